"""Varlen prompt attention over the paged KV pool: several rows' new tokens in one call, GQA.

The step's new tokens of ``R`` rows are packed flat: row ``r`` owns queries
``cu_seqlens_q[r] .. cu_seqlens_q[r + 1]`` and, after this chunk, ``ctx_lens[r]`` cached tokens
(its prefix plus the chunk, whose K/V are already written into the pages). Query ``i`` of a row
of ``n`` queries sits at position ``ctx_len - n + i`` and attends to keys ``0 ..= ctx_len - n + i``:
full over the cached prefix, causal within the chunk; a decode row is a row of one query.

``prefill_attention`` dispatches to the Triton kernel (``prefill_attention_triton.py``) on CUDA
and under Triton's interpreter, and to ``prefill_attention_ref`` elsewhere; the reference is what
the kernel is tested against.
"""
from __future__ import annotations

import torch

from .paged_attention import dequantize_pages, page_width
from .triton_switch import on_triton


def check_args(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
               cu_seqlens_q: torch.Tensor, ctx_lens: torch.Tensor, gate: torch.Tensor | None) -> None:
    """Shapes and dtypes only (no device values are read): ``q`` ``[T, H, D]``, pages
    ``[num_pages, P, Hkv, D]``, ``block_tables`` ``[R, M]``, ``cu_seqlens_q`` ``[R + 1]``,
    ``ctx_lens`` ``[R]`` (int32), ``gate`` like ``q``."""
    if q.dim() != 3 or k_pages.dim() != 4 or k_pages.shape != v_pages.shape or \
            k_pages.shape[-1] != page_width(k_pages, q.shape[-1]):
        raise ValueError(f"prefill attention: q {tuple(q.shape)}, pages {tuple(k_pages.shape)} / "
                         f"{tuple(v_pages.shape)}")
    if q.shape[1] % k_pages.shape[2]:
        raise ValueError(f"prefill attention: {q.shape[1]} query heads for {k_pages.shape[2]} KV heads")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"prefill attention: q {q.dtype}, pages {k_pages.dtype} / {v_pages.dtype}")
    r = ctx_lens.shape[0]
    if ctx_lens.dim() != 1 or cu_seqlens_q.shape != (r + 1,) or block_tables.dim() != 2 or \
            block_tables.shape[0] != r:
        raise ValueError(f"prefill attention: cu_seqlens_q {tuple(cu_seqlens_q.shape)}, ctx_lens "
                         f"{tuple(ctx_lens.shape)}, block_tables {tuple(block_tables.shape)} for {r} rows")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("ctx_lens", ctx_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32 or t.device != q.device:
            raise ValueError(f"prefill attention: {name} must be int32 on {q.device}, got {t.dtype} on {t.device}")
    if gate is not None and gate.shape != q.shape:
        raise ValueError(f"prefill attention: gate {tuple(gate.shape)} for q {tuple(q.shape)}")


def prefill_attention_ref(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                          block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, ctx_lens: torch.Tensor,
                          scale: float, gate: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's first ``ctx_len`` keys / values gathered from its pages (dequantized with their
    scales ``[num_pages, P, Hkv]`` where given: one-byte pages; 4-bit pages ``[..., D / 2]`` with
    key ranges ``[num_pages, 2, Hkv, D]`` and value scales ``[num_pages, P, Hkv, D / 32]``;
    ``cache/kv_quant.py``), then
    ``attention.causal_attention`` (fp32 scores and softmax); ``[T, H, D]`` in ``q``'s dtype,
    times ``sigmoid(gate)`` when a gate is given (as the torch path of ``Attention`` applies it)."""
    from .attention import causal_attention  # here: attention.py imports this module

    check_args(q, k_pages, v_pages, block_tables, cu_seqlens_q, ctx_lens, gate)
    page = k_pages.shape[1]
    bounds = cu_seqlens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b > e for b, e in zip(bounds, bounds[1:])):
        raise ValueError(f"prefill attention: cu_seqlens_q {bounds} for {q.shape[0]} query tokens")
    out = torch.empty_like(q)
    for r, ctx in enumerate(ctx_lens.tolist()):
        start, end = bounds[r], bounds[r + 1]
        if end - start > ctx or -(-ctx // page) > block_tables.shape[1]:
            raise ValueError(f"prefill attention: row {r} has {end - start} queries, {ctx} cached tokens, "
                             f"{block_tables.shape[1]} pages")
        if end == start:
            continue
        pages = block_tables[r, : -(-ctx // page)].long()
        keys, values = k_pages[pages], v_pages[pages]
        if k_scale is not None:
            keys = dequantize_pages(keys, k_scale[pages], torch.float32, True)
            values = dequantize_pages(values, v_scale[pages], torch.float32, False)
        keys, values = keys.flatten(0, 1)[:ctx], values.flatten(0, 1)[:ctx]
        out[start:end] = causal_attention(q[start:end], keys, values, scale)
    return out if gate is None else out * torch.sigmoid(gate)


def prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, ctx_lens: torch.Tensor,
                      max_seqlen_q: int, scale: float, gate: torch.Tensor | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[T, H, D]`` (times ``sigmoid(gate)`` with a gate ``[T, H, D]``, any row and
    head strides). ``max_seqlen_q``, the longest row's query count, is known on the host from the
    step's plan; it sizes the kernel's grid, so no device value is read."""
    if on_triton(q):
        from .prefill_attention_triton import prefill_attention_triton

        return prefill_attention_triton(q, k_pages, v_pages, block_tables, cu_seqlens_q, ctx_lens,
                                        max_seqlen_q, scale, gate, k_scale=k_scale, v_scale=v_scale)
    return prefill_attention_ref(q, k_pages, v_pages, block_tables, cu_seqlens_q, ctx_lens, scale, gate,
                                 k_scale, v_scale)
