"""Triton kernels for MoE experts held in 4 or 8 bits (``moe.QuantizedExperts``).

The experts' matrices ``[E, N, K]`` are held as ``quant_gemv_triton`` holds one projection: 4-bit
values packed two a byte ``[E, N, K / 2]`` uint8 (even column in the low nibble) or 8-bit ones
int8 ``[E, N, K]``, with fp16 scales and offsets ``[E, N, K / G]`` (``W = scale * q + offset``
per group of ``G`` columns). Decode is bound by the bytes of the experts a token reads, so a
4-bit expert streams about a quarter of a bf16 one.

- ``moe_gate_up_quant``: per assignment (token, expert), the expert's gate and up rows against
  the token's hidden state -> ``silu(gate) * up``, the packed rows read once, each chunk's
  integer dot products scaled once per row (``s * sum(x q) + o * sum(x)``, chunks within one
  group);
- ``moe_down_quant``: per token, the routing-weighted sum over its assignments of the experts'
  down rows against their ``silu(gate) * up``;
- ``moe_grouped_gemm_quant``: prompt rows, the assignments sorted by expert in blocks
  (``moe_gemm_triton.sort_by_expert``) and each block's expert tile dequantized in registers
  for ``tl.dot``, so no dense copy of an expert is ever written.

Outputs are rounded as the dense kernels round them (each GEMV's result to the activation dtype
before the activation or the weighting). The shared expert is not folded in (a quantized shared
expert runs as its own projections). References: ``QuantizedExperts.dequantize`` followed by the
torch loop of ``moe.FusedExperts``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_gemm_triton import BLOCK_M, CHUNK_TOKENS, sort_by_expert
from .quant_gemv_triton import _exact_float

GEMV_TILES = {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4}


@triton.jit
def _chunk_dot(q_ptr, rows_in, stride_n, k0, x, x_lo, x_hi, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """Integer dot products of ``BLOCK_K`` weight columns from ``k0`` of each row (pointer
    ``q_ptr + rows_in * stride_n``) with ``x`` (its even / odd halves for 4 bits): ``[BLOCK_N]``."""
    if BITS == 4:
        j = tl.arange(0, BLOCK_K // 2)
        b = tl.load(q_ptr + rows_in[:, None] * stride_n + (k0 // 2 + j)[None, :]).to(tl.int32)
        return tl.sum(_exact_float(b & 15, 0, 0) * x_lo[None, :] + _exact_float(b >> 4, 0, 0) * x_hi[None, :], 1)
    kk = tl.arange(0, BLOCK_K)
    b = tl.load(q_ptr + rows_in[:, None] * stride_n + (k0 + kk)[None, :]).to(tl.int32)
    return tl.sum(_exact_float(b, 128, 0) * x[None, :], 1)


@triton.jit
def _q_gate_up_kernel(x_ptr, q_ptr, s_ptr, o_ptr, ids_ptr, out_ptr, I, HID, stride_qe, stride_qn, stride_se,
                      stride_sn, SLOTS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, HAS_OFFSET: tl.constexpr, BITS: tl.constexpr):
    a = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < I
    rows_in = tl.minimum(rows, I - 1).to(tl.int64)
    e = tl.load(ids_ptr + a).to(tl.int64)
    q_gate = q_ptr + e * stride_qe
    q_up = q_gate + I * stride_qn
    s_gate = e * stride_se + rows_in * stride_sn
    s_up = s_gate + I * stride_sn
    x_row = x_ptr + (a // SLOTS) * HID
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in tl.range(0, HID, BLOCK_K):
        x = tl.load(x_row + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
        x_lo, x_hi = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
        grp = k0 // G
        acc_g += _chunk_dot(q_gate, rows_in, stride_qn, k0, x, x_lo, x_hi, BLOCK_K, BITS) * \
            tl.load(s_ptr + s_gate + grp).to(tl.float32)
        acc_u += _chunk_dot(q_up, rows_in, stride_qn, k0, x, x_lo, x_hi, BLOCK_K, BITS) * \
            tl.load(s_ptr + s_up + grp).to(tl.float32)
        if HAS_OFFSET:
            xs = tl.sum(x, 0)
            acc_g += xs * tl.load(o_ptr + s_gate + grp).to(tl.float32)
            acc_u += xs * tl.load(o_ptr + s_up + grp).to(tl.float32)
    g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like the unfused GEMV
    u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + a * I + rows, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _q_down_kernel(h_ptr, q_ptr, s_ptr, o_ptr, ids_ptr, wts_ptr, out_ptr, HID, I, stride_qe, stride_qn, stride_se,
                   stride_sn, SLOTS: tl.constexpr, S_PAD: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_OFFSET: tl.constexpr, BITS: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < HID
    rows_in = tl.minimum(rows, HID - 1).to(tl.int64)
    slot = tl.arange(0, S_PAD)
    ids = tl.load(ids_ptr + t * SLOTS + slot, mask=slot < SLOTS, other=0).to(tl.int64)
    wts = tl.load(wts_ptr + t * SLOTS + slot, mask=slot < SLOTS, other=0.0)
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(SLOTS):
        e = tl.sum(tl.where(slot == j, ids, 0), 0)
        wt = tl.sum(tl.where(slot == j, wts, 0.0), 0)
        q_e = q_ptr + e * stride_qe
        s_e = e * stride_se + rows_in * stride_sn
        h_row = h_ptr + (t * SLOTS + j) * I
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in tl.range(0, I, BLOCK_K):
            h = tl.load(h_row + k0 + tl.arange(0, BLOCK_K)).to(tl.float32)
            h_lo, h_hi = tl.split(tl.reshape(h, (BLOCK_K // 2, 2)))
            grp = k0 // G
            acc += _chunk_dot(q_e, rows_in, stride_qn, k0, h, h_lo, h_hi, BLOCK_K, BITS) * \
                tl.load(s_ptr + s_e + grp).to(tl.float32)
            if HAS_OFFSET:
                acc += tl.sum(h, 0) * tl.load(o_ptr + s_e + grp).to(tl.float32)
        total += wt * acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # each expert's output rounded, weighted
    tl.store(out_ptr + t * HID + rows, total.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _weight_tile(q_ptr, s_ptr, o_ptr, e, cols_in, k0, stride_qe, stride_qn, stride_se, stride_sn,
                 G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_OFFSET: tl.constexpr,
                 BITS: tl.constexpr):
    """Expert ``e``'s weight rows ``cols_in`` (output columns of the product), columns ``k0 ..
    k0 + BLOCK_K`` (within one group), dequantized and transposed: ``[BLOCK_K, BLOCK_N]`` fp32."""
    q_rows = q_ptr + e * stride_qe + cols_in[:, None] * stride_qn
    if BITS == 4:
        j = tl.arange(0, BLOCK_K // 2)
        b = tl.load(q_rows + (k0 // 2 + j)[None, :]).to(tl.int32)
        w = tl.reshape(tl.join(_exact_float(b & 15, 0, 0), _exact_float(b >> 4, 0, 0)), (BLOCK_N, BLOCK_K))
    else:
        b = tl.load(q_rows + (k0 + tl.arange(0, BLOCK_K))[None, :]).to(tl.int32)
        w = _exact_float(b, 128, 0)
    sg = e * stride_se + cols_in * stride_sn + k0 // G
    w = w * tl.load(s_ptr + sg).to(tl.float32)[:, None]
    if HAS_OFFSET:
        w += tl.load(o_ptr + sg).to(tl.float32)[:, None]
    return tl.trans(w)


@triton.jit
def _q_grouped_gate_up_kernel(x_ptr, q_ptr, s_ptr, o_ptr, rows_ptr, block_expert_ptr, out_ptr, I, HID, LAST,
                              stride_qe, stride_qn, stride_se, stride_sn, TOP_K: tl.constexpr, G: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              HAS_OFFSET: tl.constexpr, BITS: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e <= LAST:  # blocks past the last expert's run do nothing
        assign = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = assign >= 0
        assign = tl.where(valid, assign, 0).to(tl.int64)
        token = assign // TOP_K
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < I
        cols_in = tl.minimum(cols, I - 1).to(tl.int64)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, HID, BLOCK_K):
            a = tl.load(x_ptr + token[:, None] * HID + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=valid[:, None],
                        other=0.0)
            bg = _weight_tile(q_ptr, s_ptr, o_ptr, e, cols_in, k0, stride_qe, stride_qn, stride_se, stride_sn,
                              G, BLOCK_N, BLOCK_K, HAS_OFFSET, BITS).to(a.dtype)
            bu = _weight_tile(q_ptr, s_ptr, o_ptr, e, cols_in + I, k0, stride_qe, stride_qn, stride_se, stride_sn,
                              G, BLOCK_N, BLOCK_K, HAS_OFFSET, BITS).to(a.dtype)
            acc_g += tl.dot(a, bg, input_precision=PRECISION)
            acc_u += tl.dot(a, bu, input_precision=PRECISION)
        g = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        h = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + assign[:, None] * I + cols[None, :], h.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & cmask[None, :])


@triton.jit
def _q_grouped_down_kernel(h_ptr, q_ptr, s_ptr, o_ptr, rows_ptr, block_expert_ptr, wts_ptr, out_ptr, HID, I, LAST,
                           stride_qe, stride_qn, stride_se, stride_sn, G: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_OFFSET: tl.constexpr,
                           BITS: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e <= LAST:
        assign = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = assign >= 0
        assign = tl.where(valid, assign, 0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < HID
        cols_in = tl.minimum(cols, HID - 1).to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, I, BLOCK_K):
            a = tl.load(h_ptr + assign[:, None] * I + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=valid[:, None],
                        other=0.0)
            b = _weight_tile(q_ptr, s_ptr, o_ptr, e, cols_in, k0, stride_qe, stride_qn, stride_se, stride_sn,
                             G, BLOCK_N, BLOCK_K, HAS_OFFSET, BITS).to(a.dtype)
            acc += tl.dot(a, b, input_precision=PRECISION)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        wt = tl.load(wts_ptr + assign, mask=valid, other=0.0)
        tl.store(out_ptr + assign[:, None] * HID + cols[None, :], (y * wt[:, None]).to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & cmask[None, :])


def chunk_k(group: int, k: int, block_k: int) -> int:
    """Columns a chunk takes: ``block_k`` capped at the group (one scale per row per chunk); the
    group must be a power of two of at least 16 columns dividing ``k``."""
    if group < 16 or group & (group - 1) or k % group:
        raise ValueError(f"quantized experts: groups of {group} columns over {k} (powers of two >= 16 dividing it)")
    return min(block_k, group)


def _check(w, n: int, k: int, what: str) -> None:
    e = w.packed.shape[0]
    if tuple(w.packed.shape) != (e, n, k * w.bits // 8) or tuple(w.scale.shape) != (e, n, k // w.group) or \
            not w.packed.is_contiguous() or not w.scale.is_contiguous():
        raise ValueError(f"moe {what}: experts {tuple(w.packed.shape)} with scales {tuple(w.scale.shape)} "
                         f"do not make [{e}, {n}, {k}] in groups of {w.group}")


def _args(w) -> tuple:
    """Pointers and strides of a held expert matrix (``moe.QuantizedExperts``)."""
    offset = w.offset if w.offset is not None else w.scale
    return (w.packed, w.scale, offset)


def moe_gate_up_quant(x: torch.Tensor, w, ids: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """``x`` ``[N, H]``, ``w`` the held ``[E, 2I, H]`` gate / up experts, ``ids`` ``[N, S]`` ->
    ``silu(gate) * up`` ``[N * S, I]``."""
    n, hid = x.shape
    inter, slots = w.packed.shape[1] // 2, ids.shape[1]
    _check(w, 2 * inter, hid, "gate_up")
    out = torch.empty((n * slots, inter), dtype=x.dtype, device=x.device)
    t = dict(GEMV_TILES, **(tiles or {}))
    bk = chunk_k(w.group, hid, t["BLOCK_K"])
    if n:
        _q_gate_up_kernel[(n * slots, triton.cdiv(inter, t["BLOCK_N"]))](
            x.contiguous(), *_args(w), ids, out, inter, hid, w.packed.stride(0), w.packed.stride(1),
            w.scale.stride(0), w.scale.stride(1), SLOTS=slots, G=w.group, BLOCK_N=t["BLOCK_N"], BLOCK_K=bk,
            HAS_OFFSET=w.offset is not None, BITS=w.bits, num_warps=t["num_warps"])
    return out


def moe_down_quant(h: torch.Tensor, w, ids: torch.Tensor, wts: torch.Tensor, tiles: dict | None = None
                   ) -> torch.Tensor:
    """``h`` ``[N * S, I]``, ``w`` the held ``[E, H, I]`` down experts, ``ids`` / ``wts`` ``[N, S]``
    -> ``sum_s wts * (w[ids] @ h)`` ``[N, H]``."""
    n, slots = ids.shape
    hid, inter = w.packed.shape[1], h.shape[1]
    _check(w, hid, inter, "down")
    if h.shape[0] != n * slots or wts.shape != ids.shape:
        raise ValueError(f"moe down: h {tuple(h.shape)}, ids {tuple(ids.shape)}, weights {tuple(wts.shape)}")
    out = torch.empty((n, hid), dtype=h.dtype, device=h.device)
    t = dict(GEMV_TILES, **(tiles or {}))
    bk = chunk_k(w.group, inter, t["BLOCK_K"])
    if n:
        _q_down_kernel[(n, triton.cdiv(hid, t["BLOCK_N"]))](
            h.contiguous(), *_args(w), ids, wts.float().contiguous(), out, hid, inter, w.packed.stride(0),
            w.packed.stride(1), w.scale.stride(0), w.scale.stride(1), SLOTS=slots,
            S_PAD=triton.next_power_of_2(slots), G=w.group, BLOCK_N=t["BLOCK_N"], BLOCK_K=bk,
            HAS_OFFSET=w.offset is not None, BITS=w.bits, num_warps=t["num_warps"])
    return out


def moe_grouped_gemm_quant(x: torch.Tensor, gate_up, down, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """``moe_gemm_triton.moe_grouped_gemm`` over held experts: ``x`` ``[N, H]``, ``ids`` / ``wts``
    ``[N, S]`` -> ``sum_s wts * expert(x)`` ``[N, H]``."""
    n, hid = x.shape
    e, inter, slots = gate_up.packed.shape[0], gate_up.packed.shape[1] // 2, ids.shape[1]
    _check(gate_up, 2 * inter, hid, "gate_up")
    _check(down, hid, inter, "down")
    if n > CHUNK_TOKENS:
        return torch.cat([moe_grouped_gemm_quant(x[i : i + CHUNK_TOKENS], gate_up, down, ids[i : i + CHUNK_TOKENS],
                                                 wts[i : i + CHUNK_TOKENS]) for i in range(0, n, CHUNK_TOKENS)])
    rows, block_expert = sort_by_expert(ids, e)
    x = x.contiguous()
    blocks, block_n = block_expert.numel(), 64
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty((n * slots, inter), dtype=x.dtype, device=x.device)
    _q_grouped_gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, *_args(gate_up), rows, block_expert, h, inter, hid, e - 1, gate_up.packed.stride(0),
        gate_up.packed.stride(1), gate_up.scale.stride(0), gate_up.scale.stride(1), TOP_K=slots, G=gate_up.group,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=chunk_k(gate_up.group, hid, 64),
        HAS_OFFSET=gate_up.offset is not None, BITS=gate_up.bits, PRECISION=precision, num_warps=4, num_stages=3)
    y = torch.empty((n * slots, hid), dtype=x.dtype, device=x.device)
    _q_grouped_down_kernel[(blocks, triton.cdiv(hid, block_n))](
        h, *_args(down), rows, block_expert, wts.reshape(-1).float().contiguous(), y, hid, inter, e - 1,
        down.packed.stride(0), down.packed.stride(1), down.scale.stride(0), down.scale.stride(1), G=down.group,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=chunk_k(down.group, inter, 64), HAS_OFFSET=down.offset is not None,
        BITS=down.bits, PRECISION=precision, num_warps=4, num_stages=3)
    return y.view(n, slots, hid).sum(dim=1)
