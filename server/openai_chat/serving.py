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
from ..choices import all_of, combined, merged
from ..openai_common import TimingClock, chat_usage, check_choices, check_model, new_id, timings
from ..state import ServerState
from ..streaming import sse_data
from .protocol import ChatCompletionRequest, check_tool_history


class PreparedChat:
    def __init__(self, req: ChatCompletionRequest, state: ServerState) -> None:
        model = check_model(state, req.model)
        req.reject_unsupported()
        self.n = check_choices(state, req.n)
        check_tool_history(req)
        use = req.tool_use(req.function_tools())
        options = template_options(state, req.chat_template_kwargs, req.typed_template_options())
        self.prepared = prepare(
            state, req.template_messages(), tools=[t.template for t in use.tools],
            tool_specs=[t.spec for t in use.tools], options=options, sampling=req.sampling(state, use),
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


async def _choice(chat: PreparedChat, index: int, outputs: AsyncIterator[RequestOutput]
                  ) -> tuple[dict[str, Any], RequestOutput]:
    """One choice of an aggregate answer, and its final output."""
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
    return {"index": index, "message": message, "logprobs": chat.logprobs(logprobs),
            "finish_reason": _finish_reason(final, msg.tool_calls)}, final


async def complete(chat: PreparedChat, outputs: list[AsyncIterator[RequestOutput]]) -> dict[str, Any]:
    """The whole answer, one choice per iterator (``n``)."""
    done = await all_of([_choice(chat, i, o) for i, o in enumerate(outputs)])
    finals = [final for _, final in done]
    return {
        "id": chat.id,
        "object": "chat.completion",
        "created": chat.created,
        "model": chat.model,
        "choices": [choice for choice, _ in done],
        "usage": chat_usage(combined(finals)),
        "timings": timings(finals[0]),
    }


class _Streamed:
    """One choice of a stream: its output parser and the log-probabilities not yet sent (they go
    with its next chunk: text the parser holds back, such as a possible tool call's start, comes
    later)."""

    def __init__(self, chat: PreparedChat) -> None:
        self.parser = chat.parser()
        self.unsent: list[TokenLogprob] = []
        self.final: RequestOutput | None = None


async def stream(chat: PreparedChat, admitted: list[RequestOutput], outputs: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[str]:
    """SSE chunks of every choice (``index``) as their outputs arrive; prompt progress and
    per-token timings follow the first choice, which computes the prompt."""
    req = chat.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    clock = TimingClock(admitted[0])
    choices = [_Streamed(chat) for _ in outputs]

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, index: int = 0, **extra: Any) -> str:
        body = []
        if delta is not None:
            c = choices[index]
            body = [{"index": index, "delta": delta, "logprobs": chat.logprobs(c.unsent) if c.unsent else None,
                     "finish_reason": finish}]
            c.unsent = []
        return sse_data({"id": chat.id, "object": "chat.completion.chunk", "created": chat.created,
                         "model": chat.model, "choices": body, **extra})

    def visible(delta: dict[str, Any], index: int) -> str:
        if req.timings_per_token:
            return chunk(delta, None, index, timings=clock.snapshot())
        return chunk(delta, None, index)

    def progress(processed: int) -> str:
        first = admitted[0]
        return chunk(None, prompt_progress={"total": first.prompt_tokens, "cache": first.cached_tokens,
                                            "processed": processed,
                                            "time_ms": int((time.monotonic() - clock.t0) * 1000)})

    for i in range(len(choices)):
        yield chunk({"role": "assistant", "content": ""}, index=i)
    if req.return_progress:
        yield progress(admitted[0].cached_tokens)
    prefilled = False
    last_progress = admitted[0].cached_tokens
    try:
        async for i, out in merged(outputs):
            c = choices[i]
            if i == 0:
                clock.observe(out)
            c.unsent += new_logprobs(out)
            if out.prompt_processed is not None:
                if i == 0 and req.return_progress and out.prompt_processed > last_progress:
                    last_progress = out.prompt_processed
                    yield progress(out.prompt_processed)
                continue
            if i == 0 and req.return_progress and not prefilled and (out.completion_tokens or out.finished):
                prefilled = True
                yield progress(admitted[0].prompt_tokens)
            events = c.parser.push(out.text) + (c.parser.finish() if out.finished else [])
            for event in events:
                if isinstance(event, ReasoningText):
                    yield visible({"reasoning_content": event.text}, i)
                elif isinstance(event, ContentText):
                    yield visible({"content": event.text}, i)
                else:
                    head = {"index": event.index, "id": new_id("call_"), "type": "function",
                            "function": {"name": event.name, "arguments": ""}}
                    yield chunk({"tool_calls": [head]}, None, i)
                    for piece in event.argument_pieces:
                        yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": piece}}]}, None, i)
            if out.finished:
                c.final = out
                reason = _finish_reason(out, c.parser.message.tool_calls)
                yield chunk({}, reason, i) if include_usage else chunk({}, reason, i, timings=timings(out))
        if include_usage:
            finals = [c.final for c in choices]
            yield chunk(None, usage=chat_usage(combined(finals)), timings=timings(finals[0]))
    except APIError as exc:
        yield sse_data(exc.body())
    yield sse_data("[DONE]")
