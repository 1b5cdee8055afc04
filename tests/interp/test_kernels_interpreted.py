"""Every Triton kernel of the decode path on small random inputs, under Triton's CPU interpreter,
against the torch code it replaces; and whole tiny models decoding through the fused path."""
from __future__ import annotations

import pytest
import torch

from support.decode_paths import BUILDERS, load_parts, run
from support.kernel_cases import check_prefill_attention, check_attention_decode, check_gdn_decode, check_moe_block, rel_err


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("d, h, hkv, page, sms, block_d", [(64, 8, 2, 16, 4, 16), (32, 4, 4, 8, 64, 64)])
def test_paged_decode_attention(d, h, hkv, page, sms, block_d, gated, monkeypatch):
    from ninfer.engine.layers import paged_attention_triton as kernel
    from ninfer.engine.layers.paged_attention import paged_decode_attention_ref

    monkeypatch.setitem(kernel._SM_COUNT, -1, sms)  # many SMs: many splits, merged in blocks
    monkeypatch.setattr(kernel, "REDUCE_BLOCK_D", block_d)  # 16: each head merged in four slices
    b, pages = 3, 40
    k = torch.randn(pages, page, hkv, d)
    v = torch.randn_like(k)
    lens = torch.tensor([1, 17, 300], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages)[: (300 + page - 1) // page + 2] for _ in range(b)]).int()
    q = torch.randn(b, h, d)
    gate = torch.randn(b, h, 2 * d)[:, :, d:] if gated else None
    out = kernel.paged_decode_attention_triton(q, k, v, tables, lens, d**-0.5, gate)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, d**-0.5)
    if gated:
        ref = ref * torch.sigmoid(gate)
    assert rel_err(out, ref) < 1e-5


def test_norm_kernels():
    from ninfer.engine.layers.gated_delta_net import GatedRMSNorm
    from ninfer.engine.layers.mlp_triton import silu_mul_triton
    from ninfer.engine.layers.norm import RMSNorm
    from ninfer.engine.layers.norm_triton import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton

    norm = RMSNorm(96, 1e-6, zero_centered=True)
    torch.nn.init.normal_(norm.weight, 0.0, 0.5)
    x, res = torch.randn(5, 96), torch.randn(5, 96) * 3
    assert rel_err(rms_norm_triton(x, norm.weight, 1e-6, True), norm(x)) < 1e-5
    out, new_res = add_rms_norm_triton(x, res, norm.weight, 1e-6, True)
    torch.testing.assert_close(new_res, x + res)
    assert rel_err(out, norm(x + res)) < 1e-5
    gated = GatedRMSNorm(32)
    torch.nn.init.normal_(gated.weight, 1.0, 0.3)
    for tokens in (4, 700):  # 700 x 6 rows: tiles of rows, the last one ragged
        x, z = torch.randn(tokens, 6, 32), torch.randn(tokens, 6, 32)
        assert rel_err(gated_rms_norm_triton(x, z, gated.weight, gated.eps), gated(x, z)) < 1e-5
    g, u = torch.randn(3, 100), torch.randn(3, 100)
    assert rel_err(silu_mul_triton(g, u), torch.nn.functional.silu(g) * u) < 1e-5


@pytest.mark.parametrize("qwen", [True, False])
def test_attention_decode(qwen, monkeypatch):
    check_attention_decode(monkeypatch, "cpu", torch.float32, qwen, 64, 4, 2, 32, 16 if qwen else 32)


def test_gdn_decode():
    check_gdn_decode("cpu", torch.float32, hidden=64, k_heads=2, v_heads=4, head_dim=16)


@pytest.mark.parametrize("shared", [32, 48, 0])
@pytest.mark.parametrize("tokens, gemv_limit", [(1, None), (3, None), (30, 8)])  # 30 tokens: grouped GEMM
def test_moe_block(tokens, gemv_limit, shared, monkeypatch):
    from ninfer.engine.layers import moe_gemm_triton

    monkeypatch.setattr(moe_gemm_triton, "CHUNK_TOKENS", 16)  # 30 tokens: two launches
    check_moe_block(monkeypatch, "cpu", torch.float32, tokens, hidden=64, experts=16, top_k=4, inter=32,
                    shared=shared, gemv_limit=gemv_limit)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fused_decode_path_matches_per_sequence_path(name, tmp_path_factory, monkeypatch):
    """Tiny models decoding greedily through every fused decode kernel give the tokens the
    per-sequence path gives."""
    from ninfer.engine.layers import moe

    parts = load_parts(name, tmp_path_factory)
    # decode steps (3 tokens) take the grouped GEMVs, prefills the grouped GEMM (under the
    # interpreter the GEMVs would run thousands of programs for a prefill)
    monkeypatch.setattr(moe, "DECODE_MAX_ASSIGNMENTS", 3 * (parts[0].config.num_experts_per_tok + 1))
    assert run(parts, True, requests=3, max_tokens=5) == run(parts, False, requests=3, max_tokens=5)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_fused_prefill_attention_matches_torch_path(name, tmp_path_factory, monkeypatch):
    model, tok = load_parts(name, tmp_path_factory)
    check_prefill_attention(monkeypatch, model, tok, "cpu", page_size=4, tol=1e-4)


def test_assignments_grouped_by_expert_in_whole_blocks():
    from ninfer.engine.layers.moe_gemm_triton import sort_by_expert

    ids = torch.randint(0, 7, (50, 3))
    rows, block_expert = sort_by_expert(ids, 8, block_m=16)
    flat = ids.reshape(-1)
    blocks = rows.view(-1, 16)
    seen = []
    for block, expert in zip(blocks.tolist(), block_expert.tolist()):
        real = [a for a in block if a >= 0]
        if expert >= 8:  # past the last run: padding only
            assert not real
            continue
        assert real and all(flat[a] == expert for a in real) and real == sorted(real)
        assert block[: len(real)] == real  # padding only at the end of an expert's last block
        seen += real
    assert sorted(seen) == list(range(flat.numel()))  # every assignment exactly once
    assert block_expert.tolist() == sorted(block_expert.tolist())
