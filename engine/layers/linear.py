"""A projection's weight and how it is applied: a linear method per layer.

``Linear`` is ``nn.Linear`` whose weight may be held quantized instead: a ``GroupQuantized``
weight (integers with a scale and an offset per group of input columns, as a GGUF file stores
Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0) is placed with ``Linear.take_quantized``, which swaps the dense parameter
for a ``LinearMethod``: a module that owns the packed form of the weight and whose
``forward(x)`` is ``x @ weight.T``. The layers call the projection (``proj(x)``) and never look
at which kind it holds. Projections of one input held quantized fuse like dense ones
(``fuse_linears``) into one method of their concatenated rows (``fuse_methods``): the packed
layout interleaves rows in blocks of 64, so parts of whole blocks concatenate as they are. The
token embedding and the LM head take the same weights (``embedding.py``).

The CPU method runs on torch's group-wise int4 matmul (``aten._weight_int4pack_mm_for_cpu``,
``value = (q - 8) * scale + zero`` per group of 32 to 256 columns, 16-row blocks), which has a
vectorized kernel for bf16 inputs only (fp32 inputs were 10-30x slower than the fp32 dense
product, fp16 ones 100x): the activations are rounded to bf16 for the product, the per-group
scales and zeros are held in bf16, and the result, rounded to bf16, comes back in the caller's
dtype. 8-bit groups (Q8_0, Q5_K, Q6_K) are split into their high and low nibbles, two int4 products over the
same groups, summed (at 49152 x 576, 2.0 ms a token on two cores against 4.3 ms for the fp32
dequantized weight). Symmetric groups smaller than the kernel's 32 (Q6_K's 16) become one weight
in groups of 32 per position of a group within 32 columns: each keeps its own columns and zeros
elsewhere (a zero integer is a zero value where there is no offset), so Q6_K takes four int4
products, 2.5 bytes a weight against the dense fp32 weight's 4.

An LM head's quantized weight on the CPU (``head_method``) is held in fp16 instead
(``Fp16CpuMethod``, fbgemm's fp16 GEMM: fp32 activations and outputs, 2 bytes a weight): sampling
reads the logits as they are, and the int4 product's bf16 outputs (a step of 0.125 at a logit of
25) turned the embedded SmolLM2's greedy answer to the README's question; torch's int8 product
(``_weight_int8pack_mm``, per-row scales) rounds to bf16 as well, and with fp32 inputs it is slower
than the fp32 weight. At 49152 x 576 (SmolLM2's tied head) on two cores: 1.8 ms a token in fp16
against 9.5 ms for the fp32 dequantized weight (2.1 ms for the bf16 int8 product), one thread or
two alike; an fp16 weight is within 2^-11 of its Q8_0 value (a 7-bit integer times an fp16 scale).

On the GPU a 4-bit weight is held packed two values a byte with fp16 scales and offsets
(``TritonGroupMethod``, about 4.25 bits a weight at groups of 128; an 8-bit one a value a byte): decode rows (up to
``GEMV_MAX_ROWS``) run the Triton GEMV that streams the packed weight once
(``quant_gemv_triton.int4_gemv_triton``), up to ``DOT_MAX_ROWS`` rows its tensor-core form
(``int4_gemv_dot_triton``); prompt rows dequantize the weight, a block of rows at a
time into a reused buffer, for a cuBLAS product, whose cost a prompt chunk's GEMM amortises.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .fused_linear import decode_linear

INT4_GROUPS = (32, 64, 128, 256)  # group sizes the int4 matmul takes
INT4_ROW_BLOCK = 16  # output rows must come in multiples of this
INT4_PACK_ROWS = 64  # the packed layout interleaves blocks of this many rows (when they are whole)
ACTIVATION_DTYPE = torch.bfloat16  # the dtype its vectorized kernel takes


@dataclass
class GroupQuantized:
    """A 2-D weight ``[out, in]`` as integers in groups of ``group`` input columns:
    ``value = scale * q + offset`` per group (``offset`` None: symmetric, zero).

    ``q`` holds ``0 .. 15`` (``bits`` 4, uint8) or ``-128 .. 127`` (``bits`` 8, int8), one
    element per weight; ``scale`` and ``offset`` are fp32 ``[out, in // group]``. ``kind`` names
    the format it came from (``Q4_1``), for messages.
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    bits: int
    kind: str

    def __post_init__(self) -> None:
        out, cols = self.q.shape
        if self.bits not in (4, 8):
            raise ValueError(f"{self.kind}: {self.bits}-bit groups are not supported (4 or 8)")
        if cols % self.group or tuple(self.scale.shape) != (out, cols // self.group):
            raise ValueError(f"{self.kind}: scales {tuple(self.scale.shape)} do not fit a [{out}, {cols}] "
                             f"weight in groups of {self.group}")
        if self.offset is not None and self.offset.shape != self.scale.shape:
            raise ValueError(f"{self.kind}: offsets {tuple(self.offset.shape)} and scales differ in shape")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight (or its ``rows``), computed as the format defines it."""
        q, scale, offset = self.q, self.scale, self.offset
        if rows is not None:
            q, scale = q[rows], scale[rows]
            offset = None if offset is None else offset[rows]
        n, k = q.shape
        w = q.view(n, k // self.group, self.group).float() * scale[..., None]
        if offset is not None:
            w = w + offset[..., None]
        return w.view(n, k)

    def select_rows(self, order: torch.Tensor) -> "GroupQuantized":
        """The same weight with its output rows taken in ``order`` (a row permutation)."""
        return GroupQuantized(self.q.index_select(0, order), self.scale.index_select(0, order),
                              None if self.offset is None else self.offset.index_select(0, order),
                              self.group, self.bits, self.kind)


class LinearMethod(nn.Module):
    """A weight ``[out_features, in_features]`` in some held form; ``forward(x)`` is
    ``x @ weight.T`` over the last dim of ``x``, in ``x``'s dtype."""

    out_features: int
    in_features: int


def widen_groups(w: GroupQuantized) -> list[GroupQuantized]:
    """``w`` as weights in groups of 32 whose sum is ``w``: itself where its groups are 32 or
    more; for symmetric groups of ``g`` dividing 32, one per position ``i`` of a group within 32
    columns, holding the groups at ``i`` (their integers and scales) and zeros elsewhere."""
    width = INT4_GROUPS[0]
    if w.group >= width:
        return [w]
    if width % w.group or w.offset is not None:
        raise ValueError(f"{w.kind}: groups of {w.group} do not widen to {width} (only symmetric divisors do)")
    ways = width // w.group
    position = torch.arange(w.q.shape[1]) // w.group % ways
    zero = torch.zeros((), dtype=w.q.dtype)
    return [GroupQuantized(torch.where(position == i, w.q, zero), w.scale[:, i::ways].contiguous(), None, width,
                           w.bits, w.kind) for i in range(ways)]


def _int4_parts(w: GroupQuantized) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The packed int4 parts and their scales/zeros of ``w`` (groups the int4 matmul takes)."""
    offset = torch.zeros_like(w.scale) if w.offset is None else w.offset
    if w.bits == 4:
        return [_int4_pack(w.q)], [_scale_zeros(w.scale, offset + 8 * w.scale)]
    q = w.q.to(torch.int32)  # q = 16 * (high - 8) + low, high and low in 0 .. 15
    high, low = (q >> 4) + 8, q & 15
    return [_int4_pack(high), _int4_pack(low)], [_scale_zeros(16 * w.scale, offset), _scale_zeros(w.scale, 8 * w.scale)]


def _int4_pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _scale_zeros(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``[groups, out, 2]`` in the layout the int4 matmul reads."""
    return torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(ACTIVATION_DTYPE)


class Int4CpuMethod(LinearMethod):
    """One or more int4 parts over the same input columns, summed: ``sum_p (q_p - 8) *
    scale_p + zero_p`` per group. A 4-bit weight is one part (``zero = offset + 8 * scale``), an
    8-bit one two (its high nibble at 16x the scale, its low nibble); a symmetric one in groups of
    ``g`` < 32 those of its ``32 / g`` column-masked weights in groups of 32 (``widen_groups``)."""

    def __init__(self, packed: list[torch.Tensor], scale_zeros: list[torch.Tensor], group: int,
                 in_features: int) -> None:
        super().__init__()
        self.group = group
        self.in_features = in_features
        self.out_features = int(packed[0].shape[0])
        self.parts = len(packed)
        self._names = [(f"packed{i}", f"scale_zeros{i}") for i in range(self.parts)]
        for (packed_name, sz_name), p, sz in zip(self._names, packed, scale_zeros):
            self.register_buffer(packed_name, p, persistent=False)
            self.register_buffer(sz_name, sz, persistent=False)

    @classmethod
    def from_groups(cls, w: GroupQuantized) -> "Int4CpuMethod":
        packed, scale_zeros = [], []
        for part in widen_groups(w):
            p, sz = _int4_parts(part)
            packed += p
            scale_zeros += sz
        return cls(packed, scale_zeros, max(w.group, INT4_GROUPS[0]), w.q.shape[1])

    def _part(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed_name, sz_name = self._names[i]
        return self._buffers[packed_name], self._buffers[sz_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (a decode step's rows come 2-D, taken as they are: each call here costs a few
        # microseconds beside a product of tens, and a decoded token makes 120 of them)
        flat = x.dim() == 2
        # the kernel takes contiguous rows only (a Gated DeltaNet prompt's output comes strided)
        x2 = (x if flat else x.reshape(-1, self.in_features)).to(ACTIVATION_DTYPE).contiguous()
        out, buffers = None, self._buffers
        for packed_name, sz_name in self._names:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, buffers[packed_name], self.group,
                                                           buffers[sz_name]).to(x.dtype)
            out = y if out is None else out.add_(y)
        return out if flat else out.view(*x.shape[:-1], self.out_features)


SYMMETRIC_ZERO = 8  # a symmetric 4-bit weight's zero point: values scale * (q - 8)
GEMV_MAX_ROWS = 16  # input rows the scalar GEMV takes (a weight the split GEMV, up to 64 rows, does not)
# rows of a held weight's product on the tensor cores (int4_gemv_dot_triton): a decode batch past
# 16, or rows verifying drafts (4 requests with 4 drafts are 20), which would otherwise dequantize
# the whole weight each step (2 bytes a weight written and read again by cuBLAS, against half a
# byte read at 4 bits); more rows (prompt chunks) dequantize into a buffer for cuBLAS
DOT_MAX_ROWS = 64
DEQUANT_BLOCK_ELEMENTS = 1 << 25  # weight elements dequantized at once (64 MiB in bf16)
DEQUANT_BLOCK_ROWS = 128  # ... in blocks of a multiple of this many weight rows
_dequant_buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def dequant_block_rows(out_features: int, in_features: int) -> int:
    """Weight rows dequantized at once for prompt rows: about ``DEQUANT_BLOCK_ELEMENTS``, a multiple
    of ``DEQUANT_BLOCK_ROWS`` (or the whole weight). Each block's product is a column block of the
    output, and cuBLAS takes an output whose rows are not 16-byte aligned (a block of 6,553 rows)
    only with its slowest kernels (align1: the 27B's 16K prompt ran at a fifth of its rate)."""
    rows = DEQUANT_BLOCK_ELEMENTS // in_features // DEQUANT_BLOCK_ROWS * DEQUANT_BLOCK_ROWS
    return min(out_features, max(rows, DEQUANT_BLOCK_ROWS))


def _dequant_buffer(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """One reused buffer per device and dtype for weights dequantized on the fly."""
    buf = _dequant_buffers.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = _dequant_buffers[(device, dtype)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


class TritonGroupMethod(LinearMethod):
    """A 4-bit or 8-bit weight for the Triton kernels: ``packed`` ``[out, in / 2]`` uint8
    (``pack_int4``) or int8 ``[out, in]``, ``scale`` and ``offset`` (None: symmetric) fp16
    ``[out, in / group]``. A symmetric 4-bit weight (GPTQ's ``sym``, GGUF's Q4_0: every offset
    ``-8 * scale``) holds no offsets: ``zero`` 8, its values ``scale * (q - 8)`` (4.125 bits a
    weight in groups of 128 against 4.25, and a sixteenth fewer bytes to stream)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int,
                 zero: int = 0) -> None:
        super().__init__()
        self.group = group
        self.zero = zero
        self.bits = 8 if packed.dtype == torch.int8 else 4
        self.out_features = int(packed.shape[0])
        self.in_features = int(packed.shape[1]) * (8 // self.bits)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("offset", offset, persistent=False)

    @classmethod
    def from_groups(cls, w: GroupQuantized, device: torch.device) -> "TritonGroupMethod":
        from .quant_gemv_triton import pack_int4

        held = pack_int4(w.q) if w.bits == 4 else w.q.to(torch.int8).contiguous()
        scale, offset = w.scale.to(torch.float16), None if w.offset is None else w.offset.to(torch.float16)
        zero = 0
        if w.bits == 4 and offset is not None and not offset.is_meta and torch.equal(offset, scale * -SYMMETRIC_ZERO):
            offset, zero = None, SYMMETRIC_ZERO  # (-8 s rounds to fp16 as -8 times s rounded: exact)
        return cls(held.to(device), scale.to(device), None if offset is None else offset.to(device), w.group, zero)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .. import launch
        from .quant_gemv_triton import (SPLIT_MAX_ROWS, int4_dequantize_triton, int4_gemv_split_triton,
                                        int4_gemv_triton, split_takes)

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        pow2 = self.group >= 16 and not self.group & (self.group - 1)
        settings = launch.current()
        if x2.shape[0] <= SPLIT_MAX_ROWS and split_takes(self.group, self.bits) \
                and x.dtype in (torch.bfloat16, torch.float16) and settings.int4_split_gemv:
            out = int4_gemv_split_triton(x2, self.packed, self.scale, self.offset, self.group,
                                         settings.int4_split_tiles, zero=self.zero, pack_x=settings.int4_x_pack)
            return out.view(*lead, self.out_features)
        if x2.shape[0] <= GEMV_MAX_ROWS:
            out = int4_gemv_triton(x2, self.packed, self.scale, self.offset, self.group, zero=self.zero)
            return out.view(*lead, self.out_features)
        if x2.shape[0] <= DOT_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16) and pow2:
            from .quant_gemv_triton import int4_gemv_dot_triton

            return int4_gemv_dot_triton(x2, self.packed, self.scale, self.offset, self.group, zero=self.zero).view(
                *lead, self.out_features)
        # prompt rows: the weight dequantized a block of rows at a time into one reused buffer,
        # each block's product written in place as a column block of the output (cuBLAS takes
        # the output's row stride as its leading dimension: no copy, and no second output-sized
        # tensor as joining the blocks after took)
        rows = dequant_block_rows(self.out_features, self.in_features)
        buf = _dequant_buffer(x.device, x.dtype, min(rows, self.out_features) * self.in_features)
        out = torch.empty((x2.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        for r0 in range(0, self.out_features, rows):
            r1 = min(r0 + rows, self.out_features)
            w = int4_dequantize_triton(self.packed[r0:r1], self.scale[r0:r1],
                                       None if self.offset is None else self.offset[r0:r1], self.group,
                                       buf[: (r1 - r0) * self.in_features].view(r1 - r0, self.in_features),
                                       zero=self.zero)
            torch.mm(x2, w.t(), out=out[:, r0:r1])
        return out.view(*lead, self.out_features)


class Fp16CpuMethod(LinearMethod):
    """A weight held in fp16 for fbgemm's fp16 GEMM (``quantized.linear_dynamic_fp16``): the
    activations and the sums in fp32, each fp16 weight widened to fp32 in the kernel; the packed
    weight is fbgemm's own object, not a buffer (``nbytes``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(n) for n in weight.shape)
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)

    @property
    def nbytes(self) -> int:
        """Bytes of the held weight: 2 a weight."""
        return 2 * self.out_features * self.in_features

    def held_weight(self) -> torch.Tensor:
        """The held weight, widened to fp32."""
        return torch.ops.quantized.linear_unpack_fp16(self.packed)[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        out = torch.ops.quantized.linear_dynamic_fp16(x2, self.packed)
        return out.to(x.dtype).view(*lead, self.out_features)


def fp16_cpu_gemm_available() -> bool:
    """Whether this torch build has fbgemm's fp16 GEMM (x86 builds; not ARM's)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and \
        hasattr(torch.ops.quantized, "linear_prepack_fp16")


def head_method(w: GroupQuantized, device: torch.device) -> LinearMethod | None:
    """The method that holds an LM head's quantized weight ``w`` on ``device``; None where it is
    held dense (dequantized). Off the CPU the one a projection takes (``quantized_method``); on the
    CPU ``w`` in fp16 (``Fp16CpuMethod``, fp32 logits), where fbgemm is there and every value of
    ``w`` fits fp16's range."""
    device = torch.device(device)
    if device.type != "cpu":
        return quantized_method(w, device)
    if not fp16_cpu_gemm_available():
        return None
    dense = w.dequantize()
    if not bool(dense.abs().max() <= torch.finfo(torch.float16).max):
        return None
    return Fp16CpuMethod(dense)


def triton_method_fits(w: GroupQuantized) -> bool:
    """Whether the Triton kernels take ``w``: groups of an even size (4-bit or 8-bit values)."""
    return w.group % 2 == 0


def method_fits(w: GroupQuantized, device: torch.device) -> bool:
    """Whether a method holds ``w`` kept quantized on ``device``."""
    return cpu_method_fits(w) if torch.device(device).type == "cpu" else triton_method_fits(w)


def cpu_method_fits(w: GroupQuantized) -> bool:
    """Whether the CPU int4 matmul takes ``w``'s shape and groups (smaller symmetric groups that
    divide its smallest: ``widen_groups``)."""
    widens = w.group < INT4_GROUPS[0] and INT4_GROUPS[0] % w.group == 0 and w.offset is None
    return (w.group in INT4_GROUPS or widens) and w.shape[0] % INT4_ROW_BLOCK == 0


def quantized_method(w: GroupQuantized, device: torch.device) -> LinearMethod:
    """The method that runs ``w`` kept quantized on ``device``; a ValueError where none does."""
    if device.type != "cpu":
        if not triton_method_fits(w):
            raise ValueError(f"{w.kind} weight {tuple(w.shape)}: on {device.type} only weights in groups of an "
                             f"even size are kept quantized (groups of {w.group} are not)")
        return TritonGroupMethod.from_groups(w, device)
    if not cpu_method_fits(w):
        raise ValueError(f"{w.kind} weight {tuple(w.shape)} in groups of {w.group}: the CPU int4 matmul "
                         f"needs groups of {INT4_GROUPS} (or symmetric ones dividing {INT4_GROUPS[0]}) and "
                         f"output rows in multiples of {INT4_ROW_BLOCK}")
    return Int4CpuMethod.from_groups(w)


QUANTIZE_GROUPS = (128, 64, 32)  # columns per group of weights quantized at load: the first that divides
NARROW_COLUMNS = 2048  # requantized int4 weights with fewer input columns take the smallest group (32)


def quantize_rtn(w: torch.Tensor, bits: int, requantized: bool = False) -> GroupQuantized | None:
    """A dense ``[out, in]`` weight quantized by rounding to nearest: ``bits`` 4 asymmetric in
    groups of 128 columns (64 or 32 where 128 does not divide them), ``value = scale * q + min``, q
    in 0..15; ``bits`` 8 symmetric per output row (``value = scale * q``, q in -127..127; the row's
    scale repeated over its groups). None where no group size divides the columns.

    ``requantized``: ``w`` was itself held in 4-bit groups (a GGUF file's, dequantized): then a
    4-bit weight of fewer than ``NARROW_COLUMNS`` input columns (a small model's: SmolLM2's 576
    and 1536) takes groups of 32, a 16-bit scale and minimum a group as held (5 bits a weight
    against 4.25 at 128): on the embedded SmolLM2, whose Q4_1 weights are in groups of 32, groups
    of 64 and 128 cost +52% perplexity (each weight rounded a second time to a coarser grid),
    groups of 32 +0.05% (Q4_1's grid is round to nearest between a group's minimum and maximum,
    which this finds again); a small model's matrices are a small share of the bytes either way.
    A dense checkpoint's narrow matrices (the 35B-A3B's 512-column expert downs, a third of its
    weights) keep groups of 128, the 4.25 bits the launcher plans with."""
    w = w.float()
    out, cols = w.shape
    narrow = requantized and bits == 4 and cols < NARROW_COLUMNS
    groups = QUANTIZE_GROUPS[-1:] if narrow else QUANTIZE_GROUPS
    group = next((g for g in groups if cols % g == 0), 0)
    if group == 0:
        return None
    if bits == 4:
        g = w.view(out, cols // group, group)
        low, high = g.amin(-1), g.amax(-1)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return GroupQuantized(q.view(out, cols), scale, low, group, 4, "int4")
    if bits == 8:
        scale = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return GroupQuantized(q, scale[:, None].expand(out, cols // group).contiguous(), None, group, 8, "int8")
    raise ValueError(f"{bits}-bit weights are not supported (4 or 8)")


QUANTIZE_BLOCK_ELEMENTS = 1 << 26  # quantize_rtn_rows: weights a block of rows takes in fp32 (256 MiB)


def quantize_rtn_rows(w: torch.Tensor, bits: int, device: torch.device, requantized: bool = False
                      ) -> GroupQuantized | None:
    """``quantize_rtn`` of ``w`` (on the CPU, say) on ``device``, a block of rows at a time: the
    groups run along a row, so the blocks' integers, scales and offsets are the whole weight's,
    and ``device`` holds ``w`` only as its integers and one block in fp32 (the 27B's LM head,
    248,320 x 5,120, is 2.4 GiB in bf16 and 4.7 GiB in fp32; under a 16 GiB cap its weights
    leave 2.4 GiB beside it)."""
    out, cols = w.shape
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(cols, 1))
    first = quantize_rtn(w[:step].to(device), bits, requantized)
    if first is None or out <= step:
        return first
    q = torch.empty((out, cols), dtype=first.q.dtype, device=device)
    scale = torch.empty((out, cols // first.group), dtype=first.scale.dtype, device=device)
    offset = None if first.offset is None else torch.empty_like(scale)
    for start in range(0, out, step):
        part = first if start == 0 else quantize_rtn(w[start:start + step].to(device), bits, requantized)
        rows = slice(start, start + part.q.shape[0])
        q[rows], scale[rows] = part.q, part.scale
        if offset is not None:
            offset[rows] = part.offset
        del part
    return GroupQuantized(q, scale, offset, first.group, first.bits, first.kind)


def fuse_methods(methods: list[LinearMethod]) -> LinearMethod | None:
    """One method for projections of the same input, outputs concatenated in order; None where
    their kinds or groups differ, or a part before the last is not whole packed blocks."""
    if all(isinstance(m, TritonGroupMethod) for m in methods):
        return _fuse_triton(methods)
    if not all(isinstance(m, Int4CpuMethod) for m in methods):
        return None
    first = methods[0]
    if any(m.group != first.group or m.parts != first.parts or m.in_features != first.in_features
           for m in methods) or any(m.out_features % INT4_PACK_ROWS for m in methods[:-1]):
        return None
    parts = [[m._part(i) for m in methods] for i in range(first.parts)]
    fused = Int4CpuMethod([torch.cat([p for p, _ in ps]) for ps in parts],
                          [torch.cat([sz for _, sz in ps], dim=1) for ps in parts], first.group, first.in_features)
    start = 0
    for m in methods:  # each part's packed rows become a view of the fused ones, as dense weights do
        for i in range(m.parts):
            setattr(m, f"packed{i}", fused._part(i)[0][start : start + m.out_features])
        start += m.out_features
    return fused


def _fuse_triton(methods: list[TritonGroupMethod]) -> TritonGroupMethod | None:
    first = methods[0]
    if any(m.group != first.group or m.bits != first.bits or m.in_features != first.in_features or
           (m.offset is None) != (first.offset is None) or m.zero != first.zero for m in methods):
        return None
    fused = TritonGroupMethod(torch.cat([m.packed for m in methods]), torch.cat([m.scale for m in methods]),
                             None if first.offset is None else torch.cat([m.offset for m in methods]), first.group,
                             first.zero)
    start = 0
    for m in methods:  # each part's tensors become views of the fused ones, as dense weights do
        end = start + m.out_features
        m.packed, m.scale = fused.packed[start:end], fused.scale[start:end]
        if m.offset is not None:
            m.offset = fused.offset[start:end]
        start = end
    return fused


class Linear(nn.Linear):
    """``nn.Linear`` (Hugging Face names) that may hold its weight quantized (``method``)."""

    method: LinearMethod | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.method = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.method is None:
            return decode_linear(x, self.weight, self.bias)
        out = self.method(x)
        return out if self.bias is None else out + self.bias

    @property
    def quantized(self) -> bool:
        return self.method is not None

    def take_quantized(self, name: str, w: GroupQuantized, device: torch.device | None = None) -> None:
        """Hold ``w`` (checkpoint tensor ``name``, this module's weight) kept quantized on
        ``device`` (default: the weight's): its method replaces the dense parameter."""
        check_shape(name, w, self.weight.shape)
        self.method = quantized_method(w, self.weight.device if device is None else device)
        del self.weight
        self.register_parameter("weight", None)

    def extra_repr(self) -> str:
        kind = "" if self.method is None else f", method={type(self.method).__name__}"
        return super().extra_repr() + kind


def check_shape(name: str, w: GroupQuantized, shape: torch.Size) -> None:
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"shape mismatch for {name!r}: checkpoint {tuple(w.shape)}, model {tuple(shape)}")
