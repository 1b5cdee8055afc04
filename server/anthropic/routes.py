"""Routes of the Anthropic Messages API, and ``install`` (routes + error envelope)."""
from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from ..answer import answer
from ..generation import tools_left_out
from ..json_body import JSONBodyRoute
from ..state import state_of
from ..streaming import sse_event
from . import serving
from .errors import AnthropicEnvelope
from .protocol import MessagesRequest

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    state = state_of(request)
    prep = await state.workers.run(serving.PreparedMessages, body, state)
    return await answer(request, state, prep.prompt_ids, prep.params, prep.id, body.stream,
                        lambda admitted, outputs: serving.stream(prep, admitted, outputs),
                        lambda outputs: serving.complete(prep, outputs),
                        keepalive=lambda: sse_event("ping", {"type": "ping"}),
                        omitted_tools=tools_left_out(state, prep.tools), keep=prep.keep, media=prep.media)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: MessagesRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    return JSONResponse(await state.workers.run(serving.count_tokens, body, state))


def install(app: FastAPI) -> None:
    """The routes, and the envelope middleware (call after the auth middleware is added)."""
    app.include_router(router)
    app.add_middleware(AnthropicEnvelope)
