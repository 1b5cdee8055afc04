"""The FastAPI application: one route table, one error wrapper, and the middleware around it.

Middleware, outermost first: llama.cpp's path spellings without ``/v1`` rewritten to their routes
(``routing.py``), then (``middleware.py``) request id, CORS (``--cors``, default ``localhost``), bearer-key auth
(``--api-key``; not on ``/health``, the public web pages, or CORS preflights), the raw body
limit (``--max-request-mib``, 413 before JSON parsing). Every route with a JSON body parses and
checks it in ``json_body.JSONBodyRoute``. ``/openapi.json`` describes the routes.
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from .. import __version__
from . import observability, openapi, web
from .anthropic import routes as anthropic
from .errors import install_handlers
from .json_body import JSONBodyRoute
from .embeddings.routes import router as embeddings_router
from .llamacpp.routes import router as llamacpp_router
from .middleware import AuthMiddleware, BodyLimitMiddleware, RequestIdMiddleware, cors_settings
from .openai_chat.routes import router as chat_router
from .openai_completions.routes import router as completions_router
from .openai_responses.routes import router as responses_router
from .openai_common import known_model
from .routing import PathAliasMiddleware
from .state import ServerState

OPEN_PATHS = {"/health"}


def _open(path: str) -> bool:
    """Paths served without an API key: health, and the browser pages that carry the key themselves."""
    return path in OPEN_PATHS or web.is_public(path)


def _model(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "ninfer",
            "max_model_len": state.max_context, "meta": {"context_length": state.max_context}}


def create_app(state: ServerState) -> FastAPI:
    # the OpenAPI document at /openapi.json (behind the key, as the API it describes)
    app = FastAPI(title="NInfer", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.router.route_class = JSONBodyRoute  # routes added on the app check their JSON body too
    app.state.ninfer = state
    install_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.engine.healthy:
            return JSONResponse({"status": "error", "error": str(state.engine.loop.failed)}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_id})

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model(state, name) for name in state.public_names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        return _model(state, known_model(state, model_id))

    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(responses_router)
    app.include_router(embeddings_router)
    web.install(app)
    app.include_router(llamacpp_router)
    # added innermost first
    app.add_middleware(BodyLimitMiddleware, limit=state.max_request_bytes)
    app.add_middleware(AuthMiddleware, key=state.api_key, is_open=_open)
    cors = cors_settings(state.cors_origins)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)
    app.add_middleware(RequestIdMiddleware)
    anthropic.install(app)  # after auth: its envelope reshapes every /v1/messages* error
    observability.install(app, state)  # sees what the client sees
    app.add_middleware(PathAliasMiddleware)  # outermost: every layer sees the /v1 path
    openapi.install(app, _open, bool(state.api_key), state.public_names, state.strict_model_names)
    return app
