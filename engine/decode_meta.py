"""Building ``DecodeMeta`` (device tensors describing a decode step) from requests' caches."""
from __future__ import annotations

import torch

from .cache.kv_pool import pool_row
from .cache.manager import CacheManager
from .models.base import DecodeMeta
from .request import Request


def decode_rows(reqs: list[Request], page_size: int, max_pages: int, pad_page: int = 0
                ) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """Host-side rows: block tables padded to ``max_pages``, context lengths (with the new token),
    flat pool row of the new token, state slot."""
    tables, lens, writes, slots = [], [], [], []
    for req in reqs:
        cache = req.cache
        pos = cache.num_tokens
        tables.append(cache.pages + [pad_page] * (max_pages - len(cache.pages)))
        lens.append(pos + 1)
        writes.append(pool_row(cache.pages, pos, page_size) if cache.pages else 0)
        slots.append(cache.slot if cache.slot is not None else 0)
    return tables, lens, writes, slots


def build_decode_meta(reqs: list[Request], caches: CacheManager, device: torch.device) -> DecodeMeta:
    """An eager (uncaptured) decode step's metadata, tables as wide as the longest sequence."""
    page = caches.page_size
    max_pages = max((len(r.cache.pages) for r in reqs), default=1) or 1
    tables, lens, writes, slots = decode_rows(reqs, page, max_pages)
    return DecodeMeta(
        kv=caches.kv, states=caches.states, attn_ordinal=caches.attn_ordinal, gdn_ordinal=caches.gdn_ordinal,
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        write_index=torch.tensor(writes, dtype=torch.long, device=device),
        slot_ids=torch.tensor(slots, dtype=torch.long, device=device),
    )
