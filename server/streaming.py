"""Server-sent events for every API family.

``sse_response`` wraps an async iterator of SSE frames in a streaming response that sends a
``: keep-alive`` comment whenever ``interval`` seconds pass without a frame (the comment is
transport only: SSE clients ignore it).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

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


async def with_keepalive(frames: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """``frames``, with a keep-alive comment after each ``interval`` seconds of silence."""
    iterator = frames.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            try:
                frame = pending.result()
            except StopAsyncIteration:
                pending = None
                return
            pending = None
            yield frame
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration, Exception):
                pass
        closer = getattr(iterator, "aclose", None)
        if closer is not None:
            await closer()


def sse_response(frames: AsyncIterator[str], interval: float) -> StreamingResponse:
    return StreamingResponse(with_keepalive(frames, interval), media_type="text/event-stream", headers=SSE_HEADERS)
