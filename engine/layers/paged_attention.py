"""Decode attention over the paged KV pool: one query token per sequence, GQA.

``paged_decode_attention`` dispatches to the Triton kernel (``paged_attention_triton.py``) on CUDA
and to ``paged_decode_attention_ref`` elsewhere; the reference is what the kernel is tested against. Pages of one-byte elements (``--kv-dtype fp8``
/ ``int8``) come with ``k_scale`` / ``v_scale`` ``[num_pages, P, Hkv]``, one per row
(``cache/kv_quant.py``): the references dequantize the gathered rows, the kernel folds the key
scales into the scores and dequantizes the value tiles. 4-bit pages (``--kv-dtype 4bit``) are
``[num_pages, P, Hkv, D / 2]`` bytes, the keys with ranges ``[num_pages, 2, Hkv, D]`` (a step and
a minimum per page and channel), the values with scales ``[num_pages, P, Hkv, D / 32]``: every
reader dequantizes their tiles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.kv_quant import dequantize, dequantize_keys4, is_packed, raw_bytes


def page_width(k_pages: torch.Tensor, head_dim: int) -> int:
    """The pages' last dim for rows of ``head_dim``: ``head_dim``, or half of it for 4-bit pages."""
    return head_dim // 2 if is_packed(k_pages.dtype) else head_dim


def _check(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor) -> None:
    b, h, d = q.shape
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape or k_pages.shape[-1] != page_width(k_pages, d):
        raise ValueError(f"paged attention: q {tuple(q.shape)}, pages {tuple(k_pages.shape)} / {tuple(v_pages.shape)}")
    if h % k_pages.shape[2]:
        raise ValueError(f"paged attention: {h} query heads for {k_pages.shape[2]} KV heads")
    if block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError("paged attention: block_tables / context_lens do not match the batch")


def dequantize_pages(pages: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
                     keys: bool) -> torch.Tensor:
    """Whole pages ``[n, P, Hkv, *]`` with their scales (indexed by the same pages) to ``[n, P, Hkv, D]``
    in ``dtype``: 4-bit keys through their ranges per page and channel, the rest row by row."""
    if keys and is_packed(pages.dtype):
        return dequantize_keys4(pages, scales, dtype)
    return dequantize(pages, scales, dtype)


def _gather(pages: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
            dtype: torch.dtype, keys: bool) -> torch.Tensor:
    """Each sequence's pages ``[B, M * P, Hkv, D]`` in ``dtype``, dequantized where ``scales`` are given.
    Whole pages through ``index_select`` (on the CPU a third or less of what indexing with the table
    takes: 5 against 14-38 us for SmolLM2's 12 pages of a 192-token context, twice per layer)."""
    b, m = block_tables.shape
    _, p, hkv, _ = pages.shape
    index = block_tables.reshape(-1)
    rows = raw_bytes(pages).index_select(0, index).view(pages.dtype)  # e4m3: selected as its bytes
    rows = dequantize_pages(rows, None if scales is None else scales.index_select(0, index), dtype, keys)
    return rows.reshape(b, m * p, hkv, rows.shape[-1])


def paged_decode_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[B, H, D]``; pages ``[num_pages, P, Hkv, D]`` (with scales ``[num_pages, P, Hkv]``
    when quantized; 4-bit: ``[..., D / 2]``, key ranges ``[num_pages, 2, Hkv, D]``, value scales
    ``[..., D / 32]``); ``block_tables`` ``[B, M]``; ``context_lens`` ``[B]``. Query ``b`` attends to
    its first ``context_lens[b]`` cached tokens."""
    _check(q, k_pages, v_pages, block_tables, context_lens)
    b, h, d = q.shape
    _, p, hkv, _ = k_pages.shape
    m = block_tables.shape[1]
    k = _gather(k_pages, k_scale, block_tables, torch.float32, True)  # [B, S, Hkv, D]
    v = _gather(v_pages, v_scale, block_tables, torch.float32, False)
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
                           gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[B, H, D]``; with ``gate`` ``[B, H, D]`` it is multiplied by ``sigmoid(gate)``."""
    if q.is_cuda:
        from .paged_attention_triton import paged_decode_attention_triton

        _check(q, k_pages, v_pages, block_tables, context_lens)
        return paged_decode_attention_triton(q, k_pages, v_pages, block_tables, context_lens, scale, gate,
                                             k_scale=k_scale, v_scale=v_scale)
    out = paged_decode_attention_sdpa(q, k_pages, v_pages, block_tables, context_lens, scale, k_scale, v_scale)
    return out if gate is None else out * torch.sigmoid(gate)


def paged_decode_attention_sdpa(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                block_tables: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_decode_attention_ref`` through torch's fused attention (the CPU path): each KV
    head's group of query heads are the queries of one call, so K and V are gathered once and
    never repeated per query head (quantized pages: dequantized to ``q``'s dtype as gathered)."""
    _check(q, k_pages, v_pages, block_tables, context_lens)
    b, h, d = q.shape
    _, p, hkv, _ = k_pages.shape
    m = block_tables.shape[1]
    dtype = k_pages.dtype if k_scale is None else q.dtype
    k = _gather(k_pages, k_scale, block_tables, dtype, True).transpose(1, 2)  # [B, Hkv, S, D]
    v = _gather(v_pages, v_scale, block_tables, dtype, False).transpose(1, 2)
    valid = torch.arange(m * p, device=q.device)[None, :] < context_lens[:, None].long()
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d).to(k.dtype), k, v,
                                         attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(b, h, d).to(q.dtype)
