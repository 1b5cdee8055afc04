"""A sequence's view of the shared pools: the same calls as ``SequenceCache``, backed by pages and a slot."""
from __future__ import annotations

import torch

from .kv_pool import PagedKVPool
from .state_pool import StateSlotPool


class _SlotStates:
    """``states[layer]`` reads / writes one GDN layer's state in the sequence's slot."""

    def __init__(self, storage: torch.Tensor, ordinal: dict[int, int], cache: "PagedSequenceCache") -> None:
        self._storage, self._ordinal, self._cache = storage, ordinal, cache

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._storage[self._ordinal[layer], self._cache.slot]

    def __setitem__(self, layer: int, value: torch.Tensor) -> None:
        dest = self._storage[self._ordinal[layer], self._cache.slot]
        if value.data_ptr() != dest.data_ptr():
            dest.copy_(value)


class PagedSequenceCache:
    def __init__(self, kv: PagedKVPool | None, states: StateSlotPool | None,
                 attn_ordinal: dict[int, int], gdn_ordinal: dict[int, int]) -> None:
        self.kv = kv
        self.states = states
        self._attn = attn_ordinal
        self.pages: list[int] = []  # block table
        self.slot: int | None = None
        self.num_tokens = 0  # tokens whose effect is in the cache; the model's forward advances it
        if states is not None:
            self.conv_states = _SlotStates(states.conv, gdn_ordinal, self)
            self.recurrent_states = _SlotStates(states.recurrent, gdn_ordinal, self)

    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else len(self.pages) * self.kv.page_size

    def kv_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's key and value pages of ``layer`` ``[num_pages, P, Hkv, D]``."""
        a = self._attn[layer]
        return self.kv.keys[a], self.kv.values[a]

    def _check_room(self, end: int) -> None:
        if end > self.capacity:
            raise RuntimeError(f"KV pages for {self.capacity} tokens, writing up to {end}: reserve first")

    def write_rows(self, count: int, device: torch.device) -> torch.Tensor:
        """Flat pool rows (``page * P + offset``) of the next ``count`` positions, on ``device``."""
        self._check_room(self.num_tokens + count)
        return self.kv.flat_rows(self.pages, self.num_tokens, count, device)

    def gather_kv(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` keys/values of ``layer`` ``[length, Hkv, D]``."""
        return self.kv.gather(self._attn[layer], self.pages, length)

    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[t, Hkv, D]`` at positions ``num_tokens ..``; return all keys/values so far."""
        end = self.num_tokens + k.shape[0]
        self._check_room(end)
        a = self._attn[layer]
        self.kv.write(a, self.pages, self.num_tokens, k, v)
        if self.num_tokens == 0:  # nothing older: the new keys are all of them
            return k.to(self.kv.keys.dtype), v.to(self.kv.values.dtype)
        return self.kv.gather(a, self.pages, end)
