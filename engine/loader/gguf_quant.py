"""GGUF tensors kept quantized: Q4_0, Q4_1, Q8_0 and Q4_K blocks read into ``GroupQuantized`` weights.

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
                  GGMLQuantizationType.Q4_K)
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` values 0..15 in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def group_quantized(tensor: ReaderTensor) -> GroupQuantized:
    """The 2-D tensor ``[rows, cols]`` (HF dim order) of a Q4_0 / Q4_1 / Q4_K / Q8_0 GGUF tensor."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in KEPT_QUANTIZED:
        raise ValueError(f"tensor {tensor.name!r}: {qtype.name} is not kept quantized")
    cols, rows = (int(d) for d in tensor.shape.tolist())
    if qtype == GGMLQuantizationType.Q4_K:
        return _q4_k(np.asarray(tensor.data), rows, cols)
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


def _q4_k(data: np.ndarray, rows: int, cols: int) -> GroupQuantized:
    blocks = data.reshape(rows * cols // 256, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = torch.from_numpy((qs & 0x0F).reshape(rows, cols))
    scale = torch.from_numpy((d * sc.astype(np.float32)).reshape(rows, cols // GROUP))
    offset = torch.from_numpy((-dmin * m.astype(np.float32)).reshape(rows, cols // GROUP))
    return GroupQuantized(q, scale, offset, GROUP, 4, "Q4_K")
