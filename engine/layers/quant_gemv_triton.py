"""Triton GEMV over 4-bit group-quantized weights, for decode rows: ``y = x @ W.T`` with
``W[n, k] = scale[n, k // G] * q[n, k] + offset[n, k // G]``, the weight streamed once, packed.

Decode is memory bound: a 4-bit weight is a quarter of the bytes of a bf16 one. The packed form
(``pack_int4``) holds two values a byte, the even column in the low nibble; scales and offsets
are fp16 ``[N, K / G]`` (GGUF's Q4_0 / Q4_1 / Q4_K, GPTQ and AWQ all come to this: an offset
of ``-scale * zero`` where they keep a zero point). Each program owns ``BLOCK_N`` weight rows,
walks K in ``BLOCK_K`` chunks, unpacks a chunk of bytes into its two nibbles and multiplies them
with every input row (``M`` a compile-time constant, padded to a power of two), so the packed
weight is read from memory once for all rows; accumulation is fp32, the result cast once. The
reference is ``x @ GroupQuantized.dequantize().T`` (``tests/interp``, ``tests/gpu``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_TILES = {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4}


@triton.jit
def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                      G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_OFFSET: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rows_in = tl.minimum(rows, N - 1).to(tl.int64)  # the tail program re-reads the last row
    m = tl.arange(0, M_PAD)
    m_in = tl.minimum(m, M - 1).to(tl.int64)  # padded input rows re-read the last one
    j = tl.arange(0, BLOCK_K // 2)  # byte j of the chunk holds columns 2j and 2j + 1
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K // 2], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        col = k0 + 2 * j
        kmask = col < K
        b = tl.load(q_ptr + rows_in[:, None] * stride_qn + (k0 // 2 + j)[None, :], mask=kmask[None, :], other=0)
        b = b.to(tl.int32)
        lo = (b & 15).to(tl.float32)
        hi = (b >> 4).to(tl.float32)
        g = (col // G)[None, :]  # both nibbles of a byte are in one group (G is even)
        s = tl.load(s_ptr + rows_in[:, None] * stride_sn + g, mask=kmask[None, :], other=0.0).to(tl.float32)
        w_lo = lo * s
        w_hi = hi * s
        if HAS_OFFSET:
            o = tl.load(o_ptr + rows_in[:, None] * stride_sn + g, mask=kmask[None, :], other=0.0).to(tl.float32)
            w_lo += o
            w_hi += o
        x_row = x_ptr + m_in[:, None] * stride_xm
        x_lo = tl.load(x_row + col[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + col[None, :] + 1, mask=(col + 1 < K)[None, :], other=0.0).to(tl.float32)
        acc += w_lo[None, :, :] * x_lo[:, None, :] + w_hi[None, :, :] * x_hi[:, None, :]
    y = tl.sum(acc, 2)
    out = y_ptr + m[:, None].to(tl.int64) * stride_ym + rows[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=(m < M)[:, None] & rmask[None, :])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` ``[N, K]`` of values 0..15 (K even) -> ``[N, K / 2]`` uint8, column ``2j`` in the
    low nibble of byte ``j``, ``2j + 1`` in the high one."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4: q {tuple(q.shape)} must be [N, K] with K even")
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def int4_gemv_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group: int, tiles: dict | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (last dim contiguous), ``packed`` ``[N, K / 2]`` (``pack_int4``), ``scale``
    and ``offset`` ``[N, K / group]`` (offset None: symmetric) -> ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k or group % 2 or k % group or tuple(scale.shape) != (n, k // group):
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
    t["BLOCK_K"] = max(2, min(t["BLOCK_K"], triton.next_power_of_2(k)))
    _int4_gemv_kernel[(triton.cdiv(n, t["BLOCK_N"]),)](
        x, packed, scale, offset if offset is not None else scale, y, m, n, k, x.stride(0), packed.stride(0),
        scale.stride(0), y.stride(0), G=group, M_PAD=triton.next_power_of_2(m), BLOCK_N=t["BLOCK_N"],
        BLOCK_K=t["BLOCK_K"], HAS_OFFSET=offset is not None, num_warps=t["num_warps"])
    return y


@triton.jit
def _int4_mm_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                    stride_ys, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    K_PER_SPLIT: tl.constexpr, HAS_OFFSET: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm_in = tl.minimum(rm, M - 1).to(tl.int64)
    rn_in = tl.minimum(rn, N - 1).to(tl.int64)
    words = tl.arange(0, BLOCK_K // 8)  # int32 word j of a chunk holds columns 8j .. 8j + 7, low nibble first
    shifts = tl.arange(0, 8) * 4
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in tl.range(k_start, k_start + K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptr + rm_in[:, None] * stride_xm + (k0 + kk)[None, :])
        w32 = tl.load(q_ptr + rn_in[:, None] * stride_qn + (k0 // 8 + words)[None, :])
        w = (w32[:, :, None] >> shifts[None, None, :]) & 15
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // G, G)).to(tl.float32)
        g = k0 // G + tl.arange(0, BLOCK_K // G)
        s = tl.load(s_ptr + rn_in[:, None] * stride_sn + g[None, :]).to(tl.float32)
        w = w * s[:, :, None]
        if HAS_OFFSET:
            o = tl.load(o_ptr + rn_in[:, None] * stride_sn + g[None, :]).to(tl.float32)
            w = w + o[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)
        acc += tl.dot(x, tl.trans(w))
    out = y_ptr + split * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


MM_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3}


def int4_mm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                   group: int, tiles: dict | None = None) -> torch.Tensor:
    """``int4_gemv_triton``'s product for any number of rows, on tensor cores: each program
    dequantizes a ``BLOCK_N x BLOCK_K`` tile of the packed weight (read as int32 words, eight
    values each) and multiplies it with ``BLOCK_M`` input rows; ``SPLIT_K`` > 1 splits K over
    programs (fp32 partial sums, added after) so that a few decode rows still fill the GPU. K must
    be a multiple of ``BLOCK_K * SPLIT_K`` and ``BLOCK_K`` of the group."""
    m, k = x.shape
    n = packed.shape[0]
    t = dict(MM_TILES, **(tiles or {}))
    bk, split = t["BLOCK_K"], t["SPLIT_K"]
    if packed.shape[1] * 2 != k or bk % group or k % (bk * split) or tuple(scale.shape) != (n, k // group):
        raise ValueError(f"int4 mm: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scales {tuple(scale.shape)} "
                         f"in groups of {group} do not fit BLOCK_K {bk} x SPLIT_K {split}")
    if x.stride(1) != 1 or not packed.is_contiguous() or not scale.is_contiguous():
        raise ValueError("int4 mm: x needs a contiguous last dim, packed and scales must be contiguous")
    words = packed.view(torch.int32)
    y = torch.empty((split, m, n) if split > 1 else (m, n), dtype=torch.float32 if split > 1 else x.dtype,
                    device=x.device)
    if m == 0 or n == 0:
        return y if split == 1 else y.sum(0).to(x.dtype)
    grid = (triton.cdiv(n, t["BLOCK_N"]), triton.cdiv(m, t["BLOCK_M"]), split)
    _int4_mm_kernel[grid](x, words, scale, offset if offset is not None else scale, y, m, n, k, x.stride(0),
                          words.stride(0), scale.stride(0), y.stride(-2), y.stride(0) if split > 1 else 0,
                          G=group, BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], BLOCK_K=bk, K_PER_SPLIT=k // split,
                          HAS_OFFSET=offset is not None, num_warps=t["num_warps"], num_stages=t["num_stages"])
    return y if split == 1 else y.sum(0).to(x.dtype)
