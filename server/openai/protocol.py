"""Pydantic models for OpenAI Chat Completions requests, and their translation to engine types."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...engine.sampling_params import SamplingParams
from ..errors import APIError, unsupported
from ..state import SamplingDefaults


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = None
    enable_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # fields of the OpenAI API that this server does not implement yet: only neutral values pass
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Union[str, list[str], None]) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def reject_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise unsupported("n", "only one choice per request")
        if self.logprobs:
            raise unsupported("logprobs")
        if self.top_logprobs:
            raise unsupported("top_logprobs")
        if self.tools:
            raise unsupported("tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise unsupported("tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise unsupported("response_format", "only {'type': 'text'}")
        for i, m in enumerate(self.messages):
            if m.role in ("tool", "function") or m.tool_calls:
                raise unsupported(f"messages[{i}]", "tool messages and tool calls")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' requires 'stream': true", "stream_options", "invalid_value")

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            if m.reasoning_content:
                msg["reasoning_content"] = m.reasoning_content
            out.append(msg)
        return out

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def sampling_params(self, defaults: SamplingDefaults) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=defaults.repetition_penalty if self.repetition_penalty is None
            else self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            stop=list(self.stop or []),
        )
