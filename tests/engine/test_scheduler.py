"""Many requests sharing one engine: batch invariance, seeded sampling, small pools, cancellation."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request, Status
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_llama, save_tiny_qwen3, save_tiny_qwen3_5, save_tiny_qwen3_next

BUILDERS = {  # every model family: batch invariance over steps that mix prompt chunks and decode rows
    "llama": save_tiny_llama,
    "qwen3": save_tiny_qwen3,
    "qwen3_next": save_tiny_qwen3_next,
    "qwen3_5": save_tiny_qwen3_5,
    "qwen3_5_moe": lambda p: save_tiny_qwen3_5(p, moe=True),
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def parts(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt")
    ckpt = load_checkpoint(path)
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def engine_for(parts, **kw) -> LLMEngine:
    model, tok = parts
    cfg = {"max_context": 128, "prefill_chunk": 32, "max_concurrency": 8, "kv_capacity": 2048, "page_size": 8,
           **kw}
    return LLMEngine(model, tok, EngineConfig(**cfg))


def prompts(tok, n: int = 8) -> list[list[int]]:
    ids = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 4)
    return [ids[i : i + 6 + 9 * i] for i in range(n)]  # 6 .. 69 tokens, all different


def request(i: int, prompt: list[int], **params) -> Request:
    sp = SamplingParams(**{"temperature": 0.0, "max_tokens": 16 + i, "ignore_eos": True, **params})
    return Request(f"r{i}", list(prompt), sp, max_total_tokens=128, eos_ids=frozenset({2}))


def drain(engine: LLMEngine, reqs: list[Request], steps: int | None = None) -> dict[str, list[int]]:
    for r in reqs:
        engine.add_request(r)
    n = 0
    while engine.has_work and (steps is None or n < steps):
        engine.step()
        n += 1
    return {r.request_id: list(r.output_ids) for r in reqs}


def test_eight_concurrent_greedy_equal_each_alone(parts):
    ps = prompts(parts[1])
    alone = {}
    for i, p in enumerate(ps):
        alone.update(drain(engine_for(parts), [request(i, p)]))
    engine = engine_for(parts)
    together = drain(engine, [request(i, p) for i, p in enumerate(ps)])
    assert together == alone
    assert all(len(v) == 16 + i for i, v in enumerate(together.values()))
    assert engine.caches.idle()


def test_seeded_sampling_ignores_neighbours(parts):
    ps = prompts(parts[1])
    params = dict(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20)
    alone = drain(engine_for(parts), [request(0, ps[3], **params)])["r0"]
    assert len(alone) == 20
    others = [request(i, p, temperature=1.0, seed=None) for i, p in enumerate(ps) if i != 0]
    mixed = drain(engine_for(parts), [request(0, ps[3], **params), *others])["r0"]
    assert mixed == alone
    other_seed = drain(engine_for(parts), [request(0, ps[3], **{**params, "seed": 99})])["r0"]
    assert other_seed != alone  # the seed matters


@pytest.mark.parametrize("route, host_mib", [("replay", 0), ("snapshot", 64)])
def test_small_pool_pauses_and_still_matches(parts, route, host_mib):
    ps = prompts(parts[1])
    reqs = lambda: [request(i, p) for i, p in enumerate(ps)]  # noqa: E731
    ample = drain(engine_for(parts), reqs())
    engine = engine_for(parts, kv_capacity=128, host_cache_mib=host_mib)  # one request's worth of pages
    small = drain(engine, reqs())
    assert small == ample
    stats = engine.scheduler.stats
    if route == "replay":
        assert stats.preempted_replay > 0 and stats.preempted_snapshot == 0 and stats.replayed_tokens > 0
    else:
        assert stats.preempted_snapshot > 0 and stats.preempted_replay == 0
        assert stats.restored == stats.preempted_snapshot
    assert engine.caches.idle()


def test_cancel_mid_prefill_and_mid_decode_restores_idle_pools(parts):
    ps = prompts(parts[1])
    engine = engine_for(parts, prefill_chunk=16)
    long_prompt = ps[7]  # 69 tokens: five prefill chunks
    a, b, c = request(0, ps[2], max_tokens=40), request(1, long_prompt), request(2, ps[4])
    for r in (a, b, c):
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    assert b.status is Status.PREFILL and 0 < b.num_computed < len(long_prompt)
    assert a.status is Status.DECODE and a.output_ids
    assert engine.abort("r1").finish_reason == "abort"  # mid-prefill
    assert engine.abort("r0").finish_reason == "abort"  # mid-decode
    while engine.has_work:
        engine.step()
    assert engine.caches.idle()
    assert c.output_ids == drain(engine_for(parts), [request(2, ps[4])])["r2"]


def test_the_step_budget_takes_decode_rows_first_then_prompt_chunks_oldest_first(parts):
    """``max_batched_tokens``: every decoding request's token, whatever the budget, then chunks of
    as many prompts as fit (each at most ``prefill_chunk``), in admission order; the outputs are
    each request's alone."""
    engine = engine_for(parts, max_batched_tokens=40)
    ps = prompts(parts[1], 4)[1:]  # 15, 24 and 33 tokens
    reqs = [request(i, p) for i, p in enumerate(ps)]
    for r in reqs:
        engine.add_request(r)
    plan = engine.scheduler.schedule()
    assert [(r.request_id, n) for r, n in plan] == [("r0", 15), ("r1", 24), ("r2", 1)]
    engine.runner.execute(plan)
    assert reqs[0].num_computed == 15 and reqs[2].num_computed == 1
    engine.scheduler.running[0].output_ids.append(7)  # r0 now decodes (its token, as the engine would)
    engine.scheduler.running[0].status = Status.DECODE
    engine.scheduler.running[1].output_ids.append(7)
    engine.scheduler.running[1].status = Status.DECODE
    plan = engine.scheduler.schedule()
    assert [(r.request_id, n) for r, n in plan] == [("r0", 1), ("r1", 1), ("r2", 32)]
    for r in reqs:
        engine.abort(r.request_id)
    assert engine.caches.idle()


def test_the_warm_up_leaves_nothing_behind(parts):
    """``LLMEngine.warm_up`` (run at start on CUDA) over every round of row mixes: the pools idle
    again, nothing counted, and a request served after it gets the tokens it gets without."""
    ps = prompts(parts[1], 3)
    plain = drain(engine_for(parts), [request(i, p) for i, p in enumerate(ps)])
    engine = engine_for(parts)
    engine.warm_up()
    assert engine.caches.idle() and not engine.has_work
    assert engine.counters.prompt_tokens == 0 and engine.scheduler.stats.preempted_replay == 0
    assert drain(engine, [request(i, p) for i, p in enumerate(ps)]) == plain
