"""A real ``ninfer-serve`` on the embedded model, with an API key and a JSONL request log, gets one
secret in every field, header, path and query string it can carry, on every API family, accepted
and refused, and the key in query strings: neither may appear in stdout, stderr or the log."""
from __future__ import annotations

import json
import socket
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from support.server_process import ServerProcess

pytestmark = pytest.mark.slow
SERVE = str(Path(sys.executable).parent / "ninfer-serve")  # the console script of this environment

SECRET = "zq" + uuid.uuid4().hex[:14]  # a valid name everywhere a name may go (tools, metadata keys)
KEY = "key" + uuid.uuid4().hex[:14]
MODEL = "smollm2-135m-instruct"
SHORT = {"max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secrets")
    log = tmp / "requests.jsonl"
    proc = ServerProcess([SERVE, "--api-key", KEY, "--strict-model-names", "--request-log-jsonl",
                          str(log), "--max-context", "1024", "--log-level", "trace"], tmp / "server.out")
    try:
        yield proc, log
    finally:
        proc.stop()


def _tool_openai() -> dict:
    return {"type": "function", "function": {"name": SECRET, "description": SECRET, "parameters": {
        "type": "object", "properties": {SECRET: {"type": "string", "description": SECRET}}}}}


def chat_bodies() -> list[dict]:
    messages = [
        {"role": "system", "content": SECRET},
        {"role": "user", "content": f"say {SECRET}"},
        {"role": "assistant", "content": SECRET, "tool_calls": [
            {"id": SECRET, "type": "function",
             "function": {"name": SECRET, "arguments": json.dumps({SECRET: SECRET})}}]},
        {"role": "tool", "tool_call_id": SECRET, "content": SECRET},
        {"role": "user", "content": [{"type": "text", "text": SECRET}]},
    ]
    full = {"model": MODEL, "messages": messages, "tools": [_tool_openai()], "stop": [SECRET], "user": SECRET,
            "metadata": {SECRET: SECRET}, "seed": 1, SECRET: SECRET, "prompt_cache_key": SECRET,
            "safety_identifier": SECRET, **SHORT}
    return [
        full,
        {**full, "stream": True, "stream_options": {"include_usage": True}},
        {k: v for k, v in full.items() if k != "model"},
        {**full, "model": SECRET},  # refused: unknown model
        {**full, "messages": [{"role": "user", "content": SECRET, "name": SECRET}]},  # refused: names
        {**full, "tool_choice": {"type": "function", "function": {"name": SECRET}}},  # a forced call
        {**full, "tool_choice": {"type": "function", "function": {"name": SECRET * 2}}},  # refused: undeclared
        {**full, "messages": [{"role": SECRET, "content": SECRET}]},  # refused: bad role
        {**full, "temperature": SECRET},
        {**full, "n": SECRET},
        {**full, "stop": SECRET * 400},
        {**full, "response_format": {"type": SECRET}},
        {**full, "logit_bias": {SECRET: SECRET}},
        {**full, "reasoning_effort": SECRET},
        {**full, "tools": [{"type": SECRET, SECRET: SECRET}]},
        {**full, "tools": [{"type": "function", "function": {"name": f"<{SECRET}>"}}]},
        {**full, "chat_template_kwargs": {SECRET: SECRET}},
    ]


def completion_bodies() -> list[dict]:
    full = {"model": MODEL, "prompt": SECRET, "stop": [SECRET], "user": SECRET, SECRET: SECRET, **SHORT}
    return [full, {**full, "stream": True}, {**full, "model": SECRET}, {**full, "prompt": [SECRET, 7]},
            {**full, "suffix": SECRET},
            {**full, "logprobs": SECRET}, {**full, "echo": SECRET}]


def responses_bodies() -> list[dict]:
    tool = {"type": "function", "name": SECRET, "description": SECRET,
            "parameters": {"type": "object", "properties": {SECRET: {"type": "string"}}}}
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": SECRET}]},
             {"type": "function_call", "call_id": SECRET, "name": SECRET, "arguments": json.dumps({SECRET: 1})},
             {"type": "function_call_output", "call_id": SECRET, "output": SECRET}]
    full = {"model": MODEL, "input": items, "instructions": SECRET, "tools": [tool], "metadata": {SECRET: SECRET},
            "store": False, "max_output_tokens": 16, "temperature": 0, "prompt_cache_key": SECRET,
            "safety_identifier": SECRET, "user": SECRET}
    return [
        full,
        {**full, "stream": True},
        {**full, "input": SECRET},
        {**full, "previous_response_id": SECRET},  # refused: not stored
        {**full, "model": SECRET},
        {**full, SECRET: SECRET},  # refused: unknown field, named by its own name
        {**full, "tool_choice": {"type": "function", "name": SECRET}},
        {**full, "tool_choice": {"type": "function", "name": SECRET * 2}},
        {**full, "tools": [{"type": SECRET, "name": SECRET}]},
        {**full, "input": [{"type": SECRET, SECRET: SECRET}]},
        {**full, "input": [{"type": "reasoning", "id": SECRET, "summary": [], "encrypted_content": SECRET}]},
        {**full, "include": [SECRET]},
        {**full, "text": {"format": {"type": SECRET}}},
        {**full, "reasoning": {"effort": SECRET}},
    ]


def anthropic_bodies() -> list[dict]:
    tool = {"name": SECRET, "description": SECRET, "input_schema": {"type": "object", "properties": {
        SECRET: {"type": "string"}}}}
    messages = [{"role": "user", "content": SECRET},
                {"role": "assistant", "content": [{"type": "tool_use", "id": SECRET, "name": SECRET,
                                                   "input": {SECRET: SECRET}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": SECRET, "content": SECRET},
                                             {"type": "text", "text": SECRET}]}]
    full = {"model": SECRET, "max_tokens": 2, "messages": messages, "system": SECRET, "tools": [tool],
            "stop_sequences": [SECRET], "metadata": {"user_id": SECRET}, SECRET: SECRET}
    return [
        full,
        {**full, "stream": True},
        {**full, "messages": [{"role": "user", "content": SECRET}], "tools": None},
        {**full, "thinking": {"type": "enabled", "budget_tokens": 10}},  # refused: budget too small
        {**full, "thinking": {"type": SECRET}},
        {**full, "tool_choice": {"type": "tool", "name": SECRET}},
        {**full, "tool_choice": {"type": "tool", "name": SECRET * 2}},
        {**full, "tools": [{"type": SECRET, "name": SECRET}]},
        {**full, "messages": [{"role": "user", "content": [{"type": SECRET, SECRET: SECRET}]}]},
        {**full, "context_management": {"edits": [{"type": SECRET, SECRET: SECRET}]}},
        {**full, "output_config": {"effort": SECRET}},
        {**full, "service_tier": SECRET},
    ]


def llamacpp_requests() -> list[tuple[str, dict]]:
    return [
        ("/completion", {"prompt": SECRET, "n_predict": 2, "stop": [SECRET]}),
        ("/completion", {"prompt": SECRET, "n_predict": 2, "stream": True}),
        ("/completion", {"prompt": SECRET, "model": SECRET}),
        ("/completion", {"prompt": SECRET, SECRET: SECRET}),
        ("/completions", {"prompt": [SECRET, SECRET], "n_predict": 2, "response_fields": [SECRET, "content"]}),
        ("/infill", {"input_prefix": SECRET, "input_suffix": SECRET, "input_extra": [{"filename": SECRET,
                                                                                      "text": SECRET}]}),
        ("/v1/embeddings", {"input": [SECRET, SECRET], "model": SECRET}),
        ("/v1/embeddings", {"input": SECRET, "dimensions": 10**6}),
        ("/embeddings", {"content": SECRET, "pooling": "none"}),
        ("/embedding", {"content": SECRET, "pooling": SECRET}),
        ("/tokenize", {"content": SECRET, "with_pieces": True}),
        ("/tokenize", {"content": SECRET, SECRET: SECRET}),
        ("/detokenize", {"tokens": [SECRET]}),
        ("/apply-template", {"messages": [{"role": "user", "content": SECRET}]}),
        ("/apply-template", {"messages": [{"role": "user", "content": SECRET}], "model": SECRET}),
    ]


def send_everything(base: str) -> list[int]:
    """Every request, with the secret in headers too; returns the statuses."""
    statuses: list[int] = []
    headers = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "User-Agent": SECRET, "x-request-id": SECRET,
               "OpenAI-Organization": SECRET, "anthropic-version": SECRET, "anthropic-beta": SECRET,
               "Cookie": f"{SECRET}={SECRET}", "Referer": f"http://{SECRET}/", f"x-{SECRET}": SECRET}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
        def send(method: str, path: str, **kwargs) -> None:
            r = client.request(method, path, **kwargs)
            statuses.append(r.status_code)

        def post_all(paths: list[str], bodies: list[dict]) -> None:
            for path in paths:
                for body in bodies:
                    send("POST", path, json=body)

        post_all(["/v1/chat/completions", "/chat/completions"], chat_bodies())
        post_all(["/v1/completions"], completion_bodies())
        post_all(["/v1/responses", "/v1/responses/input_tokens"], responses_bodies())
        post_all(["/v1/messages", "/v1/messages/count_tokens"], anthropic_bodies())
        for path, body in llamacpp_requests():
            send("POST", path, json=body)
        # paths, query strings and bodies that are not JSON
        for path in (f"/v1/models/{SECRET}", f"/models/{SECRET}", f"/v1/responses/{SECRET}",
                     f"/v1/responses/{SECRET}/input_items?after={SECRET}", f"/{SECRET}", f"/assets/{SECRET}.js",
                     f"/v1/{SECRET}", f"/v1/models?{SECRET}={SECRET}", f"/stats?key={SECRET}",
                     f"/metrics?{SECRET}", f"/props?key={KEY}", f"/v1/responses/{SECRET}?include={SECRET}"):
            send("GET", path)
        send("DELETE", f"/v1/responses/{SECRET}")
        send("POST", f"/v1/responses/{SECRET}/cancel")
        send("PUT", "/v1/chat/completions", json={SECRET: SECRET})
        send("POST", f"/v1/chat/completions?{SECRET}={KEY}", json=chat_bodies()[0])
        send("POST", "/v1/chat/completions", content=f'{{"model": "{SECRET}", "messages": [',
             headers={"content-type": "application/json"})
        send("POST", "/v1/chat/completions", content=SECRET, headers={"content-type": "text/plain"})
        send("POST", "/v1/responses", content=SECRET.encode() + b"\xff\xfe",
             headers={"content-type": "application/json"})
        send("POST", "/v1/messages", content=json.dumps([SECRET]), headers={"content-type": "application/json"})
        # a client that leaves part way through a stream
        with client.stream("POST", "/v1/chat/completions", json={**chat_bodies()[1], "max_tokens": 64}) as r:
            statuses.append(r.status_code)
            next(r.iter_lines())
    # the key in query strings, as the web UI's LAN link carries it; no header
    for path in (f"/?key={KEY}", f"/monitor/?key={KEY}", f"/health?key={KEY}", f"/v1/models?key={KEY}",
                 f"/favicon.ico?key={KEY}", f"/assets/{KEY}.css?key={KEY}"):
        statuses.append(httpx.get(base + path, timeout=30).status_code)
    # wrong keys, every way a client sends one
    for auth in ({"Authorization": f"Bearer {SECRET}"}, {"x-api-key": SECRET}, {"Authorization": SECRET},
                 {"Authorization": f"Basic {SECRET}"}):
        statuses.append(httpx.post(base + "/v1/chat/completions", json=chat_bodies()[0], headers=auth).status_code)
        statuses.append(httpx.post(base + "/v1/messages", json=anthropic_bodies()[0], headers=auth).status_code)
    return statuses


def send_raw(port: int, data: bytes) -> None:
    """Bytes no HTTP client would send: malformed request lines, a WebSocket upgrade."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        try:
            s.recv(65536)
        except OSError:
            pass


def test_no_secret_reaches_stdout_stderr_or_the_request_log(server):
    proc, log = server
    statuses = send_everything(proc.base_url)
    for raw in (f"GET /{SECRET}?k={KEY} HTTP/1.1\r\nHost: x\r\n{SECRET} {SECRET}\r\n\r\n".encode(),
                f"{SECRET} /{KEY} HTTP/1.1\r\n\r\n".encode(),
                (f"GET /{SECRET}?key={KEY} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()):
        send_raw(proc.port, raw)
    assert httpx.get(proc.base_url + "/health", timeout=10).status_code == 200
    assert not [s for s in statuses if s >= 500], statuses  # every request got an answer, none a 5xx
    assert {200, 400, 401, 404} <= set(statuses)
    proc.stop()  # shutdown lines too

    output = proc.log_path.read_text(errors="replace")  # stdout and stderr, as the process wrote them
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # the test sees what it checks: access lines for the web page and the refused model, log records
    assert '"GET / HTTP/1.1" 200' in output and '"GET /v1/models/{model_id:path} HTTP/1.1" 404' in output
    events = [r["event"] for r in records]
    assert events.count("request_rejected") >= 60 and events.count("request_done") >= 20, events
    rejected = [r["error"] for r in records if r["event"] == "request_rejected"]
    assert {"code": "unknown_parameter", "param": "*", "type": "invalid_request_error"} in rejected
    assert {"code": "model_not_found", "param": "model", "type": "invalid_request_error"} in rejected

    for name, text in (("stdout/stderr", output), ("request log", log.read_text())):
        for secret in (SECRET, KEY):
            at = text.find(secret)
            assert at < 0, f"{'the API key' if secret == KEY else 'the secret'} in the {name}: " \
                           f"...{text[max(0, at - 300):at + 100]}..."
