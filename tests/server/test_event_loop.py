"""One request's preparation never stalls the others: a 30 MiB prompt is parsed, rendered and
tokenized on worker threads while ``/health`` answers and two streams in flight keep their pace."""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
import time

import httpx
import pytest

from support.scripted import scripted_servers

ANSWER = "word " * 4000  # long enough to outlast the measurement
RELEASES, RELEASE_S = 40, 0.0005  # a step gives up the GIL and takes it back 40 times: about 25 ms
MIB30 = 30 << 20


def gil_hungry(model) -> None:
    """Each engine step lets go of the GIL and takes it back ``RELEASES`` times, as a real model's
    forward does around every kernel it launches: a thread that holds the GIL makes each of those
    wait, so the step slows many times over (where the scripted model's one sleep would not)."""
    forward = model.forward

    def step(*args):
        for _ in range(RELEASES):
            time.sleep(RELEASE_S)
        return forward(*args)

    model.forward = step


@pytest.fixture
def serve():
    with scripted_servers(ANSWER, lambda state: gil_hungry(state.engine.loop.engine.model)) as start:
        yield start


def big_text(size: int) -> str:
    words = "the quick brown fox jumps over the lazy dog 12345, and then; "
    return (words * (size // len(words) + 1))[:size]


class Stream(threading.Thread):
    """A streamed chat request that notes when each chunk of text (reasoning or answer) arrives
    and how much text it brings (a server that is behind sends what piled up as one chunk)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.arrivals, self.sizes, self.stop = url, [], [], threading.Event()

    def run(self) -> None:
        body = {"model": "scripted", "stream": True, "temperature": 0, "messages": [{"role": "user", "content": "go"}]}
        with httpx.Client(timeout=60) as client, client.stream("POST", self.url, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[len("data: "):])["choices"]
                    text = choices[0]["delta"].get("content") or choices[0]["delta"].get("reasoning_content") \
                        if choices else None
                    if text:
                        self.arrivals.append(time.monotonic())
                        self.sizes.append(len(text))
                if self.stop.is_set():
                    return

    def pace(self, start: float, end: float) -> float:
        """Seconds per character of text over [start, end]: stalls count in full."""
        inside = [(t, n) for t, n in zip(self.arrivals, self.sizes) if start <= t <= end]
        assert len(inside) >= 10, f"only {len(inside)} chunks between {start:.2f} and {end:.2f}"
        return (inside[-1][0] - inside[0][0]) / sum(n for _, n in inside[1:])


def test_health_and_two_streams_keep_their_pace_while_a_30_mib_prompt_is_prepared(serve):
    # a context so large that no cheap bound refuses 30 MiB: it is parsed, rendered and tokenized
    # in full (9.6 M tokens), then refused by its exact count
    server, _ = serve("--max-context", str(1 << 20), "--kv-capacity", str(1 << 20), "--max-concurrency", "4")
    streams = [Stream(server.base_url + "/v1/chat/completions") for _ in range(2)]
    for s in streams:
        s.start()
    probe = httpx.Client(timeout=60)
    deadline = time.monotonic() + 30
    while min(len(s.arrivals) for s in streams) < 5:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)
    before, health_before = time.monotonic(), []
    while time.monotonic() < before + 3.0:
        t = time.monotonic()
        assert probe.get(server.base_url + "/health").status_code == 200
        health_before.append(time.monotonic() - t)
        time.sleep(0.02)

    body = json.dumps({"model": "scripted", "messages": [{"role": "user", "content": big_text(MIB30 - 200)}]}).encode()
    result = {}

    def send_big() -> None:
        with httpx.Client(timeout=600) as client:
            result["response"] = client.post(server.base_url + "/v1/chat/completions", content=body,
                                             headers={"content-type": "application/json"})

    sender = threading.Thread(target=send_big)
    during = time.monotonic()
    sender.start()
    health_during = []
    while sender.is_alive():
        t = time.monotonic()
        assert probe.get(server.base_url + "/health").status_code == 200
        health_during.append(time.monotonic() - t)
        time.sleep(0.02)
    after = time.monotonic()
    sender.join()
    for s in streams:
        s.stop.set()

    r = result["response"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    assert after - during > 1.0, "the prompt was not prepared long enough to measure anything"
    for s in streams:
        ratio = s.pace(during, after) / s.pace(before, during)
        assert ratio < 1.5, f"a stream slowed {ratio:.2f}x while the prompt was prepared"
    # 200 ms, or twice the worst seen before on a machine too busy to keep even that
    limit = max(0.2, 2 * max(health_before))
    assert max(health_during) < limit, (f"/health took {max(health_during) * 1000:.0f} ms while the prompt was "
                                        f"prepared (before: at most {max(health_before) * 1000:.0f} ms)")
    print(f"prepared for {after - during:.2f} s; /health median {statistics.median(health_during) * 1000:.0f} ms, "
          f"max {max(health_during) * 1000:.0f} ms; pace ratios "
          f"{[round(s.pace(during, after) / s.pace(before, during), 2) for s in streams]}; us/char "
          f"{[(round(s.pace(before, during) * 1e6), round(s.pace(during, after) * 1e6)) for s in streams]}")



def test_the_number_of_prepare_threads_is_a_setting():
    from ninfer.server.bootstrap import gateway_settings
    from ninfer.server.cli import build_parser

    assert gateway_settings(build_parser().parse_args(["--prepare-threads", "3"]))["workers"].threads == 3
    with pytest.raises(ValueError, match="--prepare-threads must be >= 1"):
        gateway_settings(build_parser().parse_args(["--prepare-threads", "0"]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_prepare_threads_run_below_the_engine_and_the_event_loop():
    """A long preparation takes the cores the engine and the event loop leave idle: its worker
    threads run at a lower priority than the process."""
    from ninfer.server.workers import PRIORITY_DROP, PrepareWorkers

    workers = PrepareWorkers(2)

    def nice_here() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    try:
        worker_nice = asyncio.run(workers.run(nice_here))
    finally:
        workers.close()
    own = os.getpriority(os.PRIO_PROCESS, 0)
    assert worker_nice == min(19, own + PRIORITY_DROP) > own or own == 19
    assert nice_here() == own  # the calling thread keeps its priority
