"""One error type for the gateway and its translation to OpenAI's error envelope."""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def unsupported(param: str, what: str | None = None, code: str = "unsupported_parameter") -> APIError:
    """A recognised field asking for something this server cannot do (400 naming the field)."""
    return APIError(400, f"'{param}' is not supported{': ' + what if what else ''}", param, code)


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """A malformed value (400 naming the field)."""
    return APIError(400, message, param, code)


_ENGINE_STATUS = {"server_overloaded": 429, "request_queue_timeout": 503, "engine_failed": 503}


def engine_error(exc) -> APIError:
    """An ``EngineError`` as the HTTP error a client should see."""
    return APIError(_ENGINE_STATUS.get(exc.code, 400), str(exc), None, exc.code)


def loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not out:
            out = str(p)
        elif str(p).startswith(("function-", "tagged-union", "str", "list[", "literal", "int", "float", "bool")):
            continue  # pydantic union branch names, not fields
        else:
            out += f".{p}"
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    kind = first.get("type", "")
    param = loc_to_param(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        return APIError(400, "request body is not valid JSON", None, "invalid_json")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown parameter '{param}'", param, "unknown_parameter")
    if kind == "missing":
        return APIError(400, f"missing required parameter '{param}'", param, "missing_required_parameter")
    msg = first.get("msg", "invalid value")
    return APIError(400, f"invalid value for '{param}': {msg}" if param else msg, param, "invalid_value")


def install_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}" if code else str(exc.detail)
        err = APIError(exc.status_code, message, None, code)
        return JSONResponse(err.body(), status_code=exc.status_code)
