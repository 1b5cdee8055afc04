"""Prefix checkpoints: a conversation that returns continues from where its last prompt ended.

A checkpoint is a sequence's state at one exact position ``n``: the token ids before it, the KV
pages that cover them (held, shared with whoever continues from it) and, for hybrid models, every
Gated DeltaNet layer's conv and recurrent state at ``n``, copied into a state slot of its own
(the recurrent state exists only at positions where it was saved: no block grid, no minimum
length). A new prompt is matched against the checkpoints by longest exact token prefix, shorter
than the prompt (its last token must run to give logits): a checkpoint is keyed by its length and
its last ``KEY_TAIL`` ids, so a lookup hashes a few ids per length kept, not the prompt, and the
ids themselves (compared in C) confirm a candidate.

Two tiers, a checkpoint in exactly one of them. At most ``max_entries`` are on the device; the
least recently used one goes when its slot or pages are wanted, or for a newer one (for a
slot or a place, one that a longer checkpoint covers first: ``evict_one``). Where a
request's answer ends (it has finished) its state slot becomes the checkpoint's as it is, and the
table may hold more until the engine trims it (``trim``), which it does while the device runs the
next step or while it has none: no step waits for those evictions. While idle it trims a few
places further (``CacheManager.trim``), so that the next burst of prompts finds room. It moves to
host memory when the host budget has room for it (``host_room``: the budget shared with paused
requests' snapshots, which come first; ``host.py``), else it is dropped: the KV rows of its pages
and its state slot are copied into an extent of host memory, and its pages and slot go back to the
pools. On CUDA the copy runs on a side stream behind the work queued so far, and the pages and
slot go back once its event has completed (``settle``), or at once, with the GPU told to wait for
the copy, where they are wanted sooner: the host never waits. A few state slots beyond the
checkpoints' own are kept for copies in flight (``moving_slots``); an eviction while they are all
in flight drops its checkpoint rather than wait (a burst of new conversations evicting each
other's first checkpoints). On a CPU the copy is done at once. Host checkpoints are matched like
device ones and hold no page or slot; the least recently used go when the budget is short. One
a request goes on from is promoted (``promote``): pages and a slot taken, evicting device
checkpoints, its tensors copied back, and it is a device checkpoint again. Nothing outlives the
process.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from .host import HostCopy, HostTier
from .kv_pool import PagedKVPool
from .state_pool import StateSlotPool


KEY_TAIL = 64  # the ids a key is made of, besides the length: those just before the position


def key_of(tokens: list[int], length: int) -> int:
    """The key of ``tokens[:length]``: its length and its last ``KEY_TAIL`` ids. Prefixes that
    share both share a key (the newer one keeps it); the cost of a key does not grow with the
    prefix, which a returning conversation resends whole every turn."""
    return hash((length, tuple(tokens[max(length - KEY_TAIL, 0) : length])))


_order = itertools.count()


@dataclass
class Checkpoint:
    tokens: list[int]  # the ids before the checkpoint's position
    pages: list[int]  # the KV pages covering them (the last one partly, if the length is not whole pages)
    slot: int | None  # the state slot holding the GDN states at that position (None: no GDN layers, or on the host)
    key: int = 0  # its key in the table (``key_of`` its tokens)
    used: int = field(default_factory=lambda: next(_order))  # recency
    host: HostCopy | None = None  # set while it is in host memory (no pages, no slot)
    anchor: bool = False  # a long prefill's progress anchor (engine.py): whoever resumes from it takes it on
    covered: bool = False  # a sequence went on past it and kept a longer checkpoint (where its answer ended)

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    def __init__(self, kv: PagedKVPool | None, states: StateSlotPool | None, max_entries: int,
                 host: HostTier | None = None, host_room: Callable[[], int] = lambda: 0,
                 moving_slots: int = 0) -> None:
        """At most ``max_entries`` checkpoints on the device; ``host``: the host tier (None: none),
        ``host_room()`` the host bytes checkpoints may hold now; ``moving_slots``: state slots
        kept for copies to host in flight (an eviction beyond them drops its checkpoint)."""
        self.kv = kv
        self.states = states
        self.max_entries = max_entries
        self.host = host
        self.host_room = host_room
        self.moving_limit = moving_slots
        self.page_size = kv.page_size if kv is not None else 1
        self._entries: dict[int, Checkpoint] = {}  # on the device, least recently used first
        self._host: dict[int, Checkpoint] = {}  # in host memory; a key is in one table at most
        self._lengths: dict[int, int] = {}  # length -> how many checkpoints (of both tiers) have it
        # copies to host in flight, oldest first: their event, and the pages and slot they give back
        self._moving: list[tuple[torch.cuda.Event, list[int], int | None]] = []
        self._keep: Checkpoint | None = None  # the host checkpoint being promoted: not dropped for room
        self.page_bytes = 0 if kv is None else kv.page_bytes
        self.slot_bytes = 0 if states is None else \
            states.conv[:, 0].numel() * states.conv.element_size() + \
            states.recurrent[:, 0].numel() * states.recurrent.element_size()
        self.host_kv_bytes = 0  # the data the host checkpoints hold
        self.host_state_bytes = 0
        self.host_bytes = 0  # the host memory they take (their extents)
        self.hits_gpu = 0  # requests that went on from a device checkpoint
        self.hits_host = 0  # from a host checkpoint (promoted)
        self.evicted_host = 0  # device checkpoints moved to host memory
        self.evicted_dropped = 0  # ... dropped (no host room, or every slot for copies in flight taken)
        self.copy_waits = 0  # times the GPU was told to wait for a copy to host in flight, to reuse its pages or slot

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

    def host_cost(self, length: int) -> int:
        """The host memory a checkpoint of ``length`` tokens takes."""
        if self.host is None:
            return 0
        return self.host.nbytes(-(-length // self.page_size) if self.kv is not None else 0, self.states is not None)

    def page_holds(self) -> dict[int, int]:
        """Page -> how many holds device checkpoints and copies in flight have on it (lists are
        copied in one call each: the gauges read this from another thread)."""
        holds: dict[int, int] = {}
        for pages in [e.pages for e in self.entries] + [m[1] for m in list(self._moving)]:
            for p in list(pages):
                holds[p] = holds.get(p, 0) + 1
        return holds

    def pages_held(self) -> set[int]:
        """The pages device checkpoints and copies in flight hold (one set, built in C)."""
        return set(itertools.chain.from_iterable([e.pages for e in self.entries] + [m[1] for m in list(self._moving)]))

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
        for n in sorted((n for n in self._lengths if n < len(tokens)), reverse=True):
            key = key_of(tokens, n)
            entry = self._entries.get(key) or self._host.get(key)
            if entry is not None and entry.tokens == tokens[:n]:
                entry.used = next(_order)
                table = self._entries if entry.host is None else self._host
                table[key] = table.pop(key)  # the tables run from least to most recently used
                return entry
        return None

    # ------------------------------------------------------------------ taking and dropping
    def add(self, tokens: list[int], pages: list[int], slot: int | None, adopt: bool = False) -> Checkpoint | None:
        """Keep a checkpoint of ``tokens`` whose state is in ``slot`` (a request's) and whose KV
        is in ``pages``: the pages are shared, the state copied into a slot of the checkpoint's
        own, the least recently used checkpoint evicted first where the table is full. With
        ``adopt`` (a request that has finished: its slot, if it has one, is given up to the
        checkpoint) the slot itself is kept, nothing copied and nothing evicted now: the table may hold more than
        ``max_entries`` until ``trim``. None (nothing kept, nothing adopted) when it is on the
        device already or no slot can be had."""
        if not tokens or self.max_entries < 1:
            return None
        key = key_of(tokens, len(tokens))
        existing = self._entries.get(key) or self._host.get(key)
        if existing is not None:
            if existing.tokens == tokens and existing.host is None:
                return None
            self._drop(existing)  # other ids under the same hash, or its host copy: the newer one stays
        own = slot if adopt else None
        if not adopt and len(self._entries) >= self.max_entries:
            self.evict_one()
        if self.states is not None and not adopt:
            if not self.want(slots=1):
                return None
            own = self.states.acquire(clear=False)
            self.states.copy(slot, own)
        held = [] if self.kv is None else self.kv.share(pages[: -(-len(tokens) // self.page_size)])
        entry = Checkpoint(list(tokens), held, own, key)
        self._entries[key] = entry
        self._lengths[entry.length] = self._lengths.get(entry.length, 0) + 1
        return entry

    @property
    def over(self) -> int:
        """Device checkpoints beyond ``max_entries`` (adopted since the last ``trim``)."""
        return max(len(self._entries) - self.max_entries, 0)

    def trim(self, below: int = 0, most: int | None = None, keep: bool = False) -> int:
        """Evict least recently used device checkpoints until at most ``max_entries - below``
        are left, at most ``most`` of them (the engine calls this while the device runs a step,
        or while it has none); with ``keep`` only while each can move to host memory at once
        (none dropped, the host never waiting for a copy). How many went."""
        n = 0
        while len(self._entries) > max(self.max_entries - below, 0) and (most is None or n < most):
            if not self.evict_one(keep):
                break
            n += 1
        return n

    def evict_one(self, keep: bool = False, covered_first: bool = True) -> bool:
        """Move the least recently used device checkpoint to host memory, or drop it where the
        host budget has no room for it or as many copies to host as the slots kept for them are
        in flight already (it is copied from its own pages and slot, which come back when the copy
        is done: no wait); False when there is none, or (``keep``) when it would be dropped.
        With ``covered_first`` (a place or a slot wanted, not pages) the least recently used of
        those a longer checkpoint covers goes before any other: a conversation returns to where
        its last answer ended, not to where the prompt before it did, and the longer one holds
        the same pages (evicting a covered one frees its slot and place, no page)."""
        if not self._entries:
            return False
        # the table runs from least to most recently used
        entry = next((e for e in self._entries.values() if e.covered), None) if covered_first else None
        entry = entry or next(iter(self._entries.values()))
        self.settle()
        if entry.slot is not None and self._moving and self.moving_slots >= self.moving_limit:
            if keep:
                return False
            self._drop(entry)
            self.evicted_dropped += 1
            return True
        room = self._host_room_for(len(entry.pages), entry.used)
        if room is None:
            if keep:
                return False
            self._drop(entry)
            self.evicted_dropped += 1
            return True
        self.evicted_host += 1
        del self._entries[entry.key]
        pages, slot = entry.pages, entry.slot
        entry.host, entry.pages, entry.slot = self.host.to_host(room, pages, slot), [], None
        self._host[entry.key] = entry
        self._count_host(entry.host, 1)
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
        self._keep = entry
        try:
            if len(self._entries) >= self.max_entries:
                self.evict_one()
            if not self.want(host.num_pages, 1 if self.states is not None else 0):
                return False
        finally:
            self._keep = None
        entry.pages = self.kv.allocate(host.num_pages) if self.kv is not None else []
        entry.slot = self.states.acquire(clear=False) if self.states is not None else None
        self.host.to_device(host, entry.pages, entry.slot)
        del self._host[entry.key]
        self._count_host(host, -1)
        self.host.give(host)
        entry.host = None
        entry.used = next(_order)
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
        self.settle(wait=True)

    def shrink_host(self, limit: int) -> bool:
        """Drop least recently used host checkpoints until they hold at most ``limit`` bytes;
        whether they do."""
        while self.host_bytes > limit:
            if not self._drop_oldest_host():
                return False
        return True

    def _drop_oldest_host(self, older_than: int | None = None) -> bool:
        """Drop the least recently used host checkpoint (one used before ``older_than``, if given);
        whether there was one."""
        oldest = min((e for e in self._host.values() if e is not self._keep), key=lambda e: e.used, default=None)
        if oldest is None or (older_than is not None and oldest.used > older_than):
            return False
        self._drop(oldest)
        return True

    def _host_room_for(self, pages: int, used: int) -> HostCopy | None:
        """Host memory for a copy of ``pages`` pages and a slot: room in the budget made by
        dropping host checkpoints used less recently than ``used``; None where there is none."""
        if self.host is None:
            return None
        nbytes = self.host.nbytes(pages, self.states is not None)
        if nbytes > self.host_room():
            return None
        while True:
            if self.host_bytes + nbytes <= self.host_room():
                room = self.host.take(pages, self.states is not None)
                if room is not None:
                    return room
            if not self._drop_oldest_host(used):  # (or no free run of the size left between them)
                return None

    def _count_host(self, copy: HostCopy, sign: int) -> None:
        self.host_kv_bytes += sign * copy.kv_bytes
        self.host_state_bytes += sign * copy.state_bytes
        self.host_bytes += sign * copy.nbytes

    def _drop(self, entry: Checkpoint) -> None:
        table = self._entries if entry.host is None else self._host
        del table[entry.key]
        self._lengths[entry.length] -= 1
        if not self._lengths[entry.length]:
            del self._lengths[entry.length]
        if entry.host is not None:
            self._count_host(entry.host, -1)
            self.host.give(entry.host)
            entry.host = None
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
        completed give theirs back; while short, the oldest one in flight gives them back at once
        (what is queued next waits for it on the GPU, the host does not), then least recently
        used device checkpoints go; whether they are free."""
        self.settle()
        while (self.kv is not None and self.kv.num_free < pages) or \
                (self.states is not None and self.states.num_free < slots):
            if self._moving:
                event, held, slot = self._moving.pop(0)
                self.host.wait_on_device(event)
                self.copy_waits += 1
                self._release(held, slot)
            elif not self.evict_one(covered_first=self.kv is None or self.kv.num_free >= pages):
                return False
        return True

    def settle(self, wait: bool = False) -> None:
        """Give the pools back the pages and slots of the copies to host that have completed
        (with ``wait``: all of them, the host waiting). They complete in order: one stream."""
        while self._moving and (wait or self._moving[0][0].query()):
            event, pages, slot = self._moving.pop(0)
            if wait:
                event.synchronize()
            self._release(pages, slot)
