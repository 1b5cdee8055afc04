"""Anthropic's error envelope and request-id header for every ``/v1/messages*`` response.

The gateway's handlers (and its auth and body-limit middleware) answer in the OpenAI envelope;
``AnthropicEnvelope`` rewrites those bodies on Messages paths into
``{"type": "error", "error": {"type", "message"}, "request_id"}`` with Anthropic's error types,
maps local overload to 529 ``overloaded_error`` and a queue timeout to 504 ``timeout_error``, and
adds the ``request-id`` header (the id the request-id middleware gave the request).
"""
from __future__ import annotations

import json
import uuid
from typing import Any

PATH_PREFIX = "/v1/messages"
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# engine error codes whose Anthropic status differs from the OpenAI one
STATUS_BY_CODE = {"server_overloaded": 529, "media_overloaded": 529, "request_queue_timeout": 504}


def error_body(status: int, body: Any, request_id: str | None) -> tuple[int, dict[str, Any]]:
    """(status, Anthropic error body) for an error response of the gateway (either envelope)."""
    if isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict):
        out = dict(body)
    else:
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        status = STATUS_BY_CODE.get(err.get("code"), status)
        message = str(err.get("message") or "error")
        param = err.get("param")
        if param and param not in message:
            message = f"{param}: {message}"
        kind = TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        out = {"type": "error", "error": {"type": kind, "message": message}}
    if request_id:
        out["request_id"] = request_id
    return status, out


class AnthropicEnvelope:
    """Pure ASGI middleware; must sit outside the auth middleware to reshape its 401s."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] | None = None
        chunks: list[bytes] = []

        def request_id() -> str:
            state = scope.setdefault("state", {})
            return state.get("request_id") or state.setdefault("request_id", "req_" + uuid.uuid4().hex)

        async def send_anthropic(message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"request-id"]
                headers.append((b"request-id", request_id().encode()))
                message = {**message, "headers": headers}
                content_type = dict((k.lower(), v) for k, v in headers).get(b"content-type", b"")
                if message["status"] >= 400 and content_type.startswith(b"application/json"):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                try:
                    body = json.loads(b"".join(chunks))
                except ValueError:
                    body = None
                status, out = error_body(held["status"], body, request_id())
                data = json.dumps(out, ensure_ascii=False).encode()
                headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(data)).encode()))
                await send({**held, "status": status, "headers": headers})
                held = None
                message = {"type": "http.response.body", "body": data}
            await send(message)

        await self.app(scope, receive, send_anthropic)
