"""Server-sent events for every API family.

``sse_response`` wraps an async iterator of SSE frames in a streaming response that sends a
keep-alive whenever ``interval`` seconds pass without a frame: a ``: keep-alive`` comment (SSE
clients ignore it), or the API's own idle event where its clients count only events as signs of
life (Anthropic's ``ping``; a Responses ``response.in_progress``: Codex drops a stream after five
minutes without an event, which a long prompt on a small GPU can take to prefill).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

KEEPALIVE = ": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_data(body: Any) -> str:
    """One ``data:`` frame with a JSON body (or a literal such as ``[DONE]``)."""
    text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return f"data: {text}\n\n"


def sse_event(event: str, body: Any) -> str:
    """One frame with an ``event:`` name and a JSON body."""
    return f"event: {event}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def with_keepalive(frames: AsyncIterator[str], interval: float,
                         keepalive: Callable[[], str] | None = None) -> AsyncIterator[str]:
    """``frames``, with a keep-alive after each ``interval`` seconds of silence: ``keepalive()``
    (a frame of the API's own), else a comment.

    One task per response runs ``frames`` and hands each frame over; the response waits on a
    plain future with a timer, so a frame costs no task and no ``asyncio.wait`` (at 64 streams
    the gateway handles thousands of frames a second on one thread). Frames that piled up while
    the response was sending go out together."""
    loop = asyncio.get_running_loop()
    ready: list[str] = []
    waiter: asyncio.Future | None = None
    finished = False
    failure: BaseException | None = None

    def wake() -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def produce() -> None:
        nonlocal finished, failure
        try:
            async for frame in frames:
                ready.append(frame)
                wake()
        except Exception as exc:  # noqa: BLE001 - raised again on the response's side
            failure = exc
        finally:
            finished = True
            wake()

    producer = loop.create_task(produce())
    try:
        while True:
            if ready:
                batch = "".join(ready)
                ready.clear()
                yield batch
                continue
            if finished:
                if failure is not None:
                    raise failure
                return
            waiter = loop.create_future()
            timer = loop.call_later(interval, wake)
            try:
                await waiter
            finally:
                timer.cancel()
                waiter = None
            if not ready and not finished:
                yield KEEPALIVE if keepalive is None else keepalive()
    finally:
        if not producer.done():
            producer.cancel()
            try:
                await producer
            except asyncio.CancelledError:
                pass


def sse_response(frames: AsyncIterator[str], interval: float,
                 keepalive: Callable[[], str] | None = None) -> StreamingResponse:
    return StreamingResponse(with_keepalive(frames, interval, keepalive), media_type="text/event-stream",
                             headers=SSE_HEADERS)
