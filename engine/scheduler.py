"""Who runs this step: FIFO admission, then a token budget per step (``max_batched_tokens``): every
decoding sequence's token first, then prompt chunks of as many prefilling requests as fit, oldest
first; preemption of the youngest request when the KV pool runs out.

The scheduler changes only queue membership, request status and cache ownership; the engine runs
the model on what it returns.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from .cache.manager import CacheManager
from .engine_config import EngineConfig
from .request import Request, Status


@dataclass
class SchedulerStats:
    preempted_snapshot: int = 0  # paused with their state copied to host memory
    preempted_replay: int = 0  # paused with their state dropped, rebuilt by replay
    restored: int = 0  # resumed from a host snapshot
    replay_restored: int = 0  # re-admitted after a pause that dropped their state
    replayed_tokens: int = 0  # tokens recomputed for dropped requests


class Scheduler:
    def __init__(self, config: EngineConfig, caches: CacheManager) -> None:
        self.config = config
        self.caches = caches
        self.waiting: list[Request] = []  # ordered by seq_no: paused requests go back in their place
        self.running: list[Request] = []  # ordered by seq_no (admission order)
        self.stats = SchedulerStats()
        self.admitted: list[Request] = []  # admitted for the first time in the last schedule()

    @property
    def num_paused(self) -> int:
        return sum(r.status is Status.PAUSED for r in self.waiting)

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.seq_no)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and give back everything it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.caches.close(req.cache)
        req.cache = None
        self.caches.discard(req.snapshot)
        req.snapshot = None

    def expired(self, now: float | None = None) -> list[Request]:
        """Never-admitted requests that waited longer than the pending timeout (removed)."""
        timeout = self.config.pending_timeout_s
        if timeout is None:
            return []
        now = time.monotonic() if now is None else now
        out = [r for r in self.waiting if r.status is Status.WAITING and now - r.arrival > timeout]
        for r in out:
            self.waiting.remove(r)
        return out

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[tuple[Request, int]]:
        self._admit()
        plan: list[tuple[Request, int]] = []
        budget = self.config.step_tokens
        for req in list(self.running):  # decode rows first, whatever the budget: decode never starves
            if req.status is Status.DECODE:  # usually one token; more after forced tokens
                n = max(1, min(req.num_uncomputed, self.config.prefill_chunk))
                if self._reserve(req, req.num_computed + n, plan):
                    plan.append((req, n))
                    budget -= n
        for req in list(self.running):  # then prompt chunks in admission order while the budget lasts
            if budget <= 0:
                break
            if req.status is Status.PREFILL:  # (not if paused above to make room)
                n = min(req.num_uncomputed, self.config.prefill_chunk, budget)
                mark = req.checkpoint_at
                if mark is not None and req.num_computed < mark < req.num_computed + n:
                    n = mark - req.num_computed  # the chunk ends where the checkpoint is taken
                if self._reserve(req, req.num_computed + n, plan):
                    plan.append((req, n))
                    budget -= n
        return plan

    def _admit(self) -> None:
        self.admitted = []
        while self.waiting and len(self.running) < self.config.max_concurrency:
            req = self.waiting[0]
            if req.snapshot is not None:
                if not self.caches.can_restore(req.snapshot):
                    return
                req.cache = self.caches.restore(req.snapshot)
                req.snapshot = None
                self.stats.restored += 1
            else:
                start = self.caches.continuation(req.all_ids)  # a prefix checkpoint to go on from
                done = 0 if start is None else start.length
                first = done + min(req.num_tokens - done, self.config.prefill_chunk)
                decoding = sum(r.status is Status.DECODE for r in self.running)
                need = self.caches.pages_needed(None, first) - done // self.caches.page_size + decoding
                if self.caches.free_slots < 1 or (self.running and need > self.caches.room()):
                    return
                req.cache, req.num_computed = self.caches.open_from(start) if start else (self.caches.open(), 0)
                done = req.num_computed
                if req.status is Status.WAITING:
                    req.cached_tokens = done
                if req.status is Status.PAUSED:
                    self.stats.replay_restored += 1
            self.waiting.pop(0)
            if req.status is Status.WAITING:
                self.admitted.append(req)
            req.status = Status.DECODE if req.decode_ready else Status.PREFILL
            bisect.insort(self.running, req, key=lambda r: r.seq_no)

    def _reserve(self, req: Request, total: int, plan: list[tuple[Request, int]]) -> bool:
        """Pages for ``total`` tokens of ``req``, pausing the youngest requests until they fit."""
        while not self.caches.reserve(req.cache, total):
            victim = self.running[-1]
            self._pause(victim)
            if victim is req:
                return False
            for i, (r, _) in enumerate(plan):
                if r is victim:
                    plan.pop(i)
                    break
        return True

    def _pause(self, req: Request) -> None:
        self.running.remove(req)
        req.snapshot = self.caches.pause(req.cache)
        req.cache = None
        if req.snapshot is None:
            self.stats.preempted_replay += 1
            self.stats.replayed_tokens += req.num_computed
            req.num_computed = 0
        else:
            self.stats.preempted_snapshot += 1
        req.status = Status.PAUSED
        req.times_paused += 1
        self.add(req)
