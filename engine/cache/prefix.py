"""Prefix checkpoints: a conversation that returns continues from where its last prompt ended.

A checkpoint is a sequence's state at one exact position ``n``: the token ids before it, the KV
pages that cover them (held, shared with whoever continues from it) and, for hybrid models, every
Gated DeltaNet layer's conv and recurrent state at ``n``, copied into a state slot of its own
(the recurrent state exists only at positions where it was saved: no block grid, no minimum
length). A new prompt is matched against the checkpoints by longest exact token prefix, shorter
than the prompt (its last token must run to give logits): a hash chain over whole pages finds
candidates, the token ids confirm them. Least recently used checkpoints go first when their
slots or pages are wanted.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

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


@dataclass
class Checkpoint:
    tokens: list[int]  # the ids before the checkpoint's position
    pages: list[int]  # the KV pages covering them (the last one partly, if the length is not whole pages)
    slot: int | None  # the state slot holding the GDN states at that position (None: no GDN layers)
    used: int = field(default_factory=lambda: next(_order))  # recency

    @property
    def length(self) -> int:
        return len(self.tokens)


class PrefixCache:
    def __init__(self, kv: PagedKVPool | None, states: StateSlotPool | None, max_entries: int) -> None:
        self.kv = kv
        self.states = states
        self.max_entries = max_entries
        self.page_size = kv.page_size if kv is not None else 1
        self._entries: dict[int, Checkpoint] = {}
        self._lengths: dict[int, int] = {}  # length -> how many checkpoints have it

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Checkpoint]:
        return list(self._entries.values())

    def pages_held(self) -> set[int]:
        return {p for e in self.entries for p in list(e.pages)}

    # ------------------------------------------------------------------ lookup
    def longest(self, tokens: list[int]) -> Checkpoint | None:
        """The longest checkpoint whose ids are a prefix of ``tokens`` and shorter than them."""
        lengths = sorted((n for n in self._lengths if n < len(tokens)), reverse=True)
        if not lengths:
            return None
        links = chain(tokens, self.page_size, lengths[0])
        for n in lengths:
            entry = self._entries.get(key_of(tokens, n, self.page_size, links))
            if entry is not None and entry.tokens == tokens[:n]:
                entry.used = next(_order)
                return entry
        return None

    # ------------------------------------------------------------------ taking and dropping
    def add(self, tokens: list[int], pages: list[int], slot: int | None) -> Checkpoint | None:
        """Keep a checkpoint of ``tokens`` whose state is in ``slot`` (a request's) and whose KV
        is in ``pages``: the pages are shared, the state copied into a slot of the checkpoint's
        own. None (nothing kept) when it is held already or no slot can be had."""
        if not tokens or self.max_entries < 1:
            return None
        key = key_of(tokens, len(tokens), self.page_size, chain(tokens, self.page_size, len(tokens)))
        existing = self._entries.get(key)
        if existing is not None:
            if existing.tokens == tokens:
                return None
            self._drop(key, existing)  # other ids under the same hash: the newer one stays
        own = None
        if self.states is not None:
            if len(self._entries) >= self.max_entries or self.states.num_free == 0:
                if not self.evict_one():
                    return None
            own = self.states.acquire()
            self.states.copy(slot, own)
        elif len(self._entries) >= self.max_entries:
            self.evict_one()
        held = [] if self.kv is None else self.kv.share(pages[: -(-len(tokens) // self.page_size)])
        entry = Checkpoint(list(tokens), held, own)
        self._entries[key] = entry
        self._lengths[entry.length] = self._lengths.get(entry.length, 0) + 1
        return entry

    def evict_one(self) -> bool:
        """Drop the least recently used checkpoint; False when there is none."""
        if not self._entries:
            return False
        key, entry = min(self._entries.items(), key=lambda kv: kv[1].used)
        self._drop(key, entry)
        return True

    def clear(self) -> None:
        for key, entry in list(self._entries.items()):
            self._drop(key, entry)

    def _drop(self, key: int, entry: Checkpoint) -> None:
        del self._entries[key]
        self._lengths[entry.length] -= 1
        if not self._lengths[entry.length]:
            del self._lengths[entry.length]
        if self.kv is not None:
            self.kv.release(entry.pages)
        if entry.slot is not None:
            self.states.release(entry.slot)
