"""The JSON body of every route that takes one: read, decoded and checked once, before pydantic.

``JSONBodyRoute`` (the ``route_class`` of every API router) answers in the OpenAI envelope, with
the field named where there is one, for what pydantic or the tokenizer would otherwise meet: an
empty body, a form upload (multipart; any other content type is read as JSON, as `curl -d` sends
it form-encoded), bytes that are not UTF-8, text that is not JSON, a
body that is not an object, nesting deeper than ``MAX_DEPTH``, a lone UTF-16 surrogate in any
string or field name (``"\\ud800"`` parses in Python but is no text a tokenizer can take) and a
number that is not finite (``NaN``, ``Infinity``, ``1e999``). The route then gets the parsed body,
so nothing parses it twice. Parsing and pydantic's validation (seconds for a large body) run on
the server's worker threads (``workers.py``), off the event loop.
"""
from __future__ import annotations

import email.message
import json
import math
import re
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from .errors import APIError, invalid, param_of
from .state import state_of

MAX_DEPTH = 100  # objects and arrays inside one another; tool schemas nest far less
_PLAIN = frozenset({int, bool, type(None)})  # what json.loads makes that needs no look
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way a surrogate gets into valid UTF-8 JSON


def _body_error(message: str, code: str) -> APIError:
    return APIError(400, message, None, code)


def _content_type(value: str | None) -> tuple[str, bool]:
    """(the media type, whether it names JSON); none given reads as JSON."""
    if not value:
        return "application/json", True
    header = email.message.Message()
    header["content-type"] = value
    subtype = header.get_content_subtype()
    return header.get_content_type(), header.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))


def parse_body(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """The request body as a JSON object, or the ``APIError`` that says what is wrong with it."""
    if not raw:
        raise _body_error("the request body is empty: send a JSON object", "missing_body")
    media, is_json = _content_type(content_type)
    if media.startswith("multipart/"):  # a form upload: never a JSON document
        raise _body_error(f"the request body must be JSON, sent with 'content-type: application/json', "
                          f"not {media}", "invalid_content_type")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _body_error(f"the request body is not valid UTF-8 (byte {exc.start})", "invalid_encoding") from None
    try:
        body = json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError as exc:
        sent = "" if is_json else f"; it was sent as {media}"
        raise _body_error(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})"
                          f"{sent}", "invalid_json") from None
    except RecursionError:
        raise _too_deep(None) from None
    if not isinstance(body, dict):
        raise _body_error(f"the request body must be a JSON object, not {_kind(body)}", "invalid_body")
    fault = first_fault(body, strings=_SURROGATE_ESCAPE.search(raw) is not None)
    if fault is not None:
        raise fault
    return body


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def _too_deep(path: tuple | None) -> APIError:
    return APIError(400, f"the request body nests objects and arrays more than {MAX_DEPTH} levels deep",
                    param_of(path[:1]) if path else None, "invalid_body")


def first_fault(body: Any, strings: bool = True) -> APIError | None:
    """The error for the first value, in document order, that no route may see: a string or field
    name holding a lone surrogate (looked for only when ``strings``), a number that is not finite,
    or a container deeper than ``MAX_DEPTH``. Iterative, so depth cannot exhaust the stack."""
    stack: list[tuple[tuple, Any]] = [((), iter(((None, body),)))]
    while stack:
        path, items = stack[-1]
        for key, value in items:
            kind = type(value)
            if kind in _PLAIN or kind is str and not (strings and _lone_surrogate(value)):
                continue
            here = path if key is None else (*path, key)
            if kind is str:
                return invalid(param_of(here), f"{_named(here)} is not valid Unicode text (it holds a lone "
                               "UTF-16 surrogate)", "invalid_unicode")
            if kind is float:
                if math.isfinite(value):
                    continue
                return invalid(param_of(here), f"invalid value for '{param_of(here)}': must be a finite number")
            if len(stack) > MAX_DEPTH:
                return _too_deep(here)
            if kind is dict:
                if strings and any(map(_lone_surrogate, value)):
                    return invalid(param_of(here), f"a field name in {_named(here)} is not valid Unicode text "
                                   "(it holds a lone UTF-16 surrogate)", "invalid_unicode")
                stack.append((here, iter(value.items())))
            elif _PLAIN.issuperset(map(type, value)):  # token ids: nothing to look at, checked in C
                continue
            else:
                stack.append((here, enumerate(value)))
            break
        else:
            stack.pop()
    return None


def _lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _named(path: tuple) -> str:
    return f"'{param_of(path)}'" if path else "the request body"


class _ParsedRequest(Request):
    """A request whose body was read and parsed already (FastAPI asks it for both)."""

    def __init__(self, request: Request, raw: bytes, body: Any) -> None:
        # labelled JSON whatever the client sent it as, so FastAPI takes the parsed body
        headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
        scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
        super().__init__(scope, request.receive)
        self._raw, self._parsed = raw, body

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._parsed


class JSONBodyRoute(APIRoute):
    """An ``APIRoute`` that checks a JSON body (``parse_body``) before FastAPI validates it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        whole = len(self.dependant.body_params) == 1 and not getattr(self.body_field.field_info, "embed", False)

        def parsed(raw: bytes, content_type: str | None) -> Any:
            """The parsed body; validated too where FastAPI validates it whole, as it would (the
            model instance it then gets passes its check at once)."""
            body = parse_body(raw, content_type)
            if not whole:
                return body
            value, errors = self.body_field.validate(body, {}, loc=("body",))
            if errors:
                raise RequestValidationError(errors)  # not the body: freed here, off the event loop
            return value

        async def checked(request: Request) -> Response:
            raw = await request.body()
            body = await state_of(request).workers.run(parsed, raw, request.headers.get("content-type"))
            return await handler(_ParsedRequest(request, raw, body))

        return checked
