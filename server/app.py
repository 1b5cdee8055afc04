"""The FastAPI application: one route table, one error wrapper, bearer-key auth."""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .errors import APIError, install_handlers
from .openai.routes import router as openai_router
from .state import ServerState

OPEN_PATHS = {"/health"}


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="NInfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ninfer = state
    install_handlers(app)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        key = state.api_key
        if key and request.url.path not in OPEN_PATHS and request.method != "OPTIONS":
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), key.encode()):
                err = APIError(401, "invalid or missing API key", None, "invalid_api_key")
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.engine.healthy:
            return JSONResponse({"status": "error", "error": str(state.engine.loop.failed)}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_id})

    app.include_router(openai_router)
    return app
