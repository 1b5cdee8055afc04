"""Constrained decoding on the GPU, where decode steps run from CUDA graphs and are launched
ahead: rows under a grammar draw their tokens after the step before them is read, and their
output holds to the grammar and ends with a stop id, while a free row beside them runs on to its
limit."""
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
    return load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer, frozenset(ckpt.generation.eos_token_ids)


def run(parts, requests: list[Request]) -> dict[str, list[int]]:
    model, tok, _ = parts
    eng = LLMEngine(model, tok, EngineConfig(max_context=256, max_concurrency=4, prefill_chunk=64, kv_capacity=2048,
                                             device="cuda", dtype=torch.float32))
    assert eng.runner.graphs is not None
    for r in requests:
        eng.add_request(r)
    while eng.has_work:
        eng.step()
    return {r.request_id: list(r.output_ids) for r in requests}


def req(parts, name: str, prompt: list[int], grammar=None, **params) -> Request:
    """As the server makes it: the model's stop ids, which a grammar's end allows (and only those)."""
    return Request(name, prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "grammar": grammar, **params}),
                   max_total_tokens=256, eos_ids=parts[2])


def test_rows_under_a_grammar_beside_a_free_row_on_the_gpu(parts):
    tok = parts[1]
    prompts = {"w": tok.encode("Some words: "), "free": tok.encode("A free row that runs to its limit. "),
               "c": tok.encode("A colour and an answer: ")}
    words = GrammarSpec("regex", r"[a-z ]{6,30}", "guided_regex")
    choice = GrammarSpec("regex", r"(red|green|blue) (yes|no)", "guided_regex")
    got = run(parts, [req(parts, "w", prompts["w"], grammar=words), req(parts, "free", prompts["free"], ignore_eos=True),
                      req(parts, "c", prompts["c"], grammar=choice, temperature=1.0, seed=5)])
    assert len(got["free"]) == 40
    text = {name: tok.decode([t for t in ids if t not in parts[2]]) for name, ids in got.items()}
    assert got["w"][-1] in parts[2] and re.fullmatch(r"[a-z ]{6,30}", text["w"]), text["w"]
    assert got["c"][-1] in parts[2] and re.fullmatch(r"(red|green|blue) (yes|no)", text["c"]), text["c"]
