"""Pydantic model of an Anthropic Messages request and the parsing of its content blocks.

The top level is a pydantic model; unknown advisory fields (beta options, inference geography,
...) are ignored, as the Messages contract allows. Content blocks, ``system``, ``thinking``,
``tools`` and ``tool_choice`` are parsed here by hand, so that every refusal names the exact
parameter (``messages[2].content[0].type``) and says which capability is missing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import invalid, unsupported

BILLING_HEADER = "x-anthropic-billing-header:"
CACHE_TTLS = ("5m", "1h")
# blocks whose meaning needs a capability this server does not have
NEEDS = {
    "document": "document processing",
    "search_result": "search result citations",
    "server_tool_use": "Anthropic server tools",
    "web_search_tool_result": "Anthropic server tools",
    "web_fetch_tool_result": "Anthropic server tools",
    "code_execution_tool_result": "Anthropic server tools",
    "bash_code_execution_tool_result": "Anthropic server tools",
    "text_editor_code_execution_tool_result": "Anthropic server tools",
    "tool_search_tool_result": "Anthropic server tools",
    "mcp_tool_use": "MCP connectors",
    "mcp_tool_result": "MCP connectors",
    "container_upload": "code execution containers",
    "redacted_thinking": "encrypted reasoning (only visible thinking can be restored)",
}
REFUSED_FIELDS = {
    "container": "code execution containers",
    "mcp_servers": "MCP connectors",
    "output_format": "structured outputs (constrained decoding)",
}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[dict[str, Any]]]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)  # a label, echoed back: it does not select the model
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    system: Union[str, list[dict[str, Any]], None] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    thinking: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: Any = None  # parsed in context_edits.py, so errors name the exact field
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    preserve_thinking: bool | None = None  # NInfer extension: keep the reasoning of closed turns

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not s for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def reject_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, capability in REFUSED_FIELDS.items():
            if extra.get(name) is not None:
                raise unsupported(name, f"{capability} is not available on this server")
        config = self.output_config or {}
        if config.get("format") is not None:
            raise unsupported("output_config.format", "structured outputs need constrained decoding")


# ---------------------------------------------------------------------------- blocks
@dataclass
class CacheMark:
    ttl: str  # "5m" | "1h"
    param: str


@dataclass
class Block:
    type: str  # text | image | thinking | tool_use | tool_result
    param: str
    text: str = ""  # text, or the thinking of a thinking block
    id: str = ""  # tool_use id, or tool_use_id of a tool_result
    name: str = ""
    input: dict[str, Any] = field(default_factory=dict)
    parts: list["Block"] = field(default_factory=list)  # tool_result content, in order
    is_error: bool = False
    cache: CacheMark | None = None


def _str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise invalid(param, f"'{param}' must be a string")
    return value


def cache_mark(raw: dict[str, Any], param: str) -> CacheMark | None:
    cc = raw.get("cache_control")
    if cc is None:
        return None
    at = f"{param}.cache_control"
    if not isinstance(cc, dict):
        raise invalid(at, f"'{at}' must be an object")
    if cc.get("type") != "ephemeral":
        raise invalid(f"{at}.type", "the only cache_control type is 'ephemeral'")
    ttl = cc.get("ttl") or "5m"
    if ttl not in CACHE_TTLS:
        raise invalid(f"{at}.ttl", f"cache_control ttl must be one of {', '.join(CACHE_TTLS)}")
    return CacheMark(ttl, at)


def _image_source(source: Any, param: str) -> str:
    if not isinstance(source, dict):
        raise invalid(param, "an image block needs a 'source' object")
    kind = source.get("type")
    if kind == "base64":
        media_type = _str(source.get("media_type"), f"{param}.media_type")
        return f"data:{media_type};base64,{_str(source.get('data'), f'{param}.data')}"
    if kind == "url":
        return _str(source.get("url"), f"{param}.url")
    if kind == "file":
        raise unsupported(f"{param}.type", "uploaded files; send the image as base64")
    raise invalid(f"{param}.type", "an image source is 'base64' or 'url'")


def parse_block(raw: Any, param: str, nested: bool = False) -> Block:
    """One content block; ``nested``: inside a tool_result (text and image only)."""
    if not isinstance(raw, dict):
        raise invalid(param, f"'{param}' must be a content block object")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise invalid(f"{param}.type", "a content block needs a 'type'")
    mark = cache_mark(raw, param)
    if kind == "text":
        if raw.get("citations"):
            raise unsupported(f"{param}.citations", "citations need document processing")
        return Block("text", param, text=_str(raw.get("text"), f"{param}.text"), cache=mark)
    if kind == "image":  # its source as a data URI (or URL) in ``text``, read by server/media.py
        return Block("image", param, text=_image_source(raw.get("source"), f"{param}.source"), cache=mark)
    if nested:
        raise invalid(f"{param}.type", f"a tool_result may contain text and image blocks, not '{kind}'")
    if kind == "thinking":
        return Block("thinking", param, text=_str(raw.get("thinking"), f"{param}.thinking"), cache=mark)
    if kind == "tool_use":
        tool_input = raw.get("input", {})
        if not isinstance(tool_input, dict):
            raise invalid(f"{param}.input", "tool_use input must be an object")
        return Block("tool_use", param, id=_str(raw.get("id"), f"{param}.id"),
                     name=_str(raw.get("name"), f"{param}.name"), input=tool_input, cache=mark)
    if kind == "tool_result":
        content = raw.get("content")
        parts: list[Block] = []
        if isinstance(content, str):
            parts = [Block("text", f"{param}.content", text=content)]
        elif isinstance(content, list):
            parts = [parse_block(p, f"{param}.content[{k}]", nested=True) for k, p in enumerate(content)]
        elif content is not None:
            raise invalid(f"{param}.content", "tool_result content must be a string or a list of blocks")
        is_error = raw.get("is_error", False)
        if not isinstance(is_error, bool):
            raise invalid(f"{param}.is_error", "is_error must be a boolean")
        return Block("tool_result", param, id=_str(raw.get("tool_use_id"), f"{param}.tool_use_id"), parts=parts,
                     is_error=is_error, cache=mark)
    if kind in NEEDS:
        raise unsupported(param, f"'{kind}' blocks need {NEEDS[kind]}, which this server does not provide")
    raise invalid(f"{param}.type", f"unknown content block type '{kind}'")


def message_blocks(message: Message, i: int) -> list[Block]:
    param = f"messages[{i}].content"
    if isinstance(message.content, str):
        return [Block("text", param, text=message.content)]
    return [parse_block(raw, f"{param}[{j}]") for j, raw in enumerate(message.content)]


def system_blocks(system: Union[str, list[dict[str, Any]], None]) -> list[Block]:
    """The system prompt's text blocks. In the array form a first text block that begins with
    ``x-anthropic-billing-header:`` (client attribution metadata) is consumed, cache mark and all."""
    if system is None:
        return []
    if isinstance(system, str):
        return [Block("text", "system", text=system)]
    blocks = []
    for j, raw in enumerate(system):
        block = parse_block(raw, f"system[{j}]")
        if block.type != "text":
            raise invalid(f"system[{j}].type", "system blocks must be text blocks")
        if j == 0 and block.text.startswith(BILLING_HEADER):
            continue
        blocks.append(block)
    return blocks


# ---------------------------------------------------------------------------- thinking, tools
@dataclass
class Thinking:
    mode: str | None  # enabled | disabled | adaptive | None (the server's default)
    budget: int | None = None


def parse_thinking(raw: dict[str, Any] | None, max_tokens: int | None) -> Thinking:
    if raw is None:
        return Thinking(None)
    kind = raw.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking.type", "thinking.type must be 'enabled', 'disabled' or 'adaptive'")
    display = raw.get("display")
    if display == "omitted":
        raise unsupported("thinking.display", "'omitted' needs encrypted reasoning; thinking is always returned "
                          "visibly")
    if display not in (None, "summarized"):
        raise invalid("thinking.display", "thinking.display must be 'summarized' or 'omitted'")
    if kind != "enabled":
        return Thinking(kind)
    budget = raw.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise invalid("thinking.budget_tokens", "enabled thinking needs an integer budget_tokens")
    if budget < 1024:
        raise invalid("thinking.budget_tokens", "budget_tokens must be >= 1024")
    if max_tokens is not None and budget >= max_tokens:
        raise invalid("thinking.budget_tokens", f"budget_tokens ({budget}) must be less than max_tokens "
                      f"({max_tokens})")
    return Thinking("enabled", budget)


def parse_tool_choice(raw: dict[str, Any] | None) -> tuple[str, str | None, bool]:
    """``(type, name, parallel)``: ``auto``, ``none``, ``any`` (some call is required) or ``tool``
    (the call to ``name`` is); ``parallel``: more than one call may come."""
    if raw is None:
        return "auto", None, True
    kind = raw.get("type")
    if kind not in ("auto", "none", "any", "tool"):
        raise invalid("tool_choice.type", "tool_choice.type must be 'auto', 'none', 'any' or 'tool'")
    name = raw.get("name")
    if kind == "tool" and (not isinstance(name, str) or not name):
        raise invalid("tool_choice.name", "tool_choice 'tool' needs the tool's 'name'")
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise invalid("tool_choice.disable_parallel_tool_use", "disable_parallel_tool_use must be a boolean")
    return kind, name if kind == "tool" else None, disable is not True

