"""Work that is cancelled when the HTTP client goes away (which aborts the engine request)."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from fastapi import Request

from .errors import ClientDisconnected

POLL_S = 0.25


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``
    (an ordinary end of the request: the app answers it with a status no one reads, no traceback)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if not done and await request.is_disconnected():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if current is not None and getattr(current, "cancelling", lambda: 0)():
                        raise  # this coroutine is being cancelled too (Task.cancelling: 3.11+)
                raise ClientDisconnected
    finally:
        if not task.done():  # this coroutine itself was cancelled (server shutdown)
            task.cancel()
    return task.result()
