"""Chat Completions: prompt rendering, engine call, aggregate and streamed responses."""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from ...engine.async_engine import EngineError
from ...engine.frontend.chat_template import TemplateError
from ...engine.outputs import RequestOutput
from ...engine.sampling_params import SamplingParamError
from ..errors import APIError, engine_error
from ..state import ServerState
from .protocol import ChatCompletionRequest


class PreparedChat:
    def __init__(self, req: ChatCompletionRequest, state: ServerState) -> None:
        if req.model != state.model_id:
            raise APIError(400, f"model '{req.model}' does not exist; this server serves '{state.model_id}'",
                           "model", "model_not_found")
        req.reject_unsupported()
        try:
            prompt = state.template.render(req.template_messages(), add_generation_prompt=True,
                                           **req.template_kwargs())
        except TemplateError as exc:
            raise APIError(400, f"chat template: {exc}", "messages", "invalid_value") from exc
        self.prompt_ids = state.tokenizer.encode(prompt)
        if len(self.prompt_ids) >= state.max_context:
            raise APIError(400, f"the prompt has {len(self.prompt_ids)} tokens; this server's context is "
                           f"{state.max_context} tokens", "messages", "context_length_exceeded")
        try:
            self.params = req.sampling_params(state.sampling)
        except SamplingParamError as exc:
            raise APIError(400, str(exc), exc.param, "invalid_value") from exc
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = state.model_id


def _usage(final: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _timings(final: RequestOutput) -> dict[str, Any] | None:
    if final.prefill_time is None:
        return None
    decoded = max(final.completion_tokens - 1, 0)
    decode_s = final.decode_time or 0.0
    return {
        "prompt_n": final.prompt_tokens - final.cached_tokens,
        "prompt_ms": final.prefill_time * 1000.0,
        "prompt_per_second": (final.prompt_tokens - final.cached_tokens) / final.prefill_time
        if final.prefill_time else None,
        "predicted_n": final.completion_tokens,
        "predicted_ms": decode_s * 1000.0,
        "predicted_per_second": decoded / decode_s if decode_s > 0 else None,
    }


def _finish_reason(final: RequestOutput) -> str:
    return "length" if final.finish_reason == "length" else "stop"


async def _run(state: ServerState, chat: PreparedChat) -> AsyncIterator[RequestOutput]:
    try:
        async for out in state.engine.generate(chat.prompt_ids, chat.params, chat.id):
            yield out
    except EngineError as exc:
        raise engine_error(exc) from exc


async def start(state: ServerState, chat: PreparedChat) -> AsyncIterator[RequestOutput]:
    """Submit and wait for admission, so that overload and queue timeouts are HTTP errors."""
    outputs = _run(state, chat)
    first = await anext(outputs)
    if not first.admitted:
        raise RuntimeError("engine published output before admission")
    return outputs


async def complete(state: ServerState, chat: PreparedChat) -> dict[str, Any]:
    text: list[str] = []
    final: RequestOutput | None = None
    async for out in _run(state, chat):
        text.append(out.text)
        final = out
    assert final is not None and final.finished
    body = {
        "id": chat.id,
        "object": "chat.completion",
        "created": chat.created,
        "model": chat.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": "".join(text)},
            "logprobs": None,
            "finish_reason": _finish_reason(final),
        }],
        "usage": _usage(final),
    }
    timings = _timings(final)
    if timings:
        body["timings"] = timings
    return body


async def stream(chat: PreparedChat, outputs: AsyncIterator[RequestOutput], include_usage: bool
                 ) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        body = {
            "id": chat.id,
            "object": "chat.completion.chunk",
            "created": chat.created,
            "model": chat.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **extra,
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for out in outputs:
            if out.text:
                yield chunk({"content": out.text})
            if out.finished:
                extra = {"timings": t} if (t := _timings(out)) else {}
                yield chunk({}, _finish_reason(out), **extra)
                if include_usage:
                    usage = {"id": chat.id, "object": "chat.completion.chunk", "created": chat.created,
                             "model": chat.model, "choices": [], "usage": _usage(out)}
                    yield f"data: {json.dumps(usage)}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"
