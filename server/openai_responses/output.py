"""Parsed assistant output as Responses output Items and their semantic stream events.

``OutputBuilder`` receives ``AssistantOutputParser`` events and keeps the output Items: a
reasoning Item (raw ``reasoning_text``, empty summary), an assistant message with one
``output_text`` part, and ``function_call`` Items. For each change it calls ``emit(type, body)``
with the matching SSE event (without ``sequence_number``, which the stream adds). With ``seal``
(``include: ["reasoning.encrypted_content"]``) a finished reasoning Item also carries its text
sealed as ``encrypted_content``, for a client that sends the Item back. With ``logprobs``
(``include: ["message.output_text.logprobs"]``) each ``output_text`` delta carries the entries of
the tokens that arrived since the one before (``tokens``), and the part all of its own; tokens
whose text went to reasoning are not a message's.
"""
from __future__ import annotations

from typing import Any, Callable

from ...engine.frontend.assistant_output import AssistantEvent, ContentText, ReasoningText
from ...engine.frontend.tool_parser import ToolCall
from ...engine.outputs import TokenLogprob
from ..openai_common import FunctionTool, new_id

Emit = Callable[[str, dict[str, Any]], None]
Seal = Callable[[str], str]
Entries = Callable[[list[TokenLogprob]], list[dict[str, Any]]]


class OutputBuilder:
    def __init__(self, tools: dict[str, FunctionTool], emit: Emit | None = None, seal: Seal | None = None,
                 logprobs: Entries | None = None) -> None:
        self.tools = tools
        self.emit: Emit = emit or (lambda kind, body: None)
        self.seal = seal
        self.logprobs = logprobs
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message Item receiving text
        self._text: list[str] = []
        self._unsent: list[TokenLogprob] = []  # tokens whose text has not been placed yet
        self._entries: list[dict[str, Any]] = []  # the open message part's logprobs

    def tokens(self, logprobs: list[TokenLogprob]) -> None:
        """The log-probabilities of tokens whose text ``push`` gets next (ignored unless asked for)."""
        if self.logprobs is not None:
            self._unsent += logprobs

    def _take(self) -> list[dict[str, Any]]:
        entries = self.logprobs(self._unsent) if self.logprobs is not None and self._unsent else []
        self._unsent = []
        self._entries += entries
        return entries

    def push(self, events: list[AssistantEvent]) -> None:
        for event in events:
            if isinstance(event, ReasoningText):
                self._delta("reasoning", event.text)
            elif isinstance(event, ContentText):
                self._delta("message", event.text)
            else:
                self._call(event)

    def close(self, status: str = "completed") -> None:
        """Finish the open Item (``status``: completed, or incomplete when the output was cut)."""
        item = self._open
        if item is None:
            return
        self._open = None
        text = "".join(self._text)
        index = len(self.items) - 1
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            if self.seal is not None:
                item["encrypted_content"] = self.seal(text)
            self.emit("response.reasoning_text.done", {"item_id": item["id"], "output_index": index,
                                                       "content_index": 0, "text": text})
        else:
            self._take()
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self._entries}
            item["content"] = [part]
            self.emit("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                    "content_index": 0, "text": text, "logprobs": self._entries})
        item["status"] = status
        self.emit("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                 "content_index": 0, "part": part})
        self.emit("response.output_item.done", {"output_index": index, "item": item})

    def _delta(self, kind: str, text: str) -> None:
        if self._open is None or self._open["type"] != kind:
            self.close()
            if kind == "reasoning":
                item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items.append(item)
            self._open, self._text, self._entries = item, [], []
            index = len(self.items) - 1
            self.emit("response.output_item.added", {"output_index": index, "item": _copy(item)})
            self.emit("response.content_part.added", {"item_id": item["id"], "output_index": index,
                                                      "content_index": 0, "part": part})
        self._text.append(text)
        body = {"item_id": self._open["id"], "output_index": len(self.items) - 1, "content_index": 0,
                "delta": text}
        if kind == "reasoning":
            self._unsent = []
            self.emit("response.reasoning_text.delta", body)
        else:
            self.emit("response.output_text.delta", {**body, "logprobs": self._take()})

    def _call(self, call: ToolCall) -> None:
        self.close()
        self._unsent = []
        tool = self.tools[call.name]
        item: dict[str, Any] = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                                "arguments": "", "call_id": new_id("call_"),
                                "name": tool.public_name or tool.name}
        if tool.namespace:
            item["namespace"] = tool.namespace
        self.items.append(item)
        index = len(self.items) - 1
        self.emit("response.output_item.added", {"output_index": index, "item": _copy(item)})
        for piece in call.argument_pieces:
            self.emit("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                                 "delta": piece})
        item["arguments"] = call.arguments
        item["status"] = "completed"
        self.emit("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                            "arguments": call.arguments})
        self.emit("response.output_item.done", {"output_index": index, "item": _copy(item)})


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, list) else v) for k, v in item.items()}
