"""Triton grouped GEMM for MoE prefill: token assignments sorted by expert, one tile one expert.

For more (token, expert) assignments than the decode GEMVs suit, the assignments are grouped by
expert on the device and laid out in ``BLOCK_M``-row blocks, each expert's run padded to a whole
number of blocks (rows of padding hold -1). Every block then belongs to one expert, and two
kernels run over all blocks at once, with no host sync and no loop over experts:

- gate/up: rows of ``x`` gathered by token, times the block's expert ``[gate | up]`` weight
  (``tl.dot``), returning ``silu(gate) * up`` per assignment;
- down: those rows times the expert's down weight, scaled by the routing weight, per assignment;
  the ``k`` assignments of a token are then summed.

The grid is sized from an upper bound known on the host (``A + E * (BLOCK_M - 1)`` rows), so
blocks past the last expert's run exit at once. As in ``moe_triton.py``, expert id ``E`` means
the shared expert's own weights. Reference: ``FusedExperts.forward`` (the sorted torch loop).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_triton import expert_rows, shared_or

BLOCK_M = 64
CHUNK_TOKENS = 4096  # tokens per launch pair: bounds the [tokens * k, H] intermediate of a long prefill


@triton.jit
def _block_tile(rows_ptr, pid_m, e, w_ptr, shared_ptr, SHARED, N, stride_we, stride_wn, stride_sn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block ``pid_m``'s tile: its assignments (clamped to 0 on padding rows), which rows are real,
    the output columns of this program, which of them exist (< ``N``), and pointers to expert
    ``e``'s weight rows for those columns ``[1, BLOCK_N]``."""
    assign = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = assign >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_col = expert_rows(w_ptr, shared_ptr, e, SHARED, cols, stride_we, stride_wn, stride_sn)[None, :]
    return tl.where(valid, assign, 0).to(tl.int64), valid, cols, cols < N, w_col


@triton.jit
def _grouped_gate_up_kernel(x_ptr, w_ptr, shared_ptr, rows_ptr, block_expert_ptr, out_ptr, I, HID, LAST, SHARED,
                            stride_we, stride_wn, stride_sn, TOP_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e <= LAST:  # blocks past the last expert's run do nothing
        assign, valid, cols, cmask, w_col = _block_tile(rows_ptr, pid_m, e, w_ptr, shared_ptr, SHARED, I, stride_we,
                                                        stride_wn, stride_sn, BLOCK_M, BLOCK_N)
        token = assign // TOP_K
        up_off = tl.where(e == SHARED, I * stride_sn, I * stride_wn)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, HID, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < HID
            a = tl.load(x_ptr + token[:, None] * HID + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            bmask = kmask[:, None] & cmask[None, :]
            bg = tl.load(w_col + ks[:, None], mask=bmask, other=0.0)
            bu = tl.load(w_col + up_off + ks[:, None], mask=bmask, other=0.0)
            acc_g += tl.dot(a, bg, input_precision=PRECISION)
            acc_u += tl.dot(a, bu, input_precision=PRECISION)
        g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like the unfused GEMM
        u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        h = g / (1.0 + tl.exp(-g)) * u
        dest = out_ptr + assign[:, None] * I + cols[None, :]
        tl.store(dest, h.to(out_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


@triton.jit
def _grouped_down_kernel(h_ptr, w_ptr, shared_ptr, rows_ptr, block_expert_ptr, wts_ptr, out_ptr, HID, I, LAST,
                         SHARED,
                         stride_we, stride_wn, stride_sn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e <= LAST:  # blocks past the last expert's run do nothing
        a_row, valid, cols, cmask, w_col = _block_tile(rows_ptr, pid_m, e, w_ptr, shared_ptr, SHARED, HID, stride_we,
                                                       stride_wn, stride_sn, BLOCK_M, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < I
            a = tl.load(h_ptr + a_row[:, None] * I + ks[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_col + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        wt = tl.load(wts_ptr + a_row, mask=valid, other=0.0)
        tl.store(out_ptr + a_row[:, None] * HID + cols[None, :], (y * wt[:, None]).to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & cmask[None, :])


def sort_by_expert(ids: torch.Tensor, num_ids: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignment ``a`` (``ids.reshape(-1)[a]`` its expert) laid out per expert in blocks of
    ``block_m`` rows: ``rows`` (assignment per row, -1 for padding) and ``block_expert`` (the
    expert of each block; ``num_ids`` past the last run).

    Only fixed-shape device ops (a one-hot count and its running sum rather than a sort or
    ``bincount``), so nothing reads back to the host and a CUDA graph can capture it: decode
    batches past ``DECODE_MAX_ASSIGNMENTS`` land here. Within an expert, assignments keep their
    order."""
    flat = ids.reshape(-1).long()
    total = flat.numel()
    onehot = torch.zeros(total, num_ids, dtype=torch.int32, device=flat.device).scatter_(1, flat[:, None], 1)
    counts = onehot.sum(0)
    rank = onehot.cumsum(0, dtype=torch.int32).gather(1, flat[:, None])[:, 0] - 1  # place within its expert
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    dest = (pad_end - padded)[flat] + rank
    num_blocks = triton.cdiv(total + num_ids * (block_m - 1), block_m)
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=flat.device)
    rows[dest] = torch.arange(total, dtype=torch.int32, device=flat.device)
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return rows, block_expert


def moe_grouped_gemm(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                     wts: torch.Tensor, shared_gate_up: torch.Tensor | None = None,
                     shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[N, H]``; experts ``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]``; ``ids`` /
    ``wts`` ``[N, S]`` (id ``E``: the shared expert's weights) -> ``sum_s wts * expert(x)`` ``[N, H]``."""
    n, hid = x.shape
    e, two_i, _ = gate_up.shape
    inter, slots = two_i // 2, ids.shape[1]
    if down.shape != (e, hid, inter) or gate_up.stride(2) != 1 or down.stride(2) != 1 or wts.shape != ids.shape:
        raise ValueError(f"moe grouped gemm: gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
                         f"ids {tuple(ids.shape)}")
    if n > CHUNK_TOKENS:
        return torch.cat([moe_grouped_gemm(x[i : i + CHUNK_TOKENS], gate_up, down, ids[i : i + CHUNK_TOKENS],
                                           wts[i : i + CHUNK_TOKENS], shared_gate_up, shared_down)
                          for i in range(0, n, CHUNK_TOKENS)])
    num_ids = e + int(shared_gate_up is not None)
    rows, block_expert = sort_by_expert(ids, num_ids)
    sg, stride_sg = shared_or(gate_up, shared_gate_up)
    sd, stride_sd = shared_or(down, shared_down)
    x = x.contiguous()
    h = torch.empty((n * slots, inter), dtype=x.dtype, device=x.device)
    blocks = block_expert.numel()
    block_n, block_k = 64, 64
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models keep fp32 products
    shared_id = e if shared_gate_up is not None else -1
    _grouped_gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, gate_up, sg, rows, block_expert, h, inter, hid, num_ids - 1, shared_id, gate_up.stride(0),
        gate_up.stride(1), stride_sg,
        TOP_K=slots, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, num_warps=4,
        num_stages=3)
    y = torch.empty((n * slots, hid), dtype=x.dtype, device=x.device)
    _grouped_down_kernel[(blocks, triton.cdiv(hid, block_n))](
        h, down, sd, rows, block_expert, wts.reshape(-1).float().contiguous(), y, hid, inter, num_ids - 1,
        shared_id, down.stride(0), down.stride(1), stride_sd, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision, num_warps=4, num_stages=3)
    return y.view(n, slots, hid).sum(dim=1)
