"""One Triton kernel for the Gated DeltaNet layer of a speculative verify step, every request's
positions in one launch, the slots left as they are.

A request verifying a draft brings ``T`` consecutive rows (its last token, then the drafts) over
one state slot. One program per (request, value head, block of value columns; the launch setting
``gdn_verify_tiles``, 32 columns and 4 warps by default) holds its columns of the head's state in
registers and walks the request's rows in order; at each position
it computes what the fused decode step (``gdn_decode_triton``) computes for one token:

- the depthwise causal conv and SiLU over the window of the slot's conv-state rows followed by
  the request's rows of this step up to this one, rounded to the rows' dtype;
- l2-normalised q and k, ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, the
  delta-rule update of its state columns and those columns of the output (before the output
  norm, which runs after the kernel);

and writes the state after that position (rounded to the pool's dtype, which the next position
then continues from, as a decode step would reload it) and the conv window after it to the
position's row of the verify buffers. The slot's own states are only read: once the drafts are
checked, the accepted position's states are copied into it (``models/base.VerifyRows.commit``),
and a rejected draft leaves no trace there. The torch reference of the same interface is
``gdn_verify.gdn_verify_reference`` (the CPU path and the tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import launch
from .gdn_decode_triton import BLOCK_V, row_stride
from .gdn_verify import check_verify_args
from .pdl import pdl_options, pdl_wait


@triton.jit
def _span(x_ptr, stride_x, window_ptr, start, t, cols, C, W: tl.constexpr, W_PAD: tl.constexpr):
    """``[W_PAD, n]`` tile of channels ``cols`` of position ``t``'s conv window: rows ``t .. t + W - 1``
    of [the slot's ``W - 1`` conv-state rows | the request's rows from ``start``]."""
    r = tl.arange(0, W_PAD)[:, None]
    at = t + r
    ptrs = tl.where(at < W - 1, window_ptr + at * C + cols[None, :],
                    x_ptr + (start + at - (W - 1)) * stride_x + cols[None, :])
    return tl.load(ptrs, mask=r < W, other=0.0)


@triton.jit
def _weights(w_ptr, cols, W: tl.constexpr, W_PAD: tl.constexpr):
    r = tl.arange(0, W_PAD)[:, None]
    return tl.load(w_ptr + cols[None, :] * W + r, mask=r < W, other=0.0).to(tl.float32)


@triton.jit
def _silu_conv(tile, w, out_dtype):
    """SiLU of the causal conv of a ``_span`` tile, rounded to ``out_dtype`` as the decode step's is."""
    acc = tl.sum(tile.to(tl.float32) * w, 0)
    return (acc / (1.0 + tl.exp(-acc))).to(out_dtype).to(tl.float32)


@triton.jit
def _keep_window(tile, dst_ptr, cols, C, mine, W: tl.constexpr, W_PAD: tl.constexpr):
    """The conv state after a position: its window's last ``W - 1`` rows, to ``dst_ptr`` ``[W-1, C]``
    (the columns where ``mine``)."""
    r = tl.arange(0, W_PAD)[:, None]
    tl.store(dst_ptr + (r - 1) * C + cols[None, :], tile.to(dst_ptr.dtype.element_ty),
             mask=((r >= 1) & (r < W) & mine[None, :]) != 0)


@triton.jit
def _gdn_verify_kernel(qkv_ptr, a_ptr, b_ptr, conv_ptr, cw_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, cu_ptr,
                       conv_out_ptr, state_out_ptr, out_ptr, stride_qkv, stride_a, stride_b, C, scale,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                       W: tl.constexpr, W_PAD: tl.constexpr, PDL: tl.constexpr, LAST_ONLY: tl.constexpr):
    """Program ``(r, hv, j)``: value columns ``[j * BV, (j + 1) * BV)`` of value head ``hv`` over
    the rows of request ``r`` (``cu[r] .. cu[r + 1]``, state slot ``slots[r]``). ``LAST_ONLY``: the
    states after the request's last row alone, to buffer row ``r``."""
    pdl_wait(PDL)  # the projections come from the kernel before
    ri = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    group: tl.constexpr = HV // H
    h = hv // group
    kk = tl.arange(0, K)
    vv = vb * BV + tl.arange(0, BV)
    slot = tl.load(slot_ptr + ri).to(tl.int64)
    start = tl.load(cu_ptr + ri).to(tl.int64)
    n = tl.load(cu_ptr + ri + 1).to(tl.int64) - start
    window = conv_ptr + slot * (W - 1) * C
    q_cols, k_cols, v_cols = h * K + kk, H * K + h * K + kk, 2 * H * K + hv * V + vv
    # the key head's q / k conv windows are the same for all its programs: one of them keeps them
    lead_cols = (kk < K) & (hv % group == 0) & (vb == 0)
    wq, wk, wv = _weights(cw_ptr, q_cols, W, W_PAD), _weights(cw_ptr, k_cols, W, W_PAD), \
        _weights(cw_ptr, v_cols, W, W_PAD)
    head = kk[:, None] * V + vv[None, :]
    s = tl.load(state_ptr + (slot * HV + hv) * K * V + head).to(tl.float32)
    alog = tl.load(alog_ptr + hv).to(tl.float32)
    dtb = tl.load(dtb_ptr + hv).to(tl.float32)
    dt = qkv_ptr.dtype.element_ty
    for t in range(0, n):
        row = start + t
        tq = _span(qkv_ptr, stride_qkv, window, start, t, q_cols, C, W, W_PAD)
        tk = _span(qkv_ptr, stride_qkv, window, start, t, k_cols, C, W, W_PAD)
        tv = _span(qkv_ptr, stride_qkv, window, start, t, v_cols, C, W, W_PAD)
        x = tl.load(a_ptr + row * stride_a + hv).to(tl.float32) + dtb
        b = tl.load(b_ptr + row * stride_b + hv).to(tl.float32)
        q, k, v = _silu_conv(tq, wq, dt), _silu_conv(tk, wk, dt), _silu_conv(tv, wv, dt)
        if LAST_ONLY:  # buffer row ri, written after the last position only
            keep = ri.to(tl.int64)
            here = t == n - 1
        else:
            keep = row
            here = t >= 0
        kept = conv_out_ptr + keep * (W - 1) * C
        _keep_window(tv, kept, v_cols, C, (vv < V) & here, W, W_PAD)
        _keep_window(tq, kept, q_cols, C, lead_cols & here, W, W_PAD)
        _keep_window(tk, kept, k_cols, C, lead_cols & here, W, W_PAD)

        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(alog) * softplus
        beta = 1.0 / (1.0 + tl.exp(-b))
        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], 0))
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * HV * V + hv * V + vv, o)
        held = s.to(state_out_ptr.dtype.element_ty)  # as the pool holds it: the next position reads this
        tl.store(state_out_ptr + (keep * HV + hv) * K * V + head, held, mask=head < K * V * here.to(tl.int32))
        s = held.to(tl.float32)


def gdn_verify_triton(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_pool: torch.Tensor,
                      conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      state_pool: torch.Tensor, slot_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      conv_out: torch.Tensor, state_out: torch.Tensor, num_k_heads: int,
                      block_v: int | None = None, last_only: bool = False) -> torch.Tensor:
    """``qkv`` ``[R, C]`` pre-conv rows ([q | k | v]), ``a``/``b`` ``[R, HV]`` (views of one
    projection's output are fine): request ``i`` has rows ``cu_seqlens[i] .. cu_seqlens[i + 1]``
    (int64 on the device) over state slot ``slot_ids[i]`` of ``conv_pool`` ``[slots, W-1, C]`` and
    ``state_pool`` ``[slots, HV, K, V]`` (fp32, bf16 or fp16), which are only read. The states
    after row ``r`` go to ``conv_out[r]`` and ``state_out[r]`` (the pools' shapes and dtypes past
    the first dim). Returns the output before the norm ``[R, HV, V]`` in ``qkv``'s dtype.
    ``block_v``: value columns per program (else the launch setting ``gdn_verify_tiles``).
    ``last_only``: the states after each request's last row alone, to ``conv_out[i]`` and
    ``state_out[i]`` (buffers of one row per request)."""
    check_verify_args(qkv, conv_pool, conv_weight, state_pool, slot_ids, cu_seqlens, conv_out, state_out,
                      num_k_heads, last_only)
    rows, c = qkv.shape
    _, hv, dk, dv = state_pool.shape
    width = conv_weight.shape[-1]
    tiles = launch.current().gdn_verify_tiles
    block_v = min(block_v or tiles.get("BLOCK_V", BLOCK_V), dv)
    out = torch.empty((rows, hv, dv), dtype=qkv.dtype, device=qkv.device)
    requests = slot_ids.shape[0]
    if rows and requests:
        _gdn_verify_kernel[(requests, hv, dv // block_v)](
            qkv, a, b, conv_pool, conv_weight.reshape(c, width).contiguous(), A_log, dt_bias, state_pool,
            slot_ids, cu_seqlens, conv_out, state_out, out,
            *(row_stride(t, name, "gdn verify") for t, name in ((qkv, "qkv"), (a, "a"), (b, "b"))),
            c, dk**-0.5, H=num_k_heads, HV=hv, K=dk, V=dv, BV=block_v, W=width,
            W_PAD=triton.next_power_of_2(width), LAST_ONLY=last_only, num_warps=tiles.get("num_warps", 4),
            **pdl_options(qkv))
    return out
