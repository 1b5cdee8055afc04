"""return_progress: prompt-processing events per committed prefill chunk, never backwards, the
last one (processed == total) before the first output delta."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.tiny import save_tiny_llama


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny-llama")
    state, loop = build_state(build_parser().parse_args([str(path), "--max-context", "512", "--prefill-chunk", "16"]))
    loop.start()
    with TestClient(create_app(state)) as client:
        yield client
    loop.stop()


def test_progress_per_prefill_chunk(client):
    body = {"model": "tiny-llama", "stream": True, "return_progress": True, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 6}]}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    kinds = ["progress" if "prompt_progress" in c else "delta" if c["choices"] and c["choices"][0]["delta"].get(
        "content") else "other" for c in chunks]
    progress = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
    total = progress[0]["total"]
    assert total > 48  # several 16-token chunks
    processed = [p["processed"] for p in progress]
    assert processed[0] == progress[0]["cache"] == 0
    assert processed[-1] == total
    assert processed == sorted(set(processed))  # cumulative, never backwards, no repeats
    # one event per committed chunk of 16, the one that crosses where the messages end cut there
    # (a prefix checkpoint is kept at that point, before the generation prompt)
    turn_end = total - len(client.app.state.ninfer.tokenizer.encode("<|im_start|>assistant\n"))
    chunks, at = [], 0
    while at < total:
        at = turn_end if at < turn_end < at + 16 else min(at + 16, total)
        chunks.append(at)
    assert processed[1:] == chunks
    if "delta" in kinds:
        assert kinds.index("delta") > max(i for i, k in enumerate(kinds) if k == "progress")
