"""Work that is cancelled when the HTTP client goes away (which aborts the engine request)."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from fastapi import Request

POLL_S = 0.25


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and re-raise the cancellation."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=POLL_S)
        if not done and await request.is_disconnected():
            task.cancel()
            break
    return await task
