"""The short convolution of a Gated DeltaNet layer's prompt rows, from and to their state slots,
in two Triton launches.

A step's prompt rows are a flat run of ``T`` tokens (``cu_seqlens``), each row over its own state
slot. The conv input is the rows' projections, whole (``[T, C]``, ``C = 2 * key_dim + value_dim``)
or as their q, k and v channel groups; the slot's conv state holds the ``W - 1`` raw inputs before
the row's first token (``[slots, W - 1, C]``, oldest first).

- ``_conv_kernel``: one program per (64-token chunk of a row, head of q, k or v) computes the
  depthwise causal conv and SiLU over the row's tokens, the window's rows before the row read
  from the slot, and writes q and k l2-normalised per head (eps 1e-6, as ``gated_delta_net.l2norm``)
  and v, each ``[T, heads, D]`` contiguous: what the chunked delta rule takes, with no copies.
- ``_state_kernel``: one program per (row, head) then writes the row's last ``W - 1`` inputs into
  its slot (a row shorter than that keeps the older rows of the slot's state, shifted).

Two launches, so every chunk reads the slot's state before any row's state is replaced. This takes
the place of gathering the slots' states, fla-core's conv (its autograd wrapper, the state kernel,
the layout changes of its state) and the two l2 norms, about ten launches a layer with their
Python around them. The torch reference is ``gdn_prompt.prompt_conv_reference``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..models.base import GDN_CHUNK

# the conv's warps a program: 8 take the 9B's 768-token step's conv in 29 us a layer against 37 at
# 4 (67 / 86 at 2,048 tokens; 1 or 2 spill, over 400 us: H100, bench/RESULTS.md)
CONV_WARPS = 8


@triton.jit
def _source(q_ptr, k_ptr, v_ptr, sq, sk, sv, h, HK: tl.constexpr, D: tl.constexpr):
    """Head ``h`` of [q heads | k heads | v heads]: its input pointer (at its first channel) and row stride."""
    if h < HK:
        src = q_ptr + h * D
        stride = sq
    elif h < 2 * HK:
        src = k_ptr + (h - HK) * D
        stride = sk
    else:
        src = v_ptr + (h - 2 * HK) * D
        stride = sv
    return src, stride


@triton.jit
def _conv_kernel(q_ptr, k_ptr, v_ptr, sq, sk, sv, w_ptr, pool_ptr, slots_ptr, cu_ptr, chunks_ptr,
                 qo_ptr, ko_ptr, vo_ptr, eps,
                 HK: tl.constexpr, HV: tl.constexpr, D: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
                 BT: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(chunks_ptr + 2 * i)
    c = tl.load(chunks_ptr + 2 * i + 1)
    bos = tl.load(cu_ptr + row)
    eos = tl.load(cu_ptr + row + 1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    t = bos + c * BT + tl.arange(0, BT)
    valid = t < eos
    d = tl.arange(0, D)
    ch = h * D + d
    src, stride = _source(q_ptr, k_ptr, v_ptr, sq, sk, sv, h, HK, D)
    state = pool_ptr + slot * (W - 1) * C
    acc = tl.zeros([BT, D], dtype=tl.float32)
    for j in tl.static_range(W):
        at = t + (j - (W - 1))
        inside = at >= bos
        x = tl.load(src + at[:, None] * stride + d[None, :], mask=(valid & inside)[:, None], other=0.0)
        s = tl.load(state + (at - bos + (W - 1))[:, None] * C + ch[None, :], mask=(valid & (at < bos))[:, None],
                    other=0.0)
        wj = tl.load(w_ptr + ch * W + j).to(tl.float32)
        acc += (x.to(tl.float32) + s.to(tl.float32)) * wj[None, :]
    y = acc * tl.sigmoid(acc)
    if h < 2 * HK:
        y = y * tl.rsqrt(tl.sum(y * y, axis=1) + eps)[:, None]
        if h < HK:
            out = qo_ptr + t[:, None] * (HK * D) + (h * D + d)[None, :]
        else:
            out = ko_ptr + t[:, None] * (HK * D) + ((h - HK) * D + d)[None, :]
    else:
        out = vo_ptr + t[:, None] * (HV * D) + ((h - 2 * HK) * D + d)[None, :]
    tl.store(out, y.to(out.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _state_kernel(q_ptr, k_ptr, v_ptr, sq, sk, sv, pool_ptr, slots_ptr, cu_ptr,
                  HK: tl.constexpr, D: tl.constexpr, C: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    bos = tl.load(cu_ptr + row)
    eos = tl.load(cu_ptr + row + 1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    r = tl.arange(0, W_PAD)
    keep = r < W - 1
    at = eos - (W - 1) + r
    inside = at >= bos
    d = tl.arange(0, D)
    ch = h * D + d
    src, stride = _source(q_ptr, k_ptr, v_ptr, sq, sk, sv, h, HK, D)
    state = pool_ptr + slot * (W - 1) * C
    x = tl.load(src + at[:, None] * stride + d[None, :], mask=(keep & inside)[:, None], other=0.0)
    s = tl.load(state + (at - bos + (W - 1))[:, None] * C + ch[None, :], mask=(keep & (at < bos))[:, None],
                other=0.0)
    new = tl.where(inside[:, None], x.to(state.dtype.element_ty), s)
    tl.store(state + r[:, None] * C + ch[None, :], new, mask=keep[:, None])


def _rows(t: torch.Tensor, name: str) -> int:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"prompt conv: {name} {tuple(t.shape)} strides {t.stride()} needs contiguous rows")
    return t.stride(0)


def prompt_conv_triton(groups: tuple[torch.Tensor, ...], weight: torch.Tensor, conv_pool: torch.Tensor,
                       slots: torch.Tensor, cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor,
                       num_k_heads: int, head_dim: int, eps: float = 1e-6
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``groups``: the conv input ``[T, C]``, or its q, k, v channel groups (rows may be strided,
    columns contiguous); ``weight`` ``[C, 1, W]`` or ``[C, W]``; ``conv_pool`` ``[slots, W-1, C]``
    contiguous, updated in place; ``slots`` ``[N]`` and ``cu_seqlens`` ``[N + 1]`` int64 on the
    device; ``chunk_indices`` ``[chunks, 2]`` (row, chunk of ``GDN_CHUNK`` tokens in the row:
    ``models.base.chunk_pairs``, fla-core's table). Returns q, k ``[T, Hk, D]``
    (l2-normalised) and v ``[T, Hv, D]``, contiguous in the input's dtype."""
    if len(groups) == 1:
        key_dim = num_k_heads * head_dim
        whole = groups[0]
        groups = (whole[:, :key_dim], whole[:, key_dim: 2 * key_dim], whole[:, 2 * key_dim:])
    q, k, v = groups
    t, c = q.shape[0], q.shape[1] + k.shape[1] + v.shape[1]
    hk, hv = q.shape[1] // head_dim, v.shape[1] // head_dim
    weight = weight.reshape(weight.shape[0], -1)
    width = weight.shape[1]
    if head_dim & (head_dim - 1) or hk != num_k_heads or v.shape[1] % head_dim:
        raise ValueError(f"prompt conv: q {tuple(q.shape)}, v {tuple(v.shape)} for {num_k_heads} key heads of "
                         f"{head_dim} (a power of two, shared by v)")
    if weight.shape[0] != c or not weight.is_contiguous():
        raise ValueError(f"prompt conv: weight {tuple(weight.shape)} for {c} channels, contiguous")
    if conv_pool.shape[1:] != (width - 1, c) or not conv_pool.is_contiguous():
        raise ValueError(f"prompt conv: conv_pool {tuple(conv_pool.shape)}, expected [slots, {width - 1}, {c}]")
    strides = (_rows(q, "q"), _rows(k, "k"), _rows(v, "v"))
    qo = torch.empty((t, hk, head_dim), dtype=q.dtype, device=q.device)
    ko = torch.empty_like(qo)
    vo = torch.empty((t, hv, head_dim), dtype=q.dtype, device=q.device)
    rows, heads = slots.shape[0], 2 * hk + hv
    if t == 0 or rows == 0:
        return qo, ko, vo
    _conv_kernel[(chunk_indices.shape[0], heads)](
        q, k, v, *strides, weight, conv_pool, slots, cu_seqlens, chunk_indices, qo, ko, vo, eps,
        HK=hk, HV=hv, D=head_dim, C=c, W=width, BT=GDN_CHUNK, num_warps=CONV_WARPS)
    _state_kernel[(rows, heads)](q, k, v, *strides, conv_pool, slots, cu_seqlens, HK=hk, D=head_dim, C=c, W=width,
                                 W_PAD=triton.next_power_of_2(max(width - 1, 1)), num_warps=1)
    return qo, ko, vo
