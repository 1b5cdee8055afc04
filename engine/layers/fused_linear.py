"""One GEMM instead of several for projections that read the same input.

After loading, bias-free ``nn.Linear`` modules that share an input get one concatenated weight;
each module's ``weight`` becomes a view of its rows, so names and memory stay as they were. On
the GPU a decode step then launches one matrix-vector product where it launched three or four.

``decode_linear`` is ``F.linear`` that takes the Triton GEMV (``gemv_triton.py``) for the few-row
products of a decode step where ``gemv_tiles`` says it beats cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .triton_switch import on_triton

# Input rows up to which ``decode_linear`` may take the Triton GEMV; more rows always use cuBLAS.
GEMV_MAX_ROWS = 8
# Tiles by input rows M: the first entry whose bound is >= M wins; M past every bound uses cuBLAS.
# Edit after timing with ``python -m bench.gemv_tune`` on the target GPU.
GEMV_ROW_TILES: tuple[tuple[int, dict], ...] = (
    (4, {"BLOCK_N": 2, "BLOCK_K": 512, "num_warps": 2}),
)
# Only weights with K >= GEMV_MIN_K_PER_N * N take it by default: with few output rows cuBLAS
# splits K and adds a reduce kernel (x [1, 4096] @ [2048, 4096]^T ran at 1.9 TB/s on an H200,
# split-K plus reduce), while for wide weights its GEMV streams at about 4 TB/s.
GEMV_MIN_K_PER_N = 2
# Measured exceptions by (M, N, K): the tiles to use there, or None where cuBLAS wins.
GEMV_SHAPE_TILES: dict[tuple[int, int, int], dict | None] = {}
# BLOCK_N under Triton's interpreter (CPU tensors), where each program runs in Python
_INTERPRET_BLOCK_N = 64


def gemv_tiles(m: int, n: int, k: int) -> dict | None:
    """Tiles for the Triton GEMV of ``[m, k] @ [n, k]^T``, or None where ``F.linear`` is used."""
    if m < 1 or m > GEMV_MAX_ROWS:
        return None
    if (m, n, k) in GEMV_SHAPE_TILES:
        return GEMV_SHAPE_TILES[(m, n, k)]
    if k < GEMV_MIN_K_PER_N * n:
        return None
    return next((tiles for rows, tiles in GEMV_ROW_TILES if m <= rows), None)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on Triton tensors (``on_triton``) the Triton GEMV where
    ``gemv_tiles`` picks it. The choice reads shapes, dtypes and strides only (no host sync), so
    it is fixed for a captured CUDA graph."""
    if (on_triton(x) and x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.stride(-1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))):
        tiles = gemv_tiles(x.shape[0], weight.shape[0], weight.shape[1])
        if tiles is not None:
            from .gemv_triton import gemv_triton

            if not x.is_cuda:  # the interpreter: fewer, taller programs
                tiles = dict(tiles, BLOCK_N=_INTERPRET_BLOCK_N)
            return gemv_triton(x, weight, bias, tiles)
    return F.linear(x, weight, bias)


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
        return decode_linear(x, fused).split(sizes, dim=-1)
    return tuple(F.linear(x, w) for w in fused.split(sizes, dim=0))


def fuse_model_projections(model: nn.Module) -> int:
    """Call ``fuse_projections`` on every module that has one; returns how many fused."""
    count = 0
    for module in model.modules():
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None and fuse():
            count += 1
    return count
