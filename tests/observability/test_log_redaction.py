"""What logs keep of a request: route templates instead of paths, no query strings, no exception
messages from request handling, and errors as type, code and field names only."""
from __future__ import annotations

import io
import logging

import pytest
from fastapi.testclient import TestClient

from ninfer.server.app import create_app
from ninfer.server.observability.log_filter import RedactingFilter, traceback_without_messages
from ninfer.server.observability.request_log import logged_error, logged_param, redact_argv
from support.scripted import scripted_state

SECRET = "zqsecret41d7"


@pytest.mark.parametrize("param, logged", [
    ("model", "model"),
    ("tools[0].function.name", "tools[0].function.name"),
    ("messages[3].content[1].text", "messages[3].content[1].text"),
    ("context_management.edits[0].keep", "context_management.edits[0].keep"),
    (SECRET, "*"),  # unknown_parameter names the client's own field
    (f"metadata.{SECRET}", "metadata.*"),
    (f"logit_bias.{SECRET}[2]", "logit_bias.*[2]"),
    (f"tools.{SECRET} value", "tools.*"),
    ("", "*"),
])
def test_a_param_keeps_only_the_servers_field_names(param, logged):
    assert logged_param(param) == logged


def test_an_error_is_logged_without_its_message():
    err = {"message": f"model '{SECRET}' does not exist", "type": "invalid_request_error", "param": SECRET,
           "code": "model_not_found"}
    assert logged_error(err) == {"type": "invalid_request_error", "code": "model_not_found", "param": "*"}
    assert logged_error({"type": f"x {SECRET}", "code": 7, "param": ["x"]}) == {"type": "other", "code": "other",
                                                                                "param": "*"}


def test_argv_hides_the_key_under_any_flag_spelling():
    argv = ["--api-k", SECRET, "--port", "1", f"--api-key={SECRET}", "--api-key", SECRET]
    assert SECRET not in " ".join(redact_argv(argv, secrets=(SECRET,)))
    assert redact_argv(argv, secrets=(SECRET,))[2:4] == ["--port", "1"]


def _record(name: str, msg: str, args: tuple, exc: BaseException | None = None) -> logging.LogRecord:
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, info)


def _formatted(record: logging.LogRecord) -> str:
    assert RedactingFilter().filter(record)
    return logging.Formatter("%(name)s: %(message)s").format(record)


def test_the_access_line_has_no_path_or_query():
    record = _record("uvicorn.access", '%s - "%s %s HTTP/%s" %d',
                     ("127.0.0.1:5", "GET", f"/v1/models/{SECRET}?key={SECRET}", "1.1", 404))
    line = _formatted(record)
    assert SECRET not in line and '"GET (no route) HTTP/1.1" 404' in line


def test_asgi_trace_scopes_lose_the_url():
    scope = {"type": "http", "path": f"/{SECRET}", "raw_path": SECRET.encode(), "query_string": SECRET.encode(),
             "method": "GET"}
    line = _formatted(_record("uvicorn.asgi", "%s [%d] Started scope=%s", ("ASGI", 1, scope)))
    assert SECRET not in line and "'method': 'GET'" in line


def _raise_chain() -> BaseException:
    try:
        try:
            raise KeyError(SECRET)
        except KeyError as inner:
            raise ValueError(f"bad {SECRET}") from inner
    except ValueError as exc:
        return exc


def test_tracebacks_keep_frames_and_types_not_messages():
    exc = _raise_chain()
    text = traceback_without_messages(exc)
    assert SECRET not in text
    assert "builtins.KeyError" in text and "builtins.ValueError" in text and "_raise_chain" in text
    assert SECRET not in _formatted(_record("uvicorn.error", "Exception in ASGI application", (), exc))
    group = ExceptionGroup("g", [RuntimeError(SECRET)])
    assert "builtins.RuntimeError" in traceback_without_messages(group)
    assert SECRET not in traceback_without_messages(group)


def test_the_engines_own_exceptions_keep_their_messages():
    line = _formatted(_record("ninfer.engine", "engine step failed", (), RuntimeError("CUDA out of memory")))
    assert "CUDA out of memory" in line


def test_an_unhandled_error_logs_its_route_not_the_path():
    state, loop = scripted_state({}, "x")
    app = create_app(state)

    @app.get("/boom/{item}")
    async def boom(item: str):
        raise RuntimeError(f"failed on {item}")

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactingFilter())
    logger = logging.getLogger("ninfer.server")
    logger.addHandler(handler)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            r = client.get(f"/boom/{SECRET}?q={SECRET}")
    finally:
        logger.removeHandler(handler)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    text = out.getvalue()
    assert "unhandled error in GET /boom/{item}" in text and "builtins.RuntimeError" in text
    assert SECRET not in text
