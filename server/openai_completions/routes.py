"""Route of the legacy Completions API."""
from __future__ import annotations

from fastapi import APIRouter, Request

from ..answer import answer_choices
from ..json_body import JSONBodyRoute
from ..state import state_of
from . import serving
from .protocol import CompletionRequest

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    state = state_of(request)
    c = await state.workers.run(serving.PreparedCompletion, body, state)
    return await answer_choices(request, state, c.prompt_ids, c.params, c.id, c.n, body.stream,
                                lambda _, outputs: serving.stream(c, outputs),
                                lambda outputs: serving.complete(c, outputs))
