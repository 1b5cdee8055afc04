"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) for the loader tests, which the ``gguf`` package reads but
cannot write: random valid blocks, and a plain round-to-nearest encoder of float weights (not
llama.cpp's search for the best scales: any valid block is a fair input to the reader), and the
tensor types of a Q4_K_M / Q5_K_M-like file."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

SUPER = 256  # elements per block
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
K_QUANTS = tuple(BLOCK_BYTES)


def _half_bytes(x: np.ndarray) -> np.ndarray:
    """``[B]`` floats -> ``[B, 2]`` bytes of their fp16."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``[rows, cols / 256 * bytes]`` random bytes, with finite small fp16 ``d`` (and ``dmin``)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // SUPER, BLOCK_BYTES[qtype]), dtype=np.uint8)
    n = len(blocks)
    if qtype == Q.Q6_K:
        blocks[:, 208:210] = _half_bytes(rng.uniform(0.001, 0.02, n))
    else:
        blocks[:, 0:2] = _half_bytes(rng.uniform(0.001, 0.02, n))
        blocks[:, 2:4] = _half_bytes(rng.uniform(0.001, 0.02, n))
    return blocks.reshape(rows, -1)


def _ratio(x: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(unit > 0, x / unit, 0.0)
    return np.clip(np.rint(r), 0, top)


def _fp16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``[B, 8]`` 6-bit scales and minimums -> the 12 bytes Q4_K / Q5_K keep them in."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    first = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    second = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=1)


def _encode_min_scale(blocks: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: header bytes (d, dmin, scales), ``q`` ``[B, 8, 32]`` in 0..``top``."""
    g = blocks.reshape(len(blocks), 8, 32)
    low = np.minimum(g.min(-1), 0.0)
    step = (g.max(-1) - low) / top
    d = _fp16_round(step.max(-1) / 63)
    dmin = _fp16_round((-low).max(-1) / 63)
    sc = _ratio(step, d[:, None], 63)
    m = _ratio(-low, dmin[:, None], 63)
    unit, shift = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = _ratio(g + shift, unit, top).astype(np.uint8)
    header = np.concatenate([_half_bytes(d), _half_bytes(dmin), _pack_scales(sc, m)], axis=1)
    return header, q


def _nibble_pairs(q: np.ndarray, span: int) -> np.ndarray:
    """``[B, n]`` values -> ``[B, n / 2]`` bytes: each run of ``span`` bytes holds ``span``
    elements in its low halves and the next ``span`` in its high ones."""
    runs = (q & 15).reshape(len(q), -1, 2, span)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(len(q), -1)


def encode(w: np.ndarray, qtype: Q) -> np.ndarray:
    """``w`` ``[rows, cols]`` (cols a multiple of 256) as ``qtype`` blocks, rounded to nearest."""
    rows, cols = w.shape
    blocks = w.astype(np.float32).reshape(-1, SUPER)
    n = len(blocks)
    if qtype == Q.Q6_K:
        g = blocks.reshape(n, 16, 16)
        step = np.abs(g).max(-1) / 31
        d = _fp16_round(step.max(-1) / 127)
        sc = _ratio(step, d[:, None], 127)
        q = (_ratio(g + 32 * (d[:, None] * sc)[..., None], (d[:, None] * sc)[..., None], 63)).astype(np.uint8)
        q = q.reshape(n, SUPER)
        halves = q.reshape(n, 2, 128)
        pairs = ((halves >> 4) & 3).reshape(n, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        qh = np.bitwise_or.reduce(pairs, axis=2).reshape(n, 64)
        out = np.concatenate([_nibble_pairs(q, 64), qh, sc.astype(np.int8).view(np.uint8), _half_bytes(d)], axis=1)
    elif qtype == Q.Q4_K:
        header, q = _encode_min_scale(blocks, 15)
        out = np.concatenate([header, _nibble_pairs(q.reshape(n, SUPER), 32)], axis=1)
    elif qtype == Q.Q5_K:
        header, q = _encode_min_scale(blocks, 31)
        fifth = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # [B, group, 32]
        qh = np.bitwise_or.reduce(fifth, axis=1)
        out = np.concatenate([header, qh, _nibble_pairs(q.reshape(n, SUPER), 32)], axis=1)
    else:
        raise ValueError(f"not a K-quant: {qtype.name}")
    assert out.shape[1] == BLOCK_BYTES[qtype]
    return out.reshape(rows, -1)


def mixed_type(kind: str, layer: int | None, layers: int, cols: int, base: Q = Q.Q4_K) -> Q | None:
    """The type of a matrix in a Q4_K_M-like file (``base`` Q5_K: Q5_K_M-like): Q6_K for the
    output head, ``attn_v`` and, in the first half of the layers, ``ffn_down``; ``base`` for the
    others; Q8_0 where the columns are not whole 256-element blocks (None, F32: not even 32)."""
    if cols % SUPER:
        return Q.Q8_0 if cols % 32 == 0 else None
    if kind in ("output", "attn_v") or kind == "ffn_down" and layer is not None and layer < (layers + 1) // 2:
        return Q.Q6_K
    return base
