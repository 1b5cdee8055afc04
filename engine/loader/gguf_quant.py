"""GGUF tensors kept quantized: Q4_0, Q4_1 and Q8_0 blocks read into ``GroupQuantized`` weights.

Each block covers 32 consecutive elements of a row and starts with its fp16 scale ``d``:

- Q4_0 (18 bytes): 16 bytes of nibbles, ``value = d * (q - 8)``;
- Q4_1 (20 bytes): then an fp16 minimum ``m``, 16 bytes of nibbles, ``value = d * q + m``;
- Q8_0 (34 bytes): 32 int8, ``value = d * q``.

A nibble byte ``j`` holds element ``j`` in its low half and element ``j + 16`` in its high half.
The integers, scales and offsets are kept as the file gives them, so ``GroupQuantized.dequantize``
is exactly ``gguf.quants.dequantize``.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.gguf_reader import ReaderTensor

from ..layers.linear import GroupQuantized

GROUP = 32
KEPT_QUANTIZED = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
_HEADER_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` values 0..15 in element order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def group_quantized(tensor: ReaderTensor) -> GroupQuantized:
    """The 2-D tensor ``[rows, cols]`` (HF dim order) of a Q4_0 / Q4_1 / Q8_0 GGUF tensor."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in KEPT_QUANTIZED:
        raise ValueError(f"tensor {tensor.name!r}: {qtype.name} is not kept quantized")
    cols, rows = (int(d) for d in tensor.shape.tolist())
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
