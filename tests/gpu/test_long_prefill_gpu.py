"""A 131,072-token prompt chunk at the 27B's widths on the GPU: whole, the MLP's gate/up GEMM
would span 131072 x 34816 elements (past 2^31, where cuBLAS failed with
CUBLAS_STATUS_EXECUTION_FAILED); on row blocks it runs, and gives the logits of the same prompt
in four chunks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.decode import NullTokenizer, randomize_
from bench.shapes import shape_config
from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.layers.fused_linear import fuse_model_projections
from ninfer.engine.models.registry import build_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
TOKENS = 131072


@pytest.fixture(scope="module")
def model():
    """Four layers (three Gated DeltaNet, one gated attention) of the 27B's shape, random bf16."""
    cfg = dataclasses.replace(shape_config("qwen3.5-27b"), num_hidden_layers=4,
                              layer_types=["linear_attention"] * 3 + ["full_attention"])
    m = build_model(cfg, dtype=torch.bfloat16, device="cuda")
    randomize_(m)
    fuse_model_projections(m)
    yield m
    del m
    torch.cuda.empty_cache()


def last_logits(model, prompt: list[int], chunk: int) -> torch.Tensor:
    """The logits the engine samples the first token from, the prompt in chunks of ``chunk``."""
    engine = LLMEngine(model, NullTokenizer(model.config.vocab_size), EngineConfig(
        max_context=TOKENS + 64, max_concurrency=1, prefill_chunk=chunk, kv_capacity=TOKENS + 64, page_size=16,
        host_cache_mib=0, cuda_graphs=False, device="cuda", dtype=torch.bfloat16))
    seen = []
    head = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(head(hidden).float()) or seen[-1]
    try:
        engine.add_request(Request("long", prompt, SamplingParams(temperature=0.0, max_tokens=1), TOKENS + 64))
        while engine.has_work:
            for out in engine.step():
                assert out.finish_reason != "error", out.error
    finally:
        del model.compute_logits
    torch.cuda.synchronize()
    (logits,) = seen
    return logits[0]


def test_one_131072_token_chunk_at_the_27b_widths(model):
    prompt = torch.randint(0, model.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = last_logits(model, prompt, TOKENS)
    chunked = last_logits(model, prompt, TOKENS // 4)
    assert torch.isfinite(whole).all()
    cos = torch.nn.functional.cosine_similarity(whole, chunked, dim=0).item()
    assert cos > 0.99, cos  # bf16, summed in other blocks: close, never another prompt's logits
