"""Linear methods (``layers/linear.py``): a projection, a fused projection, the embedding and the LM
head holding group-quantized weights give the products of their dequantized weights."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ninfer.engine.layers.embedding import Embedding, LMHead
from ninfer.engine.layers.fused_linear import fuse_linears, split_linear
from ninfer.engine.layers.linear import Fp16CpuMethod, GroupQuantized, Int4CpuMethod, Linear, fp16_cpu_gemm_available
from ninfer.engine.layers.norm import RMSNorm
from ninfer.engine.models.weights import load_parameters

BF16_STEP = 2.0**-8  # relative spacing of bf16 values


def random_groups(out: int, cols: int, bits: int, offset: bool, group: int = 32, seed: int = 0) -> GroupQuantized:
    gen = torch.Generator().manual_seed(seed)
    g = cols // group
    if bits == 4:
        q = torch.randint(0, 16, (out, cols), generator=gen, dtype=torch.uint8)
    else:
        q = torch.randint(-128, 128, (out, cols), generator=gen, dtype=torch.int32).to(torch.int8)
    scale = (torch.rand(out, g, generator=gen) * 0.02 + 0.001).half().float()  # fp16 scales, as in GGUF
    off = (torch.rand(out, g, generator=gen) * -0.1).half().float() if offset else None
    return GroupQuantized(q, scale, off, group, bits, f"test-{bits}bit")


def reference(x: torch.Tensor, w: GroupQuantized) -> torch.Tensor:
    """Dequantize-then-matmul with the inputs the kernel sees: ``x`` in bf16, each group's scale
    and zero (``offset + 8 * scale``, 4-bit) in bf16, the sums in fp64."""
    n, k = w.shape
    scale = w.scale.to(torch.bfloat16).double()
    if w.bits == 4:
        offset = torch.zeros_like(w.scale) if w.offset is None else w.offset
        zero = (offset + 8 * w.scale).to(torch.bfloat16).double()
        deq = (w.q.double().view(n, -1, w.group) - 8) * scale[..., None] + zero[..., None]
    else:
        deq = w.q.double().view(n, -1, w.group) * scale[..., None]
    return (x.to(torch.bfloat16).double() @ deq.view(n, k).t()).float()


def assert_rounded_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to the bf16 rounding of the product's result (and of the 8-bit halves')."""
    err = (y - ref).abs()
    bound = 2 * BF16_STEP * ref.abs() + 1e-3 * ref.abs().max()
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} over bound"


@pytest.mark.parametrize("bits,offset", [(4, True), (4, False), (8, False)])
@pytest.mark.parametrize("rows", [1, 5])
def test_quantized_projection_is_its_dequantized_product(bits, offset, rows):
    w = random_groups(48, 96, bits, offset)
    lin = Linear(96, 48, bias=False)
    lin.take_quantized("p.weight", w)
    assert lin.quantized and lin.weight is None and isinstance(lin.method, Int4CpuMethod)
    x = torch.randn(rows, 96)
    y = lin(x)
    assert y.shape == (rows, 48) and y.dtype == torch.float32
    assert_rounded_close(y, reference(x, w))
    # and near the exact fp32 product of the format's own dequantization
    exact = x @ w.dequantize().t()
    assert (y - exact).abs().max() <= 0.02 * exact.abs().max()


def test_larger_groups_and_bias():
    w = random_groups(32, 256, 4, True, group=128)
    lin = Linear(256, 32, bias=True)
    nn.init.normal_(lin.bias)
    lin.take_quantized("p.weight", w)
    x = torch.randn(3, 256)
    assert_rounded_close(lin(x) - lin.bias, reference(x, w))


def quantized_parts(sizes: list[int], cols: int = 64) -> list[Linear]:
    parts = [Linear(cols, n, bias=False) for n in sizes]
    for i, p in enumerate(parts):
        p.take_quantized(f"p{i}.weight", random_groups(p.out_features, cols, 4, True, seed=i))
    return parts


@pytest.mark.parametrize("bits", [4, 8])
def test_fused_quantized_parts_equal_the_parts(bits):
    parts = [Linear(64, n, bias=False) for n in (128, 64, 48)]  # the last part need not be whole blocks
    for i, p in enumerate(parts):
        p.take_quantized(f"p{i}.weight", random_groups(p.out_features, 64, bits, bits == 4, seed=i))
    fused = fuse_linears(parts)
    assert isinstance(fused, Int4CpuMethod) and fused.out_features == 240
    x = torch.randn(3, 64)
    for got, part in zip(split_linear(x, fused, [128, 64, 48]), parts):
        assert torch.equal(got, part(x))
        # the parts' packed rows are views of the fused ones (no second copy)
        assert part.method.packed0.untyped_storage().data_ptr() == fused.packed0.untyped_storage().data_ptr()


def test_parts_that_cannot_be_joined_stay_apart():
    assert fuse_linears(quantized_parts([48, 16])) is None  # 48 rows: not whole packed blocks
    a, b = quantized_parts([64])[0], Linear(64, 16, bias=False)
    assert fuse_linears([a, b]) is None  # one dense, one quantized


def test_embedding_rows_stay_quantized():
    w = random_groups(64, 32, 8, False)
    emb = Embedding(64, 32)
    emb.take_quantized("embed.weight", w)
    assert emb.weight is None and emb.table is w
    ids = torch.tensor([[3, 0], [63, 3]])
    rows = emb(ids)
    assert rows.shape == (2, 2, 32) and rows.dtype == torch.float32
    assert torch.equal(rows, w.dequantize()[ids])  # lookups are exact


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_is_held_in_fp16_with_fp32_logits(tied):
    """Logits are read by sampling as they are: on the CPU the head's weight is held in fp16
    (fbgemm's fp16 GEMM, fp32 activations and sums), never run through the bf16-rounding int4
    product; a table tied to it stays quantized for the lookups."""
    if not fp16_cpu_gemm_available():
        pytest.skip("this torch has no fbgemm")
    w = random_groups(64, 32, 8, False)
    emb = Embedding(64, 32)
    head = LMHead(32, 64, tied_to=emb if tied else None)
    owner, name = (emb, "model.embed_tokens.weight") if tied else (head, "lm_head.weight")
    owner.take_quantized(name, w)
    assert isinstance(head.method, Fp16CpuMethod) and head.method.nbytes == 2 * 64 * 32
    held = w.dequantize().half().float()
    assert torch.equal(head.method.held_weight(), held)
    assert (held - w.dequantize()).abs().max() <= 2.0**-11 * w.dequantize().abs().max()  # fp16's step
    hidden = torch.randn(4, 3, 32)
    logits = head(hidden)
    assert logits.shape == (4, 3, 64) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, (hidden.double() @ held.double().t()).float(), rtol=1e-6, atol=1e-5)
    assert emb.weight is None if tied else head.weight is None
    if tied:
        assert emb.table is w and torch.equal(emb(torch.tensor([5])), w.dequantize()[5:6])


@pytest.mark.parametrize("tied", [True, False])
def test_lm_head_without_fbgemm_is_held_dense(tied, monkeypatch):
    """Where no method holds the head's weight it is dequantized at load, a tied table with it."""
    from ninfer.engine.layers import linear

    monkeypatch.setattr(linear, "fp16_cpu_gemm_available", lambda: False)
    w = random_groups(64, 32, 8, False)
    emb = Embedding(64, 32)
    head = LMHead(32, 64, tied_to=emb if tied else None)
    owner, name = (emb, "model.embed_tokens.weight") if tied else (head, "lm_head.weight")
    owner.take_quantized(name, w)
    assert head.method is None and torch.equal(head.lm_weight, w.dequantize())
    hidden = torch.randn(4, 32)
    torch.testing.assert_close(head(hidden), hidden @ w.dequantize().t(), rtol=1e-5, atol=1e-5)
    if tied:
        assert emb.table is None and torch.equal(emb(torch.tensor([5])), w.dequantize()[5:6])


def test_lm_head_out_of_fp16_range_is_held_dense():
    w = random_groups(64, 32, 8, False)
    w.scale[3, 0] = 1000.0  # values to 128000, past fp16's 65504
    head = LMHead(32, 64)
    head.take_quantized("lm_head.weight", w)
    assert head.method is None and torch.equal(head.lm_weight, w.dequantize())


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = Linear(64, 16, bias=False)
        self.norm = RMSNorm(64, 1e-6)
        self.router = nn.Linear(64, 16, bias=False)


def test_load_parameters_places_quantized_weights_and_refuses_others():
    block = _Block()
    w = random_groups(16, 64, 4, True)
    load_parameters(block, [("proj.weight", w), ("norm.weight", torch.ones(64)),
                            ("router.weight", torch.zeros(16, 64))])
    assert block.proj.quantized
    with pytest.raises(ValueError, match=r"'router.weight' is test-4bit-quantized, and Linear takes only dense"):
        load_parameters(_Block(), [("router.weight", w)])
    with pytest.raises(ValueError, match="shape mismatch for 'proj.weight'"):
        load_parameters(_Block(), [("proj.weight", random_groups(32, 64, 4, True))])


def test_off_the_cpu_weights_are_held_for_the_triton_kernels():
    from ninfer.engine.layers.linear import TritonGroupMethod

    lin = Linear(64, 16, bias=False, device="meta")
    lin.take_quantized("p.weight", random_groups(16, 64, 4, True))
    assert isinstance(lin.method, TritonGroupMethod) and lin.method.packed.shape == (16, 32)
    lin = Linear(64, 16, bias=False, device="meta")
    lin.take_quantized("p.weight", random_groups(16, 64, 8, False))
    assert lin.method.bits == 8 and lin.method.packed.dtype == torch.int8 and lin.method.in_features == 64
    w = random_groups(16, 63, 4, True, group=63)  # groups of an odd size: not for the kernels' byte pairs
    with pytest.raises(ValueError, match="groups of an even size"):
        Linear(63, 16, bias=False, device="meta").take_quantized("p.weight", w)


def test_shapes_the_cpu_kernel_cannot_take_are_refused():
    lin = Linear(64, 24, bias=False)
    with pytest.raises(ValueError, match="multiples of 16"):
        lin.take_quantized("p.weight", random_groups(24, 64, 4, True))


@pytest.mark.parametrize("bits, requantized", [(4, False), (8, False), (4, True)])
def test_quantizing_a_weight_a_block_of_rows_at_a_time_gives_the_whole_weights_groups(monkeypatch, bits, requantized):
    """A weight quantized at load (a dense checkpoint's matrices, a GPTQ checkpoint's bf16 LM head
    under ``--head-weights``) goes to the device a block of rows at a time: the 27B's head in fp32
    is 4.7 GiB, more than a 16 GiB cap leaves beside its other weights. The blocks' integers,
    scales and offsets are those of the weight quantized whole, and no call sees more rows than a
    block."""
    from ninfer.engine.layers import linear

    w = torch.randn(300, 256, dtype=torch.bfloat16) * torch.linspace(0.1, 3.0, 300)[:, None].to(torch.bfloat16)
    whole = linear.quantize_rtn(w, bits, requantized)
    seen = []
    real = linear.quantize_rtn

    def spy(x, b, r=False):
        seen.append(x.shape[0])
        return real(x, b, r)

    monkeypatch.setattr(linear, "QUANTIZE_BLOCK_ELEMENTS", 64 * 256)
    monkeypatch.setattr(linear, "quantize_rtn", spy)
    blocks = linear.quantize_rtn_rows(w, bits, torch.device("cpu"), requantized)
    assert seen == [64, 64, 64, 64, 44]
    assert (blocks.group, blocks.bits, blocks.kind) == (whole.group, whole.bits, whole.kind)
    assert torch.equal(blocks.q, whole.q) and torch.equal(blocks.scale, whole.scale)
    assert (blocks.offset is None) == (whole.offset is None)
    assert blocks.offset is None or torch.equal(blocks.offset, whole.offset)
    assert torch.equal(blocks.dequantize(), whole.dequantize())
