"""One error type for the gateway and its translation to OpenAI's error envelope."""
from __future__ import annotations

import logging
import math
import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .routing import route_template

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
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
CLIENT_GONE = 499  # nginx's status for a client that closed the connection before the answer

log = logging.getLogger("ninfer.server")


def _text(value: Any) -> Any:
    """``value`` made encodable as UTF-8: an error message must never fail to be written."""
    return LONE_SURROGATE.sub("\ufffd", value) if isinstance(value, str) else value


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
                "message": _text(self.message),
                "type": _TYPES.get(self.status, "server_error"),
                "param": _text(self.param),
                "code": self.code,
            }
        }


def unsupported(param: str, what: str | None = None, code: str = "unsupported_parameter") -> APIError:
    """A recognised field asking for something this server cannot do (400 naming the field)."""
    return APIError(400, f"'{param}' is not supported{': ' + what if what else ''}", param, code)


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    """A malformed value (400 naming the field)."""
    return APIError(400, message, param, code)


# internal_error: one request failed inside the engine, which goes on serving the others
_ENGINE_STATUS = {"server_overloaded": 429, "request_queue_timeout": 503, "engine_failed": 503,
                  "internal_error": 500}


def engine_error(exc) -> APIError:
    """An ``EngineError`` as the HTTP error a client should see."""
    return APIError(_ENGINE_STATUS.get(exc.code, 400), str(exc), None, exc.code)


class ClientDisconnected(Exception):
    """The client went away before its response started; nobody is left to answer."""


def param_of(path: tuple[Any, ...]) -> str | None:
    """A JSON path as a ``param``: ``messages[0].content``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if out else str(p)
    return out or None


def loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    fields = [p for i, p in enumerate(parts) if i == 0 or isinstance(p, int) or not str(p).startswith(
        ("function-", "tagged-union", "str", "list[", "literal", "int", "float", "bool"))]  # union branch names
    return param_of(tuple(fields))


def _non_finite(value: Any) -> bool:
    try:
        return not isinstance(value, bool) and not math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    kind = first.get("type", "")
    param = loc_to_param(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", None, "invalid_json")
    if param is None and kind in ("missing", "model_attributes_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object", None, "invalid_body")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown parameter '{param}'", param, "unknown_parameter")
    if kind == "missing":
        return APIError(400, f"missing required parameter '{param}'", param, "missing_required_parameter")
    if _non_finite(first.get("input")):
        return APIError(400, f"invalid value for '{param}': must be a finite number", param, "invalid_value")
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

    async def _gone(request: Request, _: Exception) -> Response:
        # an ordinary end: the engine request (if any) was aborted; the status is for logs only
        log.debug("client left before the response of %s %s", request.method, route_template(request.scope))
        return Response(status_code=CLIENT_GONE)

    app.add_exception_handler(ClientDisconnected, _gone)
    app.add_exception_handler(ClientDisconnect, _gone)  # gone while its body was being read

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}" if code else str(exc.detail)
        err = APIError(exc.status_code, message, None, code)
        return JSONResponse(err.body(), status_code=exc.status_code)
