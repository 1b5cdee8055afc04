"""Every GPU kernel against its torch reference, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("d, h, hkv, page", [(256, 24, 4, 16), (256, 8, 2, 16), (128, 16, 16, 8), (64, 9, 3, 16)])
def test_paged_decode_attention(d, h, hkv, page):
    from ninfer.engine.layers.paged_attention import paged_decode_attention, paged_decode_attention_ref

    torch.manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    b, pages = 5, 300
    k = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor([1, 17, 700, 2048, 1500], dtype=torch.int32, device="cuda")
    width = (2048 + page - 1) // page + 3
    tables = torch.stack([torch.randperm(pages, device="cuda")[:width] for _ in range(b)]).int()
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    out = paged_decode_attention(q, k, v, tables, lens, d**-0.5)
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, lens, d**-0.5)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm(zero_centered):
    from ninfer.engine.layers.norm import RMSNorm

    norm = RMSNorm(5120, 1e-6, zero_centered).cuda()
    torch.nn.init.normal_(norm.weight, 0.0, 0.5)
    x = torch.randn(37, 5120, device="cuda", dtype=torch.bfloat16) * 3
    out = norm(x)
    ref = norm.cpu()(x.cpu().float()).cuda()
    assert rel_err(out, ref) < 1e-2


def test_gated_rms_norm():
    from ninfer.engine.layers.gated_delta_net import GatedRMSNorm

    norm = GatedRMSNorm(128).cuda()
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    x = torch.randn(64, 48, 128, device="cuda", dtype=torch.bfloat16)
    z = torch.randn_like(x)
    out = norm(x, z)
    ref = norm.cpu()(x.cpu().float(), z.cpu().float()).cuda()
    assert rel_err(out, ref) < 1e-2


def test_silu_mul():
    from ninfer.engine.layers.mlp import silu_mul

    g = torch.randn(9, 17408, device="cuda", dtype=torch.bfloat16)
    u = torch.randn_like(g)
    assert rel_err(silu_mul(g, u), torch.nn.functional.silu(g.float()) * u.float()) < 1e-2


def test_grouped_gemv():
    from ninfer.engine.layers.moe import grouped_gemv

    w = torch.randn(256, 1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(24, 2048, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (24,), device="cuda")
    ref = torch.bmm(w[ids].float(), x.float()[:, :, None])[:, :, 0]
    assert rel_err(grouped_gemv(x, w, ids), ref) < 1e-2


def test_gdn_decode_step_fla_vs_torch():
    from ninfer.engine.layers.gdn_ops import recurrent_step_batched
    from ninfer.engine.layers.gated_delta_net import l2norm

    b, hk, hv, dk, dv = 6, 16, 48, 128, 128
    q = l2norm(torch.randn(b, hk, dk, device="cuda"))
    k = l2norm(torch.randn(b, hk, dk, device="cuda"))
    v = torch.randn(b, hv, dv, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(b, hv, device="cuda")
    beta = torch.rand(b, hv, device="cuda")
    state = torch.randn(b, hv, dk, dv, device="cuda") * 0.1
    out, new = recurrent_step_batched(q, k, v, g, beta, state.clone())
    ref_out, ref_new = recurrent_step_batched(q.cpu(), k.cpu(), v.cpu().float(), g.cpu(), beta.cpu(), state.cpu())
    assert rel_err(out, ref_out.cuda()) < 1e-2
    assert rel_err(new, ref_new.cuda()) < 1e-2  # q and k enter the kernel as bf16


def test_gdn_prefill_fla_vs_torch():
    from ninfer.engine.layers.gdn_ops import chunk_gated_delta_rule, prefill_gated_delta_rule
    from ninfer.engine.layers.gated_delta_net import l2norm

    t, hk, hv, dk, dv = 333, 4, 8, 128, 128
    q = l2norm(torch.randn(t, hk, dk, device="cuda"))
    k = l2norm(torch.randn(t, hk, dk, device="cuda"))
    v = torch.randn(t, hv, dv, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(t, hv, device="cuda") * 0.5
    beta = torch.rand(t, hv, device="cuda")
    state = torch.randn(hv, dk, dv, device="cuda") * 0.1
    out, final = prefill_gated_delta_rule(q, k, v, g, beta, state)
    ref_out, ref_final = chunk_gated_delta_rule(q.cpu(), k.cpu(), v.cpu().float(), g.cpu(), beta.cpu(), state.cpu())
    assert rel_err(out, ref_out.cuda()) < 2e-2
    assert rel_err(final, ref_final.cuda()) < 2e-2


def test_fused_gdn_decode_vs_torch_path():
    """conv_step + recurrent_step (in place on the pools) against the layer's torch decode path."""
    from types import SimpleNamespace

    from ninfer.engine.layers.gated_delta_net import GatedDeltaNet

    layer = GatedDeltaNet(0, 256, num_k_heads=4, num_v_heads=8, head_k_dim=128, head_v_dim=128)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    layer = layer.cuda()
    b, slots = 5, 9
    conv = torch.randn(1, slots, 3, layer.conv_dim, device="cuda", dtype=torch.bfloat16)
    rec = torch.randn(1, slots, 8, 128, 128, device="cuda") * 0.1
    slot_ids = torch.tensor([7, 2, 0, 5, 3], device="cuda")
    qkv = torch.randn(b, layer.conv_dim, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(b, 8, device="cuda", dtype=torch.bfloat16)
    bb = torch.randn(b, 8, device="cuda", dtype=torch.bfloat16)

    def meta(c, r):
        return SimpleNamespace(gdn_ordinal={0: 0}, states=SimpleNamespace(conv=c, recurrent=r), slot_ids=slot_ids)

    conv_ref, rec_ref = conv.clone(), rec.clone()
    out = layer._decode_fused(qkv, a, bb, meta(conv, rec))
    beta = torch.sigmoid(bb.float())
    g = -torch.exp(layer.A_log.float()) * torch.nn.functional.softplus(a.float() + layer.dt_bias.float())
    ref = layer._decode(qkv, g, beta, meta(conv_ref, rec_ref))
    assert rel_err(out, ref) < 2e-2
    assert rel_err(rec[0, slot_ids], rec_ref[0, slot_ids]) < 1e-3
    torch.testing.assert_close(conv[0, slot_ids].float(), conv_ref[0, slot_ids].float())
    untouched = [s for s in range(slots) if s not in slot_ids.tolist()]
    torch.testing.assert_close(rec[0, untouched], rec_ref[0, untouched])
