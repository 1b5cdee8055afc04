"""Every GPU kernel against its torch reference, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from support.kernel_cases import (check_attention_decode, check_gdn_decode, check_gdn_decode_skips_unused_rows, check_gdn_prompt_conv, check_gdn_verify,
                                  check_gdn_short_prompt_rows, check_moe_block, check_moe_norm_route,
                                  check_moe_quantized, check_int4_gemv, check_norm_gemv, rel_err)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("d, h, hkv, page", [(256, 24, 4, 16), (256, 8, 2, 16), (128, 16, 16, 8), (64, 9, 3, 16)])
def test_paged_decode_attention(d, h, hkv, page, gated):
    from ninfer.engine.layers.paged_attention import paged_decode_attention, paged_decode_attention_ref

    torch.manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    b, pages = 5, 300
    k = torch.randn(pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lens = torch.tensor([1, 17, 700, 2048, 1500], dtype=torch.int32, device="cuda")
    width = (2048 + page - 1) // page + 3
    tables = torch.stack([torch.randperm(pages, device="cuda")[:width] for _ in range(b)]).int()
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(b, h, 2 * d, device="cuda", dtype=torch.bfloat16)[:, :, d:] if gated else None
    out = paged_decode_attention(q, k, v, tables, lens, d**-0.5, gate)
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, lens, d**-0.5)
    if gated:
        ref = ref * torch.sigmoid(gate.float())
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


def test_add_rms_norm():
    from ninfer.engine.layers.norm import RMSNorm

    norm = RMSNorm(5120, 1e-6, True).cuda()
    torch.nn.init.normal_(norm.weight, 0.0, 0.5)
    x = torch.randn(7, 5120, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x) * 4
    out, new_res = norm(x, res)
    ref_res = (x.float() + res.float())
    assert rel_err(new_res, ref_res) < 1e-2
    assert rel_err(out, norm.cpu()(ref_res.cpu()).cuda()) < 1e-2


@pytest.mark.parametrize("tokens", [64, 1001])  # 1001 x 48 rows: the tiled (prefill) form, a ragged tail
def test_gated_rms_norm(tokens):
    from ninfer.engine.layers.gated_delta_net import GatedRMSNorm

    norm = GatedRMSNorm(128).cuda()
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    x = torch.randn(tokens, 48, 128, device="cuda", dtype=torch.bfloat16)
    proj = torch.randn(tokens, 48 * 128 + 64, device="cuda", dtype=torch.bfloat16)
    z = proj[:, 32: 32 + 48 * 128].view(tokens, 48, 128)  # read in place from the projection's rows
    into = torch.empty(tokens, 48 * 128, device="cuda", dtype=torch.bfloat16)
    out = norm(x, z, out=into)
    assert out.data_ptr() == into.data_ptr()
    ref = norm.cpu()(x.cpu().float(), z.cpu().float()).cuda()
    assert rel_err(out, ref) < 1e-2


def test_silu_mul():
    from ninfer.engine.layers.mlp import silu_mul

    g = torch.randn(9, 17408, device="cuda", dtype=torch.bfloat16)
    u = torch.randn_like(g)
    assert rel_err(silu_mul(g, u), torch.nn.functional.silu(g.float()) * u.float()) < 1e-2
    g, u = torch.randn(9, 2 * 17408, device="cuda", dtype=torch.bfloat16).split([17408, 17408], dim=-1)
    assert rel_err(silu_mul(g, u), torch.nn.functional.silu(g.float()) * u.float()) < 1e-2  # a fused output's halves


@pytest.mark.parametrize("m, n, k", [(1, 2048, 4096), (4, 5120, 6144), (1, 5120, 17408), (8, 12352, 2048),
                                     (3, 1000, 5000)])  # the last: ragged N and K
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv(m, n, k, with_bias):
    from ninfer.engine.layers.gemv_triton import gemv_triton

    torch.manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    x = torch.randn(m, k + 64, device="cuda", dtype=torch.bfloat16)[:, 32:32 + k]  # strided rows
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    out = gemv_triton(x, w, bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2
    for tiles in ({"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 1}, {"BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 8}):
        assert rel_err(gemv_triton(x, w, bias, tiles), ref) < 1e-2


@pytest.mark.parametrize("m, n, k", [(1, 12352, 2048), (4, 9216, 2048), (1, 16480, 5120), (3, 1000, 5000)])
def test_norm_gemv(m, n, k):
    torch.manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    check_norm_gemv("cuda", torch.bfloat16, m, n, k, None, 1e-2)
    check_norm_gemv("cuda", torch.bfloat16, m, n, k, {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4}, 1e-2)


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
    ref_out, ref_final = chunk_gated_delta_rule(q.cpu(), k.cpu(), v.cpu().float(), g.cpu(), beta.cpu(), state.cpu())
    out, final = prefill_gated_delta_rule(q, k, v, g, beta, state)
    assert rel_err(out, ref_out.cuda()) < 2e-2
    assert rel_err(final, ref_final.cuda()) < 2e-2
    scale = torch.rand(t, hk, 1, device="cuda") * 3 + 0.1  # raw q / k: normalised inside the kernel
    out, final = prefill_gated_delta_rule(q * scale, k * scale, v, g, beta, state, l2norm_qk=True)
    assert rel_err(out, ref_out.cuda()) < 2e-2
    assert rel_err(final, ref_final.cuda()) < 2e-2


@pytest.mark.parametrize("t, with_state", [(1, True), (2, True), (700, True), (700, False)])
def test_causal_conv1d_fla_vs_torch(t, with_state):
    from ninfer.engine.layers.gdn_ops import causal_conv1d, causal_conv1d_fla

    c, w = 10240, 4
    rows = torch.randn(t, c + 6240, device="cuda", dtype=torch.bfloat16)[:, :c]  # strided, as split from a GEMM
    weight = torch.randn(c, 1, w, device="cuda", dtype=torch.bfloat16) * 0.5
    state = torch.randn(w - 1, c, device="cuda", dtype=torch.bfloat16) if with_state else None
    out, new_state = causal_conv1d_fla(rows, weight, state)
    ref, ref_state = causal_conv1d(rows.float().cpu(), weight.float().cpu(), None if state is None else state.float().cpu())
    assert rel_err(out, ref.cuda()) < 1e-2
    assert torch.equal(new_state.float().cpu(), ref_state)


@pytest.mark.parametrize("k_heads, v_heads", [(4, 8), (4, 12), (4, 4)])  # 2, 3 and 1 value heads per key head
@pytest.mark.parametrize("block_v", [None, 128])  # the default column blocks, one program per head
def test_fused_gdn_decode_vs_torch_path(k_heads, v_heads, block_v):
    check_gdn_decode("cuda", torch.bfloat16, hidden=256, k_heads=k_heads, v_heads=v_heads, head_dim=128,
                     block_v=block_v)


def test_fused_gdn_decode_skips_rows_without_a_slot():
    check_gdn_decode_skips_unused_rows("cuda", torch.bfloat16, hidden=256, k_heads=4, v_heads=8, head_dim=128)


@pytest.mark.parametrize("k_heads, v_heads", [(4, 8), (16, 32)])
def test_gdn_short_prompt_rows_vs_torch(k_heads, v_heads):
    """Prompt rows of a few tokens through the verify kernel's recurrent form, at the real head size."""
    check_gdn_short_prompt_rows("cuda", torch.bfloat16, hidden=256, k_heads=k_heads, v_heads=v_heads, head_dim=128)


@pytest.mark.parametrize("k_heads, v_heads", [(4, 8), (4, 12)])
@pytest.mark.parametrize("block_v", [None, 128])
def test_gdn_verify_kernel_vs_decode_steps(k_heads, v_heads, block_v):
    """The verify kernel at the real head size (128 x 128 states), rows of 5, 5 and 2 positions."""
    check_gdn_verify("cuda", torch.bfloat16, hidden=256, k_heads=k_heads, v_heads=v_heads, head_dim=128,
                     widths=(5, 5, 2), block_v=block_v)


@pytest.mark.parametrize("shared", [512, 384, 0])
@pytest.mark.parametrize("tokens", [1, 5, 56, 700])  # 700 tokens: the grouped GEMM
def test_moe_block_kernels_vs_torch(shared, tokens, monkeypatch):
    check_moe_block(monkeypatch, "cuda", torch.bfloat16, tokens, hidden=2048, experts=256, top_k=8, inter=512,
                    shared=shared)


@pytest.mark.parametrize("bits", [4, 8, 6])  # 6: Q6_K's symmetric groups of 16
@pytest.mark.parametrize("tokens", [1, 5, 56, 700])  # 700 tokens: the grouped GEMM
def test_moe_quantized_experts_vs_torch(bits, tokens, monkeypatch):
    check_moe_quantized(monkeypatch, "cuda", torch.bfloat16, tokens, hidden=2048, experts=256, top_k=8, inter=512,
                        bits=bits)


@pytest.mark.parametrize("shared", [512, 0])
@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_norm_route_vs_unfused_kernels(shared, tokens, monkeypatch):
    """Residual add + norm + router + routing in one launch (35B-A3B size), twice in a row."""
    torch.manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    check_moe_norm_route(monkeypatch, "cuda", torch.bfloat16, tokens, hidden=2048, experts=256, top_k=8, inter=512,
                         shared=shared)


@pytest.mark.parametrize("kind", ["qwen3_5", "llama"])
def test_fused_attention_decode_vs_torch_path(kind, monkeypatch):
    if kind == "qwen3_5":
        check_attention_decode(monkeypatch, "cuda", torch.bfloat16, True, 1024, 24, 4, 256, 64)
    else:
        check_attention_decode(monkeypatch, "cuda", torch.bfloat16, False, 1024, 32, 8, 128, 128)


@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_down_all_slots_vs_slot_loop(tokens):
    """The down GEMV's two forms (``ALL_SLOTS``) at the 35B-A3B size agree in bf16."""
    from ninfer.engine.layers import moe_triton as mt

    e, hid, inter, k = 256, 2048, 512, 8
    w = torch.randn(e, hid, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    shared = torch.randn(hid, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    ids, wts = mt.route_triton(torch.randn(tokens, e + 1, device="cuda"), k, e, True, True)
    h = torch.randn(tokens * (k + 1), inter, device="cuda", dtype=torch.bfloat16)
    loop = mt.moe_down_triton(h, w, shared, ids, wts, {"ALL_SLOTS": False})
    tile = mt.moe_down_triton(h, w, shared, ids, wts, {"ALL_SLOTS": True, "BLOCK_N": 2, "BLOCK_K": 128, "num_warps": 4})
    assert rel_err(tile, loop) < 1e-2


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (1000, 2048, 32), (37, 384, 128)])
@pytest.mark.parametrize("with_offset", [False, True, "symmetric"])
def test_int4_gemv(m, n, k, group, with_offset):
    check_int4_gemv("cuda", torch.bfloat16, m, n, k, group, with_offset, None, 2e-2)


@pytest.mark.parametrize("m", [1, 3, 16, 20, 64])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (1000, 2048, 32), (37, 384, 128)])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_int4_gemv_on_tensor_cores(m, n, k, group, with_offset, bits):
    check_int4_gemv("cuda", torch.bfloat16, m, n, k, group, with_offset, None, 2e-2, kernel="dot", bits=bits)


@pytest.mark.parametrize("m", [1, 3, 16, 20, 64])
@pytest.mark.parametrize("n, k, group, tiles", [
    (5120, 17408, 128, None),  # the 27B's MLP down: K split over programs (the default count)
    (34816, 5120, 128, None),  # its gate_up: enough row blocks without a split
    (1000, 2048, 32, {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "SPLIT": 8}),
    (37, 384, 128, {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "SPLIT": 3}),
])
@pytest.mark.parametrize("with_offset", [False, True, "symmetric"])
def test_int4_gemv_split_over_k(m, n, k, group, tiles, with_offset):
    """The decode rows' 4-bit GEMV with K split over programs, the last to arrive adding the
    partial sums (twice, so the arrival counters are seen put back)."""
    for _ in range(2):
        check_int4_gemv("cuda", torch.bfloat16, m, n, k, group, with_offset, tiles, 2e-2, kernel="split")


@pytest.mark.parametrize("n, k, group", [(5120, 17408, 128), (34816, 5120, 128), (1000, 2048, 32)])
@pytest.mark.parametrize("with_offset", [False, True, "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_decode_row_prepared_once_on_the_gpu(n, k, group, with_offset, dtype):
    """One decode row prepared by ``x_pack`` before the split GEMV (the form ``int4_x_pack`` runs)."""
    for _ in range(2):
        check_int4_gemv("cuda", dtype, 1, n, k, group, with_offset, None, 2e-2, kernel="split", pack_x=True)


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("with_offset", [False, True])
def test_int4_gemv_split_in_fp16(m, with_offset):
    """fp16 input rows: the nibbles made fp16 ``1024 + q`` by the same PTX, BASE's bits an operand."""
    check_int4_gemv("cuda", torch.float16, m, 4096, 4096, 128, with_offset, None, 2e-2, kernel="split")


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n, k, group", [(248320, 5120, 5120), (4096, 4096, 128)])  # the 27B's 8-bit LM head
def test_int8_gemv_split_over_k(m, n, k, group):
    check_int4_gemv("cuda", torch.bfloat16, m, n, k, group, False, None, 2e-2, kernel="split", bits=8)


@pytest.mark.parametrize("n, k, group", [(5000, 4096, 128), (37, 384, 32)])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_int4_dequantize(n, k, group, with_offset, bits):
    check_int4_gemv("cuda", torch.bfloat16, 1, n, k, group, with_offset, None, 1e-2, kernel="dequantize", bits=bits)


@pytest.mark.parametrize("m", [1, 20])
def test_symmetric_4_bit_weights_on_tensor_cores_and_dequantized(m):
    """Offsets of ``-8 * scale`` held as the zero point 8: the tensor-core GEMV and the dequantizing kernel."""
    check_int4_gemv("cuda", torch.bfloat16, m, 4096, 4096, 128, "symmetric", None, 2e-2, kernel="dot")
    check_int4_gemv("cuda", torch.bfloat16, 1, 5000, 4096, 128, "symmetric", None, 1e-2, kernel="dequantize")


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k, group", [(4096, 4096, 128), (1000, 2048, 32)])
def test_int8_gemv(m, n, k, group):
    check_int4_gemv("cuda", torch.bfloat16, m, n, k, group, False, None, 2e-2, bits=8)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gdn_prompt_conv(split):
    check_gdn_prompt_conv("cuda", torch.bfloat16, k_heads=16, v_heads=32, head_dim=128, widths=(70, 1, 2, 2048),
                          split=split)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gdn_prompt_rows_match_fla_cores_own_calls(state_dtype):
    """A layer's prompt rows through the two-launch conv and fla-core's forward called directly
    against the same rows through fla-core's public conv and chunked rule: outputs and the
    slots' states after them."""
    from types import SimpleNamespace

    from ninfer.engine.layers.gated_delta_net import GatedDeltaNet
    from ninfer.engine.models.base import chunk_offsets, chunk_pairs

    torch.manual_seed(3)
    layer = GatedDeltaNet(0, 256, num_k_heads=2, num_v_heads=4, head_k_dim=128, head_v_dim=128)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    layer = layer.cuda().bfloat16()
    bounds = [0, 300, 301, 303, 1100]
    t, slots = bounds[-1], torch.tensor([5, 0, 3, 7], device="cuda")
    conv = torch.randn(8, 3, layer.conv_dim, device="cuda", dtype=torch.bfloat16)
    rec = (torch.randn(8, 4, 128, 128, device="cuda") * 0.05).to(state_dtype)
    qkv = torch.randn(t, layer.conv_dim + 8, device="cuda", dtype=torch.bfloat16)[:, 8:]
    ab = torch.randn(t, 8, device="cuda", dtype=torch.bfloat16)
    a, b = ab[:, :4], ab[:, 4:]
    cu = torch.tensor(bounds, device="cuda")
    prompt = SimpleNamespace(cu_seqlens_long=cu, cu_seqlens_host=torch.tensor(bounds),
                             chunks=torch.tensor(chunk_pairs(bounds), device="cuda").view(-1, 2),
                             chunk_offsets=torch.tensor(chunk_offsets(bounds), device="cuda"))
    conv2, rec2 = conv.clone(), rec.clone()
    with torch.inference_mode():
        got = layer._mix_prompt_rows((qkv,), a, b, conv, rec, slots, prompt)
        g, beta = layer._gates(a, b)
        want = layer._mix_varlen((qkv,), g, beta, conv2, rec2, slots, prompt)
    assert rel_err(got.float(), want.float()) < 2e-2
    assert torch.equal(conv, conv2)
    assert rel_err(rec.float(), rec2.float()) < 2e-2


def test_the_chunked_rules_thin_call_equals_fla_cores_forward():
    """fla-core's five forward kernels launched from ``gdn_chunk_fla`` (the first launch through
    its decorators, which tune; the next with their choices fixed) give fla-core's
    ``chunk_gated_delta_rule_fwd``'s outputs and final states bit for bit, both times."""
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    from ninfer.engine.layers.gdn_chunk_fla import chunk_delta_rule, chunk_kernels
    from ninfer.engine.models.base import chunk_offsets, chunk_pairs

    torch.manual_seed(5)
    bounds = [0, 300, 301, 303, 1100]
    t, h, hv, d = bounds[-1], 2, 4, 128
    q = torch.nn.functional.normalize(torch.randn(1, t, h, d, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, t, h, d, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, t, hv, d, device="cuda", dtype=torch.bfloat16)
    a, beta = torch.randn(1, t, hv, device="cuda"), torch.rand(1, t, hv, device="cuda")
    A_log, dt_bias = torch.randn(hv, device="cuda"), torch.randn(hv, device="cuda")
    state = torch.randn(4, hv, d, d, device="cuda") * 0.05
    cu = torch.tensor(bounds, device="cuda")
    chunks = torch.tensor(chunk_pairs(bounds), device="cuda").view(-1, 2)
    offsets = torch.tensor(chunk_offsets(bounds), device="cuda")
    _, want_o, _, want_final, _, _ = chunk_gated_delta_rule_fwd(
        q=q, k=k, v=v, g=a, beta=beta, scale=d ** -0.5, initial_state=state, output_final_state=True,
        cu_seqlens=cu, chunk_indices=chunks, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    for _ in range(2):
        o, final = chunk_delta_rule(q, k, v, a, beta, A_log, dt_bias, state, cu, chunks, offsets, d ** -0.5)
        assert torch.equal(o, want_o) and torch.equal(final, want_final)
    fixed = chunk_kernels().states.fixed
    assert len(fixed) == 1 and {"BV", "num_warps", "USE_INITIAL_STATE", "IS_VARLEN"} <= set(next(iter(fixed.values())))
