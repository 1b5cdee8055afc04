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

from .. import launch
from .triton_switch import on_triton

# Which products take the GEMV and with which tiles: ``launch.LaunchSettings``' gemv_* fields
# (tuned per GPU in ``engine/tuned``; ``python -m bench.gemv_tune`` times them). Only weights with
# K >= min_k_per_n * N take it by default: with few output rows cuBLAS splits K and adds a reduce
# kernel (x [1, 4096] @ [2048, 4096]^T ran at 1.9 TB/s on an H200, split-K plus reduce), while for
# wide weights its GEMV streams at about 4 TB/s.

# BLOCK_N under Triton's interpreter (CPU tensors), where each program runs in Python
_INTERPRET_BLOCK_N = 64


def gemv_tiles(m: int, n: int, k: int) -> dict | None:
    """Tiles for the Triton GEMV of ``[m, k] @ [n, k]^T``, or None where ``F.linear`` is used."""
    s = launch.current()
    if m < 1 or m > s.gemv_max_rows:
        return None
    if (m, n, k) in s.gemv_shape_tiles:
        return s.gemv_shape_tiles[(m, n, k)]
    if k < s.gemv_min_k_per_n * n:
        return None
    return next((tiles for rows, tiles in s.gemv_row_tiles if m <= rows), None)


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
                weight: torch.Tensor | nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(norm(residual + x), weight), residual + x)`` for the pre-norm block's
    ``norm`` (an ``RMSNorm``) and a bias-free projection. At the shapes of the launch
    settings' ``norm_gemv_shape_tiles`` the add + norm ride in the Triton GEMV, one launch
    (``gemv_triton.norm_gemv_triton``); elsewhere ``norm(x, residual)`` then ``decode_linear``.
    Shapes and dtypes decide, never values, so a captured graph keeps the choice. A fused
    quantized projection (a linear method, ``linear.py``) takes the norm's output."""
    if not isinstance(weight, torch.Tensor):
        hidden, residual = norm(x, residual)
        return weight(hidden), residual
    if (on_triton(x) and x.dim() == 2 and x.dtype == weight.dtype == residual.dtype
            and weight.dim() == 2 and weight.is_contiguous()):
        tiles = launch.current().norm_gemv_shape_tiles.get((x.shape[0], weight.shape[0], weight.shape[1]))
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


def fuse_linears(linears: list[nn.Linear]) -> torch.Tensor | nn.Module | None:
    """The concatenated ``[sum(out), in]`` weight, or None when a module has a bias. Modules
    holding their weights quantized (``linear.Linear.method``) give one method of them all
    (``linear.fuse_methods``), or None where some are dense or their kinds differ."""
    if any(lin.bias is not None for lin in linears):
        return None
    methods = [getattr(lin, "method", None) for lin in linears]
    if any(m is not None for m in methods):
        from .linear import fuse_methods

        return None if None in methods else fuse_methods(methods)
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


def split_linear(x: torch.Tensor, fused: torch.Tensor | nn.Module, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """The parts of a fused projection: a dense weight, or a linear method (``linear.py``)."""
    if not isinstance(fused, torch.Tensor):
        return fused(x).split(sizes, dim=-1)
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
