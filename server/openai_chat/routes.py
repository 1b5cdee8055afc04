"""Route of the Chat Completions API."""
from __future__ import annotations

from fastapi import APIRouter, Request

from ..answer import answer_choices
from ..generation import tools_left_out
from ..json_body import JSONBodyRoute
from ..state import state_of
from . import serving
from .protocol import ChatCompletionRequest

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    state = state_of(request)
    chat = await state.workers.run(serving.PreparedChat, body, state)
    p = chat.prepared
    return await answer_choices(request, state, p.prompt_ids, p.params, chat.id, chat.n, body.stream,
                                lambda admitted, outputs: serving.stream(chat, admitted, outputs),
                                lambda outputs: serving.complete(chat, outputs),
                                omitted_tools=tools_left_out(state, p.tools), keep=p.keep, media=p.media)
