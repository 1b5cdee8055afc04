"""Every Triton kernel of the decode path on small random inputs, under Triton's CPU interpreter,
against the torch code it replaces; and whole tiny models decoding through the fused path."""
from __future__ import annotations

import pytest
import torch

from support.decode_paths import BUILDERS, load_parts, reference, run
from support.kernel_cases import (check_attention_decode, check_gdn_decode, check_gdn_decode_skips_unused_rows, check_gdn_prompt_conv, check_gdn_verify,
                                  check_gdn_short_prompt_rows, check_moe_block, check_moe_norm_route,
                                  check_moe_quantized,
                                  check_int4_gemv, check_norm_gemv, check_prefill_attention, rel_err)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("d, h, hkv, page, sms, block_d", [(64, 8, 2, 16, 4, 16), (32, 4, 4, 8, 64, 64)])
def test_paged_decode_attention(d, h, hkv, page, sms, block_d, gated, monkeypatch, set_launch):
    from ninfer.engine.layers import paged_attention_triton as kernel
    from ninfer.engine.layers.paged_attention import paged_decode_attention_ref

    monkeypatch.setitem(kernel._SM_COUNT, -1, sms)  # many SMs: many splits, merged in blocks
    set_launch(attention_reduce_block_d=block_d)  # 16: each head merged in four slices
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


@pytest.mark.parametrize("per_shape", [False, True])
def test_paged_decode_attention_launch_choices(per_shape, monkeypatch):
    """The tuning overrides (more split programs, a split cap that does not divide the context,
    smaller steps and merge slices), passed per call or as the shape's entry of the launch
    settings' ``attention_shape_tiles``, give the reference's output."""
    from ninfer.engine.layers import paged_attention_triton as kernel
    from ninfer.engine.layers.paged_attention import paged_decode_attention_ref

    k = torch.randn(30, 8, 2, 32)
    v = torch.randn_like(k)
    lens = torch.tensor([5, 150], dtype=torch.int32)
    tables = torch.stack([torch.randperm(30)[:20] for _ in range(2)]).int()
    q = torch.randn(2, 4, 32)
    tiles = {"PROGRAMS_PER_SM": 8, "MAX_SPLITS": 5, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1,
             "REDUCE_BLOCK_D": 8}
    if per_shape:
        from ninfer.engine import launch

        shapes = launch.current().attention_shape_tiles
        monkeypatch.setattr(launch, "_active", launch.current().changed(attention_shape_tiles={**shapes,
                                                                                                (4, 2, 32): tiles}))
    caps = []
    splits = kernel.num_splits_for
    monkeypatch.setattr(kernel, "num_splits_for", lambda *a: caps.append(a[-1]) or splits(*a))
    out = kernel.paged_decode_attention_triton(q, k, v, tables, lens, 32**-0.5, None, None if per_shape else tiles)
    assert rel_err(out, paged_decode_attention_ref(q, k, v, tables, lens, 32**-0.5)) < 1e-5
    assert caps == [5]  # the split cap of these tiles, not the module's default


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
    # z read in place from a wider projection's rows, written into the caller's buffer
    proj = torch.randn(700, 6 * 32 + 40)
    x, z = torch.randn(700, 6, 32), proj[:, 8: 8 + 6 * 32].view(700, 6, 32)
    out = torch.full((800, 6 * 32), float("nan"))
    got = gated_rms_norm_triton(x, z, gated.weight, gated.eps, out=out[100:])
    assert got.data_ptr() == out[100:].data_ptr() and torch.isnan(out[:100]).all()
    assert rel_err(out[100:].view(700, 6, 32), gated(x, z.contiguous())) < 1e-5
    g, u = torch.randn(3, 100), torch.randn(3, 100)
    assert rel_err(silu_mul_triton(g, u), torch.nn.functional.silu(g) * u) < 1e-5
    # the halves of a fused gate/up output read where they lie (rows 2 x 1100 apart, two column
    # blocks a row, the second ragged), the output contiguous; and a 3-D input
    from ninfer.engine.layers import mlp_triton

    fused = torch.randn(5, 2 * 1100)
    g, u = fused.split([1100, 1100], dim=-1)
    assert mlp_triton._rows(g).data_ptr() == g.data_ptr() and mlp_triton._rows(u).data_ptr() == u.data_ptr()
    got = silu_mul_triton(g, u)
    assert got.is_contiguous() and got.shape == (5, 1100)
    assert rel_err(got, torch.nn.functional.silu(g) * u) < 1e-5
    g3, u3 = torch.randn(2, 3, 40), torch.randn(2, 3, 40)
    assert rel_err(silu_mul_triton(g3, u3), torch.nn.functional.silu(g3) * u3) < 1e-5


def test_host_embedding_rows():
    """The lookup ``--embedding-host`` runs on the GPU: rows of a table wider than one block."""
    from ninfer.engine.layers.embedding_triton import host_embedding_triton

    table = torch.randn(300, 1500)
    ids = torch.tensor([[299, 0, 5], [5, 123, 7]])
    assert torch.equal(host_embedding_triton(table, ids), torch.nn.functional.embedding(ids, table))


@pytest.mark.parametrize("m, n, k, tiles", [
    (1, 37, 100, None),  # the default tiles: one ragged K chunk, a ragged last row block
    (3, 37, 300, {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 2}),  # ragged N and K, M padded to 4
    (3, 16, 256, {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4}),  # even K
    (1, 9, 64, {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 8}),  # BLOCK_K clipped to K, warps capped
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv(m, n, k, tiles, with_bias):
    from ninfer.engine.layers.gemv_triton import gemv_triton

    x = torch.randn(m, k + 11)[:, 5:5 + k]  # rows strided, last dim contiguous
    w = torch.randn(n, k)
    bias = torch.randn(n) if with_bias else None
    out = gemv_triton(x, w, bias, tiles)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert rel_err(out, torch.nn.functional.linear(x, w, bias)) < 1e-5
    with pytest.raises(ValueError):
        gemv_triton(x, w[:, 1:].contiguous())


@pytest.mark.parametrize("m, n, k, tiles", [
    (1, 37, 100, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 1}),  # ragged K over four chunks, ragged N
    (3, 16, 128, {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 2}),  # even K, M padded to 4
])
def test_norm_gemv(m, n, k, tiles):
    check_norm_gemv("cpu", torch.float32, m, n, k, tiles, 1e-5)


@pytest.mark.parametrize("qwen", [True, False])
def test_attention_decode(qwen, monkeypatch):
    check_attention_decode(monkeypatch, "cpu", torch.float32, qwen, 64, 4, 2, 32, 16 if qwen else 32)


@pytest.mark.parametrize("v_heads, block_v", [(4, None), (4, 4), (6, 8)])  # one or several programs per head
def test_gdn_decode(v_heads, block_v):
    check_gdn_decode("cpu", torch.float32, hidden=64, k_heads=2, v_heads=v_heads, head_dim=16, block_v=block_v)


def test_gdn_decode_skips_rows_without_a_slot():
    check_gdn_decode_skips_unused_rows("cpu", torch.float32, hidden=64, k_heads=2, v_heads=4, head_dim=16)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gdn_decode_with_a_half_precision_state(state_dtype):
    """``--state-dtype bf16 / fp16``: the kernel reads the state, updates it in fp32 and stores it
    rounded, as the torch decode path does."""
    check_gdn_decode("cpu", torch.float32, hidden=64, k_heads=2, v_heads=4, head_dim=16, state_dtype=state_dtype)


@pytest.mark.parametrize("v_heads, block_v, widths", [(4, None, (3, 1, 5, 2)), (6, 8, (4, 4)), (4, 16, (2,))])
def test_gdn_verify(v_heads, block_v, widths):
    """Verify rows of several requests (of different lengths, one or several programs per head)."""
    check_gdn_verify("cpu", torch.float32, hidden=64, k_heads=2, v_heads=v_heads, head_dim=16, widths=widths,
                     block_v=block_v)


@pytest.mark.parametrize("widths", [(3, 1, 5, 2), (8,)])
def test_gdn_short_prompt_rows(widths):
    check_gdn_short_prompt_rows("cpu", torch.float32, hidden=64, k_heads=2, v_heads=4, head_dim=16, widths=widths)


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("v_heads", [2, 4])
def test_gdn_prompt_conv(v_heads, split):
    check_gdn_prompt_conv("cpu", torch.float32, k_heads=2, v_heads=v_heads, head_dim=16, split=split)


def test_gdn_prompt_conv_bf16_rows_over_an_fp32_pool():
    check_gdn_prompt_conv("cpu", torch.bfloat16, k_heads=2, v_heads=2, head_dim=16, widths=(3, 66),
                          pool_dtype=torch.float32)


def test_gdn_verify_tiles_from_the_launch_settings(set_launch):
    set_launch(gdn_verify_tiles={"BLOCK_V": 4, "num_warps": 2})  # four programs per head
    check_gdn_verify("cpu", torch.float32, hidden=64, k_heads=2, v_heads=4, head_dim=16, widths=(3, 2))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gdn_verify_with_a_half_precision_state(state_dtype):
    """Each position continues from its state rounded as the pool holds it, as a decode step would."""
    check_gdn_verify("cpu", torch.float32, hidden=64, k_heads=2, v_heads=4, head_dim=16, state_dtype=state_dtype)


@pytest.mark.parametrize("shared", [32, 48, 0])
@pytest.mark.parametrize("tokens, gemv_limit", [(1, None), (3, None), (30, 8)])  # 30 tokens: grouped GEMM
def test_moe_block(tokens, gemv_limit, shared, monkeypatch):
    from ninfer.engine.layers import moe_gemm_triton

    monkeypatch.setattr(moe_gemm_triton, "CHUNK_TOKENS", 16)  # 30 tokens: two launches
    check_moe_block(monkeypatch, "cpu", torch.float32, tokens, hidden=64, experts=16, top_k=4, inter=32,
                    shared=shared, gemv_limit=gemv_limit)


@pytest.mark.parametrize("tokens, shared, tiles", [
    (1, 32, None), (3, 32, None), (1, 0, None), (3, 0, None),  # shared expert folded into the router, none
    (3, 48, None),  # a shared expert of its own size: not folded, run beside
    (3, 32, {"ROWS": 16, "TOKENS": 1, "num_warps": 4}),  # 2 x 3 programs: fewer row programs than tokens
    (3, 0, {"ROWS": 4, "TOKENS": 2, "num_warps": 4}),  # a ragged last token group
    (3, 32, "router after the wait"),  # launch setting moe_router_before_wait off
])
def test_moe_norm_route(tokens, shared, tiles, monkeypatch):
    if tiles == "router after the wait":
        from ninfer.engine import launch

        monkeypatch.setattr(launch, "_active", launch.current().changed(moe_router_before_wait=False))
        tiles = None
    check_moe_norm_route(monkeypatch, "cpu", torch.float32, tokens, hidden=64, experts=16, top_k=4, inter=32,
                         shared=shared, tiles=tiles)


@pytest.mark.parametrize("n", [1, 5, 16])
def test_decode_advance(n):
    """The inputs a captured step leaves for the next one: the kernel against its host twin, with
    padding rows (position 0), rows crossing into their next page, and rows past their table."""
    from ninfer.engine.decode_advance import advance_reference, advance_triton

    page, max_pages = 4, 6
    positions = torch.randint(1, page * max_pages, (n,))
    if n > 1:
        positions[::3] = 0  # padding
        positions[1] = page * max_pages - 1  # its next position is past its table row
        positions[-1] = 2 * page - 1  # its next position starts a new page
    lens = torch.where(positions > 0, positions + 1, 1).int()
    write = torch.randint(0, 1000, (n,))
    tables = torch.randint(0, 50, (n, max_pages)).int()
    mine = [positions.clone(), lens.clone(), write.clone(), tables.clone()]
    ref = [positions.clone(), lens.clone(), write.clone(), tables.clone()]
    advance_triton(*mine, page)
    advance_reference(*ref, page)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
    real = positions > 0
    assert torch.equal(ref[0], torch.where(real, positions + 1, positions))
    if n > 1:
        assert ref[2][1] == write[1]  # past the table: the write row stays for the host to replace
        assert ref[2][-1] == tables[-1, 2] * page  # first row of the next page


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fused_step_path_matches_reference_path(name, tmp_path_factory, monkeypatch):
    """Tiny models served together greedily through every fused kernel (decode rows and prompt
    chunks in the same steps) give each request's tokens alone on the reference path."""
    from ninfer.engine.layers import moe

    parts = load_parts(name, tmp_path_factory)
    # decode steps (3 tokens) take the grouped GEMVs, prefills the grouped GEMM (under the
    # interpreter the GEMVs would run thousands of programs for a prefill)
    monkeypatch.setattr(moe, "DECODE_MAX_ASSIGNMENTS", 3 * (parts[0].config.num_experts_per_tok + 1))
    assert run(parts, requests=3, max_tokens=5) == reference(parts, requests=3, max_tokens=5)


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


@pytest.mark.parametrize("tiles", [{"ALL_SLOTS": False, "BLOCK_N": 4, "BLOCK_K": 16},
                                   {"ALL_SLOTS": True, "BLOCK_N": 4, "BLOCK_K": 16},
                                   {"ALL_SLOTS": True, "BLOCK_N": 1, "BLOCK_K": 64}])
def test_moe_down_both_forms(tiles):
    """The grouped down GEMV, slot after slot or all slots' rows in one tile, against torch:
    per token the weighted sum over its slots of the expert's (or the shared expert's) rows."""
    from ninfer.engine.layers import moe_triton as mt

    e, hid, inter, k = 16, 42, 48, 4  # ragged: 42 rows in blocks of 4, 48 columns in blocks of 64
    w, shared = torch.randn(e, hid, inter), torch.randn(hid, inter)
    for n in (1, 3):
        ids, wts = mt.route_triton(torch.randn(n, e + 1), k, e, True, True)
        h = torch.randn(n * (k + 1), inter)
        out = mt.moe_down_triton(h, w, shared, ids, wts, tiles)
        experts = torch.cat([w, shared[None]])[ids.long()]  # [n, k + 1, hid, inter]
        ref = torch.einsum("nshi,nsi->nsh", experts, h.view(n, k + 1, inter)).mul(wts[..., None]).sum(1)
        assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("m, n, k, group, tiles", [
    (1, 37, 256, 32, None),  # ragged last row block
    (3, 16, 384, 128, {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4}),  # ragged K chunk, M padded to 4
    (8, 9, 96, 32, {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 2}),
])
@pytest.mark.parametrize("with_offset", [False, True, "symmetric"])
def test_int4_gemv(m, n, k, group, tiles, with_offset):
    check_int4_gemv("cpu", torch.float32, m, n, k, group, with_offset, tiles, 1e-5)
    from ninfer.engine.layers.quant_gemv_triton import int4_gemv_triton, pack_int4

    with pytest.raises(ValueError):  # scales of another group size
        int4_gemv_triton(torch.randn(1, 64), pack_int4(torch.zeros(4, 64)), torch.ones(4, 4).half(), None, 32)


@pytest.mark.parametrize("m, n, k, group, tiles", [
    (1, 37, 256, 32, {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4}),  # ragged last row block, chunks of a group
    (3, 16, 384, 128, None),
    (20, 24, 128, 64, {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2}),  # rows padded to 32, two chunks a group
    (5, 16, 64, 16, None),  # GGUF Q6_K's groups of 16: a 16-column chunk
])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_int4_gemv_on_tensor_cores(m, n, k, group, tiles, with_offset, dtype, bits):
    """The GEMV's ``tl.dot`` form: nibbles made 16-bit floats by their bits, the base taken off per
    chunk with the scales; 8-bit values converted as they are."""
    check_int4_gemv("cpu", dtype, m, n, k, group, with_offset, tiles, 1e-2, kernel="dot", bits=bits)


@pytest.mark.parametrize("m, n, k, group, tiles", [
    (1, 37, 256, 32, {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "SPLIT": 3}),  # ragged rows, 8 chunks in 3 splits
    (3, 16, 384, 128, None),  # the split the multiprocessors ask for
    (16, 24, 512, 64, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "SPLIT": 1}),  # one split: y written whole
    (2, 40, 256, 128, {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 2, "SPLIT": 2}),  # four chunks a group
    (20, 24, 256, 64, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "SPLIT": 2}),  # rows verifying drafts: 32 padded
    (64, 16, 128, 128, None),
])
@pytest.mark.parametrize("with_offset", [False, True, "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_int4_gemv_split_over_k(m, n, k, group, tiles, with_offset, dtype):
    """The decode rows' GEMV on the tensor cores with K split over programs: the even and odd
    columns' products as two dots, the splits' fp32 partial sums added after."""
    check_int4_gemv("cpu", dtype, m, n, k, group, with_offset, tiles, 1e-2, kernel="split")


@pytest.mark.parametrize("n, k, group, tiles", [
    (37, 256, 32, {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "SPLIT": 3}),  # chunks of 32, sums per chunk
    (40, 512, 128, {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 2, "SPLIT": 2}),  # two chunks a group
    (16, 384, 128, None),
])
@pytest.mark.parametrize("with_offset", [False, True, "symmetric"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_decode_row_prepared_once_gives_the_split_gemvs_product(n, k, group, tiles, with_offset, dtype):
    """One decode row prepared before the split GEMV (``x_pack``: its even and odd columns as the
    first rows of zero tiles, its sums a chunk) gives the product of the row as it is, offsets
    and a constant zero point included; the buffers are kept, their zero rows never written."""
    from ninfer.engine.layers import quant_gemv_triton as qg

    check_int4_gemv("cpu", dtype, 1, n, k, group, with_offset, tiles, 1e-2, kernel="split", pack_x=True)
    chunk = min((tiles or qg.SPLIT_TILES)["BLOCK_K"], group)
    xe, xo, xs = qg._X_PACKS[(torch.device("cpu"), dtype, k, chunk)]
    assert xe.shape == xo.shape == (16, k // 2) and xs.shape == (k // chunk,)
    assert not xe[1:].any() and not xo[1:].any() and xe[0].any()


@pytest.mark.parametrize("m, n, k, group, tiles", [
    (1, 37, 640, 640, {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "SPLIT": 3}),  # one scale a row (5 x 128)
    (5, 24, 256, 32, None),
])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_int8_gemv_split_over_k(m, n, k, group, tiles, with_offset, dtype):
    """8-bit weights (the LM head under ``--weights int4``, every projection under ``int8``, GGUF
    groups held in 8 bits with their offsets) take the split GEMV too, a row's one scale
    included: chunks of the largest power of two dividing it."""
    check_int4_gemv("cpu", dtype, m, n, k, group, with_offset, tiles, 1e-2, kernel="split", bits=8)


@pytest.mark.parametrize("n, k, group", [(37, 256, 32), (16, 384, 128), (5, 512, 256)])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_int4_dequantize(n, k, group, with_offset, bits):
    check_int4_gemv("cpu", torch.float32, 1, n, k, group, with_offset, None, 1e-6, kernel="dequantize", bits=bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_symmetric_4_bit_weights_take_a_constant_zero_point(dtype):
    """4-bit weights whose offsets are all ``-8 * scale`` (GPTQ's sym, GGUF's Q4_0) read no offsets:
    the tensor-core GEMV and the dequantizing kernel subtract the zero point 8 themselves (the
    scalar and split GEMVs: their tests above); a zero point is refused beside offsets or 8-bit values."""
    from ninfer.engine.layers.quant_gemv_triton import int4_gemv_split_triton, pack_int4

    check_int4_gemv("cpu", dtype, 5, 24, 256, 64, "symmetric", None, 1e-2, kernel="dot")
    check_int4_gemv("cpu", torch.float32, 1, 37, 256, 32, "symmetric", None, 1e-6, kernel="dequantize")
    x, packed, scale = torch.randn(1, 256).to(dtype), pack_int4(torch.zeros(4, 256)), torch.ones(4, 2).half()
    with pytest.raises(ValueError, match="constant zero point"):
        int4_gemv_split_triton(x, packed, scale, scale, 128, zero=8)
    with pytest.raises(ValueError, match="constant zero point"):
        int4_gemv_split_triton(x, torch.zeros(4, 256, dtype=torch.int8), scale, None, 128, zero=8)


@pytest.mark.parametrize("m, n, k, group", [(1, 37, 256, 32), (5, 16, 384, 128)])
@pytest.mark.parametrize("with_offset", [False, True])
def test_int8_gemv(m, n, k, group, with_offset):
    check_int4_gemv("cpu", torch.float32, m, n, k, group, with_offset, None, 1e-5, bits=8)


@pytest.mark.parametrize("m, n, k, tiles", [
    (1, 37, 384, None),  # chunks of 128 columns, eight groups: a scale per column pair
    (3, 16, 272, {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 2}),  # 17 groups: chunks of one group
    (2, 9, 96, {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 2}),  # chunks of 32 columns (64 does not divide K)
])
@pytest.mark.parametrize("with_offset", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_groups_of_16(m, n, k, tiles, with_offset, bits):
    """Groups smaller than a chunk (GGUF Q6_K's 16, held as int8): chunks of whole groups."""
    from ninfer.engine.layers.quant_gemv_triton import chunk_columns

    assert [chunk_columns(128, 16, k) for k in (384, 272, 96)] == [128, 16, 32]
    assert chunk_columns(128, 32, 384) == 32 and chunk_columns(8, 16, 384) == 8  # one group (or part) a chunk
    check_int4_gemv("cpu", torch.float32, m, n, k, 16, with_offset, tiles, 1e-5, bits=bits)


@pytest.mark.parametrize("n, k", [(37, 384), (16, 272)])
@pytest.mark.parametrize("with_offset", [False, True])
def test_int8_dequantize_groups_of_16(n, k, with_offset):
    check_int4_gemv("cpu", torch.float32, 1, n, k, 16, with_offset, None, 1e-6, kernel="dequantize", bits=8)


@pytest.mark.parametrize("rows, dtype", [(3, torch.float32), (40, torch.float32), (3, torch.bfloat16)])
# decode rows: the split GEMV (bf16: the tensor-core one); prompt rows: dequantized blocks, then a GEMM
def test_int4_triton_method_fused_projections(rows, dtype, monkeypatch):
    """Three projections of one input held 4-bit for the Triton kernels, fused into one method
    as the model fuses q/k/v: the fused product and each part's equal the dequantized weights'."""
    from ninfer.engine.layers import linear
    from ninfer.engine.layers.linear import GroupQuantized, Linear, fuse_methods

    monkeypatch.setattr(linear, "DEQUANT_BLOCK_ELEMENTS", 20 * 256)  # several row blocks per product
    monkeypatch.setattr(linear, "DEQUANT_BLOCK_ROWS", 16)  # (of 16 rows: 48 = 3 x 16)
    torch.manual_seed(0)
    parts, dense = [], []
    for out, offset in [(48, True), (16, True), (24, True)]:
        q = torch.randint(0, 16, (out, 256), dtype=torch.uint8)
        scale = (torch.rand(out, 2) * 0.02 + 0.001).half().float()
        off = (torch.rand(out, 2) * -0.1).half().float() if offset else None
        w = GroupQuantized(q, scale, off, 128, 4, "test")
        lin = Linear(256, out, bias=False, device="meta")
        lin.take_quantized("p.weight", w)
        lin.method = linear.TritonGroupMethod.from_groups(w, torch.device("cpu"))
        assert lin.method.out_features == out and lin.method.in_features == 256
        parts.append(lin)
        dense.append(w.dequantize())
    fused = fuse_methods([p.method for p in parts])
    assert fused.out_features == 88
    x = torch.randn(rows, 256).to(dtype)
    want = x.float() @ torch.cat(dense).T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(fused(x).float(), want) < tol
    for lin, w in zip(parts, dense):
        assert rel_err(lin(x).float(), x.float() @ w.T) < tol


@pytest.mark.parametrize("rows", [3, 40])
def test_k_quant_weights_through_the_triton_method(rows, monkeypatch):
    """GGUF Q6_K (symmetric int8 in groups of 16) and Q5_K (int8 0..31 in groups of 32 with
    offsets) weights as read from random blocks, held for the Triton kernels: decode rows (the
    GEMV) and prompt rows (dequantized blocks, then a GEMM) give the dequantized weight's product."""
    from gguf import GGMLQuantizationType as Q

    from ninfer.engine.layers import linear
    from ninfer.engine.loader.gguf_quant import _SUPER_BLOCK_READERS
    from support.k_quants import random_blocks

    monkeypatch.setattr(linear, "DEQUANT_BLOCK_ELEMENTS", 20 * 512)  # several row blocks per product
    monkeypatch.setattr(linear, "DEQUANT_BLOCK_ROWS", 16)
    for qtype in (Q.Q6_K, Q.Q5_K):
        w = _SUPER_BLOCK_READERS[qtype](random_blocks(qtype, 48, 512, seed=7), 48, 512)
        method = linear.TritonGroupMethod.from_groups(w, torch.device("cpu"))
        assert method.bits == 8 and method.group == w.group
        # the method reads fp16 scales and offsets: its reference is the weight from them
        ref = linear.GroupQuantized(w.q, w.scale.half().float(), None if w.offset is None else
                                    w.offset.half().float(), w.group, 8, w.kind).dequantize()
        x = torch.randn(rows, 512)
        assert rel_err(method(x), x @ ref.T) < 1e-5


def test_fused_gdn_verify_runs_speculative_rows(tmp_path_factory):
    """Speculative verify rows of a hybrid model through the GDN verify kernel: one launch per
    layer for every verifying request, each position's states kept and the accepted one copied
    into the slot (drafts from the answers with a token spoiled at a moving place, so every
    accepted length is seen)."""
    from support.overlap import drive
    from support.spec_drafts import AnswerDrafter, use_drafter

    parts = load_parts("qwen3_5", tmp_path_factory)
    specs = {0: {"max_tokens": 12}, 1: {"max_tokens": 9}}
    plain, _ = drive(parts, False, specs)
    answers = {name: seen["tokens"] for name, seen in plain.items()}
    engines = []
    fast, _ = drive(parts, False, specs, spec="ngram", draft_tokens=3, engine_out=engines,
                    prepare=lambda e: use_drafter(e, AnswerDrafter(answers, 3, spoil=True)))
    assert fast == plain
    c = engines[0].counters
    assert 0 < c.spec_accepted_tokens < c.spec_draft_tokens


def test_fused_kernels_run_the_mtp_head(tmp_path_factory):
    """``--spec mtp`` through the fused kernels: greedy outputs as without drafts."""
    import torch

    from ninfer.engine.loader import load_checkpoint, load_model
    from support.mtp_weights import add_mtp_weights
    from support.overlap import drive
    from support.tiny import save_tiny_qwen3_5

    ckpt = load_checkpoint(add_mtp_weights(save_tiny_qwen3_5(tmp_path_factory.mktemp("mtp") / "ckpt")))
    parts = (load_model(ckpt, "cpu", torch.float32, mtp=True), ckpt.tokenizer)
    specs = {0: {"max_tokens": 10}, 1: {"max_tokens": 7}}
    plain, _ = drive(parts, False, specs)
    engines = []
    fast, _ = drive(parts, False, specs, spec="mtp", draft_tokens=2, engine_out=engines)
    assert fast == plain and engines[0].counters.spec_draft_tokens > 0


@pytest.mark.parametrize("bits", [4, 8, 6])  # 6: Q6_K's symmetric groups of 16
@pytest.mark.parametrize("tokens, gemv_limit", [(1, None), (3, None), (20, 8)])  # 20 tokens: grouped GEMM
def test_moe_quantized_experts(tokens, gemv_limit, bits, monkeypatch):
    from ninfer.engine.layers import moe_gemm_triton, moe_quant_triton

    monkeypatch.setattr(moe_gemm_triton, "CHUNK_TOKENS", 16)
    monkeypatch.setattr(moe_quant_triton, "CHUNK_TOKENS", 16)  # 20 tokens: two launches
    check_moe_quantized(monkeypatch, "cpu", torch.float32, tokens, hidden=64, experts=8, top_k=2, inter=32,
                        bits=bits, gemv_limit=gemv_limit)


@pytest.mark.parametrize("rows", [20, 64, 100])  # the tensor-core GEMV up to 64 rows, dequantized blocks past them
def test_int4_triton_method_rows_past_the_gemv(rows):
    """bf16 rows of a 4-bit weight held for the Triton kernels past ``GEMV_MAX_ROWS``: its
    tensor-core product (rows verifying drafts, decode batches past 16), or the weight
    dequantized for a GEMM (prompt chunks); either equals the dequantized weight's product."""
    from ninfer.engine.layers import linear
    from ninfer.engine.layers.linear import GroupQuantized

    torch.manual_seed(0)
    q = torch.randint(0, 16, (48, 256), dtype=torch.uint8)
    w = GroupQuantized(q, (torch.rand(48, 2) * 0.02 + 0.001).half().float(), (torch.rand(48, 2) * -0.1).half().float(),
                       128, 4, "test")
    method = linear.TritonGroupMethod.from_groups(w, torch.device("cpu"))
    x = torch.randn(rows, 256).to(torch.bfloat16)
    out = method(x)
    assert out.dtype == torch.bfloat16 and rel_err(out.float(), x.float() @ w.dequantize().T) < 1e-2


def test_the_split_gemv_takes_its_tiles_from_the_launch_settings(monkeypatch):
    """A held 4-bit weight's decode rows run the split GEMV with the launch setting
    ``int4_split_tiles`` in force (rows a program, warps, the programs a multiprocessor its K
    split aims at), and give the same product at every choice."""
    from ninfer.engine import launch
    from ninfer.engine.layers import linear, quant_gemv_triton as qg
    from ninfer.engine.layers.linear import GroupQuantized

    seen = []
    real = qg.int4_gemv_split_triton
    monkeypatch.setattr(qg, "int4_gemv_split_triton", lambda *a, **kw: seen.append(a[5]) or real(*a, **kw))
    monkeypatch.setattr(qg, "_sms", lambda device: 4)
    torch.manual_seed(0)
    q = torch.randint(0, 16, (48, 512), dtype=torch.uint8)
    w = GroupQuantized(q, (torch.rand(48, 4) * 0.02 + 0.001).half().float(), (torch.rand(48, 4) * -0.1).half().float(),
                       128, 4, "test")
    method = linear.TritonGroupMethod.from_groups(w, torch.device("cpu"))
    x = torch.randn(2, 512).to(torch.bfloat16)
    want = x.float() @ w.dequantize().T
    for tiles in ({"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "PER_SM": 4},
                  {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 2, "PER_SM": 1}):
        with launch.using(int4_split_tiles=tiles):
            assert rel_err(method(x).float(), want) < 1e-2
        assert seen[-1] == tiles
    packs = []
    real_pack = qg.x_pack
    monkeypatch.setattr(qg, "x_pack", lambda *a: packs.append(a[1]) or real_pack(*a))
    with launch.using(int4_x_pack=True):  # one decode row prepared first
        assert rel_err(method(x[:1]).float(), want[:1]) < 1e-2
        assert rel_err(method(x).float(), want) < 1e-2  # two rows: as they are
    assert packs == [128]
    with launch.using(int4_x_pack=False):  # one decode row as it is
        assert rel_err(method(x[:1]).float(), want[:1]) < 1e-2
    assert packs == [128]
    assert qg.split_count(48, 512, 16, 128, torch.device("cpu"), per_sm=4) == 4  # 3 row blocks, 16 programs wanted
    assert qg.split_count(48, 512, 32, 64, torch.device("cpu"), per_sm=1) == 2


def test_a_symmetric_4_bit_weight_is_held_without_offsets(monkeypatch):
    """A 4-bit weight whose offsets are all ``-8 * scale`` (a GPTQ ``sym`` checkpoint's, GGUF
    Q4_0's) is held for the Triton kernels as scales alone with the zero point 8: a sixteenth
    fewer bytes at groups of 128, and the products of every path (decode rows, rows on the tensor
    cores, prompt rows dequantized in blocks) those of the weight as stored; a fused projection
    takes it only beside other symmetric parts."""
    from ninfer.engine.layers import linear
    from ninfer.engine.layers.linear import GroupQuantized, fuse_methods

    monkeypatch.setattr(linear, "DEQUANT_BLOCK_ELEMENTS", 20 * 256)  # several row blocks for prompt rows
    monkeypatch.setattr(linear, "DEQUANT_BLOCK_ROWS", 16)
    torch.manual_seed(0)
    q = torch.randint(0, 16, (48, 256), dtype=torch.uint8)
    scale = (torch.rand(48, 2) * 0.02 + 0.001).half().float()
    sym = GroupQuantized(q, scale, -8 * scale, 128, 4, "GPTQ")
    asym = GroupQuantized(q, scale, -7 * scale, 128, 4, "GPTQ")
    held, other = (linear.TritonGroupMethod.from_groups(w, torch.device("cpu")) for w in (sym, asym))
    assert (held.offset, held.zero) == (None, 8) and other.offset is not None and other.zero == 0
    size = [sum(b.numel() * b.element_size() for b in m.buffers()) for m in (held, other)]
    assert size[0] == size[1] - 48 * 2 * 2  # no fp16 offset a group
    for rows in (1, 20, 100):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        assert rel_err(held(x).float(), x.float() @ sym.dequantize().T) < 1e-2
    assert fuse_methods([held, other]) is None
    both = fuse_methods([held, linear.TritonGroupMethod.from_groups(sym, torch.device("cpu"))])
    assert both is not None and both.zero == 8 and both.offset is None


@pytest.mark.parametrize("bits", [4, 8])
def test_the_tensor_core_gemv_lowers_as_a_gpu_runs_it(bits):
    """The interpreter runs bf16 dots in fp32 (``DOT_FP32``); the variant a GPU runs, bf16
    operands straight into ``tl.dot``, lowers for sm_90 too."""
    from ninfer.engine.layers import quant_gemv_triton as qg
    from support import kernel_lowering

    x, y = torch.randn(20, 256).to(torch.bfloat16), torch.empty(20, 48, dtype=torch.bfloat16)
    packed = torch.zeros(48, 128, dtype=torch.uint8) if bits == 4 else torch.zeros(48, 256, dtype=torch.int8)
    scale = torch.ones(48, 2, dtype=torch.float16)
    launch = kernel_lowering.launch_of(
        qg._int4_gemv_dot_kernel, (x, packed, scale, scale, y, 20, 48, 256, 256, packed.shape[1], 2, 48),
        {"G": 128, "M_PAD": 32, "BLOCK_N": 64, "BLOCK_K": 128, "HAS_OFFSET": bits == 4,
         "BASE_BITS": 0x4300 if bits == 4 else 0, "BASE": 128.0 if bits == 4 else 0.0, "DOT_FP32": False,
         "BITS": bits})
    assert not kernel_lowering.lower_recorded([launch])


def test_the_split_gemv_puts_its_arrival_counters_back():
    """Each row block's last program adds the splits' sums and puts its counter back to 0, so the
    next launch (the next layer, a graph replay) finds them ready: two launches in a row give the
    same result, and every counter is 0 after."""
    from ninfer.engine.layers import quant_gemv_triton as qg

    torch.manual_seed(0)
    packed = qg.pack_int4(torch.randint(0, 16, (96, 512), dtype=torch.uint8))
    scale = (torch.rand(96, 4) * 0.02 + 0.001).half()
    x = torch.randn(2, 512).to(torch.bfloat16)
    tiles = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 2, "SPLIT": 4}
    first = qg.int4_gemv_split_triton(x, packed, scale, None, 128, tiles)
    assert torch.equal(qg.int4_gemv_split_triton(x, packed, scale, None, 128, tiles), first)
    assert not qg._COUNTS[torch.device("cpu")].any()


@pytest.mark.parametrize("bits, one_row, packed_x", [(4, False, False), (8, False, False), (4, True, False),
                                                     (4, True, True)], ids=["4bit", "8bit", "4bit-1", "4bit-1-packed"])
@pytest.mark.parametrize("split", [1, 4], ids=["whole", "split"])
def test_the_split_gemv_lowers_as_a_gpu_runs_it(split, bits, one_row, packed_x):
    """The split-K GEMV's GPU variant (bf16 operands straight into its two ``tl.dot``, the nibbles
    made floats by inline PTX; one split writing the output, or several leaving fp32 partial
    planes that the last to arrive adds; the sums of x from all 16 rows, from the one real row,
    or from the row prepared by ``x_pack``) lowers for sm_90."""
    from ninfer.engine.layers import quant_gemv_triton as qg
    from support import kernel_lowering

    x, y = torch.randn(1, 1024).to(torch.bfloat16), torch.empty(1, 48, dtype=torch.bfloat16)
    partial, counts = torch.empty(split, 1, 48), torch.zeros(1, dtype=torch.int32)
    packed = torch.zeros(48, 512, dtype=torch.uint8) if bits == 4 else torch.zeros(48, 1024, dtype=torch.int8)
    scale = torch.ones(48, 8, dtype=torch.float16)
    launch = kernel_lowering.launch_of(
        qg._int4_gemv_split_kernel,
        (x, packed, scale, scale, y, partial, counts, x, x, partial, 1, 48, 1024, 8 // split, split, 1024, packed.shape[1],
         scale.shape[1], 48, 48),
        {"G": 128, "M_PAD": 16, "BLOCK_N": 64, "BLOCK_K": 128, "HAS_OFFSET": bits == 4,
         "BASE_BITS": 0x4300 if bits == 4 else 0, "BASE": 128.0 if bits == 4 else 0.0, "DOT_FP32": False,
         "SPLIT": split > 1, "BITS": bits, "ONE_ROW": one_row, "PACKED_X": packed_x})
    assert not kernel_lowering.lower_recorded([launch])
