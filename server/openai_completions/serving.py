"""Legacy Completions: the prompt as given, the engine call, aggregate and streamed responses."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from ...engine.outputs import RequestOutput
from ..errors import APIError, invalid
from ..generation import check_context_floor, check_prompt, check_token_ids, sampling_params
from ..logprobs import LegacyLogprobs, TokenText, new_logprobs
from ..choices import all_of, combined, merged
from ..openai_common import check_choices, check_model, new_id, timings
from ..state import ServerState
from ..streaming import sse_data
from .protocol import CompletionRequest


class PreparedCompletion:
    def __init__(self, req: CompletionRequest, state: ServerState) -> None:
        model = check_model(state, req.model)
        req.reject_unsupported()
        self.n = check_choices(state, req.n)
        prompt = req.one_prompt()
        if isinstance(prompt, str):
            check_context_floor(state, state.tokenizer.min_tokens(prompt), "prompt")
            self.prompt_text, self.prompt_ids = prompt, state.tokenizer.encode(prompt)
            if not self.prompt_ids:
                raise invalid("prompt", "the prompt is empty")
        else:
            check_token_ids(state, prompt, "prompt")
            self.prompt_ids = list(prompt)
            self.prompt_text = state.tokenizer.decode(self.prompt_ids) if req.echo else ""
        check_prompt(state, self.prompt_ids, "prompt")
        self.params = sampling_params(state, req.sampling(state))
        self.req = req
        self.id = new_id("cmpl-")
        self.created = int(time.time())
        self.model = model  # the name the request used, or the served model's id
        self.token_text = TokenText(state.tokenizer)

    def logprobs(self) -> LegacyLogprobs | None:
        """The answer's ``logprobs`` builder (None when the request did not ask)."""
        return None if self.req.logprobs is None else LegacyLogprobs(self.token_text, self.req.logprobs)


def _usage(final: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def _finish_reason(final: RequestOutput) -> str:
    return "length" if final.finish_reason == "length" else "stop"


async def _choice(c: PreparedCompletion, index: int, outputs: AsyncIterator[RequestOutput]
                  ) -> tuple[dict[str, Any], RequestOutput]:
    text = [c.prompt_text] if c.req.echo else []
    final: RequestOutput | None = None
    logprobs = []
    async for out in outputs:
        text.append(out.text)
        logprobs += new_logprobs(out)
        final = out
    assert final is not None and final.finished
    builder = c.logprobs()
    return {"index": index, "text": "".join(text), "logprobs": builder and builder.add(logprobs),
            "finish_reason": _finish_reason(final)}, final


async def complete(c: PreparedCompletion, outputs: list[AsyncIterator[RequestOutput]]) -> dict[str, Any]:
    """The whole answer, one choice per iterator (``n``)."""
    done = await all_of([_choice(c, i, o) for i, o in enumerate(outputs)])
    finals = [final for _, final in done]
    return {
        "id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
        "choices": [choice for choice, _ in done],
        "usage": _usage(combined(finals)),
        "timings": timings(finals[0]),
    }


async def stream(c: PreparedCompletion, outputs: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    """SSE chunks of every choice (``index``) as their outputs arrive."""
    include_usage = bool(c.req.stream_options and c.req.stream_options.include_usage)
    builders = [c.logprobs() for _ in outputs]
    finals: list[RequestOutput | None] = [None] * len(outputs)

    def chunk(text: str | None, finish: str | None = None, out: RequestOutput | None = None, index: int = 0,
              **extra: Any) -> str:
        builder = builders[index]
        logprobs = None if builder is None or out is None else builder.add(new_logprobs(out))
        choices = [] if text is None else [{"index": index, "text": text, "logprobs": logprobs,
                                            "finish_reason": finish}]
        return sse_data({"id": c.id, "object": "text_completion", "created": c.created, "model": c.model,
                         "choices": choices, **extra})

    if c.req.echo and c.prompt_text:
        for i in range(len(outputs)):
            yield chunk(c.prompt_text, index=i)
    try:
        async for i, out in merged(outputs):
            if out.finished:
                finals[i] = out
                yield chunk(out.text, _finish_reason(out), out, i,
                            **({} if include_usage else {"timings": timings(out)}))
            elif out.text or (builders[i] is not None and out.logprobs):
                yield chunk(out.text, None, out, i)
        if include_usage:
            yield chunk(None, usage=_usage(combined(finals)), timings=timings(finals[0]))
    except APIError as exc:
        yield sse_data(exc.body())
    yield sse_data("[DONE]")
