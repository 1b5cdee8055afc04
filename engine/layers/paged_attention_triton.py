"""Triton kernels for paged decode attention (flash-decoding: split the context, then reduce).

Phase 1: one program per (sequence, KV head, split) runs an online softmax over its share of the
context for all query heads of that KV head at once (GQA group on the M axis of ``tl.dot``) and
writes partial max / sum / accumulator. Phase 2: one program per (sequence, query head) merges the
splits. Grid sizes depend only on the batch and the pool's maximum pages per sequence, so a step
can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_TOKENS = 512  # context tokens per program in phase 1


@triton.jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale,
                    stride_bt, num_splits,
                    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(len_ptr + b)
    start = s * SPLIT
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if start < ctx:  # splits past the context only record an empty partial
        for off in range(start, start + SPLIT, BLOCK_N):
            t = off + tl.arange(0, BLOCK_N)
            tmask = t < ctx
            page = tl.load(bt_ptr + b * stride_bt + t // P, mask=tmask, other=0).to(tl.int64)
            row = (page * P + t % P) * HKV + kvh
            k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=tmask[:, None], other=0.0)
            v = tl.load(v_ptr + row[:, None] * D + offs_d[None, :], mask=tmask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [G_PAD, BLOCK_N]
            scores = tl.where(tmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
    base = (b * H + heads) * num_splits + s
    tl.store(m_ptr + base, m_i, mask=gmask)
    tl.store(l_ptr + base, l_i, mask=gmask)
    tl.store(acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, num_splits, D: tl.constexpr, S_PAD: tl.constexpr):
    bh = tl.program_id(0)
    offs_s = tl.arange(0, S_PAD)
    smask = offs_s < num_splits
    m = tl.load(m_ptr + bh * num_splits + offs_s, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + bh * num_splits + offs_s, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    denom = tl.sum(w * l, 0)
    offs_d = tl.arange(0, D)
    acc = tl.load(acc_ptr + (bh * num_splits + offs_s)[:, None] * D + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + bh * D + offs_d, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention_triton(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float) -> torch.Tensor:
    b, h, d = q.shape
    _, p, hkv, _ = k_pages.shape
    if d & (d - 1) or not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("paged attention kernel: head_dim must be a power of two and pages contiguous")
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    group = h // hkv
    g_pad = max(16, triton.next_power_of_2(group))
    max_tokens = block_tables.shape[1] * p
    split = min(SPLIT_TOKENS, triton.next_power_of_2(max(max_tokens, 16)))
    num_splits = triton.cdiv(max_tokens, split)
    m = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    block_n = 32 if d >= 256 else 64
    _partial_kernel[(b, hkv, num_splits)](
        q, k_pages, v_pages, block_tables, context_lens, m, l, acc, scale,
        block_tables.stride(0), num_splits,
        H=h, HKV=hkv, D=d, P=p, GROUP=group, G_PAD=g_pad, BLOCK_N=block_n, SPLIT=split,
        num_warps=4, num_stages=2,
    )
    out = torch.empty_like(q)
    _reduce_kernel[(b * h,)](m, l, acc, out, num_splits, D=d, S_PAD=triton.next_power_of_2(num_splits))
    return out
