"""``--weights int8`` / ``int4``: a dense checkpoint's projections quantized at load (round to nearest,
per-row int8, int4 in groups of 128, of 32 for narrow matrices) and run through the CPU linear methods; the logits of a tiny
random Qwen3.5 stay near those of its dense load."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.layers.linear import Int4CpuMethod, Linear, quantize_rtn
from ninfer.engine.loader import load_checkpoint, load_model, quantized_at_load
from ninfer.engine.models.registry import build_model
from ninfer.engine.models.base import ForwardBatch
from support.tiny import save_tiny_qwen3_5, save_wide_qwen3_5


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_is_within_half_a_step(bits):
    w = torch.randn(32, 2048) * torch.linspace(0.1, 3.0, 32)[:, None]
    q = quantize_rtn(w, bits)
    assert q.bits == bits and q.group == 128 and q.q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    step = q.scale.repeat_interleave(q.group, dim=1)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    if bits == 8:  # one scale per row
        assert bool((q.scale == q.scale[:, :1]).all())


def test_groups_of_128_or_the_largest_that_divides():
    assert quantize_rtn(torch.randn(16, 2304), 4).group == 128
    assert quantize_rtn(torch.randn(16, 2112), 4).group == 64
    assert quantize_rtn(torch.randn(16, 576), 8).group == 64
    assert quantize_rtn(torch.randn(16, 96), 8).group == 32
    assert quantize_rtn(torch.randn(16, 48), 4) is None  # left dense


def test_narrow_int4_matrices_take_groups_of_32_where_they_were_quantized_before():
    """Fewer than ``NARROW_COLUMNS`` input columns (a small model's: SmolLM2's 576 and 1536) from a
    quantized checkpoint; a dense checkpoint's (the 35B-A3B's 512-column expert downs) keep 128."""
    assert quantize_rtn(torch.randn(16, 576), 4, requantized=True).group == 32
    assert quantize_rtn(torch.randn(16, 1536), 4, requantized=True).group == 32
    assert quantize_rtn(torch.randn(16, 512), 4).group == 128
    assert quantize_rtn(torch.randn(16, 576), 4).group == 64
    assert quantize_rtn(torch.randn(16, 4096), 4, requantized=True).group == 128


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A 4-layer hybrid Qwen3.5 wide enough that its projections fit the int4 matmul."""
    return load_checkpoint(save_wide_qwen3_5(tmp_path_factory.mktemp("ckpt") / "qwen", 256))


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), ForwardBatch.single(len(ids), model.new_cache())))


@pytest.fixture(scope="module")
def dense_logits(tiny_qwen):
    ids = list(range(3, 40))
    bf16 = logits(load_model(tiny_qwen, "cpu", torch.bfloat16, "dense"), ids).float()
    return ids, logits(load_model(tiny_qwen, "cpu", torch.float32, "dense"), ids), bf16


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_tiny_qwen3_5_quantized_at_load_stays_near_dense(tiny_qwen, dense_logits, weights):
    """Random weights have no structure for 4 bits to keep (every weight counts alike), so the
    bounds are loose for int4: measured 2.3% (int8) and 32% (int4) of the largest logit, against
    1.6% for the whole model in bf16, whose rounding the int4 matmul's inputs share."""
    ids, want, bf16 = dense_logits
    quant = load_model(tiny_qwen, "cpu", torch.float32, weights)
    linears = {n: m for n, m in quant.named_modules() if isinstance(m, Linear)}
    held = {n for n, m in linears.items() if m.quantized}
    # every projection but the GDN's 4-row b / a ones (not a multiple of 16 rows) is quantized
    assert held == {n for n in linears if not n.endswith(("in_proj_b", "in_proj_a"))}
    gdn = quant.model.layers[0].linear_attn
    assert isinstance(gdn.in_proj_qkv.method, Int4CpuMethod) and gdn.in_proj_b.weight is not None
    got = logits(quant, ids)
    floor = relative_error(bf16, want)
    if weights == "int8":
        assert relative_error(got, want) < max(3 * floor, 0.01)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    else:
        assert relative_error(got, want) < 0.5
        assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.8


def test_quantized_at_load_off_the_cpu_holds_the_head_in_8_bits(tiny_qwen):
    """On the GPU (here the meta device, which builds no kernels) every projection and the LM
    head are held for the Triton kernels: the projections in ``bits``, the head in 8 bits."""
    from ninfer.engine.layers.linear import TritonGroupMethod

    assert EngineConfig(device="cuda", weights="int4").weights == "int4"
    assert EngineConfig(device="cuda", weights="int8").weights == "int8"
    model = build_model(tiny_qwen.config, dtype=torch.bfloat16, device="meta")
    model.load_weights(quantized_at_load(model, tiny_qwen.weights(), 4, torch.device("meta")))
    held = {n: m.method for n, m in model.named_modules() if getattr(m, "method", None) is not None}
    assert all(isinstance(m, TritonGroupMethod) for m in held.values())
    assert held["lm_head"].bits == 8 and held["model.layers.0.mlp.down_proj"].bits == 4
    assert {n for n, m in model.named_modules() if isinstance(m, Linear)} | {"lm_head"} == set(held)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_moe_experts_and_shared_expert_quantized_at_load(tmp_path, weights):
    """The MoE experts are held in ``bits`` (one int4 product per expert on the CPU), next to the
    shared expert's quantized projections, which run on their own (never folded into the
    experts' kernels). The tiny MoE's routing flips under any rounding, so the experts and the
    shared expert are compared as modules on the same routing, and the whole model only runs."""
    from ninfer.engine.layers.moe import QuantizedExperts

    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path / "moe", moe=True))
    dense = load_model(ckpt, "cpu", torch.float32, "dense")
    quant = load_model(ckpt, "cpu", torch.float32, weights)
    moe, ref = quant.model.layers[0].mlp, dense.model.layers[0].mlp
    assert moe.shared_expert.gate_proj.quantized and not moe._shared_folded
    experts = moe.experts
    assert isinstance(experts.gate_up_held, QuantizedExperts) and isinstance(experts.down_held, QuantizedExperts)
    assert experts.gate_up_proj is None and experts.down_proj is None  # no dense copy kept
    assert experts.gate_up_held.bits == (8 if weights == "int8" else 4)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    ids, wts = ref.route(x)
    # measured 1.2% and 14-30% (int4 over random weights, which have no structure for 4 bits to keep,
    # in groups of 64 and 32 with bf16 activations; against 1.6% for the whole model in bf16)
    bound = 0.03 if weights == "int8" else 0.45
    with torch.no_grad():
        assert relative_error(moe.shared_expert(x), ref.shared_expert(x)) < bound
        assert relative_error(experts(x, ids, wts), ref.experts(x, ids, wts)) < bound
    got = logits(quant, list(range(3, 30)))
    assert got.shape == (27, ckpt.config.vocab_size) and bool(torch.isfinite(got).all())


def test_moe_experts_held_packed_off_the_cpu(tmp_path):
    """Off the CPU (the meta device here, which builds no kernels) the experts are packed for the
    Triton kernels: ``[E, N, K / 2]`` bytes with fp16 scales and minimums ``[E, N, K / 32]``."""
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path / "moe", moe=True))
    model = build_model(ckpt.config, dtype=torch.bfloat16, device="meta")
    model.load_weights(quantized_at_load(model, ckpt.weights(), 4, torch.device("meta")))
    experts = model.model.layers[0].mlp.experts
    e, i, h = ckpt.config.num_experts, ckpt.config.moe_intermediate_size, ckpt.config.hidden_size
    assert experts.kernels_take and experts.gate_up_held.per_expert is None
    assert tuple(experts.gate_up_held.packed.shape) == (e, 2 * i, h // 2) and experts.gate_up_held.packed.dtype == torch.uint8
    assert tuple(experts.down_held.scale.shape) == (e, h, i // 32) and experts.down_held.scale.dtype == torch.float16


def test_experts_with_one_matrix_held_are_made_dense_again_for_the_kernels():
    """A file whose experts' gate/up come in a held format and down in one that is not: the
    packed half is dequantized after the load (the kernels take both held or neither)."""
    from ninfer.engine.layers.linear import GroupQuantized, quantize_rtn
    from ninfer.engine.layers.moe import FusedExperts

    experts = FusedExperts(4, 64, 32)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    q = quantize_rtn(experts.gate_up_proj.detach().reshape(-1, 64), 4)
    experts.take_quantized("experts.gate_up_proj", q, torch.device("cpu"), packed=True)
    assert experts.quantized and not experts.kernels_take
    assert experts.settle(torch.float32)
    assert experts.gate_up_held is None and experts.kernels_take and not experts.quantized
    held = GroupQuantized(q.q, q.scale.half().float(), q.offset.half().float(), q.group, 4, "int4")  # fp16 scales
    assert torch.equal(experts.gate_up_proj, held.dequantize().view(4, 64, 64))
    assert not experts.settle(torch.float32)  # nothing left to settle


@pytest.mark.parametrize("weights,length", [("int8", 64), ("int4", 64), ("int4", 150)])
def test_engine_serves_a_prompt_of_chunks_with_the_weights_held_quantized(tiny_qwen, weights, length):
    """A prompt long enough for the Gated DeltaNet's chunked form (whose output reaches
    ``out_proj`` strided) runs through the engine with every projection held quantized, and its
    greedy tokens are those of the same weights run over the whole sequence without the engine."""
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams

    quant = load_model(tiny_qwen, "cpu", torch.float32, weights)
    ids = [3 + (7 * i) % 300 for i in range(length)]
    eng = LLMEngine(quant, tiny_qwen.tokenizer, EngineConfig(max_context=256, max_concurrency=2))
    eng.add_request(Request("long", ids, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                            max_total_tokens=256))
    got = []
    while eng.has_work:
        for o in eng.step():
            got += list(o.token_ids or [])
    want = []
    for _ in range(3):
        want.append(int(logits(quant, ids + want)[-1].argmax()))
    assert got == want


def test_prompt_rows_dequantize_blocks_of_aligned_rows():
    """A prompt's product with a 4-bit weight on the GPU dequantizes blocks of weight rows, each
    a column block of the output: every block but a weight's last is a multiple of 128 rows, so
    each one's output columns start 16-byte aligned (cuBLAS runs a misaligned output only with
    its slowest kernels), at the 27B's projections as at a small one."""
    from ninfer.engine.layers.linear import DEQUANT_BLOCK_ROWS, dequant_block_rows

    for n, k in [(34816, 5120), (5120, 17408), (5120, 6144), (16384, 5120), (248320, 5120), (96, 64)]:
        rows = dequant_block_rows(n, k)
        assert rows == n or rows % DEQUANT_BLOCK_ROWS == 0, (n, k, rows)
        assert rows * k <= max(1 << 25, DEQUANT_BLOCK_ROWS * k)  # about 64 MiB of bf16 at once
