"""The generation routes' common ending: admit the request, then answer it as an SSE stream or
as one JSON body. The client going away cancels the request in both cases. A request carrying
several prompts (llama.cpp's batch) runs them side by side (``answer_batch``)."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams
from .cancellation import cancel_on_disconnect
from .choices import merged, start_choices
from .generation import Keep, start
from .state import ServerState
from .streaming import sse_response

Outputs = AsyncIterator[RequestOutput]
OMITTED_TOOLS_HEADER = "x-ninfer-omitted-tools"


def name_omitted_tools(response: Response, omitted: Sequence[str]) -> Response:
    """Name the tools left out of the prompt (hosted tool types the server cannot run, or every
    function where the chat template has no place for tools), so a client can see what it lacks."""
    if omitted:
        response.headers[OMITTED_TOOLS_HEADER] = ",".join(omitted)
    return response


async def answer(request: Request, state: ServerState, prompt_ids: list[int], params: SamplingParams,
                 request_id: str, stream: bool | None,
                 frames: Callable[[RequestOutput, Outputs], AsyncIterator[str]],
                 whole: Callable[[Outputs], Awaitable[Any]],
                 keepalive: Callable[[], str] | None = None,
                 omitted_tools: Sequence[str] = (),
                 keep: Keep = Keep(), media: Any = None) -> StreamingResponse | JSONResponse:
    """``frames(admitted, outputs)`` gives the SSE frames of a streamed answer, ``whole(outputs)``
    the JSON body of a complete one; ``keepalive()`` the API's idle frame (default: a comment);
    ``omitted_tools`` are named in a header; ``keep``: where prefix checkpoints are kept;
    ``media``: the prompt's images (``server/media.py``)."""
    return await answer_choices(request, state, prompt_ids, params, request_id, 1, stream,
                                lambda admitted, outputs: frames(admitted[0], outputs[0]),
                                lambda outputs: whole(outputs[0]), keepalive, omitted_tools, keep, media)


async def answer_choices(request: Request, state: ServerState, prompt_ids: list[int], params: SamplingParams,
                         request_id: str, n: int, stream: bool | None,
                         frames: Callable[[list[RequestOutput], list[Outputs]], AsyncIterator[str]],
                         whole: Callable[[list[Outputs]], Awaitable[Any]],
                         keepalive: Callable[[], str] | None = None,
                         omitted_tools: Sequence[str] = (),
                         keep: Keep = Keep(), media: Any = None) -> StreamingResponse | JSONResponse:
    """``answer`` for ``n`` choices of one prompt (``choices.py``): ``frames`` and ``whole`` get
    one admission output and one iterator per choice."""
    admitted, outputs = await cancel_on_disconnect(
        request, start_choices(state, prompt_ids, params, request_id, n, keep, media))
    if stream:
        return name_omitted_tools(sse_response(frames(admitted, outputs), state.keepalive_s, keepalive),
                                  omitted_tools)
    return name_omitted_tools(JSONResponse(await cancel_on_disconnect(request, whole(outputs))), omitted_tools)


class Job:
    """One prompt of a request that carries several (a batch): its engine request and how its
    outputs become its SSE frames or its part of the JSON answer."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 frames: Callable[[Outputs], AsyncIterator[str]] | None,
                 whole: Callable[[Outputs], Awaitable[Any]]) -> None:
        self.prompt_ids, self.params, self.request_id = prompt_ids, params, request_id
        self.frames, self.whole = frames, whole


async def _first_failure(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; on the first failure cancel the rest and raise it."""
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _start_all(state: ServerState, jobs: Sequence[Job]) -> list[Outputs]:
    """Submit every job and wait for each one's admission; if one is refused (the server at
    capacity, a queue timeout), those already in are cancelled and the refusal raised."""
    started: list[Outputs] = []
    try:
        for job in jobs:
            started.append((await start(state, job.prompt_ids, job.params, job.request_id))[1])
    except BaseException:
        for outputs in started:
            await outputs.aclose()
        raise
    return started


async def answer_batch(request: Request, state: ServerState, jobs: Sequence[Job],
                       stream: bool | None) -> StreamingResponse | JSONResponse:
    """Several prompts of one request run side by side. Aggregate: a JSON list of the jobs' bodies
    in order (``run_batch``). Streamed: every job admitted first (a batch the queue cannot hold is
    refused whole), then their frames interleaved as they come (each frame carries its job's
    ``index``). The client going away cancels them all."""
    if not stream:
        return JSONResponse(await run_batch(request, state, jobs))
    started = await cancel_on_disconnect(request, _start_all(state, jobs))
    return sse_response(_merged(jobs, started), state.keepalive_s)


async def run_batch(request: Request, state: ServerState, jobs: Sequence[Job]) -> list[Any]:
    """Every job's ``whole`` result, in order. At most ``--max-concurrency`` of them are in the
    engine at once, the next submitted as one ends, so a batch larger than the queue (a RAG
    client's thousand chunks) is answered, not refused; the first failure (or the client going
    away) cancels the others."""
    lanes = asyncio.Semaphore(state.engine.config.max_concurrency)

    async def one(job: Job) -> Any:
        async with lanes:
            outputs = (await start(state, job.prompt_ids, job.params, job.request_id))[1]
            try:
                return await job.whole(outputs)
            finally:
                await outputs.aclose()

    tasks = [asyncio.ensure_future(one(job)) for job in jobs]
    await cancel_on_disconnect(request, _first_failure(tasks))
    return [task.result() for task in tasks]


async def _merged(jobs: Sequence[Job], started: list[Outputs]) -> AsyncIterator[str]:
    """Every job's frames, each as soon as it comes (``choices.merged``); leaving closes them all."""
    try:
        async for _, frame in merged([job.frames(outputs) for job, outputs in zip(jobs, started)]):
            yield frame
    finally:
        for outputs in started:
            await outputs.aclose()
