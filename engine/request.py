"""The one request-state class the engine passes between its parts."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # never admitted yet
    PREFILL = "prefill"  # computing prompt (or replaying) tokens
    DECODE = "decode"  # one token per step
    PAUSED = "paused"  # preempted: waits to be resumed from a snapshot or by replay
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos token or stop string
    LENGTH = "length"  # max_tokens or context limit
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # rejected or failed; ``error_code`` says why


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
    cache: Any = None  # PagedSequenceCache while running
    snapshot: Any = None  # HostCopy (cache/host.py) while paused with its state on the host
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # matched stop string or stop token id
    first_token_time: float | None = None
    prefill_done_time: float | None = None
    finish_time: float | None = None
    error_code: str | None = None
    times_paused: int = 0
    thinking: Any = None  # ThinkingState (engine/thinking.py) when params.thinking is set
    grammar: Any = None  # GrammarState (engine/grammar.py) when params.grammar is set, once compiled
    admitted_time: float | None = None  # when the request was first admitted
    # prompt positions where a prefix checkpoint is taken once the tokens before them are
    # computed, ascending (None: where the prompt ends; the engine sets it, empty without a cache)
    checkpoints: list[int] | None = None
    # another one where the answer ends, when the request finishes (a stop or its length): the
    # next turn of a conversation whose template renders the answer as it was generated goes on
    # from there
    checkpoint_answer: bool = True
    anchor: Any = None  # the newest progress anchor (a Checkpoint) of a long prefill, replaced as it goes
    # (request, length): the running request whose prompt starts with this one's first ``length``
    # tokens, which this one waits for to compute them once for both (False: none was found)
    shares: Any = None
    # several choices of one prompt (``n``): the first request says how many others go on from its
    # prompt (``forks``: it keeps a checkpoint where its last prompt token begins), each of those
    # names it (``fork_of``: its id) and waits for that checkpoint, so the prompt is computed once
    forks: int = 0
    fork_of: str | None = None
    cached_tokens: int = 0  # prompt tokens taken from a prefix checkpoint at admission
    reuse: dict[str, str] | None = None  # that checkpoint's tier ("gpu" | "host") and kind ("turn" | "anchor")
    # the prompt's images (``vision/media.py``: where their placeholders lie, their embeddings once
    # encoded, the prompt's M-RoPE positions and the offset of the positions after it), or None
    media: Any = None
    pooled: Any = None  # Pooled (pooling.py): the hidden states an embedding request has gathered
    # speculative decoding (``spec.py``): the tokens proposed to follow ``output_ids``, run in the
    # step the scheduler plans them for and kept as far as the model agrees; the drafter's index
    # of the sequence; drafted and accepted tokens over the request's life
    draft: list[int] = field(default_factory=list)
    ngram: Any = None
    mtp_draft: list[int] = field(default_factory=list)  # the MTP head's draft, made after the last step
    spec_drafted: int = 0
    spec_accepted: int = 0
    # drafts this request takes a round now (None: as many as the engine drafts): two more after
    # a round that kept every draft, one fewer after one that did not (``Drafter.adapt``)
    spec_len: int | None = None
    # a verify row's Gated DeltaNet states not yet settled in the slot: (VerifyRows, the row's
    # first position), while the engine commits the round (``LLMEngine._verify``)
    verify_states: Any = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key_prompt(self) -> list[int]:
        """The prompt's ids as the prefix cache compares them (images keyed by their digest:
        ``MediaPrompt.keyed``)."""
        return self.prompt_ids if self.media is None else self.media.keyed(self.prompt_ids)

    @property
    def key_ids(self) -> list[int]:
        """``all_ids`` as the prefix cache compares them (``key_prompt``)."""
        return self.all_ids if self.media is None else self.key_prompt + self.output_ids

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def decode_ready(self) -> bool:
        return bool(self.output_ids) and self.num_computed == self.num_tokens - 1

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
