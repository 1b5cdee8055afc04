"""``context_management``: the Messages API's context edits, applied as prompt rewrites.

The edits run in request order on the lowered template messages, before the prompt is rendered
for the last time; the client keeps its full history and gets back what was applied.

- ``clear_thinking_20251015`` drops the reasoning of all but the ``keep`` most recent assistant
  turns that have some (default 1; ``"all"`` keeps every one). An assistant turn runs from one
  user text message to the next, so a tool-calling loop is one turn. Whether kept reasoning is
  written into the prompt stays the chat template's choice (``preserve_thinking``).
- ``clear_tool_uses_20250919`` acts once the prompt exceeds ``trigger`` (default 100,000 input
  tokens, or a number of tool uses): every tool result but those of the ``keep`` most recent
  tool uses (default 3) and of ``exclude_tools`` is replaced by a placeholder, and the call's
  input too when ``clear_tool_inputs`` says so (true, or a list of tool names). With
  ``clear_at_least``, the edit is applied only if it removes at least that many prompt tokens.

``cleared_input_tokens`` is measured on the rendered prompt, before and after each edit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import invalid, unsupported

CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEARED_RESULT = "[tool result cleared from the context]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
EDIT_FIELDS = {CLEAR_THINKING: ("type", "keep"),
               CLEAR_TOOL_USES: ("type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs")}


@dataclass(frozen=True)
class ClearThinking:
    keep: int | None  # assistant turns whose thinking stays; None: all


@dataclass(frozen=True)
class ClearToolUses:
    trigger: tuple[str, int]  # ("input_tokens" | "tool_uses", value)
    keep: int
    clear_at_least: int | None
    exclude_tools: frozenset[str]
    clear_inputs: bool | frozenset[str]


Edit = ClearThinking | ClearToolUses


# ---------------------------------------------------------------------------- parsing
def parse(raw: Any) -> list[Edit]:
    """The edits of a request's ``context_management`` (None: no edits)."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        raise invalid("context_management", "must be an object holding 'edits'")
    for key in raw:
        if key != "edits":
            raise invalid(f"context_management.{key}", "unknown field: context_management holds 'edits'")
    edits = raw.get("edits", [])
    if not isinstance(edits, list):
        raise invalid("context_management.edits", "must be a list of edits")
    out: list[Edit] = []
    seen: set[str] = set()
    for i, edit in enumerate(edits):
        at = f"context_management.edits[{i}]"
        if not isinstance(edit, dict):
            raise invalid(at, "an edit must be an object")
        kind = edit.get("type")
        if kind == "compact_20260112":
            raise unsupported(f"{at}.type", "compaction needs a summarising model call, which this server does "
                              "not make")
        if kind not in EDIT_FIELDS:
            raise invalid(f"{at}.type", f"an edit's type must be '{CLEAR_THINKING}' or '{CLEAR_TOOL_USES}'")
        if kind in seen:
            raise invalid(f"{at}.type", "each edit type may appear once")
        if kind == CLEAR_THINKING and out:
            raise invalid(f"{at}.type", f"'{CLEAR_THINKING}' must be the first edit")
        seen.add(kind)
        for key in edit:
            if key not in EDIT_FIELDS[kind]:
                raise invalid(f"{at}.{key}", f"unknown field for a '{kind}' edit")
        out.append(_clear_thinking(edit, at) if kind == CLEAR_THINKING else _clear_tool_uses(edit, at))
    return out


def _counted(raw: Any, at: str, kinds: tuple[str, ...], minimum: int) -> tuple[str, int]:
    """A ``{"type": KIND, "value": N}`` object."""
    if not isinstance(raw, dict):
        raise invalid(at, "must be an object with 'type' and 'value'")
    for key in raw:
        if key not in ("type", "value"):
            raise invalid(f"{at}.{key}", "unknown field: the object holds 'type' and 'value'")
    kind, value = raw.get("type"), raw.get("value")
    if kind not in kinds:
        raise invalid(f"{at}.type", f"type must be {' or '.join(repr(k) for k in kinds)}")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise invalid(f"{at}.value", f"value must be an integer >= {minimum}")
    return kind, value


def _clear_thinking(edit: dict[str, Any], at: str) -> ClearThinking:
    keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all" and set(keep) == {"type"}):
        return ClearThinking(None)
    if not isinstance(keep, dict):
        raise invalid(f"{at}.keep", "keep must be 'all' or an object {type: 'thinking_turns', value}")
    return ClearThinking(_counted(keep, f"{at}.keep", ("thinking_turns",), 1)[1])


def _clear_tool_uses(edit: dict[str, Any], at: str) -> ClearToolUses:
    trigger = edit.get("trigger")
    trigger = ("input_tokens", DEFAULT_TRIGGER_TOKENS) if trigger is None else \
        _counted(trigger, f"{at}.trigger", ("input_tokens", "tool_uses"), 1)
    keep = edit.get("keep")
    keep = DEFAULT_KEEP_TOOL_USES if keep is None else _counted(keep, f"{at}.keep", ("tool_uses",), 0)[1]
    least = edit.get("clear_at_least")
    least = None if least is None else _counted(least, f"{at}.clear_at_least", ("input_tokens",), 0)[1]
    exclude = _names(edit.get("exclude_tools"), f"{at}.exclude_tools")
    inputs = edit.get("clear_tool_inputs")
    if inputs is None or isinstance(inputs, bool):
        clear_inputs: bool | frozenset[str] = bool(inputs)
    else:
        clear_inputs = _names(inputs, f"{at}.clear_tool_inputs", "a boolean or a list of tool names")
    return ClearToolUses(trigger, keep, least, exclude, clear_inputs)


def _names(raw: Any, at: str, what: str = "a list of tool names") -> frozenset[str]:
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise invalid(at, f"must be {what}")
    return frozenset(raw)


# ---------------------------------------------------------------------------- applying
Render = Callable[[list[dict[str, Any]]], tuple[str, list[int]]]


def apply(edits: list[Edit], messages: list[dict[str, Any]], render: Render
          ) -> tuple[str, list[int], list[dict[str, Any]], int]:
    """(prompt text, ids, applied edits as the response reports them, input tokens before any edit)."""
    text, ids = render(messages)
    original = len(ids)
    applied: list[dict[str, Any]] = []
    for edit in edits:
        if isinstance(edit, ClearThinking):
            edited, count = clear_thinking(messages, edit.keep)
            report = {"type": CLEAR_THINKING, "cleared_thinking_turns": count}
        else:
            edited, count = clear_tool_uses(messages, edit, len(ids))
            report = {"type": CLEAR_TOOL_USES, "cleared_tool_uses": count}
        if not count:
            continue
        new_text, new_ids = render(edited)
        cleared = len(ids) - len(new_ids)
        if isinstance(edit, ClearToolUses) and edit.clear_at_least is not None and cleared < edit.clear_at_least:
            continue
        messages, text, ids = edited, new_text, new_ids
        applied.append({**report, "cleared_input_tokens": max(cleared, 0)})
    return text, ids, applied, original


def _turns(messages: list[dict[str, Any]]) -> list[list[int]]:
    """Indices of the assistant messages of each assistant turn (user text starts a new turn)."""
    turns: list[list[int]] = []
    open_turn = False
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            open_turn = False
        elif m.get("role") == "assistant":
            if not open_turn:
                turns.append([])
                open_turn = True
            turns[-1].append(i)
    return turns


def clear_thinking(messages: list[dict[str, Any]], keep: int | None) -> tuple[list[dict[str, Any]], int]:
    """Messages without the reasoning of older thinking turns, and how many turns lost it."""
    if keep is None:
        return messages, 0
    thinking = [t for t in _turns(messages) if any(messages[i].get("reasoning_content") for i in t)]
    cleared = thinking[:max(len(thinking) - keep, 0)]
    out = list(messages)
    for turn in cleared:
        for i in turn:
            out[i] = {k: v for k, v in out[i].items() if k != "reasoning_content"}
    return out, len(cleared)


def clear_tool_uses(messages: list[dict[str, Any]], edit: ClearToolUses, prompt_tokens: int
                    ) -> tuple[list[dict[str, Any]], int]:
    """Messages with older tool results (and inputs) cleared, and how many tool uses were, once
    the trigger is exceeded."""
    uses = [(i, j, call) for i, m in enumerate(messages) if m.get("role") == "assistant"
            for j, call in enumerate(m.get("tool_calls") or [])]
    kind, value = edit.trigger
    if (prompt_tokens if kind == "input_tokens" else len(uses)) <= value:
        return messages, 0
    results = {m.get("tool_call_id"): i for i, m in enumerate(messages) if m.get("role") == "tool"}
    older = uses[:max(len(uses) - edit.keep, 0)]
    out = list(messages)
    count = 0
    for i, j, call in older:
        name = call["function"]["name"]
        if name in edit.exclude_tools or call.get("id") not in results:
            continue
        r = results[call["id"]]
        out[r] = {**out[r], "content": CLEARED_RESULT}
        if edit.clear_inputs is True or (edit.clear_inputs and name in edit.clear_inputs):
            calls = list(out[i]["tool_calls"])
            calls[j] = {**calls[j], "function": {**calls[j]["function"], "arguments": {}}}
            out[i] = {**out[i], "tool_calls": calls}
        count += 1
    return out, count
