"""KV pages in one byte per element (``--kv-dtype fp8`` / ``int8``): the element formats, the
quantization of new K/V rows and its inverse.

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
"""
from __future__ import annotations

import torch

# ``--kv-dtype``: "auto" stores K/V in the model's compute dtype
KV_DTYPES = ("auto", "bf16", "fp8", "int8")
REFUSED_KV_DTYPES = {"4bit": "4bit KV (keys and values in 4-bit groups) is not implemented yet; "
                             "use fp8 or int8"}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_STORAGE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
SCALE_DTYPE = torch.float32
_TINY = 1e-30  # the scale of an all-zero row (its bytes are zeros either way)
_ROTATIONS: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def storage_dtype(kv_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The pages' element type for ``--kv-dtype`` ``kv_dtype`` under compute dtype ``compute_dtype``."""
    return compute_dtype if kv_dtype == "auto" else _STORAGE[kv_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` ``[..., D]`` to ``dtype`` bytes ``[..., D]`` and their fp32 scales ``[...]``."""
    qmax = QMAX[dtype]
    x = x.float()
    scale = (x.abs().amax(dim=-1) / qmax).clamp_min(_TINY)
    y = (x / scale[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:  # half away from zero, as the Triton write does
        y = torch.sign(y) * torch.floor(y.abs() + 0.5)
    return y.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Bytes ``[..., D]`` times their scales ``[...]`` in ``dtype``; ``q`` as ``dtype`` without scales."""
    if scale is None:
        return q.to(dtype)
    return (q.float() * scale[..., None].float()).to(dtype)


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
