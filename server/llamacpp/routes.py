"""Routes of the llama.cpp-compatible endpoints (errors in the shared OpenAI-style envelope)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..answer import Job, answer_batch, answer_choices
from ..json_body import JSONBodyRoute
from ..openai_common import check_model
from ..state import state_of
from . import serving
from .protocol import ApplyTemplateRequest, CompletionRequest, DetokenizeRequest, InfillRequest, TokenizeRequest

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/completion")
@router.post("/completions")  # llama-server's second spelling; the OpenAI one is /v1/completions
async def completion(body: CompletionRequest, request: Request):
    state = state_of(request)
    preps, batch = await state.workers.run(serving.prepare_completion, body, state)
    return await completion_answer(request, state, preps, batch, body.stream)


@router.post("/infill")
async def infill(body: InfillRequest, request: Request):
    state = state_of(request)
    prep = await state.workers.run(serving.prepare_infill, body, state)
    return await completion_answer(request, state, [prep], False, body.stream)


async def completion_answer(request: Request, state, preps: list[serving.PreparedCompletion], batch: bool,
                            stream: bool):
    """One prompt's answer (a list of its completions with ``n_cmpl`` > 1), or a batch's: a list
    of them (their frames interleaved when streamed)."""
    if not batch:
        prep = preps[0]
        return await answer_choices(request, state, prep.prompt_ids, prep.params, prep.id, prep.n, stream,
                                    lambda _, outputs: serving.stream(prep, outputs),
                                    lambda outputs: serving.complete(prep, outputs))
    jobs = [Job(p.prompt_ids, p.params, p.id, (lambda p: lambda outputs: serving.stream(p, [outputs]))(p),
                (lambda p: lambda outputs: serving.complete(p, [outputs]))(p)) for p in preps]
    return await answer_batch(request, state, jobs, stream)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    state = state_of(request)  # the id list of a long text is large to write too
    return await state.workers.run(lambda: JSONResponse(serving.tokenize(state, body)))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    return JSONResponse(await state.workers.run(serving.detokenize, state, body.tokens))


@router.post("/apply-template")
async def apply_template(body: ApplyTemplateRequest, request: Request) -> JSONResponse:
    state = state_of(request)
    check_model(state, body.model)
    return JSONResponse({"prompt": await state.workers.run(serving.chat_prompt, state, body)})


@router.get("/props")
async def props(request: Request) -> JSONResponse:
    return JSONResponse(serving.props(state_of(request)))


@router.get("/slots")
async def slots(request: Request) -> JSONResponse:
    return JSONResponse(serving.slots(state_of(request)))
