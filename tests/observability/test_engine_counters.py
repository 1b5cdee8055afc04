"""Engine work counters stay exact when requests are paused and replayed or restored."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from ninfer.engine.stats import EngineCounters
from support.tiny import save_tiny_llama


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    ckpt = load_checkpoint(save_tiny_llama(tmp_path_factory.mktemp("llama") / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


@pytest.mark.parametrize("host_mib", [0, 64], ids=["replay", "snapshot"])
def test_counts_under_preemption(parts, host_mib):
    model, tok = parts
    engine = LLMEngine(model, tok, EngineConfig(max_context=128, prefill_chunk=32, max_concurrency=8,
                                                kv_capacity=128, page_size=8, host_cache_mib=host_mib))
    ids = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 4)
    reqs = [Request(f"r{i}", ids[i: i + 6 + 9 * i], SamplingParams(temperature=0.0, max_tokens=16 + i, ignore_eos=True),
                    max_total_tokens=128) for i in range(8)]
    for r in reqs:
        engine.add_request(r)
    while engine.has_work:
        engine.step()
    c, s = engine.counters, engine.scheduler.stats
    assert s.preempted_replay + s.preempted_snapshot > 0
    assert c.prompt_tokens == c.prefill_tokens == sum(len(r.prompt_ids) for r in reqs)
    assert c.cached_tokens == 0
    assert c.generation_tokens == sum(len(r.output_ids) for r in reqs) == sum(16 + i for i in range(8))
    assert c.decode_tokens == c.generation_tokens - len(reqs)
    assert c.replayed_tokens == s.replayed_tokens
    assert s.replay_restored == s.preempted_replay and s.restored == s.preempted_snapshot
    assert c.admitted_requests == len(reqs) and not c._frontier


def test_window_counts_whole_seconds():
    c = EngineCounters()
    c._ring[100 % len(c._ring)] = (100, 7, 3)
    c._ring[95 % len(c._ring)] = (95, 1, 1)
    c._ring[40 % len(c._ring)] = (40, 50, 50)  # outside the last minute
    assert c.window(1, now=101.5) == (7, 3)
    assert c.window(10, now=101.5) == (8, 4)
    assert c.window(60, now=101.5) == (8, 4)
    assert c.window(1, now=100.2) == (0, 0)  # the current second is not over
