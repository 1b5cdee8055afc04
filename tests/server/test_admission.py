"""Admission control over HTTP: 429 when full, 503 when not admitted in time, disconnect cancels."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from support.scripted import scripted_servers
from support.waiting import wait_for

LONG = "word " * 400


def body(stream: bool = True) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": "go"}], "stream": stream}


def slow_steps(state) -> None:
    state.engine.loop.engine.model.step_delay = 0.02


@pytest.fixture
def serve():
    with scripted_servers(LONG, slow_steps) as start:
        yield start


def hold_stream(url: str, opened: threading.Event, release: threading.Event) -> None:
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body()) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        opened.set()
        release.wait(20)


def test_429_once_concurrency_plus_pending_are_outstanding(serve):
    server, state = serve("--max-concurrency", "2", "--max-pending-requests", "1")
    url = server.base_url + "/v1/chat/completions"
    release = threading.Event()
    held = []
    for _ in range(2):  # two admitted, streaming
        opened = threading.Event()
        t = threading.Thread(target=hold_stream, args=(url, opened, release))
        t.start()
        assert opened.wait(10)
        held.append(t)
    # the third waits in the queue (non-streamed, so it stays outstanding without admission)
    queued = threading.Thread(target=lambda: httpx.post(url, json={**body(False), "max_tokens": 3}, timeout=60))
    queued.start()
    assert wait_for(lambda: state.engine.outstanding == 3)
    r = httpx.post(url, json=body(stream=False), timeout=10)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "server_overloaded"
    release.set()
    for t in held:
        t.join(20)
    queued.join(60)


def test_503_when_not_admitted_in_time(serve):
    server, state = serve("--max-concurrency", "1", "--pending-timeout-ms", "300")
    url = server.base_url + "/v1/chat/completions"
    release, opened = threading.Event(), threading.Event()
    t = threading.Thread(target=hold_stream, args=(url, opened, release))
    t.start()
    assert opened.wait(10)
    started = time.monotonic()
    r = httpx.post(url, json=body(stream=True), timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "request_queue_timeout"
    assert 0.25 < time.monotonic() - started < 5
    release.set()
    t.join(20)


def test_closing_a_stream_cancels_the_request(serve):
    server, state = serve()
    engine = state.engine.loop.engine
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.base_url + "/v1/chat/completions", json=body()) as r:
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            assert len(engine.running) == 1
    assert wait_for(lambda: len(engine.running) == 0 and not engine.waiting, 5)
    assert wait_for(lambda: engine.caches.idle(), 5)
    assert state.engine.outstanding == 0
