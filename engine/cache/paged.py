"""A sequence's hold on the shared pools: its block table (KV pages) and its state slot.

Layers read and write the pools themselves through the step's ``StepMeta``; this object is what
the cache manager hands out, grows, pauses and takes back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .kv_pool import PagedKVPool
from .state_pool import StateSlotPool

if TYPE_CHECKING:
    from .prefix import Checkpoint


class PagedSequenceCache:
    def __init__(self, kv: PagedKVPool | None, states: StateSlotPool | None) -> None:
        self.kv = kv
        self.states = states
        self.pages: list[int] = []  # block table
        self.slot: int | None = None  # how far it is filled is the request's one cursor, ``num_computed``
        self.kv_slot: int | None = None  # its write slot in the KV pool (exact 4-bit keys), if any
        self.origin: Checkpoint | None = None  # the last checkpoint on its way: it went on from it, or kept it

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else len(self.pages) * self.kv.page_size
