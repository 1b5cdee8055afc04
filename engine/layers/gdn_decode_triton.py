"""One fused Triton kernel for a Gated DeltaNet decode step, working in place on the state pool.

One program per (sequence, value head, block of ``BLOCK_V`` value columns) does, from the raw
projections:

- the depthwise causal conv over [last W-1 inputs | new input] and SiLU for the channels it reads
  (its key head's q and k, its own v columns), and the shift of its v channels' conv state;
- l2-normalised q and k, ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, the
  delta-rule update of its columns of the head's fp32 state in place in the slot, and those
  columns of the head's output.

The programs of one key head (its value heads times their column blocks) then meet on a
per-(slot, key head) counter: each counts itself in after its reads of the conv windows and its
output stores (a barrier first, so all its threads are done), and the one that arrives last
shifts the key head's q / k conv state (nobody reads it any more) and applies the layer's output
norm, ``rmsnorm(o) * weight * silu(z)`` over each value head, to the outputs the others wrote.
The counters only grow (int64) and every step adds the same number of arrivals per key head, so
"last" is ``count % arrivals == arrivals - 1``.

One launch replaces three (conv, recurrence, gated norm) and the two dozen small ops of the torch
path (``GatedDeltaNet._decode`` + ``GatedRMSNorm``, the reference this is tested against); slot
ids are read on the device, so a CUDA graph can capture the step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .norm_triton import inv_rms
from .pdl import pdl_options, pdl_wait

# Value columns per program: a 128 x 128 head in four programs of 128 x 32, so a batch-1 step runs
# four times as many programs as there are value heads (32 programs left most of an H200 idle).
BLOCK_V = 32


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
                     H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     G_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr, PDL: tl.constexpr):
    """Program ``(b, hv, j)``: value columns ``[j * BV, (j + 1) * BV)`` of value head ``hv`` of
    sequence ``b``; the key head's last program to arrive also shifts the q / k conv state and
    normalises the outputs of the key head's value heads."""
    pdl_wait(PDL)  # the projections come from the kernel before; the state pools are read and written
    bi = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    group: tl.constexpr = HV // H
    arrivals: tl.constexpr = group * (V // BV)  # programs per (sequence, key head)
    h = hv // group
    kk = tl.arange(0, K)
    vv = vb * BV + tl.arange(0, BV)
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    if slot < 0:  # no row here (a captured step's padding): nothing read or written
        return
    x_row = qkv_ptr + bi * stride_qkv
    window = conv_ptr + slot * (W - 1) * C
    q_cols, k_cols, v_cols = h * K + kk, H * K + h * K + kk, 2 * H * K + hv * V + vv
    tq = _window(x_row, window, q_cols, C, W, W_PAD)
    tk = _window(x_row, window, k_cols, C, W, W_PAD)
    tv = _window(x_row, window, v_cols, C, W, W_PAD)
    # every other load of the step goes out now, with the windows, before anything waits on one
    s_ptr = state_ptr + (slot * HV + hv) * K * V + kk[:, None] * V + vv[None, :]
    s = tl.load(s_ptr).to(tl.float32)  # held in fp32, bf16 or fp16 (--state-dtype), updated in fp32
    x = tl.load(a_ptr + bi * stride_a + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
    alog = tl.load(alog_ptr + hv).to(tl.float32)
    b = tl.load(b_ptr + bi * stride_b + hv).to(tl.float32)
    dt = qkv_ptr.dtype.element_ty
    q, k, v = _conv(tq, cw_ptr, q_cols, dt, W, W_PAD), _conv(tk, cw_ptr, k_cols, dt, W, W_PAD), \
        _conv(tv, cw_ptr, v_cols, dt, W, W_PAD)
    tl.debug_barrier()  # every thread of the program has read the windows before any is rewritten
    _shift(tv, window, v_cols, C, W, W_PAD)  # these v channels: read by this program only

    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(alog) * softplus
    beta = 1.0 / (1.0 + tl.exp(-b))
    s = s * tl.exp(g)
    delta = beta * (v - tl.sum(s * k[:, None], 0))
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptr, s.to(state_ptr.dtype.element_ty))
    o = tl.sum(s * q[:, None], 0).to(out_ptr.dtype.element_ty)  # rounded like the step's output
    out_row = out_ptr + bi * HV * V
    tl.store(out_row + hv * V + vv, o)

    tl.debug_barrier()  # every thread's reads of the windows and stores of o come before the release
    arrived = tl.atomic_add(count_ptr + slot * stride_count + h, 1, sem="acq_rel", scope="gpu")
    if arrived % arrivals == arrivals - 1:  # the key head's last program: all its heads' o are written
        _shift(tq, window, q_cols, C, W, W_PAD)
        _shift(tk, window, k_cols, C, W, W_PAD)
        j = tl.arange(0, G_PAD)[:, None]
        cols = (h * group + j) * V + tl.arange(0, V)[None, :]  # [G_PAD, V]: the key head's value heads
        mine = (j + cols * 0) < group
        # .cg: from L2, where the other programs' stores landed, never a stale L1 line
        heads_o = tl.load(out_row + cols, mask=mine, other=0.0, cache_modifier=".cg").to(tl.float32)
        heads_z = tl.load(z_ptr + bi * stride_z + cols, mask=mine, other=0.0).to(tl.float32)
        inv = inv_rms(heads_o, V, eps, 1)
        y = heads_o * inv[:, None] * tl.load(nw_ptr + tl.arange(0, V)).to(tl.float32)[None, :] \
            * (heads_z / (1.0 + tl.exp(-heads_z)))
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mine)


def row_stride(t: torch.Tensor, name: str, kernel: str = "gdn step") -> int:
    """Row stride of a ``[B, n]`` view whose last dim is contiguous (a slice of a fused projection)."""
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{kernel}: {name} {tuple(t.shape)} strides {t.stride()} needs contiguous rows")
    return t.stride(0)


def gdn_decode_step_triton(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           conv_pool: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                           dt_bias: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor,
                           counts: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           num_k_heads: int, block_v: int | None = None, out: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """``qkv`` ``[B, C]`` pre-conv rows ([q | k | v]), ``z`` ``[B, HV*V]``, ``a``/``b`` ``[B, HV]``
    (views of one projection's output are fine); ``conv_pool`` ``[slots, W-1, C]`` and ``state_pool``
    ``[slots, HV, K, V]`` (fp32, bf16 or fp16) updated in place; ``counts`` int64 ``[slots, >= num_k_heads]``, whose
    launches must all use the same ``block_v`` (value columns per program, ``BLOCK_V`` when None,
    at most V). Returns the normed, gated output ``[B, HV*V]`` (the input of ``out_proj``), written
    into ``out`` (contiguous) where given. A row whose slot id is negative is skipped: its output
    row is left as it was and no slot is touched (a captured step's rows past its real ones)."""
    bsz, c = qkv.shape
    _, hv, dk, dv = state_pool.shape
    width = conv_weight.shape[-1]
    if state_pool.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not state_pool.is_contiguous() or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"gdn step: state pool {tuple(state_pool.shape)} {state_pool.dtype}")
    if conv_pool.shape[1:] != (width - 1, c) or not conv_pool.is_contiguous() or conv_pool.dtype != qkv.dtype \
            or hv % num_k_heads or c != 2 * num_k_heads * dk + hv * dv:
        raise ValueError(f"gdn step: conv pool {tuple(conv_pool.shape)} for qkv {tuple(qkv.shape)}, width {width}")
    if counts.dtype != torch.int64 or counts.shape[1] < num_k_heads or counts.stride(1) != 1:
        raise ValueError(f"gdn step: counters {tuple(counts.shape)} {counts.dtype}")
    block_v = min(block_v or BLOCK_V, dv)
    if out is None:
        out = torch.empty((bsz, hv * dv), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (bsz, hv * dv) or not out.is_contiguous() or out.dtype != qkv.dtype:
        raise ValueError(f"gdn step: out {tuple(out.shape)} {out.dtype} for {bsz} rows of {hv * dv}")
    if bsz:
        _gdn_step_kernel[(bsz, hv, dv // block_v)](
            qkv, z, a, b, conv_pool, conv_weight.reshape(c, width).contiguous(), A_log, dt_bias, state_pool,
            slot_ids, counts, norm_weight, out,
            row_stride(qkv, "qkv"), row_stride(z, "z"), row_stride(a, "a"), row_stride(b, "b"),
            counts.stride(0), c, dk**-0.5, eps,
            H=num_k_heads, HV=hv, K=dk, V=dv, BV=block_v, G_PAD=triton.next_power_of_2(hv // num_k_heads),
            W=width, W_PAD=triton.next_power_of_2(width), num_warps=4, **pdl_options(qkv))
    return out
