"""Routes of the OpenAI-compatible API."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..state import ServerState
from . import serving
from .protocol import ChatCompletionRequest

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.ninfer


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    return {
        "object": "list",
        "data": [{
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "ninfer",
            "meta": {"context_length": state.max_context},
        }],
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = _state(request)
    chat = serving.PreparedChat(body, state)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        outputs = await _cancel_on_disconnect(request, serving.start(state, chat))
        return StreamingResponse(serving.stream(chat, outputs, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return JSONResponse(await _cancel_on_disconnect(request, serving.complete(state, chat)))


async def _cancel_on_disconnect(request: Request, work):
    """Run ``work``; if the client goes away first, cancel it (which aborts the engine request)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            break
    return await task
