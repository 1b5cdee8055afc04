"""The one request-state class the engine passes between its parts."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from .cache.sequence import SequenceCache
from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos token or stop string
    LENGTH = "length"  # max_tokens or context limit
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"


_ids = itertools.count()


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # context limit for prompt + output
    eos_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.monotonic)
    seq_no: int = field(default_factory=lambda: next(_ids))  # FIFO order
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose effect is in the cache
    cache: SequenceCache | None = None
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # matched stop string or stop token id
    first_token_time: float | None = None
    prefill_done_time: float | None = None
    finish_time: float | None = None
    cancelled: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_prompt_remaining(self) -> int:
        return max(len(self.prompt_ids) - self.num_computed, 0)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        if self.status is Status.FINISHED:
            return
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
        self.cache = None
