"""A model's streamed output as an assistant message: reasoning, answer text and tool calls.

Chains ``ReasoningParser`` (reasoning vs answer) and ``ToolCallParser`` (calls in the answer).
Every API family (Chat Completions, Responses, Anthropic Messages) feeds it the engine's text
deltas and maps the events to its own wire format:

    parser = AssistantOutputParser(starts_in_reasoning=True, tools=[ToolSpec("get_weather", schema)])
    for out in engine_outputs:
        for event in parser.push(out.text):
            ...  # ReasoningText | ContentText | ToolCall, in output order
    for event in parser.finish():
        ...
    message = parser.message   # the aggregate: reasoning, content, tool_calls

Adjacent events of the same kind are merged within one ``push``. ``tools=None`` (or empty)
turns tool-call parsing off: all answer text is content.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Union

from .reasoning import ReasoningParser
from .tool_parser import ToolCall, ToolCallParser, ToolSpec


@dataclass(frozen=True)
class ReasoningText:
    text: str


@dataclass(frozen=True)
class ContentText:
    text: str


AssistantEvent = Union[ReasoningText, ContentText, ToolCall]


@dataclass
class AssistantMessage:
    """Everything parsed so far."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class AssistantOutputParser:
    def __init__(self, starts_in_reasoning: bool, tools: Iterable[ToolSpec] | None = None) -> None:
        self.reasoning = ReasoningParser(starts_in_reasoning)
        specs = list(tools or [])
        self.tools = ToolCallParser(specs) if specs else None
        self.message = AssistantMessage()

    @property
    def in_reasoning(self) -> bool:
        return self.reasoning.in_reasoning

    def push(self, text: str) -> list[AssistantEvent]:
        if not text:
            return []
        delta = self.reasoning.push(text)
        return self._route(delta.reasoning, delta.content, final=False)

    def finish(self) -> list[AssistantEvent]:
        delta = self.reasoning.finish()
        return self._route(delta.reasoning, delta.content, final=True)

    def _route(self, reasoning: str, content: str, final: bool) -> list[AssistantEvent]:
        events: list[AssistantEvent] = []
        if reasoning:
            events.append(ReasoningText(reasoning))
        if self.tools is None:
            if content:
                events.append(ContentText(content))
        else:
            pieces = self.tools.push(content) if content else []
            if final:
                pieces += self.tools.finish()
            for piece in pieces:
                events.append(ContentText(piece) if isinstance(piece, str) else piece)
        events = _merge(events)
        for e in events:
            if isinstance(e, ReasoningText):
                self.message.reasoning += e.text
            elif isinstance(e, ContentText):
                self.message.content += e.text
            else:
                self.message.tool_calls.append(e)
        return events


def _merge(events: list[AssistantEvent]) -> list[AssistantEvent]:
    out: list[AssistantEvent] = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (ReasoningText, ContentText)):
            out[-1] = type(e)(out[-1].text + e.text)
        else:
            out.append(e)
    return out


def parse_assistant_output(text: str, starts_in_reasoning: bool,
                           tools: Iterable[ToolSpec] | None = None) -> AssistantMessage:
    """The whole output at once, exactly as a streamed parse gives it."""
    parser = AssistantOutputParser(starts_in_reasoning, tools)
    parser.push(text)
    parser.finish()
    return parser.message
