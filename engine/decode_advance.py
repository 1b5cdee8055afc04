"""The decode inputs a captured step leaves for the step after it.

A greedy decode step of the same requests that follows a captured one needs, per row, the next
position, one more context token and the KV write row of that position; its token ids are
already in place (``cuda_graphs``: the argmax written over the input ids). ``advance_triton`` does
that at the end of the captured step, on the device; ``advance_reference`` does the same to host
tensors, where the graph decoder keeps its picture of the device's input buffer, so a step whose
staged inputs equal that picture needs no copy at all.

Rows at position 0 are padding (a real decode row is past its first prompt token) and stay as
they are. A row whose next position runs past its block-table row keeps its write row; its
staged table then differs from the picture, so the host sends the step's inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def advance_reference(positions: torch.Tensor, context_lens: torch.Tensor, write_index: torch.Tensor,
                      block_tables: torch.Tensor, page_size: int) -> None:
    """In place, rows ``[n]`` (tables ``[n, max_pages]``): position + 1, context length + 1, and
    the pool row of the new position, for every row not at position 0."""
    real = positions > 0
    nxt = positions + 1
    page = nxt // page_size
    inside = real & (page < block_tables.shape[1])
    entry = block_tables.gather(1, page.clamp(max=block_tables.shape[1] - 1).unsqueeze(1)).squeeze(1).long()
    write_index.copy_(torch.where(inside, entry * page_size + nxt % page_size, write_index))
    positions.copy_(torch.where(real, nxt, positions))
    context_lens.copy_(torch.where(real, context_lens + 1, context_lens))


@triton.jit
def _advance_kernel(pos_ptr, len_ptr, write_ptr, bt_ptr, n, max_pages, stride_bt,
                    P: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    pos = tl.load(pos_ptr + i, mask=m, other=0)
    real = m & (pos > 0)
    nxt = pos + 1
    page = nxt // P
    inside = real & (page < max_pages)
    entry = tl.load(bt_ptr + i * stride_bt + page, mask=inside, other=0).to(tl.int64)
    tl.store(write_ptr + i, entry * P + nxt % P, mask=inside)
    tl.store(pos_ptr + i, nxt, mask=real)
    lens = tl.load(len_ptr + i, mask=real, other=0)
    tl.store(len_ptr + i, lens + 1, mask=real)


def advance_triton(positions: torch.Tensor, context_lens: torch.Tensor, write_index: torch.Tensor,
                   block_tables: torch.Tensor, page_size: int) -> None:
    """``advance_reference`` in one launch of one program (a decode batch is at most a few dozen
    rows), no host sync, so a CUDA graph can end with it."""
    n = positions.shape[0]
    if not (context_lens.shape == write_index.shape == (n,) and block_tables.shape[0] == n
            and positions.dtype == write_index.dtype == torch.long and context_lens.dtype == torch.int32
            and block_tables.stride(1) == 1):
        raise ValueError(f"advance: positions {tuple(positions.shape)}, lengths {tuple(context_lens.shape)}, "
                         f"write rows {tuple(write_index.shape)}, tables {tuple(block_tables.shape)}")
    if n:
        _advance_kernel[(1,)](positions, context_lens, write_index, block_tables, n, block_tables.shape[1],
                              block_tables.stride(0), P=page_size, BLOCK=triton.next_power_of_2(n), num_warps=1)
