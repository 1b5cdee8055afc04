"""Pydantic models of the llama.cpp server endpoints we implement, and their engine translation.

Fields follow llama.cpp's names (``n_predict``, ``repeat_penalty``, ``seed: -1`` for random).
A ``prompt`` is a string, token ids mixed with strings (one prompt), or a list of those (a batch:
one result each, in a list); ``response_fields`` picks (nested, ``a/b``) fields of the answer.
Unknown fields are refused by name, as on the OpenAI surface; a few llama.cpp options that only
tune its own cache or slot choice (``cache_prompt``, ``id_slot``) are accepted and have no effect
on the output.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...engine.sampling_params import MAX_LOGPROBS, SamplingParams
from ..errors import invalid, unsupported
from ..state import SamplingDefaults
from ..structured import request_grammar


PromptParts = list[Union[int, str]]  # token ids and texts, in order: one prompt


def prompt_list(prompt: Union[str, list[Any]]) -> tuple[list[PromptParts], bool]:
    """``(prompts, batch)``: llama.cpp's reading of a ``prompt`` field. A string, or a list of
    token ids (strings may be mixed in), is one prompt; a list of strings, or of lists, is a
    batch whose items are each a string or a list of ids and strings."""
    if isinstance(prompt, str):
        return [[prompt]], False
    kinds = set(map(type, prompt))  # in C: a returning conversation's prompt is 30,000 ids
    if any(issubclass(k, int) for k in kinds) and not any(issubclass(k, list) for k in kinds):
        return [list(prompt)], False
    prompts = []
    for i, item in enumerate(prompt):
        if isinstance(item, int):
            raise ValueError(f"prompt[{i}]: a batch of prompts holds strings or lists of token ids, not a bare id")
        prompts.append([item] if isinstance(item, str) else list(item))
    return prompts, True


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Union[str, list[Union[int, str, list[Union[int, str]]]]]
    response_fields: list[str] | None = None  # only these fields of the answer ("a/b": nested), named by path
    n_predict: int | None = Field(default=None, ge=-1)  # -1: until eos or the context limit
    max_tokens: int | None = Field(default=None, ge=-1)  # alias of n_predict, as llama.cpp accepts
    stream: bool = False
    stop: list[str] = Field(default_factory=list)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_k: int | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None  # -1 or absent: a fresh random seed
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    return_tokens: bool = False  # the ids are always returned; kept for llama.cpp clients
    cache_prompt: bool = True  # prompt reuse is the engine's business
    id_slot: int = -1  # lanes are assigned by the scheduler
    # completions of the one prompt (llama-server's n_cmpl; n as OpenAI names it): with more than
    # one, the answer is a list of results, each with its index, and stream chunks name theirs
    n_cmpl: int | None = Field(default=None, ge=1)
    n: int | None = Field(default=None, ge=1)
    n_probs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)  # per token, its probability and the n best
    post_sampling_probs: bool = False  # probabilities after the sampling chain, not the raw logits' log-softmax
    logit_bias: Union[list[Any], dict[str, Any], None] = None  # [[token, bias], ...] or {token: bias}
    grammar: str | None = None  # GBNF ("" = none)
    json_schema: dict[str, Any] | None = None
    model: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Union[str, list[Any]]) -> Union[str, list[Any]]:
        if not v:
            raise ValueError("the prompt must not be empty")
        return v

    @field_validator("response_fields")
    @classmethod
    def _fields(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not f.strip("/") for f in v):
            raise ValueError("a response field must name a field")
        return v

    def reject_unsupported(self) -> None:
        if self.n is not None and self.n_cmpl is not None and self.n != self.n_cmpl:
            raise invalid("n_cmpl", f"'n_cmpl' ({self.n_cmpl}) and 'n' ({self.n}) differ")

    @property
    def choices(self) -> int | None:
        return self.n_cmpl if self.n_cmpl is not None else self.n

    def budget(self, default: int | None) -> int | None:
        """Output tokens: ``n_predict`` (or ``max_tokens``); -1 runs to eos or the context limit;
        absent takes the server's ``--default-max-tokens``."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        if n is None:
            return default
        return None if n < 0 else n

    def sampling_params(self, defaults: SamplingDefaults, default_max_tokens: int | None = None,
                        logit_bias: dict[int, float] | None = None) -> SamplingParams:
        """``logit_bias``: this request's, resolved to ids (``server/logprobs.llamacpp_logit_bias``)."""
        return SamplingParams(
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=defaults.repetition_penalty if self.repeat_penalty is None else self.repeat_penalty,
            seed=None if self.seed is None or self.seed < 0 else self.seed & ((1 << 64) - 1),
            max_tokens=self.budget(default_max_tokens),
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            logprobs=self.n_probs or None,
            logprobs_after_sampling=self.post_sampling_probs,
            logit_bias=logit_bias or {},
            grammar=request_grammar(self),
        )


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    content: str
    add_special: bool = False  # prepend the BOS token where the model's texts start with one
    parse_special: bool = True  # special tokens written in the text are recognised
    with_pieces: bool = False

    def reject_unsupported(self) -> None:
        if not self.parse_special:
            raise unsupported("parse_special", "special tokens in the text are always recognised")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[int]


class ApplyTemplateRequest(BaseModel):
    """A Chat Completions body (``model`` optional): other fields are validated by the chat
    request model itself, so the prompt is rendered exactly as ``/v1/chat/completions`` would."""

    model_config = ConfigDict(extra="allow")

    messages: list[Any] = Field(min_length=1)
    model: str | None = None


class ExtraChunkModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str
    filename: str = "tmp"


class InfillRequest(CompletionRequest):
    """llama.cpp's ``/infill``: the text before the gap (``input_prefix``), after it
    (``input_suffix``), other files of the project (``input_extra``), and a ``prompt`` that goes
    on from the prefix (may be empty); every ``/completion`` sampling field besides."""

    prompt: Union[str, list[Union[int, str]]] = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunkModel] = Field(default_factory=list)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Union[str, list[Union[int, str]]]) -> Union[str, list[Union[int, str]]]:
        return v  # empty: the model goes on from the prefix alone
