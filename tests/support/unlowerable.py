"""A kernel that Triton's interpreter runs but its compiler rejects, for the lowering check's own
test (tests/interp/test_kernels_lower.py): its helper returns ``None`` in a tuple when not
``SCALED``, as the prefill attention kernel's K/V load once did."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load(x_ptr, offs, SCALED: tl.constexpr):
    scale = None
    if SCALED:
        scale = tl.load(x_ptr + offs) * 0 + 2.0
    return tl.load(x_ptr + offs), scale


@triton.jit
def double_kernel(x_ptr, out_ptr, N: tl.constexpr, SCALED: tl.constexpr):
    offs = tl.arange(0, N)
    x, scale = _load(x_ptr, offs, SCALED)
    if SCALED:
        x = x * scale
    else:
        x = x * 2.0
    tl.store(out_ptr + offs, x)
