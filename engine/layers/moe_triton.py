"""Triton grouped GEMV for MoE decode: row ``m`` of ``x`` times the weight of expert ``ids[m]``.

Each program computes ``BLOCK_N`` outputs of one row, streaming that expert's weight rows once;
expert ids are read on the device, so a decode step needs no host sync and can be graph-captured.
Reference: ``moe.grouped_gemv``'s torch branch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemv_kernel(x_ptr, w_ptr, ids_ptr, out_ptr, N, K, stride_we, stride_wn,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(ids_ptr + m).to(tl.int64)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < K
        x = tl.load(x_ptr + m * K + cols, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e * stride_we + rows[:, None] * stride_wn + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(out_ptr + m * N + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)


def grouped_gemv_triton(x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    e, n, k2 = w.shape
    if k != k2 or ids.shape != (m,) or w.stride(2) != 1:
        raise ValueError(f"grouped_gemv: x {tuple(x.shape)}, w {tuple(w.shape)}, ids {tuple(ids.shape)}")
    x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n = 32
    _grouped_gemv_kernel[(m, triton.cdiv(n, block_n))](x, w, ids, out, n, k, w.stride(0), w.stride(1),
                                                      BLOCK_N=block_n, BLOCK_K=256, num_warps=4)
    return out
