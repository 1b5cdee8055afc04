"""The requests llama.cpp's own server tests send for model names, ``/completions``, ``/infill``,
CORS, ``response_fields``, token and batch prompts, ``n_probs``, ``logit_bias`` and embeddings, against a real
``ninfer-serve`` as the README starts it (the embedded SmolLM2, default flags)."""
from __future__ import annotations

import base64
import math
import struct
import sys
from pathlib import Path

import httpx
import openai
import pytest

from support.server_process import ServerProcess

pytestmark = pytest.mark.slow
SERVE = str(Path(sys.executable).parent / "ninfer-serve")  # the console script of this environment
MODEL = "smollm2-135m-instruct"
PROMPT = "I believe the meaning of life is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess([SERVE], tmp_path_factory.mktemp("llamacpp") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="dummy", max_retries=0)


def test_openai_clients_model_names_are_answered(oai):
    res = oai.completions.create(model="davinci-002", prompt=PROMPT, max_tokens=8, temperature=0)
    assert res.model == MODEL and res.choices[0].finish_reason == "length" and res.choices[0].text
    chat = oai.chat.completions.create(model="gpt-3.5-turbo", max_tokens=8, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == MODEL and chat.choices[0].message.content
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_completions_without_v1_is_the_native_completion(http):
    body = http.post("/completions", json={"prompt": PROMPT, "n_predict": 8, "ignore_eos": True}).json()
    assert body["content"] and body["timings"]["predicted_n"] == 8 and len(body["tokens"]) == 8
    assert body["stop_type"] == "limit" and body["truncated"] is False and "choices" not in body


def test_infill_on_a_model_without_fim_tokens_names_them(http):
    r = http.post("/infill", json={"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "fim_not_supported"
    assert "<|fim_prefix|>" in r.json()["error"]["message"] and MODEL in r.json()["error"]["message"]


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8000"])
def test_local_pages_may_call_it(http, origin):
    r = http.options("/completion", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    r = http.post("/completion", json={"prompt": PROMPT, "n_predict": 2}, headers={"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin


def test_other_origins_are_not_reflected(http):
    r = http.options("/completion", headers={"Origin": "https://example.com", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_response_fields(http):
    fields = ["content", "generation_settings/n_predict", "prompt"]
    body = http.post("/completion", json={"prompt": PROMPT, "n_predict": 8, "response_fields": fields}).json()
    assert set(body) == set(fields) and body["generation_settings/n_predict"] == 8 and body["prompt"] == PROMPT


def test_token_and_batch_prompts(http):
    # SmolLM2's GGUF says its texts start with no BOS: add_special adds none, as in llama-server
    tokens = http.post("/tokenize", json={"content": PROMPT, "add_special": True}).json()["tokens"]
    assert tokens == http.post("/tokenize", json={"content": PROMPT}).json()["tokens"]
    single = http.post("/completion", json={"prompt": tokens, "temperature": 0, "n_predict": 8}).json()
    assert isinstance(single["content"], str) and single["content"]
    batch = http.post("/completion", json={"prompt": [tokens, tokens], "temperature": 0, "n_predict": 8}).json()
    assert isinstance(batch, list) and len(batch) == 2 and batch[0]["content"] == batch[1]["content"]
    mixed = http.post("/completion", json={"prompt": [tokens, PROMPT], "temperature": 0, "n_predict": 8}).json()
    assert isinstance(mixed, list) and len(mixed) == 2 and mixed[0]["content"] == mixed[1]["content"]
    one = http.post("/completion", json={"prompt": [1, 2, 3, 4, 5, 6, PROMPT, 7, 8, 9, 10, PROMPT],
                                         "n_predict": 4}).json()
    assert isinstance(one["content"], str)


def test_openai_embeddings(http, oai):
    body = http.post("/v1/embeddings", json={"input": PROMPT}).json()
    vec = body["data"][0]["embedding"]
    assert len(vec) == 576 and abs(math.fsum(x * x for x in vec) - 1) < 1e-3  # SmolLM2-135M: 576 wide
    n = len(http.post("/tokenize", json={"content": PROMPT}).json()["tokens"])
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    packed = http.post("/v1/embeddings", json={"input": PROMPT, "encoding_format": "base64"}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert all(abs(a - b) < 1e-6 for a, b in zip(struct.unpack(f"<{len(raw) // 4}f", raw), vec))
    many = oai.embeddings.create(model="text-embedding-3-small", input=[PROMPT, "This is a test", PROMPT])
    assert len(many.data) == 3 and all(len(d.embedding) == 576 for d in many.data)
    assert max(abs(a - b) for a, b in zip(many.data[0].embedding, many.data[2].embedding)) < 1e-4


def test_llamacpp_embeddings(http):
    n = len(http.post("/tokenize", json={"content": "hello hello hello"}).json()["tokens"])
    every = http.post("/embeddings", json={"content": "hello hello hello", "pooling": "none"}).json()
    assert len(every[0]["embedding"]) == n
    assert all(abs(math.fsum(x * x for x in row) - 1) > 1e-3 for row in every[0]["embedding"])  # not normalized
    pooled = http.post("/embedding", json={"content": ["hello", "world"]}).json()
    assert [p["index"] for p in pooled] == [0, 1] and len(pooled[0]["embedding"]) == 1
    assert abs(math.fsum(x * x for x in pooled[0]["embedding"][0]) - 1) < 1e-3


def test_n_probs_and_post_sampling_probs(http):
    body = http.post("/completion", json={"prompt": PROMPT, "n_predict": 5, "n_probs": 10, "temperature": 0,
                                          "ignore_eos": True}).json()
    probs = body["completion_probabilities"]
    assert len(probs) == 5 and [p["id"] for p in probs] == body["tokens"]
    for p in probs:
        assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 10
        top = [t["logprob"] for t in p["top_logprobs"]]
        assert top == sorted(top, reverse=True) and p["top_logprobs"][0]["id"] == p["id"]  # greedy: the best
    body = http.post("/completion", json={"prompt": PROMPT, "n_predict": 5, "n_probs": 10, "temperature": 1.0,
                                          "top_k": 5, "seed": 3, "post_sampling_probs": True, "ignore_eos": True}).json()
    for p in body["completion_probabilities"]:
        assert 0 < p["prob"] <= 1 and len(p["top_probs"]) <= 5  # top_k left five candidates at most
        assert math.isclose(sum(t["prob"] for t in p["top_probs"]), 1.0, rel_tol=1e-3)


def test_logit_bias_forms(http):
    ask = {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "ignore_eos": True}
    first = http.post("/completion", json=ask).json()["tokens"][0]
    for bias in ([[first, False]], {str(first): -100}, [[first, -100.0]]):
        tokens = http.post("/completion", json={**ask, "logit_bias": bias}).json()["tokens"]
        assert first not in tokens, bias
    favoured = http.post("/completion", json={**ask, "logit_bias": [[" Paris", 100]]}).json()
    assert favoured["content"].startswith(" Paris")  # a token given as its text
