"""One GEMM instead of several for projections that read the same input.

After loading, bias-free ``nn.Linear`` modules that share an input get one concatenated weight;
each module's ``weight`` becomes a view of its rows, so names and memory stay as they were. On
the GPU a decode step then launches one matrix-vector product where it launched three or four.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor | None:
    """The concatenated ``[sum(out), in]`` weight, or None when a module has a bias."""
    if any(lin.bias is not None for lin in linears):
        return None
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    offset = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[offset : offset + rows], requires_grad=False)
        offset += rows
    return fused


# Above this many rows (long prefill chunks) each part gets its own GEMM: the parts come out
# contiguous, so the kernels after them need no strided copies, and a GEMM this tall is efficient
# on its own. Shorter runs keep one GEMM: there the extra launches cost more than the copies.
SPLIT_ROWS = 2048


def split_linear(x: torch.Tensor, fused: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    if x.shape[0] <= SPLIT_ROWS:
        return F.linear(x, fused).split(sizes, dim=-1)
    return tuple(F.linear(x, w) for w in fused.split(sizes, dim=0))


def fuse_model_projections(model: nn.Module) -> int:
    """Call ``fuse_projections`` on every module that has one; returns how many fused."""
    count = 0
    for module in model.modules():
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None and fuse():
            count += 1
    return count
