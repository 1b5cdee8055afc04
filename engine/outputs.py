"""What the engine publishes for a request after each step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class TokenLogprob(NamedTuple):
    """One output token's log-probability and the ``top`` alternatives ``(id, logprob)``, most
    likely first (a token the engine forced, not sampled, has 0.0 and none)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    text: str = ""  # new text since the last output
    token_ids: list[int] = field(default_factory=list)  # new tokens since the last output
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asks for them
    finished: bool = False
    admitted: bool = False  # the one output saying the request has left the queue
    # on that output: seconds from submission (``Request.arrival``) to admission, by the engine's
    # clock (the admission reaches the gateway only with the first step's outputs)
    queue_time: float | None = None
    prompt_processed: int | None = None  # set on progress outputs: prompt tokens now in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reuse: dict[str, str] | None = None  # where the cached tokens came from (``Request.reuse``), final output
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # output tokens committed inside the reasoning block (cumulative)
    reasoning_loop: bool = False  # the reasoning repeated itself and was ended (``thinking.py``), final output
    embedding: list[list[float]] | None = None  # an embedding request's pooled states, final output
    error: str | None = None
    error_code: str | None = None  # e.g. "request_queue_timeout"
    # timings in seconds, filled on the final output
    prefill_time: float | None = None
    decode_time: float | None = None
    # speculative decoding, final output: tokens drafted for the request and those kept
    draft_tokens: int = 0
    draft_accepted: int = 0


def merge(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``first`` followed by ``later`` as one output: text, token ids and logprobs joined, every count,
    ending and timing the later one's (they are cumulative or final)."""
    first.text += later.text
    first.token_ids = first.token_ids + later.token_ids
    if first.logprobs is not None or later.logprobs is not None:
        first.logprobs = (first.logprobs or []) + (later.logprobs or [])
    for name in ("finished", "finish_reason", "stop_reason", "prompt_tokens", "cached_tokens", "reuse",
                 "completion_tokens", "reasoning_tokens", "reasoning_loop", "prefill_time", "decode_time",
                 "embedding", "error", "error_code", "draft_tokens", "draft_accepted"):
        setattr(first, name, getattr(later, name))
    return first
