"""The reasoning-loop guard: reasoning that repeats itself is ended (``stop``) or closed so the
answer follows (``conclude``), where it starts to repeat and not before."""
from __future__ import annotations

import random

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParamError, SamplingParams, ThinkingControl
from ninfer.engine.thinking import LOOP_MIN_SPAN, repeating
from support.tiny import save_tiny_llama


def first_loop(ids: list[int]) -> int | None:
    """How many tokens of ``ids`` are committed when the guard sees them repeat (None: never)."""
    grams: dict = {}
    return next((n for n in range(1, len(ids) + 1) if repeating(ids[:n], grams)), None)


def test_a_period_repeated_over_the_span_is_a_loop_and_varied_text_is_not():
    rng = random.Random(0)
    start = [rng.randrange(1000) for _ in range(40)]
    cycle = [rng.randrange(1000) for _ in range(7)]
    ids = start + cycle * 20
    n = first_loop(ids)
    assert n is not None and n - len(start) >= LOOP_MIN_SPAN  # not before the tail covers the span
    assert n - len(start) < LOOP_MIN_SPAN + len(cycle)
    assert first_loop([rng.randrange(1000) for _ in range(3000)]) is None
    long_cycle = [rng.randrange(1000) for _ in range(100)]
    n = first_loop(start + long_cycle * 4)
    assert n == len(start) + 3 * len(long_cycle)  # three whole repeats of a long period


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    ckpt = load_checkpoint(save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def run(parts, thinking: ThinkingControl | None, prompt: list[int], max_tokens: int = 300):
    model, tok = parts
    eng = LLMEngine(model, tok, EngineConfig(max_context=1024, prefill_chunk=256))
    req = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                              thinking=thinking), max_total_tokens=1024)
    eng.add_request(req)
    final = None
    while eng.has_work:
        for out in eng.step():
            final = out if out.finished else final
    return list(req.output_ids), final


def test_a_looping_reasoning_is_stopped_or_concluded_where_it_repeats(parts):
    tok = parts[1]
    # a random model's greedy output falls into a cycle: find a prompt whose reasoning loops
    for i in range(20):
        prompt = tok.encode(f"Think about case {i} step by step. ")
        free, _ = run(parts, None, prompt)
        at = first_loop(free)
        if at is not None and at < 250:
            break
    else:
        pytest.skip("no prompt made the random model loop")
    end = next(t for t in range(3, 400) if t not in free)  # a close token it never writes itself
    stopped, final = run(parts, ThinkingControl(end_id=end, loop="stop"), prompt)
    assert stopped == free[:at]
    assert final.finish_reason == "stop" and final.reasoning_loop and final.reasoning_tokens == at
    close = (end,)
    concluded, final = run(parts, ThinkingControl(end_id=end, close_ids=close, loop="conclude"), prompt)
    assert concluded[: at + 1] == free[:at] + [end]
    assert final.finish_reason == "length" and final.reasoning_loop and final.reasoning_tokens == at + 1
    # without the guard the same reasoning runs on
    _, final = run(parts, ThinkingControl(end_id=end), prompt)
    assert not final.reasoning_loop and final.finish_reason == "length"


def test_conclude_needs_a_close_suffix():
    with pytest.raises(SamplingParamError):
        ThinkingControl(end_id=5, loop="conclude")
    with pytest.raises(SamplingParamError):
        ThinkingControl(end_id=5, close_ids=(5,), loop="sometimes")
