"""Routes of the embeddings endpoints: OpenAI's ``/v1/embeddings``; llama.cpp's ``/embedding``
and ``/embeddings`` (its native answer, not OpenAI's, as llama-server has them)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..answer import run_batch
from ..json_body import JSONBodyRoute
from ..openai_common import check_model
from ..state import state_of
from . import serving
from .protocol import EmbeddingRequest, LlamaEmbeddingRequest

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    check_model(state, body.model)
    prep = await state.workers.run(serving.prepare_openai, body, state)
    finals = await run_batch(request, state, prep.jobs())
    return JSONResponse(await state.workers.run(serving.openai_body, body, state, prep, finals))


@router.post("/embedding")
@router.post("/embeddings")
async def llama_embeddings(body: LlamaEmbeddingRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    prep, normalize = await state.workers.run(serving.prepare_llama, body, state)
    finals = await run_batch(request, state, prep.jobs())
    return JSONResponse(await state.workers.run(serving.llama_body, finals, normalize))
