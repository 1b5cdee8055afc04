"""Per-request sampling and stopping parameters, validated where they are built."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .grammar import GrammarSpec
from .pooling import POOLING

MAX_LOGPROBS = 100  # the most alternatives a request may ask for at each token
MAX_LOGIT_BIAS = 100.0  # a bias's magnitude (-inf aside: that id is never chosen)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None  # None = up to the context limit
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    thinking: ThinkingControl | None = None  # the output starts inside a reasoning block
    grammar: GrammarSpec | None = None  # the output is held to it (engine/grammar.py)
    # per output token, its log-probability and those of the ``logprobs`` most likely ids (None:
    # none asked), from the raw logits (before penalties, bias and temperature); with
    # ``logprobs_after_sampling``, from the distribution the token was drawn from instead
    logprobs: int | None = None
    logprobs_after_sampling: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits; -inf: never
    # an embedding request (engine/pooling.py): none | mean | last; its output is the prompt's
    # final hidden states pooled so, and it samples nothing (max_tokens must be 0)
    pooling: str | None = None

    def __post_init__(self) -> None:
        checks = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be between 0 and 100"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be between 0 and 1"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0, "must be >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise SamplingParamError(name, f"{name} {why}, got {getattr(self, name)!r}")
        if any(not s for s in self.stop):
            raise SamplingParamError("stop", "stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SamplingParamError("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, "
                                     f"got {self.logprobs!r}")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise SamplingParamError("logit_bias", f"logit_bias token id {token} is negative")
            if not (bias == -math.inf or -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise SamplingParamError("logit_bias", f"logit_bias of token {token} must be between "
                                         f"-{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bias!r}")
        if self.pooling is not None:
            if self.pooling not in POOLING:
                raise SamplingParamError("pooling", f"pooling must be one of {', '.join(POOLING)}, got {self.pooling!r}")
            if self.max_tokens != 0:
                raise SamplingParamError("max_tokens", "an embedding request generates nothing: max_tokens must be 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class ThinkingControl:
    """Reasoning accounting for an output that starts inside an open reasoning block.

    ``end_id``: the token that closes the block (``</think>``). ``budget``: after this many
    reasoning tokens the engine commits ``close_ids`` (guidance text ending in the close marker)
    instead of sampling, then continues (``engine/thinking.py``). ``loop``: what reasoning that
    repeats itself gets: ``stop`` ends the request, ``conclude`` commits ``close_ids`` as the
    budget does (None: nothing)."""

    end_id: int
    budget: int | None = None
    close_ids: tuple[int, ...] = ()
    loop: str | None = None

    def __post_init__(self) -> None:
        if self.budget is not None and (self.budget < 1 or self.end_id not in self.close_ids):
            raise SamplingParamError("thinking_budget", "a thinking budget must be >= 1 and its close "
                                     "suffix must contain the close token")
        if self.loop not in (None, "stop", "conclude"):
            raise SamplingParamError("reasoning_loop", f"reasoning_loop must be 'stop' or 'conclude', got {self.loop!r}")
        if self.loop == "conclude" and self.end_id not in self.close_ids:
            raise SamplingParamError("reasoning_loop", "concluding a reasoning loop needs a close suffix that "
                                     "contains the close token")


class SamplingParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
