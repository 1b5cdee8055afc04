"""Triton GEMV over 4-bit (and 8-bit) group-quantized weights, for decode rows: ``y = x @ W.T`` with
``W[n, k] = scale[n, k // G] * q[n, k] + offset[n, k // G]``, the weight streamed once, packed.

Decode is memory bound: a 4-bit weight is a quarter of the bytes of a bf16 one. The packed form
(``pack_int4``) holds two values a byte, the even column in the low nibble; scales and offsets
are fp16 ``[N, K / G]`` (GGUF's Q4_0 / Q4_1 / Q4_K, GPTQ and AWQ all come to this: an offset
of ``-scale * zero`` where they keep a zero point; GGUF's Q8_0, Q5_K and Q6_K to 8-bit groups). Each program owns ``BLOCK_N`` weight rows,
walks K in ``BLOCK_K`` chunks (a divisor of the group: one scale per row per chunk; for groups
under 32 columns, as GGUF Q6_K's 16, a multiple of the group that divides K, with a scale per
column pair: ``chunk_columns``), unpacks a
chunk of bytes into its two nibbles and multiplies them with the even and odd columns of every
input row (loaded as one vector and split) (``M`` a compile-time constant, padded to a power of two), so the packed
weight is read from memory once for all rows; accumulation is fp32, the result cast once. The
reference is ``x @ GroupQuantized.dequantize().T`` (``tests/interp``, ``tests/gpu``). An 8-bit
weight (int8 ``[N, K]``, one value a byte) takes the same kernels, its bytes split into even and
odd columns as the input's are.

``int4_gemv_dot_triton`` is the same product on the tensor cores: each nibble becomes the 16-bit
float ``BASE + q`` by its bits (no conversion instruction), the chunk's product is ``tl.dot`` over
the rows padded to 16, and ``BASE * sum(x)`` comes off with the scales once per row and chunk;
``python -m bench.gemv_tune --int4`` times it beside the GEMV above and torch's tinygemm.

Prompt rows are compute bound: ``int4_dequantize_triton`` writes the weight (or a block of its
rows) out in the activation dtype for a cuBLAS product, a pass over memory that a prompt chunk's
GEMM amortises.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_switch import INTERPRET

DEFAULT_TILES = {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4}
_PORTABLE = tl.constexpr(INTERPRET)  # no inline assembly in the kernels (the interpreter runs none)


@triton.jit
def _exact_float(q, bias: tl.constexpr, zero: tl.constexpr):
    """Integers ``q - zero`` (``q + bias`` in 0 .. 2^23) as fp32 without a conversion instruction:
    their bits under the exponent of 2^23, then 2^23 (and ``bias`` and ``zero``) subtracted, both
    exact. The conversion
    (I2F) runs at a quarter of the FMA rate on the GPUs this serves, and a GEMV over 4-bit
    weights is bound by the instructions per byte, not by memory."""
    return ((q + bias) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias + zero)


@triton.jit
def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                      G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_OFFSET: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr):
    # BLOCK_K divides the group G (one scale and offset per weight row per chunk: the chunk's
    # integer dot products scaled once, ``s * sum(x q) + o * sum(x)``), or is a multiple of it
    # dividing K (one per column pair, G even: the weights scaled one by one)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows_in = tl.minimum(rows, N - 1).to(tl.int64)  # the tail program re-reads the last row
    m = tl.arange(0, M_PAD)
    m_in = tl.minimum(m, M - 1).to(tl.int64)  # padded input rows re-read the last one
    j = tl.arange(0, BLOCK_K // 2)  # byte j of the chunk holds columns 2j and 2j + 1
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K // 2], tl.float32)  # column pairs (BLOCK_K > G)
    acc_rows = tl.zeros([M_PAD, BLOCK_N], tl.float32)  # whole chunks, scaled (BLOCK_K <= G)
    for k0 in tl.range(0, K, BLOCK_K):
        if BITS == 4:
            b = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 // 2 + j)[None, :]).to(tl.int32)
            q_lo = _exact_float(b & 15, 0, ZERO)
            q_hi = _exact_float(b >> 4, 0, ZERO)
        else:  # one int8 a byte: the even and odd columns split as the input's are
            b = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 + kk)[None, :]).to(tl.int32)
            q_lo, q_hi = tl.split(tl.reshape(_exact_float(b, 128, 0), (BLOCK_N, BLOCK_K // 2, 2)))
        x = tl.load(x_ptr + m_in[:, None] * stride_xm + (k0 + kk)[None, :]).to(tl.float32)
        x_lo, x_hi = tl.split(tl.reshape(x, (M_PAD, BLOCK_K // 2, 2)))
        if BLOCK_K > G:
            sg = rows_in[:, None] * stride_sn + ((k0 + 2 * j) // G)[None, :]
            s = tl.load(s_ptr + sg).to(tl.float32)
            w_lo = q_lo * s
            w_hi = q_hi * s
            if HAS_OFFSET:
                o = tl.load(o_ptr + sg).to(tl.float32)
                w_lo += o
                w_hi += o
            acc += w_lo[None, :, :] * x_lo[:, None, :] + w_hi[None, :, :] * x_hi[:, None, :]
        else:
            sg = rows_in * stride_sn + k0 // G
            dots = tl.sum(q_lo[None, :, :] * x_lo[:, None, :] + q_hi[None, :, :] * x_hi[:, None, :], 2)
            acc_rows += dots * tl.load(s_ptr + sg).to(tl.float32)[None, :]
            if HAS_OFFSET:
                acc_rows += tl.sum(x, 1)[:, None] * tl.load(o_ptr + sg).to(tl.float32)[None, :]
    if BLOCK_K > G:
        y = tl.sum(acc, 2)
    else:
        y = acc_rows
    out = y_ptr + m[:, None].to(tl.int64) * stride_ym + rows[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=(m < M)[:, None] & rmask[None, :])


@triton.jit
def _int4_gemv_dot_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                          G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_OFFSET: tl.constexpr, BASE_BITS: tl.constexpr, BASE: tl.constexpr,
                          DOT_FP32: tl.constexpr, BITS: tl.constexpr):
    # The products on the tensor cores: each nibble becomes the 16-bit float BASE + q by its bits
    # alone (BASE's exponent, q in the low mantissa bits: ``BASE_BITS | q``, exact), the chunk's
    # [M_PAD, BLOCK_K] x [BLOCK_K, BLOCK_N] product is tl.dot's, and BASE * sum(x) comes off with
    # the group's scale and offset once per row and chunk (BLOCK_K divides G):
    # sum(x (s q + o)) = s * (dot - BASE sum(x)) + o sum(x)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows_in = tl.minimum(rows, N - 1).to(tl.int64)
    m = tl.arange(0, M_PAD)
    mmask = m < M
    j = tl.arange(0, BLOCK_K // 2)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + (k0 + kk)[None, :], mask=mmask[:, None], other=0.0)
        if BITS == 4:
            b = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 // 2 + j)[None, :]).to(tl.int16)
            lo = ((b & 15) | BASE_BITS).to(x.dtype, bitcast=True)
            hi = ((b >> 4) | BASE_BITS).to(x.dtype, bitcast=True)
            w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # BASE + q, columns in order
        else:  # one int8 a byte, -128..127: exact in bf16 and fp16, converted (BASE 0)
            w = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 + kk)[None, :])
            w = w.to(tl.float32) if DOT_FP32 else w.to(x.dtype)  # (the interpreter's int8 -> bf16 is not exact)
        if DOT_FP32:  # Triton's CPU interpreter multiplies bf16 operands' raw bits in tl.dot
            r = tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32))
        else:
            r = tl.dot(x, tl.trans(w))
        xs = tl.sum(x.to(tl.float32), 1)
        sg = rows_in * stride_sn + k0 // G
        s = tl.load(s_ptr + sg).to(tl.float32)
        acc += r * s[None, :] - (BASE * xs)[:, None] * s[None, :]
        if HAS_OFFSET:
            acc += xs[:, None] * tl.load(o_ptr + sg).to(tl.float32)[None, :]
    out = y_ptr + m[:, None].to(tl.int64) * stride_ym + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & rmask[None, :])


DOT_TILES = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}
# 16-bit floats BASE + q (q in 0..15) by their bits: the exponent of BASE over q in the low mantissa bits
_DOT_BASES = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


def int4_gemv_dot_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                         group: int, tiles: dict | None = None, zero: int = 0) -> torch.Tensor:
    """``int4_gemv_triton`` with the products on the tensor cores (``tl.dot`` over the rows padded
    to 16): ``x`` ``[M, K]`` bf16 or fp16 (M <= 64), ``packed`` ``[N, K / 2]`` (``pack_int4``) or
    int8 ``[N, K]``, ``scale``/``offset`` ``[N, K / group]``, groups of a power of two >= 16."""
    m, k = x.shape
    n = packed.shape[0]
    bits_w = 8 if packed.dtype == torch.int8 else 4
    if x.dtype not in _DOT_BASES or packed.dtype not in (torch.uint8, torch.int8) or \
            packed.shape[1] * (8 // bits_w) != k or m > 64 or \
            group < 16 or group & (group - 1) or k % group or tuple(scale.shape) != (n, k // group):
        raise ValueError(f"int4 gemv (dot): x {tuple(x.shape)} {x.dtype}, packed {tuple(packed.shape)} "
                         f"{packed.dtype}, scales {tuple(scale.shape)} in groups of {group} do not fit")
    if k > 1 and x.stride(1) != 1 or not (packed.is_contiguous() and scale.is_contiguous()) or \
            offset is not None and not offset.is_contiguous():
        raise ValueError("int4 gemv (dot): x needs a contiguous last dim, packed, scales and offsets must be contiguous")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    t = dict(DOT_TILES, **(tiles or {}))
    bits, base = _DOT_BASES[x.dtype] if bits_w == 4 else (0, 0.0)
    base += _zero(zero, offset, bits_w)  # symmetric: BASE + q - zero comes off as BASE + zero does
    _int4_gemv_dot_kernel[(triton.cdiv(n, t["BLOCK_N"]),)](
        x, packed, scale, offset if offset is not None else scale, y, m, n, k, x.stride(0), packed.stride(0),
        scale.stride(0), y.stride(0), G=group, M_PAD=max(16, triton.next_power_of_2(m)), BLOCK_N=t["BLOCK_N"],
        BLOCK_K=min(t["BLOCK_K"], group), HAS_OFFSET=offset is not None, BASE_BITS=bits, BASE=base,
        DOT_FP32=INTERPRET and x.dtype == torch.bfloat16, BITS=bits_w, num_warps=t["num_warps"])
    return y


@triton.jit
def _split_finish(acc, y_ptr, p_ptr, count_ptr, rows, rmask, m, mmask, N, SPLITS, stride_ym, stride_ps,
                  SPLIT: tl.constexpr):
    """``acc`` ``[M_PAD, BLOCK_N]`` (this program's fp32 sums) into y: with one split written as it
    is; else left in this split's plane of ``p``, and the last of the row block's programs to
    arrive (an arrival counter per row block, put back to 0 after) adds every plane into y."""
    pid = tl.program_id(0)
    omask = mmask[:, None] & rmask[None, :]
    out = y_ptr + m[:, None].to(tl.int64) * stride_ym + rows[None, :]
    if SPLIT:
        plane = p_ptr + m[:, None].to(tl.int64) * N + rows[None, :]
        tl.store(plane + tl.program_id(1).to(tl.int64) * stride_ps, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial sums stored before the release below
        arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:  # the row block's last program: every split's sums are in
            total = tl.zeros(acc.shape, tl.float32)
            for sp in tl.range(0, SPLITS):
                # .cg: read from L2, where the other programs' stores landed, never a stale L1 line
                total += tl.load(plane + sp * stride_ps, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(count_ptr + pid, 0)  # ready for the next launch (next layer, graph replay)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _nibble_floats(b, dtype: tl.constexpr, BASE_BITS: tl.constexpr):
    """The low and high nibbles of bytes ``b`` as the 16-bit floats ``BASE + q`` (``BASE_BITS``
    the float's bits of BASE, whose last unit is 1): on the GPU four bytes at a time in one
    register, a byte permute and a masked OR per two values (PTX ``prmt`` / ``lop3``), where
    the compiler's byte-by-byte extraction took three; under the CPU interpreter, which runs no
    assembly, by integer ops."""
    if _PORTABLE:
        w = b.to(tl.int16)
        lo = ((w & 15) | BASE_BITS).to(dtype, bitcast=True)
        hi = ((w >> 4) | BASE_BITS).to(dtype, bitcast=True)
    else:
        bits = tl.full(b.shape, BASE_BITS * 65537, tl.int32)  # BASE's bits in both halves of a word
        lo, hi = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 t<2>;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            lop3.b32 $0, t0, 0x000F000F, $5, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, $5, 0xEA;
            shr.b32 t0, t0, 4;
            shr.b32 t1, t1, 4;
            lop3.b32 $2, t0, 0x000F000F, $5, 0xEA;
            lop3.b32 $3, t1, 0x000F000F, $5, 0xEA;
            }
            """, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[b, bits], dtype=(tl.int16, tl.int16), is_pure=True,
            pack=4)
        lo, hi = lo.to(dtype, bitcast=True), hi.to(dtype, bitcast=True)
    return lo, hi


@triton.jit
def _int4_gemv_split_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, p_ptr, count_ptr, xe_ptr, xo_ptr, xs_ptr, M, N, K,
                            STEPS, SPLITS, stride_xm, stride_qn, stride_sn, stride_ym, stride_ps, G: tl.constexpr,
                            M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            HAS_OFFSET: tl.constexpr, BASE_BITS: tl.constexpr, BASE: tl.constexpr,
                            DOT_FP32: tl.constexpr, SPLIT: tl.constexpr, BITS: tl.constexpr, ONE_ROW: tl.constexpr,
                            PACKED_X: tl.constexpr):
    # A few rows (decode, verify) against a 4-bit (or 8-bit) weight on the tensor cores, the K columns split over
    # ``program_id(1)`` (STEPS chunks each, SPLITS splits) so a narrow weight still fills the GPU:
    # each program leaves its partial sums in its own fp32 plane of p, and the last of a row
    # block's programs to arrive (an arrival counter per row block, put back to 0 after) adds
    # them into y; with one split (SPLIT false) the program writes y itself. The nibbles
    # become BASE + q by their bits (no interleave: the even columns' products and the odd ones'
    # are two dots against x's even and odd columns), BASE * sum(x) taken off per chunk with the
    # scale (BLOCK_K divides G): sum(x (s q + o)) = s * (dot - BASE sum(x)) + o sum(x). 8-bit
    # values (-128..127, a byte each) are converted as they are, exact in bf16 and fp16 (BASE 0).
    # ONE_ROW: one input row (decode at batch 1): the sums of x from that row alone, not the 16 the
    # dot pads to. PACKED_X (with ONE_ROW): that row prepared once by ``_x_pack_kernel``, its even
    # and odd columns each the first row of a 16-row tile whose other rows are zeros (xe, xo
    # ``[16, K / 2]``) and its sums a chunk (xs): the loop loads x's tiles as it loads the weight's,
    # with no rows of zeros staged through shared memory and no sums across threads each chunk.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows_in = tl.minimum(rows, N - 1).to(tl.int64)
    m = tl.arange(0, M_PAD)
    mmask = m < M
    j = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    k_begin = split * STEPS * BLOCK_K
    k_end = tl.minimum(K, k_begin + STEPS * BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    for k0 in tl.range(k_begin, k_end, BLOCK_K):
        if BITS == 4:
            if PACKED_X:
                xe = tl.load(xe_ptr + m[:, None] * (K // 2) + (k0 // 2 + j)[None, :])
                xo = tl.load(xo_ptr + m[:, None] * (K // 2) + (k0 // 2 + j)[None, :])
            elif ONE_ROW:  # the one row's chunk loaded once, contiguous; the dot's padding rows zeros, not loads
                xv = tl.load(x_ptr + k0 + kk)
                xe1, xo1 = tl.split(tl.reshape(xv, (BLOCK_K // 2, 2)))
                xe = tl.where(m[:, None] == 0, xe1[None, :], 0.0).to(xv.dtype)
                xo = tl.where(m[:, None] == 0, xo1[None, :], 0.0).to(xv.dtype)
            else:
                xv = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + (k0 + kk)[None, :], mask=mmask[:, None],
                             other=0.0)
                xe, xo = tl.split(tl.reshape(xv, (M_PAD, BLOCK_K // 2, 2)))
            b = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 // 2 + j)[None, :])
            lo, hi = _nibble_floats(b, xe.dtype, BASE_BITS)
            if DOT_FP32:  # Triton's CPU interpreter multiplies bf16 operands' raw bits in tl.dot
                r = tl.dot(xe.to(tl.float32), tl.trans(lo).to(tl.float32)) + \
                    tl.dot(xo.to(tl.float32), tl.trans(hi).to(tl.float32))
            else:
                r = tl.dot(xe, tl.trans(lo)) + tl.dot(xo, tl.trans(hi))
            if PACKED_X:
                xs = tl.where(m == 0, tl.load(xs_ptr + k0 // BLOCK_K), 0.0)
            elif ONE_ROW:  # the sum of the one real row (the other 15 of the dot's are zeros)
                xs = tl.where(m == 0, tl.sum(xv.to(tl.float32), 0), 0.0)
            else:
                xs = tl.sum(xv.to(tl.float32), 1)
        else:
            x = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + (k0 + kk)[None, :], mask=mmask[:, None],
                        other=0.0)
            w = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 + kk)[None, :])
            if DOT_FP32:  # (and the interpreter's int8 -> bf16 is not exact)
                r = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
            else:
                r = tl.dot(x, tl.trans(w.to(x.dtype)))
            xs = tl.sum(x.to(tl.float32), 1)
        sg = rows_in * stride_sn + k0 // G
        sc = tl.load(s_ptr + sg).to(tl.float32)
        acc += (r - (BASE * xs)[:, None]) * sc[None, :]
        if HAS_OFFSET:
            acc += xs[:, None] * tl.load(o_ptr + sg).to(tl.float32)[None, :]
    _split_finish(acc, y_ptr, p_ptr, count_ptr, rows, rmask, m, mmask, N, SPLITS, stride_ym, stride_ps, SPLIT)


SPLIT_TILES = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4}  # the server's: launch setting ``int4_split_tiles``
SPLIT_MAX_ROWS = 64  # input rows the split GEMV takes (padded to a power of two from 16 for the tensor cores)
SPLIT_PROGRAMS_PER_SM = 4  # K is split until the programs number about this many per SM
_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def split_count(n: int, k: int, block_n: int, block_k: int, device: torch.device,
                per_sm: int = SPLIT_PROGRAMS_PER_SM) -> int:
    """K splits of the split GEMV: enough programs for ``per_sm`` a multiprocessor, at most one
    chunk of ``block_k`` columns a split."""
    programs = triton.cdiv(n, block_n)
    want = per_sm * _sms(device)
    return max(1, min(k // block_k, triton.cdiv(want, programs)))


def _split_plan(x: torch.Tensor, n: int, k: int, block_n: int, block_k: int, split: int | None,
                per_sm: int = SPLIT_PROGRAMS_PER_SM):
    """What a launch of a split GEMV over ``[M, K] @ [N, K]^T`` takes: ``(y, row blocks, chunks a
    split, splits, the fp32 partial-sum planes (y itself with one split), the arrival counters)``;
    ``split`` of None: ``split_count``'s. Inside a CUDA-graph capture before any counters exist,
    one split."""
    m = x.shape[0]
    steps_all = k // block_k
    split = split or split_count(n, k, block_n, block_k, x.device, per_sm)
    steps = triton.cdiv(steps_all, min(split, steps_all))
    split = triton.cdiv(steps_all, steps)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n, block_n)
    counts = _arrival_counts(x.device, blocks) if split > 1 else None
    if split > 1 and counts is None:  # no counters yet, inside a capture: one split
        split, steps = 1, steps_all
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    return y, blocks, steps, split, partial, counts


def int4_gemv_split_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                           group: int, tiles: dict | None = None, zero: int = 0, pack_x: bool = False) -> torch.Tensor:
    """``int4_gemv_triton`` for a few rows (``SPLIT_MAX_ROWS``) of bf16 / fp16 ``x`` against a
    4-bit ``packed`` ``[N, K / 2]`` weight (or an 8-bit ``[N, K]`` one) in groups it takes
    (``split_takes``), on the tensor cores
    with K split over programs (tiles: ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, and ``SPLIT``, by
    default ``split_count``); the splits' fp32 partial sums are added by the last program of each
    row block to finish, in the same launch. ``pack_x``: one row of x against a 4-bit weight
    prepared first by ``_x_pack_kernel`` (its dot tiles and chunk sums, in buffers kept per
    device, dtype and width; where they do not exist yet inside a CUDA-graph capture, x as it is)."""
    m, k = x.shape
    n = packed.shape[0]
    bits_w = 8 if packed.dtype == torch.int8 else 4
    if not split_takes(group, bits_w) or x.dtype not in _DOT_BASES or packed.dtype not in (torch.uint8, torch.int8) \
            or packed.shape[1] * (8 // bits_w) != k or m > SPLIT_MAX_ROWS or k % group \
            or tuple(scale.shape) != (n, k // group):
        raise ValueError(f"int4 gemv (split): x {tuple(x.shape)} {x.dtype}, packed {tuple(packed.shape)} "
                         f"{packed.dtype}, scales {tuple(scale.shape)} in groups of {group} do not fit")
    if k > 1 and x.stride(1) != 1 or not (packed.is_contiguous() and scale.is_contiguous()) or \
            offset is not None and not offset.is_contiguous():
        raise ValueError("int4 gemv (split): x needs a contiguous last dim, packed, scales and offsets must be "
                         "contiguous")
    t = dict(SPLIT_TILES, **(tiles or {}))
    block_k = min(t["BLOCK_K"], group & -group)  # a power of two dividing the group
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    y, blocks, steps, split, partial, counts = _split_plan(x, n, k, t["BLOCK_N"], block_k, t.get("SPLIT"),
                                                           t.get("PER_SM", SPLIT_PROGRAMS_PER_SM))
    bits, base = _DOT_BASES[x.dtype] if bits_w == 4 else (0, 0.0)
    base += _zero(zero, offset, bits_w)
    xp = x_pack(x, block_k) if pack_x and m == 1 and bits_w == 4 else None
    _int4_gemv_split_kernel[(blocks, split)](
        x, packed, scale, offset if offset is not None else scale, y, partial, counts if counts is not None else y,
        *(xp if xp is not None else (x, x, y)),
        m, n, k, steps, split, x.stride(0), packed.stride(0), scale.stride(0), y.stride(0), partial.stride(0),
        G=group, M_PAD=max(16, triton.next_power_of_2(m)), BLOCK_N=t["BLOCK_N"], BLOCK_K=block_k,
        HAS_OFFSET=offset is not None, BASE_BITS=bits,
        BASE=base, DOT_FP32=INTERPRET and (x.dtype == torch.bfloat16 or bits_w == 8), SPLIT=split > 1, BITS=bits_w,
        ONE_ROW=m == 1, PACKED_X=xp is not None, num_warps=t["num_warps"],
        **({"num_stages": t["num_stages"]} if "num_stages" in t else {}))
    return y


@triton.jit
def _x_pack_kernel(x_ptr, xe_ptr, xo_ptr, xs_ptr, K, CHUNK: tl.constexpr):
    # one chunk of x's one row a program: its even and odd columns into the first rows of xe and
    # xo (their other rows stay zeros), its fp32 sum into xs
    c = tl.program_id(0)
    j = tl.arange(0, CHUNK // 2)
    x = tl.load(x_ptr + c * CHUNK + tl.arange(0, CHUNK))
    even, odd = tl.split(tl.reshape(x, (CHUNK // 2, 2)))
    tl.store(xe_ptr + c * (CHUNK // 2) + j, even)
    tl.store(xo_ptr + c * (CHUNK // 2) + j, odd)
    tl.store(xs_ptr + c, tl.sum(x.to(tl.float32), 0))


_X_PACKS: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def x_pack(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One row of ``x`` ``[1, K]`` prepared for the split GEMV: ``(xe, xo, xs)``, its even and odd
    columns as the first rows of ``[16, K / 2]`` tiles of zeros and its fp32 sums a ``chunk`` of
    columns. The buffers are kept per device, dtype, width and chunk (the zero rows are written
    once, when they are made) and made outside a CUDA-graph capture only: None inside one until
    they exist (the caller then passes x as it is)."""
    k = x.shape[1]
    key = (x.device, x.dtype, k, chunk)
    bufs = _X_PACKS.get(key)
    if bufs is None:
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        bufs = _X_PACKS[key] = (torch.zeros(16, k // 2, dtype=x.dtype, device=x.device),
                                torch.zeros(16, k // 2, dtype=x.dtype, device=x.device),
                                torch.zeros(k // chunk, dtype=torch.float32, device=x.device))
    xe, xo, xs = bufs
    _x_pack_kernel[(k // chunk,)](x, xe, xo, xs, k, CHUNK=chunk)
    return bufs


def split_takes(group: int, bits: int) -> bool:
    """Whether the split GEMV takes a weight in groups of ``group`` columns: 4-bit ones in groups
    of a power of two from 32, 8-bit ones (one scale a row, or groups) in groups of a multiple of 32."""
    return group >= 32 and (not group & (group - 1) if bits == 4 else group % 32 == 0)


_COUNTS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # counters a larger set replaced: a captured graph may still use them


def _arrival_counts(device: torch.device, n: int) -> torch.Tensor | None:
    """The split GEMV's arrival counters (int32 zeros, put back to zero by the kernel that used
    them), ``n`` of them, shared by every launch on ``device`` (one stream's launches run one
    after another); made outside a CUDA-graph capture only (None inside one, until they exist)."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if counts is not None:
            _OUTGROWN.append(counts)
        counts = _COUNTS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return counts


ONE_GROUP_CHUNKS = 32  # groups of at least this many columns run one group (or part of one) a chunk


def chunk_columns(block_k: int, group: int, k: int) -> int:
    """The columns a chunk takes: ``block_k`` (a power of two), capped at the group for groups of
    ``ONE_GROUP_CHUNKS`` columns or more (a chunk within one group, one scale a row); smaller groups
    (Q6_K's 16, whose one-group chunks would be 8 bytes a row) take ``block_k`` halved until it
    divides ``k``, not below the group (a chunk of whole groups, none past the end)."""
    if group >= min(block_k, ONE_GROUP_CHUNKS):
        return min(block_k, group)
    while block_k > group and k % block_k:
        block_k //= 2
    return max(block_k, group)


def _zero(zero: int, offset: torch.Tensor | None, bits: int) -> int:
    """A constant zero point, checked: for 4-bit weights without offsets only."""
    if zero and (offset is not None or bits != 4 or not 0 < zero < 16):
        raise ValueError(f"a constant zero point ({zero}) is for 4-bit weights without offsets")
    return zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[N, K]`` of values 0..15 (K even) -> ``[N, K / 2]`` uint8, column ``2j`` in the
    low nibble of byte ``j``, ``2j + 1`` in the high one."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4: q {tuple(q.shape)} must be [N, K] with K even")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def int4_gemv_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group: int, tiles: dict | None = None, zero: int = 0) -> torch.Tensor:
    """``x`` ``[M, K]`` (last dim contiguous), ``packed`` ``[N, K / 2]`` (``pack_int4``; or int8
    ``[N, K]``, one value a byte), ``scale`` and ``offset`` ``[N, K / group]`` (offset None: none,
    or ``zero``, every group's zero point: 8 for symmetric 4-bit weights, ``scale * (q - 8)``)
    -> ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n = packed.shape[0]
    bits = 8 if packed.dtype == torch.int8 else 4
    if packed.shape[1] * (8 // bits) != k or group % 2 or k % group or tuple(scale.shape) != (n, k // group):
        raise ValueError(f"int4 gemv: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scales "
                         f"{tuple(scale.shape)} in groups of {group} do not fit")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"int4 gemv: offsets {tuple(offset.shape)} and scales {tuple(scale.shape)} differ")
    if k > 1 and x.stride(1) != 1 or not (packed.is_contiguous() and scale.is_contiguous()) or \
            offset is not None and not offset.is_contiguous():
        raise ValueError("int4 gemv: x needs a contiguous last dim, packed, scales and offsets must be contiguous")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    t = dict(DEFAULT_TILES, **(tiles or {}))
    t["BLOCK_K"] = chunk_columns(t["BLOCK_K"], group, k)
    if group % t["BLOCK_K"] and (t["BLOCK_K"] % group or k % t["BLOCK_K"]):
        raise ValueError(f"int4 gemv: BLOCK_K {t['BLOCK_K']} neither divides the group of {group} nor is a "
                         f"multiple of it dividing K {k}")
    _int4_gemv_kernel[(triton.cdiv(n, t["BLOCK_N"]),)](
        x, packed, scale, offset if offset is not None else scale, y, m, n, k, x.stride(0), packed.stride(0),
        scale.stride(0), y.stride(0), G=group, M_PAD=triton.next_power_of_2(m), BLOCK_N=t["BLOCK_N"],
        BLOCK_K=t["BLOCK_K"], HAS_OFFSET=offset is not None, BITS=bits, ZERO=_zero(zero, offset, bits),
        num_warps=t["num_warps"])
    return y


@triton.jit
def _int4_dequant_kernel(q_ptr, s_ptr, o_ptr, w_ptr, N, K, stride_qn, stride_sn, stride_wn, G: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_OFFSET: tl.constexpr,
                         BITS: tl.constexpr, ZERO: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    rmask = rows < N
    rows_in = tl.minimum(rows, N - 1).to(tl.int64)
    kk = k0 + tl.arange(0, BLOCK_K)
    if BLOCK_K > G:  # chunks of several groups: a scale per column
        sg = rows_in[:, None] * stride_sn + (kk // G)[None, :]
    else:
        sg = rows_in[:, None] * stride_sn + k0 // G
    s = tl.load(s_ptr + sg).to(tl.float32)
    if BITS == 4:
        j = tl.arange(0, BLOCK_K // 2)
        b = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 // 2 + j)[None, :]).to(tl.int32)
        w = tl.reshape(tl.join(((b & 15) - ZERO).to(tl.float32), ((b >> 4) - ZERO).to(tl.float32)),
                       (BLOCK_N, BLOCK_K))
    else:
        w = tl.load(q_ptr + rows_in[:, None] * stride_qn + kk[None, :]).to(tl.float32)
    w = w * s
    if HAS_OFFSET:
        w += tl.load(o_ptr + sg).to(tl.float32)
    tl.store(w_ptr + rows_in[:, None] * stride_wn + kk[None, :], w.to(w_ptr.dtype.element_ty),
             mask=rmask[:, None])


def int4_dequantize_triton(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, group: int,
                           out: torch.Tensor, zero: int = 0) -> torch.Tensor:
    """``out`` ``[N, K]`` (its dtype, e.g. bf16; rows may be strided) = the weight ``packed``
    ``[N, K / 2]`` (or int8 ``[N, K]``) holds, ``scale``/``offset`` ``[N, K / group]``."""
    n, k = out.shape
    bits = 8 if packed.dtype == torch.int8 else 4
    if packed.shape != (n, k * bits // 8) or tuple(scale.shape) != (n, k // group) or group % 2 or k % group:
        raise ValueError(f"int4 dequantize: packed {tuple(packed.shape)}, scales {tuple(scale.shape)} in groups of "
                         f"{group} do not make {tuple(out.shape)}")
    if n == 0:
        return out
    bk = chunk_columns(128, group, k)
    _int4_dequant_kernel[(triton.cdiv(n, 16), k // bk)](
        packed, scale, offset if offset is not None else scale, out, n, k, packed.stride(0), scale.stride(0),
        out.stride(0), G=group, BLOCK_N=16, BLOCK_K=bk, HAS_OFFSET=offset is not None, BITS=bits,
        ZERO=_zero(zero, offset, bits), num_warps=4)
    return out
