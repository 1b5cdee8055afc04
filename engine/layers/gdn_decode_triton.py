"""Fused Triton kernels for one Gated DeltaNet decode step, working in place on the state pool.

``conv_step``: for every sequence, the depthwise causal conv over [last W-1 inputs | new input],
SiLU, and the shift of the conv state, in place in the sequence's slot.
``recurrent_step``: l2-normalised q and k, ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``, the delta-rule update of the fp32 state in place in the slot, and the output.
Two launches replace the two dozen small ops of the torch path (``GatedDeltaNet._decode_torch``,
the reference these are tested against); slot ids are read on the device, so a CUDA graph can
capture the step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(x_ptr, state_ptr, w_ptr, slot_ptr, out_ptr, C,
                      W: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    base = state_ptr + slot * (W - 1) * C
    x = tl.load(x_ptr + b * C + cols, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(w_ptr + cols * W + (W - 1), mask=mask, other=0.0).to(tl.float32)
    prev = tl.load(base + cols, mask=mask, other=0.0)
    acc += prev.to(tl.float32) * tl.load(w_ptr + cols * W, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, W - 1):
        cur = tl.load(base + j * C + cols, mask=mask, other=0.0)
        acc += cur.to(tl.float32) * tl.load(w_ptr + cols * W + j, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + (j - 1) * C + cols, cur, mask=mask)
    tl.store(base + (W - 2) * C + cols, x.to(state_ptr.dtype.element_ty), mask=mask)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * C + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _recurrent_step_kernel(mixed_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, out_ptr,
                           C, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BV: tl.constexpr):
    bi = tl.program_id(0)
    hv = tl.program_id(1)
    vcols = tl.program_id(2) * BV + tl.arange(0, BV)
    h = hv // (HV // H)
    kk = tl.arange(0, K)
    row = mixed_ptr + bi * C
    q = tl.load(row + h * K + kk).to(tl.float32)
    k = tl.load(row + H * K + h * K + kk).to(tl.float32)
    v = tl.load(row + 2 * H * K + hv * V + vcols).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    x = tl.load(a_ptr + bi * HV + hv).to(tl.float32) + tl.load(dtb_ptr + hv).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)) * softplus
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + bi * HV + hv).to(tl.float32)))
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    s_ptr = state_ptr + (slot * HV + hv) * K * V + kk[:, None] * V + vcols[None, :]
    s = tl.load(s_ptr) * tl.exp(g)
    delta = beta * (v - tl.sum(s * k[:, None], 0))
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptr, s)
    o = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + (bi * HV + hv) * V + vcols, o.to(out_ptr.dtype.element_ty))


def conv_step_triton(x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor,
                     slot_ids: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, C]`` new pre-conv rows; ``conv_pool`` ``[slots, W-1, C]`` (updated in place);
    ``weight`` ``[C, W]``. Returns SiLU(conv) ``[B, C]``."""
    b, c = x.shape
    width = weight.shape[-1]
    if conv_pool.shape[1:] != (width - 1, c) or not conv_pool.is_contiguous():
        raise ValueError(f"conv_step: pool {tuple(conv_pool.shape)} for x {tuple(x.shape)}, width {width}")
    x, weight = x.contiguous(), weight.reshape(c, width).contiguous()
    out = torch.empty_like(x)
    _conv_step_kernel[(b, triton.cdiv(c, 1024))](x, conv_pool, weight, slot_ids, out, c, W=width, BLOCK=1024)
    return out


def recurrent_step_triton(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                          dt_bias: torch.Tensor, state_pool: torch.Tensor, slot_ids: torch.Tensor,
                          num_k_heads: int, head_k_dim: int) -> torch.Tensor:
    """``mixed`` ``[B, C]`` (conv output, [q | k | v]); ``a``, ``b`` ``[B, HV]`` raw projections;
    ``state_pool`` ``[slots, HV, K, V]`` fp32 (updated in place). Returns ``[B, HV, V]``."""
    bsz, c = mixed.shape
    _, hv, dk, dv = state_pool.shape
    if dk != head_k_dim or state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError(f"recurrent_step: state pool {tuple(state_pool.shape)} {state_pool.dtype}")
    out = torch.empty((bsz, hv, dv), dtype=mixed.dtype, device=mixed.device)
    bv = min(32, dv)
    _recurrent_step_kernel[(bsz, hv, triton.cdiv(dv, bv))](
        mixed.contiguous(), a.contiguous(), b.contiguous(), A_log, dt_bias, state_pool, slot_ids, out,
        c, dk**-0.5, H=num_k_heads, HV=hv, K=dk, V=dv, BV=bv, num_warps=4)
    return out
