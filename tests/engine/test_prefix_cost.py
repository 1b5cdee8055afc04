"""The prefix cache costs nothing where it cannot hit: many distinct prompts at once, none sent
again, take the same steps and the same time with the cache (its checkpoints, their moves to the
host tier) as without it, and give the same tokens."""
from __future__ import annotations

import time

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_qwen3_5

STREAMS, PROMPT, OUT = 16, 200, 24


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def engine(parts, **kw) -> LLMEngine:
    model, tok = parts
    return LLMEngine(model, tok, EngineConfig(max_context=512, max_concurrency=STREAMS, prefill_chunk=2048,
                                              host_cache_mib=64, **kw))


def load(round_: int) -> list[Request]:
    """``STREAMS`` greedy requests of distinct ``PROMPT``-token prompts (new ones each round)."""
    g = torch.Generator().manual_seed(round_)
    return [Request(f"r{round_}-{i}", torch.randint(3, 390, (PROMPT,), generator=g).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True), max_total_tokens=512)
            for i in range(STREAMS)]


def run(eng: LLMEngine, reqs: list[Request]) -> tuple[int, float, dict[str, list[int]], int]:
    """All of ``reqs`` at once to the end: the steps, their summed time, each request's tokens,
    and how many checkpoints were evicted inside the steps or left beyond the table after one
    (which a GPU's engine evicts while its next step runs, ``LLMEngine.step``)."""
    prefix = eng.caches.prefix
    evictions = [0]
    if prefix is not None:
        evict_one = prefix.evict_one

        def counted(keep: bool = False) -> bool:
            evictions[0] += 1
            return evict_one(keep)

        prefix.evict_one = counted
    for r in reqs:
        eng.add_request(r)
    steps, spent, out = 0, 0.0, {r.request_id: [] for r in reqs}
    while eng.has_work:
        t0 = time.thread_time()  # the engine steps on this thread (torch on one: conftest's ``_few_threads``)
        outputs = eng.step()
        spent += time.thread_time() - t0
        steps += 1
        if prefix is not None:
            evictions[0] += prefix.over
        for o in outputs:
            out[o.request_id] += list(o.token_ids or [])
    if prefix is not None:
        del prefix.evict_one
    while eng.idle_work():  # as the server's loop does between steps and requests (no step waits for it)
        pass
    return steps, spent, out, evictions[0]


def test_distinct_prompts_take_the_same_steps_and_time_with_the_cache_as_without(parts):
    cached, plain = engine(parts), engine(parts, prefix_cache=False)
    prefix = cached.caches.prefix
    assert prefix is not None and plain.caches.prefix is None
    times = {"on": [], "off": []}
    for round_ in range(8):  # alternating, so a slower moment of the machine falls on both; the least of seven each
        for name, eng in (("on", cached), ("off", plain)) if round_ % 2 else (("off", plain), ("on", cached)):
            steps, spent, out, evicted = run(eng, load(round_))
            times[name].append((steps, spent, out, evicted))
    for (s_on, _, out_on, _), (s_off, _, out_off, _) in zip(times["on"], times["off"]):
        assert s_on == s_off  # no step added: no chunk cut, nothing waited for
        assert out_on == out_off  # token-identical
    # every request left two checkpoints (where its prompt and its answer ended); the newest
    # stay on the device, less two places for each of the next burst's requests (kept free while
    # the engine is idle, so its steps evict none, not even where the table fills: each round
    # after the first two finds it full), and the rest went to the host tier, where they stay
    # within its budget
    assert [evicted for _, _, _, evicted in times["on"]] == [0] * 8
    assert len(prefix) == prefix.max_entries - 2 * STREAMS and prefix.num_host > 0
    assert cached.caches.host_checkpoint_bytes <= cached.caches.host_cache_bytes
    on = min(spent for _, spent, _, _ in times["on"][1:])  # the first round of each warms up
    off = min(spent for _, spent, _, _ in times["off"][1:])
    assert on <= 1.10 * off, f"the steps took {on / off:.3f}x as long with the prefix cache"
    print(f"summed step time with the cache {on * 1e3:.0f} ms, without {off * 1e3:.0f} ms ({on / off:.3f}x)")
