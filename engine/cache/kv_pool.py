"""Paged K/V storage for the full-attention layers, allocated once at startup.

``keys[a]`` / ``values[a]`` for attention layer ordinal ``a`` are ``[num_pages, page_size, Hkv, D]``.
A sequence owns a list of page ids (its block table); token ``t`` lives at page ``table[t // P]``,
row ``t % P``. Pages are handed out from a free list; nothing is allocated after startup.
"""
from __future__ import annotations

import torch


class OutOfPagesError(RuntimeError):
    pass


def pool_row(table: list[int], pos: int, page_size: int) -> int:
    """Flat pool row (``page * P + offset``) of token ``pos`` of a sequence with block table ``table``."""
    return table[pos // page_size] * page_size + pos % page_size


class PagedKVPool:
    def __init__(self, num_attn_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs >= 1 page of >= 1 token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_attn_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @staticmethod
    def bytes_per_page(num_attn_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return 2 * num_attn_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        pages.clear()
