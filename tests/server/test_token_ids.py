"""A checkpoint whose ``vocab_size`` exceeds its tokenizer (Qwen3.5 declares 248,320 rows, the
tokenizer has 248,077 ids) serves sampled text with every id decodable, and token-id prompts past
the tokenizer are a 400 naming the id's place, with the server healthy after."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.tiny import QWEN_TOKENIZER_IDS, save_tiny_qwen3_5_padded_vocab

REQUESTS, TOKENS = 8, 250  # 2,000 sampled tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_qwen3_5_padded_vocab(tmp_path_factory.mktemp("ckpt") / "padded")


def serve(checkpoint, device: str, *flags: str):
    args = build_parser().parse_args([str(checkpoint), "--device", device, "--max-concurrency", str(REQUESTS),
                                      "--max-context", "512", "--kv-capacity", "8192", "--model-id", "padded", *flags])
    state, loop = build_state(args)
    loop.start()
    return state, loop


@pytest.fixture(scope="module")
def cpu_server(checkpoint):
    state, loop = serve(checkpoint, "cpu")
    with LiveServer(create_app(state)) as server:
        yield server, state
    loop.stop()


def completion(base_url: str, prompt: str, seed: int, temperature: float) -> httpx.Response:
    body = {"prompt": prompt, "n_predict": TOKENS, "temperature": temperature, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0, "seed": seed, "ignore_eos": True}
    return httpx.post(base_url + "/completion", json=body, timeout=600)


def check_concurrent_sampling(server, state, temperature: float) -> None:
    prompts = ["Tell me a story about the sea.", "What is 2 + 2?", "Hello!", "List three colours.",
               "Write a haiku.", "Explain rain.", "Translate 'cat' to French.", "Say something."]
    with ThreadPoolExecutor(REQUESTS) as pool:
        replies = list(pool.map(lambda i: completion(server.base_url, prompts[i], i, temperature), range(REQUESTS)))
    for r in replies:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens_predicted"] == len(body["tokens"]) == TOKENS and body["stop_type"] == "limit"
        assert all(0 <= t < QWEN_TOKENIZER_IDS for t in body["tokens"])
        assert body["content"] == state.tokenizer.decode(body["tokens"])  # every id decodable, the text is theirs
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_padded_vocabulary_serves_2000_sampled_tokens_across_8_requests(cpu_server):
    check_concurrent_sampling(*cpu_server, temperature=1.5)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.5, 0.0], ids=["sampled", "greedy-in-graph"])
def test_padded_vocabulary_on_cuda(checkpoint, temperature):
    """The same on the GPU: batched decode in CUDA graphs, the greedy argmax inside the graph."""
    state, loop = serve(checkpoint, "cuda", "--engine-thread")  # its engine read here
    try:
        assert state.engine.loop.engine.runner.graphs is not None
        with LiveServer(create_app(state)) as server:
            check_concurrent_sampling(server, state, temperature)
    finally:
        loop.stop()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [9707, QWEN_TOKENIZER_IDS + 3], "max_tokens": 2}, "prompt[1]"),
    ("/v1/completions", {"prompt": [-1, 9707], "max_tokens": 2}, "prompt[0]"),
    ("/completion", {"prompt": ["Hello", 9707, QWEN_TOKENIZER_IDS], "n_predict": 2}, "prompt[2]"),
    ("/detokenize", {"tokens": [9707, QWEN_TOKENIZER_IDS + 200]}, "tokens[1]"),
])
def test_token_ids_past_the_tokenizer_are_refused(cpu_server, path, body, param):
    """Ids the model has rows for but the tokenizer cannot decode are refused as any other id
    out of range; the server stays healthy and serves the next request."""
    server, _ = cpu_server
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value"
    assert f"out of range [0, {QWEN_TOKENIZER_IDS})" in error["message"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": [9707, 11], "max_tokens": 2,
                                                               "temperature": 0}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
