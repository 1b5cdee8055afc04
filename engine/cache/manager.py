"""Owns the KV page pool and the state-slot pool; opens, grows, pauses and closes sequence caches.

Accounting is exact: after every request has finished or been cancelled, ``idle()`` holds.
Pausing a sequence either snapshots its pages and slot to host memory (within
``host_cache_bytes``, ``host.py``) or drops them, in which case the engine rebuilds it by
replaying tokens. The same host budget holds prefix checkpoints evicted from the device
(``prefix.py``), counted apart (``host_checkpoint_bytes``): snapshots come first, and take the
room of host checkpoints (least recently used first) when they need it.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .host import HostCopy, HostTier
from .kv_pool import PagedKVPool
from .paged import PagedSequenceCache
from .prefix import Checkpoint, PrefixCache
from .state_pool import StateSlotPool


class CacheManager:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str, host_cache_bytes: int = 0,
                 checkpoints: int = 0, moving_slots: int = 0, kv_dtype: torch.dtype | None = None,
                 state_dtype: torch.dtype = torch.float32, write_slots: int | None = None,
                 ahead_slots: int = 0) -> None:
        """``num_slots`` state slots for sequences, ``checkpoints`` more for prefix checkpoints
        (at most that many are kept; ``prefix`` is None without any) and ``moving_slots`` more for
        checkpoints' copies to host in flight. KV pages hold ``kv_dtype`` (``dtype`` when None;
        fp8 / int8 with per-row scales, 4-bit with per-group ones, ``kv_quant.py``); the conv states
        ``dtype``, the recurrent states ``state_dtype``. 4-bit pools keep the exact keys of the
        page each sequence is filling in ``write_slots`` write slots of ``dtype`` (``num_slots``
        when None; a sequence opened past them writes from the rounded rows). ``ahead_slots``:
        places in the checkpoint table that the engine's idle work keeps free (``trim``)."""
        types = config.layer_types
        self.attn_ordinal = {i: n for n, i in enumerate(i for i, t in enumerate(types) if t == "full_attention")}
        self.gdn_ordinal = {i: n for n, i in enumerate(i for i, t in enumerate(types) if t == "linear_attention")}
        self.kv = PagedKVPool(len(self.attn_ordinal), num_pages, page_size, config.num_key_value_heads,
                              config.head_dim, kv_dtype or dtype, device,
                              num_slots if write_slots is None else write_slots, dtype) if self.attn_ordinal else None
        self.states = StateSlotPool(len(self.gdn_ordinal), num_slots + checkpoints + moving_slots,
                                    *state_shapes(config), dtype, device, state_dtype) if self.gdn_ordinal else None
        self.host_cache_bytes = host_cache_bytes  # for snapshots and host checkpoints together
        self.host_bytes_used = 0  # the snapshots'
        self.host = HostTier(self.kv, self.states, host_cache_bytes, torch.device(device)) \
            if host_cache_bytes and (self.kv is not None or self.states is not None) else None
        self.prefix = PrefixCache(self.kv, self.states, checkpoints, self.host,
                                  lambda: self.host_cache_bytes - self.host_bytes_used,
                                  moving_slots) if checkpoints else None
        self.ahead_slots = ahead_slots
        self.padding_page: int | None = None  # held for padded rows of captured decode graphs
        self.padding_slot: int | None = None

    # ------------------------------------------------------------------ accounting
    @property
    def page_size(self) -> int:
        return self.kv.page_size if self.kv else 1

    @property
    def free_pages(self) -> int:
        self._settle()
        return self.kv.num_free if self.kv else 1 << 30

    @property
    def free_slots(self) -> int:
        """Free slots, those of checkpoints' copies to host still in flight (waited for when
        taken) and those of the checkpoints beyond their number (evicted when taken)."""
        self._settle()
        spare = self.prefix.moving_slots + self.prefix.over if self.prefix is not None else 0
        return self.states.num_free + spare if self.states else 1 << 30

    @property
    def host_checkpoint_bytes(self) -> int:
        return self.prefix.host_bytes if self.prefix is not None else 0

    def grow_host(self) -> bool:
        """Pin one more slab of host memory ahead of need, if the budget wants one (a pause of up
        to a few hundred milliseconds: the engine calls it only while it has no work); whether
        it did."""
        return self.host is not None and self.host.arena.grow()

    def _settle(self) -> None:
        if self.prefix is not None:
            self.prefix.settle()

    def pages_needed(self, cache: PagedSequenceCache | None, total_tokens: int) -> int:
        if self.kv is None:
            return 0
        have = len(cache.pages) if cache is not None else 0
        return max(self.kv.pages_for(total_tokens) - have, 0)

    def room(self) -> int:
        """Pages a sequence can have: the free ones and those only checkpoints hold (evicted for
        it), or their copies to host in flight (given back when done)."""
        if self.kv is None:
            return 1 << 30
        if self.prefix is None:
            return self.kv.num_free
        self.prefix.settle()
        holds = self.prefix.page_holds()
        return self.kv.num_free + sum(self.kv.holders(p) == n for p, n in holds.items())

    def has_room(self, pages: int) -> bool:
        """Whether a sequence can have ``pages`` pages (``room``); the pages only checkpoints
        hold are counted only where the free ones fall short (a walk over every page they hold)."""
        return self.kv is None or pages <= self.kv.num_free or pages <= self.room()

    def idle(self) -> bool:
        """Nothing is held but the padding and the prefix checkpoints (exactly): the device ones'
        pages and slots (with those of their copies to host in flight); host ones hold neither,
        and no snapshot is left."""
        self._settle()
        kept_pages = len(self.prefix.pages_held()) if self.prefix is not None else 0
        kept_slots = self.prefix.slots_held() if self.prefix is not None else 0
        pages_ok = self.kv is None or \
            self.kv.num_free == self.kv.num_pages - (self.padding_page is not None) - kept_pages
        slots_ok = self.states is None or \
            self.states.num_free == self.states.num_slots - (self.padding_slot is not None) - kept_slots
        return pages_ok and slots_ok and self.host_bytes_used == 0

    def reserve_padding(self) -> tuple[int, int]:
        """One page and one slot that padded batch rows may scribble on (``-1`` where a pool is absent)."""
        if self.padding_page is None and self.kv is not None:
            self.padding_page = self.kv.allocate(1)[0]
        if self.padding_slot is None and self.states is not None:
            self.padding_slot = self.states.acquire()
        return (-1 if self.padding_page is None else self.padding_page,
                -1 if self.padding_slot is None else self.padding_slot)

    @property
    def no_write_slot(self) -> int:
        """The KV write slot of rows without one (padding, a sequence past the pool's slots):
        one no write reads."""
        return self.kv.no_write_slot if self.kv is not None else 0

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> PagedSequenceCache:
        cache = PagedSequenceCache(self.kv, self.states)
        if self.kv is not None:
            cache.kv_slot = self.kv.take_write_slot()
        if self.states is not None:
            if self.prefix is not None:
                self.prefix.want(slots=1)  # a checkpoint's copy to host may still hold one
            cache.slot = self.states.acquire()
        return cache

    def open_from(self, start: Checkpoint) -> tuple[PagedSequenceCache, int]:
        """A cache for a sequence that continues from checkpoint ``start``, and the tokens it has
        so: a host checkpoint promoted to the device first, then the checkpoint's whole pages
        shared, its partly filled last page copied (the sequence writes past the checkpoint into
        it), its GDN states copied into the sequence's slot. A fresh cache and 0 where no room is
        left for the promotion or the copy."""
        cache = self.open()
        from_host = start.host is not None
        if from_host and not self.prefix.promote(start):
            return cache, 0
        if start.slot is not None:
            self.states.copy(start.slot, cache.slot)  # queued now: while room is made, the checkpoint may go
        if self.kv is not None:
            whole = start.length // self.kv.page_size
            held = self.kv.share(start.pages)  # while room is made, the checkpoint may go
            if start.length % self.kv.page_size:
                if not self._make_room(1):
                    self.kv.release(held)
                    self.close(cache)  # its slot has the checkpoint's states
                    return self.open(), 0
                page = self.kv.allocate(1)[0]
                self.kv.copy_page(held[whole], page)
                cache.pages = held[:whole] + [page]
                self.kv.release(held[whole:])
            else:
                cache.pages = held
        cache.origin = start
        if from_host:
            self.prefix.hits_host += 1
        else:
            self.prefix.hits_gpu += 1
        return cache, start.length

    def shared_pages(self, start: Checkpoint) -> int:
        """KV pages a continuation from ``start`` gets without taking any: a device checkpoint's
        whole pages; none from a host one (its pages are taken when it is promoted)."""
        return 0 if self.kv is None or start.host is not None else start.length // self.kv.page_size

    def reserve(self, cache: PagedSequenceCache, total_tokens: int) -> bool:
        """Make room for ``total_tokens`` tokens (dropping checkpoints as needed); False (and
        nothing taken) when pages run out."""
        need = self.pages_needed(cache, total_tokens)
        if need > self.free_pages and not self._make_room(need):
            return False
        if need:
            cache.pages.extend(self.kv.allocate(need))
        return True

    def _make_room(self, pages: int) -> bool:
        """Evict least recently used device checkpoints (to host memory, or dropped) until
        ``pages`` pages are free; whether they are."""
        if self.prefix is not None:
            return self.prefix.want(pages=pages)
        return self.kv.num_free >= pages

    def checkpoint(self, cache: PagedSequenceCache, tokens: list[int], last: bool = False) -> Checkpoint | None:
        """Keep the sequence's state after ``tokens`` (all computed) as a prefix checkpoint; the
        checkpoint, or None where none was kept (held already, or no room). ``last``: the
        sequence ends here (its request has finished), so its state slot becomes the
        checkpoint's, uncopied (``PrefixCache.add``'s ``adopt``; ``trim`` evicts for it later)."""
        if self.prefix is None:
            return None
        entry = self.prefix.add(tokens, cache.pages, cache.slot, adopt=last)
        if entry is not None:
            if cache.origin is not None:
                cache.origin.covered = True  # the sequence went on past it: ``PrefixCache.evict_one``
            cache.origin = entry
            if last:
                cache.slot = None
        return entry

    # evictions ahead of need per call of ``trim(ahead=True)``: the engine's idle work comes in
    # short turns, between which it takes the requests that have arrived
    AHEAD_EVICTIONS = 4

    def trim(self, ahead: bool = False, most: int | None = None) -> int:
        """Evict the device checkpoints beyond their number (``PrefixCache.trim``); with
        ``ahead`` (the engine is idle, or runs a decode step) a few more (``most``, by default
        ``AHEAD_EVICTIONS``), until ``ahead_slots`` of the table are free, as long as each moves
        to host memory at once (none dropped ahead of need, no wait for a copy in flight): a
        burst of new prompts then keeps its checkpoints without evicting any in its steps. How
        many went."""
        if self.prefix is None:
            return 0
        if not ahead:
            return self.prefix.trim()
        return self.prefix.trim(self.ahead_slots, self.AHEAD_EVICTIONS if most is None else most, keep=True)

    def drop(self, entry: Checkpoint | None) -> None:
        """Give up a checkpoint that is no longer wanted (a progress anchor superseded)."""
        if self.prefix is not None:
            self.prefix.remove(entry)

    def continuation(self, tokens: list[int]) -> Checkpoint | None:
        """The longest checkpoint, on the device or the host, a sequence of ``tokens`` can continue from."""
        return None if self.prefix is None else self.prefix.longest(tokens)

    def close(self, cache: PagedSequenceCache | None) -> None:
        if cache is None:
            return
        if self.kv is not None and cache.pages:
            self.kv.release(cache.pages)
        if self.kv is not None and cache.kv_slot is not None:
            self.kv.give_write_slot(cache.kv_slot)
            cache.kv_slot = None
        if self.states is not None and cache.slot is not None:
            self.states.release(cache.slot)
            cache.slot = None

    # ------------------------------------------------------------------ pausing
    def pause(self, cache: PagedSequenceCache) -> HostCopy | None:
        """Free the cache's device resources; a host snapshot when the budget allows (host
        checkpoints dropped for its room), else None. The copy is queued and the pages and slot
        given back at once: what is queued next waits for the copy on the GPU."""
        snap = None
        if self.host is not None:
            state = self.states is not None
            need = self.host.nbytes(len(cache.pages), state)
            if self.host_bytes_used + need <= self.host_cache_bytes:
                if self.prefix is not None:
                    self.prefix.shrink_host(self.host_cache_bytes - self.host_bytes_used - need)
                room = self.host.take(len(cache.pages), state)
                while room is None and self.prefix is not None and self.prefix.shrink_host(self.prefix.host_bytes - 1):
                    room = self.host.take(len(cache.pages), state)  # (no free run of the size: more go)
                if room is not None:
                    snap = self.host.to_host(room, cache.pages, cache.slot)
                    self.host.wait_on_device(snap.event)
                    self.host_bytes_used += snap.nbytes
        self.close(cache)
        return snap

    def can_restore(self, snap: HostCopy) -> bool:
        """Whether a snapshot's pages fit, counting those only prefix checkpoints hold (given up for it)."""
        return self.has_room(snap.num_pages) and (self.states is None or self.free_slots > 0)

    def restore(self, snap: HostCopy) -> PagedSequenceCache:
        cache = self.open()
        if self.kv is not None:
            self._make_room(snap.num_pages)
            cache.pages = self.kv.allocate(snap.num_pages)
        self.host.to_device(snap, cache.pages, cache.slot)
        self.discard(snap)
        return cache

    def discard(self, snap: HostCopy | None) -> None:
        if snap is not None and self.host is not None:
            self.host_bytes_used -= snap.nbytes
            self.host.give(snap)


def state_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    conv = (config.linear_conv_kernel_dim - 1, 2 * key_dim + value_dim)
    recurrent = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    return conv, recurrent


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype, page_size: int = 16) -> int:
    """Bytes of one token's K/V over every attention layer with pages of ``dtype`` (scales
    included; 4-bit pages' key ranges per page of ``page_size`` tokens, rounded up a token)."""
    n_attn = sum(t == "full_attention" for t in config.layer_types)
    per_page = PagedKVPool.bytes_per_page(n_attn, page_size, config.num_key_value_heads, config.head_dim, dtype)
    return -(-per_page // page_size)
