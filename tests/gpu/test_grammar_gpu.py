"""Constrained decoding on the GPU, where decode steps run from CUDA graphs and are launched
ahead: rows under a grammar draw their tokens after the step before them is read, and their
output holds to the grammar while a free row beside them keeps the tokens it has alone."""
from __future__ import annotations

import re

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.grammar import GrammarSpec
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.tiny import save_tiny_qwen3_5

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5") / "ckpt"))
    return load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer


def run(parts, requests: list[Request]) -> dict[str, list[int]]:
    model, tok = parts
    eng = LLMEngine(model, tok, EngineConfig(max_context=256, max_concurrency=4, prefill_chunk=64, kv_capacity=2048,
                                             device="cuda", dtype=torch.float32))
    assert eng.runner.graphs is not None
    for r in requests:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    return {r.request_id: list(r.output_ids) for r in requests}


def req(name: str, prompt: list[int], grammar=None, **params) -> Request:
    return Request(name, prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "grammar": grammar, **params}),
                   max_total_tokens=256)


def test_rows_under_a_grammar_beside_a_free_row_on_the_gpu(parts):
    tok = parts[1]
    prompts = {"w": tok.encode("Some words: "), "free": tok.encode("A free row that runs to its limit. "),
               "c": tok.encode("A colour and an answer: ")}
    # the same three rows free: the free row's step shapes are the same as beside the held rows
    unheld = run(parts, [req(name, p, ignore_eos=True) for name, p in prompts.items()])
    words = GrammarSpec("regex", r"[a-z ]{6,30}", "guided_regex")
    choice = GrammarSpec("regex", r"(red|green|blue) (yes|no)", "guided_regex")
    got = run(parts, [req("w", prompts["w"], grammar=words), req("free", prompts["free"], ignore_eos=True),
                      req("c", prompts["c"], grammar=choice, temperature=1.0, seed=5)])
    assert got["free"] == unheld["free"]
    assert re.fullmatch(r"[a-z ]{6,30}", tok.decode(got["w"])), tok.decode(got["w"])
    assert re.fullmatch(r"(red|green|blue) (yes|no)", tok.decode(got["c"])), tok.decode(got["c"])
