"""GGUF tensors kept quantized: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks read into ``GroupQuantized`` weights.

Each Q4_0 / Q4_1 / Q8_0 block covers 32 consecutive elements of a row and starts with its fp16
scale ``d``:

- Q4_0 (18 bytes): 16 bytes of nibbles, ``value = d * (q - 8)``;
- Q4_1 (20 bytes): then an fp16 minimum ``m``, 16 bytes of nibbles, ``value = d * q + m``;
- Q8_0 (34 bytes): 32 int8, ``value = d * q``.

A nibble byte ``j`` holds element ``j`` in its low half and element ``j + 16`` in its high half.
A Q4_K block (144 bytes) covers 256 elements in 8 groups of 32: fp16 ``d`` and ``dmin``, 12
bytes packing a 6-bit scale ``sc`` and minimum ``m`` per group (unpacked by gguf's
``Q4_K.get_scale_min``), then 128 bytes of nibbles, 32 bytes for each pair of groups (the first
in the low halves); ``value = d * sc * q - dmin * m``, group-wise asymmetric int4 as well.

The other K-quants are held as 8-bit groups (``bits`` 8: one int8 a value):

- Q5_K (176 bytes, 256 elements): ``d``, ``dmin`` and the 12 scale bytes as Q4_K, then 32 bytes
  ``qh`` (bit ``g`` of byte ``i`` is the fifth bit of element ``i`` of group ``g``) and 128 bytes
  of low nibbles laid out as Q4_K's; ``value = d * sc * q - dmin * m``, q in 0..31, groups of 32.
- Q6_K (210 bytes, 256 elements): 128 bytes ``ql`` of low nibbles, 64 bytes ``qh`` of high bit
  pairs, 16 int8 scales (one per 16 elements), fp16 ``d`` last; ``value = d * sc * (q - 32)``, q
  in 0..63, held symmetric (``q - 32`` in -32..31, no offset) in groups of 16. Each half of 128
  elements takes 64 ``ql`` bytes (elements ``j`` and ``j + 64`` in the low and high nibble of
  byte ``j``) and 32 ``qh`` bytes (bits ``2t .. 2t + 1`` of byte ``i`` for element ``32 t + i``).

The integers, scales and offsets are kept as the file gives them, so ``GroupQuantized.dequantize``
is exactly ``gguf.quants.dequantize``.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor
from gguf.quants import Q4_K

from ..layers.linear import GroupQuantized

GROUP = 32
KEPT_QUANTIZED = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                  GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
SUPER_BLOCK = 256  # elements of a K-quant block
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` values 0..15 in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def group_quantized(tensor: ReaderTensor) -> GroupQuantized:
    """The 2-D tensor ``[rows, cols]`` (HF dim order) of a GGUF tensor of a ``KEPT_QUANTIZED`` type;
    a 3-D one (the MoE experts, ``[E, N, K]`` in HF order) as its ``E * N`` rows."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in KEPT_QUANTIZED:
        raise ValueError(f"tensor {tensor.name!r}: {qtype.name} is not kept quantized")
    dims = [int(d) for d in tensor.shape.tolist()]
    cols, rows = dims[0], int(np.prod(dims[1:]))
    if qtype in _SUPER_BLOCK_READERS:
        return _SUPER_BLOCK_READERS[qtype](np.asarray(tensor.data), rows, cols)
    blocks = np.asarray(tensor.data).reshape(rows, cols // GROUP, -1)
    header = _HEADER_BYTES[qtype]
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    body = blocks[..., header:]
    offset = None
    if qtype == GGMLQuantizationType.Q8_0:
        q, bits = torch.from_numpy(body.copy().view(np.int8).reshape(rows, cols)), 8
    else:
        q, bits = torch.from_numpy(_nibbles(body).reshape(rows, cols)), 4
        if qtype == GGMLQuantizationType.Q4_0:
            offset = -8.0 * d
        else:
            offset = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return GroupQuantized(q, torch.from_numpy(d), None if offset is None else torch.from_numpy(offset),
                          GROUP, bits, qtype.name)


def _fp16(raw: np.ndarray) -> np.ndarray:
    """``[B, 2]`` bytes -> ``[B, 1]`` fp32 of the fp16 they hold."""
    return raw.copy().view(np.float16).astype(np.float32)


def _k_scales(blocks: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's per-group ``d * sc`` and ``-dmin * m``, each ``[rows, cols / 32]``."""
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each
    scale = (d * sc.astype(np.float32)).reshape(rows, cols // GROUP)
    offset = (-dmin * m.astype(np.float32)).reshape(rows, cols // GROUP)
    return torch.from_numpy(scale), torch.from_numpy(offset)


def _low_nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """``[B, n]`` bytes, each run of ``span`` bytes holding ``span`` elements in its low halves and
    the next ``span`` in its high ones -> ``[B, 2 n]`` values 0..15 in element order."""
    halves = qs.reshape(len(qs), -1, 1, span) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (halves & 0x0F).reshape(len(qs), -1)


def _q4_k(data: np.ndarray, rows: int, cols: int) -> GroupQuantized:
    blocks = data.reshape(rows * cols // SUPER_BLOCK, 144)
    scale, offset = _k_scales(blocks, rows, cols)
    q = torch.from_numpy(_low_nibbles(blocks[:, 16:], 32).reshape(rows, cols))
    return GroupQuantized(q, scale, offset, GROUP, 4, "Q4_K")


def _q5_k(data: np.ndarray, rows: int, cols: int) -> GroupQuantized:
    blocks = data.reshape(rows * cols // SUPER_BLOCK, 176)
    scale, offset = _k_scales(blocks, rows, cols)
    fifth = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [B, group, 32]
    q = _low_nibbles(blocks[:, 48:], 32) | (fifth.reshape(len(blocks), -1) << 4)
    return GroupQuantized(torch.from_numpy(q.view(np.int8).reshape(rows, cols)), scale, offset, GROUP, 8, "Q5_K")


Q6_K_GROUP = 16


def _q6_k(data: np.ndarray, rows: int, cols: int) -> GroupQuantized:
    blocks = data.reshape(rows * cols // SUPER_BLOCK, 210)
    n = len(blocks)
    low = _low_nibbles(blocks[:, :128], 64)  # [B, 256]
    pairs = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (low | ((pairs & 3).reshape(n, -1) << 4)).view(np.int8) - np.int8(32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [B, 16]
    scale = (_fp16(blocks[:, 208:210]) * sc).reshape(rows, cols // Q6_K_GROUP)
    return GroupQuantized(torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy(scale), None, Q6_K_GROUP, 8,
                          "Q6_K")


_SUPER_BLOCK_READERS = {GGMLQuantizationType.Q4_K: _q4_k, GGMLQuantizationType.Q5_K: _q5_k,
                        GGMLQuantizationType.Q6_K: _q6_k}
