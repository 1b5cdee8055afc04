"""Triton kernels for MoE decode: routing, and the experts as two grouped GEMVs.

A decode step's MoE block runs as one router GEMV and three launches, with expert ids read on the
device (no host sync, so CUDA graphs can capture it):

- ``route_triton``: per token, softmax over the router logits, top-k by repeated arg-max,
  optional renormalisation; when the shared expert is folded in, its gate logit (the router's
  extra last row) becomes one more assignment with weight ``sigmoid(logit)``.
- ``moe_gate_up_triton``: per assignment (token, expert), the expert's gate and up rows against
  the token's hidden state, returning ``silu(gate) * up``.
- ``moe_down_triton``: per token, the weighted sum over its assignments of the experts' down
  projections, so no ``[N * k, H]`` intermediate and no separate reduction.

An assignment whose id equals ``num_experts`` reads the shared expert's own weights (same
intermediate size), so the shared expert costs no launches of its own. References: the torch
path of ``moe.SparseMoeBlock`` (``route``, ``FusedExperts``, the shared expert).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def expert_rows(w_ptr, shared_ptr, e, shared_id, rows, stride_we, stride_wn, stride_sn):
    """Pointers to weight rows ``rows`` of expert ``e``, or of the shared expert when ``e`` is
    ``shared_id`` (its own ``[rows, K]`` tensor)."""
    r64 = rows.to(tl.int64)
    return tl.where(e == shared_id, shared_ptr + r64 * stride_sn, w_ptr + e * stride_we + r64 * stride_wn)


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l,
                  TOP_K: tl.constexpr, SLOTS: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  NORM_TOPK: tl.constexpr, SHARED: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e < E, p, -1.0)
    slot = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], tl.int32)
    wts = tl.zeros([K_PAD], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, E_PAD), 0)
        ids = tl.where(slot == j, idx, ids)
        wts = tl.where(slot == j, best, wts)
        p = tl.where(e == idx, -1.0, p)
    if NORM_TOPK:
        wts = wts / tl.sum(wts, 0)
    if SHARED:
        gate = tl.load(logits_ptr + t * stride_l + E).to(tl.float32)
        ids = tl.where(slot == TOP_K, E, ids)
        wts = tl.where(slot == TOP_K, 1.0 / (1.0 + tl.exp(-gate)), wts)
    tl.store(ids_ptr + t * SLOTS + slot, ids, mask=slot < SLOTS)
    tl.store(w_ptr + t * SLOTS + slot, wts, mask=slot < SLOTS)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, shared_ptr, ids_ptr, out_ptr, I, HID, E, stride_we, stride_wn, stride_sn,
                    SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    a = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < I
    e = tl.load(ids_ptr + a).to(tl.int64)
    base = expert_rows(w_ptr, shared_ptr, e, E, rows, stride_we, stride_wn, stride_sn)[:, None]
    up_off = tl.where(e == E, I * stride_sn, I * stride_wn)
    x_row = x_ptr + (a // SLOTS) * HID
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(0, HID, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cmask = cols < HID
        x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        m = rmask[:, None] & cmask[None, :]
        acc_g += tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32) * x
        acc_u += tl.load(base + up_off + cols[None, :], mask=m, other=0.0).to(tl.float32) * x
    g = tl.sum(acc_g, 1).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded like the unfused GEMV
    u = tl.sum(acc_u, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + a * I + rows, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _down_kernel(h_ptr, w_ptr, shared_ptr, ids_ptr, wts_ptr, out_ptr, HID, I, E, stride_we, stride_wn, stride_sn,
                 SLOTS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    rows = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rmask = rows < HID
    slot = tl.arange(0, S_PAD)
    # every slot's expert id and weight up front: the unrolled loop below has no dependent loads
    ids = tl.load(ids_ptr + t * SLOTS + slot, mask=slot < SLOTS, other=0).to(tl.int64)
    wts = tl.load(wts_ptr + t * SLOTS + slot, mask=slot < SLOTS, other=0.0)
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(SLOTS):
        e = tl.sum(tl.where(slot == j, ids, 0), 0)
        wt = tl.sum(tl.where(slot == j, wts, 0.0), 0)
        base = expert_rows(w_ptr, shared_ptr, e, E, rows, stride_we, stride_wn, stride_sn)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(0, I, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            cmask = cols < I
            h = tl.load(h_ptr + (t * SLOTS + j) * I + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(base + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32) * h
        y = tl.sum(acc, 1).to(out_ptr.dtype.element_ty).to(tl.float32)
        total += wt * y
    tl.store(out_ptr + t * HID + rows, total.to(out_ptr.dtype.element_ty), mask=rmask)


def route_triton(logits: torch.Tensor, top_k: int, num_experts: int, norm_topk_prob: bool,
                 shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[N, E (+1 shared gate)]`` -> ids ``[N, k (+1)]`` int32, weights fp32."""
    n = logits.shape[0]
    slots = top_k + int(shared)
    if logits.shape[1] != num_experts + int(shared) or logits.stride(1) != 1:
        raise ValueError(f"route: logits {tuple(logits.shape)} for {num_experts} experts, shared={shared}")
    ids = torch.empty((n, slots), dtype=torch.int32, device=logits.device)
    wts = torch.empty((n, slots), dtype=torch.float32, device=logits.device)
    if n:
        _route_kernel[(n,)](logits, ids, wts, num_experts, logits.stride(0), TOP_K=top_k, SLOTS=slots,
                            K_PAD=triton.next_power_of_2(slots), E_PAD=triton.next_power_of_2(num_experts),
                            NORM_TOPK=norm_topk_prob, SHARED=shared, num_warps=4)
    return ids, wts


def shared_or(w: torch.Tensor, shared: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    if shared is None:
        return w, 0
    if shared.shape != w.shape[1:] or shared.stride(1) != 1:
        raise ValueError(f"moe: shared expert weight {tuple(shared.shape)} vs experts {tuple(w.shape)}")
    return shared, shared.stride(0)


# Tile sizes of the two grouped GEMVs, the fastest of ``python -m bench.moe_tune`` on an H200 at
# the 35B-A3B shape (1 and 8 tokens, in CUDA graphs): gate_up 10.9 us per layer at one token (was
# 15.3 with 8 rows x 4 warps), down 10.2 us (was 11.2); bench/RESULTS.md has the tables.
GATE_UP_TILES = {"BLOCK_N": 1, "BLOCK_K": 512, "num_warps": 2}
DOWN_TILES = {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 8}


def _tiles(default: dict, tiles: dict | None, k: int) -> dict:
    t = dict(default, **(tiles or {}))
    t["BLOCK_K"] = min(t["BLOCK_K"], triton.next_power_of_2(k))
    return t


def moe_gate_up_triton(x: torch.Tensor, w: torch.Tensor, shared: torch.Tensor | None,
                       ids: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """``x`` ``[N, H]``, ``w`` ``[E, 2I, H]``, ``shared`` ``[2I, H]`` (id ``E``), ``ids`` ``[N, S]``
    -> ``silu(gate) * up`` ``[N * S, I]``."""
    n, hid = x.shape
    e, two_i, hid2 = w.shape
    if hid != hid2 or w.stride(2) != 1 or ids.shape[0] != n:
        raise ValueError(f"moe gate_up: x {tuple(x.shape)}, w {tuple(w.shape)}, ids {tuple(ids.shape)}")
    inter, slots = two_i // 2, ids.shape[1]
    shared_w, stride_s = shared_or(w, shared)
    out = torch.empty((n * slots, inter), dtype=x.dtype, device=x.device)
    t = _tiles(GATE_UP_TILES, tiles, hid)
    if n:
        _gate_up_kernel[(n * slots, triton.cdiv(inter, t["BLOCK_N"]))](
            x.contiguous(), w, shared_w, ids, out, inter, hid, e, w.stride(0), w.stride(1), stride_s,
            SLOTS=slots, **t)
    return out


def moe_down_triton(h: torch.Tensor, w: torch.Tensor, shared: torch.Tensor | None, ids: torch.Tensor,
                    wts: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """``h`` ``[N * S, I]``, ``w`` ``[E, H, I]``, ``shared`` ``[H, I]`` (id ``E``), ``ids``/``wts``
    ``[N, S]`` -> ``sum_s wts * (w[ids] @ h)`` ``[N, H]``."""
    n, slots = ids.shape
    e, hid, inter = w.shape
    if h.shape != (n * slots, inter) or w.stride(2) != 1 or wts.shape != ids.shape:
        raise ValueError(f"moe down: h {tuple(h.shape)}, w {tuple(w.shape)}, ids {tuple(ids.shape)}")
    shared_w, stride_s = shared_or(w, shared)
    out = torch.empty((n, hid), dtype=h.dtype, device=h.device)
    t = _tiles(DOWN_TILES, tiles, inter)
    if n:
        _down_kernel[(n, triton.cdiv(hid, t["BLOCK_N"]))](
            h.contiguous(), w, shared_w, ids, wts, out, hid, inter, e, w.stride(0), w.stride(1), stride_s,
            SLOTS=slots, S_PAD=triton.next_power_of_2(slots), **t)
    return out
