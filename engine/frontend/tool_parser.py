"""Qwen XML tool calls in model output, parsed while it streams.

The Qwen3.5 / Qwen3.6 chat format writes a call as::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

``ToolCallParser`` turns answer text into an ordered list of events: ``str`` pieces of ordinary
content and ``ToolCall`` objects. Content streams as soon as it cannot be the start of a call;
a ``<tool_call>`` region is held until it is complete, then becomes one ``ToolCall`` (only for a
function in the declared tool set) or, if it is malformed or names an undeclared function, comes
back as content byte for byte. Whitespace that separates a call from the text around it is
dropped. The events do not depend on how the text was chunked, so the aggregate result of
``parse_tool_calls(text)`` equals the concatenation of a streamed parse.

Parameter values are untyped text in this format. A parameter's schema in the tool definition
guides the conversion (``convert_parameter``): a direct ``type`` (or a list of types), or an
``anyOf``/``oneOf`` made only of explicit types. String-admitting parameters stay strings; an
empty value of a non-string parameter is omitted; booleans are matched case-insensitively;
other values become JSON when they parse as JSON and strings otherwise. Without an explicit type
a value is JSON when it parses as JSON, else a string. Arguments keep the order the model wrote.

A value may contain any text, markup included, and balanced nested
``<parameter=...>...</parameter>`` pairs. The format has no escape, so a standalone
``</parameter>`` or an unmatched nested opener makes the whole region ordinary content.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
_BLANK = " \t\r\n"


@dataclass(frozen=True)
class ToolSpec:
    """A callable function: its name as the model sees it, and its JSON-schema ``parameters``."""

    name: str
    parameters: Mapping[str, Any] | None = None

    def property_schema(self, key: str) -> Any:
        props = self.parameters.get("properties") if isinstance(self.parameters, Mapping) else None
        return props.get(key) if isinstance(props, Mapping) else None


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. ``arguments`` is a JSON object text in the model's member order;
    ``argument_pieces`` split it at parameter boundaries for streaming (they join to it)."""

    index: int  # 0, 1, ... in order of appearance in this output
    name: str
    arguments: str
    argument_pieces: tuple[str, ...] = field(default=(), repr=False)

    @property
    def arguments_dict(self) -> dict[str, Any]:
        return json.loads(self.arguments)


ToolEvent = Union[str, ToolCall]


# ---------------------------------------------------------------------------- values
def declared_types(schema: Any) -> frozenset[str] | None:
    """The explicit JSON types a parameter schema admits, or None when it names none."""
    if not isinstance(schema, Mapping):
        return None
    own = _explicit_type(schema)
    if own is not None:
        return own
    for key in ("anyOf", "oneOf"):
        alternatives = schema.get(key)
        if isinstance(alternatives, list) and alternatives:
            types: set[str] = set()
            for alt in alternatives:
                t = _explicit_type(alt) if isinstance(alt, Mapping) else None
                if t is None:
                    return None
                types |= t
            return frozenset(types)
    return None


def _explicit_type(schema: Mapping[str, Any]) -> frozenset[str] | None:
    t = schema.get("type")
    if isinstance(t, str):
        return frozenset([t])
    if isinstance(t, list) and t and all(isinstance(x, str) for x in t):
        return frozenset(t)
    return None


OMIT = object()


def convert_parameter(text: str, schema: Any) -> Any:
    """A parameter's text as a JSON value under its schema; ``OMIT`` when an
    empty value of a non-string parameter should be left out. See the module docstring."""
    types = declared_types(schema)
    if types is not None and "string" in types:
        return text
    if types is not None and text == "":
        return OMIT
    if types is not None and "boolean" in types and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text


def arguments_json(pairs: Sequence[tuple[str, Any]]) -> tuple[str, tuple[str, ...]]:
    """``(arguments, pieces)``: the JSON object of ``pairs`` in order, and its per-member pieces."""
    if not pairs:
        return "{}", ("{}",)
    pieces = [("{" if i == 0 else ", ") + json.dumps(k, ensure_ascii=False) + ": "
              + json.dumps(v, ensure_ascii=False) for i, (k, v) in enumerate(pairs)]
    pieces.append("}")
    return "".join(pieces), tuple(pieces)


# ---------------------------------------------------------------------------- one region
@dataclass
class _Region:
    status: str  # "incomplete" | "complete" | "invalid"
    end: int = 0  # complete: index just past </tool_call>; invalid: where the markup went wrong
    name: str = ""
    params: list[tuple[str, str]] = field(default_factory=list)


def _skip_blank(s: str, i: int) -> int:
    while i < len(s) and s[i] in _BLANK:
        i += 1
    return i


def _expect(s: str, i: int, token: str) -> str:
    """'yes' if ``token`` is at ``i``, 'maybe' if ``s`` ends with a prefix of it there, else 'no'."""
    rest = s[i: i + len(token)]
    if rest == token:
        return "yes"
    return "maybe" if token.startswith(rest) else "no"


def _read_tag_name(s: str, i: int) -> tuple[str, int] | str:
    """The ``NAME`` of ``NAME>`` at ``i`` and the index after ``>``; or 'incomplete' / 'invalid'."""
    end = s.find(">", i)
    name = s[i:] if end < 0 else s[i:end]
    if "\n" in name or "<" in name:
        return "invalid"
    if end < 0:
        return "incomplete"
    return (name, end + 1) if name.strip() else "invalid"


def _value_end(s: str, i: int) -> tuple[int, int] | None:
    """(end of value, index after its ``</parameter>``), counting nested parameter pairs."""
    depth = 1
    while True:
        close = s.find(PARAM_CLOSE, i)
        if close < 0:
            return None
        opener = s.find(PARAM_OPEN, i, close)
        if opener >= 0:
            depth += 1
            i = opener + len(PARAM_OPEN)
            continue
        depth -= 1
        if depth == 0:
            return close, close + len(PARAM_CLOSE)
        i = close + len(PARAM_CLOSE)


def _parse_region(s: str, tools: Mapping[str, ToolSpec]) -> _Region:
    """Parse ``s`` (which starts with ``<tool_call>``) as far as it goes."""
    i = _skip_blank(s, len(CALL_OPEN))
    seen = _expect(s, i, FUNCTION_OPEN)
    if seen != "yes":
        return _Region("incomplete" if seen == "maybe" else "invalid", i)
    got = _read_tag_name(s, i + len(FUNCTION_OPEN))
    if isinstance(got, str):
        return _Region(got, i)
    name, j = got
    if name not in tools:
        return _Region("invalid", i)
    region = _Region("incomplete", name=name)
    keys: set[str] = set()
    i = j
    while True:
        i = _skip_blank(s, i)
        if _expect(s, i, PARAM_OPEN) == "yes":
            got = _read_tag_name(s, i + len(PARAM_OPEN))
            if isinstance(got, str):
                return _Region(got, i)
            key, j = got
            if key in keys:
                return _Region("invalid", i)
            span = _value_end(s, j)
            if span is None:
                return _Region("incomplete", i)
            value = s[j: span[0]]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            keys.add(key)
            region.params.append((key, value))
            i = span[1]
            continue
        seen = _expect(s, i, FUNCTION_CLOSE)
        if seen != "yes":
            maybe = seen == "maybe" or _expect(s, i, PARAM_OPEN) == "maybe"
            return _Region("incomplete" if maybe else "invalid", i)
        i = _skip_blank(s, i + len(FUNCTION_CLOSE))
        seen = _expect(s, i, CALL_CLOSE)
        if seen != "yes":
            return _Region("incomplete" if seen == "maybe" else "invalid", i)
        region.status, region.end = "complete", i + len(CALL_CLOSE)
        return region


# ---------------------------------------------------------------------------- streaming
class ToolCallParser:
    """Streaming parser of answer text (reasoning already removed) into content and calls.

    ``tools``: the functions that may be called; markup naming any other stays content.
    ``push(text)`` and ``finish()`` return ``ToolEvent`` lists (``str`` content or ``ToolCall``),
    in output order; ``calls`` holds every call parsed so far.
    """

    def __init__(self, tools: Iterable[ToolSpec]) -> None:
        self.tools: dict[str, ToolSpec] = {t.name: t for t in tools}
        self.calls: list[ToolCall] = []
        self._text = ""  # held ordinary text: trailing blanks and a partial <tool_call>
        self._region: str | None = None  # held text from <tool_call> on
        self._blank_before = ""  # blanks between the preceding text and the region
        self._after_call = False  # the held blanks directly follow a call

    def push(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if self._region is not None:
            self._region += text
            self._advance_region(events, final=False)
        else:
            self._text += text
        self._scan_text(events, final=False)
        return _merge(events)

    def finish(self) -> list[ToolEvent]:
        """End of output: an unfinished region and any held text come back as content."""
        events: list[ToolEvent] = []
        if self._region is not None:
            self._advance_region(events, final=True)
        self._scan_text(events, final=True)
        return _merge(events)

    def _scan_text(self, events: list[ToolEvent], final: bool) -> None:
        while self._region is None and self._text:
            buf = self._text
            start = buf.find(CALL_OPEN)
            if start >= 0:
                body = buf[:start]
                kept = body.rstrip(_BLANK)
                self._emit(events, kept)
                self._blank_before = body[len(kept):]
                self._region, self._text = buf[start:], ""
                self._advance_region(events, final)
                continue
            if final:
                if not (self._after_call and not buf.strip(_BLANK)):
                    self._emit(events, buf)
                self._text = ""
                return
            hold = _partial_open(buf)
            body, tail = buf[: len(buf) - hold], buf[len(buf) - hold:]
            kept = body.rstrip(_BLANK)
            self._emit(events, kept)
            self._text = body[len(kept):] + tail
            return

    def _emit(self, events: list[ToolEvent], text: str) -> None:
        if not text:
            return
        if self._after_call:  # blanks right after a call are separators
            self._after_call = False
            text = text.lstrip(_BLANK)
        if text:
            events.append(text)

    def _advance_region(self, events: list[ToolEvent], final: bool) -> None:
        region = _parse_region(self._region, self.tools)
        if region.status == "incomplete" and not final:
            return
        if region.status == "complete":
            events.append(self._make_call(region))
            rest = self._region[region.end:]
            self._after_call = True
        else:  # malformed: the text up to where it went wrong is content, scanning resumes there
            cut = len(self._region) if region.status == "incomplete" else max(region.end, len(CALL_OPEN))
            self._emit(events, self._blank_before + self._region[:cut])
            rest = self._region[cut:]
        self._region, self._blank_before = None, ""
        self._text = rest + self._text

    def _make_call(self, region: _Region) -> ToolCall:
        spec = self.tools[region.name]
        pairs = []
        for key, text in region.params:
            value = convert_parameter(text, spec.property_schema(key))
            if value is not OMIT:
                pairs.append((key, value))
        arguments, pieces = arguments_json(pairs)
        call = ToolCall(len(self.calls), region.name, arguments, pieces)
        self.calls.append(call)
        return call


def _partial_open(buf: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(buf), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(buf[-n:]):
            return n
    return 0


def _merge(events: list[ToolEvent]) -> list[ToolEvent]:
    """Adjacent content pieces joined."""
    out: list[ToolEvent] = []
    for e in events:
        if isinstance(e, str) and out and isinstance(out[-1], str):
            out[-1] += e
        else:
            out.append(e)
    return out


def parse_tool_calls(text: str, tools: Iterable[ToolSpec]) -> tuple[str, list[ToolCall]]:
    """The whole answer at once: (content, calls), exactly as a streamed parse gives them."""
    parser = ToolCallParser(tools)
    events = parser.push(text) + parser.finish()
    return "".join(e for e in events if isinstance(e, str)), list(parser.calls)
