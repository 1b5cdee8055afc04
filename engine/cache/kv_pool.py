"""Paged K/V storage for the full-attention layers, allocated once at startup.

``keys[a]`` / ``values[a]`` for attention layer ordinal ``a`` are ``[num_pages, page_size, Hkv, D]``.
A sequence owns a list of page ids (its block table); token ``t`` lives at page ``table[t // P]``,
row ``t % P``. Pages are handed out from a free list; nothing is allocated after startup. A page
may be held by several owners (a prefix checkpoint and the sequences that continue from it): it
counts its holders and goes back to the free list when the last one releases it.

With a one-byte element type (``--kv-dtype fp8`` / ``int8``, ``kv_quant.py``) each (token, KV
head) row has an fp32 scale in ``k_scales[a]`` / ``v_scales[a]`` ``[num_pages, P, Hkv]``, at the
row's own index; ``tensors`` lists every tensor indexed by page on its dim 1, which is what a
copy of pages (``copy_page``, the host tier) copies. 4-bit pages (``--kv-dtype 4bit``) are
``[num_pages, page_size, Hkv, D / 2]`` bytes; the keys' ranges are per page and channel,
``k_scales[a]`` ``[num_pages, 2, Hkv, D]`` (fp16 steps and minimums), the values' scales per
group of the head dim, ``v_scales[a]`` ``[num_pages, P, Hkv, D / 32]`` (fp16).

With 4-bit pages and ``write_slots``, each running sequence may hold a write slot: the keys of
the page it is filling as computed, per attention layer (``key_rows`` ``[L_attn, slots + 1, P,
Hkv, D]`` in ``exact_dtype``, and the pool row each holds, ``key_rows_at`` ``[L_attn, slots + 1,
P]``), from which a write requantizes the page (``kv_quant.ExactKeys``); the last slot takes the
writes of rows without one (``no_write_slot``). Not pages: copies of pages leave them out.

``journal`` (a list, or None): where page copies and cleared write slots are noted, for the
tensor-parallel ranks to make the same in their own pools (``tp_steps.py``).
"""
from __future__ import annotations

import torch

from .kv_quant import KEY_STATS_DTYPE, SCALE_DTYPE, ExactKeys, is_packed, key_stats_shape, page_shapes, scale_dtype


class OutOfPagesError(RuntimeError):
    pass


def pool_row(table: list[int], pos: int, page_size: int) -> int:
    """Flat pool row (``page * P + offset``) of token ``pos`` of a sequence with block table ``table``."""
    return table[pos // page_size] * page_size + pos % page_size


def pool_rows(table: list[int], start: int, n: int, page_size: int) -> list[int]:
    """``pool_row`` of tokens ``start .. start + n``, a run of rows per page."""
    rows, pos, end = [], start, start + n
    while pos < end:
        page, offset = divmod(pos, page_size)
        take = min(page_size - offset, end - pos)
        base = table[page] * page_size + offset
        rows.extend(range(base, base + take))
        pos += take
    return rows


class PagedKVPool:
    def __init__(self, num_attn_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, write_slots: int = 0,
                 exact_dtype: torch.dtype = torch.float32) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"KV pool needs >= 1 page of >= 1 token, got {num_pages} x {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        rows = (num_attn_layers, num_pages, page_size, num_kv_heads)
        elements, scales = page_shapes(head_dim, dtype)
        self.keys = torch.zeros(rows + elements, dtype=dtype, device=device)
        self.values = torch.zeros(rows + elements, dtype=dtype, device=device)
        self.k_scales = self.v_scales = None
        if scales is not None:
            self.v_scales = torch.zeros(rows + scales, dtype=scale_dtype(dtype), device=device)
            if is_packed(dtype):  # a step and a minimum per page and channel
                k_shape, k_dtype = rows[:2] + key_stats_shape(num_kv_heads, head_dim), KEY_STATS_DTYPE
            else:
                k_shape, k_dtype = rows + scales, SCALE_DTYPE
            self.k_scales = torch.zeros(k_shape, dtype=k_dtype, device=device)
        self.key_rows = self.key_rows_at = None
        self.write_slots = write_slots if is_packed(dtype) else 0
        if self.write_slots:
            slots = (num_attn_layers, self.write_slots + 1, page_size)
            self.key_rows = torch.zeros(slots + (num_kv_heads, head_dim), dtype=exact_dtype, device=device)
            self.key_rows_at = torch.full(slots, -1, dtype=torch.long, device=device)
        self._free_write_slots: list[int] = list(range(self.write_slots - 1, -1, -1))
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._holders = [0] * num_pages
        self.journal: list[tuple] | None = None

    @staticmethod
    def bytes_per_page(num_attn_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elements, scales = page_shapes(head_dim, dtype)
        row = elements[0] * torch.empty((), dtype=dtype).element_size()
        if scales is not None:
            row += (scales[0] if scales else 1) * scale_dtype(dtype).itemsize
        per_page = 2 * num_attn_layers * page_size * num_kv_heads * row
        if is_packed(dtype):  # the keys' ranges take the place of their groups' scales
            per_page -= num_attn_layers * page_size * num_kv_heads * scales[0] * scale_dtype(dtype).itemsize
            per_page += num_attn_layers * num_kv_heads * head_dim * 2 * KEY_STATS_DTYPE.itemsize
        return per_page

    @staticmethod
    def bytes_per_write_slot(num_attn_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype, exact_dtype: torch.dtype) -> int:
        """Bytes of one write slot (the exact keys of a page and their rows) for pages of ``dtype``."""
        if not is_packed(dtype):
            return 0
        return num_attn_layers * page_size * (num_kv_heads * head_dim * exact_dtype.itemsize + 8)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a page's data lives in (pages on dim 1): K, V and, quantized, their scales."""
        return [self.keys, self.values] + ([] if self.k_scales is None else [self.k_scales, self.v_scales])

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every tensor of ``tensors``."""
        return sum(t[:, 0].numel() * t.element_size() for t in self.tensors)

    def layer(self, a: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attention layer ordinal ``a``'s K pages, V pages and their scales (None unquantized)."""
        if self.k_scales is None:
            return self.keys[a], self.values[a], None, None
        return self.keys[a], self.values[a], self.k_scales[a], self.v_scales[a]

    @property
    def no_write_slot(self) -> int:
        """The slot of rows written without one (read by no write)."""
        return self.write_slots

    def take_write_slot(self) -> int | None:
        """A write slot for a sequence (its exact rows forgotten), or None where none is free."""
        if not self._free_write_slots:
            return None
        slot = self._free_write_slots.pop()
        self.clear_write_slot(slot)
        return slot

    def clear_write_slot(self, slot: int) -> None:
        """Forget write slot ``slot``'s rows (queued on the device)."""
        self.key_rows_at[:, slot] = -1
        if self.journal is not None:
            self.journal.append(("clear_write_slot", slot))

    def give_write_slot(self, slot: int) -> None:
        self._free_write_slots.append(slot)

    def exact_keys(self, a: int, slots: torch.Tensor | None) -> ExactKeys | None:
        """Attention layer ordinal ``a``'s exact keys for rows of write slots ``slots`` (None
        where the pool keeps none or the step names no slots)."""
        if self.key_rows is None or slots is None:
            return None
        return ExactKeys(self.key_rows[a], self.key_rows_at[a], slots)

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
        for t in self.tensors:
            t[:, dst] = t[:, src]
        if self.journal is not None:
            self.journal.append(("copy_page", src, dst))
