"""Log-probabilities and logit bias through every API family, against a tiny Llama served for
real (uvicorn over HTTP) and transformers' logits of the same checkpoint: Chat Completions
(aggregate and streamed, through the ``openai`` SDK), legacy Completions, Responses and
llama.cpp's ``/completion`` (``n_probs``, ``post_sampling_probs``, both ``logit_bias`` forms)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
import transformers

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.tiny import save_tiny_llama

MODEL = "tiny-llama"
HELLO = [{"role": "user", "content": "Hello world! How are you today?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("ckpt") / MODEL)
    state, loop = build_state(build_parser().parse_args([str(path), "--max-context", "256"]))
    loop.start()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with LiveServer(create_app(state)) as live:
        yield live, state, reference
    loop.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served[0].base_url, timeout=120) as c:
        yield c


def by_bytes(state) -> dict[bytes, int]:
    """Token ids by their bytes (unique in this tokenizer), to read ids back from entries."""
    table = {state.tokenizer.token_bytes(i): i for i in range(state.tokenizer.vocab_size)}
    assert len(table) == state.tokenizer.vocab_size
    return table


def text_of(state, token: int) -> str:
    return state.tokenizer.token_bytes(token).decode("utf-8", errors="backslashreplace")


def reference(served, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each output position."""
    with torch.no_grad():
        logits = served[2](torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]


def chat_prompt(state) -> list[int]:
    return state.tokenizer.encode(state.template.render(HELLO, add_generation_prompt=True))


def check_openai_entries(served, prompt: list[int], entries: list[dict], top: int) -> list[int]:
    """Each entry's token, bytes, logprob and ``top`` alternatives against transformers; the ids."""
    state = served[1]
    ids_of = by_bytes(state)
    ids = [ids_of[bytes(e["bytes"])] for e in entries]
    for e, i in zip(entries, ids):
        assert e["token"] == bytes(e["bytes"]).decode("utf-8", errors="backslashreplace")
    for e, row in zip(entries, reference(served, prompt, ids)):
        assert e["logprob"] == pytest.approx(float(row[ids_of[bytes(e["bytes"])]]), abs=1e-3)
        best = torch.topk(row, top)
        assert [ids_of[bytes(t["bytes"])] for t in e["top_logprobs"]] == best.indices.tolist()
        values = [t["logprob"] for t in e["top_logprobs"]]
        assert values == pytest.approx(best.values.tolist(), abs=1e-3) and values == sorted(values, reverse=True)
    return ids


# ---------------------------------------------------------------------------- Chat Completions
def test_chat_logprobs_match_transformers_aggregate_and_streamed(served, client):
    state = served[1]
    body = dict(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, logprobs=True, top_logprobs=20)
    reply = client.chat.completions.create(**body)
    content = [e.model_dump() for e in reply.choices[0].logprobs.content]
    assert len(content) == reply.usage.completion_tokens == 8
    ids = check_openai_entries(served, chat_prompt(state), content, 20)
    assert state.tokenizer.decode(ids) == reply.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += [e.model_dump() for e in chunk.choices[0].logprobs.content]
    assert streamed == content


def test_chat_sampled_rows_and_plain_rows_beside_them(served, client):
    state = served[1]
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=1.0, seed=3,
                                           logprobs=True, top_logprobs=2)
    content = [e.model_dump() for e in reply.choices[0].logprobs.content]
    check_openai_entries(served, chat_prompt(state), content, 2)
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=1.0, seed=3)
    assert plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == reply.choices[0].message.content  # the same draw without them
    only = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in only.choices[0].logprobs.content)


def test_chat_logit_bias_forces_and_forbids(served, client):
    state = served[1]
    body = dict(model=MODEL, messages=HELLO, max_tokens=4, temperature=0)
    free = client.chat.completions.create(**body, logprobs=True)
    first = by_bytes(state)[bytes(free.choices[0].logprobs.content[0].bytes)]
    forced = state.tokenizer.encode(" fox")[-1]
    reply = client.chat.completions.create(**body, logit_bias={str(forced): 100})
    assert reply.choices[0].message.content == state.tokenizer.decode([forced] * 4)
    banned = client.chat.completions.create(**body, logprobs=True, logit_bias={str(first): -100})
    assert by_bytes(state)[bytes(banned.choices[0].logprobs.content[0].bytes)] != first


# ---------------------------------------------------------------------------- legacy Completions
@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "streamed"])
def test_legacy_completion_logprobs(served, http, stream):
    state = served[1]
    prompt = state.tokenizer.encode("The quick brown fox")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11, "logprobs": 3,
            "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(c["text"] for c in choices)
        parts = [c["logprobs"] for c in choices if c["logprobs"]]
        lp = {k: sum((p[k] for p in parts), []) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    else:
        choice = r.json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
    # a token that is part of a character reads as its bytes' escapes ("\\xf0")
    ids_of = {text_of(state, i): i for i in range(state.tokenizer.vocab_size)}
    ids = [ids_of[t] for t in lp["tokens"]]
    assert len(ids) == 6 and state.tokenizer.decode(ids) == text
    assert lp["text_offset"] == [len(state.tokenizer.decode(ids[:i])) for i in range(6)]
    for token, value, best, row in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                       reference(served, prompt, ids)):
        assert value == pytest.approx(float(row[ids_of[token]]), abs=1e-3)
        top = torch.topk(row, 3)
        expected = {text_of(state, i): v for i, v in zip(top.indices.tolist(), top.values.tolist())}
        assert set(best) == set(expected) | {token}  # the chosen token and the 3 best
        assert all(best[k] == pytest.approx(v, abs=1e-3) for k, v in expected.items())


# ---------------------------------------------------------------------------- Responses
def test_responses_output_text_logprobs(served, client):
    state = served[1]
    kwargs = dict(model=MODEL, input=HELLO, max_output_tokens=6, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=4)
    reply = client.responses.create(**kwargs)
    part = reply.output[0].content[0]
    entries = [e.model_dump() for e in part.logprobs]
    ids = check_openai_entries(served, chat_prompt(state), entries, 4)
    assert state.tokenizer.decode(ids) == part.text and reply.top_logprobs == 4
    streamed = []
    for event in client.responses.create(**kwargs, stream=True):
        if event.type == "response.output_text.delta":
            streamed += [e.model_dump() for e in event.logprobs]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in entries])
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    plain = client.responses.create(model=MODEL, input=HELLO, max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == []


# ---------------------------------------------------------------------------- llama.cpp
@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "streamed"])
def test_llamacpp_n_probs(served, http, stream):
    state = served[1]
    prompt = state.tokenizer.encode("Paris is the capital")
    r = http.post("/completion", json={"prompt": prompt, "n_predict": 5, "temperature": 0, "n_probs": 4,
                                       "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        probs = sum((c.get("completion_probabilities", []) for c in chunks if not c["stop"]), [])
        tokens = sum((c["tokens"] for c in chunks if not c["stop"]), [])
        assert chunks[-1]["generation_settings"]["n_probs"] == 4
    else:
        body = r.json()
        probs, tokens = body["completion_probabilities"], body["tokens"]
    assert [p["id"] for p in probs] == tokens and len(tokens) == 5
    for p, row in zip(probs, reference(served, prompt, tokens)):
        assert p["token"] == text_of(state, p["id"]) and bytes(p["bytes"]) == state.tokenizer.token_bytes(p["id"])
        assert p["logprob"] == pytest.approx(float(row[p["id"]]), abs=1e-3)
        top = torch.topk(row, 4)
        assert [t["id"] for t in p["top_logprobs"]] == top.indices.tolist()
        assert [t["logprob"] for t in p["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-3)


def test_llamacpp_post_sampling_probs(served, http):
    state = served[1]
    prompt = state.tokenizer.encode("Paris is the capital")
    body = http.post("/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0.8, "top_k": 3,
                                          "seed": 5, "n_probs": 10, "post_sampling_probs": True}).json()
    for p, row in zip(body["completion_probabilities"], reference(served, prompt, body["tokens"])):
        top = torch.topk(row, 3)
        kept = torch.softmax(top.values / 0.8, -1)
        assert [t["id"] for t in p["top_probs"]] == top.indices.tolist()  # only what top_k left
        assert [t["prob"] for t in p["top_probs"]] == pytest.approx(kept.tolist(), abs=1e-3)
        assert p["prob"] == pytest.approx(dict(zip(top.indices.tolist(), kept.tolist()))[p["id"]], abs=1e-3)
        assert "logprob" not in p
    greedy = http.post("/completion", json={"prompt": prompt, "n_predict": 2, "temperature": 0, "n_probs": 3,
                                            "post_sampling_probs": True}).json()
    assert all(p["prob"] == 1.0 and len(p["top_probs"]) == 1 for p in greedy["completion_probabilities"])


def test_llamacpp_logit_bias_forms(served, http):
    state = served[1]
    prompt = state.tokenizer.encode("Paris is the capital")
    free = http.post("/completion", json={"prompt": prompt, "n_predict": 3, "temperature": 0}).json()["tokens"]
    fox = state.tokenizer.encode(" fox")
    for bias in ([[fox[-1], 100]], {str(fox[-1]): 100}, [[" fox", 100]] if len(fox) == 1 else [[fox[-1], 100]]):
        tokens = http.post("/completion", json={"prompt": prompt, "n_predict": 3, "temperature": 0,
                                                "logit_bias": bias}).json()["tokens"]
        assert tokens == [fox[-1]] * 3, bias
    for bias in ([[free[0], False]], {str(free[0]): False}):
        tokens = http.post("/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0,
                                                "logit_bias": bias}).json()["tokens"]
        assert tokens != free[:1], bias
