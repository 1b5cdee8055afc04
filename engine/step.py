"""The step description: one flat, varlen picture of a step's rows over the shared pools.

A plan of ``(request, n)`` rows becomes the token ids and positions of the flat run and a
``StepMeta`` (``models/base.py``): the rows of one token first (decode rows), then the rows of
several (prompt chunks, forced tokens); per row its context length, block table, state slot and
query run; per token its KV write row (and write slot, where the pool keeps exact 4-bit keys);
and which tokens' logits are sampled. Everything is laid out in one host buffer and reaches the device in one copy (pinned on CUDA, so the copy is
asynchronous); the int32 part is one cast on the device.
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from .cache.kv_pool import pool_rows
from .cache.manager import CacheManager
from .models.base import ForwardBatch, PromptRows, StepMeta, VerifyRows, chunk_offsets, chunk_pairs
from .request import Request


@dataclass
class Step:
    """A step ready to run: the model's inputs, and the rows in the order the forward sees them."""

    input_ids: torch.Tensor  # [N] int64
    batch: ForwardBatch
    plan: list[tuple[Request, int]]  # decode rows first
    sample_index: torch.Tensor  # [S] int64: the flat tokens whose logits the sampled rows take
    sampled: list[Request]  # the rows that reach their next token, in ``sample_index`` order
    # per sampled row, how many of ``sample_index`` are its own: 1, or 1 + k for a row that
    # verifies a draft of k tokens (the logits of every position it runs); None: all 1
    widths: list[int] | None = None


def index_on(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index on ``device`` without waiting for it: on CUDA a pinned copy sent
    asynchronously (``torch.tensor(values, device=...)`` copies from pageable memory, which waits
    for the device's queue)."""
    host = _int64(values)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _int64(values: list[int]) -> torch.Tensor:
    """An int64 host tensor of ``values``, through an array (a third of ``torch.tensor``'s time
    on a step's thousands of entries)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.zeros(0, dtype=torch.long)


def _aligned(values: list[int], multiple: int) -> list[int]:
    """``values`` padded with zeros to a multiple of ``multiple`` elements."""
    return values + [0] * (-len(values) % multiple)


def drafted(req: Request, n: int) -> int:
    """How many of a row's ``n`` new tokens are its request's draft (those past ``num_tokens``)."""
    return max(req.num_computed + n - req.num_tokens, 0)


def order_rows(plan: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """Rows of one new token first (stable), then the rows that verify a draft, then the rest:
    the order of the step's flat token run."""
    verify = [row for row in plan if row[1] != 1 and drafted(*row)]
    return [row for row in plan if row[1] == 1] + verify + [row for row in plan if row[1] != 1 and not drafted(*row)]


def build_step(plan: list[tuple[Request, int]], caches: CacheManager, device: torch.device,
               ids: torch.Tensor | None = None) -> Step:
    """The step for ``plan`` (``ids``: the decode rows' input tokens already on the device, for a
    plan of decode rows only). Reads each request's ``num_computed`` as where its new tokens start;
    changes nothing.

    A row that runs past ``num_tokens`` verifies its request's ``draft`` (speculative
    decoding): it is laid out as one decode row per position, each with the context
    up to itself over the same pages (every K/V is written before any row attends), so every
    position is computed exactly as a one-token step computes it; all of them are sampled. In a
    model with Gated DeltaNet layers those rows share the request's state slot: those layers run
    each request's positions in order from the slot, which they only read (``VerifyRows``)."""
    plan = order_rows(plan)
    layout = []  # (request, first position, new tokens): the rows StepMeta describes
    verify = set()  # the requests whose rows verify a draft
    for req, n in plan:
        if n > 1 and drafted(req, n):
            layout += [(req, req.num_computed + i, 1) for i in range(n)]
            verify.add(id(req))
        else:
            layout.append((req, req.num_computed, n))
    input_ids, batch, sample_t, sampled, widths = _describe(layout, caches, device, ids, verify=verify)
    return Step(input_ids, batch, plan, sample_t, sampled, widths)


def build_rows(rows: list[tuple[Request, int, int]], tokens: list[int] | torch.Tensor, caches: CacheManager,
               device: torch.device) -> tuple[torch.Tensor, ForwardBatch, torch.Tensor]:
    """A forward over ``rows`` of ``(request, first position, tokens)`` with the given ``tokens``
    (flat, in the rows' order; the rows of one token first), outside the requests' cursors: the
    MTP head's rows (``mtp.py``). ``tokens`` on the device (rows of one token each: the head's
    own drafts, never read on the host) are the input ids as they are. Returns the input ids,
    the batch and the flat index of each row's last token."""
    if isinstance(tokens, torch.Tensor):
        if any(n != 1 for _, _, n in rows):
            raise ValueError("tokens on the device are for rows of one token each")
        input_ids, batch, _, _, _ = _describe(rows, caches, device, tokens)
        return input_ids, batch, torch.arange(len(rows), device=device)
    input_ids, batch, last, _, _ = _describe(rows, caches, device, None, tokens=tokens)
    return input_ids, batch, last


def _describe(layout: list[tuple[Request, int, int]], caches: CacheManager, device: torch.device,
              ids: torch.Tensor | None, verify: set[int] = frozenset(), tokens: list[int] | None = None):
    """The tensors of a step laid out as ``layout`` (decode rows first): input ids, the
    ``ForwardBatch``, the sampled flat indices, the sampled requests and their widths (None: one
    each). With ``tokens`` those are the input ids and every row's last token is sampled."""
    page = caches.page_size
    rows = len(layout)
    num_decode = sum(n == 1 for _, _, n in layout)
    width = max((len(r.cache.pages) for r, _, _ in layout), default=1) or 1
    given, tokens = tokens, []
    positions, writes, slots, lens, tables, kv_slots = [], [], [], [], [], []
    exact = caches.kv is not None and caches.kv.write_slots > 0  # each token's write slot, where the pool keeps them
    axes: list[torch.Tensor | None] = []  # per row, its M-RoPE positions where its request has images
    embeds: list[tuple[int, torch.Tensor]] = []  # (flat index of the first, image rows) placed in the run
    cu, sample, sampled, widths, end = [0], [], [], [], 0
    for i, (req, start, n) in enumerate(layout):
        cache = req.cache
        table = cache.pages
        if cache.kv is not None and start + n > cache.capacity:
            raise RuntimeError(f"KV pages for {cache.capacity} tokens, writing up to {start + n}: reserve first")
        if given is None and ids is None:
            if start >= req.num_tokens:  # a draft token
                tokens.append(req.draft[start - req.num_tokens])
            else:
                tokens.extend(req.all_ids[start : start + n] if n > 1 else (req.token_at(start),))
        media = req.media
        if media is None:
            positions.extend(range(start, start + n))
            axes.append(None)
        else:  # past its prompt a position is its index plus the request's offset, on all three axes
            rows3 = media.rows(start, n)
            positions.extend(rows3[0].tolist())
            axes.append(rows3)
            for im in media.overlapping(start, start + n) if given is None else ():  # the MTP head's rows take none
                lo, hi = max(start, im.start), min(start + n, im.end)
                if im.embeds is None:
                    raise RuntimeError("an image's tokens are in a step before the image is encoded")
                embeds.append((end + lo - start, im.embeds[lo - im.start : hi - im.start]))
        if table:
            writes.extend(pool_rows(table, start, n, page))
        else:
            writes.extend([0] * n)
        slots.append(cache.slot if cache.slot is not None else 0)
        if exact:
            kv_slots.extend([cache.kv_slot if cache.kv_slot is not None else caches.no_write_slot] * n)
        lens.append(start + n)
        tables.extend(table)
        tables.extend([0] * (width - len(table)))
        end += n
        if i >= num_decode:
            cu.append(end - num_decode)
        if given is not None:  # every row's last token
            sample.append(end - 1)
            sampled.append(req)
        elif start + n == req.num_tokens:  # everything known is computed: its next token is sampled
            sample.append(end - 1)
            sampled.append(req)
            widths.append(1)
        elif id(req) in verify:  # the token after a draft token
            sample.append(end - 1)
            widths[-1] += 1
    prompt_rows = rows - num_decode
    # every segment starts 16-byte aligned: Triton specializes a kernel on its pointers'
    # alignment, so unaligned slices would compile new variants as the row and token counts move
    if given is not None:
        tokens = list(given)
    pairs = chunk_pairs(cu) if prompt_rows else []
    offsets = chunk_offsets(cu) if prompt_rows else []
    wide = _aligned(tokens, 2) + _aligned(positions, 2) + _aligned(writes, 2) + _aligned(kv_slots, 2) + \
        _aligned(slots, 2) + _aligned(sample, 2) + _aligned(pairs, 2) + _aligned(offsets, 2)
    narrow = _aligned(lens, 4) + (_aligned(cu, 4) if prompt_rows else []) + tables
    host = _int64(wide + narrow)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    n_tok = end
    off = 0

    def take(count: int) -> torch.Tensor:
        nonlocal off
        out = dev[off : off + count]
        off += -(-count // 2) * 2
        return out

    input_ids = ids if ids is not None else take(n_tok)
    pos_t, write_t, kv_slot_t = take(n_tok), take(n_tok), take(len(kv_slots))
    slot_t, sample_t = take(rows), take(len(sample))
    pairs_t = take(len(pairs)).view(-1, 2)
    offsets_t = take(len(offsets))
    small = dev[off:].to(torch.int32)
    lens_t = small[:rows]
    prompt = None
    cu_at = len(_aligned(lens, 4))
    if prompt_rows:
        at, end = off + cu_at, off + cu_at + prompt_rows + 1
        prompt = PromptRows(cu_seqlens=small[cu_at : cu_at + prompt_rows + 1], cu_seqlens_long=dev[at:end],
                            cu_seqlens_host=host[at:end], max_seqlen=max(n for _, _, n in layout[num_decode:]),
                            slots_host=slots[num_decode:], chunks=pairs_t, chunk_offsets=offsets_t)
        cu_at += len(_aligned(cu, 4))
    verify = _verify_rows(layout, num_decode, verify, slots, device) if verify and caches.states is not None \
        else None
    meta = StepMeta(kv=caches.kv, states=caches.states, attn_ordinal=caches.attn_ordinal,
                    gdn_ordinal=caches.gdn_ordinal, block_tables=small[cu_at:].view(rows, width),
                    context_lens=lens_t, write_index=write_t, slot_ids=slot_t, num_decode=num_decode,
                    prompt=prompt, verify=verify, kv_slots=kv_slot_t if exact else None)
    batch = ForwardBatch(positions=pos_t, seq_lens=[n for _, _, n in layout], caches=[r.cache for r, _, _ in layout],
                         step=meta)
    if any(a is not None and not bool((a == a[0]).all()) for a in axes):  # image tokens: three-axis positions
        batch.mrope = torch.cat([a if a is not None else torch.arange(s, s + k, dtype=torch.long)[None].expand(3, -1)
                                 for a, (_, s, k) in zip(axes, layout)], dim=1).to(device)
    if embeds:
        index = torch.cat([torch.arange(at, at + rows.shape[0], dtype=torch.long) for at, rows in embeds]).to(device)
        batch.embeds = (index, torch.cat([rows for _, rows in embeds]).to(device))
    return input_ids, batch, sample_t, sampled, widths if len(sample) > len(sampled) else None


def _verify_rows(layout: list[tuple[Request, int, int]], num_decode: int, verify: set[int], slots: list[int],
                 device: torch.device) -> VerifyRows:
    """The verify rows of a step (``VerifyRows``): the decode rows from the first verifying
    request's on, each request's positions one after another."""
    first = next(i for i in range(num_decode) if id(layout[i][0]) in verify)
    cu, ids, requests = [0], [], {}
    i = first
    while i < num_decode:
        req = layout[i][0]
        if id(req) not in verify:
            raise RuntimeError("a plain decode row among the rows that verify drafts")
        width = 1
        while i + width < num_decode and layout[i + width][0] is req:
            width += 1
        requests[id(req)] = (cu[-1], width)
        ids.append(slots[i])
        cu.append(cu[-1] + width)
        i += width
    at = len(_aligned(ids, 2))  # the bounds 16-byte aligned, as every segment in ``_describe``
    host = torch.tensor(_aligned(ids, 2) + cu, dtype=torch.long)
    if device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    return VerifyRows(first=first, slots=dev[: len(ids)], cu_seqlens=dev[at:], positions=cu[-1], requests=requests)
