"""A returning turn's host cost does not grow with the prefix it finds cached.

A conversation that comes back resends everything so far; the engine goes on from a prefix
checkpoint and computes only the new tokens. What the server does with the whole prompt on the
way (the body parsed and checked, the ids handed to the engine, the checkpoint looked up and a new
one kept, the first token published) must stay small beside that: no Python step per prompt token,
no decode of the whole prompt, nothing hashed twice. Served by a scripted model, whose forward
costs next to nothing per token, so the time to first token is the server's own: a returning turn
after 30,000 cached tokens against one after 1,000, through HTTP (``/completion``, token ids, as
``bench.serve`` sends them), the best of several rounds of each. On two busy cores the ratio came
to 2.9-4.0; the code before took 6.1-10.1 (the prompt decoded before it went to the engine, a
hash chain over it built three times, Python loops over its ids in the type checks).
"""
from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import scripted_state

LONG, SHORT, NEW = 30_000, 1_000, 256  # cached prefixes, and the new tokens of the returning turn
ROUNDS = 11
RATIO = 5.0  # the long turn's best time to first token over the short one's, at most


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state({}, "Hello there.", "--max-context", "40000", "--max-concurrency", "1",
                                 prefix_cache=True)
    loop.start()
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, timeout=120) as client:
        yield client
    loop.stop()


def first_token_s(client: httpx.Client, ids: list[int]) -> tuple[float, dict]:
    """Seconds from sending ``ids`` (streamed, two tokens) to the first chunk with a token, and the
    final chunk."""
    body = json.dumps({"prompt": ids, "n_predict": 2, "ignore_eos": True, "stream": True, "temperature": 0.0})
    first, final = None, None
    t0 = time.perf_counter()  # the body written already: what a client spends on it is its own
    with client.stream("POST", "/completion", content=body, headers={"content-type": "application/json"}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("tokens") and first is None:
                first = time.perf_counter() - t0
            if chunk.get("stop"):
                final = chunk
    assert first is not None and final is not None
    return first, final


def returning_turn_s(client: httpx.Client, rng: random.Random, cached: int) -> float:
    """A first turn of ``cached`` tokens, then the returning turn (its answer and ``NEW`` tokens
    added): the returning turn's time to first token."""
    prompt = [rng.randrange(1_000, 200_000) for _ in range(cached)]
    answer = client.post("/completion", json={"prompt": prompt, "n_predict": 2, "ignore_eos": True,
                                              "temperature": 0.0}).json()["tokens"]
    seconds, final = first_token_s(client, prompt + answer + [rng.randrange(1_000, 200_000) for _ in range(NEW)])
    assert final["tokens_cached"] >= cached  # from the checkpoint where the answer (or the prompt) ended
    return seconds


def test_a_long_cached_prefix_costs_the_returning_turn_little_more_than_a_short_one(served):
    rng = random.Random(34)
    returning_turn_s(served, rng, SHORT)  # warm: the first request of a server pays for imports
    long, short = [], []
    for _ in range(ROUNDS):
        long.append(returning_turn_s(served, rng, LONG))
        short.append(returning_turn_s(served, rng, SHORT))
    ratio = min(long) / min(short)
    print(f"returning turn, time to first token: {LONG} cached {min(long) * 1e3:.1f} ms, {SHORT} cached "
          f"{min(short) * 1e3:.1f} ms (best of {ROUNDS}); ratio {ratio:.2f}")
    assert ratio <= RATIO
