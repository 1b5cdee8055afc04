"""Paged K/V pools with several rows of prompt queries, for the prompt attention kernel's tests
(the GPU tests at real sizes in bf16, the interpreter tests at small sizes in fp32)."""
from __future__ import annotations

from types import SimpleNamespace

import torch


def paged_rows(rows: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, page: int,
               dtype: torch.dtype, device: str, gated: bool = False, spare_pages: int = 3) -> SimpleNamespace:
    """``rows``: ``(cached prefix, new queries)`` per row. Every row's pages are drawn from one
    shuffled pool; slots past a row's context (the rest of its last page, the spare pages) hold
    NaN (page 0, where a masked page-table read points, among them) and block-table columns past
    its pages hold -1, so a read past the context shows in the output. The query is a view of
    rows ``[q | gate]`` per head, as a gated layer's projection lays them out (a plain layer's
    too, the gate half unused)."""
    ctxs = [prefix + n for prefix, n in rows]
    need = [-(-c // page) for c in ctxs]
    num_pages = 1 + sum(need) + spare_pages
    k = torch.full((num_pages, page, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    v = torch.full_like(k, float("nan"))
    perm = 1 + torch.randperm(num_pages - 1, device=device)  # page 0 stays NaN: where a masked read lands
    tables = torch.full((len(rows), max(need) + 1), -1, dtype=torch.int32, device=device)
    used = 0
    for r, (ctx, n) in enumerate(zip(ctxs, need)):
        pages = perm[used: used + n]
        used += n
        tables[r, :n] = pages.int()
        slots = (pages[:, None] * page + torch.arange(page, device=device)).flatten()[:ctx]
        k.view(-1, kv_heads, head_dim)[slots] = torch.randn(ctx, kv_heads, head_dim, device=device).to(dtype)
        v.view(-1, kv_heads, head_dim)[slots] = torch.randn(ctx, kv_heads, head_dim, device=device).to(dtype)
    lens = [n for _, n in rows]
    raw = torch.randn(sum(lens), heads, 2 * head_dim, device=device).to(dtype)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return SimpleNamespace(q=raw[:, :, :head_dim], gate=raw[:, :, head_dim:] if gated else None, k=k, v=v,
                           tables=tables, cu=cu, ctx=torch.tensor(ctxs, dtype=torch.int32, device=device),
                           max_q=max(lens), scale=head_dim**-0.5)


def dense_reference(case: SimpleNamespace) -> torch.Tensor:
    """Row by row from contiguous K/V read back token by token through the block table, with an
    explicit position mask and torch's SDPA in fp64: independent of the reference under test."""
    page = case.k.shape[1]
    outs = []
    for r, ctx in enumerate(case.ctx.tolist()):
        start, end = case.cu[r].item(), case.cu[r + 1].item()
        if start == end:
            continue
        pos = torch.arange(ctx)
        slots = case.tables[r].long().cpu()[pos // page] * page + pos % page
        keys = case.k.flatten(0, 1)[slots.to(case.k.device)].double()  # [ctx, Hkv, D]
        values = case.v.flatten(0, 1)[slots.to(case.k.device)].double()
        q = case.q[start:end].double()
        group = q.shape[1] // keys.shape[1]
        q_pos = torch.arange(ctx - (end - start), ctx)
        mask = (pos[None, :] <= q_pos[:, None]).to(q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
            values.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=case.scale)
        outs.append(out.transpose(0, 1))
    out = torch.cat(outs)
    return out if case.gate is None else out * torch.sigmoid(case.gate.double())
