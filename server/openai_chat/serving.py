"""Chat Completions: preparation, the engine call, aggregate and streamed responses."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from ...engine.frontend.assistant_output import AssistantOutputParser, ContentText, ReasoningText
from ...engine.frontend.tool_parser import ToolCall
from ...engine.outputs import RequestOutput, TokenLogprob
from ..errors import APIError
from ..generation import prepare, template_options
from ..logprobs import TokenText, new_logprobs, openai_entries
from ..openai_common import TimingClock, chat_usage, check_model, new_id, timings
from ..state import ServerState
from ..streaming import sse_data
from .protocol import ChatCompletionRequest, check_tool_history


class PreparedChat:
    def __init__(self, req: ChatCompletionRequest, state: ServerState) -> None:
        model = check_model(state, req.model)
        req.reject_unsupported()
        check_tool_history(req)
        callable_tools = req.callable_tools(req.function_tools())
        options = template_options(state, req.chat_template_kwargs, req.typed_template_options())
        self.prepared = prepare(
            state, req.template_messages(), tools=[t.template for t in callable_tools],
            tool_specs=[t.spec for t in callable_tools], options=options, sampling=req.sampling(state),
            thinking_budget=req.thinking_budget,
        )
        self.req = req
        self.id = new_id("chatcmpl-")
        self.created = int(time.time())
        self.model = model  # the name the request used, or the served model's id
        self.token_text = TokenText(state.tokenizer)

    def logprobs(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        """A choice's ``logprobs`` for these tokens (None when the request did not ask)."""
        if self.req.top is None:
            return None
        return {"content": openai_entries(self.token_text, logprobs, self.req.top), "refusal": None}

    def parser(self) -> AssistantOutputParser:
        return AssistantOutputParser(self.prepared.starts_in_reasoning, self.prepared.tools)


def _finish_reason(final: RequestOutput, calls: list[ToolCall]) -> str:
    if final.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


def _tool_call(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def complete(chat: PreparedChat, outputs: AsyncIterator[RequestOutput]) -> dict[str, Any]:
    parser = chat.parser()
    final: RequestOutput | None = None
    logprobs: list[TokenLogprob] = []
    async for out in outputs:
        parser.push(out.text)
        logprobs += new_logprobs(out)
        final = out
    parser.finish()
    assert final is not None and final.finished
    msg = parser.message
    message: dict[str, Any] = {"role": "assistant", "content": msg.content, "refusal": None}
    if msg.reasoning or chat.prepared.starts_in_reasoning:
        message["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        message["tool_calls"] = [_tool_call(c, new_id("call_")) for c in msg.tool_calls]
        message["content"] = msg.content or None
    return {
        "id": chat.id,
        "object": "chat.completion",
        "created": chat.created,
        "model": chat.model,
        "choices": [{"index": 0, "message": message, "logprobs": chat.logprobs(logprobs),
                     "finish_reason": _finish_reason(final, msg.tool_calls)}],
        "usage": chat_usage(final),
        "timings": timings(final),
    }


async def stream(chat: PreparedChat, admitted: RequestOutput, outputs: AsyncIterator[RequestOutput]
                 ) -> AsyncIterator[str]:
    req = chat.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    clock = TimingClock(admitted)

    # the log-probabilities of tokens not yet sent: they go with the next chunk that has a choice
    # (text the output parser holds back, such as a possible tool call's start, comes later)
    unsent: list[TokenLogprob] = []

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> str:
        choices = []
        if delta is not None:
            choices = [{"index": 0, "delta": delta, "logprobs": chat.logprobs(unsent) if unsent else None,
                        "finish_reason": finish}]
            unsent.clear()
        return sse_data({"id": chat.id, "object": "chat.completion.chunk", "created": chat.created,
                         "model": chat.model, "choices": choices, **extra})

    def visible(delta: dict[str, Any]) -> str:
        return chunk(delta, timings=clock.snapshot()) if req.timings_per_token else chunk(delta)

    def progress(processed: int) -> str:
        return chunk(None, prompt_progress={"total": admitted.prompt_tokens, "cache": admitted.cached_tokens,
                                            "processed": processed,
                                            "time_ms": int((time.monotonic() - clock.t0) * 1000)})

    yield chunk({"role": "assistant", "content": ""})
    if req.return_progress:
        yield progress(admitted.cached_tokens)
    parser = chat.parser()
    prefilled = False
    last_progress = admitted.cached_tokens
    try:
        async for out in outputs:
            clock.observe(out)
            unsent += new_logprobs(out)
            if out.prompt_processed is not None:
                if req.return_progress and out.prompt_processed > last_progress:
                    last_progress = out.prompt_processed
                    yield progress(out.prompt_processed)
                continue
            if req.return_progress and not prefilled and (out.completion_tokens or out.finished):
                prefilled = True
                yield progress(admitted.prompt_tokens)
            events = parser.push(out.text) + (parser.finish() if out.finished else [])
            for event in events:
                if isinstance(event, ReasoningText):
                    yield visible({"reasoning_content": event.text})
                elif isinstance(event, ContentText):
                    yield visible({"content": event.text})
                else:
                    head = {"index": event.index, "id": new_id("call_"), "type": "function",
                            "function": {"name": event.name, "arguments": ""}}
                    yield chunk({"tool_calls": [head]})
                    for piece in event.argument_pieces:
                        yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": piece}}]})
            if out.finished:
                reason = _finish_reason(out, parser.message.tool_calls)
                if include_usage:
                    yield chunk({}, reason)
                    yield chunk(None, usage=chat_usage(out), timings=timings(out))
                else:
                    yield chunk({}, reason, timings=timings(out))
    except APIError as exc:
        yield sse_data(exc.body())
    yield sse_data("[DONE]")
