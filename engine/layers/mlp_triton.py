"""Triton kernel for SwiGLU's elementwise part, ``silu(gate) * up`` in one pass (reference:
``mlp.silu_mul``'s torch branch)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, cols, blocks, g_stride, u_stride, BLOCK: tl.constexpr):
    """Program ``pid``: columns ``BLOCK * (pid % blocks)`` on of row ``pid // blocks``; gate and up
    rows ``g_stride`` / ``u_stride`` apart (the halves of a fused gate/up projection's output,
    read where they lie), the output rows contiguous."""
    pid = tl.program_id(0)
    row = (pid // blocks).to(tl.int64)
    offs = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    g = tl.load(g_ptr + row * g_stride + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offs, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, cols]`` with unit column stride, a view where it can be (the halves of a
    fused projection's output are), a copy where not."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` into a new contiguous tensor of their shape, reading each input's rows
    in place (no copy of a strided half of a fused gate/up output)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} vs up {tuple(up.shape)}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        g, u = _rows(gate), _rows(up)
        cols = g.shape[1]
        blocks = triton.cdiv(cols, 1024)
        _silu_mul_kernel[(g.shape[0] * blocks,)](g, u, out, cols, blocks, g.stride(0), u.stride(0), BLOCK=1024)
    return out
