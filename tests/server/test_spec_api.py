"""``--spec ngram`` through the server on a tiny Llama (and ``--spec mtp`` on a tiny Qwen3.5 with
MTP weights): the text of a greedy ``/completion`` is the same as without it, its ``timings`` carry llama.cpp's ``draft_n`` / ``draft_n_accepted``, and
``/metrics`` and ``/stats`` count the rounds, drafted and accepted tokens."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.tiny import save_tiny_llama

PROMPT = "Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("llama") / "ckpt")


def serve(checkpoint, *flags: str):
    args = build_parser().parse_args([str(checkpoint), "--device", "cpu", "--engine-thread", "--max-context", "256",
                                      "--kv-capacity", "2048", "--model-id", "tiny", *flags])
    state, loop = build_state(args)
    loop.start()
    return state, loop


def complete(client) -> dict:
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 60, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_ngram_drafts_through_the_server(checkpoint):
    state, loop = serve(checkpoint)
    try:
        with TestClient(create_app(state)) as client:
            plain = complete(client)
            assert "draft_n" not in plain["timings"]
            assert client.get("/stats").json()["speculative"]["enabled"] is False
    finally:
        loop.stop()
    state, loop = serve(checkpoint, "--spec", "ngram", "--draft-tokens", "6")
    try:
        with TestClient(create_app(state)) as client:
            fast = complete(client)
            assert fast["content"] == plain["content"] and fast["tokens"] == plain["tokens"]
            timings = fast["timings"]
            assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] <= timings["draft_n"]
            assert timings["predicted_n"] == plain["timings"]["predicted_n"] == 60
            rounds = metric(client, "ninfer_spec_decode_rounds_total")
            assert metric(client, "ninfer_spec_decode_draft_tokens_total") == timings["draft_n"]
            assert metric(client, "ninfer_spec_decode_accepted_tokens_total") == timings["draft_n_accepted"]
            assert 0 < rounds <= timings["draft_n"]
            spec = client.get("/stats").json()["speculative"]
            assert spec["enabled"] is True and spec["accepted"] == timings["draft_n_accepted"]
            assert 0 < spec["acceptance_by_position"][0] <= 1
    finally:
        loop.stop()


def test_mtp_drafts_through_the_server(tmp_path):
    """The head's drafts (random weights: mostly rejected) leave the text as it is, and are counted."""
    from support.mtp_weights import add_mtp_weights
    from support.tiny import save_tiny_qwen3_5

    path = add_mtp_weights(save_tiny_qwen3_5(tmp_path / "qwen3_5"))
    texts = []
    for flags in ((), ("--spec", "mtp", "--draft-tokens", "3")):
        state, loop = serve(path, *flags)
        try:
            with TestClient(create_app(state)) as client:
                out = complete(client)
                texts.append((out["content"], out["tokens"]))
                if flags:
                    assert out["timings"]["draft_n"] > 0
                    assert metric(client, "ninfer_spec_decode_draft_tokens_total") == out["timings"]["draft_n"]
                    assert client.get("/stats").json()["speculative"]["enabled"] is True
        finally:
            loop.stop()
    assert texts[0] == texts[1]
