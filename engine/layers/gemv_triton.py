"""Triton GEMV for decode: ``y = x @ weight.T (+ bias)`` for a few input rows, in ONE launch.

A decode step's linear layers are memory bound: each streams its bf16 weight once for 1..8 token
rows. cuBLAS (``F.linear``) picks split-K for some of these shapes, adding a reduce kernel (and
sometimes a memset) and reaching well under copy bandwidth. Here each program owns ``BLOCK_N``
weight rows, walks K in ``BLOCK_K`` chunks, loads each weight chunk once and multiplies it with
every input row (``M`` is a compile-time constant, padded to a power of two), so the weight is read
from memory once for all rows and no partial sums leave the program: no split-K, no reduce kernel,
no memset, no host sync (safe inside CUDA-graph capture).

Accumulation is fp32; the bias (if any) is added in fp32 and the result cast once, like
``torch.nn.functional.linear``, which is the reference (``tests/interp``, ``tests/gpu``).
``bench/gemv_tune.py`` times the tiles against cuBLAS.

``norm_gemv_triton`` is the same launch with the pre-norm block's "add the branch, normalise" in
front: the input rows are ``x + residual`` (rounded to the model dtype, as the unfused add rounds
them), scaled per column by the RMSNorm weight; their sum of squares is gathered along K in the
same loop and ``rsqrt(mean + eps)`` multiplies the dot products at the end, so the norm costs no
launch and no pass of its own (every program reads the whole input row anyway). The first program
writes ``x + residual`` out. Against ``RMSNorm(x, residual)`` then ``F.linear`` (the reference) the
only difference is that the normalised row is never rounded to the model dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_triton import norm_weight
from .pdl import pdl_options, pdl_wait

# Tiles for one input row, not yet timed here: moe_triton's gate/up GEMV measured best on an H200
# at 1 row of gate and 1 of up per program (two 16-byte loads in flight per thread), BLOCK_K 512,
# 2 warps; BLOCK_N 2 is the same for a plain GEMV. ``python -m bench.gemv_tune`` times the others.
DEFAULT_TILES = {"BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 2}

# Each thread loads 16-byte vectors along K. When a chunk of BLOCK_K columns has fewer vectors than
# the program has threads, Triton gives the spare warps weight rows in the weight tile's layout but
# input rows in the inputs' layout, and converts the weight tile through shared memory every chunk
# (seen in the sm_90 TTGIR); so ``num_warps`` is capped at ``BLOCK_K * itemsize / 512``.
_VECTOR_BYTES = 16


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, nw_ptr, res_out_ptr, M, N, K, stride_xm, stride_wn,
                 stride_ym, eps, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr, NORM: tl.constexpr,
                 ZERO_CENTERED: tl.constexpr, PDL: tl.constexpr):
    """``NORM``: the input rows are ``x + res`` (``res`` rows ``K`` apart, the sum written to
    ``res_out`` by program 0) under RMSNorm with weight ``nw``. ``PDL``: see ``pdl.py``."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    # ragged N: the tail program re-reads row N-1 instead of masking, so weight loads stay unmasked
    rows_in = tl.minimum(rows, N - 1).to(tl.int64)
    m = tl.arange(0, M_PAD)
    m_in = tl.minimum(m, M - 1)  # padded input rows re-read the last one; their outputs are dropped
    k = tl.arange(0, BLOCK_K)
    # 3-D pointers: [1, BLOCK_N, BLOCK_K] weight, [M_PAD, 1, BLOCK_K] inputs
    w_ptrs = w_ptr + rows_in[None, :, None] * stride_wn + k[None, None, :]
    x_ptrs = x_ptr + m_in[:, None, None].to(tl.int64) * stride_xm + k[None, None, :]
    # per thread one fp32 partial sum per (input row, weight row, 16-byte vector of the chunk):
    # each chunk's products are summed over their vector in registers, the threads' partial sums
    # only once after the loop
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K // VEC], tl.float32)
    sq = tl.zeros([M_PAD, 1], tl.float32)  # NORM: the input rows' sums of squares
    pdl_wait(PDL)
    for k0 in tl.range(0, K, BLOCK_K):
        kmask = (k0 + k < K)[None, None, :]
        if EVEN_K:
            w = tl.load(w_ptrs + k0)
            x = tl.load(x_ptrs + k0)
        else:
            w = tl.load(w_ptrs + k0, mask=kmask, other=0.0)
            x = tl.load(x_ptrs + k0, mask=kmask, other=0.0)
        x = x.to(tl.float32)
        if NORM:
            in_rows = m[:, None, None] * K + k0 + k[None, None, :]  # [M_PAD, 1, BLOCK_K] in x + res
            r = tl.load(res_ptr + m_in[:, None, None] * K + k0 + k[None, None, :], mask=kmask, other=0.0)
            total = (x + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # rounded as the unfused add
            if pid == 0:
                tl.store(res_out_ptr + in_rows, total, mask=kmask & (m < M)[:, None, None])
            x = total.to(tl.float32)
            sq += tl.sum(x * x, 2)
            x = x * norm_weight(nw_ptr, k0 + k, k0 + k < K, ZERO_CENTERED)[None, None, :]
        prod = w.to(tl.float32) * x  # [M_PAD, BLOCK_N, BLOCK_K]
        acc += tl.sum(tl.reshape(prod, [M_PAD, BLOCK_N, BLOCK_K // VEC, VEC]), 3)
    y = tl.sum(acc, 2)
    if NORM:
        y = y * tl.rsqrt(sq / K + eps)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_in).to(tl.float32)[None, :]
    out = y_ptr + m[:, None].to(tl.int64) * stride_ym + rows[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=(m < M)[:, None] & rmask[None, :])


def gemv_config(m: int, k: int, tiles: dict | None = None, itemsize: int = 2) -> dict:
    """The launch's constants: ``tiles`` over ``DEFAULT_TILES``, BLOCK_K clipped to K, num_warps
    capped so that every warp splits K (see ``_VECTOR_BYTES``)."""
    t = dict(DEFAULT_TILES, **(tiles or {}))
    t["BLOCK_K"] = min(t["BLOCK_K"], triton.next_power_of_2(k))
    t["num_warps"] = max(1, min(t["num_warps"], t["BLOCK_K"] * itemsize // (_VECTOR_BYTES * 32)))
    vec = min(t["BLOCK_K"], _VECTOR_BYTES // itemsize)
    return dict(t, M_PAD=triton.next_power_of_2(m), EVEN_K=k % t["BLOCK_K"] == 0, VEC=vec)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                tiles: dict | None = None) -> torch.Tensor:
    """``x`` ``[M, K]`` (rows may be strided, last dim contiguous), ``weight`` ``[N, K]`` contiguous,
    ``bias`` ``[N]`` or None -> ``[M, N]`` in ``x``'s dtype; ``F.linear(x, weight, bias)``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    if x.shape[1] > 1 and x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"gemv: x strides {x.stride()} need a contiguous last dim, weight strides "
                         f"{weight.stride()} must be contiguous")
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} for {weight.shape[0]} output features")
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_((bias if bias is not None else torch.zeros(n, device=x.device)).expand(m, n))
    _launch(x, weight, bias, y, tiles)
    return y


def _launch(x, weight, bias, y, tiles, residual=None, nw=None, res_out=None, eps=0.0, zero_centered=False):
    m, k = x.shape
    t = gemv_config(m, k, tiles, weight.element_size())
    _gemv_kernel[(triton.cdiv(weight.shape[0], t["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, y, x if residual is None else residual,
        weight if nw is None else nw, y if res_out is None else res_out, m, weight.shape[0], k, x.stride(0),
        weight.stride(0), y.stride(0), eps, HAS_BIAS=bias is not None, NORM=residual is not None,
        ZERO_CENTERED=zero_centered, **t, **pdl_options(x))


def norm_gemv_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     zero_centered: bool, weight: torch.Tensor, tiles: dict | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(RMSNorm(residual + x)), residual + x)`` in one launch: ``x`` and ``residual``
    ``[M, K]``, ``norm_weight`` ``[K]`` (``1 + w`` when ``zero_centered``), ``weight`` ``[N, K]``
    contiguous, no bias."""
    if x.dim() != 2 or residual.shape != x.shape or norm_weight.shape != (x.shape[1],) \
            or weight.dim() != 2 or weight.shape[1] != x.shape[1] or not weight.is_contiguous():
        raise ValueError(f"norm_gemv: x {tuple(x.shape)}, residual {tuple(residual.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)}, weight {tuple(weight.shape)} (contiguous [N, K])")
    x, residual = x.contiguous(), residual.contiguous()
    y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(residual)
    if x.numel() and weight.shape[0]:
        _launch(x, weight, None, y, tiles, residual, norm_weight, res_out, eps, zero_centered)
    elif x.numel():  # no output features: the residual sum is still the caller's next residual
        torch.add(x, residual, out=res_out)
    return y, res_out
