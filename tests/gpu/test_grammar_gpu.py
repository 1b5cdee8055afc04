"""Constrained decoding on the GPU, where decode steps run from CUDA graphs and are launched
ahead: rows under a grammar draw their tokens after the step before them is read, and their
output holds to the grammar while a free row beside them keeps the tokens it has alone."""
from __future__ import annotations

import json
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
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}


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
    free = tok.encode("A free row that runs to its limit. ")
    alone = run(parts, [req("free", free, ignore_eos=True)])["free"]
    words = GrammarSpec("regex", r"[a-z ]{6,30}", "guided_regex")
    doc = GrammarSpec.json_schema(SCHEMA, "response_format")
    got = run(parts, [req("w", tok.encode("Some words: "), grammar=words),
                      req("free", free, ignore_eos=True),
                      req("j", tok.encode("A document: "), grammar=doc, temperature=1.0, seed=5)])
    assert got["free"] == alone
    assert re.fullmatch(r"[a-z ]{6,30}", tok.decode(got["w"]))
    doc = json.loads(tok.decode(got["j"]))
    assert set(doc) == {"colour", "ok"} and doc["colour"] in ("red", "green", "blue") and isinstance(doc["ok"], bool)
