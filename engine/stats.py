"""Engine-wide work counters: written by the engine thread only, read lock-free by the gateway.

Every field a reader touches is a plain int or an immutable tuple, so another thread always sees
a whole value and a scrape never waits for the engine. Token accounting follows one rule each:

- ``prompt_tokens`` / ``cached_tokens``: a request's full prompt, and the part already in cache,
  counted once when it is first admitted;
- ``prefill_tokens``: prompt tokens computed for the first time (cache hits excluded);
- ``replayed_tokens``: tokens recomputed to rebuild a request whose state was dropped by a pause;
- ``generation_tokens``: every committed output token; ``decode_tokens``: those after each
  request's first (the first comes from prefill).

``window(n)`` sums prefill / generated tokens over the last ``n`` whole seconds from a ring of
per-second buckets, which is what live throughput is computed from.
"""
from __future__ import annotations

import time
from typing import Iterable

from .request import Request, Status

RING_SECONDS = 128


class EngineCounters:
    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_tokens = 0
        self.replayed_tokens = 0
        self.generation_tokens = 0
        self.decode_tokens = 0
        self.admitted_requests = 0
        self.images_encoded = 0  # images run through the vision tower (not those inside a reused prefix)
        # speculative decoding (stays off and zero until a drafter exists): rounds of draft +
        # verify, drafted and accepted tokens, steps decoded without drafts, and per draft
        # position the rounds in which that position was accepted (a new tuple each update)
        self.spec_enabled = False
        self.spec_rounds = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_fallback_steps = 0
        self.spec_accepted_by_position: tuple[int, ...] = ()
        self._frontier: dict[str, int] = {}  # request id -> highest position ever computed
        self._ring: list[tuple[int, int, int]] = [(-1, 0, 0)] * RING_SECONDS  # (second, prefill, generated)

    def __getstate__(self) -> dict:
        """What another process reads (``snapshot.py``): the totals and the ring, not which
        request has computed how far."""
        state = dict(self.__dict__)
        state["_frontier"] = {}
        return state

    # ------------------------------------------------------------------ engine thread
    def scheduled(self, admitted: Iterable[Request], plan: Iterable[tuple[Request, int]]) -> None:
        """Account a step's plan before it runs (``num_computed`` not yet advanced)."""
        for req in admitted:
            self.admitted_requests += 1
            self.prompt_tokens += len(req.prompt_ids)
            self.cached_tokens += req.num_computed
            self._frontier[req.request_id] = req.num_computed
        fresh_total = 0
        for req, n in plan:
            start, end = req.num_computed, req.num_computed + n
            frontier = self._frontier.get(req.request_id, start)
            self._frontier[req.request_id] = max(frontier, end)
            if req.status is not Status.PREFILL:
                continue
            self.replayed_tokens += max(min(end, frontier) - start, 0)
            fresh_total += max(min(end, len(req.prompt_ids)) - max(start, frontier), 0)
        if fresh_total:
            self.prefill_tokens += fresh_total
            self._bump(fresh_total, 0)

    def committed(self, req: Request) -> None:
        """One output token was appended to ``req``."""
        self.generation_tokens += 1
        if len(req.output_ids) > 1:
            self.decode_tokens += 1
        self._bump(0, 1)

    def finished(self, req: Request) -> None:
        self._frontier.pop(req.request_id, None)

    def _bump(self, prefill: int, generated: int) -> None:
        sec = int(time.monotonic())
        i = sec % RING_SECONDS
        s, p, g = self._ring[i]
        self._ring[i] = (sec, p + prefill, g + generated) if s == sec else (sec, prefill, generated)

    # ------------------------------------------------------------------ any thread
    def window(self, seconds: int, now: float | None = None) -> tuple[int, int]:
        """(prefill tokens, generated tokens) over the last ``seconds`` whole seconds."""
        seconds = min(seconds, RING_SECONDS - 1)
        current = int(time.monotonic() if now is None else now)
        prefill = generated = 0
        for sec in range(current - seconds, current):
            s, p, g = self._ring[sec % RING_SECONDS]
            if s == sec:
                prefill += p
                generated += g
        return prefill, generated
