"""Quantized KV pages on the GPU (``--kv-dtype int8`` / ``fp8`` / ``4bit``): the decode and prompt
attention kernels compiled for int8, e4m3 and 4-bit pages at real head dims in bf16 against the
torch references that dequantize the gathered pages first, and the recurrent state of a Gated
DeltaNet decode step held in bf16 (``--state-dtype``)."""
from __future__ import annotations

import pytest
import torch

from support.kernel_cases import check_gdn_decode, rel_err
from support.prefill_cases import paged_rows

pytestmark = pytest.mark.gpu

DTYPES = [torch.int8, torch.float8_e4m3fn, torch.uint8]
IDS = ["int8", "fp8", "4bit"]


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("d, h, hkv", [(256, 24, 4), (128, 32, 8), (64, 12, 2)])
def test_paged_decode_attention_over_quantized_pages(d, h, hkv, kv_dtype):
    from ninfer.engine.cache.kv_quant import quantize_pages
    from ninfer.engine.layers.paged_attention import paged_decode_attention, paged_decode_attention_ref

    b, page, pages = 4, 16, 600
    (k, ks), (v, vs) = (quantize_pages(torch.randn(pages, page, hkv, d, device="cuda"), kv_dtype, keys)
                        for keys in (True, False))
    lens = torch.tensor([1, 100, 4097, 9000], dtype=torch.int32, device="cuda")
    tables = torch.stack([torch.randperm(pages, device="cuda")[:570] for _ in range(b)]).int()
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    out = paged_decode_attention(q, k, v, tables, lens, d**-0.5, gate, ks, vs)
    ref = paged_decode_attention_ref(q.float(), k, v, tables, lens, d**-0.5, ks, vs) * torch.sigmoid(gate.float())
    assert rel_err(out.float(), ref) < 2e-2


@pytest.mark.parametrize("kv_dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("d, h, hkv, page", [(256, 24, 4, 16), (128, 16, 16, 32), (64, 12, 2, 16)])
def test_prefill_attention_over_quantized_pages(d, h, hkv, page, kv_dtype):
    from ninfer.engine.cache.kv_quant import quantize_pages
    from ninfer.engine.layers.prefill_attention import prefill_attention, prefill_attention_ref

    case = paged_rows([(0, 300), (5003, 1), (1021, 200)], h, hkv, d, page, torch.bfloat16, "cuda", True)
    # NaN value scales past each context (4-bit keys: ranges over the rows before)
    (k, ks), (v, vs) = quantize_pages(case.k, kv_dtype, True), quantize_pages(case.v, kv_dtype, False)
    out = prefill_attention(case.q, k, v, case.tables, case.cu, case.ctx, case.max_q, case.scale, case.gate, ks, vs)
    ref = prefill_attention_ref(case.q.float(), k, v, case.tables, case.cu, case.ctx, case.scale,
                                case.gate.float(), ks, vs)
    assert not out.isnan().any()
    assert rel_err(out.float(), ref) < 2e-2


def test_gdn_decode_with_a_bf16_state():
    check_gdn_decode("cuda", torch.bfloat16, hidden=256, k_heads=4, v_heads=8, head_dim=128,
                     state_dtype=torch.bfloat16)
