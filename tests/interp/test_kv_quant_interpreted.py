"""Quantized KV pages (``--kv-dtype int8`` / ``fp8`` / ``4bit``) under Triton's CPU interpreter: the
decode and prompt attention kernels reading int8 / e4m3 pages with their per-row scales, and 4-bit
pages with their keys' ranges per page and channel and their values' scales per group, against
the torch references that dequantize the gathered pages first; whole tiny models through the
attention kernels against the torch path over the same quantized pools (the K/V write of
quantized pages is the torch one on both: it rotates one-byte keys and queries first and
requantizes the pages 4-bit keys are written to, ``cache/kv_quant.py``)."""
from __future__ import annotations

import pytest
import torch

from support.decode_paths import load_parts
from support.kernel_cases import check_prefill_attention, rel_err
from support.prefill_cases import paged_rows

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.uint8]
IDS = ["int8", "fp8", "4bit"]


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("d, h, hkv, page, sms", [(64, 8, 2, 16, 4), (32, 4, 4, 8, 64), (16, 4, 2, 8, 4)])
def test_paged_decode_attention_over_one_byte_pages(d, h, hkv, page, sms, gated, kv_dtype, monkeypatch):
    from ninfer.engine.cache.kv_quant import quantize_pages
    from ninfer.engine.layers import paged_attention_triton as kernel
    from ninfer.engine.layers.paged_attention import paged_decode_attention_ref, paged_decode_attention_sdpa

    monkeypatch.setitem(kernel._SM_COUNT, -1, sms)
    b, pages = 3, 40
    scale_rows = torch.logspace(-2, 1, page)[None, :, None, None]  # rows of different size in a page
    (k, ks), (v, vs) = (quantize_pages(torch.randn(pages, page, hkv, d) * scale_rows, kv_dtype, keys)
                        for keys in (True, False))
    lens = torch.tensor([1, 17, 300], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages)[: (300 + page - 1) // page + 2] for _ in range(b)]).int()
    q = torch.randn(b, h, d)
    gate = torch.randn(b, h, 2 * d)[:, :, d:] if gated else None
    out = kernel.paged_decode_attention_triton(q, k, v, tables, lens, d**-0.5, gate, k_scale=ks, v_scale=vs)
    ref = paged_decode_attention_ref(q, k, v, tables, lens, d**-0.5, ks, vs)
    sdpa = paged_decode_attention_sdpa(q, k, v, tables, lens, d**-0.5, ks, vs)  # the CPU path
    assert rel_err(sdpa, ref) < 1e-5
    if gated:
        ref = ref * torch.sigmoid(gate)
    assert rel_err(out, ref) < 1e-5


ROWS = [(0, 20), (49, 1), (17, 33), (64, 7), (3, 0), (5, 40)]


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("d, h, hkv, page, tiles", [(64, 4, 4, 16, None),
                                                     (32, 8, 2, 5, {"BLOCK_M": 16, "BLOCK_N": 8}),
                                                     (128, 4, 2, 16, {"BLOCK_M": 16, "BLOCK_N": 16})])
def test_prefill_attention_over_one_byte_pages(d, h, hkv, page, tiles, kv_dtype):
    """Slots past each row's context hold NaN before quantizing, so their scales are NaN: a read
    past the context shows in the output."""
    from ninfer.engine.cache.kv_quant import quantize_pages
    from ninfer.engine.layers.prefill_attention import prefill_attention_ref
    from ninfer.engine.layers.prefill_attention_triton import prefill_attention_triton

    case = paged_rows(ROWS, h, hkv, d, page, torch.float32, "cpu", gated=True)
    (k, ks), (v, vs) = quantize_pages(case.k, kv_dtype, True), quantize_pages(case.v, kv_dtype, False)
    out = prefill_attention_triton(case.q, k, v, case.tables, case.cu, case.ctx, case.max_q, case.scale,
                                   case.gate, tiles, k_scale=ks, v_scale=vs)
    ref = prefill_attention_ref(case.q, k, v, case.tables, case.cu, case.ctx, case.scale, case.gate, ks, vs)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_fused_steps_over_one_byte_pools_match_the_torch_path(name, kv_dtype, tmp_path_factory, monkeypatch):
    model, tok = load_parts(name, tmp_path_factory)
    check_prefill_attention(monkeypatch, model, tok, "cpu", page_size=4, tol=1e-3, kv_dtype=kv_dtype)
