"""Chat Completions over HTTP against a tiny Llama checkpoint, in process."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.tiny import save_tiny_llama

MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Hello world! How are you today?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")
    args = build_parser().parse_args([str(path), "--max-context", "256", "--api-key", "sekret"])
    state, loop = build_state(args)
    loop.start()
    with TestClient(create_app(state), headers={"Authorization": "Bearer sekret"}) as client:
        yield client, state
    loop.stop()


@pytest.fixture
def client(server):
    return server[0]


def chat(client, **body):
    body = {"model": MODEL, "messages": HELLO, **body}
    return client.post("/v1/chat/completions", json=body)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_needs_no_key(server):
    _, state = server
    with TestClient(create_app(state)) as anonymous:
        assert anonymous.get("/health").json() == {"status": "ok", "model": MODEL}
        r = anonymous.get("/v1/models")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_models(client):
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]


def test_aggregate_reports_usage_and_finish(client):
    body = chat(client, temperature=0, max_tokens=12).json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 12
    assert body["timings"]["predicted_n"] == usage["completion_tokens"]


def test_max_tokens_gives_length(client):
    body = chat(client, temperature=0, max_completion_tokens=3, stop=None).json()
    if body["choices"][0]["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == 3
    else:  # the model ended on eos before three tokens
        assert body["usage"]["completion_tokens"] <= 3


def test_stream_matches_aggregate(client):
    whole = chat(client, temperature=0, max_tokens=20).json()
    with client.stream("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 20,
        "stream": True, "stream_options": {"include_usage": True},
    }) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finishing = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishing) == 1 and finishing[0]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_stop_string_cuts_the_text(client):
    full = chat(client, temperature=0, max_tokens=30).json()["choices"][0]["message"]["content"]
    assert len(full) >= 6, full
    stop = full[3:6]  # likely spans a token boundary
    body = chat(client, temperature=0, max_tokens=30, stop=[stop]).json()
    text = body["choices"][0]["message"]["content"]
    assert text == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_seed_makes_sampling_repeatable(client):
    a = chat(client, temperature=1.0, seed=7, max_tokens=16).json()["choices"][0]["message"]["content"]
    b = chat(client, temperature=1.0, seed=7, max_tokens=16).json()["choices"][0]["message"]["content"]
    assert a == b


def test_any_model_name_is_answered_by_the_served_model(client):
    r = chat(client, model="other", max_tokens=4)
    assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"messages": []}, 400, "messages"),
        ({"temperature": 3}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"max_tokens": -1}, 400, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, 400, "tools[0].function.strict"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"logit_bias": {"abc": 1}}, 400, "logit_bias.abc"),
        ({"logit_bias": {"5": 101}}, 400, "logit_bias.5"),
        ({"logit_bias": {"100000": 1}}, 400, "logit_bias.100000"),
        ({"n": 100}, 400, "n"),  # more choices than lanes
        ({"frequency_penalty": 2.5}, 400, "frequency_penalty"),
        ({"top_logprobs": 3}, 400, "top_logprobs"),  # without logprobs: true
        ({"response_format": {"type": "xml"}}, 400, "response_format.type"),
    ],
)
def test_bad_requests_name_the_field(client, body, status, param):
    r = chat(client, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_missing_messages_and_bad_json(client):
    r = client.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_neutral_values_of_unsupported_fields_are_accepted(client):
    r = chat(client, max_tokens=2, logprobs=False, n=1, frequency_penalty=0, presence_penalty=0,
             response_format={"type": "text"}, user="u1", bogus_field=1)  # unknown fields are ignored
    assert r.status_code == 200, r.text


def test_prompt_longer_than_context_is_refused(client):
    long = [{"role": "user", "content": "Hello world! " * 400}]
    r = chat(client, messages=long)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
