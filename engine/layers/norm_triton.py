"""Triton kernels for the norms: RMSNorm (plain or zero-centred) and the GDN gated RMSNorm.

One program per row (the gated norm: a tile of rows for long runs), fp32 math, one read and one
write of each row. References: ``norm.RMSNorm``
and ``gated_delta_net.GatedRMSNorm`` (their torch code), used on the CPU and by the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_options, pdl_wait


@triton.jit
def inv_rms(x, D, eps, AXIS: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` of fp32 rows ``D`` long along ``AXIS`` (zeros past ``D``)."""
    return tl.rsqrt(tl.sum(x * x, AXIS) / D + eps)


@triton.jit
def norm_weight(w_ptr, cols, mask, ZERO_CENTERED: tl.constexpr):
    """The norm's scale in fp32: ``w``, or ``1 + w`` when zero-centred (0 where ``mask`` is off)."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


@triton.jit
def _normalize(x, w_ptr, cols, mask, D, eps, ZERO_CENTERED: tl.constexpr):
    """One fp32 row (zeros past ``D``) times ``rsqrt(mean(x^2) + eps)`` and the weight."""
    return x * inv_rms(x, D, eps, 0) * norm_weight(w_ptr, cols, mask, ZERO_CENTERED)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, D, eps,
                     ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normalize(x, w_ptr, cols, mask, D, eps, ZERO_CENTERED)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, D, eps,
                         ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + r).to(res_out_ptr.dtype.element_ty)  # rounded as the unfused add rounds it
    tl.store(res_out_ptr + row * D + cols, total, mask=mask)
    y = _normalize(total.to(tl.float32), w_ptr, cols, mask, D, eps, ZERO_CENTERED)
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, N, D, H, stride_zt, eps, ROWS: tl.constexpr,
                           BLOCK: tl.constexpr):
    """``ROWS`` rows (heads) per program: the rows are one head wide (128), too short to keep a
    program busy. ``z`` is read in place from its token rows (``stride_zt`` apart, ``H`` heads
    each): the projection's output it is a view of needs no copy."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    rows64 = rows.to(tl.int64)
    offs = rows64[:, None] * D + cols[None, :]
    z_offs = ((rows64 // H) * stride_zt + (rows64 % H) * D)[:, None] + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + z_offs, mask=mask, other=0.0).to(tl.float32)
    inv = inv_rms(x, D, eps, 1)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = x * inv[:, None] * w[None, :] * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _warps(block: int) -> int:
    """Warps per row program: a lone decode row is latency bound, so spread it over more loads."""
    return max(4, min(16, block // 512))


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for rows of {d}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), d, eps,
                                         ZERO_CENTERED=zero_centered, BLOCK=triton.next_power_of_2(d),
                                         num_warps=_warps(triton.next_power_of_2(d)), **pdl_options(x2))
    return out.view(x.shape)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        zero_centered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` and its RMSNorm in one pass: returns ``(normed, new_residual)``."""
    d = x.shape[-1]
    if residual.shape != x.shape or weight.shape != (d,):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, residual {tuple(residual.shape)}")
    x2, r2 = x.reshape(-1, d).contiguous(), residual.reshape(-1, d).contiguous()
    out, res_out = torch.empty_like(x2), torch.empty_like(r2)
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, d, eps, ZERO_CENTERED=zero_centered,
                                             BLOCK=block, num_warps=_warps(block), **pdl_options(x2))
    return out.view(x.shape), res_out.view(x.shape)


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """``rmsnorm(x) * weight * silu(z)`` per head: ``x`` and ``z`` ``[..., H, D]`` (``z`` may be
    a view whose tokens lie apart, as in the fused input projection's output), into ``out``
    (contiguous, ``x``'s size) where given."""
    d = x.shape[-1]
    if z.shape != x.shape or weight.shape != (d,):
        raise ValueError(f"gated_rms_norm: x {tuple(x.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}")
    x2 = x.reshape(-1, d).contiguous()
    heads = x.shape[-2] if x.dim() >= 2 else 1
    if x.dim() == 3 and z.stride(2) == 1 and z.stride(1) == d:  # token rows apart: read in place
        z2, stride_zt = z, z.stride(0)
    else:
        z2 = z.reshape(-1, d).contiguous()
        heads, stride_zt = 1, d
    if out is None:
        out = torch.empty_like(x2)
    elif out.numel() != x2.numel() or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"gated_rms_norm: out {tuple(out.shape)} {out.dtype} for x {tuple(x.shape)} {x.dtype}")
    n, block = x2.shape[0], triton.next_power_of_2(d)
    rows = 1 if n < 4096 else max(1, 2048 // block)  # decode: a program per row, for parallelism
    if n:
        _gated_rms_norm_kernel[(triton.cdiv(n, rows),)](x2, z2, weight, out, n, d, heads, stride_zt, eps, ROWS=rows,
                                                         BLOCK=block)
    return out.view(x.shape)
