"""One GEMM instead of several for projections that read the same input.

After loading, bias-free ``nn.Linear`` modules that share an input get one concatenated weight;
each module's ``weight`` becomes a view of its rows, so names and memory stay as they were. On
the GPU a decode step then launches one matrix-vector product where it launched three or four.

``decode_linear`` is ``F.linear`` that takes the Triton GEMV (``gemv_triton.py``) for the few-row
products of a decode step where ``gemv_tiles`` says it beats cuBLAS. ``norm_linear`` is the
pre-norm block's add + RMSNorm followed by a projection, as one GEMV launch for a decode step.
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
# Measured exceptions by (M, N, K): the tiles to use there, or None where cuBLAS wins. H200, bf16,
# ``python -m bench.gemv_tune`` (bench/RESULTS.md, 2026-12-01), us per call in a CUDA graph:
GEMV_SHAPE_TILES: dict[tuple[int, int, int], dict | None] = {
    # qwen3.5-35b-a3b: GDN input projection 14.3 (cuBLAS 16.7), GDN out_proj = attention o_proj
    # 6.3 (cuBLAS 8.9, the K >= 2N default tiles 7.7), attention qkv 11.4 (12.6), LM head 227 (256)
    (1, 12352, 2048): {"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 1},
    (1, 2048, 4096): {"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8},
    (1, 9216, 2048): {"BLOCK_N": 1, "BLOCK_K": 1024, "num_warps": 2},
    (1, 248320, 2048): {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 8},
    # qwen3.5-27b: GDN input projection 40.7 (cuBLAS 44.2), out_proj = o_proj 17.3 (18.6),
    # attention qkv 37.3 (39.5), MLP gate/up 84.1 (90.1), MLP down 44.4 (49.8), LM head 553 (652)
    (1, 16480, 5120): {"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 1},
    (1, 5120, 6144): {"BLOCK_N": 1, "BLOCK_K": 2048, "num_warps": 4},
    (1, 14336, 5120): {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 1},
    (1, 34816, 5120): {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4},
    (1, 5120, 17408): {"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4},
    (1, 248320, 5120): {"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8},
}
# The GEMV with the pre-norm add + RMSNorm in front (``norm_linear``), by (M, N, K): taken only
# where measured faster than the add + norm launch followed by the plain projection
# (``python -m bench.gemv_tune --norm``, H200, us per call in a CUDA graph); every program re-reads
# the input and residual rows, so its best tiles are taller than the plain GEMV's. The 35B-A3B GDN
# input projection tied alone (15.9 either way) but its whole decode step was 2.43 ms against
# 2.51 with it (graph 2.39 vs 2.45, bench.decode on one H200 machine, one launch less per GDN
# layer); not taken at the 27B MLP gate/up (86.0 vs 86.5).
NORM_GEMV_SHAPE_TILES: dict[tuple[int, int, int], dict] = {
    (1, 9216, 2048): {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 1},  # 35B-A3B attention qkv: 12.1 (13.5)
    (1, 12352, 2048): {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 1},  # 35B-A3B GDN input: 15.9 (15.9)
    (1, 16480, 5120): {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 2},  # 27B GDN input: 43.9 (45.4)
    (1, 14336, 5120): {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4},  # 27B attention qkv: 39.6 (40.6)
}
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
    if x.device.type == "cpu" and x.dim() == 2 and weight.dim() == 2:
        return cpu_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on the CPU as ``weight @ x.T``: MKL then streams the weight once for the few
    rows of a decode step, where ``F.linear``'s GEMM reads it several times over (a 30-layer
    stack of SmolLM2's shapes on two cores: 2.6x faster at 2 to 4 rows, 1.3x at 64, the same at 1)."""
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out + bias


def norm_linear(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(norm(residual + x), weight), residual + x)`` for the pre-norm block's
    ``norm`` (an ``RMSNorm``) and a bias-free projection. At the shapes of
    ``NORM_GEMV_SHAPE_TILES`` the add + norm ride in the Triton GEMV, one launch
    (``gemv_triton.norm_gemv_triton``); elsewhere ``norm(x, residual)`` then ``decode_linear``.
    Shapes and dtypes decide, never values, so a captured graph keeps the choice."""
    if (on_triton(x) and x.dim() == 2 and x.dtype == weight.dtype == residual.dtype
            and weight.dim() == 2 and weight.is_contiguous()):
        tiles = NORM_GEMV_SHAPE_TILES.get((x.shape[0], weight.shape[0], weight.shape[1]))
        if tiles is not None:
            from .gemv_triton import norm_gemv_triton

            if not x.is_cuda:
                tiles = dict(tiles, BLOCK_N=_INTERPRET_BLOCK_N)
            return norm_gemv_triton(x, residual, norm.weight, norm.eps, norm.zero_centered, weight, tiles)
    hidden, residual = norm(x, residual)
    return decode_linear(hidden, weight), residual


class NormFusedInput:
    """For a token mixer with a fused input projection (``_fused``, its parts ``_sizes``) and
    ``_from_projections(*parts, batch)``: ``forward_residual(x, residual, norm, batch)`` is
    ``(self(norm(residual + x)), residual + x)``, ``norm`` the layer's ``input_layernorm``; in a
    step of decode rows only the add + norm ride in the input projection (``norm_linear``)."""

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                         batch) -> tuple[torch.Tensor, torch.Tensor]:
        if batch.step is None or batch.step.prompt is not None or self._fused is None:
            hidden, residual = norm(x, residual)
            return self(hidden, batch), residual
        proj, residual = norm_linear(x, residual, norm, self._fused)
        return self._from_projections(*proj.split(self._sizes, dim=-1), batch), residual


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


# Elements one tensor of a GEMM or elementwise kernel may span: cuBLAS(Lt) fails with
# CUBLAS_STATUS_EXECUTION_FAILED on an operand or result of 2^31 elements or more (32-bit offsets
# in some of its kernels; a 131,072-token chunk through the 27B's gate/up GEMM, 131072 x 34816,
# did), and the Triton kernels here index with int32. Token-wise work wider than the rest (the
# MLP's intermediate) runs on row blocks under it (``by_row_blocks``); the widest whole-chunk
# tensor left bounds the prefill chunk (``engine_config.max_prefill_chunk``).
MAX_TENSOR_ELEMENTS = 2**31 - 1


def by_row_blocks(fn, x: torch.Tensor, width: int) -> torch.Tensor:
    """``fn(x)`` for a row-wise ``fn`` whose widest tensor holds ``width`` elements per row of
    ``x``, run on blocks of rows so none reaches ``MAX_TENSOR_ELEMENTS``; one call (no copy) when
    ``x`` is short enough, as every decode step is."""
    rows = max(1, MAX_TENSOR_ELEMENTS // width)
    if x.shape[0] <= rows:
        return fn(x)
    return torch.cat([fn(x[i : i + rows]) for i in range(0, x.shape[0], rows)])


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
