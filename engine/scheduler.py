"""Who runs this step: FIFO admission, then a token budget per step (``max_batched_tokens``): every
decoding sequence's token first, then prompt chunks of as many prefilling requests as fit, oldest
first, fewer beside decode rows where the step would keep them waiting too long (``pace.py``);
preemption of the youngest request when the KV pool runs out. With a drafter
(speculative decoding, ``spec.py``) a decoding request's row also carries its draft, as far as
the budget and the pool allow.

The scheduler changes only queue membership, request status and cache ownership; the engine runs
the model on what it returns.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from .cache.manager import CacheManager
from .engine_config import EngineConfig
from .pace import StepPace
from .request import Request, Status


@dataclass
class SchedulerStats:
    preempted_snapshot: int = 0  # paused with their state copied to host memory
    preempted_replay: int = 0  # paused with their state dropped, rebuilt by replay
    restored: int = 0  # resumed from a host snapshot
    replay_restored: int = 0  # re-admitted after a pause that dropped their state
    replayed_tokens: int = 0  # tokens recomputed for dropped requests


class Scheduler:
    def __init__(self, config: EngineConfig, caches: CacheManager, drafter=None, pace: StepPace | None = None) -> None:
        self.config = config
        self.caches = caches
        self.drafter = drafter  # spec.Drafter when speculative decoding is on
        self.pace = pace  # caps the prompt tokens of a step with decode rows (pace.py)
        self.undrafted = 0  # decoding rows of the last schedule() that could have carried a draft and did not
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
        if self.drafter is not None:
            budget = self._drafts(plan, budget)
        if plan and self.pace is not None:  # prompt tokens beside decode rows: within the gap they may wait
            first = sum(r.status is Status.PREFILL for r in self.running) + len(self.waiting)
            budget = min(budget, self.pace.prompt_tokens(len(plan), first))
        for req in list(self.running):  # then prompt chunks in admission order while the budget lasts
            if budget <= 0:
                break
            if req.status is Status.PREFILL:  # (not if paused above to make room)
                n = self._cut(req, min(req.num_uncomputed, self.config.prefill_chunk, budget))
                if self._reserve(req, req.num_computed + n, plan):
                    plan.append((req, n))
                    budget -= n
        return plan

    def _drafts(self, plan: list[tuple[Request, int]], budget: int) -> int:
        """Give the decoding rows of ``plan`` (each with its one uncomputed token) their drafts,
        in admission order, while the step's budget lasts and pages are free without pausing
        anyone (a draft that does not fit is shortened or left out); the budget left."""
        self.undrafted = 0
        for i, (req, n) in enumerate(plan):
            req.draft = []
            if n != 1 or not req.decode_ready:
                continue
            draft = self.drafter.propose(req)[: max(budget, 0)]
            while draft and not self.caches.reserve(req.cache, req.num_computed + 1 + len(draft)):
                draft = draft[: len(draft) // 2]
            if not draft:
                self.undrafted += self.drafter.eligible(req)
                continue
            req.draft = draft
            plan[i] = (req, 1 + len(draft))
            budget -= len(draft)
        return budget

    def _cut(self, req: Request, n: int) -> int:
        """``n`` prompt tokens of ``req``, or fewer so that the chunk ends where the next of its
        checkpoints, or of its progress anchors, is taken."""
        start = req.num_computed
        for mark in req.checkpoints or ():
            if start < mark < start + n:
                n = mark - start
                break
        every = self.config.progress_anchor
        if every and self.caches.prefix is not None:
            anchor = (start // every + 1) * every
            if anchor < min(start + n, len(req.prompt_ids)):
                n = anchor - start
        return n

    def _admit(self) -> None:
        """Admit waiting requests in order while there is room; one that waits for a prompt prefix
        another request is computing (``_waits_for_prefix``) lets those behind it go first."""
        self.admitted = []
        i = 0
        while i < len(self.waiting) and len(self.running) < self.config.max_concurrency:
            req = self.waiting[i]
            if req.status is Status.WAITING and self._waits_for_prefix(req):
                i += 1
                continue
            if req.snapshot is not None:
                if not self.caches.can_restore(req.snapshot):
                    return
                req.cache = self.caches.restore(req.snapshot)
                req.snapshot = None
                self.stats.restored += 1
            else:
                # a prefix checkpoint to go on from (not for embeddings: they pool every prompt token)
                start = None if req.pooled is not None else self.caches.continuation(req.key_ids)
                done = 0 if start is None else start.length
                first = done + min(req.num_tokens - done, self.config.prefill_chunk)
                decoding = sum(r.status is Status.DECODE for r in self.running)
                need = self.caches.pages_needed(None, first) - (self.caches.shared_pages(start) if start else 0) + decoding
                if self.caches.free_slots < 1 or (self.running and not self.caches.has_room(need)):
                    return
                tier = "host" if start is not None and start.host is not None else "gpu"
                req.cache, req.num_computed = self.caches.open_from(start) if start else (self.caches.open(), 0)
                done = req.num_computed
                if done and start.anchor:  # a prefill resumed: its anchor is this request's now
                    req.anchor = start
                if req.status is Status.WAITING:
                    req.cached_tokens = done
                    req.reuse = {"tier": tier, "kind": "anchor" if start.anchor else "turn"} if done else None
                if req.status is Status.PAUSED:
                    self.stats.replay_restored += 1
            self.waiting.pop(i)
            if req.status is Status.WAITING:
                self.admitted.append(req)
            req.status = Status.DECODE if req.decode_ready else Status.PREFILL
            bisect.insort(self.running, req, key=lambda r: r.seq_no)

    # the shortest shared prompt prefix worth a wait: below it, computing it twice costs less
    # than a step of waiting
    SHARED_PREFIX_MIN = 256

    def _waits_for_prefix(self, req: Request) -> bool:
        """Whether ``req`` waits for a running request that is computing the start of its prompt
        (an orchestrator's subagents sent together with one long system prompt): the first time
        it is asked, the running prompt that shares the longest prefix with it (at least
        ``SHARED_PREFIX_MIN`` tokens, not yet computed that far) gets a checkpoint there, and
        ``req`` waits until it is taken, then goes on from it. Another choice of one prompt
        (``Request.fork_of``) waits the same way for its first choice's checkpoint."""
        if req.shares is None:
            req.shares = False
            if req.fork_of is not None and self.caches.prefix is not None:
                # another choice of the same prompt: it goes on from where the first one's last
                # prompt token begins (a checkpoint the first keeps, ``Request.forks``)
                first = next((r for r in self.running if r.request_id == req.fork_of), None)
                n = len(req.prompt_ids) - 1
                if first is not None and n > 0 and first.key_prompt == req.key_prompt and n in first.checkpoints:
                    req.shares = (first, n)
            elif self.caches.prefix is not None and req.pooled is None and len(req.prompt_ids) > self.SHARED_PREFIX_MIN:
                best = 0
                for other in self.running:
                    if other.status is Status.PREFILL:
                        n = min(common_prefix(req.key_prompt, other.key_prompt), len(req.prompt_ids) - 1)
                        if n >= self.SHARED_PREFIX_MIN and n > best and other.num_computed < n:
                            best, req.shares = n, (other, n)
                if req.shares:
                    other, n = req.shares
                    if n not in other.checkpoints:
                        bisect.insort(other.checkpoints, n)
        if not req.shares:
            return False
        other, n = req.shares
        if other.status is Status.PREFILL and other.num_computed < n and any(r is other for r in self.running):
            return True
        req.shares = False  # computed (or the other gone): admitted as any other
        return False

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
        req.draft = []  # (a row paused after its draft was given: it runs no step now)
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


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with alike (slices compared in C, bisected)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
