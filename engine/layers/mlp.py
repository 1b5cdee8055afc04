"""SwiGLU feed-forward block with Hugging Face parameter names."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .fused_linear import by_row_blocks, fuse_linears, split_linear
from .linear import Linear


class GatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self._sizes = [intermediate_size, intermediate_size]
        self._fused: torch.Tensor | nn.Module | None = None  # concatenated gate/up (fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On row blocks for a long prompt chunk: the gate/up output is the widest tensor of a
        forward (``fused_linear.MAX_TENSOR_ELEMENTS``)."""
        return by_row_blocks(self._rows, x, sum(self._sizes))

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            h = silu_mul(*split_linear(x, self._fused, self._sizes))
        else:
            h = silu_mul(self.gate_proj(x), self.up_proj(x))
        return self.down_proj(h)

    def fuse_projections(self) -> bool:
        if self._fused is None:
            self._fused = fuse_linears([self.gate_proj, self.up_proj])
        return self._fused is not None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: one Triton pass on CUDA (``mlp_triton.py``), torch elsewhere."""
    if gate.is_cuda:
        from .mlp_triton import silu_mul_triton

        return silu_mul_triton(gate, up)
    return F.silu(gate) * up
