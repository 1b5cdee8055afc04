"""Route of the Chat Completions API."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..generation import start
from ..state import state_of
from ..cancellation import cancel_on_disconnect
from ..streaming import sse_response
from . import serving
from .protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = state_of(request)
    chat = serving.PreparedChat(body, state)
    p = chat.prepared
    admitted, outputs = await cancel_on_disconnect(request, start(state, p.prompt_ids, p.params, chat.id))
    if body.stream:
        return sse_response(serving.stream(chat, admitted, outputs), state.keepalive_s)
    return JSONResponse(await cancel_on_disconnect(request, serving.complete(chat, outputs)))
