"""A Messages request lowered to what the chat template renders: messages, tools, options.

- ``system`` (string or text blocks) becomes the first system message; inline ``system``
  messages keep their position.
- Consecutive messages of one role are joined without separators.
- An assistant turn becomes ``reasoning_content`` (its thinking), ``content`` (its text) and
  ``tool_calls`` (its tool_use blocks); signatures carry no meaning and are dropped.
- The user turn after an assistant turn with tool calls must open with exactly one tool_result
  per call; the results become ``tool`` messages in call order, each keeping its text/image
  parts in order and saying so explicitly when ``is_error`` is set. A conversation may begin
  with results (a truncated or imported history).
- A final assistant message with only text is a prefill: the prompt is rendered up to a new
  assistant turn (thinking off) and the text is appended, so generation continues it.
- ``cache_control`` marks are validated (``ephemeral``, ttl 5m/1h, at most four breakpoints,
  request-level merged onto the last block) and then serve only as hints.
- ``context_management`` edits are parsed here and applied when the prompt is built
  (``context_edits.py``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import invalid, unsupported
from ..generation import template_options
from ..media import image_part
from ..openai_common import FunctionTool, ToolUse, function_tool, unique_names
from ..state import ServerState
from . import context_edits
from .protocol import Block, MessagesRequest, Thinking, cache_mark, message_blocks, parse_thinking, \
    parse_tool_choice, system_blocks

MAX_BREAKPOINTS = 4
EFFORTS = ("low", "medium", "high", "max")
TOOL_ERROR_PREFIX = "[tool error] "  # how a result with is_error: true reads in the prompt


@dataclass
class Lowered:
    messages: list[dict[str, Any]]
    tools: ToolUse  # the callable ones (rendered and parsed), and whether a call is forced
    options: dict[str, Any]
    thinking: Thinking
    prefill: str | None = None
    breakpoints: list[str] = field(default_factory=list)  # params of the accepted cache marks
    edits: list[context_edits.Edit] | None = None  # None: the request has no context_management


def lower(req: MessagesRequest, state: ServerState) -> Lowered:
    req.reject_unsupported()
    edits = None if req.context_management is None else context_edits.parse(req.context_management)
    thinking = parse_thinking(req.thinking, req.max_tokens)
    declared = parse_tools(req.tools)
    use = tool_use(declared, req.tool_choice)

    system = system_blocks(req.system)
    turns = _join_roles(req)
    marks = [b.cache for b in system if b.cache] + [t[1] for t in declared_marks(req.tools)]
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": _text_parts(system)})
    pending: list[Block] = []  # tool calls of the previous assistant turn, awaiting results
    prefill = None
    for n, (role, blocks) in enumerate(turns):
        marks += [b.cache for b in blocks if b.cache] + [p.cache for b in blocks for p in b.parts if p.cache]
        last = n == len(turns) - 1
        if role == "system":
            _only(blocks, ("text",), "system messages hold text blocks")
            messages.append({"role": "system", "content": _text_parts(blocks)})
        elif role == "user":
            messages += _user_turn(blocks, pending, first=n == 0 or (n == 1 and turns[0][0] == "system"))
            pending = []
        else:
            if pending:
                raise invalid(pending[0].param, f"tool_use '{pending[0].id}' has no tool_result in the next "
                              "user message")
            if last:
                prefill = _prefill(blocks, thinking)
                break
            messages.append(_assistant_turn(blocks))
            pending = [b for b in blocks if b.type == "tool_use"]
    if pending:
        raise invalid(pending[0].param, f"tool_use '{pending[0].id}' has no tool_result in a following user message")

    options = _options(state, req, thinking, prefill is not None)
    breakpoints = check_breakpoints(marks, req, turns)
    return Lowered(messages, use, options, thinking, prefill, breakpoints, edits)


# ---------------------------------------------------------------------------- turns
def _join_roles(req: MessagesRequest) -> list[tuple[str, list[Block]]]:
    turns: list[tuple[str, list[Block]]] = []
    for i, message in enumerate(req.messages):
        blocks = message_blocks(message, i)
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks))
    return turns


def _only(blocks: list[Block], kinds: tuple[str, ...], why: str) -> None:
    for b in blocks:
        if b.type not in kinds:
            raise invalid(f"{b.param}.type", f"'{b.type}' block not allowed here: {why}")


def _text_parts(blocks: list[Block]) -> list[dict[str, Any]]:
    """Template parts of text and image blocks (``server/media.py`` reads the images)."""
    return [image_part(b.text, b.param) if b.type == "image" else {"type": "text", "text": b.text} for b in blocks]


def _user_turn(blocks: list[Block], pending: list[Block], first: bool) -> list[dict[str, Any]]:
    _only(blocks, ("text", "image", "tool_result"), "a user turn holds text, images and tool results")
    lead = 0
    while lead < len(blocks) and blocks[lead].type == "tool_result":
        lead += 1
    results, rest = blocks[:lead], blocks[lead:]
    for b in rest:
        if b.type == "tool_result":
            raise invalid(b.param, "tool_result blocks must come first in a user message")
    if pending:
        by_id: dict[str, Block] = {}
        calls = {c.id for c in pending}
        for r in results:
            if r.id not in calls:
                raise invalid(f"{r.param}.tool_use_id", f"no tool_use with id '{r.id}' in the previous assistant "
                              "message")
            if r.id in by_id:
                raise invalid(f"{r.param}.tool_use_id", f"a second tool_result for '{r.id}'")
            by_id[r.id] = r
        missing = [c for c in pending if c.id not in by_id]
        if missing:
            raise invalid(missing[0].param, f"tool_use '{missing[0].id}' has no tool_result in the next user "
                          "message")
        results = [by_id[c.id] for c in pending]  # call order
    elif results and not first:
        raise invalid(f"{results[0].param}.tool_use_id", "tool_result without a tool_use in the previous "
                      "assistant message")
    out = [_tool_message(r) for r in results]
    if rest:
        out.append({"role": "user", "content": _text_parts(rest)})
    return out


def _tool_message(result: Block) -> dict[str, Any]:
    parts = _text_parts(result.parts)
    if result.is_error:
        parts.insert(0, {"type": "text", "text": TOOL_ERROR_PREFIX})
    return {"role": "tool", "tool_call_id": result.id, "content": parts}


def _assistant_turn(blocks: list[Block]) -> dict[str, Any]:
    _only(blocks, ("text", "thinking", "tool_use"), "an assistant turn holds thinking, text and tool_use")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.type == "text")}
    thinking = [b.text for b in blocks if b.type == "thinking"]
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    calls = [b for b in blocks if b.type == "tool_use"]
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.input}}
                                 for c in calls]
    return message


def _prefill(blocks: list[Block], thinking: Thinking) -> str:
    for b in blocks:
        if b.type != "text":
            raise invalid(f"{b.param}.type", f"an assistant prefill holds text only, not '{b.type}'")
    if thinking.mode in ("enabled", "adaptive"):
        raise invalid("thinking", "an assistant prefill cannot start with thinking enabled")
    return "".join(b.text for b in blocks)


def _options(state: ServerState, req: MessagesRequest, thinking: Thinking, prefill: bool) -> dict[str, Any]:
    enable = {"enabled": True, "adaptive": True, "disabled": False}.get(thinking.mode or "")
    if prefill:
        enable = False  # the continued text is answer text
    effort = (req.output_config or {}).get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid("output_config.effort", f"output_config.effort must be one of {', '.join(EFFORTS)}")
    typed = {"enable_thinking": enable, "preserve_thinking": req.preserve_thinking,
             "reasoning_effort": effort if enable is not False else None}
    return template_options(state, None, typed, "output_config")


# ---------------------------------------------------------------------------- tools
def parse_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    out = []
    for i, tool in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(param, f"'{param}' must be an object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise unsupported(f"{param}.type", f"'{kind}' is an Anthropic-provided tool; only user-defined tools "
                              "are executable here")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise invalid(f"{param}.input_schema", "input_schema must be a JSON schema with type 'object'")
        description = tool.get("description")
        examples = tool.get("input_examples")
        if examples is not None:
            if not isinstance(examples, list) or not all(isinstance(e, dict) for e in examples):
                raise invalid(f"{param}.input_examples", "input_examples must be a list of objects")
            shown = "\n".join(json.dumps(e, ensure_ascii=False) for e in examples)
            description = f"{description or ''}\n\nExample inputs:\n{shown}".lstrip("\n")
        fn = {"name": tool.get("name"), "description": description, "parameters": schema,
              "strict": tool.get("strict"), "defer_loading": tool.get("defer_loading"),
              "allowed_callers": tool.get("allowed_callers")}
        out.append(function_tool(fn, param))
        out[-1].schema_param = f"{param}.input_schema"
    unique_names(out, "tools")
    return out


def tool_use(declared: list[FunctionTool], choice: dict[str, Any] | None) -> ToolUse:
    """What ``tool_choice`` makes of the declared tools: ``any`` forces a call to one of them,
    ``tool`` a call to the one it names; ``disable_parallel_tool_use`` holds an answer to one
    call, which only a forced choice or strict tools can enforce."""
    kind, name, parallel = parse_tool_choice(choice)
    if kind == "none":
        return ToolUse([])
    if kind == "tool":
        named = [t for t in declared if t.name == name]
        if not named:
            raise invalid("tool_choice.name", f"tool_choice names {name!r}, which is not a declared tool")
        return ToolUse(named, True, parallel)
    if kind == "any" and not declared:
        raise invalid("tool_choice.type", "tool_choice 'any' needs at least one tool")
    if not parallel and kind == "auto" and not any(t.strict for t in declared):
        raise unsupported("tool_choice.disable_parallel_tool_use", "a single call per turn is enforced only "
                          "where calls are held to a grammar (tool_choice 'any' or 'tool', or strict tools)")
    return ToolUse(declared, kind == "any", parallel)


def declared_marks(tools: list[dict[str, Any]] | None) -> list[tuple[int, Any]]:
    marks = []
    for i, tool in enumerate(tools or []):
        mark = cache_mark(tool, f"tools[{i}]") if isinstance(tool, dict) else None
        if mark is not None:
            marks.append((i, mark))
    return marks


# ---------------------------------------------------------------------------- cache hints
def check_breakpoints(marks: list, req: MessagesRequest, turns: list[tuple[str, list[Block]]]) -> list[str]:
    """The accepted breakpoints (their params). Block-level marks are distinct targets; the
    request-level mark targets the last block: it merges with a mark there of the same ttl,
    conflicts with another ttl, and otherwise needs a free slot."""
    if len(marks) > MAX_BREAKPOINTS:
        raise invalid(marks[MAX_BREAKPOINTS].param, f"at most {MAX_BREAKPOINTS} cache_control breakpoints are "
                      f"allowed, got {len(marks)}")
    params = [m.param for m in marks]
    if req.cache_control is None:
        return params
    top = cache_mark({"cache_control": req.cache_control}, "request")
    last = turns[-1][1][-1] if turns and turns[-1][1] else None
    if last is not None and last.cache is not None:
        if last.cache.ttl != top.ttl:
            raise invalid("cache_control.ttl", f"the request-level ttl ({top.ttl}) conflicts with the "
                          f"breakpoint at {last.cache.param} ({last.cache.ttl})")
        return params
    if len(marks) >= MAX_BREAKPOINTS:
        raise invalid("cache_control", f"the request-level breakpoint needs a slot, but {MAX_BREAKPOINTS} "
                      "block-level breakpoints are already set")
    return params + ["cache_control"]
