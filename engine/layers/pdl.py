"""Programmatic dependent launch (Hopper and newer) for the decode step's Triton kernels.

A kernel launched this way may start while the kernel before it in the stream is still running.
Each of ours first lets the next kernel start as soon as all of its own programs run
(``gdc_launch_dependents``), may load what no kernel writes (weights), then waits until the
kernels before it have finished and their writes are visible (``gdc_wait``) before it reads
anything they produce or writes anything at all. A chain of such launches hides each kernel's
start (and the latency of its first weight loads) behind the tail of the kernel before; any
other kernel in the stream waits for everything before it, as without PDL. CUDA-graph capture
keeps the launches' programmatic edges.

Two forms: ``NINFER_PDL=1`` releases the next kernel at the start of each program, before the
wait (the next kernel's programs may then be resident and waiting while this one runs);
``NINFER_PDL=late`` releases it right after the wait. Off unless one of them is set: the first
form, with the GEMV also reading its first weight chunk before the wait, made the 35B-A3B
batch-1 step slower on an H200 (2.71 ms against 2.58 without it, bench/RESULTS.md 2026-12-01);
the switch is there so the next measurement is one environment variable away
(``bash bench/gpu_check.sh OUT pdl`` times all three).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .triton_switch import INTERPRET

_MODES = {"1": 1, "late": 2}
MODE = _MODES.get(os.environ.get("NINFER_PDL", ""), 0)  # 0 off, 1 release first, 2 release after the wait


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict:
    """Launch options for a kernel taking a ``PDL`` constexpr, for a launch on ``t``'s device."""
    on = MODE != 0 and t.is_cuda and not INTERPRET and \
        _hopper(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": MODE, "launch_pdl": True} if on else {"PDL": 0}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernels before this one and let the next one start, in the order of the mode
    (``MODE``); a no-op without PDL."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == 2:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
