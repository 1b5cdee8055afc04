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


def test_4bit_key_writes_in_a_cuda_graph_end_as_a_whole_page_write():
    """A 4-bit key write with its exact rows (``ExactKeys``) captured in a CUDA graph and replayed
    a row at a time for two sequences side by side leaves each page with the codes and ranges of
    the page written whole."""
    from ninfer.engine.cache.kv_quant import ExactKeys, quantize_keys4, write_keys4

    g = torch.Generator(device="cuda").manual_seed(5)
    page, hkv, d, slots = 16, 4, 128, 3
    x = torch.randn(2, 2 * page, hkv, d, device="cuda", generator=g) * 3 + torch.linspace(-9, 9, d, device="cuda")
    x = x.bfloat16()
    pages = torch.zeros(8, page, hkv, d // 2, dtype=torch.uint8, device="cuda")
    stats = torch.zeros(8, 2, hkv, d, dtype=torch.float16, device="cuda")
    exact = ExactKeys(torch.zeros(slots + 1, page, hkv, d, dtype=torch.bfloat16, device="cuda"),
                      torch.full((slots + 1, page), -1, dtype=torch.long, device="cuda"),
                      torch.tensor([2, 0], device="cuda"))
    tables = torch.tensor([[5, 1], [2, 6]], device="cuda")
    index = torch.zeros(2, dtype=torch.long, device="cuda")
    k = torch.zeros(2, hkv, d, dtype=torch.bfloat16, device="cuda")

    def feed(t: int) -> None:
        index.copy_(tables[:, t // page] * page + t % page)
        k.copy_(x[:, t])

    feed(0)
    write_keys4(pages, stats, index, k, exact)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_keys4(pages, stats, index, k, exact)
    for t in range(2 * page):
        feed(t)
        graph.replay()
    codes, ranges = quantize_keys4(x.view(4, page, hkv, d))
    order = tables.flatten()
    assert torch.equal(pages[order], codes) and torch.equal(stats[order], ranges)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_4bit_decode_in_cuda_graphs_gives_the_eager_tokens(spec, tmp_path_factory, set_launch):
    """Decode (and verify) steps over 4-bit pages replayed from CUDA graphs, each sequence's key
    writes through its write slot, give the tokens of the same steps run eagerly. The decode
    batches are whole graph buckets (2, then 4, then 2 or 1), so a graph runs the eager step's own
    shapes: a batch of 3 padded to 4 takes other GEMM kernels, whose last-bit differences move a
    4-bit key code now and then, and the tiny random model's flat logits turn that into another
    token (the non-quantized graph tests cover padding)."""
    from ninfer.engine.loader import load_checkpoint, load_model
    from support.overlap import drive
    from support.tiny import save_tiny_llama

    ckpt = load_checkpoint(save_tiny_llama(tmp_path_factory.mktemp("llama") / "ckpt"))
    parts = (load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer)
    specs = {i: {"max_tokens": 24} for i in range(4)}
    extra = {} if spec is None else {"spec": spec, "draft_tokens": 3}
    set_launch(verify_in_graph=True)
    engines = []
    arrivals = {2: (0, 3), 3: (0, 3)}  # two join together once the first has 3 tokens
    eager, _ = drive(parts, False, specs, arrivals=arrivals, device="cuda", cuda_graphs=False, kv_dtype="4bit",
                     **extra)
    graphed, _ = drive(parts, False, specs, arrivals=arrivals, device="cuda", kv_dtype="4bit",
                       engine_out=engines, **extra)
    assert engines[0].runner.graphs is not None and engines[0].caches.kv.write_slots > 0
    assert graphed == eager
