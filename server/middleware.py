"""Pure ASGI middleware that every HTTP request crosses before a route sees it.

Outermost first: ``RequestIdMiddleware`` (an ``x-request-id`` on every response), CORS
(starlette's, answering preflights; ``cors_settings``), ``AuthMiddleware`` (bearer key),
``BodyLimitMiddleware`` (413 before the body is parsed). Errors use the OpenAI envelope of
``errors.py``.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
import uuid
from typing import Any, Awaitable, Callable

from .errors import APIError
from .routing import route_template

log = logging.getLogger("ninfer.server")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, err: APIError, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


# the ``localhost`` keyword of --cors: a page served from this machine, any scheme's port
LOCALHOST_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?"


def cors_settings(origins: tuple[str, ...]) -> dict[str, Any] | None:
    """starlette ``CORSMiddleware`` options for ``--cors`` origins (None: no browser origin may
    call): allowed origins are reflected, preflights answered for any method and header."""
    if not origins:
        return None
    for origin in origins:
        if origin not in ("*", "localhost") and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise ValueError(f"--cors: {origin!r} is not an origin (scheme://host[:port]), 'localhost' or '*'")
    listed = [o for o in origins if o != "localhost"]
    return dict(allow_origins=listed, allow_origin_regex=LOCALHOST_ORIGIN if "localhost" in origins else None,
                allow_methods=["*"], allow_headers=["*"], expose_headers=["x-request-id"],
                allow_credentials="*" not in origins)


class RequestIdMiddleware:
    """Gives each request an id (``scope["state"]["request_id"]``) and returns it as ``x-request-id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = "req_" + uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s (%s)", scope.get("method"), route_template(scope), request_id)
            if started:
                raise
            await send_error(send_with_id, APIError(500, "internal server error", None, "internal_error"))


class AuthMiddleware:
    """``Authorization: Bearer KEY`` (or ``x-api-key: KEY``) on every path but the open ones."""

    def __init__(self, app: ASGIApp, key: str | None, is_open: Callable[[str], bool]) -> None:
        self.app = app
        self.key = key.encode() if key else None
        self.is_open = is_open

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key and scope["method"] != "OPTIONS" and not self.is_open(scope["path"]):
            headers = dict(scope.get("headers", []))
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.key):
                err = APIError(401, "invalid or missing API key", None, "invalid_api_key")
                return await send_error(send, err, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a request body larger than ``limit`` bytes with 413 before anything parses it.

    A declared ``content-length`` is checked at once; a chunked body is read (up to the limit)
    and then handed on."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self) -> APIError:
        mib = self.limit / (1 << 20)
        return APIError(413, f"request body exceeds the server's limit of {mib:g} MiB (--max-request-mib)",
                        None, "request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await send_error(send, APIError(400, "invalid content-length header", None, "invalid_request"))
            if declared > self.limit:
                return await send_error(send, self._too_large())
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await send_error(send, self._too_large())
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
