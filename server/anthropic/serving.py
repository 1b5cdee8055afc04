"""Messages: preparation, and the engine's output as Anthropic content blocks, whole or streamed.

The model's text goes through the shared ``AssistantOutputParser`` (reasoning, answer text, Qwen
tool calls); ``BlockBuilder`` turns its events into the block lifecycle: a ``thinking`` block
(closed with an opaque signature), ``text`` blocks and ``tool_use`` blocks, in output order.
"""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ...engine.frontend.assistant_output import AssistantOutputParser, ContentText, ReasoningText
from ...engine.frontend.tool_parser import ToolCall
from ...engine.outputs import RequestOutput
from ..errors import APIError
from ..media import expand, images_of
from ..generation import Sampling, check_prompt, keep_for, rendered_prompt, sampling_params, thinking_control
from ..openai_common import check_model, new_id
from ..state import ServerState
from ..streaming import sse_event
from . import context_edits
from .convert import Lowered, lower
from .errors import error_body
from .protocol import MessagesRequest

SIGNATURE_PREFIX = b"ninfer-thinking-v1:"


def signature(thinking: str) -> str:
    """An opaque stand-in for Anthropic's signature: lowering ignores it (thinking is restored from
    its visible text), so any value a client sends back is accepted."""
    return base64.b64encode(SIGNATURE_PREFIX + hashlib.sha256(thinking.encode()).digest()).decode()


@dataclass
class Prompt:
    text: str
    ids: list[int]
    applied: list[dict[str, Any]]  # context edits, as ``context_management.applied_edits`` reports them
    original_tokens: int  # before the edits
    marks: tuple[int, ...] = ()  # where prefix checkpoints go in ``ids`` (``generation.rendered_prompt``)
    media: Any = None  # the images (MediaPrompt), their placeholders expanded in ``ids``


def build_prompt(state: ServerState, low: Lowered) -> Prompt:
    tools = [t.template for t in low.tools.tools]
    # of each rendering (context edits may render several and keep one): its messages and marks
    renderings: dict[int, tuple[list[int], list[dict[str, Any]], tuple[int, ...]]] = {}

    def render(messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        text, ids, marks = rendered_prompt(state, messages, tools, low.options)
        if low.prefill is not None:
            text += low.prefill
            ids = state.tokenizer.encode(text)
        renderings[id(ids)] = (ids, messages, marks)  # the ids held: no other list takes their id
        return text, ids

    prompt = Prompt(*context_edits.apply(low.edits or [], low.messages, render))
    _, messages, prompt.marks = renderings.get(id(prompt.ids), (None, low.messages, ()))
    images = images_of(state, messages)  # those of the messages kept; on a worker thread, as the whole preparation
    if images:
        prompt.ids, prompt.media, marks = expand(state, prompt.ids, images, prompt.marks)
        prompt.marks = marks or ()
    return prompt


def count_tokens(req: MessagesRequest, state: ServerState) -> dict[str, Any]:
    check_model(state, req.model)
    low = lower(req, state)
    prompt = build_prompt(state, low)
    out: dict[str, Any] = {"input_tokens": len(prompt.ids)}
    if low.edits is not None:
        out["context_management"] = {"original_input_tokens": prompt.original_tokens}
    return out


class PreparedMessages:
    def __init__(self, req: MessagesRequest, state: ServerState) -> None:
        check_model(state, req.model)  # refuses only under --strict-model-names
        low = lower(req, state)
        prompt = build_prompt(state, low)
        text, ids = prompt.text, prompt.ids
        check_prompt(state, ids)
        # what the response reports: present when the request asked for context management
        self.context_management = None if low.edits is None else {"applied_edits": prompt.applied}
        max_tokens = req.max_tokens if req.max_tokens is not None else state.default_max_tokens
        if low.thinking.budget is not None and max_tokens is not None and low.thinking.budget >= max_tokens:
            raise APIError(400, f"thinking.budget_tokens ({low.thinking.budget}) must be less than the output "
                           f"limit ({max_tokens})", "thinking.budget_tokens", "invalid_value")
        self.starts_in_reasoning, control = thinking_control(state, text, len(ids), max_tokens, low.thinking.budget,
                                                             "thinking.budget_tokens")
        sampling = Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                            max_tokens=req.max_tokens, stop=list(req.stop_sequences or []),
                            grammar=low.tools.grammar())
        self.params = sampling_params(state, sampling, control)
        self.prompt_ids = ids
        self.media = prompt.media
        self.keep = keep_for(state, tuple(m for m in prompt.marks if m <= len(ids)), low.options)
        self.tools = [t.spec for t in low.tools.tools]
        self.stop_sequences = set(req.stop_sequences or [])
        self.max_context = state.max_context
        self.id = new_id("msg_")
        self.model = req.model  # echoed: the label does not select the model

    def parser(self) -> AssistantOutputParser:
        return AssistantOutputParser(self.starts_in_reasoning, self.tools)

    def stop(self, final: RequestOutput, calls: bool) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence``."""
        if final.finish_reason == "length":
            at_limit = final.prompt_tokens + final.completion_tokens >= self.max_context
            return ("model_context_window_exceeded" if at_limit else "max_tokens"), None
        if isinstance(final.stop_reason, str) and final.stop_reason in self.stop_sequences:
            return "stop_sequence", final.stop_reason
        return ("tool_use" if calls else "end_turn"), None


def usage(out: RequestOutput, output_tokens: int | None = None) -> dict[str, Any]:
    return {
        "input_tokens": out.prompt_tokens - out.cached_tokens,
        "output_tokens": out.completion_tokens if output_tokens is None else output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": out.cached_tokens,
    }


class BlockBuilder:
    """Assistant events -> content blocks. ``feed`` returns the SSE events they cause; ``blocks``
    is the aggregate content so far."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.calls = 0
        self._open: str | None = None  # type of the last block while it is open

    def feed(self, event: ReasoningText | ContentText | ToolCall) -> list[tuple[str, dict[str, Any]]]:
        if isinstance(event, ReasoningText):
            return self._text("thinking", event.text)
        if isinstance(event, ContentText):
            return self._text("text", event.text)
        return self._tool_use(event)

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        index, block = len(self.blocks) - 1, self.blocks[-1]
        events = []
        if self._open == "thinking":
            block["signature"] = signature(block["thinking"])
            events.append(_delta(index, {"type": "signature_delta", "signature": block["signature"]}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None
        return events

    def _text(self, kind: str, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        events = []
        if self._open != kind:
            events += self.close()
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self.blocks.append(empty)
            self._open = kind
            events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                   "content_block": dict(empty)}))
        self.blocks[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        events.append(_delta(len(self.blocks) - 1, delta))
        return events

    def _tool_use(self, call: ToolCall) -> list[tuple[str, dict[str, Any]]]:
        events = self.close()
        block = {"type": "tool_use", "id": new_id("toolu_"), "name": call.name, "input": call.arguments_dict}
        self.blocks.append(block)
        self.calls += 1
        index = len(self.blocks) - 1
        events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": {**block, "input": {}}}))
        for piece in call.argument_pieces or (call.arguments,):
            events.append(_delta(index, {"type": "input_json_delta", "partial_json": piece}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events


def _delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


async def complete(prep: PreparedMessages, outputs: AsyncIterator[RequestOutput]) -> dict[str, Any]:
    parser, builder = prep.parser(), BlockBuilder()
    final: RequestOutput | None = None
    async for out in outputs:
        for event in parser.push(out.text):
            builder.feed(event)
        final = out
    for event in parser.finish():
        builder.feed(event)
    builder.close()
    assert final is not None and final.finished
    reason, sequence = prep.stop(final, builder.calls > 0)
    body = {"id": prep.id, "type": "message", "role": "assistant", "model": prep.model, "content": builder.blocks,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(final)}
    if prep.context_management is not None:
        body["context_management"] = prep.context_management
    return body


async def stream(prep: PreparedMessages, admitted: RequestOutput, outputs: AsyncIterator[RequestOutput]
                 ) -> AsyncIterator[str]:
    """message_start (usage as admitted), ping, the blocks' start / delta / stop events,
    message_delta (stop reason, cumulative usage, applied context edits), message_stop; an
    ``error`` event on failure."""
    parser, builder = prep.parser(), BlockBuilder()
    start = {"id": prep.id, "type": "message", "role": "assistant", "model": prep.model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": usage(admitted, 0)}
    yield sse_event("message_start", {"type": "message_start", "message": start})
    yield sse_event("ping", {"type": "ping"})
    try:
        async for out in outputs:
            for event in parser.push(out.text):
                for name, body in builder.feed(event):
                    yield sse_event(name, body)
            if out.finished:
                for event in parser.finish():
                    for name, body in builder.feed(event):
                        yield sse_event(name, body)
                for name, body in builder.close():
                    yield sse_event(name, body)
                reason, sequence = prep.stop(out, builder.calls > 0)
                delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": usage(out)}
                if prep.context_management is not None:
                    delta["context_management"] = prep.context_management
                yield sse_event("message_delta", delta)
                yield sse_event("message_stop", {"type": "message_stop"})
    except APIError as exc:
        _, body = error_body(exc.status, exc.body(), None)
        yield sse_event("error", body)
