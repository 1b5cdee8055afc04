"""Route of the legacy Completions API."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..cancellation import cancel_on_disconnect
from ..generation import start
from ..state import state_of
from ..streaming import sse_response
from . import serving
from .protocol import CompletionRequest

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = state_of(request)
    c = serving.PreparedCompletion(body, state)
    _, outputs = await cancel_on_disconnect(request, start(state, c.prompt_ids, c.params, c.id))
    if body.stream:
        return sse_response(serving.stream(c, outputs), state.keepalive_s)
    return JSONResponse(await cancel_on_disconnect(request, serving.complete(c, outputs)))
