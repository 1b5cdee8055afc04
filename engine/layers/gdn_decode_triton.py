"""One fused Triton kernel for a Gated DeltaNet decode step, working in place on the state pool.

One program per (sequence, value head) does, from the raw projections:

- the depthwise causal conv over [last W-1 inputs | new input] and SiLU for the channels the head
  reads (its key head's q and k, its own v), and the shift of those channels' conv state;
- l2-normalised q and k, ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, the
  delta-rule update of the head's fp32 state in place in the slot, and the head's output;
- the output norm of the layer, ``rmsnorm(o) * weight * silu(z)`` over the head.

The value heads of one key head all read its q / k conv state, so none of them may shift it
before the others have read it: each program counts itself in on a per-(slot, key head) counter
after reading (a barrier first, so all its threads have read), and the one that arrives last does
the shift from the window it read. The counters only grow (int64), and
every step adds exactly one arrival per value head, so "last" is ``count % group == group - 1``.

One launch replaces three (conv, recurrence, gated norm) and the two dozen small ops of the torch
path (``GatedDeltaNet._decode`` + ``GatedRMSNorm``, the reference this is tested against); slot
ids are read on the device, so a CUDA graph can capture the step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_triton import inv_rms


@triton.jit
def _window(x_ptr, window_ptr, cols, C, W: tl.constexpr, W_PAD: tl.constexpr):
    """``[W_PAD, n]`` tile of channels ``cols``: the ``W - 1`` conv state rows, then the new input."""
    r = tl.arange(0, W_PAD)[:, None]
    ptrs = tl.where(r < W - 1, window_ptr + r * C + cols[None, :], x_ptr + cols[None, :] + r * 0)
    return tl.load(ptrs, mask=r < W, other=0.0)


@triton.jit
def _conv(tile, w_ptr, cols, out_dtype, W: tl.constexpr, W_PAD: tl.constexpr):
    """SiLU of the causal conv over a ``_window`` tile, rounded to ``out_dtype`` as the unfused
    conv's output is."""
    r = tl.arange(0, W_PAD)[:, None]
    w = tl.load(w_ptr + cols[None, :] * W + r, mask=r < W, other=0.0).to(tl.float32)
    acc = tl.sum(tile.to(tl.float32) * w, 0)
    return (acc / (1.0 + tl.exp(-acc))).to(out_dtype).to(tl.float32)


@triton.jit
def _shift(tile, window_ptr, cols, C, W: tl.constexpr, W_PAD: tl.constexpr):
    """Write a ``_window`` tile back one row up: the oldest state row drops out, the input enters."""
    r = tl.arange(0, W_PAD)[:, None]
    tl.store(window_ptr + (r - 1) * C + cols[None, :], tile.to(window_ptr.dtype.element_ty), mask=(r >= 1) & (r < W))


@triton.jit
def _gdn_step_kernel(qkv_ptr, z_ptr, a_ptr, b_ptr, conv_ptr, cw_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr,
                     count_ptr, nw_ptr, out_ptr, stride_qkv, stride_z, stride_a, stride_b, stride_count, C, scale, eps,
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
                     W_PAD: tl.constexpr):
    bi = tl.program_id(0)
    hv = tl.program_id(1)
    group: tl.constexpr = HV // H
    h = hv // group
    kk = tl.arange(0, K)
    vv = tl.arange(0, V)
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    x_row = qkv_ptr + bi * stride_qkv
    window = conv_ptr + slot * (W - 1) * C
    q_cols, k_cols, v_cols = h * K + kk, H * K + h * K + kk, 2 * H * K + hv * V + vv
    tq = _window(x_row, window, q_cols, C, W, W_PAD)
    tk = _window(x_row, window, k_cols, C, W, W_PAD)
    tv = _window(x_row, window, v_cols, C, W, W_PAD)
    dt = qkv_ptr.dtype.element_ty
    q, k, v = _conv(tq, cw_ptr, q_cols, dt, W, W_PAD), _conv(tk, cw_ptr, k_cols, dt, W, W_PAD), \
        _conv(tv, cw_ptr, v_cols, dt, W, W_PAD)
    tl.debug_barrier()  # every thread of the program has read the windows before any is rewritten
    _shift(tv, window, v_cols, C, W, W_PAD)  # this head's v channels: read by this program only
    arrived = tl.atomic_add(count_ptr + slot * stride_count + h, 1, sem="acq_rel", scope="gpu")
    if arrived % group == group - 1:  # the key head's last value head: nobody reads q / k any more
        _shift(tq, window, q_cols, C, W, W_PAD)
        _shift(tk, window, k_cols, C, W, W_PAD)

    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    x = tl.load(a_ptr + bi * stride_a + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * softplus
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + bi * stride_b + hv).to(tl.float32)))
    s_ptr = state_ptr + (slot * HV + hv) * K * V + kk[:, None] * V + vv[None, :]
    s = tl.load(s_ptr) * tl.exp(g)
    delta = beta * (v - tl.sum(s * k[:, None], 0))
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptr, s)
    o = tl.sum(s * q[:, None], 0).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like the step's output

    z = tl.load(z_ptr + bi * stride_z + hv * V + vv).to(tl.float32)
    inv = inv_rms(o, V, eps, 0)
    y = o * inv * tl.load(nw_ptr + vv).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + (bi * HV + hv) * V + vv, y.to(out_ptr.dtype.element_ty))


def _rows(t: torch.Tensor, name: str) -> int:
    """Row stride of a ``[B, n]`` view whose last dim is contiguous (a slice of a fused projection)."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"gdn step: {name} {tuple(t.shape)} strides {t.stride()} needs contiguous rows")
    return t.stride(0)


def gdn_decode_step_triton(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           conv_pool: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                           dt_bias: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor,
                           counts: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           num_k_heads: int) -> torch.Tensor:
    """``qkv`` ``[B, C]`` pre-conv rows ([q | k | v]), ``z`` ``[B, HV*V]``, ``a``/``b`` ``[B, HV]``
    (views of one projection's output are fine); ``conv_pool`` ``[slots, W-1, C]`` and ``state_pool``
    ``[slots, HV, K, V]`` fp32 updated in place; ``counts`` int64 ``[slots, >= num_k_heads]``.
    Returns the normed, gated output ``[B, HV*V]`` (the input of ``out_proj``)."""
    bsz, c = qkv.shape
    _, hv, dk, dv = state_pool.shape
    width = conv_weight.shape[-1]
    if state_pool.dtype != torch.float32 or not state_pool.is_contiguous() or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"gdn step: state pool {tuple(state_pool.shape)} {state_pool.dtype}")
    if conv_pool.shape[1:] != (width - 1, c) or not conv_pool.is_contiguous() or conv_pool.dtype != qkv.dtype \
            or hv % num_k_heads \
            or c != 2 * num_k_heads * dk + hv * dv:
        raise ValueError(f"gdn step: conv pool {tuple(conv_pool.shape)} for qkv {tuple(qkv.shape)}, width {width}")
    if counts.dtype != torch.int64 or counts.shape[1] < num_k_heads or counts.stride(1) != 1:
        raise ValueError(f"gdn step: counters {tuple(counts.shape)} {counts.dtype}")
    out = torch.empty((bsz, hv * dv), dtype=qkv.dtype, device=qkv.device)
    if bsz:
        _gdn_step_kernel[(bsz, hv)](
            qkv, z, a, b, conv_pool, conv_weight.reshape(c, width).contiguous(), A_log, dt_bias, state_pool,
            slot_ids, counts, norm_weight, out, _rows(qkv, "qkv"), _rows(z, "z"), _rows(a, "a"), _rows(b, "b"),
            counts.stride(0), c, dk**-0.5, eps,
            H=num_k_heads, HV=hv, K=dk, V=dv, W=width, W_PAD=triton.next_power_of_2(width), num_warps=8 if dk * dv >= 128 * 128 else 4)
    return out
