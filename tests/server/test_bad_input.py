"""Malformed and hostile request bodies get a 400 naming the field (or the body), never a 500;
the connection, the request log and the server stay as they were."""
from __future__ import annotations

import http.client
import json
import socket
import time

import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import record_prompts, scripted_state

LONE = '"a\\ud800b"'  # JSON text of a string holding a lone UTF-16 surrogate
JSON = {"content-type": "application/json"}
GENERATION = {
    "/v1/chat/completions": {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "scripted", "prompt": "hi"},
    "/v1/responses": {"model": "scripted", "input": "hi"},
    "/v1/messages": {"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "/completion": {"prompt": "hi"},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "requests.jsonl"
    state, loop = scripted_state({}, "Hello", "--request-log-jsonl", str(log), "--default-max-tokens", "8")
    loop.start()
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client, state, log, live
    loop.stop()


@pytest.fixture
def client(served):
    return served[0]


def post(client, path: str, body, headers=JSON) -> httpx.Response:
    return client.post(path, content=body if isinstance(body, (str, bytes)) else json.dumps(body), headers=headers)


def error(r: httpx.Response) -> dict:
    """``error`` of either envelope; Anthropic's has no ``param``, so it reads as None."""
    err = r.json()["error"]
    return {"param": err.get("param"), "code": err.get("code"), "message": err["message"]}


def healthy(client) -> bool:
    return client.get("/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"model":"scripted","messages":[{"role":"user","content":%s}]}' % LONE,
     "messages[0].content"),
    ("/v1/chat/completions", '{"model":"scripted","messages":[{"role":"user","content":[{"type":"text","text":%s}]}]}'
     % LONE, "messages[0].content[0].text"),
    ("/tokenize", '{"content":%s}' % LONE, "content"),
    ("/completion", '{"prompt":%s}' % LONE, "prompt"),
    ("/v1/completions", '{"model":"scripted","prompt":%s}' % LONE, "prompt"),
    ("/v1/responses", '{"model":"scripted","input":%s}' % LONE, "input"),
    ("/v1/responses", '{"model":"scripted","input":[{"role":"user","content":%s}]}' % LONE, "input[0].content"),
    ("/v1/messages", '{"model":"scripted","max_tokens":8,"messages":[{"role":"user","content":%s}]}' % LONE,
     "messages[0].content"),
    ("/v1/chat/completions", '{"model":%s,"messages":[{"role":"user","content":"hi"}]}' % LONE, "model"),
    ("/v1/messages", '{"model":%s,"max_tokens":8,"messages":[{"role":"user","content":"hi"}]}' % LONE, "model"),
])
def test_a_lone_surrogate_is_a_400_naming_its_field(client, path, body, param):
    r = post(client, path, body)
    assert r.status_code == 400, r.text
    err = error(r)
    assert "lone UTF-16 surrogate" in err["message"] and f"'{param}'" in err["message"]
    if not path.startswith("/v1/messages"):
        assert err["param"] == param and err["code"] == "invalid_unicode"
    assert "\ud800" not in r.text and "\\ud800" not in r.text  # the value is not echoed
    assert healthy(client)


def test_a_lone_surrogate_in_a_field_name(client):
    r = post(client, "/v1/chat/completions",
             '{"model":"scripted","messages":[{"role":"user","content":"hi","x\\udc00":1}]}')
    assert r.status_code == 400 and error(r)["param"] == "messages[0]" and error(r)["code"] == "invalid_unicode"
    assert healthy(client)


def test_typed_marker_characters_beside_a_control_token_stay_text(served):
    client, state = served[0], served[1]
    prompts = record_prompts(state)
    text = "<|im_end|> and \ue0009\ue001"
    r = post(client, "/v1/chat/completions", {"model": "scripted", "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    assert text in prompts[-1]  # what the model read, as the user typed it
    r = post(client, "/apply-template", {"messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200 and text in r.json()["prompt"]
    assert healthy(client)


def test_a_deeply_nested_body_keeps_the_connection_and_is_logged(served):
    client, _, log, live = served
    deep = '{"model":"scripted","messages":' + "[" * 10_000 + "]" * 10_000 + "}"
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", deep, JSON)
        first = conn.getresponse()
        body = json.loads(first.read())
        sock = conn.sock
        assert first.status == 400 and body["error"]["code"] == "invalid_body" and body["error"]["param"] is None
        assert "the request body nests" in body["error"]["message"]
        assert first.getheader("connection") != "close"
        conn.request("GET", "/health")
        second = conn.getresponse()
        assert second.status == 200 and json.loads(second.read())["status"] == "ok"
        assert conn.sock is sock  # the same keep-alive connection answered both
    finally:
        conn.close()
    request_id = first.getheader("x-request-id")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    rejected = [r for r in records if r["event"] == "request_rejected" and r["request_id"] == request_id]
    assert len(rejected) == 1 and rejected[0]["status"] == 400 and rejected[0]["error"]["code"] == "invalid_body"


@pytest.mark.parametrize("path", GENERATION)
@pytest.mark.parametrize("body, headers, code, says", [
    (b"", JSON, "missing_body", "the request body is empty"),
    (b"[]", JSON, "invalid_body", "the request body must be a JSON object, not an array"),
    (b"null", JSON, "invalid_body", "the request body must be a JSON object, not null"),
    (b'{"prompt": "hi"}', {"content-type": "multipart/form-data; boundary=x"}, "invalid_content_type",
     "the request body must be JSON, sent with 'content-type: application/json', not multipart/form-data"),
    (b"prompt=hi", {"content-type": "text/plain"}, "invalid_json",
     "the request body is not valid JSON"),
    (b'{"prompt": "h\xffi"}', JSON, "invalid_encoding", "the request body is not valid UTF-8 (byte 13)"),
    (b'{"prompt": "hi",', JSON, "invalid_json", "the request body is not valid JSON"),
])
def test_a_body_that_is_no_json_object_says_so(client, path, body, headers, code, says):
    r = post(client, path, body, headers)
    assert r.status_code == 400, r.text
    err = error(r)
    assert err["message"].startswith(says) and err["param"] is None
    if not path.startswith("/v1/messages"):
        assert err["code"] == code
    assert healthy(client)


@pytest.mark.parametrize("path", GENERATION)
@pytest.mark.parametrize("headers", [{}, {"content-type": "application/x-www-form-urlencoded"},
                                     {"content-type": "text/plain; charset=utf-8"}])
def test_a_json_body_is_read_whatever_its_content_type(client, path, headers):
    # `curl -d '{...}'` sends JSON labelled as a form; clients of local servers rely on it being read
    r = post(client, path, json.dumps(GENERATION[path]), headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", GENERATION)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_number_that_is_not_finite_is_named(client, path, value):
    text = json.dumps(GENERATION[path])[:-1] + f', "temperature": {value}}}'
    r = post(client, path, text)
    assert r.status_code == 400, r.text
    err = error(r)
    assert err["message"] == "invalid value for 'temperature': must be a finite number"
    if not path.startswith("/v1/messages"):
        assert err["param"] == "temperature" and err["code"] == "invalid_value"
    assert healthy(client)


@pytest.mark.parametrize("path, extra", [
    ("/v1/chat/completions", {"temperature": 5e-324}),
    ("/v1/chat/completions", {"top_p": 5e-324}),
    ("/v1/messages", {"top_p": 5e-324}),
    ("/v1/completions", {"temperature": 1e-45, "top_p": 1e-45}),
    ("/completion", {"repeat_penalty": 5e-324}),
])
def test_extreme_sampling_values_are_served(client, path, extra):
    # values so small that fp32 logits overflow or the nucleus rounds to nothing: the most likely
    # token is still sampled, and the engine (every other request) lives on
    r = post(client, path, {**GENERATION[path], **extra})
    assert r.status_code == 200, r.text
    assert healthy(client)


def test_a_client_that_leaves_before_its_response_is_an_ordinary_end(tmp_path, capfd, caplog):
    state, loop = scripted_state({"slow": "x " * 200}, "Hello")
    model = state.engine.loop.engine.model
    model.step_delay = 0.02
    loop.start()
    try:
        with LiveServer(create_app(state)) as live:
            body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": "slow"}]}).encode()
            head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            # gone while generating (no byte of the response yet), then gone halfway through the body
            for n, sent, length in ((1, body, len(body)), (2, body[:20], len(body))):
                with socket.create_connection(("127.0.0.1", live.port)) as s:
                    s.sendall(head + b"content-length: %d\r\n\r\n%s" % (length, sent))
                    time.sleep(0.5)
                cancelled = f'ninfer_requests_total{{outcome="cancelled"}} {n}.0'
                deadline = time.monotonic() + 20
                while cancelled not in (metrics := httpx.get(live.base_url + "/metrics").text):
                    assert time.monotonic() < deadline, metrics
                    time.sleep(0.1)
            assert 'ninfer_requests_total{outcome="rejected"} 0.0' in metrics
            assert httpx.get(live.base_url + "/health").status_code == 200
    finally:
        loop.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "CancelledError" not in err and "Exception in ASGI" not in err, err
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
