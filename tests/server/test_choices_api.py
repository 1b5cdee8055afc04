"""Several choices of one prompt (``n``) on a tiny Llama served for real: Chat Completions (through
the ``openai`` SDK, aggregate and streamed), legacy Completions and llama.cpp's ``n_cmpl``. Choice
``i`` equals the request alone with ``seed + i``, and the prompt is computed once (the metrics'
prefill tokens: the prompt, then one token per other choice)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.tiny import save_tiny_llama
from support.waiting import wait_for

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("ckpt") / MODEL)
    state, loop = build_state(build_parser().parse_args([str(path), "--max-context", "256"]))
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield live, state
    loop.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].base_url, timeout=120) as c:
        yield c


def prefilled(http) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "ninfer_prefill_tokens_total":
                return sample.value
    raise AssertionError("no ninfer_prefill_tokens_total")


def settled(http) -> float:
    """The prefill counter once the engine's snapshot has caught up (it no longer moves)."""
    last = [prefilled(http)]

    def same() -> bool:
        now = prefilled(http)
        steady, last[0] = now == last[0], now
        return steady

    wait_for(lambda: same() and same(), timeout=2.0)
    return last[0]


def test_chat_n_choices_equal_single_requests_with_derived_seeds(served, client, http):
    messages = [{"role": "user", "content": "Tell me about the quick brown fox and Paris."}]
    body = dict(model=MODEL, messages=messages, max_tokens=10, temperature=1.0)
    before = settled(http)
    reply = client.chat.completions.create(**body, n=4, seed=42)
    after = settled(http)
    prompt = reply.usage.prompt_tokens
    assert after - before == prompt + 3  # one prefill; each other choice computes the last prompt token
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) == 4
    singles = [client.chat.completions.create(**body, seed=42 + i) for i in range(4)]
    assert texts == [s.choices[0].message.content for s in singles]
    # usage: the prompt once, every choice's output
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    streamed = {i: "" for i in range(4)}
    finishes = {}
    for chunk in client.chat.completions.create(**body, n=4, seed=42, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == reply.usage.completion_tokens
    assert [streamed[i] for i in range(4)] == texts and sorted(finishes) == [0, 1, 2, 3]


def test_chat_n_with_logprobs_gives_each_choice_its_own(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                           temperature=1.0, seed=9, n=2, logprobs=True, top_logprobs=2)
    for c in reply.choices:
        assert b"".join(bytes(e.bytes) for e in c.logprobs.content).decode(errors="replace") == c.message.content


def test_legacy_completions_n(served, http):
    prompt = served[1].tokenizer.encode("Hello world! How are you")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 1.0}
    r = http.post("/v1/completions", json={**body, "n": 3, "seed": 5})
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    assert texts == [http.post("/v1/completions", json={**body, "seed": 5 + i}).json()["choices"][0]["text"]
                     for i in range(3)]
    chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json={**body, "n": 3, "seed": 5,
                                                                                  "stream": True}).text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert ["".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
            for i in range(3)] == texts


def test_llamacpp_n_cmpl(served, http):
    prompt = served[1].tokenizer.encode("Paris is the capital")
    body = {"prompt": prompt, "n_predict": 6, "temperature": 1.0}
    results = http.post("/completion", json={**body, "n_cmpl": 2, "seed": 3}).json()
    assert [r["index"] for r in results] == [0, 1]
    assert [r["tokens"] for r in results] == [http.post("/completion", json={**body, "seed": 3 + i}).json()["tokens"]
                                              for i in range(2)]
    chunks = [json.loads(line[6:]) for line in http.post("/completion", json={**body, "n": 2, "seed": 3,
                                                                             "stream": True}).text.splitlines()
              if line.startswith("data: ")]
    assert [sum((c["tokens"] for c in chunks if c["index"] == i and not c["stop"]), []) for i in range(2)] == \
        [r["tokens"] for r in results]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/completion", {"prompt": "x", "n_cmpl": 9}, "n_cmpl"),
    ("/completion", {"prompt": "x", "n_cmpl": 2, "n": 3}, "n_cmpl"),
])
def test_bad_choice_counts_name_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_client_gone_mid_stream_cancels_every_choice(served):
    state = served[1]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 200, "n": 3,
            "temperature": 1.0, "stream": True}
    with httpx.Client(base_url=served[0].base_url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # one piece of text, then the client leaves
    assert wait_for(lambda: state.engine.outstanding == 0, timeout=10.0)
    assert wait_for(lambda: not state.engine.loop.view().lanes, timeout=10.0)
