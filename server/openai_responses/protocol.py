"""Pydantic models of Responses requests. Unknown top-level fields fail with ``unknown_parameter``;
recognised fields that ask for unsupported behaviour fail with a 400 naming the field."""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import invalid, unsupported

# ``include`` values with something to add: reasoning Items' sealed text (see sealing.py)
INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs")


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: str | None = None
    summary: str | None = None  # a hint: raw reasoning text is returned, summaries are not written
    generate_summary: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None


class _Common(BaseModel):
    """Fields shared by Create and input-token counting."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, min_length=1)  # absent: the served model
    input: Union[str, list[dict[str, Any]], None] = None
    instructions: str | None = None
    previous_response_id: str | None = None
    reasoning: Reasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    preserve_thinking: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: str | None = None
    # recognised, refused when they ask for something
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None

    def reject_common(self) -> None:
        if self.conversation is not None:
            raise unsupported("conversation", "Conversations are not available; use previous_response_id")
        if self.prompt is not None:
            raise unsupported("prompt", "stored prompt templates are not available")
        if self.context_management is not None:
            raise unsupported("context_management", "compaction is not available")
        if self.truncation not in (None, "disabled"):
            raise unsupported("truncation", "overlong input fails instead of dropping items; only 'disabled'")
        if self.text is not None:
            if self.text.verbosity not in (None, "medium"):
                raise unsupported("text.verbosity", "only 'medium'")

    @property
    def effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning else None


class ResponsesRequest(_Common):
    max_output_tokens: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    store: bool | None = True
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    thinking_budget: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(default=None, ge=0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    service_tier: str | None = None
    background: bool | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    # recognised, refused when they ask for something
    moderation: Any = None
    background_options: Any = None
    access_programs: Any = None
    image: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            if len(v) > 16:
                raise ValueError("at most 16 metadata pairs")
            if any(len(k) > 64 or len(val) > 512 for k, val in v.items()):
                raise ValueError("metadata keys are at most 64 characters and values at most 512")
        return v

    def reject_unsupported(self) -> None:
        self.reject_common()
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", "only 'auto' or 'default'")
        if self.background:
            raise unsupported("background", "background execution is not available")
        for i, value in enumerate(self.include or []):
            if value not in INCLUDABLE:
                raise unsupported(f"include[{i}]", f"only {', '.join(INCLUDABLE)} can be included")
        if self.moderation is not None:
            raise unsupported("moderation", "moderation is not available")
        for name in ("background_options", "access_programs", "image"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "'stream_options' requires 'stream': true")
        if self.prompt_cache_options is not None and \
                self.prompt_cache_options.get("mode", "implicit") not in ("implicit", "explicit"):
            raise invalid("prompt_cache_options.mode", "mode must be 'implicit' or 'explicit'")

    @property
    def top(self) -> int | None:
        """Alternatives per token when the text's log-probabilities are asked for (by ``include`` or
        a ``top_logprobs``), else None."""
        if "message.output_text.logprobs" in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    @property
    def include_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])


class InputTokensRequest(_Common):
    model: str | None = None  # optional here, as in OpenAI's API; checked when given


class RetrieveQuery(BaseModel):
    include: list[str] | None = None
    stream: bool | None = None
    starting_after: int | None = None


InputItemsOrder = Literal["asc", "desc"]
