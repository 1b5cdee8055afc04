"""The engine's batched path (one forward per step over the pools, as CUDA graphs run it) against
the models' per-sequence reference path, on the CPU with the torch references of the kernels."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.layers.paged_attention import paged_decode_attention_ref
from ninfer.engine.layers.attention import causal_attention
from support.decode_paths import BUILDERS, load_parts, reference, run


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def parts(request, tmp_path_factory):
    return load_parts(request.param, tmp_path_factory)


def test_served_together_matches_each_alone_on_the_reference_path(parts):
    assert run(parts) == reference(parts)


def test_paged_reference_matches_contiguous_attention():
    torch.manual_seed(0)
    pages, p, hkv, d, h = 12, 4, 2, 16, 6
    k_pages, v_pages = torch.randn(pages, p, hkv, d), torch.randn(pages, p, hkv, d)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    lens = torch.tensor([10, 16], dtype=torch.int32)
    q = torch.randn(2, h, d)
    out = paged_decode_attention_ref(q, k_pages, v_pages, tables, lens, 0.25)
    for b in range(2):
        k = k_pages[tables[b].long()].reshape(-1, hkv, d)[: lens[b]]
        v = v_pages[tables[b].long()].reshape(-1, hkv, d)[: lens[b]]
        torch.testing.assert_close(out[b], causal_attention(q[b : b + 1], k, v, 0.25)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fused_projections_keep_the_logits(name, tmp_path_factory):
    """One GEMM over the concatenated weights gives each projection's rows: the same logits.

    Compared in float64. In fp32 the CPU GEMM sums in an order that depends on the output width
    (MKL takes another kernel for the 4-column b / a projections of the tiny Qwen3.5 than for the
    same rows inside the 104-column fused GEMM): both are within fp32's bound of the exact
    product, but they differ by an ulp, which four layers of these loud random weights grow to
    1e-5..1e-4 in the logits (the fp32 logits themselves are 5e-4 off the float64 ones), so an
    fp32 comparison at 1e-5 tests the CPU's kernel choice, not the fusion. In float64 the two
    orders agree to ~1e-16 before each fp32 norm rounds them (the logits come out bit for bit the
    same on every seed tried), so the 1e-5 holds with room, where a wrong row or part would be
    off by the logits' own size."""
    from ninfer.engine.layers.fused_linear import fuse_model_projections
    from ninfer.engine.models.base import ForwardBatch

    model, tok = load_parts(name, tmp_path_factory, torch.float64)
    ids = tok.encode("Hello world! How are you today?")

    def logits():
        cache = model.new_cache()
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(ids), ForwardBatch.single(len(ids), cache)))

    before = logits()
    names = {n for n, _ in model.named_parameters()}
    assert fuse_model_projections(model) > 0
    assert {n for n, _ in model.named_parameters()} == names
    assert all(p.dtype == torch.float64 for p in model.parameters())
    torch.testing.assert_close(logits(), before, rtol=1e-5, atol=1e-5)


def test_long_prefill_split_projections_keep_the_logits(parts, monkeypatch):
    """Past ``SPLIT_ROWS`` tokens the fused projections run one GEMM per part and the GDN conv
    runs per q / k / v group; a prompt in two chunks (the conv state carried across) gives the
    logits of the one-GEMM path."""
    from ninfer.engine.layers import fused_linear
    from ninfer.engine.models.base import ForwardBatch

    model, tok = parts
    fused_linear.fuse_model_projections(model)
    ids = tok.encode("Hello world! How are you today? The quick brown fox jumps over the lazy dog. " * 2)

    def logits(split_rows: int) -> torch.Tensor:
        monkeypatch.setattr(fused_linear, "SPLIT_ROWS", split_rows)
        cache, out = model.new_cache(), []
        with torch.inference_mode():
            for chunk in (ids[:13], ids[13:]):
                hidden = model(torch.tensor(chunk), ForwardBatch.single(len(chunk), cache))
                out.append(model.compute_logits(hidden))
        return torch.cat(out)

    split, whole = logits(4), logits(10_000)
    # fp32 GEMMs blocked differently round differently; a wrong channel group or conv state would
    # be off by the logits' own size
    assert ((split - whole).norm() / whole.norm()).item() < 1e-4
