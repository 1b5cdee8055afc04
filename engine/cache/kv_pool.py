"""Paged K/V storage for the full-attention layers, allocated once at startup.

``keys[a]`` / ``values[a]`` for attention layer ordinal ``a`` are ``[num_pages, page_size, Hkv, D]``.
A sequence owns a list of page ids (its block table); token ``t`` lives at page ``table[t // P]``,
row ``t % P``. Pages are handed out from a free list; nothing is allocated after startup. A page
may be held by several owners (a prefix checkpoint and the sequences that continue from it): it
counts its holders and goes back to the free list when the last one releases it.
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
        self._holders = [0] * num_pages

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
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._holders[p] = 1
        return pages

    def holders(self, page: int) -> int:
        return self._holders[page]

    def share(self, pages: list[int]) -> list[int]:
        """One more holder for each of ``pages`` (held already); returns them, as a new list."""
        for p in pages:
            self._holders[p] += 1
        return list(pages)

    def release(self, pages: list[int]) -> None:
        """Drop one hold on each of ``pages`` (the list is emptied); pages nobody holds are free."""
        for p in reversed(pages):
            self._holders[p] -= 1
            if self._holders[p] == 0:
                self._free.append(p)
        pages.clear()

    def copy_page(self, src: int, dst: int) -> None:
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]
