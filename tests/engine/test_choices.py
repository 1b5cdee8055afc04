"""Several choices of one prompt (``n``): the first request computes the prompt, the others go on
from its checkpoint where the last prompt token begins, each drawing with its own seed."""
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


def engine(parts, **kw) -> LLMEngine:
    return LLMEngine(*parts, EngineConfig(**{"max_context": 256, "prefill_chunk": 32, **kw}))


def choice(i: int, prompt: list[int], seed: int, **kw) -> Request:
    return Request(f"c{i}", prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=12, ignore_eos=True),
                   max_total_tokens=256, **kw)


def run(eng: LLMEngine, reqs: list[Request]) -> dict[str, list[int]]:
    for r in reqs:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    return {r.request_id: r.output_ids for r in reqs}


def test_choices_compute_the_prompt_once_and_draw_as_single_requests(parts):
    tok = parts[1]
    prompt = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 2)
    alone = {}
    for i in range(4):
        alone.update(run(engine(parts), [choice(i, prompt, 100 + i)]))
    eng = engine(parts)
    group = [choice(0, prompt, 100, forks=3)] + [choice(i, prompt, 100 + i, fork_of="c0") for i in range(1, 4)]
    together = run(eng, group)
    assert together == alone and len({tuple(v) for v in together.values()}) == 4
    assert eng.counters.prefill_tokens == len(prompt) + 3  # the prompt once, then each other choice's last token
    assert [r.cached_tokens for r in group] == [0] + [len(prompt) - 1] * 3


def test_without_a_prefix_cache_each_choice_computes_its_prompt(parts):
    prompt = parts[1].encode("Paris is the capital of France.")
    eng = engine(parts, prefix_cache=False)
    group = [choice(0, prompt, 7, forks=1), choice(1, prompt, 8, fork_of="c0")]
    together = run(eng, group)
    assert together == {**run(engine(parts), [choice(0, prompt, 7)]), **run(engine(parts), [choice(1, prompt, 8)])}
    assert eng.counters.prefill_tokens == 2 * len(prompt)
