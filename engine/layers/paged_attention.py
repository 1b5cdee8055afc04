"""Decode attention over the paged KV pool: one query token per sequence, GQA.

``paged_decode_attention`` dispatches to the Triton kernel (``paged_attention_triton.py``) on CUDA
and to ``paged_decode_attention_ref`` elsewhere; the reference is what the kernel is tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _check(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor) -> None:
    b, h, d = q.shape
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape or k_pages.shape[-1] != d:
        raise ValueError(f"paged attention: q {tuple(q.shape)}, pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)}")
    if h % k_pages.shape[2]:
        raise ValueError(f"paged attention: {h} query heads for {k_pages.shape[2]} KV heads")
    if block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError("paged attention: block_tables / context_lens do not match the batch")


def paged_decode_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """``q`` ``[B, H, D]``; pages ``[num_pages, P, Hkv, D]``; ``block_tables`` ``[B, M]``;
    ``context_lens`` ``[B]``. Query ``b`` attends to its first ``context_lens[b]`` cached tokens."""
    _check(q, k_pages, v_pages, block_tables, context_lens)
    b, h, d = q.shape
    _, p, hkv, _ = k_pages.shape
    m = block_tables.shape[1]
    k = k_pages[block_tables.long()].reshape(b, m * p, hkv, d).float()  # [B, S, Hkv, D]
    v = v_pages[block_tables.long()].reshape(b, m * p, hkv, d).float()
    group = h // hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale
    valid = torch.arange(m * p, device=q.device)[None, :] < context_lens[:, None].long()
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhs,bshd->bhd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[B, H, D]``; with ``gate`` ``[B, H, D]`` it is multiplied by ``sigmoid(gate)``."""
    if q.is_cuda:
        from .paged_attention_triton import paged_decode_attention_triton

        _check(q, k_pages, v_pages, block_tables, context_lens)
        return paged_decode_attention_triton(q, k_pages, v_pages, block_tables, context_lens, scale, gate)
    out = paged_decode_attention_sdpa(q, k_pages, v_pages, block_tables, context_lens, scale)
    return out if gate is None else out * torch.sigmoid(gate)


def paged_decode_attention_sdpa(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """``paged_decode_attention_ref`` through torch's fused attention (the CPU path): each KV
    head's group of query heads are the queries of one call, so K and V are gathered once and
    never repeated per query head."""
    _check(q, k_pages, v_pages, block_tables, context_lens)
    b, h, d = q.shape
    _, p, hkv, _ = k_pages.shape
    m = block_tables.shape[1]
    k = k_pages[block_tables.long()].reshape(b, m * p, hkv, d).transpose(1, 2)  # [B, Hkv, S, D]
    v = v_pages[block_tables.long()].reshape(b, m * p, hkv, d).transpose(1, 2)
    valid = torch.arange(m * p, device=q.device)[None, :] < context_lens[:, None].long()
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d).to(k.dtype), k, v,
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(b, h, d).to(q.dtype)
