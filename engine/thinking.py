"""Reasoning-token accounting, the thinking budget and the reasoning-loop guard, on the engine
thread.

A request whose prompt ends inside an open reasoning block carries a ``ThinkingControl`` in its
``SamplingParams`` (built by the frontend from the tokenizer). Every committed output token up
to and including the close token counts as a reasoning token. When ``budget`` reasoning tokens
are committed and the block is still open, the engine commits ``close_ids`` (Qwen's early-close
guidance and close marker) without sampling, then generation continues as usual: the forced
tokens are ordinary output tokens that the model reads back on its following steps.

With ``loop`` set, reasoning that repeats itself is caught as it happens: each committed token's
last ``LOOP_GRAM`` tokens are looked up among those seen before in the block; where they were
seen ``p`` tokens earlier, the block's tail is checked for ``LOOP_REPEATS`` whole repeats of
that period (at least ``LOOP_MIN_SPAN`` tokens). ``stop`` then ends the request, ``conclude``
commits ``close_ids`` as the budget does and the answer follows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request

LOOP_GRAM = 8  # tokens of the n-gram whose earlier place gives a candidate period
LOOP_REPEATS = 3  # whole repeats of the period the tail must hold
LOOP_MIN_SPAN = 64  # tokens the repeating tail covers at least (a short period repeats more)
LOOP_MAX_PERIOD = 512  # longer repeats are not looked for


@dataclass
class ThinkingState:
    open: bool = True
    reasoning_tokens: int = 0
    forced: bool = False  # the close suffix has been committed
    looped: bool = False  # the reasoning repeated itself (``loop``)
    grams: dict = field(default_factory=dict)  # last LOOP_GRAM tokens -> where they last ended


def repeating(ids: list[int], grams: dict) -> bool:
    """Whether ``ids`` (one token longer than at the last call, ``grams`` kept between calls) now
    end in ``LOOP_REPEATS`` whole repeats of one period, covering ``LOOP_MIN_SPAN`` tokens or more."""
    n = len(ids)
    if n < LOOP_GRAM:
        return False
    key = tuple(ids[n - LOOP_GRAM:])
    before, grams[key] = grams.get(key), n
    if before is None or n - before > LOOP_MAX_PERIOD:
        return False
    period = n - before
    span = max(LOOP_REPEATS * period, LOOP_MIN_SPAN)
    if span > n:
        return False
    start = n - span
    return all(ids[i] == ids[i - period] for i in range(start + period, n))


def account(req: Request, token: int) -> list[int]:
    """Count ``token`` (just committed); return tokens to commit next without sampling."""
    control = req.params.thinking
    if control is None:
        return []
    state = req.thinking
    if state is None:
        state = req.thinking = ThinkingState()
    if not state.open:
        return []
    state.reasoning_tokens += 1
    if token == control.end_id:
        state.open = False
        return []
    if control.budget is not None and not state.forced and state.reasoning_tokens >= control.budget:
        state.forced = True
        return list(control.close_ids)
    if control.loop is not None and not state.forced and repeating(req.output_ids, state.grams):
        state.looped = True
        if control.loop == "conclude":
            state.forced = True
            return list(control.close_ids)
    return []


def stops(req: Request) -> bool:
    """Whether the request ends here: its reasoning repeated itself under ``loop: stop``."""
    state = req.thinking
    return state is not None and state.looped and req.params.thinking.loop == "stop"


def looped(req: Request) -> bool:
    return req.thinking is not None and req.thinking.looped


def may_force_next(req: Request) -> bool:
    """Whether committing one more token could force the close tokens (so the token after it is
    not the model's to sample)."""
    control = req.params.thinking
    if control is None or control.budget is None:
        return False
    state = req.thinking or ThinkingState()
    return state.open and not state.forced and state.reasoning_tokens + 1 >= control.budget


def reasoning_tokens(req: Request) -> int:
    return 0 if req.thinking is None else req.thinking.reasoning_tokens
