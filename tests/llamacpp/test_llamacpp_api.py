"""llama.cpp-compatible endpoints over HTTP, against the scripted model (real tokenizer, template
and engine)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import record_prompts, scripted_state

ANSWER = "The capital of France is Paris. 巴黎 🇫🇷"


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state({"capital": ANSWER, "story": "once " * 200})
    seen = record_prompts(state)
    loop.start()
    with TestClient(create_app(state)) as client:
        yield client, state, seen
    loop.stop()


@pytest.fixture
def client(served):
    return served[0]


def sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("text", ["Hello world!", "巴黎 🇫🇷 and 😀", "  spaces\n\ttabs ", "<|im_start|>user\nhi<|im_end|>"])
def test_tokenize_detokenize_round_trip(client, text):
    ids = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw.decode("utf-8") == text


def test_pieces_that_split_a_character_come_as_bytes(client, served):
    state = served[1]
    ids = client.post("/tokenize", json={"content": "😀😀😀 ĳ"}).json()["tokens"]
    pieces = client.post("/tokenize", json={"content": "😀😀😀 ĳ", "with_pieces": True}).json()["tokens"]
    for p in pieces:
        if isinstance(p["piece"], list):
            assert bytes(p["piece"]) == state.tokenizer.token_bytes(p["id"])
    assert len(pieces) == len(ids)


def test_detokenize_refuses_unknown_ids(client):
    r = client.post("/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"


def test_apply_template_is_the_prompt_chat_completions_renders(served):
    client, state, seen = served
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    for extra in ({}, {"enable_thinking": False}):
        prompt = client.post("/apply-template", json={"messages": messages, **extra}).json()["prompt"]
        seen.clear()
        reply = client.post("/v1/chat/completions", json={"model": "scripted", "messages": messages, **extra})
        assert reply.status_code == 200, reply.text
        assert seen == [prompt]  # the text the model was given, decoded from its token ids
        assert reply.json()["usage"]["prompt_tokens"] == len(client.post("/tokenize", json={"content": prompt}).json()["tokens"])


def test_completion_aggregate(client):
    body = client.post("/completion", json={"prompt": "The capital of France?", "n_predict": 64}).json()
    assert body["content"] == ANSWER
    assert body["stop"] is True and body["stop_type"] == "eos"
    assert body["tokens_predicted"] == len(body["tokens"])
    assert client.post("/detokenize", json={"tokens": body["tokens"][:-1]}).json()["content"] == ANSWER
    t = body["timings"]
    assert t["predicted_n"] == body["tokens_predicted"] and t["prompt_n"] == body["tokens_evaluated"]
    assert t["prompt_ms"] >= 0 and t["predicted_ms"] > 0


def test_completion_streams_and_reports_timings(client):
    whole = client.post("/completion", json={"prompt": "capital", "n_predict": 64}).json()
    with client.stream("POST", "/completion", json={"prompt": "capital", "n_predict": 64, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert len(events) > 3
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == whole["tokens"]
    last = events[-1]
    assert last["stop_type"] == "eos" and last["timings"]["predicted_n"] == len(whole["tokens"])
    assert last["timings"]["predicted_per_second"] > 0


def test_completion_token_prompt_stop_word_and_limit(client):
    ids = client.post("/tokenize", json={"content": "The capital"}).json()["tokens"]
    body = client.post("/completion", json={"prompt": ids, "stop": ["Paris"]}).json()
    assert body["content"] == "The capital of France is "
    assert body["stop_type"] == "word" and body["stopping_word"] == "Paris"
    body = client.post("/completion", json={"prompt": ["The ", *ids], "n_predict": 3}).json()
    assert body["stop_type"] == "limit" and body["tokens_predicted"] == 3


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "bogus": 1}, "bogus"),
    ({"prompt": "x", "n_probs": 101}, "n_probs"),
    ({"prompt": "x", "logit_bias": [[1, 2, 3]]}, "logit_bias[0]"),
    ({"prompt": "x", "logit_bias": {"1": "high"}}, "logit_bias.1"),
    ({"prompt": "x", "logit_bias": [[10 ** 9, 1.0]]}, "logit_bias[0]"),
    ({"prompt": [1, -5]}, "prompt[1]"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
])
def test_completion_bad_requests_name_the_field(client, body, param):
    r = client.post("/completion", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_props(client, served):
    state = served[1]
    props = client.get("/props").json()
    assert props["model_alias"] == "scripted"
    assert props["n_ctx"] == props["default_generation_settings"]["n_ctx"] == state.max_context
    assert props["chat_template"] == state.template.source
    assert props["total_slots"] == state.engine.config.max_concurrency


def test_slots_show_what_each_lane_does():
    state, loop = scripted_state({}, "word " * 300, "--max-concurrency", "2")
    state.engine.loop.engine.model.step_delay = 0.02
    loop.start()
    try:
        with LiveServer(create_app(state)) as server:
            idle = httpx.get(server.base_url + "/slots").json()
            assert [s["is_processing"] for s in idle] == [False, False]
            opened, release = threading.Event(), threading.Event()

            def hold():
                with httpx.stream("POST", server.base_url + "/completion",
                                  json={"prompt": "go", "stream": True, "n_predict": 250}, timeout=30) as r:
                    lines = r.iter_lines()  # kept: a collected iterator closes the stream
                    next(lines)
                    opened.set()
                    release.wait(20)

            t = threading.Thread(target=hold)
            t.start()
            assert opened.wait(10)
            busy = httpx.get(server.base_url + "/slots").json()
            release.set()
            t.join(20)
            lane = busy[0]
            assert lane["is_processing"] and lane["state"] == "decode" and lane["id_task"].startswith("cmpl-")
            assert lane["n_prompt_tokens"] == 1 and lane["n_decoded"] >= 1
            assert lane["n_remain"] == 250 - lane["n_decoded"] and lane["params"]["n_predict"] == 250
            assert busy[1]["is_processing"] is False
            deadline = time.monotonic() + 5
            while httpx.get(server.base_url + "/slots").json()[0]["is_processing"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not httpx.get(server.base_url + "/slots").json()[0]["is_processing"]
    finally:
        loop.stop()
