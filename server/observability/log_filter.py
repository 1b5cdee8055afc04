"""What stdout and stderr may print about a request: its method, the route it reached and the
status, never the path or query string the client sent (``/?key=...``, ``/v1/models/NAME``), and
no exception message from request handling (a message may quote a request's values).

``RouteNameMiddleware`` notes the route template of each response as it starts, in a context
variable that uvicorn's access line (written within the same ``send``) is rewritten from.
``install_log_redaction()`` adds one ``RedactingFilter`` to every handler uvicorn and the root
logger write through, after uvicorn has configured its logging: uvicorn's access line, the scopes
its ``trace`` level prints, and every traceback that reaches those handlers pass through it. The
engine's own loggers keep their exception messages: the engine never sees a request's JSON.
"""
from __future__ import annotations

import logging
import traceback
from contextvars import ContextVar

from ..routing import NO_ROUTE, route_template

KEEP_MESSAGES = ("ninfer.engine",)  # loggers whose exceptions are about the model, not a request
HIDDEN = "<redacted>"
_SCOPE_KEYS = ("path", "raw_path", "query_string", "root_path")  # scope members holding the client's URL
_ROUTE: ContextVar[str] = ContextVar("ninfer_response_route", default=NO_ROUTE)


class RouteNameMiddleware:
    """Pure ASGI: sets the response's route template before its status line is sent."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message) -> None:
            if message["type"] == "http.response.start":
                _ROUTE.set(route_template(scope))
            await send(message)

        await self.app(scope, receive, send_named)


def traceback_without_messages(exc: BaseException) -> str:
    """The frames and exception types of ``exc`` and of the exceptions it was raised from, without
    their messages."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ if e.__cause__ is not None else None if e.__suppress_context__ else e.__context__
    parts: list[str] = []
    for i, e in enumerate(reversed(chain)):
        if i:
            parts.append("\nwhich led to:\n\n")
        parts.append("Traceback (most recent call last):\n")
        parts.extend(traceback.format_list(traceback.extract_tb(e.__traceback__)))
        parts.append(f"{type(e).__module__}.{type(e).__qualname__} (message withheld: it may quote a request)\n")
        members = getattr(e, "exceptions", None)  # an exception group's
        for j, sub in enumerate(members if isinstance(members, (list, tuple)) else ()):
            if isinstance(sub, BaseException):
                inner = traceback_without_messages(sub).replace("\n", "\n  ")
                parts.append(f"  member {j + 1}:\n  {inner}\n")
    return "".join(parts).rstrip("\n")


class RedactingFilter(logging.Filter):
    """Rewrites records in place. A record it cannot rewrite is replaced by a line naming the
    failure: logging never fails a request, and nothing unredacted gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            self._redact(record)
        except Exception as exc:  # noqa: BLE001
            record.msg = f"(a {record.name} record withheld: redaction failed with {type(exc).__name__})"
            record.args = ()
            record.exc_info, record.exc_text = None, None
        return True

    @staticmethod
    def _redact(record: logging.LogRecord) -> None:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, _target, version, status = record.args
            record.args = (client, method, _ROUTE.get(), version, status)
        elif record.name == "uvicorn.asgi" and isinstance(record.args, tuple):
            record.args = tuple({k: HIDDEN if k in _SCOPE_KEYS else v for k, v in a.items()}
                                if isinstance(a, dict) else a for a in record.args)
        if record.exc_info and record.exc_info[1] is not None and not record.name.startswith(KEEP_MESSAGES):
            record.exc_text = traceback_without_messages(record.exc_info[1])
            record.exc_info = None


def install_log_redaction() -> RedactingFilter:
    """Filter every handler of the root logger and of uvicorn's loggers (call after uvicorn's
    ``Config``, which installs its handlers)."""
    redacting = RedactingFilter()
    for name in (None, "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(redacting)
    return redacting
