"""Layer building blocks against hand-computed values, and attention through the sequence cache."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ninfer.engine.cache.sequence import SequenceCache
from ninfer.engine.layers import attention as attention_mod
from ninfer.engine.layers.attention import Attention, causal_attention
from ninfer.engine.layers.embedding import LMHead
from ninfer.engine.layers.mlp import GatedMLP
from ninfer.engine.layers.norm import RMSNorm
from ninfer.engine.layers.rotary import RotaryEmbedding, rope_inv_freq
from ninfer.engine.models.base import ForwardBatch


# ---------------------------------------------------------------- RMSNorm

def test_rmsnorm_plain_matches_hand_computation():
    norm = RMSNorm(2, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([2.0, 3.0]))
    rms = math.sqrt((3.0**2 + 4.0**2) / 2)
    out = norm(torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(out, torch.tensor([[2 * 3.0 / rms, 3 * 4.0 / rms]]))


def test_rmsnorm_zero_centered_scales_by_one_plus_weight():
    norm = RMSNorm(2, eps=0.0, zero_centered=True)
    assert torch.equal(norm.weight, torch.zeros(2))  # identity scale at init
    x = torch.tensor([[3.0, 4.0]])
    rms = math.sqrt(12.5)
    torch.testing.assert_close(norm(x), x / rms)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(norm(x), torch.tensor([[2 * 3.0 / rms, 3 * 4.0 / rms]]))


def test_rmsnorm_eps_and_bf16_computed_in_fp32():
    norm = RMSNorm(4, eps=1.0)
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(norm(x), x / math.sqrt(2.0))
    xb = torch.randn(5, 4).to(torch.bfloat16)
    out = norm.to(torch.bfloat16)(xb)
    assert out.dtype == torch.bfloat16
    expected = (xb.float() * torch.rsqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1.0)).to(torch.bfloat16)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("rows, dim", [(1, 576), (3, 1536), (64, 4096)])
def test_rmsnorm_is_the_written_out_formula_bit_for_bit(rows, dim, zero_centered):
    gen = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, eps=1e-5, zero_centered=zero_centered)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen) * 0.3 + (0.0 if zero_centered else 1.0))
    x, residual = torch.randn(rows, dim, generator=gen) * 5, torch.randn(rows, dim, generator=gen)
    scale = 1.0 + norm.weight if zero_centered else norm.weight

    def written_out(x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * scale

    assert torch.equal(norm(x), written_out(x))
    out, summed = norm(x, residual)
    assert torch.equal(summed, residual + x) and torch.equal(out, written_out(residual + x))


# ---------------------------------------------------------------- rotary

def _rot(x1: float, x2: float, angle: float) -> tuple[float, float]:
    return x1 * math.cos(angle) - x2 * math.sin(angle), x2 * math.cos(angle) + x1 * math.sin(angle)


def test_rotary_full_rotates_half_pairs():
    rope = RotaryEmbedding(head_dim=4, rotary_dim=4, base=10000.0)  # inv_freq = [1, 0.01]
    q = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [N=1, H=1, D=4]
    p = 5
    out, _ = rope(torch.tensor([p]), q, q.clone())
    a0, a2 = _rot(1.0, 3.0, p * 1.0)  # pair (0, 2) at frequency 1
    a1, a3 = _rot(2.0, 4.0, p * 0.01)  # pair (1, 3) at frequency 0.01
    torch.testing.assert_close(out[0, 0], torch.tensor([a0, a1, a2, a3]))


def test_rotary_partial_leaves_tail_and_position_zero_is_identity():
    rope = RotaryEmbedding(head_dim=8, rotary_dim=4, base=10000.0)
    q = torch.arange(1.0, 9.0).view(1, 1, 8)
    k = torch.arange(1.0, 9.0).view(1, 1, 8).repeat(1, 2, 1)  # two kv heads
    out_q, out_k = rope(torch.tensor([3]), q, k)
    torch.testing.assert_close(out_q[..., 4:], q[..., 4:])
    a0, a2 = _rot(1.0, 3.0, 3.0)
    a1, a3 = _rot(2.0, 4.0, 0.03)
    torch.testing.assert_close(out_q[0, 0, :4], torch.tensor([a0, a1, a2, a3]))
    torch.testing.assert_close(out_k[0, 1], out_q[0, 0])
    same_q, _ = rope(torch.tensor([0]), q, k)
    torch.testing.assert_close(same_q, q)


@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_rotary_is_the_written_out_rotation_bit_for_bit_and_a_step_computes_its_factors_once(rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim)
    rope = RotaryEmbedding(head_dim=64, rotary_dim=rotary_dim, base=10000.0)
    positions = torch.tensor([0, 7, 130, 4095])
    q, k = torch.randn(4, 9, 64, generator=gen), torch.randn(4, 3, 64, generator=gen)
    angles = positions.float()[:, None] * rope.inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def written_out(x):
        half = rotary_dim // 2
        x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    memo = {}
    out_q, out_k = rope(positions, q, k, memo)
    assert torch.equal(out_q, written_out(q)) and torch.equal(out_k, written_out(k))
    assert out_q.is_contiguous() and out_k.is_contiguous() and list(memo) == [rope]
    memo[rope] = tuple(f * 0 for f in memo[rope])  # the next layer of the step reads the kept factors
    assert torch.equal(rope(positions, q, k, memo)[0][..., :rotary_dim], torch.zeros(4, 9, rotary_dim))


def test_rotary_scores_depend_on_relative_position():
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=16, rotary_dim=16, base=500.0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pq: int, pk: int) -> torch.Tensor:
        rq, _ = rope(torch.tensor([pq]), q, q)
        _, rk = rope(torch.tensor([pk]), k, k)
        return (rq * rk).sum()

    torch.testing.assert_close(score(10, 3), score(107, 100), rtol=1e-4, atol=1e-4)


def test_llama3_scaling_by_wavelength_band():
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1000,
    }
    inv = rope_inv_freq(8, 10000.0, scaling)  # unscaled [1, 0.1, 0.01, 0.001]
    # wavelengths 2*pi/f: 6.3 and 63 < 1000/4 -> unchanged; 6283 > 1000 -> divided by 8;
    # 628 is in the band: interpolated with smooth = (1000/628.3 - 1) / (4 - 1)
    smooth = (1000 / (2 * math.pi / 0.01) - 1.0) / 3.0
    expected = torch.tensor([1.0, 0.1, (1 - smooth) * 0.01 / 8 + smooth * 0.01, 0.001 / 8])
    torch.testing.assert_close(inv, expected)


def test_linear_scaling_and_unknown_type():
    inv = rope_inv_freq(4, 10000.0, {"type": "linear", "factor": 4.0})
    torch.testing.assert_close(inv, torch.tensor([0.25, 0.0025]))
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(4, 10000.0, {"rope_type": "yarn", "factor": 4.0})


# ---------------------------------------------------------------- MLP and head

def test_gated_mlp_is_swiglu():
    torch.manual_seed(0)
    mlp = GatedMLP(8, 16)
    x = torch.randn(3, 8)
    expected = mlp.down_proj.weight @ (F.silu(mlp.gate_proj.weight @ x.T) * (mlp.up_proj.weight @ x.T))
    torch.testing.assert_close(mlp(x), expected.T)


def test_lm_head_tied_shares_embedding():
    emb = torch.nn.Embedding(10, 4)
    head = LMHead(4, 10, tied_to=emb)
    assert list(dict(head.named_parameters())) == []
    h = torch.randn(2, 4)
    torch.testing.assert_close(head(h), h @ emb.weight.T)
    assert head(h.to(torch.bfloat16)).dtype == torch.float32


# ---------------------------------------------------------------- attention

def test_causal_attention_matches_sdpa_with_gqa_and_offset(monkeypatch):
    torch.manual_seed(0)
    s, t, h, hkv, d = 9, 4, 6, 2, 8
    q, k, v = torch.randn(t, h, d), torch.randn(s, hkv, d), torch.randn(s, hkv, d)
    # reference: queries are the last t positions; query i sees keys 0..s-t+i
    mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
    kr, vr = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1), attn_mask=mask)
    out = causal_attention(q, k, v, d**-0.5)
    torch.testing.assert_close(out, ref.transpose(0, 1), atol=1e-6, rtol=1e-5)
    monkeypatch.setattr(attention_mod, "_MAX_SCORE_ELEMENTS", h * s)  # one query per chunk
    torch.testing.assert_close(causal_attention(q, k, v, d**-0.5), out)


ATTN_VARIANTS = {
    "llama": dict(qk_norm=None, gated=False, bias=False, rotary_dim=16),
    "qwen3": dict(qk_norm="plain", gated=False, bias=True, rotary_dim=16),
    "qwen3_5": dict(qk_norm="zero_centered", gated=True, bias=False, rotary_dim=4),
}


def _attention(variant: str, layer_idx: int = 0) -> Attention:
    opts = dict(ATTN_VARIANTS[variant])
    rope = RotaryEmbedding(16, opts.pop("rotary_dim"), 10000.0)
    attn = Attention(layer_idx, 32, 4, 2, 16, rope, **opts)
    with torch.no_grad():  # non-trivial norm weights, so the variants really differ
        for norm in (attn.q_norm, attn.k_norm):
            if norm is not None:
                norm.weight.uniform_(-0.5, 0.5)
    return attn


def _run(attn: Attention, x: torch.Tensor, caches: list[SequenceCache], lens: list[int]) -> torch.Tensor:
    positions = torch.cat([torch.arange(c.num_tokens, c.num_tokens + n) for c, n in zip(caches, lens)])
    batch = ForwardBatch(positions=positions, seq_lens=lens, caches=caches)
    out = attn(x, batch)
    batch.advance_caches()
    return out


@pytest.mark.parametrize("variant", list(ATTN_VARIANTS))
def test_attention_incremental_equals_full_prefill(variant):
    torch.manual_seed(0)
    attn = _attention(variant, layer_idx=1)
    x = torch.randn(10, 32)
    full = _run(attn, x, [SequenceCache(2)], [10])
    cache = SequenceCache(2)
    parts = [_run(attn, x[:6], [cache], [6])]  # prefill
    parts.append(_run(attn, x[6:8], [cache], [2]))  # a chunk
    parts += [_run(attn, x[i : i + 1], [cache], [1]) for i in (8, 9)]  # decode steps
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)
    assert cache.kv_len(1) == 10 and cache.kv_len(0) == 0


@pytest.mark.parametrize("variant", list(ATTN_VARIANTS))
def test_attention_flat_batch_equals_each_alone(variant):
    torch.manual_seed(0)
    attn = _attention(variant)
    history, new_a, new_b = torch.randn(5, 32), torch.randn(3, 32), torch.randn(7, 32)
    # alone: a has 5 cached tokens and gets 3 more; b is a fresh 7-token prompt
    cache_a = SequenceCache(1)
    _run(attn, history, [cache_a], [5])
    alone_a = _run(attn, new_a, [cache_a], [3])
    alone_b = _run(attn, new_b, [SequenceCache(1)], [7])
    # together in one flat run
    cache_a2 = SequenceCache(1)
    _run(attn, history, [cache_a2], [5])
    cache_b2 = SequenceCache(1)
    both = _run(attn, torch.cat([new_a, new_b]), [cache_a2, cache_b2], [3, 7])
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), atol=1e-6, rtol=1e-5)
    assert (cache_a2.num_tokens, cache_b2.num_tokens) == (8, 7)


def test_gated_attention_reads_gate_per_head():
    """q_proj rows per head are [q | gate]: a zero gate halves the ungated output exactly."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, 16, 10000.0)
    plain = Attention(0, 32, 4, 2, 16, rope)
    gated = Attention(0, 32, 4, 2, 16, rope, gated=True)
    with torch.no_grad():
        for name in ("k_proj", "v_proj", "o_proj"):
            getattr(gated, name).load_state_dict(getattr(plain, name).state_dict())
        q_rows = plain.q_proj.weight.view(4, 16, 32)
        gated.q_proj.weight.copy_(torch.cat([q_rows, torch.zeros_like(q_rows)], dim=1).view(128, 32))
    x = torch.randn(6, 32)
    out_plain = _run(plain, x, [SequenceCache(1)], [6])
    out_gated = _run(gated, x, [SequenceCache(1)], [6])
    torch.testing.assert_close(out_gated, 0.5 * out_plain, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("long", [False, True])
def test_split_linear_gives_each_projection_contiguous(long):
    """Decode-sized runs take one GEMM and split it; prefill-sized runs take one GEMM per part.
    Either way each part is that projection's output."""
    from ninfer.engine.layers.fused_linear import SPLIT_ROWS, fuse_linears, split_linear

    rows = SPLIT_ROWS + 5 if long else 3
    torch.manual_seed(rows)
    lins = [torch.nn.Linear(32, n, bias=False) for n in (24, 8, 5)]
    x = torch.randn(rows, 32)
    want = [lin(x) for lin in lins]
    fused = fuse_linears(lins)
    parts = split_linear(x, fused, [24, 8, 5])
    for got, ref in zip(parts, want):
        torch.testing.assert_close(got, ref)
        assert got.is_contiguous() == (rows > SPLIT_ROWS)


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 256), (4, 4, 32)])
def test_cpu_paged_decode_attention_matches_its_reference(heads):
    """The CPU path (torch's fused attention, one call per KV head's query group) gives the
    reference's output: GQA, a context of one token, pages partly filled, a full block table."""
    from ninfer.engine.layers.paged_attention import paged_decode_attention_ref, paged_decode_attention_sdpa

    h, hkv, d = heads
    g = torch.Generator().manual_seed(h)
    k_pages, v_pages = (torch.randn(40, 16, hkv, d, generator=g) for _ in range(2))
    tables = torch.randperm(40, generator=g)[:15].view(3, 5).to(torch.int32)
    lens = torch.tensor([1, 37, 80], dtype=torch.int32)
    q = torch.randn(3, h, d, generator=g)
    ref = paged_decode_attention_ref(q, k_pages, v_pages, tables, lens, d ** -0.5)
    torch.testing.assert_close(paged_decode_attention_sdpa(q, k_pages, v_pages, tables, lens, d ** -0.5), ref,
                               atol=1e-5, rtol=1e-5)
