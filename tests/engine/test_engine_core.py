"""The synchronous engine core on a tiny Llama: batching, chunked prefill, stops, aborts."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_llama


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    ckpt = load_checkpoint(save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def make_engine(parts, **kw) -> LLMEngine:
    model, tok = parts
    return LLMEngine(model, tok, EngineConfig(**{"max_context": 256, "prefill_chunk": 64, **kw}))


def run(engine: LLMEngine, requests: list[Request]) -> dict[str, tuple[list[int], str, str]]:
    for r in requests:
        engine.add_request(r)
    text: dict[str, list[str]] = {r.request_id: [] for r in requests}
    done = {}
    while engine.has_work:
        for out in engine.step():
            text[out.request_id].append(out.text)
            if out.finished:
                req = next(r for r in requests if r.request_id == out.request_id)
                done[out.request_id] = (list(req.output_ids), "".join(text[out.request_id]), out.finish_reason)
    return done


def req(i: int, prompt: list[int], **params) -> Request:
    return Request(f"r{i}", prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 12, **params}),
                   max_total_tokens=256, eos_ids=frozenset({2}))


def prompts(tok) -> list[list[int]]:
    base = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 3)
    return [base[: 5 + 17 * i] for i in range(5)]


def test_concurrent_greedy_equals_alone(parts):
    ps = prompts(parts[1])
    alone = {f"r{i}": run(make_engine(parts), [req(i, p)])[f"r{i}"] for i, p in enumerate(ps)}
    together = run(make_engine(parts, max_concurrency=4), [req(i, p) for i, p in enumerate(ps)])
    assert together == alone


def test_chunked_prefill_equals_one_shot(parts):
    p = prompts(parts[1])[-1]
    assert len(p) > 40
    small = run(make_engine(parts, prefill_chunk=16), [req(0, p)])  # 4 chunks
    big = run(make_engine(parts, prefill_chunk=1024), [req(0, p)])
    assert small == big


def test_max_tokens_zero_is_prompt_only(parts):
    out = run(make_engine(parts), [req(0, prompts(parts[1])[1], max_tokens=0)])
    assert out["r0"] == ([], "", "length")


def test_context_limit_ends_with_length(parts):
    p = prompts(parts[1])[1]
    r = Request("r0", p, SamplingParams(temperature=0.0, ignore_eos=True), max_total_tokens=len(p) + 5)
    out = run(make_engine(parts), [r])
    assert out["r0"][2] == "length" and len(out["r0"][0]) == 5


def test_abort_mid_decode_frees_the_request(parts):
    engine = make_engine(parts)
    a, b = req(0, prompts(parts[1])[2], max_tokens=50, ignore_eos=True), req(1, prompts(parts[1])[3])
    engine.add_request(a)
    engine.add_request(b)
    for _ in range(4):
        engine.step()
    out = engine.abort("r0")
    assert out.finished and out.finish_reason == "abort"
    assert a.cache is None and a not in engine.running
    while engine.has_work:
        engine.step()
    alone = run(make_engine(parts), [req(1, prompts(parts[1])[3])])
    assert b.output_ids == alone["r1"][0]
    assert not engine.has_work and not engine.running


def test_eos_stops_and_is_not_text(parts):
    model, tok = parts
    p = prompts(tok)[2]
    free = run(make_engine(parts), [req(0, p, max_tokens=8, ignore_eos=True)])["r0"][0]
    eos = free[3]
    out = run(make_engine(parts), [Request("r0", p, SamplingParams(temperature=0.0, max_tokens=8),
                                           max_total_tokens=256, eos_ids=frozenset({eos}))])["r0"]
    first = free.index(eos)
    assert out[0] == free[: first + 1] and out[2] == "stop"
    assert out[1] == tok.decode(free[:first])


def test_forced_close_tokens_run_in_one_step(parts):
    """A thinking budget commits its close tokens without sampling; the next step runs them all in
    one forward (not one token per step), and then a token is sampled again."""
    from ninfer.engine.sampling_params import ThinkingControl

    model, tok = parts
    engine = make_engine(parts)
    close = (5, 6, 7, 2)
    control = ThinkingControl(end_id=2, budget=3, close_ids=close)
    r = Request("r0", prompts(tok)[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                      thinking=control), max_total_tokens=256)
    engine.add_request(r)
    while len(r.output_ids) < 3:
        engine.step()
    assert r.output_ids[3:] == list(close)  # forced right after the third reasoning token
    assert r.num_tokens - r.num_computed == 1 + len(close)
    (req, n), = engine.scheduler.schedule()
    assert req is r and n == 1 + len(close)
