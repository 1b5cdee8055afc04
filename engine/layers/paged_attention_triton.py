"""Triton kernels for paged decode attention (flash-decoding: split the context, then reduce).

Phase 1: one program per (sequence, KV head, split) runs an online softmax over its share of the
context for all query heads of that KV head at once (GQA group on the M axis of ``tl.dot``) and
writes partial max / sum / accumulator. Each sequence's context is cut into ``num_splits`` equal
shares from its length read on the device, and ``num_splits`` is chosen from the batch so that
about two programs run per SM: a lone 4K-token sequence still spreads over the whole card. Phase
2: one program per (sequence, query head, slice of the head dim) merges the splits and, for
gated attention (Qwen3.5), multiplies by ``sigmoid(gate)``. Grid sizes depend only on the batch
and the pool's maximum pages per sequence, so a step can be captured in a CUDA graph.

One-byte pages (``--kv-dtype fp8`` / ``int8``, ``QUANT``): a tile's keys are converted exactly to
the query's dtype and their per-row scales multiply the scores; its values are dequantized
(times their scales, in fp32, then to the query's dtype) before the weighted sum. 4-bit pages
(``--kv-dtype 4bit``, ``PACKED``): each element of a K / V tile reads its byte and nibble, a key
the step and minimum of its page's channel (``load_keys4``), a value the scale of its group
(``load_kv4``), and the tile is dequantized in fp32 before the dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import launch
from ..cache.kv_quant import is_packed
from .pdl import pdl_options, pdl_wait

# Launch choices: ``launch.LaunchSettings``' attention_* fields, by (query heads, KV heads,
# head_dim) where a shape was measured (``bench.attention_tune`` times them). The merge programs
# take slices of the head dim: a lone sequence has only ``H`` heads to merge, each over up to 64
# splits, so whole heads left most SMs idle (8 us per layer for 16 heads of 256 on an H200).
_SM_COUNT: dict[int, int] = {}


def num_splits_for(batch: int, kv_heads: int, max_tokens: int, block_n: int, device: torch.device,
                   programs_per_sm: int | None = None, max_splits: int | None = None) -> int:
    """Splits per sequence: enough programs to fill the card, never more splits than blocks."""
    if device.type != "cuda":  # Triton's interpreter (kernel tests on the CPU)
        index = -1
        _SM_COUNT.setdefault(index, 4)
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    s = launch.current()
    wanted = triton.cdiv((programs_per_sm or s.attention_programs_per_sm) * _SM_COUNT[index], batch * kv_heads)
    return max(1, min(wanted, max_splits or s.attention_max_splits, triton.cdiv(max_tokens, block_n)))


@triton.jit
def _pool_rows(bt_row_ptr, t, ctx, kvh, HKV: tl.constexpr, P: tl.constexpr):
    """Flat K/V pool rows of tokens ``t`` of one sequence for KV head ``kvh`` (0 past ``ctx``)."""
    page = tl.load(bt_row_ptr + t // P, mask=t < ctx, other=0).to(tl.int64)
    return (page * P + t % P) * HKV + kvh


@triton.jit
def load_kv4(ptr, s_ptr, rows, offs_d, mask, D: tl.constexpr, GS: tl.constexpr, MASKED: tl.constexpr):
    """A tile ``[len(rows), D]`` of 4-bit pages in fp32: element ``d`` of pool row ``r`` is nibble
    ``d % 2`` of byte ``r * D / 2 + d / 2`` (code - 7.5) times scale ``r * D / GS + d / GS``; rows
    outside ``mask`` read as zeros when ``MASKED``."""
    byte_at = ptr + rows[:, None] * (D // 2) + offs_d[None, :] // 2
    scale_at = s_ptr + rows[:, None] * (D // GS) + offs_d[None, :] // GS
    if MASKED:
        byte = tl.load(byte_at, mask=mask[:, None], other=0)
        scale = tl.load(scale_at, mask=mask[:, None], other=0.0)
    else:
        byte = tl.load(byte_at)
        scale = tl.load(scale_at)
    code = (byte.to(tl.int32) >> ((offs_d[None, :] % 2) * 4)) & 15
    return (code.to(tl.float32) - 7.5) * scale.to(tl.float32)


@triton.jit
def load_keys4(ptr, st_ptr, rows, offs_d, mask, D: tl.constexpr, HKV: tl.constexpr, P: tl.constexpr,
               MASKED: tl.constexpr):
    """A tile ``[len(rows), D]`` of 4-bit key pages in fp32: element ``d`` of pool row ``r`` (page
    ``r / (P * HKV)``, KV head ``r % HKV``) is nibble ``d % 2`` of byte ``r * D / 2 + d / 2``
    times the step plus the minimum of channel ``d`` of that page and head (ranges ``[pages, 2,
    HKV, D]``: steps, then minimums); rows outside ``mask`` read as zeros when ``MASKED``."""
    byte_at = ptr + rows[:, None] * (D // 2) + offs_d[None, :] // 2
    step_at = st_ptr + ((rows // (P * HKV) * 2 * HKV + rows % HKV) * D)[:, None] + offs_d[None, :]
    if MASKED:
        byte = tl.load(byte_at, mask=mask[:, None], other=0)
        step = tl.load(step_at, mask=mask[:, None], other=0.0)
        low = tl.load(step_at + HKV * D, mask=mask[:, None], other=0.0)
    else:
        byte = tl.load(byte_at)
        step = tl.load(step_at)
        low = tl.load(step_at + HKV * D)
    code = (byte.to(tl.int32) >> ((offs_d[None, :] % 2) * 4)) & 15
    return code.to(tl.float32) * step.to(tl.float32) + low.to(tl.float32)


# integers that move from step to step (block-table width, splits, gate strides) are not
# specialized on (== 1, % 16): each new value would compile a variant inside a user's request
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _partial_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, scale,
                    stride_bt, num_splits,
                    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr,
                    PACKED: tl.constexpr, GS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(len_ptr + b)
    share = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = s * share
    stop = tl.minimum(start + share, ctx)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if start < ctx:  # splits past the context only record an empty partial
        row = _pool_rows(bt_ptr + b * stride_bt, start + tl.arange(0, BLOCK_N), ctx, kvh, HKV, P)
        for off in range(start, stop, BLOCK_N):
            t = off + tl.arange(0, BLOCK_N)
            tmask = t < ctx
            if PACKED:
                k = load_keys4(k_ptr, ks_ptr, row, offs_d, tmask, D, HKV, P, True)
                v = load_kv4(v_ptr, vs_ptr, row, offs_d, tmask, D, GS, True)
            else:
                k = tl.load(k_ptr + row[:, None] * D + offs_d[None, :], mask=tmask[:, None], other=0.0)
                v = tl.load(v_ptr + row[:, None] * D + offs_d[None, :], mask=tmask[:, None], other=0.0)
            if QUANT:
                ks = tl.load(ks_ptr + row, mask=tmask, other=0.0)
                vs = tl.load(vs_ptr + row, mask=tmask, other=0.0)
                v = v.to(tl.float32) * vs[:, None]
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            # the next block's page-table reads go out with this block's K/V reads, not after them
            row = _pool_rows(bt_ptr + b * stride_bt, t + BLOCK_N, tl.minimum(stop, ctx), kvh, HKV, P)
            scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [G_PAD, BLOCK_N]
            if QUANT:
                scores = scores * ks[None, :]
            scores = tl.where(tmask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
    base = (b * H + heads) * num_splits + s
    tl.store(m_ptr + base, m_i, mask=gmask)
    tl.store(l_ptr + base, l_i, mask=gmask)
    tl.store(acc_ptr + base[:, None] * D + offs_d[None, :], acc, mask=gmask[:, None])


@triton.jit(do_not_specialize=["num_splits", "stride_gb", "stride_gh"])
def _reduce_kernel(m_ptr, l_ptr, acc_ptr, gate_ptr, out_ptr, num_splits, stride_gb, stride_gh,
                   H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, S_PAD: tl.constexpr,
                   S_BLOCK: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    bh = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, S_PAD)
    smask = offs_s < num_splits
    m = tl.load(m_ptr + bh * num_splits + offs_s, mask=smask, other=float("-inf"))
    l = tl.load(l_ptr + bh * num_splits + offs_s, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
    denom = tl.sum(w * l, 0)
    out = tl.zeros([BLOCK_D], tl.float32)
    for s0 in tl.static_range(0, S_PAD, S_BLOCK):  # a few splits at a time: bounded registers
        offs = s0 + tl.arange(0, S_BLOCK)
        mask = offs < num_splits
        m_s = tl.load(m_ptr + bh * num_splits + offs, mask=mask, other=float("-inf"))
        w_s = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_max))
        acc = tl.load(acc_ptr + (bh * num_splits + offs)[:, None] * D + offs_d[None, :], mask=mask[:, None],
                      other=0.0)
        out += tl.sum(acc * w_s[:, None], 0)
    out = out / denom
    if GATED:
        gate = tl.load(gate_ptr + (bh // H) * stride_gb + (bh % H) * stride_gh + offs_d).to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32) / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + bh * D + offs_d, out.to(out_ptr.dtype.element_ty))


def check_scales(what: str, k_pages: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 d: int) -> tuple[bool, int]:
    """Whether the pages are 4-bit and their values' group size (``d`` when not 4-bit); a
    ValueError where the scales do not fit the pages (one per row; 4-bit: a key range per page
    and channel, a value scale per group of a row) or are not contiguous."""
    packed = is_packed(k_pages.dtype)
    if k_scale is None and v_scale is None and not packed:
        return False, d
    ok = k_scale is not None and v_scale is not None and k_scale.is_contiguous() and v_scale.is_contiguous()
    if ok and packed:  # the keys' ranges per page and channel, the values' scales per group
        n, _, hkv, _ = k_pages.shape
        ok = k_scale.shape == (n, 2, hkv, d) and v_scale.dim() == 4 and v_scale.shape[:-1] == k_pages.shape[:-1] \
            and d % v_scale.shape[-1] == 0
    elif ok:
        ok = k_scale.shape == v_scale.shape == k_pages.shape[:-1]
    if not ok:
        raise ValueError(f"{what}: scales {None if k_scale is None else tuple(k_scale.shape)} / "
                         f"{None if v_scale is None else tuple(v_scale.shape)} for {k_pages.dtype} pages "
                         f"{tuple(k_pages.shape)}")
    return packed, (d // v_scale.shape[-1] if packed else d)


def paged_decode_attention_triton(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, gate: torch.Tensor | None = None,
                                  tiles: dict | None = None, k_scale: torch.Tensor | None = None,
                                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gate`` ``[B, H, D]`` (any row and head strides): output ``* sigmoid(gate)``. ``k_scale`` /
    ``v_scale`` ``[num_pages, P, Hkv]`` contiguous: the rows' scales of one-byte pages (4-bit
    pages ``[num_pages, P, Hkv, D / 2]``: the keys' ranges ``[num_pages, 2, Hkv, D]``, the values'
    groups' scales ``[num_pages, P, Hkv, D / GS]``). ``tiles``
    overrides the launch choices (the launch settings' ``attention_shape_tiles`` entry for the
    shape, else their attention_* defaults; ``bench.attention_tune`` times them): ``PROGRAMS_PER_SM``, ``MAX_SPLITS``, ``BLOCK_N``
    (tokens per step), ``num_warps`` / ``num_stages`` of the first phase and ``REDUCE_BLOCK_D``."""
    b, h, d = q.shape
    _, p, hkv, _ = k_pages.shape
    settings = launch.current()
    t = dict(settings.attention_shape_tiles.get((h, hkv, d), {}), **(tiles or {}))
    if d & (d - 1) or not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("paged attention kernel: head_dim must be a power of two and pages contiguous")
    packed, gs = check_scales("paged attention kernel", k_pages, k_scale, v_scale, d)
    quant = k_scale is not None and not packed  # a scale per row, on the scores
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    group = h // hkv
    g_pad = max(16, triton.next_power_of_2(group))
    block_n = t.get("BLOCK_N", 32 if d >= 256 else 64)
    max_splits = t.get("MAX_SPLITS") or settings.attention_max_splits
    num_splits = num_splits_for(b, hkv, block_tables.shape[1] * p, block_n, q.device, t.get("PROGRAMS_PER_SM"),
                                max_splits)
    m = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    _partial_kernel[(b, hkv, num_splits)](
        q, k_pages, v_pages, m if k_scale is None else k_scale, m if v_scale is None else v_scale, block_tables,
        context_lens, m, l, acc, scale, block_tables.stride(0), num_splits,
        H=h, HKV=hkv, D=d, P=p, GROUP=group, G_PAD=g_pad, BLOCK_N=block_n, QUANT=quant, PACKED=packed, GS=gs,
        num_warps=t.get("num_warps", 4), num_stages=t.get("num_stages", 2), **pdl_options(q),
    )
    out = torch.empty_like(q)
    if gate is not None and (gate.shape != q.shape or gate.stride(2) != 1):
        raise ValueError(f"paged attention: gate {tuple(gate.shape)} strides {gate.stride()} for q {tuple(q.shape)}")
    block_d = min(d, t.get("REDUCE_BLOCK_D", settings.attention_reduce_block_d))
    _reduce_kernel[(b * h, d // block_d)](m, l, acc, out if gate is None else gate, out, num_splits,
                             *((0, 0) if gate is None else gate.stride()[:2]), H=h, D=d, BLOCK_D=block_d,
                             # padded to the shape's most splits, not this step's: one variant per shape
                             S_PAD=triton.next_power_of_2(max_splits),
                             S_BLOCK=min(8, triton.next_power_of_2(max_splits)),
                             GATED=gate is not None,
                             **pdl_options(q))
    return out
