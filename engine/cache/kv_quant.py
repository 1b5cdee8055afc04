"""Quantized KV pages: one byte per element (``--kv-dtype fp8`` / ``int8``) or two elements per
byte (``--kv-dtype 4bit``): the element formats, the quantization of new K/V rows and its inverse.

Scales are per token and per KV head: each (token, head) row of ``D`` values is stored as ``D``
bytes plus one fp32 scale, ``amax(|row|) / QMAX``, in a side tensor beside the pages
(``PagedKVPool.k_scales`` / ``v_scales``, ``[L_attn, num_pages, P, Hkv]``: the pool row index of
a token's head addresses both). Why per token rather than a static scale per head: a scale fixed
from the first prompt's amax saturates on a later token with a larger outlier (keys after RoPE
and values of attention sinks differ by orders of magnitude from token to token), and needs a
calibration step and state; a per-row scale is computed where the row is written, costs 4 bytes
per ``D`` (3% at ``D = 128``, 6% at 64) and makes every row's error relative to its own size. It
is what many engines do for int8 KV. Writes round to nearest (half away from zero for int8,
the cast's round-to-nearest-even for e4m3) and saturate at ``QMAX``; the attention reads the
bytes, converts the keys exactly to the compute dtype and multiplies the scores by their scales,
and dequantizes each value tile in fp32 (the kernels), or dequantizes the gathered rows first
(the torch paths and the references).

Keys and queries are rotated first (``rotation``: an orthonormal Hadamard matrix per head, so
``q H . k H = q . k`` and the scores are unchanged): keys carry a few outlier channels (RoPE's low
frequencies, attention sinks), and a score's rounding error grows with the largest products
``q_i k_i``; the rotation spreads each over the whole head. Measured on the embedded SmolLM2
(``bench/RESULTS.md``): e4m3 keys took perplexity +1.64% without it, +0.30% with it. The pages
hold rotated keys; values are not rotated (their error does not meet a product of outliers).

4-bit pages (``--kv-dtype 4bit``, stored as ``uint8``, ``[..., D / 2]``): element ``2i`` in the
low nibble of byte ``i``, ``2i + 1`` in the high one. Keys and values are grouped differently, as
KIVI does: keys per channel over a page, values per token.

Keys: each (page, KV head, channel) has an fp16 step and minimum (``k_scales`` ``[num_pages, 2,
Hkv, D]``: steps, then minimums), and a key's code ``c`` in ``0 .. 15`` stands for ``min + c *
step`` over the page's rows. A key's few outlier channels (RoPE's low frequencies, attention
sinks) keep their size from token to token, so a range per channel fits them and the other
channels alike, where a range per row is set by the outliers and rounds the rest coarsely. A
write requantizes each page it touches over the page's rows so far. The earlier rows come from
the pool's exact copy of the page being filled where it has them (``ExactKeys``: per write slot,
the last page's keys as computed), so a page written a row at a time ends with the codes and
ranges a write of the whole page gives; where it has not (a page copied from a prefix checkpoint
or brought back from host memory, a sequence without a write slot) they are its rows
dequantized, rounded again to the wider grid where the range grows. Keys are not rotated. Values: each
group of ``KV4_GROUP`` (32) elements along the head dim has an fp16 scale ``amax(|group|) / 7.5``
(rounded up, so no element falls past the outer codes' cells; +1.90% perplexity on the embedded
model in prompt chunks where fp32 scales gave +1.85%)
(``[..., D / 32]`` beside the pages) and a code ``c`` stands for ``(c - 7.5) * scale``, the
midpoints of 16 equal cells over ``[-amax, amax]``.

Measured on the embedded SmolLM2 (``D = 64``, pages of 16, 4096 tokens, ``bench/RESULTS.md``):
keys per channel over a page +1.3% perplexity alone (+1.5% with the fp16 step and minimum,
+1.8% written a token at a time), against +9.7% for groups of 32 along the rotated head and
+6.2% for asymmetric groups of 16; values per row as above cost nothing measurable; keys and
values through the paged steps +1.85% in prompt chunks, +1.66% a token a step from the exact
rows (+3.55% from the dequantized ones; the first version, groups of 32 of rotated keys: +11.7%). A row costs
``D / 2`` bytes of codes, plus ``4 D / P`` bytes of key ranges a key row and 2 bytes a value
group: 84 bytes per token and KV head at ``D = 64``, ``P = 16`` (5.25 bits an element), against
bf16's 256.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

# ``--kv-dtype``: "auto" stores K/V in the model's compute dtype
KV_DTYPES = ("auto", "bf16", "fp8", "int8", "4bit")
# the pages of ``--kv-dtype 4bit``: two 4-bit codes per byte
PACKED4 = torch.uint8
KV4_GROUP = 32  # elements per scale along the head dim in 4-bit value pages
KEY_STATS_DTYPE = torch.float16  # the step and minimum of a channel of a 4-bit key page
KEY_LEVELS = 15.0  # a 4-bit key code c stands for min + c * step, c in 0 .. 15
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, PACKED4: 7.5}
CODE_MID = 7.5  # a 4-bit code c stands for (c - 7.5) * scale
_STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8, "4bit": PACKED4}
SCALE_DTYPE = torch.float32
# a 4-bit value group's scale: fp16 (2 bytes a group of 32 instead of 4: 7% of a 4-bit page; its
# rounding, 2^-11 relative, is far below a code's step), at most its largest finite value
VALUE4_SCALE_DTYPE = torch.float16
VALUE4_SCALE_MAX = 65504.0
_TINY = 1e-30  # the scale of an all-zero row (its bytes are zeros either way)
_ROTATIONS: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def storage_dtype(kv_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The pages' element type for ``--kv-dtype`` ``kv_dtype`` under compute dtype ``compute_dtype``."""
    return compute_dtype if kv_dtype == "auto" else _STORAGE[kv_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def is_packed(dtype: torch.dtype) -> bool:
    """4-bit pages: two elements per byte, a scale per group of the head dim."""
    return dtype == PACKED4


def key_stats_shape(num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """The shape of one 4-bit key page's ranges: a step and a minimum per (KV head, channel)."""
    return (2, num_kv_heads, head_dim)


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scales beside pages of ``dtype``: fp16 for 4-bit value groups, else fp32."""
    return VALUE4_SCALE_DTYPE if is_packed(dtype) else SCALE_DTYPE


def group_size(head_dim: int) -> int:
    """Elements per scale of a 4-bit row of ``head_dim`` (``KV4_GROUP``, or the whole row if shorter)."""
    return min(KV4_GROUP, head_dim)


def page_shapes(head_dim: int, dtype: torch.dtype) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The trailing shape of one (token, KV head) row in the pages and in their scales (None:
    no scales): ``(D,)`` and ``()`` for one-byte pages, ``(D / 2,)`` and ``(D / 32,)`` for 4-bit."""
    if is_packed(dtype):
        if head_dim % 2 or head_dim % group_size(head_dim):
            raise ValueError(f"4-bit KV pages need an even head_dim that groups of {KV4_GROUP} divide "
                             f"(or shorter), got {head_dim}")
        return (head_dim // 2,), (head_dim // group_size(head_dim),)
    return (head_dim,), (() if is_quantized(dtype) else None)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` ``[..., D]`` to ``dtype`` bytes ``[..., D]`` and their fp32 scales ``[...]``;
    4-bit: packed bytes ``[..., D / 2]`` and a scale per group ``[..., D / KV4_GROUP]``."""
    if is_packed(dtype):
        return _quantize4(x)
    qmax = QMAX[dtype]
    x = x.float()
    scale = (x.abs().amax(dim=-1) / qmax).clamp_min(_TINY)
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:  # half away from zero, as the Triton write does
        y = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return y.to(dtype), scale


def _quantize4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    page_shapes(d, PACKED4)  # checks the head dim
    gs = group_size(d)
    g = x.float().reshape(*x.shape[:-1], d // gs, gs)
    # the codes are those of the scale as stored (an all-zero group's is 0, and so its values)
    exact = (g.abs().amax(dim=-1) / QMAX[PACKED4]).clamp_max(VALUE4_SCALE_MAX)
    scale = exact.to(VALUE4_SCALE_DTYPE)  # rounded up: no element past the outer codes' cells
    up = (scale.view(torch.int16) + 1).view(VALUE4_SCALE_DTYPE)  # the next fp16 above (scales are >= 0)
    scale = torch.where(scale.float() < exact, up, scale)
    step = scale.float().clamp_min(_TINY)[..., None]
    codes = torch.floor(g / step) + 8.0  # the cell of -7.5 .. 7.5 steps, its midpoint code - 7.5
    codes = codes.clamp(0, 15).to(torch.uint8).reshape(*x.shape[:-1], d)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def unpack4(q: torch.Tensor) -> torch.Tensor:
    """Packed bytes ``[..., D / 2]`` to their codes ``[..., D]`` (uint8, ``0 .. 15``)."""
    return torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[..., D]`` times their scales ``[...]`` in ``dtype``; ``q`` as ``dtype`` without
    scales; 4-bit bytes ``[..., D / 2]`` with their group scales ``[..., G]`` to ``[..., D]``."""
    if scale is None:
        return q.to(dtype)
    if is_packed(q.dtype):
        codes = unpack4(q).float() - CODE_MID
        gs = codes.shape[-1] // scale.shape[-1]
        return (codes * scale.float().repeat_interleave(gs, dim=-1)).to(dtype)
    return (q.float() * scale[..., None].float()).to(dtype)


def dequantize_keys4(q: torch.Tensor, stats: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """4-bit key pages ``[n, P, Hkv, D / 2]`` with their ranges ``[n, 2, Hkv, D]`` to ``[n, P, Hkv, D]``."""
    stats = stats.float()
    return (unpack4(q).float() * stats[:, None, 0] + stats[:, None, 1]).to(dtype)


def _key_ranges(rows: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 step and minimum per (page, KV head, channel) over the ``valid`` rows ``[n, P]``
    of pages ``rows`` ``[n, P, Hkv, D]``: the minimum rounded down and the step up, so that the
    rounded grid still covers every row."""
    mask = valid[:, :, None, None]
    low = rows.masked_fill(~mask, float("inf")).amin(1)
    high = rows.masked_fill(~mask, float("-inf")).amax(1)
    low16 = low.to(KEY_STATS_DTYPE)
    down, up = torch.full_like(low16, float("-inf")), torch.full_like(low16, float("inf"))
    low16 = torch.where(low16.float() > low, torch.nextafter(low16, down), low16)
    step = ((high - low16.float()) / KEY_LEVELS).clamp_min(_TINY)
    step16 = step.to(KEY_STATS_DTYPE)
    step16 = torch.where(step16.float() < step, torch.nextafter(step16, up), step16)
    return step16.clamp_min(torch.finfo(KEY_STATS_DTYPE).tiny), low16


KEYS_PER_WRITE = 256  # rows requantized at a time (each takes a copy of its page in fp32)


class ExactKeys(NamedTuple):
    """A layer's exact keys of the pages being filled: write slot ``s`` (one per running sequence)
    holds in ``rows[s]`` ``[P, Hkv, D]`` (the compute dtype) the keys last written to the pool
    rows ``at[s]`` ``[P]`` (``page * P + offset``, -1: none), at their offsets. The last slot takes
    the writes of rows without one and is never read. ``slots`` ``[n]``: each written row's slot."""

    rows: torch.Tensor  # [S + 1, P, Hkv, D]
    at: torch.Tensor  # [S + 1, P] int64
    slots: torch.Tensor  # [n] int64


def write_keys4(pages: torch.Tensor, stats: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
                exact: ExactKeys | None = None) -> None:
    """Write keys ``k`` ``[n, Hkv, D]`` to flat pool rows ``index`` (``page * P + offset``) of 4-bit
    key pages ``[num_pages, P, Hkv, D / 2]`` with ranges ``stats`` ``[num_pages, 2, Hkv, D]``,
    requantizing each page touched over its rows up to the last one written: the earlier rows
    from ``exact`` where it holds them (then kept there with the new ones), else dequantized. The
    rows of one page are adjacent in ``index``, in order (a sequence's tokens); no host sync, so a
    CUDA graph can hold it."""
    for at in range(0, index.shape[0], KEYS_PER_WRITE):
        part = None if exact is None else exact._replace(slots=exact.slots[at : at + KEYS_PER_WRITE])
        _write_keys4(pages, stats, index[at : at + KEYS_PER_WRITE], k[at : at + KEYS_PER_WRITE], part)


def _write_keys4(pages: torch.Tensor, stats: torch.Tensor, index: torch.Tensor, k: torch.Tensor,
                 exact: ExactKeys | None) -> None:
    n, p = index.shape[0], pages.shape[1]
    page, offset = index // p, index % p
    at = torch.arange(n, device=index.device)
    first = torch.ones(n, dtype=torch.bool, device=index.device)
    first[1:] = page[1:] != page[:-1]
    group = torch.cummax(torch.where(first, at, 0), 0).values  # each row's page's first row here
    rows = dequantize_keys4(pages[page], stats[page], torch.float32)  # [n, P, Hkv, D]
    if exact is not None:  # the page's earlier rows as computed, where the row's slot holds them
        unread = exact.rows.shape[0] - 1
        pool_rows = page[:, None] * p + torch.arange(p, device=index.device)
        held = (exact.at[exact.slots] == pool_rows) & (exact.slots < unread)[:, None]
        rows = torch.where(held[:, :, None, None], exact.rows[exact.slots].float(), rows)
    rows[group, offset] = k.float()  # the page's new rows into its first row's copy
    last = torch.zeros(n, dtype=offset.dtype, device=index.device).scatter_reduce(0, group, offset, "amax")
    rows, last = rows[group], last[group]  # every row of a page: its page as the first row holds it
    codes, ranges = quantize_keys4(rows, torch.arange(p, device=index.device)[None, :] <= last[:, None])
    pages.index_copy_(0, page, codes)  # the rows of a page write the same
    stats.index_copy_(0, page, ranges)
    if exact is not None:
        _keep_exact(exact, index, offset, k)


def _keep_exact(exact: ExactKeys, index: torch.Tensor, offset: torch.Tensor, k: torch.Tensor) -> None:
    """The written rows into their slots' exact copies: of the rows of one slot that share an
    offset (a write longer than a page) the last, the page still being filled; the others go to
    the unread slot."""
    p = exact.at.shape[1]
    n = index.shape[0]
    at = torch.arange(n, device=index.device)
    place = exact.slots * p + offset
    latest = torch.full((exact.at.numel(),), -1, dtype=at.dtype, device=index.device)
    latest = latest.scatter_reduce(0, place, at, "amax")
    place = torch.where(latest[place] == at, place, (exact.rows.shape[0] - 1) * p)
    exact.rows.view(-1, *k.shape[1:]).index_copy_(0, place, k.to(exact.rows.dtype))
    exact.at.view(-1).index_copy_(0, place, index)


def quantize_keys4(rows: torch.Tensor, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Key pages ``[n, P, Hkv, D]`` to packed codes ``[n, P, Hkv, D / 2]`` and their ranges
    ``[n, 2, Hkv, D]`` over the rows ``valid`` ``[n, P]`` (all where None; the others' codes are
    clamped to the range)."""
    if valid is None:
        valid = torch.ones(rows.shape[:2], dtype=torch.bool, device=rows.device)
    rows = rows.float()
    step, low = _key_ranges(rows, valid)
    codes = ((rows - low.float()[:, None]) / step.float()[:, None]).nan_to_num_(0.0).round_().clamp_(0, KEY_LEVELS)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), torch.stack([step, low], dim=1)


def quantize_pages(x: torch.Tensor, dtype: torch.dtype, keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole pages ``[n, P, Hkv, D]`` of keys or values to ``dtype`` and their scales (4-bit keys:
    their ranges per page and channel over the rows without NaN), as writes leave them."""
    if keys and is_packed(dtype):
        return quantize_keys4(x, ~x.isnan().any(-1).any(-1))
    return quantize(x, dtype)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or e4m3 tensors viewed as their bytes (torch has no ``index_copy_`` for them on the CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def rotation(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The orthonormal Hadamard matrix ``[D, D]`` (Sylvester's, symmetric) that keys and queries
    are multiplied by before one-byte keys are stored; None where ``head_dim`` is not a power of two."""
    if head_dim & (head_dim - 1):
        return None
    key = (head_dim, torch.device(device), dtype)
    if key not in _ROTATIONS:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _ROTATIONS[key] = (h / head_dim**0.5).to(device=device, dtype=dtype)
    return _ROTATIONS[key]
