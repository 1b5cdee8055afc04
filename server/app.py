"""The FastAPI application: one route table, one error wrapper, and the middleware around it.

Middleware, outermost first (``middleware.py``): request id, CORS (``--cors``), bearer-key auth
(``--api-key``; not on ``/health``, the public web pages, or CORS preflights), the raw body
limit (``--max-request-mib``, 413 before JSON parsing).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from . import observability, web
from .anthropic import routes as anthropic
from .errors import APIError, install_handlers
from .llamacpp.routes import router as llamacpp_router
from .middleware import AuthMiddleware, BodyLimitMiddleware, RequestIdMiddleware
from .openai_chat.routes import router as chat_router
from .openai_completions.routes import router as completions_router
from .openai_responses.routes import router as responses_router
from .state import ServerState

OPEN_PATHS = {"/health"}


def _open(path: str) -> bool:
    """Paths served without an API key: health, and the browser pages that carry the key themselves."""
    return path in OPEN_PATHS or web.is_public(path)


def _model(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "ninfer",
            "max_model_len": state.max_context, "meta": {"context_length": state.max_context}}


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="NInfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ninfer = state
    install_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.engine.healthy:
            return JSONResponse({"status": "error", "error": str(state.engine.loop.failed)}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_id})

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict:
        if model_id != state.model_id:
            raise APIError(404, f"model '{model_id}' does not exist; this server serves '{state.model_id}'",
                           "model", "model_not_found")
        return _model(state)

    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(responses_router)
    web.install(app)
    app.include_router(llamacpp_router)
    # added innermost first
    app.add_middleware(BodyLimitMiddleware, limit=state.max_request_bytes)
    app.add_middleware(AuthMiddleware, key=state.api_key, is_open=_open)
    if state.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(state.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"],
                           allow_credentials="*" not in state.cors_origins)
    app.add_middleware(RequestIdMiddleware)
    anthropic.install(app)  # after auth: its envelope reshapes every /v1/messages* error
    observability.install(app, state)  # outermost: sees what the client sees
    return app
