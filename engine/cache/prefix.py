"""Prefix checkpoints: a conversation that returns continues from where its last prompt ended.

A checkpoint is a sequence's state at one exact position ``n``: the token ids before it, the KV
pages that cover them (held, shared with whoever continues from it) and, for hybrid models, every
Gated DeltaNet layer's conv and recurrent state at ``n``, copied into a state slot of its own
(the recurrent state exists only at positions where it was saved: no block grid, no minimum
length). A new prompt is matched against the checkpoints by longest exact token prefix, shorter
than the prompt (its last token must run to give logits): a hash chain over whole pages finds
candidates, the token ids confirm them.

Two tiers, a checkpoint in exactly one of them. At most ``max_entries`` are on the device; the
least recently used one goes when its slot or pages are wanted, or for a newer one. It moves to
host memory when the host budget has room for it (``host_room``: the budget shared with paused
requests' snapshots, which come first), else it is dropped: the KV rows of its pages and its
state slot are copied into host tensors, and its pages and slot go back to the pools. On CUDA
the copy runs on a side stream behind the work queued so far, into pinned memory, and the pages
and slot go back once its event has completed (``settle``, whenever pages or slots are wanted);
on a CPU at once. Host checkpoints are matched like device ones and hold no page or slot; the
least recently used go when the budget is short. One a request goes on from is promoted
(``promote``): pages and a slot taken, evicting device checkpoints, its tensors copied back, and
it is a device checkpoint again. Nothing outlives the process.
"""
from __future__ import annotations

import itertools
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from .kv_pool import PagedKVPool
from .state_pool import StateSlotPool


def chain(tokens: list[int], page_size: int, upto: int) -> list[int]:
    """``chain[i]``: the hash of ``tokens[: i * page_size]`` (``chain[0]`` of nothing), for the
    whole pages of the first ``upto`` tokens."""
    out = [0]
    for i in range(upto // page_size):
        out.append(hash((out[-1], tuple(tokens[i * page_size : (i + 1) * page_size]))))
    return out


def key_of(tokens: list[int], length: int, page_size: int, links: list[int]) -> int:
    """The key of ``tokens[:length]``: its whole pages' chain, then the tokens of its last part."""
    whole = length // page_size
    return hash((links[whole], tuple(tokens[whole * page_size : length])))


_order = itertools.count()


@dataclass(eq=False)
class HostCopy:
    """A host checkpoint's state: the KV rows of the pages that covered it, its GDN states."""

    keys: torch.Tensor | None  # [L_attn, pages, P, Hkv, D]
    values: torch.Tensor | None
    conv: torch.Tensor | None  # [L_gdn, W-1, C]
    recurrent: torch.Tensor | None  # [L_gdn, Hv, K, V]
    kv_bytes: int
    state_bytes: int
    event: torch.cuda.Event | None = None  # recorded after the copy from the device (CUDA only)


@dataclass
class Checkpoint:
    tokens: list[int]  # the ids before the checkpoint's position
    pages: list[int]  # the KV pages covering them (the last one partly, if the length is not whole pages)
    slot: int | None  # the state slot holding the GDN states at that position (None: no GDN layers, or on the host)
    key: int = 0  # its key in the table (``key_of`` its tokens)
    used: int = field(default_factory=lambda: next(_order))  # recency
    host: HostCopy | None = None  # set while it is in host memory (no pages, no slot)
    anchor: bool = False  # a long prefill's progress anchor (engine.py): whoever resumes from it takes it on

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    def __init__(self, kv: PagedKVPool | None, states: StateSlotPool | None, max_entries: int,
                 host_room: Callable[[], int] = lambda: 0) -> None:
        """At most ``max_entries`` checkpoints on the device; ``host_room()``: the host bytes
        checkpoints may hold now (0: no host tier)."""
        self.kv = kv
        self.states = states
        self.max_entries = max_entries
        self.host_room = host_room
        self.page_size = kv.page_size if kv is not None else 1
        self._entries: dict[int, Checkpoint] = {}  # on the device
        self._host: dict[int, Checkpoint] = {}  # in host memory; a key is in one table at most
        self._lengths: dict[int, int] = {}  # length -> how many checkpoints (of both tiers) have it
        # copies to host in flight, oldest first: their event, and the pages and slot they give back
        self._moving: list[tuple[torch.cuda.Event, list[int], int | None]] = []
        self._keep: Checkpoint | None = None  # the host checkpoint being promoted: not dropped for room
        self._stream: torch.cuda.Stream | None = None  # the side stream of the copies (CUDA)
        pool = kv.keys if kv is not None else states.conv if states is not None else None
        self.device = pool.device if pool is not None else torch.device("cpu")
        self.page_bytes = 0 if kv is None else 2 * kv.keys[:, 0].numel() * kv.keys.element_size()
        self.slot_bytes = 0 if states is None else \
            states.conv[:, 0].numel() * states.conv.element_size() + \
            states.recurrent[:, 0].numel() * states.recurrent.element_size()
        self.host_kv_bytes = 0  # what the host checkpoints hold
        self.host_state_bytes = 0
        self.hits_gpu = 0  # requests that went on from a device checkpoint
        self.hits_host = 0  # from a host checkpoint (promoted)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Checkpoint]:
        """The device checkpoints."""
        return list(self._entries.values())

    @property
    def host_entries(self) -> list[Checkpoint]:
        return list(self._host.values())

    @property
    def num_host(self) -> int:
        return len(self._host)

    @property
    def host_bytes(self) -> int:
        return self.host_kv_bytes + self.host_state_bytes

    def page_holds(self) -> dict[int, int]:
        """Page -> how many holds device checkpoints and copies in flight have on it (lists are
        copied in one call each: the gauges read this from another thread)."""
        holds: dict[int, int] = {}
        for pages in [e.pages for e in self.entries] + [m[1] for m in list(self._moving)]:
            for p in list(pages):
                holds[p] = holds.get(p, 0) + 1
        return holds

    def pages_held(self) -> set[int]:
        return set(self.page_holds())

    def slots_held(self) -> int:
        """State slots the device checkpoints and copies in flight hold."""
        return sum(e.slot is not None for e in self._entries.values()) + self.moving_slots

    @property
    def moving_slots(self) -> int:
        return sum(m[2] is not None for m in self._moving)

    # ------------------------------------------------------------------ lookup
    def longest(self, tokens: list[int]) -> Checkpoint | None:
        """The longest checkpoint, of either tier, whose ids are a prefix of ``tokens`` and shorter
        than them."""
        lengths = sorted((n for n in self._lengths if n < len(tokens)), reverse=True)
        if not lengths:
            return None
        links = chain(tokens, self.page_size, lengths[0])
        for n in lengths:
            key = key_of(tokens, n, self.page_size, links)
            entry = self._entries.get(key) or self._host.get(key)
            if entry is not None and entry.tokens == tokens[:n]:
                entry.used = next(_order)
                return entry
        return None

    # ------------------------------------------------------------------ taking and dropping
    def add(self, tokens: list[int], pages: list[int], slot: int | None) -> Checkpoint | None:
        """Keep a checkpoint of ``tokens`` whose state is in ``slot`` (a request's) and whose KV
        is in ``pages``: the pages are shared, the state copied into a slot of the checkpoint's
        own. None (nothing kept) when it is on the device already or no slot can be had."""
        if not tokens or self.max_entries < 1:
            return None
        key = key_of(tokens, len(tokens), self.page_size, chain(tokens, self.page_size, len(tokens)))
        existing = self._entries.get(key) or self._host.get(key)
        if existing is not None:
            if existing.tokens == tokens and existing.host is None:
                return None
            self._drop(existing)  # other ids under the same hash, or its host copy: the newer one stays
        if len(self._entries) >= self.max_entries:
            self.evict_one()
        own = None
        if self.states is not None:
            if not self.want(slots=1):
                return None
            own = self.states.acquire()
            self.states.copy(slot, own)
        held = [] if self.kv is None else self.kv.share(pages[: -(-len(tokens) // self.page_size)])
        entry = Checkpoint(list(tokens), held, own, key)
        self._entries[key] = entry
        self._lengths[entry.length] = self._lengths.get(entry.length, 0) + 1
        return entry

    def evict_one(self) -> bool:
        """Move the least recently used device checkpoint to host memory, or drop it where the
        host budget has no room for it; False when there is none."""
        if not self._entries:
            return False
        entry = min(self._entries.values(), key=lambda e: e.used)
        if not self._host_fits(len(entry.pages) * self.page_bytes + self.slot_bytes, entry.used):
            self._drop(entry)
            return True
        del self._entries[entry.key]
        pages, slot = entry.pages, entry.slot
        entry.host, entry.pages, entry.slot = self._to_host(pages, slot), [], None
        self._host[entry.key] = entry
        self.host_kv_bytes += entry.host.kv_bytes
        self.host_state_bytes += entry.host.state_bytes
        if entry.host.event is None:
            self._release(pages, slot)
        else:
            self._moving.append((entry.host.event, pages, slot))
        return True

    def promote(self, entry: Checkpoint) -> bool:
        """Bring host checkpoint ``entry`` back to the device: pages and a slot taken (evicting
        device checkpoints), its tensors copied in; False (it stays on the host) where no room can
        be had or it is no longer kept."""
        if self._host.get(entry.key) is not entry:
            return False
        host = entry.host
        pages = 0 if host.keys is None else host.keys.shape[1]
        self._keep = entry
        try:
            if len(self._entries) >= self.max_entries:
                self.evict_one()
            if not self.want(pages, 1 if self.states is not None else 0):
                return False
        finally:
            self._keep = None
        entry.pages = self.kv.allocate(pages) if self.kv is not None else []
        entry.slot = self.states.acquire() if self.states is not None else None
        self._to_device(host, entry.pages, entry.slot)
        del self._host[entry.key]
        self.host_kv_bytes -= host.kv_bytes
        self.host_state_bytes -= host.state_bytes
        entry.host = None
        self._entries[entry.key] = entry
        return True

    def remove(self, entry: Checkpoint | None) -> None:
        """Drop ``entry`` if it is still kept (it may have been evicted or replaced since)."""
        if entry is not None and (self._entries.get(entry.key) is entry or self._host.get(entry.key) is entry):
            self._drop(entry)

    def clear(self) -> None:
        """Drop every checkpoint of both tiers; every page, slot and host byte goes back."""
        for entry in self.entries + self.host_entries:
            self._drop(entry)
        while self._moving:
            self.settle(wait=True)

    def shrink_host(self, limit: int) -> bool:
        """Drop least recently used host checkpoints until they hold at most ``limit`` bytes;
        whether they do."""
        while self.host_bytes > limit:
            oldest = min((e for e in self._host.values() if e is not self._keep), key=lambda e: e.used, default=None)
            if oldest is None:
                return False
            self._drop(oldest)
        return True

    def _host_fits(self, nbytes: int, used: int) -> bool:
        """Room in the host budget for ``nbytes`` more, made by dropping host checkpoints used
        less recently than ``used``; whether there is."""
        room = self.host_room()
        if nbytes > room:
            return False
        while self.host_bytes + nbytes > room:
            oldest = min((e for e in self._host.values() if e is not self._keep), key=lambda e: e.used, default=None)
            if oldest is None or oldest.used > used:
                return False
            self._drop(oldest)
        return True

    def _drop(self, entry: Checkpoint) -> None:
        table = self._entries if entry.host is None else self._host
        del table[entry.key]
        self._lengths[entry.length] -= 1
        if not self._lengths[entry.length]:
            del self._lengths[entry.length]
        if entry.host is not None:
            self.host_kv_bytes -= entry.host.kv_bytes
            self.host_state_bytes -= entry.host.state_bytes
            entry.host = None  # (pinned memory a copy still writes is kept until it is done)
        else:
            self._release(entry.pages, entry.slot)

    def _release(self, pages: list[int], slot: int | None) -> None:
        if self.kv is not None:
            self.kv.release(pages)
        if slot is not None:
            self.states.release(slot)

    # ------------------------------------------------------------------ pages and slots
    def want(self, pages: int = 0, slots: int = 0) -> bool:
        """Make ``pages`` KV pages and ``slots`` state slots free: the copies to host that have
        completed give theirs back, then (while short) the oldest one in flight is waited for, then
        least recently used device checkpoints go; whether they are free."""
        self.settle()
        while (self.kv is not None and self.kv.num_free < pages) or \
                (self.states is not None and self.states.num_free < slots):
            if self._moving:
                self.settle(wait=True)
            elif not self.evict_one():
                return False
        return True

    def settle(self, wait: bool = False) -> None:
        """Give the pools back the pages and slots of the copies to host that have completed
        (with ``wait``: after waiting for the oldest). They complete in order: one stream."""
        if wait and self._moving:
            self._moving[0][0].synchronize()
        while self._moving and self._moving[0][0].query():
            _, pages, slot = self._moving.pop(0)
            self._release(pages, slot)

    # ------------------------------------------------------------------ copies between the tiers
    def _side(self) -> tuple[torch.cuda.Stream | None, object]:
        """The side stream (CUDA; None on a CPU), made to wait for the work queued so far, and a
        context that runs on it."""
        if self.device.type != "cuda":
            return None, nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stream, torch.cuda.stream(self._stream)

    def _to_host(self, pages: list[int], slot: int | None) -> HostCopy:
        """Copies of ``pages``' KV rows and ``slot``'s states in host memory: on CUDA queued on the
        side stream into pinned memory (their event set), on a CPU done."""
        stream, on_side = self._side()
        pinned = stream is not None

        def fetch(src: torch.Tensor) -> torch.Tensor:
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
            return out.copy_(src, non_blocking=pinned)

        with on_side:
            keys = values = conv = recurrent = None
            if self.kv is not None:
                idx = torch.tensor(pages, dtype=torch.long, device=self.device)
                keys, values = fetch(self.kv.keys[:, idx]), fetch(self.kv.values[:, idx])
            if slot is not None:
                conv, recurrent = fetch(self.states.conv[:, slot]), fetch(self.states.recurrent[:, slot])
        copy = HostCopy(keys, values, conv, recurrent, len(pages) * self.page_bytes,
                        0 if slot is None else self.slot_bytes)
        if stream is not None:
            copy.event = torch.cuda.Event()
            copy.event.record(stream)
        return copy

    def _to_device(self, host: HostCopy, pages: list[int], slot: int | None) -> None:
        """``host``'s tensors into ``pages`` and ``slot``: on CUDA from pinned memory on the side
        stream (behind its own copy to host, if that is still in flight), the current stream
        waiting for it before anything that reads them."""
        stream, on_side = self._side()
        pinned = stream is not None
        with on_side:
            if host.event is not None:
                stream.wait_event(host.event)
            if self.kv is not None:
                idx = torch.tensor(pages, dtype=torch.long, device=self.device)
                self.kv.keys[:, idx] = host.keys.to(self.device, non_blocking=pinned)
                self.kv.values[:, idx] = host.values.to(self.device, non_blocking=pinned)
            if slot is not None:
                self.states.conv[:, slot] = host.conv.to(self.device, non_blocking=pinned)
                self.states.recurrent[:, slot] = host.recurrent.to(self.device, non_blocking=pinned)
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
            torch.cuda.current_stream(self.device).wait_event(done)
