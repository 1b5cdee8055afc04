"""Triton kernel for the front of an attention layer on paged caches: q/k norm, RoPE and the
KV-cache write, for decode steps and for prompt tokens alike.

One program per (token row, head): query heads are normalised (plain or zero-centred RMSNorm,
optional), rotated (neox layout on the first ``rotary_dim`` dims, angles ``position * inv_freq``
in fp32) and written to a packed ``[B, H, D]`` query; key heads get the same treatment and are
written with their value rows straight into the row's page slot (``write_index``). This replaces
about twenty small torch ops per attention layer. Reference: the module's own torch path in
``Attention.forward`` (``RMSNorm``, ``RotaryEmbedding``, the cache's K/V write).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_triton import inv_rms
from .pdl import pdl_options, pdl_wait


@triton.jit
def _decode_qkv_kernel(q_ptr, k_ptr, v_ptr, stride_q, stride_k, stride_v, pos_ptr, inv_freq_ptr,
                       qw_ptr, kw_ptr, write_ptr, k_pages_ptr, v_pages_ptr, q_out_ptr, eps,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, Q_HEAD_STRIDE: tl.constexpr,
                       ROT: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    j = tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = ROT // 2
    partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
    if j < H:
        src = q_ptr + b * stride_q + j * Q_HEAD_STRIDE
        w_ptr = qw_ptr
    else:
        src = k_ptr + b * stride_k + (j - H) * D
        w_ptr = kw_ptr
    x = tl.load(src + d).to(tl.float32)
    xp = tl.load(src + partner).to(tl.float32)
    if NORM != 0:
        inv = inv_rms(x, D, eps, 0)
        w = tl.load(w_ptr + d).to(tl.float32)
        wp = tl.load(w_ptr + partner).to(tl.float32)
        if NORM == 2:
            w += 1.0
            wp += 1.0
        x = (x * inv * w).to(q_out_ptr.dtype.element_ty).to(tl.float32)
        xp = (xp * inv * wp).to(q_out_ptr.dtype.element_ty).to(tl.float32)
    pos = tl.load(pos_ptr + b).to(tl.float32)
    freq = tl.load(inv_freq_ptr + tl.where(d < half, d, d - half), mask=d < ROT, other=0.0)
    angle = pos * freq
    c = tl.cos(angle)
    s = tl.sin(angle)
    out = tl.where(d < half, x * c - xp * s, tl.where(d < ROT, x * c + xp * s, x))
    if j < H:
        tl.store(q_out_ptr + (b * H + j) * D + d, out.to(q_out_ptr.dtype.element_ty))
    else:
        row = tl.load(write_ptr + b).to(tl.int64) * HKV + (j - H)
        tl.store(k_pages_ptr + row * D + d, out.to(k_pages_ptr.dtype.element_ty))
        vals = tl.load(v_ptr + b * stride_v + (j - H) * D + d)
        tl.store(v_pages_ptr + row * D + d, vals.to(v_pages_ptr.dtype.element_ty))


def decode_qkv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      inv_freq: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                      zero_centered: bool, eps: float, write_index: torch.Tensor, k_pages: torch.Tensor,
                      v_pages: torch.Tensor, num_heads: int, q_head_stride: int) -> torch.Tensor:
    """``q`` ``[B, *]`` with head ``j`` at columns ``j * q_head_stride`` (``2D`` when a gate is
    interleaved), ``k``/``v`` ``[B, Hkv * D]``; rows may be strided. Writes K/V at ``write_index``
    rows of the pages ``[num_pages, P, Hkv, D]`` and returns the rotated query ``[B, H, D]``."""
    b = q.shape[0]
    _, _, hkv, d = k_pages.shape
    rot = 2 * inv_freq.shape[0]
    if d & (d - 1) or rot > d or k.shape != (b, hkv * d) or v.shape != k.shape or \
            not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError(f"decode_qkv: q {tuple(q.shape)}, k {tuple(k.shape)}, pages {tuple(k_pages.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("decode_qkv: rows must have unit column stride")
    out = torch.empty((b, num_heads, d), dtype=q.dtype, device=q.device)
    norm = 0 if q_norm is None else (2 if zero_centered else 1)
    _decode_qkv_kernel[(b, num_heads + hkv)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), positions, inv_freq,
        q_norm if q_norm is not None else inv_freq, k_norm if k_norm is not None else inv_freq,
        write_index, k_pages, v_pages, out, eps,
        H=num_heads, HKV=hkv, D=d, Q_HEAD_STRIDE=q_head_stride, ROT=rot, NORM=norm, num_warps=1,
        **pdl_options(q))
    return out
