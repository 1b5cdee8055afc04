"""Transport contracts over real HTTP: request ids, auth, CORS, 413, SSE framing and keep-alive,
llama.cpp-style progress and timings, Responses resources."""
from __future__ import annotations

import json

import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import scripted_state

MODEL = "scripted"
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCRIPT = "Let me think.\n</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state({"slow": "x " * 40}, SCRIPT, "--api-key", KEY, "--cors", "https://app.example",
                                 "--max-request-mib", "0.01")
    loop.start()
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client, state
    loop.stop()


@pytest.fixture
def http(served):
    return served[0]


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}], **extra}


def sse(response) -> list[tuple[str | None, str]]:
    """(event name, data) of each frame; comments come back as (":", text)."""
    frames, event, data = [], None, []
    for line in response.iter_lines():
        if line.startswith(":"):
            frames.append((":", line))
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and data:
            frames.append((event, "\n".join(data)))
            event, data = None, []
    if data:
        frames.append((event, "\n".join(data)))
    return frames


def test_auth_and_request_ids(http):
    r = http.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["x-request-id"]
    assert http.get("/health").status_code == 200 and http.get("/health").headers["x-request-id"]
    ok = http.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    other = http.post("/v1/chat/completions", json=chat_body(), headers={"x-api-key": KEY})
    assert ok.status_code == other.status_code == 200
    assert ok.headers["x-request-id"] != other.headers["x-request-id"]
    bad = http.post("/v1/chat/completions", json=chat_body(temperature=-1), headers=AUTH)
    assert bad.status_code == 400 and bad.headers["x-request-id"]
    missing = http.get("/v1/nothing-here", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True), headers=AUTH) as s:
        assert s.headers["x-request-id"] and s.headers["content-type"].startswith("text/event-stream")


def test_cors_preflight_needs_no_key(http):
    r = http.options("/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = http.get("/v1/models", headers={**AUTH, "Origin": "https://app.example"})
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    r = http.options("/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_oversized_body_is_413_before_parsing(http):
    big = b"{" + b" " * 20000  # not even JSON: the size alone decides
    r = http.post("/v1/chat/completions", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(20):
            yield b" " * 1000

    r = http.post("/v1/responses", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and r.headers["x-request-id"]


def test_models(http):
    listed = http.get("/v1/models", headers=AUTH).json()
    assert [m["id"] for m in listed["data"]] == [MODEL]
    assert http.get(f"/v1/models/{MODEL}", headers=AUTH).json()["id"] == MODEL
    assert http.get("/v1/models/other", headers=AUTH).status_code == 404


def test_keepalive_comment_while_the_model_is_slow(served):
    http, state = served
    model = state.engine.loop.engine.model
    state.keepalive_s, model.step_delay = 0.05, 0.15
    try:
        body = chat_body(messages=[{"role": "user", "content": "slow"}], stream=True, max_tokens=3)
        with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
            frames = sse(r)
    finally:
        state.keepalive_s, model.step_delay = 5.0, 0.0
    assert (":", ": keep-alive") in frames
    data = [d for e, d in frames if e != ":"]
    assert data[-1] == "[DONE]"


@pytest.mark.parametrize("path, body, idle", [
    ("/v1/responses", {"input": "slow", "stream": True, "max_output_tokens": 3}, "response.in_progress"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "slow"}], "stream": True, "max_tokens": 3}, "ping"),
])
def test_apis_whose_clients_count_events_get_their_own_idle_event(served, path, body, idle):
    """Codex drops a Responses stream after minutes without an event, which a long prompt can
    take to prefill: its idle frames are ``response.in_progress`` events in sequence; Anthropic's
    are ``ping`` events, as its API sends them."""
    http, state = served
    model = state.engine.loop.engine.model
    state.keepalive_s, model.step_delay = 0.05, 0.15
    try:
        with http.stream("POST", path, json={"model": MODEL, **body}, headers=AUTH) as r:
            frames = sse(r)
    finally:
        state.keepalive_s, model.step_delay = 5.0, 0.0
    assert not [f for f in frames if f[0] == ":"]  # no comments: events only
    events = [(e, json.loads(d)) for e, d in frames]
    assert sum(e == idle for e, _ in events) >= 2 + (idle == "ping")  # the stream's own one, and idle ones
    if idle == "ping":
        assert events[-1][0] == "message_stop"
    else:
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert events[-1][0] in ("response.completed", "response.incomplete")  # 3 tokens may cut it
        assert all(d["response"]["status"] == "in_progress" for e, d in events if e == idle)


def test_progress_and_per_token_timings(http):
    body = chat_body(stream=True, return_progress=True, timings_per_token=True)
    with http.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as r:
        chunks = [json.loads(d) for e, d in sse(r) if d != "[DONE]"]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    assert progress[0]["processed"] == progress[0]["cache"] == 0
    assert progress[-1]["processed"] == progress[-1]["total"] > 0
    first_delta = next(i for i, c in enumerate(chunks) if c["choices"] and
                       ("reasoning_content" in c["choices"][0]["delta"] or "content" in c["choices"][0]["delta"]
                        and c["choices"][0]["delta"]["content"]))
    last_progress = max(i for i, c in enumerate(chunks) if "prompt_progress" in c)
    assert last_progress < first_delta
    visible = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].keys() & {"content", "reasoning_content"}
               and c is not chunks[0]]
    assert visible and all("timings" in c for c in visible)
    counts = [c["timings"]["predicted_n"] for c in visible]
    assert counts == sorted(counts) and counts[-1] > 0
    assert "timings" in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_responses_sse_frames_name_their_type(http):
    body = {"model": MODEL, "input": "2+2?", "stream": True}
    with http.stream("POST", "/v1/responses", json=body, headers=AUTH) as r:
        frames = [(e, json.loads(d)) for e, d in sse(r) if e != ":"]
    assert all(e == d["type"] for e, d in frames)
    assert [d["sequence_number"] for _, d in frames] == list(range(len(frames)))
    assert "[DONE]" not in [d for _, d in frames]
    kinds = [e for e, _ in frames]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") \
        < kinds.index("response.reasoning_text.delta")


def test_response_resources(http):
    items = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    created = http.post("/v1/responses", json={"model": MODEL, "input": items}, headers=AUTH).json()
    rid = created["id"]
    page = http.get(f"/v1/responses/{rid}/input_items", params={"limit": 2, "order": "asc"}, headers=AUTH).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["m0", "m1"] and page["has_more"]
    rest = http.get(f"/v1/responses/{rid}/input_items", params={"after": page["last_id"], "order": "asc"},
                    headers=AUTH).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["m2", "m3", "m4"] and not rest["has_more"]
    desc = http.get(f"/v1/responses/{rid}/input_items", headers=AUTH).json()
    assert desc["data"][0]["content"][0]["text"] == "m4"
    assert http.get(f"/v1/responses/{rid}/input_items", params={"limit": 101}, headers=AUTH).status_code == 400
    assert http.get(f"/v1/responses/{rid}", params={"include": ["x"]}, headers=AUTH).status_code == 400
    assert http.post(f"/v1/responses/{rid}/cancel", headers=AUTH).status_code == 400
    compact = http.post("/v1/responses/compact", json={}, headers=AUTH)
    assert compact.json()["error"]["code"] == "compaction_not_supported"
    assert http.delete(f"/v1/responses/{rid}", headers=AUTH).json() == \
        {"id": rid, "object": "response.deleted", "deleted": True}
    gone = http.get(f"/v1/responses/{rid}", headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {}}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
])
def test_tools_a_template_cannot_show_are_named_in_a_header(served, path, body):
    """A chat template that never renders ``tools`` (SmolLM2's) leaves the model blind to them:
    the answer says so, naming them in ``x-ninfer-omitted-tools`` (agents such as Claude Code and
    Codex always send tools, and the embedded model still answers them); with tools it can show,
    no header."""
    from ninfer.engine.frontend.chat_template import ChatTemplate

    http, state = served
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    before, state.template = state.template, ChatTemplate(plain, eos_token="<|im_end|>")
    try:
        assert not state.template.renders_tools and before.renders_tools
        blind = http.post(path, json={"model": MODEL, **body}, headers=AUTH)
        with http.stream("POST", path, json={"model": MODEL, **body, "stream": True}, headers=AUTH) as r:
            streamed = r.headers.get("x-ninfer-omitted-tools")
            r.read()
    finally:
        state.template = before
    seen = http.post(path, json={"model": MODEL, **body}, headers=AUTH)
    assert blind.status_code == 200 and seen.status_code == 200, (blind.text, seen.text)
    assert blind.headers["x-ninfer-omitted-tools"] == streamed == "f"
    assert "x-ninfer-omitted-tools" not in seen.headers
