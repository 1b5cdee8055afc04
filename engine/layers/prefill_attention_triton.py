"""Triton flash-attention for prompt rows over the paged KV pool (varlen, GQA, causal over pages).

One program per (query tile of a row, KV head). A tile is ``BLOCK_M`` consecutive (token, head)
pairs of one row's queries for the ``GROUP`` query heads that share the KV head, pair ``j`` being
token ``j // GROUP``, head ``j % GROUP``: K/V tiles loaded once serve the whole group, a short
row (a decode row: ``GROUP`` pairs) still fills the M axis of ``tl.dot``, and the causal diagonal
of a tile spans only ``BLOCK_M / GROUP`` tokens. Each program runs an online softmax (exp2, fp32
accumulators) over ``BLOCK_N``-token K/V tiles read in place through the row's block table, in
two loops: the keys every query of the tile sees (no mask) and then the diagonal band up to the
tile's last query, masked; tiles past it are skipped. The output gate (Qwen3.5 gated attention)
is applied at the store. The grid is ``(tiles of the longest row, rows, KV heads)`` from host
values only, and no launch argument that changes between steps is specialised on, so a step with
new token counts does not compile the kernel again. One-byte pages (``--kv-dtype fp8`` / ``int8``,
``QUANT``) as in the decode kernel: keys converted exactly to the query's dtype with their
per-row scales on the scores, values dequantized in fp32 before the weighted sum; 4-bit pages
(``PACKED``) dequantized tile by tile, keys and values, as the decode kernel does.
Reference: ``prefill_attention_ref``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import launch
from .paged_attention_triton import _pool_rows, check_scales, load_keys4, load_kv4
from .prefill_attention import check_args

# Launch choices by head_dim: ``launch.LaunchSettings.prefill_attention_tiles`` ((query, head)
# pairs per tile, keys per step, warps, pipelining stages; ``bench.prefill_attention --sweep``
# times them).


@triton.jit
def _load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, rows, offs_d, mask, dtype, D: tl.constexpr, MASKED: tl.constexpr,
             QUANT: tl.constexpr, PACKED: tl.constexpr, GS: tl.constexpr, HKV: tl.constexpr, P: tl.constexpr):
    """A K/V tile in ``dtype`` (values dequantized; 4-bit pages: keys too) and the keys' per-row
    scales (unused zeros unless ``QUANT``: a jitted function cannot return None); rows outside
    ``mask`` read as zeros when ``MASKED``."""
    ks = tl.zeros_like(rows).to(tl.float32)
    if PACKED:
        k = load_keys4(k_ptr, ks_ptr, rows, offs_d, mask, D, HKV, P, MASKED)
        v = load_kv4(v_ptr, vs_ptr, rows, offs_d, mask, D, GS, MASKED)
    elif MASKED:
        k = tl.load(k_ptr + rows[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * D + offs_d[None, :], mask=mask[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + rows[:, None] * D + offs_d[None, :])
        v = tl.load(v_ptr + rows[:, None] * D + offs_d[None, :])
    if QUANT:
        if MASKED:
            ks = tl.load(ks_ptr + rows, mask=mask, other=0.0)
            vs = tl.load(vs_ptr + rows, mask=mask, other=0.0)
        else:
            ks = tl.load(ks_ptr + rows)
            vs = tl.load(vs_ptr + rows)
        v = v.to(tl.float32) * vs[:, None]
    return k.to(dtype), v.to(dtype), ks


@triton.jit
def _step(q, k, v, ks, m_i, l_i, acc, qk_scale, visible, MASKED: tl.constexpr, QUANT: tl.constexpr):
    """One K/V tile of the online softmax (scores in log2 units)."""
    s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
    if QUANT:
        s = s * ks[None, :]
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_qt", "stride_bt", "stride_gt"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, ctx_ptr, gate_ptr, out_ptr, qk_scale,
                    stride_qt, stride_qh, stride_bt, stride_gt, stride_gh,
                    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr,
                    QUANT: tl.constexpr, PACKED: tl.constexpr, GS: tl.constexpr):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # a row's last tiles see the most keys: first out
    r = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_ptr + r)
    q_len = tl.load(cu_ptr + r + 1) - q_start
    pairs = q_len * GROUP
    if tile * BLOCK_M < pairs:  # tiles past a shorter row's end have nothing to do
        prefix = tl.load(ctx_ptr + r) - q_len
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < pairs
        tok = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        offs_d = tl.arange(0, D)
        q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=mmask[:, None], other=0.0)
        q_pos = prefix + tok  # absolute positions (padding pairs past the row see the whole band)
        first = prefix + tile * BLOCK_M // GROUP
        last = prefix + (tl.minimum(tile * BLOCK_M + BLOCK_M, pairs) - 1) // GROUP
        full = (first + 1) // BLOCK_N * BLOCK_N  # keys below it are visible to every query of the tile
        bt_row = bt_ptr + r.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(0, full, BLOCK_N):
            rows = _pool_rows(bt_row, start + tl.arange(0, BLOCK_N), full, kvh, HKV, P)
            k, v, ks = _load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, rows, offs_d, None, q.dtype, D, False, QUANT,
                                PACKED, GS, HKV, P)
            m_i, l_i, acc = _step(q, k, v, ks, m_i, l_i, acc, qk_scale, None, False, QUANT)
        # the diagonal band: every query sees key ``full`` (<= first), so no row is all -inf
        for start in range(full, last + 1, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            kmask = k_pos <= last  # keys past the tile's last query: none sees them (may be past ctx)
            rows = _pool_rows(bt_row, k_pos, last + 1, kvh, HKV, P)
            k, v, ks = _load_kv(k_ptr, v_ptr, ks_ptr, vs_ptr, rows, offs_d, kmask, q.dtype, D, True, QUANT,
                                PACKED, GS, HKV, P)
            visible = k_pos[None, :] <= q_pos[:, None]
            m_i, l_i, acc = _step(q, k, v, ks, m_i, l_i, acc, qk_scale, visible, True, QUANT)
        out = acc / l_i[:, None]
        if GATED:  # rounded to the output dtype first, as the torch path multiplies it
            g_rows = (q_start + tok).to(tl.int64) * stride_gt + head * stride_gh
            gate = tl.load(gate_ptr + g_rows[:, None] + offs_d[None, :], mask=mmask[:, None], other=0.0)
            out = out.to(out_ptr.dtype.element_ty).to(tl.float32) / (1.0 + tl.exp(-gate.to(tl.float32)))
        o_rows = ((q_start + tok).to(tl.int64) * H + head) * D
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None])


def prefill_attention_triton(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                             block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, ctx_lens: torch.Tensor,
                             max_seqlen_q: int, scale: float, gate: torch.Tensor | None = None,
                             tiles: dict | None = None, k_scale: torch.Tensor | None = None,
                             v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ``[T, H, D]`` and ``gate`` ``[T, H, D]`` with any row and head strides (unit column
    stride); pages ``[num_pages, P, Hkv, D]`` contiguous; ``block_tables`` ``[R, M]``,
    ``cu_seqlens_q`` ``[R + 1]``, ``ctx_lens`` ``[R]`` int32 on the device; ``max_seqlen_q`` the
    longest row's query count (a host int, at least that row's: a smaller one leaves the rows'
    last tokens uncomputed); ``k_scale`` / ``v_scale`` ``[num_pages, P, Hkv]`` contiguous, the
    rows' scales of one-byte pages (4-bit pages ``[..., D / 2]``: their groups' scales
    ``[num_pages, P, Hkv, D / GS]``; their keys' ranges ``[num_pages, 2, Hkv, D]``).
    ``tiles`` overrides the launch settings' tiles for ``D`` (``BLOCK_M``, ``BLOCK_N``,
    ``num_warps``, ``num_stages``). Returns ``[T, H, D]`` contiguous, in ``q``'s dtype."""
    check_args(q, k_pages, v_pages, block_tables, cu_seqlens_q, ctx_lens, gate)
    t, h, d = q.shape
    _, p, hkv, _ = k_pages.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"prefill attention kernel: head_dim must be a power of two >= 16, got {d}")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("prefill attention kernel: K/V pages must be contiguous")
    packed, gs = check_scales("prefill attention kernel", k_pages, k_scale, v_scale, d)
    quant = k_scale is not None and not packed
    if q.stride(2) != 1 or (gate is not None and gate.stride(2) != 1):
        raise ValueError(f"prefill attention kernel: q strides {q.stride()} / gate strides "
                         f"{None if gate is None else gate.stride()} need a unit column stride")
    if block_tables.stride(1) != 1 or cu_seqlens_q.stride(0) != 1 or ctx_lens.stride(0) != 1:
        raise ValueError("prefill attention kernel: block_tables rows, cu_seqlens_q and ctx_lens must be dense")
    rows = ctx_lens.shape[0]
    if t and not 0 < max_seqlen_q <= t:
        raise ValueError(f"prefill attention kernel: max_seqlen_q {max_seqlen_q} for {t} query tokens")
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or rows == 0:
        return out
    settings = launch.current()
    table = settings.prefill_attention_tiles
    c = dict(table.get(d, table[128]))
    if packed:
        c.update(settings.prefill_attention_4bit_tiles.get(d, {}))
    c.update(tiles or {})
    group = h // hkv
    grid = (triton.cdiv(max_seqlen_q * group, c["BLOCK_M"]), rows, hkv)
    _prefill_kernel[grid](
        q, k_pages, v_pages, q if k_scale is None else k_scale, q if v_scale is None else v_scale, block_tables,
        cu_seqlens_q,
        ctx_lens, q if gate is None else gate, out,
        scale * math.log2(math.e), q.stride(0), q.stride(1), block_tables.stride(0),
        *((0, 0) if gate is None else gate.stride()[:2]),
        H=h, HKV=hkv, D=d, P=p, GROUP=group, BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], GATED=gate is not None,
        QUANT=quant, PACKED=packed, GS=gs, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out
