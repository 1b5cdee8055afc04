"""The embedded SmolLM2 (Q4_1 matrices, a Q8_0 tied embedding) kept quantized on the CPU against its
dequantized load: every projection held quantized, the tied table kept Q8_0 and the LM head in fp16, the
same perplexity on a long English text, and the same answer to the README's question at temperature 0; ``--weights int8`` and ``int4`` (quantized at load
from the dequantized weights) within the issue's 0.5% and 6% of the dequantized perplexity."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.frontend.chat_template import ChatTemplate
from ninfer.engine.layers.linear import Fp16CpuMethod, Int4CpuMethod, Linear
from ninfer.engine.loader import load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.perplexity import perplexity
from support.perplexity import text_ids as english_ids

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def models(smollm2):
    return {w: load_model(smollm2, "cpu", torch.float32, w) for w in ("auto", "dense")}


def test_every_matrix_is_held_quantized(models):
    kept = models["auto"]
    projections = [m for m in kept.modules() if isinstance(m, Linear)]
    assert len(projections) == 7 * 30 and all(m.quantized for m in projections)
    # the Q8_0 embedding is tied to the head: the table stays Q8_0 for the lookups, the head holds
    # it in fp16 (layers/embedding.py); no fp32 copy of it is left
    table, head = kept.model.embed_tokens.table, kept.lm_head.method
    assert table.kind == "Q8_0" and kept.model.embed_tokens.weight is None
    assert isinstance(head, Fp16CpuMethod) and (head.out_features, head.in_features) == (49152, 576)
    table_bytes = sum(t.numel() * t.element_size() for t in (table.q, table.scale))
    dense_head = models["dense"].lm_head.lm_weight
    assert dense_head.dtype == torch.float32 and dense_head.shape == (49152, 576)
    assert head.nbytes == dense_head.numel() * 2 and table_bytes < dense_head.numel() * 1.2
    assert not any(p.numel() >= dense_head.numel() for p in kept.parameters())
    assert projections[0].method.packed0.dtype == torch.uint8
    for layer in kept.model.layers:  # q/k/v and gate/up each one int4 product
        assert isinstance(layer.self_attn._fused, Int4CpuMethod) and isinstance(layer.mlp._fused, Int4CpuMethod)
    quantized_bytes = sum(b.numel() * b.element_size() for m in projections for b in m.method.buffers())
    dense_bytes = sum(m.weight.numel() * 4 for m in models["dense"].modules() if isinstance(m, Linear))
    assert quantized_bytes < dense_bytes / 6  # the packed projections against their fp32 weights


@pytest.fixture(scope="module")
def text_ids(smollm2) -> list[int]:
    return english_ids(smollm2.tokenizer)


@pytest.fixture(scope="module")
def dense_perplexity(models, text_ids) -> float:
    ppl = perplexity(models["dense"], text_ids)
    assert ppl < 30, ppl  # a trained model reading English
    return ppl


def test_perplexity_kept_quantized_equals_dequantized(models, text_ids, dense_perplexity):
    kept = perplexity(models["auto"], text_ids)
    print(f"weights kept quantized: perplexity {kept:.4f} against {dense_perplexity:.4f} "
          f"({(kept / dense_perplexity - 1) * 100:+.3f}%)")
    assert abs(kept - dense_perplexity) / dense_perplexity < 0.001, (kept, dense_perplexity)


def test_perplexity_int8_at_load(smollm2, text_ids, dense_perplexity):
    """``--weights int8`` on the dequantized weights: per-row int8 within 0.5% of the dense
    perplexity."""
    model = load_model(smollm2, "cpu", torch.float32, "int8")
    assert all(m.quantized for m in model.modules() if isinstance(m, Linear))
    ppl = perplexity(model, text_ids)
    print(f"weights int8: perplexity {ppl:.4f} against {dense_perplexity:.4f} "
          f"({(ppl / dense_perplexity - 1) * 100:+.3f}%)")
    assert abs(ppl - dense_perplexity) / dense_perplexity < 0.005, (ppl, dense_perplexity)


def test_perplexity_int4_at_load(smollm2, text_ids, dense_perplexity):
    """``--weights int4`` on the dequantized weights: round to nearest in groups of 32 (the
    narrow matrices' groups, ``linear.quantize_rtn``) within the issue's 6% of the dense
    perplexity (measured +0.05%; groups of 64 / 128 cost +52%)."""
    model = load_model(smollm2, "cpu", torch.float32, "int4")
    projections = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.quantized for m in projections) and all(m.method.group == 32 for m in projections)
    ppl = perplexity(model, text_ids)
    print(f"weights int4: perplexity {ppl:.4f} against {dense_perplexity:.4f} "
          f"({(ppl / dense_perplexity - 1) * 100:+.3f}%)")
    assert abs(ppl - dense_perplexity) / dense_perplexity < 0.06, (ppl, dense_perplexity)


def answer(model, smollm2) -> str:
    tok = smollm2.tokenizer
    prompt = ChatTemplate(smollm2.chat_template, tok.bos_token or "", tok.eos_token or "").render(QUESTION)
    engine = LLMEngine(model, tok, EngineConfig(max_context=512, max_concurrency=1))
    eos = frozenset(smollm2.generation.eos_token_ids)
    engine.add_request(Request("q", tok.encode(prompt), SamplingParams(temperature=0.0, max_tokens=48),
                               max_total_tokens=512, eos_ids=eos))
    text = []
    while engine.has_work:
        text += [out.text for out in engine.step()]
    return "".join(text)


def test_readme_question_has_the_same_answer(smollm2, models):
    kept, dense = answer(models["auto"], smollm2), answer(models["dense"], smollm2)
    assert "Paris" in dense
    assert kept == dense
