"""Token embedding rows read from a table in pinned host memory (``--embedding-host``).

Pinned host memory is mapped into the GPU's address space, so a kernel reads the rows a step
needs in place over the bus: a few KiB a token, with no host sync and no copy of the table, and
the lookup stays inside the captured decode graphs. Reference: ``torch.nn.functional.embedding``
on the same table.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _gather_rows_kernel(table, ids, out, D, stride_t, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    row = tl.load(ids + i).to(tl.int64)
    values = tl.load(table + row * stride_t + cols, mask=mask)
    tl.store(out + i.to(tl.int64) * D + cols, values, mask=mask)


def host_embedding_triton(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` ``[*ids.shape, D]`` on ``ids``' device, ``table`` ``[V, D]`` in pinned host
    memory (rows contiguous)."""
    flat = ids.reshape(-1)
    d = table.shape[1]
    out = torch.empty(flat.shape[0], d, dtype=table.dtype, device=ids.device)
    if flat.numel():
        _gather_rows_kernel[(flat.shape[0], triton.cdiv(d, BLOCK))](table, flat, out, d, table.stride(0),
                                                                   BLOCK=BLOCK, num_warps=4)
    return out.view(*ids.shape, d)
