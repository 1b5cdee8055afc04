"""Which tensors take the Triton kernels: CUDA tensors, and every tensor when Triton's
interpreter is on (``TRITON_INTERPRET=1``), so the fused decode path can be checked on a CPU."""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def on_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or INTERPRET
