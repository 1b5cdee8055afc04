"""The Gated DeltaNet layer's part of a speculative verify step: every verifying request's rows
from its slot's states, the states after each row kept in the verify buffers, the slots only read.

``gdn_verify`` runs ``gdn_verify_triton`` (one launch for every request, ``gdn_verify_triton.py``)
on CUDA and under Triton's interpreter, and ``gdn_verify_reference`` elsewhere: the same
interface in torch, position by position over the requests still running, each position exactly
the layer's torch decode step (``GatedDeltaNet._decode``) on states held aside.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .gdn_ops import recurrent_step_batched
from .triton_switch import on_triton


def check_verify_args(qkv: torch.Tensor, conv_pool: torch.Tensor, conv_weight: torch.Tensor,
                      state_pool: torch.Tensor, slot_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                      conv_out: torch.Tensor, state_out: torch.Tensor, num_k_heads: int,
                      last_only: bool = False) -> None:
    """The shapes ``gdn_verify`` takes (its docstring; ``last_only``: buffers of a row per request)."""
    rows, c = qkv.shape
    kept = slot_ids.shape[0] if last_only else rows
    _, hv, dk, dv = state_pool.shape
    width = conv_weight.shape[-1]
    if state_pool.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not state_pool.is_contiguous() \
            or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"gdn verify: state pool {tuple(state_pool.shape)} {state_pool.dtype}")
    if conv_pool.shape[1:] != (width - 1, c) or not conv_pool.is_contiguous() or conv_pool.dtype != qkv.dtype \
            or hv % num_k_heads or c != 2 * num_k_heads * dk + hv * dv:
        raise ValueError(f"gdn verify: conv pool {tuple(conv_pool.shape)} for qkv {tuple(qkv.shape)}, width {width}")
    if conv_out.shape[0] < kept or conv_out.shape[1:] != conv_pool.shape[1:] or conv_out.dtype != conv_pool.dtype \
            or not conv_out.is_contiguous():
        raise ValueError(f"gdn verify: conv buffer {tuple(conv_out.shape)} {conv_out.dtype} for {kept} rows")
    if state_out.shape[0] < kept or state_out.shape[1:] != state_pool.shape[1:] \
            or state_out.dtype != state_pool.dtype or not state_out.is_contiguous():
        raise ValueError(f"gdn verify: state buffer {tuple(state_out.shape)} {state_out.dtype} for {kept} rows")
    if cu_seqlens.dim() != 1 or slot_ids.shape != (cu_seqlens.shape[0] - 1,):
        raise ValueError(f"gdn verify: {tuple(slot_ids.shape)} slots for cu_seqlens {tuple(cu_seqlens.shape)}")


def gdn_verify(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_pool: torch.Tensor,
               conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, state_pool: torch.Tensor,
               slot_ids: torch.Tensor, cu_seqlens: torch.Tensor, conv_out: torch.Tensor, state_out: torch.Tensor,
               num_k_heads: int) -> torch.Tensor:
    """``qkv`` ``[R, C]`` pre-conv rows ([q | k | v]), ``a``/``b`` ``[R, HV]``: request ``i`` has
    rows ``cu_seqlens[i] .. cu_seqlens[i + 1]`` (int64) over state slot ``slot_ids[i]`` of
    ``conv_pool`` ``[slots, W-1, C]`` and ``state_pool`` ``[slots, HV, K, V]`` (fp32, bf16 or
    fp16), which are only read. The states after row ``r`` go to ``conv_out[r]`` and
    ``state_out[r]`` (the pools' shapes and dtypes past the first dim). Returns the output
    before the layer's output norm, ``[R, HV, V]`` in ``qkv``'s dtype."""
    if on_triton(qkv):
        from .gdn_verify_triton import gdn_verify_triton

        return gdn_verify_triton(qkv, a, b, conv_pool, conv_weight, A_log, dt_bias, state_pool, slot_ids,
                                 cu_seqlens, conv_out, state_out, num_k_heads)
    return gdn_verify_reference(qkv, a, b, conv_pool, conv_weight, A_log, dt_bias, state_pool, slot_ids,
                                cu_seqlens, conv_out, state_out, num_k_heads)


def gdn_verify_reference(qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_pool: torch.Tensor,
                         conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                         state_pool: torch.Tensor, slot_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                         conv_out: torch.Tensor, state_out: torch.Tensor, num_k_heads: int) -> torch.Tensor:
    """``gdn_verify`` in torch: position ``t`` of every request with more than ``t`` rows at once,
    as one decode step over the requests' states held aside (reads the row bounds on the host)."""
    from .gated_delta_net import l2norm

    check_verify_args(qkv, conv_pool, conv_weight, state_pool, slot_ids, cu_seqlens, conv_out, state_out,
                      num_k_heads)
    rows, c = qkv.shape
    _, hv, dk, dv = state_pool.shape
    key_dim = num_k_heads * dk
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    weight = conv_weight.reshape(c, -1)  # [C, W]
    bounds = cu_seqlens.to(torch.long)
    starts, widths = bounds[:-1], bounds[1:] - bounds[:-1]
    conv = conv_pool.index_select(0, slot_ids)
    rec = state_pool.index_select(0, slot_ids)
    out = qkv.new_empty(rows, hv, dv)
    for t in range(int(widths.max()) if widths.numel() else 0):
        live = (widths > t).nonzero().flatten()
        at = starts[live] + t
        n = live.shape[0]
        window = torch.cat([conv.index_select(0, live), qkv.index_select(0, at)[:, None, :].to(conv.dtype)], dim=1)
        mixed = F.silu(torch.einsum("bwc,cw->bc", window.float(), weight.float())).to(qkv.dtype)
        conv.index_copy_(0, live, window[:, 1:])
        q, k, v = mixed.split([key_dim, key_dim, hv * dv], dim=-1)
        q = l2norm(q.reshape(n, num_k_heads, dk))
        k = l2norm(k.reshape(n, num_k_heads, dk))
        o, s = recurrent_step_batched(q, k, v.reshape(n, hv, dv), g.index_select(0, at), beta.index_select(0, at),
                                      rec.index_select(0, live))
        held = s.to(rec.dtype)
        rec.index_copy_(0, live, held)
        out.index_copy_(0, at, o.to(out.dtype))
        conv_out.index_copy_(0, at, window[:, 1:])
        state_out.index_copy_(0, at, held)
    return out
