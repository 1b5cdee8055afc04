"""Triton kernels for MoE decode: routing, and the experts as two grouped GEMVs.

A decode step's MoE block runs as three launches, with expert ids read on the device (no host
sync, so CUDA graphs can capture it):

- ``norm_route_triton``: the layer's residual add + post-attention RMSNorm, the router GEMV and
  the routing in one launch. Program ``(i, g)`` normalises token group ``g`` (rounded as
  ``norm_triton``'s add + norm kernel rounds it) and takes its logits for router rows block
  ``i`` (rounded to the model dtype, as the GEMV's output); the group's last program to bump
  its arrival counter (an int32 the block owns, put back to zero by that program) routes the
  group: per token, softmax over the logits, top-k by repeated arg-max, optional
  renormalisation; when the shared expert is folded in, its gate logit (the router's extra last
  row) becomes one more assignment with weight ``sigmoid(logit)``. ``route_triton`` is that
  routing alone, on logits from a separate GEMM (prefill and the other unfused paths); both
  share ``route_rows``.
- ``moe_gate_up_triton``: per assignment (token, expert), the expert's gate and up rows against
  the token's hidden state, returning ``silu(gate) * up``.
- ``moe_down_triton``: per token, the weighted sum over its assignments of the experts' down
  projections, so no ``[N * k, H]`` intermediate and no separate reduction.

An assignment whose id equals ``num_experts`` reads the shared expert's own weights (same
intermediate size), so the shared expert costs no launches of its own. References: the torch
path of ``moe.SparseMoeBlock`` (``route``, ``FusedExperts``, the shared expert) and, for the fused
launch, ``norm.RMSNorm(x, residual)`` followed by ``route_triton``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import launch
from .norm_triton import inv_rms, norm_weight
from .pdl import pdl_options, pdl_wait


@triton.jit
def expert_rows(w_ptr, shared_ptr, e, shared_id, rows, stride_we, stride_wn, stride_sn):
    """Pointers to weight rows ``rows`` of expert ``e``, or of the shared expert when ``e`` is
    ``shared_id`` (its own ``[rows, K]`` tensor)."""
    r64 = rows.to(tl.int64)
    return tl.where(e == shared_id, shared_ptr + r64 * stride_sn, w_ptr + e * stride_we + r64 * stride_wn)


@triton.jit
def route_rows(logits, gate, E, T: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
               NORM_TOPK: tl.constexpr, SHARED: tl.constexpr):
    """Routing of ``T`` tokens: ``logits`` ``[T, E_PAD]`` fp32 (columns past ``E`` ignored),
    ``gate`` ``[T]`` the shared expert's gate logit (used when ``SHARED``) -> expert ids ``[T, K_PAD]``
    int32 and weights fp32: softmax, top-k by repeated arg-max (lowest id on ties), optional
    renormalisation, the shared expert as slot ``TOP_K`` (id ``E``, weight ``sigmoid(gate)``)."""
    e = tl.arange(0, E_PAD)[None, :]
    slot = tl.arange(0, K_PAD)[None, :]
    logits = tl.where(e < E, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    p = tl.where(e < E, p, -1.0)
    ids = tl.zeros([T, K_PAD], tl.int32)
    wts = tl.zeros([T, K_PAD], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)[:, None]
        idx = tl.min(tl.where(p == best, e, E_PAD), 1)[:, None]
        ids = tl.where(slot == j, idx, ids)
        wts = tl.where(slot == j, best, wts)
        p = tl.where(e == idx, -1.0, p)
    if NORM_TOPK:
        wts = wts / tl.sum(wts, 1)[:, None]
    if SHARED:
        ids = tl.where(slot == TOP_K, E, ids)
        wts = tl.where(slot == TOP_K, (1.0 / (1.0 + tl.exp(-gate)))[:, None], wts)
    return ids, wts


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l,
                  TOP_K: tl.constexpr, SLOTS: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  NORM_TOPK: tl.constexpr, SHARED: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    row = logits_ptr + t * stride_l
    logits = tl.load(row + e, mask=e < E, other=float("-inf")).to(tl.float32)[None, :]
    if SHARED:
        gate = tl.load(row + E + tl.zeros([1], tl.int32)).to(tl.float32)
    else:
        gate = tl.zeros([1], tl.float32)
    ids, wts = route_rows(logits, gate, E, 1, TOP_K, K_PAD, E_PAD, NORM_TOPK, SHARED)
    slot = tl.arange(0, K_PAD)[None, :]
    tl.store(ids_ptr + t * SLOTS + slot, ids, mask=slot < SLOTS)
    tl.store(w_ptr + t * SLOTS + slot, wts, mask=slot < SLOTS)


@triton.jit
def _norm_route_kernel(x_ptr, res_ptr, nw_ptr, r_ptr, normed_ptr, res_out_ptr, logits_ptr, ids_ptr, wts_ptr,
                       count_ptr, N, H, R, E, stride_r, eps,
                       ZERO_CENTERED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                       TOKENS: tl.constexpr, TOP_K: tl.constexpr, SLOTS: tl.constexpr, K_PAD: tl.constexpr,
                       E_PAD: tl.constexpr, NORM_TOPK: tl.constexpr, SHARED: tl.constexpr,
                       WEIGHTS_FIRST: tl.constexpr, PDL: tl.constexpr):
    """Program ``(i, g)``: residual add + RMSNorm of the ``TOKENS`` tokens of group ``g`` and their
    logits for router rows ``[i * ROWS, (i + 1) * ROWS)``; the group's program that arrives last
    (its counter ``count[g]``) routes the group's tokens and puts the counter back to zero.
    ``WEIGHTS_FIRST``: the router rows and norm weight are read before the wait for the kernel
    before (the launch setting ``moe_router_before_wait``)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    group = tl.program_id(1)
    cols = tl.arange(0, BLOCK_H)[None, :]
    cmask = cols < H
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    if not WEIGHTS_FIRST:
        pdl_wait(PDL)
    # this program's router rows, read once (from HBM), issued before anything waits on a load
    router = tl.load(r_ptr + rows.to(tl.int64)[:, None] * stride_r + cols, mask=rmask[:, None] & cmask,
                     other=0.0).to(tl.float32)
    w = norm_weight(nw_ptr, cols, cmask, ZERO_CENTERED)
    if WEIGHTS_FIRST:
        pdl_wait(PDL)  # the weights above are read while the kernel before finishes
    for i in tl.static_range(TOKENS):  # unrolled: the tokens' loads are independent
        t = group * TOKENS + i
        tb = cols * 0 + t  # the token index as a block: masks built from it are block-wise bools
        m = cmask & (tb < N)
        x = tl.load(x_ptr + t * H + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + t * H + cols, mask=m, other=0.0).to(tl.float32)
        total = (x + r).to(res_out_ptr.dtype.element_ty)  # rounded as the unfused add rounds it
        total32 = total.to(tl.float32)
        inv = inv_rms(total32, H, eps, 1)
        normed = (total32 * inv[:, None] * w).to(normed_ptr.dtype.element_ty)
        mine = m & (tb % nprog == pid)  # each token's rows are written by one program
        tl.store(res_out_ptr + t * H + cols, total, mask=mine)
        tl.store(normed_ptr + t * H + cols, normed, mask=mine)
        logit = tl.sum(normed.to(tl.float32) * router, 1)  # [ROWS], rounded below as the GEMV's output
        tl.store(logits_ptr + t * R + rows, logit.to(logits_ptr.dtype.element_ty), mask=rmask & (rows * 0 + t < N))

    tl.debug_barrier()  # every thread's logits stored before the release below
    arrived = tl.atomic_add(count_ptr + group, 1, sem="acq_rel", scope="gpu")
    if arrived == nprog - 1:  # the group's last program: all its logits are written
        e = tl.arange(0, E_PAD)[None, :]
        slot = tl.arange(0, K_PAD)[None, :]
        tok = (group * TOKENS + tl.arange(0, TOKENS))[:, None]
        tmask = tok < N
        # .cg: read from L2, where the other programs' stores landed, never a stale L1 line
        logits = tl.load(logits_ptr + tok * R + e, mask=tmask & (e < E), other=0.0,
                         cache_modifier=".cg").to(tl.float32)
        if SHARED:
            gate = tl.load(logits_ptr + tok * R + E, mask=tmask, other=0.0, cache_modifier=".cg")
            gate = tl.sum(gate.to(tl.float32), 1)
        else:
            gate = tl.zeros([TOKENS], tl.float32)
        ids, wts = route_rows(logits, gate, E, TOKENS, TOP_K, K_PAD, E_PAD, NORM_TOPK, SHARED)
        smask = tmask & (slot < SLOTS)
        tl.store(ids_ptr + tok * SLOTS + slot, ids, mask=smask)
        tl.store(wts_ptr + tok * SLOTS + slot, wts, mask=smask)
        tl.atomic_xchg(count_ptr + group, 0)  # ready for the next launch (next layer, graph replay)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, shared_ptr, ids_ptr, out_ptr, I, HID, E, stride_we, stride_wn, stride_sn,
                    SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # the expert ids come from the kernel before
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
                 SLOTS: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ALL_SLOTS: tl.constexpr, PDL: tl.constexpr):
    """Program ``(t, i)``: output rows ``[i * BLOCK_N, (i + 1) * BLOCK_N)`` of token ``t``, summed
    over its slots. ``ALL_SLOTS``: every slot's rows gathered into one ``[S_PAD * BLOCK_N,
    BLOCK_K]`` tile per step along K (all their loads in flight at once), else slot after slot."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    if ALL_SLOTS:
        pair = tl.arange(0, S_PAD * BLOCK_N)  # (slot, row) pairs, slot-major
        slot = pair // BLOCK_N
        rows = (tl.program_id(1) * BLOCK_N + pair % BLOCK_N).to(tl.int64)
        smask = slot < SLOTS
        mask = smask & (rows < HID)
        e = tl.load(ids_ptr + t * SLOTS + slot, mask=smask, other=0).to(tl.int64)
        wt = tl.load(wts_ptr + t * SLOTS + slot, mask=smask, other=0.0)
        base = expert_rows(w_ptr, shared_ptr, e, E, rows, stride_we, stride_wn, stride_sn)[:, None]
        h_row = h_ptr + (t * SLOTS + slot)[:, None] * I
        acc = tl.zeros([S_PAD * BLOCK_N], tl.float32)
        for k0 in tl.range(0, I, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m = mask[:, None] & (cols < I)[None, :]
            h = tl.load(h_row + cols[None, :], mask=m, other=0.0).to(tl.float32)
            acc += tl.sum(tl.load(base + cols[None, :], mask=m, other=0.0).to(tl.float32) * h, 1)
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * wt  # each expert's output rounded, weighted
        total = tl.sum(tl.reshape(y, [S_PAD, BLOCK_N]), 0)
        out_rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + t * HID + out_rows, total.to(out_ptr.dtype.element_ty), mask=out_rows < HID)
    else:
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
                acc += tl.load(base + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                               other=0.0).to(tl.float32) * h
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


# Launch choices: ``launch.LaunchSettings``' moe_* fields. With programmatic dependent launch
# (``pdl.py``) the fused launch reads its router rows and norm weight before waiting for the
# kernel before (``moe_router_before_wait``); loads ahead of the wait made other kernels slower on
# an H200 (the GEMV's first weight chunk, 2.71 against 2.58 ms per 35B-A3B step; the MoE down
# GEMV's expert rows, 2.79 against 2.69; bench/RESULTS.md, 2026-12-01); this one was never timed
# the other way round, which ``python -m bench.decode ... --set moe_router_before_wait=False``
# does. The fused norm + router + routing launch's programs go by token count N
# (``moe_norm_route_tiles``: the first bound >= N wins; past the last the unfused launches are
# faster): a program takes ``ROWS`` router rows (power of 2) of one group of ``TOKENS`` tokens
# (power of 2); each group is routed by its last program, so groups route in parallel.


def norm_route_tiles(n: int) -> dict | None:
    """Tiles of the fused launch for ``n`` tokens, or None where the unfused launches win."""
    return next((tiles for bound, tiles in launch.current().moe_norm_route_tiles if n <= bound), None)


def norm_route_triton(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      zero_centered: bool, router: torch.Tensor, count: torch.Tensor, top_k: int, num_experts: int,
                      norm_topk_prob: bool, shared: bool, tiles: dict | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch for ``add_rms_norm_triton`` + the router GEMV + ``route_triton``: ``x`` (the
    mixer's output) and ``residual`` ``[N, H]``, ``router`` ``[E (+1 shared gate), H]``, ``count``
    int32 zeros on the device, one per token group (``ceil(N / TOKENS)``), left at zero; one set
    per caller, never used by two launches that may run at once -> ``(normed, residual + x, ids,
    weights)``, ids/weights as ``route_triton``'s."""
    hid = x.shape[-1]
    rows = num_experts + int(shared)
    x2, r2 = x.reshape(-1, hid).contiguous(), residual.reshape(-1, hid).contiguous()
    n, slots = x2.shape[0], top_k + int(shared)
    t = dict(norm_route_tiles(n) or launch.current().moe_norm_route_tiles[-1][1], **(tiles or {}))
    groups = triton.cdiv(n, t["TOKENS"])
    if residual.shape != x.shape or norm_weight.shape != (hid,) or router.shape != (rows, hid) \
            or router.stride(1) != 1 or count.dtype != torch.int32 or count.numel() < groups:
        raise ValueError(f"norm_route: x {tuple(x.shape)}, residual {tuple(residual.shape)}, router "
                         f"{tuple(router.shape)} for {num_experts} experts, shared={shared}, "
                         f"{count.numel()} counters for {groups} token groups")
    normed, res_out = torch.empty_like(x2), torch.empty_like(r2)
    logits = torch.empty((n, rows), dtype=x.dtype, device=x.device)
    ids = torch.empty((n, slots), dtype=torch.int32, device=x.device)
    wts = torch.empty((n, slots), dtype=torch.float32, device=x.device)
    if n:
        _norm_route_kernel[(triton.cdiv(rows, t["ROWS"]), groups)](
            x2, r2, norm_weight, router, normed, res_out, logits, ids, wts, count, n, hid, rows, num_experts,
            router.stride(0), eps, ZERO_CENTERED=zero_centered, BLOCK_H=triton.next_power_of_2(hid),
            ROWS=t["ROWS"], TOKENS=t["TOKENS"], TOP_K=top_k, SLOTS=slots, K_PAD=triton.next_power_of_2(slots),
            E_PAD=triton.next_power_of_2(num_experts), NORM_TOPK=norm_topk_prob, SHARED=shared,
            WEIGHTS_FIRST=launch.current().moe_router_before_wait, num_warps=t["num_warps"], **pdl_options(x))
    return normed.view(x.shape), res_out.view(residual.shape), ids, wts


def shared_or(w: torch.Tensor, shared: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    if shared is None:
        return w, 0
    if shared.shape != w.shape[1:] or shared.stride(1) != 1:
        raise ValueError(f"moe: shared expert weight {tuple(shared.shape)} vs experts {tuple(w.shape)}")
    return shared, shared.stride(0)


def down_tiles(n: int) -> dict:
    """The down GEMV's default tiles for ``n`` tokens (every slot's rows in one tile at one token)."""
    s = launch.current()
    return s.moe_down_tiles_one_token if n == 1 else s.moe_down_tiles


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
    t = _tiles(launch.current().moe_gate_up_tiles, tiles, hid)
    if n:
        _gate_up_kernel[(n * slots, triton.cdiv(inter, t["BLOCK_N"]))](
            x.contiguous(), w, shared_w, ids, out, inter, hid, e, w.stride(0), w.stride(1), stride_s,
            SLOTS=slots, **t, **pdl_options(x))
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
    t = _tiles(down_tiles(n), tiles, inter)
    if n:
        _down_kernel[(n, triton.cdiv(hid, t["BLOCK_N"]))](
            h.contiguous(), w, shared_w, ids, wts, out, hid, inter, e, w.stride(0), w.stride(1), stride_s,
            SLOTS=slots, S_PAD=triton.next_power_of_2(slots), **t, **pdl_options(h))
    return out
