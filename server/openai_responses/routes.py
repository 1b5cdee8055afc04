"""Routes of the Responses API (core: create, retrieve, delete, input Items, input tokens)."""
from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from ..answer import answer, name_omitted_tools
from ..errors import APIError, unsupported
from ..json_body import JSONBodyRoute
from ..state import state_of
from . import serving
from .protocol import InputItemsOrder, InputTokensRequest, ResponsesRequest

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/responses")
async def create(body: ResponsesRequest, request: Request):
    state = state_of(request)
    run = await state.workers.run(serving.ResponseRun, body, state)
    p = run.prepared
    return await answer(request, state, p.prompt_ids, p.params, run.id, body.stream,
                        lambda _, outputs: serving.stream(run, outputs),
                        lambda outputs: serving.complete(run, outputs), keepalive=run.still_working,
                        omitted_tools=run.omitted_tools, keep=p.keep, media=p.media)


@router.post("/v1/responses/input_tokens")
async def input_tokens(body: InputTokensRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    count, omitted = await state.workers.run(serving.count_input_tokens, body, state)
    return name_omitted_tools(JSONResponse(count), omitted)


@router.post("/v1/responses/compact")
async def compact() -> dict:
    raise APIError(400, "response compaction is not supported by this server", None, "compaction_not_supported")


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request, include: list[str] | None = Query(default=None),
                   stream: bool | None = None) -> dict:
    entry = serving.stored(state_of(request), response_id)
    if include:
        raise unsupported("include", "no additional output data is available")
    if stream:
        raise unsupported("stream", "stored responses cannot be streamed again")
    return entry.response


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> dict:
    state = state_of(request)
    serving.stored(state, response_id)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def input_items(response_id: str, request: Request, after: str | None = None,
                      limit: int = Query(default=20, ge=1, le=100), order: InputItemsOrder = "desc",
                      include: list[str] | None = Query(default=None)) -> dict:
    entry = serving.stored(state_of(request), response_id)
    if include:
        raise unsupported("include", "no additional Item data is available")
    return serving.input_items_page(entry, after, limit, order)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, request: Request) -> JSONResponse:
    serving.stored(state_of(request), response_id)
    raise APIError(400, "only background responses can be cancelled, and background execution is not supported",
                   None, "background_not_supported")
