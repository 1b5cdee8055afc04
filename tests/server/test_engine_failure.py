"""An engine failure is visible on /health and ends ninfer-serve with exit code 2."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from ninfer.engine.engine import LLMEngine
from ninfer.server import cli
from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
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
    state, loop = build_state(cli.build_parser().parse_args([str(tiny)]))
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
    thread = threading.Thread(target=lambda: result.append(cli.main([str(tiny), "--port", str(port)])))
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
