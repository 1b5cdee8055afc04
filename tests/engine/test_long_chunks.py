"""Long prompt chunks: the MLP runs on row blocks so no tensor reaches 2^31 elements (where cuBLAS
and the Triton kernels fail), the same logits as in one piece; a chunk whose widest remaining
tensor would reach it is refused at start with the largest value that works."""
from __future__ import annotations

import re

import pytest
import torch

from bench.shapes import shape_config
from ninfer.engine.engine_config import EngineConfig, max_prefill_chunk
from ninfer.engine.layers import fused_linear
from ninfer.engine.layers.mlp import GatedMLP
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.models.base import ForwardBatch
from ninfer.server import cli
from support.tiny import save_tiny_qwen3_5


def test_mlp_runs_long_inputs_on_row_blocks_under_the_limit(monkeypatch):
    """With the limit at 10 rows of the gate/up output, 95 rows run as 10 blocks (the last one
    short) and give what one pass gives; each block's widest tensor stays under the limit."""
    torch.manual_seed(0)
    mlp = GatedMLP(16, 24).double()
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    mlp.fuse_projections()
    x = torch.randn(95, 16, dtype=torch.float64)
    whole = mlp(x)
    seen = []
    inner = mlp._rows
    monkeypatch.setattr(mlp, "_rows", lambda rows: seen.append(rows.shape[0]) or inner(rows))
    monkeypatch.setattr(fused_linear, "MAX_TENSOR_ELEMENTS", 10 * 48 + 7)
    blocked = mlp(x)
    assert seen == [10] * 9 + [5] and max(seen) * 48 <= fused_linear.MAX_TENSOR_ELEMENTS
    torch.testing.assert_close(blocked, whole, rtol=1e-12, atol=1e-12)


def test_a_model_forward_on_row_blocks_keeps_the_logits(tmp_path, monkeypatch):
    """A whole hybrid model (dense MLPs, fused projections) with the limit at a few rows: a
    40-token chunk's logits are the one-pass ones (float64: the blocks' GEMMs sum as the whole)."""
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path / "ckpt"))
    model = load_model(ckpt, "cpu", torch.float64)
    fused_linear.fuse_model_projections(model)
    ids = torch.tensor(ckpt.tokenizer.encode("Hello world! How are you today? The quick brown fox. " * 3)[:40])

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model(ids, ForwardBatch.single(len(ids), model.new_cache())))

    whole = logits()
    monkeypatch.setattr(fused_linear, "MAX_TENSOR_ELEMENTS", 7 * 2 * 96)  # 7-row blocks of the MLPs
    torch.testing.assert_close(logits(), whole, rtol=1e-9, atol=1e-9)


def test_the_largest_chunk_follows_the_widest_tensor_left():
    """27B: the gated query projection, 24 heads x 256 x 2 = 12,288 wide (the MLP's 34,816-wide
    gate/up output runs on row blocks); 35B-A3B: 16 x 256 x 2 = 8,192."""
    assert max_prefill_chunk(shape_config("qwen3.5-27b")) == (2**31 - 1) // 12288 == 174762
    assert max_prefill_chunk(shape_config("qwen3.5-35b-a3b")) == (2**31 - 1) // 8192
    config = EngineConfig(max_context=262144, prefill_chunk=131072)
    config.check_for_model(shape_config("qwen3.5-27b"))  # the chunk the benchmark runs
    with pytest.raises(ValueError, match=re.escape("the largest that works is 174762 (--prefill-chunk)")):
        EngineConfig(max_context=262144, prefill_chunk=174763).check_for_model(shape_config("qwen3.5-27b"))


def test_ninfer_serve_refuses_a_chunk_too_long_at_start(tmp_path, capsys):
    """Before the weights are read: exit 1, the flag and the largest value that works."""
    path = save_tiny_qwen3_5(tmp_path / "ckpt")
    limit = max_prefill_chunk(load_checkpoint(path).config)
    assert cli.main([str(path), "--prefill-chunk", str(limit + 1), "--max-context", "512"]) == 1
    err = capsys.readouterr().err
    assert f"prefill_chunk {limit + 1} is too long for this model" in err
    assert f"the largest that works is {limit} (--prefill-chunk)" in err
