"""An engine failure is visible on /health and ends ninfer-serve with exit code 2; a failure that
belongs to one request ends that request alone."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from ninfer.engine.engine import LLMEngine
from ninfer.server import cli
from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from support.faults import FaultyDecode
from support.live_server import LiveServer
from support.scripted import scripted_state
from support.server_process import free_port
from support.tiny import save_tiny_llama

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def broken_step(self):
    raise RuntimeError("simulated device fault")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny")


def test_failed_step_turns_health_503(tiny, monkeypatch):
    monkeypatch.setattr(LLMEngine, "step", broken_step)
    state, loop = build_state(cli.build_parser().parse_args([str(tiny), "--engine-thread"]))
    failures = []
    loop.on_failure = failures.append
    loop.start()
    with TestClient(create_app(state)) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503
        assert "simulated device fault" in r.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "simulated device fault" in health.json()["error"]
        assert client.post("/v1/chat/completions", json=BODY).status_code == 503
    assert len(failures) == 1


def test_failed_step_ends_the_process_with_code_2(tiny, monkeypatch):
    monkeypatch.setattr(LLMEngine, "step", broken_step)
    port = free_port()
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(cli.main([str(tiny), "--engine-thread", "--port", str(port)])))
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not result:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    assert httpx.post(base + "/v1/chat/completions", timeout=30, json=BODY).status_code == 503
    thread.join(30)
    assert result == [cli.EXIT_ENGINE_FAILURE]


def test_a_fault_in_one_requests_output_ends_that_request_alone():
    """The request whose output cannot be decoded gets a 500 ``internal_error``; the stream
    beside it runs to its end, /health stays 200 and the next request is served."""
    state, loop = scripted_state({"kaboom": "It goes KABOOM here.", "story": "once upon a time " * 20})
    engine = state.engine.loop.engine
    tok = engine.tokenizer
    fault_id = tok.encode(" KABOOM")[0]
    assert fault_id not in tok.encode("once upon a time " * 20)
    engine.tokenizer = FaultyDecode(tok, fault_id)  # read by each request's detokenizer
    engine.model.step_delay = 0.01  # the story is still streaming when the other one fails
    loop.start()
    try:
        with LiveServer(create_app(state)) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
            story = {"prompt": "Tell me a story.", "n_predict": 200}
            with client.stream("POST", "/completion", json={**story, "stream": True}) as streamed:
                assert streamed.status_code == 200
                events = (json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: "))
                first = next(events)
                failed = client.post("/completion", json={"prompt": "Tell me a kaboom.", "n_predict": 200})
                rest = list(events)
            assert failed.status_code == 500, failed.text
            assert failed.json()["error"]["code"] == "internal_error"
            assert "KeyError" in failed.json()["error"]["message"]
            assert "".join(e["content"] for e in [first, *rest]) == "once upon a time " * 20
            assert rest[-1]["stop"] is True and rest[-1]["stop_type"] == "eos"
            assert client.get("/health").status_code == 200
            after = client.post("/completion", json=story)
            assert after.status_code == 200 and after.json()["content"] == "once upon a time " * 20
    finally:
        loop.stop()
