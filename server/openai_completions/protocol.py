"""Pydantic model of a legacy Completions request (raw prompt, no chat template)."""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import invalid, unsupported
from ..generation import Sampling
from ..logprobs import openai_logit_bias
from ..state import ServerState
from ..structured import request_grammar
from ..openai_common import normalize_stops, reject_unsupported_sampling

DEFAULT_MAX_TOKENS = 16  # the legacy API's documented default


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # absent: the served model (as local servers take it)
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=0)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=20)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    n: int | None = Field(default=None, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # constrained decoding, by its common names
    response_format: dict[str, Any] | None = None
    grammar: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    guided_decoding_backend: Any = None
    json_schema: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Union[str, list[str], None]) -> list[str]:
        return normalize_stops(v)

    def reject_unsupported(self) -> None:
        reject_unsupported_sampling(self)
        if self.best_of not in (None, 1):
            raise unsupported("best_of", "one candidate per request")
        if self.suffix:
            raise unsupported("suffix", "insertion (fill-in-the-middle) is not supported")
        if self.logprobs is not None and self.echo:
            raise unsupported("logprobs", "with 'echo': the prompt's log-probabilities are not computed")

    def one_prompt(self) -> str | list[int]:
        """The single prompt: a string or token ids (a batch of several is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise unsupported("prompt", "one prompt per request")
            p = p[0]
        if isinstance(p, list) and not p:
            raise invalid("prompt", "the prompt is empty")
        return p

    def sampling(self, state: ServerState) -> Sampling:
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        seed=self.seed, max_tokens=self.max_tokens, stop=list(self.stop or []),
                        logprobs=self.logprobs, logit_bias=openai_logit_bias(state, self.logit_bias),
                        grammar=request_grammar(self, self.response_format))
