"""Pydantic models of a Chat Completions request, its checks, and its translation to engine terms.

Unknown top-level fields are ignored (as OpenAI-compatible servers do); fields whose behaviour
this server cannot provide are refused with a 400 naming the field when they ask for it, and
accepted at their neutral values.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import invalid, unsupported
from ..generation import Sampling
from ..logprobs import openai_logit_bias
from ..media import image_part
from ..state import ServerState
from ..structured import request_grammar
from ..openai_common import (FunctionTool, ToolUse, callable_tools, function_tool, normalize_stops,
                             reject_unsupported_sampling, unique_names)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCallHistory(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"


class ToolCallHistory(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallHistory


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallHistory] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCallHistory | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    audio: Any = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    include_obfuscation: bool | None = None


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # absent: the served model (as local servers take it)
    messages: list[ChatMessage] = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0, le=20)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = None
    # reasoning
    reasoning_effort: str | None = None
    enable_thinking: bool | None = None
    preserve_thinking: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = Field(default=None, ge=1)
    # tools
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Union[str, dict[str, Any], None] = None
    # llama.cpp-style observations
    timings_per_token: bool = False
    return_progress: bool = False
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, Any] | None = None
    # accepted at their neutral values only
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    verbosity: str | None = None
    store: bool | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: Any = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # advisory hints
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    # constrained decoding under its other names: refused by name
    grammar: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    json_schema: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Union[str, list[str], None]) -> list[str]:
        return normalize_stops(v)

    # ------------------------------------------------------------------ checks
    def reject_unsupported(self) -> None:
        """400 for every field that asks for behaviour this server cannot provide."""
        reject_unsupported_sampling(self)
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise unsupported("modalities", "text output only")
        if self.verbosity not in (None, "medium"):
            raise unsupported("verbosity", "only 'medium'")
        if self.store:
            raise unsupported("store", "chat completions are not stored")
        if self.web_search_options is not None:
            raise unsupported("web_search_options", "web search is not available")
        if self.moderation is not None:
            raise unsupported("moderation", "moderation is not available")
        if self.mm_processor_kwargs and any(v is not None for v in self.mm_processor_kwargs.values()):
            raise unsupported("mm_processor_kwargs", "no multimodal processor is loaded")
        if self.functions:
            raise unsupported("functions", "legacy function definitions; declare them in 'tools'")
        if self.function_call not in (None, "none", "auto"):
            raise unsupported("function_call", "legacy function choice")
        if self.return_progress and not self.stream:
            raise invalid("return_progress", "'return_progress' requires 'stream': true")
        for i, m in enumerate(self.messages):
            self._check_message(i, m)

    def _check_message(self, i: int, m: ChatMessage) -> None:
        at = f"messages[{i}]"
        if m.name and m.role not in ("tool", "function"):
            raise unsupported(f"{at}.name", "participant names cannot be represented by the chat template")
        if m.audio is not None:
            raise unsupported(f"{at}.audio", "audio is not supported")
        if m.role != "assistant" and (m.tool_calls or m.function_call or m.reasoning_content or m.reasoning):
            field = "tool_calls" if m.tool_calls else "function_call" if m.function_call else "reasoning_content"
            raise invalid(f"{at}.{field}", f"'{field}' belongs to assistant messages")
        if m.role == "function" and not m.name:
            raise invalid(f"{at}.name", "a legacy function result needs the function's name")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                self._check_part(f"{at}.content[{j}]", m.role, part)

    @staticmethod
    def _check_part(at: str, role: str, part: ContentPart) -> None:
        extra = part.model_extra or {}
        if part.type == "text":
            if part.text is None:
                raise invalid(f"{at}.text", "a text part needs 'text'")
        elif part.type == "refusal" and role == "assistant":
            if part.refusal is None:
                raise invalid(f"{at}.refusal", "a refusal part needs 'refusal'")
        elif part.type == "image_url" and role in ("user", "system", "developer", "tool"):
            media = extra.get(part.type)
            detail = media.get("detail") if isinstance(media, dict) else None
            if detail not in (None, "auto"):
                raise unsupported(f"{at}.{part.type}.detail", "only 'auto' image detail")
            url = media.get("url") if isinstance(media, dict) else media
            if not isinstance(url, str):
                raise invalid(f"{at}.image_url.url", "an image_url part needs 'image_url': {'url': <data URI>}")
        elif part.type in ("image_url", "video_url"):
            raise unsupported(at, f"'{part.type}' parts in {role} messages")
        elif part.type in ("input_audio", "file", "audio"):
            raise unsupported(at, f"'{part.type}' input is not supported")
        else:
            raise invalid(f"{at}.type", f"unsupported content part type '{part.type}'")

    # ------------------------------------------------------------------ translation
    def function_tools(self) -> list[FunctionTool]:
        """Declared function tools (all of them, in order); refuses what cannot be honoured."""
        out = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type", "function")
            if kind != "function":
                raise unsupported(f"tools[{i}].type", f"'{kind}' tools; only function tools")
            out.append(function_tool(tool.get("function"), f"tools[{i}].function"))
        unique_names(out, "tools")
        return out

    def tool_use(self, tools: list[FunctionTool]) -> ToolUse:
        """What ``tool_choice`` lets (or makes) the model call."""
        return callable_tools(tools, self.tool_choice, self.parallel_tool_calls,
                              lambda choice: _allowed_names(choice, tools), _named)

    def template_messages(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": "tool" if m.role == "function" else m.role,
                                   "content": _content(m, f"messages[{i}]")}
            if m.role == "assistant":
                reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
                if reasoning is not None:
                    msg["reasoning_content"] = reasoning
                calls = [c.function for c in m.tool_calls or []]
                if m.function_call is not None:
                    calls.append(m.function_call)
                if calls:
                    msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                         for c in calls]
            out.append(msg)
        return out

    def typed_template_options(self) -> dict[str, Any]:
        return {"enable_thinking": self.enable_thinking, "preserve_thinking": self.preserve_thinking,
                "reasoning_effort": self.reasoning_effort}

    @property
    def top(self) -> int | None:
        """Alternatives per token when log-probabilities are asked for (None: they are not)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling(self, state: ServerState, tools: ToolUse) -> Sampling:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                        seed=self.seed, max_tokens=max_tokens, stop=list(self.stop or []), logprobs=self.top,
                        logit_bias=openai_logit_bias(state, self.logit_bias),
                        grammar=tools.grammar(request_grammar(self, self.response_format)))


def _content(m: ChatMessage, at: str) -> str | list[dict[str, Any]]:
    """The template content of a message: its text, or with images a list of text and image
    parts (``server/media.py``)."""
    if not isinstance(m.content, list) or not any(p.type == "image_url" for p in m.content):
        return _text(m)
    out: list[dict[str, Any]] = []
    for j, p in enumerate(m.content):
        if p.type == "image_url":
            media = (p.model_extra or {}).get("image_url")
            out.append(image_part(media.get("url") if isinstance(media, dict) else media, f"{at}.content[{j}]"))
        else:
            out.append({"type": "text", "text": p.text if p.type == "text" else (p.refusal or "")})
    return out


def _text(m: ChatMessage) -> str:
    """String content, or text/refusal parts joined without separators."""
    if m.content is None:
        return m.refusal or ""
    if isinstance(m.content, str):
        return m.content
    return "".join(p.text if p.type == "text" else (p.refusal or "") for p in m.content)


def check_tool_history(req: ChatCompletionRequest) -> None:
    """Tool-call arguments in history must be JSON objects (the template writes them out)."""
    for i, m in enumerate(req.messages):
        for j, call in enumerate(m.tool_calls or []):
            try:
                value = json.loads(call.function.arguments or "{}")
            except ValueError:
                raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments",
                              "tool call arguments must be a JSON object text") from None
            if not isinstance(value, dict):
                raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments",
                              "tool call arguments must be a JSON object")


def _named(choice: dict) -> str:
    """The name in a Chat ``{"type": "function", "function": {"name"}}`` choice."""
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice.function.name", "a named tool choice needs 'function': {'name': ...}")
    return name


def _allowed_names(choice: dict, tools: list[FunctionTool]) -> tuple[list[str], bool]:
    """Names in a Chat ``{"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`` choice,
    and whether its mode requires a call."""
    spec = choice.get("allowed_tools") or {}
    mode = spec.get("mode", "auto")
    if mode not in ("auto", "required"):
        raise invalid("tool_choice.allowed_tools.mode", "mode must be 'auto' or 'required'")
    names = []
    for j, ref in enumerate(spec.get("tools") or []):
        fn = ref.get("function") if isinstance(ref, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else ref.get("name") if isinstance(ref, dict) else None
        if not isinstance(name, str) or name not in {t.name for t in tools}:
            raise invalid(f"tool_choice.allowed_tools.tools[{j}]", f"no declared function tool {name!r}")
        names.append(name)
    return names, mode == "required"
