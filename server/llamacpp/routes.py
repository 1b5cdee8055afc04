"""Routes of the llama.cpp-compatible endpoints (errors in the shared OpenAI-style envelope)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..answer import answer
from ..errors import APIError
from ..state import state_of
from . import serving
from .protocol import ApplyTemplateRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

router = APIRouter()


@router.post("/completion")
async def completion(body: CompletionRequest, request: Request):
    state = state_of(request)
    prep = serving.PreparedCompletion(body, state)
    return await answer(request, state, prep.prompt_ids, prep.params, prep.id, body.stream,
                        lambda _, outputs: serving.stream(prep, outputs), lambda outputs: serving.complete(prep, outputs))


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    return JSONResponse(serving.tokenize(state_of(request), body))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    return JSONResponse(serving.detokenize(state_of(request), body.tokens))


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    if body.model is not None and body.model != state.model_id:
        raise APIError(400, f"model '{body.model}' does not exist; this server serves '{state.model_id}'",
                       "model", "model_not_found")
    return JSONResponse({"prompt": serving.chat_prompt(state, body)})


@router.get("/props")
async def props(request: Request) -> JSONResponse:
    return JSONResponse(serving.props(state_of(request)))


@router.get("/slots")
async def slots(request: Request) -> JSONResponse:
    return JSONResponse(serving.slots(state_of(request)))
