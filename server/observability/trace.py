"""Per-HTTP-request tracing of generation endpoints, as a pure ASGI middleware.

For each POST to a generation path the middleware opens an ``HttpTrace`` in a context variable,
so the engine observer (``monitor.py``) knows the protocol and the arrival time of the request it
sees, and watches the response status. A request that ended in an error before any generation
started is reported once as rejected (``request_rejected`` in the log, ``outcome="rejected"``).
"""
from __future__ import annotations

import asyncio
import json
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .request_log import logged_error

if TYPE_CHECKING:
    from . import Observability

GENERATION_PATHS = {
    "/v1/chat/completions": "openai_chat",
    "/v1/completions": "openai_completions",
    "/v1/responses": "openai_responses",
    "/v1/messages": "anthropic",
    "/completion": "llamacpp",
}
MAX_KEPT_BODY = 1 << 20  # request bodies larger than this are not parsed for the log's shape
MAX_KEPT_ERROR = 1 << 16


@dataclass
class HttpTrace:
    protocol: str
    path: str
    t0: float = field(default_factory=time.monotonic)
    started: list[str] = field(default_factory=list)  # engine request ids begun under this request
    status: int | None = None
    request_id: str | None = None  # from the response's request-id / x-request-id header
    body: bytearray | None = None  # kept only while a request log is written
    error_body: bytearray | None = None

    def parsed_body(self) -> Any:
        if not self.body or len(self.body) > MAX_KEPT_BODY:
            return None
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError):  # RecursionError: nesting too deep for the parser
            return None

    def error(self) -> dict[str, Any]:
        """type / code / param of an OpenAI- or Anthropic-shaped error body, as the log may hold them
        (``request_log.logged_error``: no message, field names only)."""
        try:
            body = json.loads(self.error_body or b"")
        except ValueError:
            return {}
        err = body.get("error") if isinstance(body, dict) else None
        if not isinstance(err, dict):
            return {}
        return logged_error(err)


_CURRENT: ContextVar[HttpTrace | None] = ContextVar("ninfer_http_trace", default=None)


def current_trace() -> HttpTrace | None:
    return _CURRENT.get()


class TraceMiddleware:
    def __init__(self, app, hub: "Observability") -> None:
        self.app = app
        self.hub = hub

    async def __call__(self, scope, receive, send) -> None:
        protocol = None
        if scope["type"] == "http" and scope.get("method") == "POST":
            protocol = GENERATION_PATHS.get(scope.get("path", ""))
        if protocol is None:
            await self.app(scope, receive, send)
            return
        keep = self.hub.log is not None
        trace = HttpTrace(protocol, scope["path"], body=bytearray() if keep else None)

        async def receive_traced():
            message = await receive()
            if trace.body is not None and message["type"] == "http.request" and len(trace.body) <= MAX_KEPT_BODY:
                trace.body.extend(message.get("body", b""))
            return message

        async def send_traced(message) -> None:
            if message["type"] == "http.response.start":
                trace.status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() in (b"request-id", b"x-request-id"):
                        trace.request_id = value.decode("latin-1")
                if keep and trace.status >= 400 and not trace.started:
                    trace.error_body = bytearray()
            elif message["type"] == "http.response.body" and trace.error_body is not None:
                if len(trace.error_body) < MAX_KEPT_ERROR:
                    trace.error_body.extend(message.get("body", b""))
            await send(message)

        token = _CURRENT.set(trace)
        try:
            await self.app(scope, receive_traced, send_traced)
        except asyncio.CancelledError:
            if trace.status is None:
                trace.status = 499  # the client left before any answer
            raise
        except BaseException:
            if trace.status is None:
                trace.status = 500
            raise
        finally:
            _CURRENT.reset(token)
            if not trace.started and (trace.status or 500) >= 400:
                self.hub.monitor.rejected(trace)
