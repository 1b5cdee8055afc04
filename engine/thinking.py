"""Reasoning-token accounting and the thinking budget, on the engine thread.

A request whose prompt ends inside an open reasoning block carries a ``ThinkingControl`` in its
``SamplingParams`` (built by the frontend from the tokenizer). Every committed output token up
to and including the close token counts as a reasoning token. When ``budget`` reasoning tokens
are committed and the block is still open, the engine commits ``close_ids`` (Qwen's early-close
guidance and close marker) without sampling, then generation continues as usual: the forced
tokens are ordinary output tokens that the model reads back on its following steps.
"""
from __future__ import annotations

from dataclasses import dataclass

from .request import Request


@dataclass
class ThinkingState:
    open: bool = True
    reasoning_tokens: int = 0
    forced: bool = False  # the close suffix has been committed


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
    return []


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
