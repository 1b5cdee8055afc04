"""Programmatic dependent launch (Hopper and newer) for the decode step's Triton kernels.

A kernel launched this way may start while the kernel before it in the stream is still running.
Each of ours lets the next kernel start once all of its own programs run
(``gdc_launch_dependents``), may load what no kernel writes (weights) early, and waits until the
kernels before it have finished and their writes are visible (``gdc_wait``) before it reads
anything they produce or writes anything at all. A chain of such launches hides each kernel's
start (and the latency of its first weight loads) behind the tail of the kernel before; any
other kernel in the stream waits for everything before it, as without PDL. CUDA-graph capture
keeps the launches' programmatic edges.

Two forms, the launch setting ``pdl``: ``late`` (the default) releases the next kernel right
after the wait; ``first`` releases it at the start of each program, before the wait (the next
kernel's programs may then be resident and waiting while this one runs); ``off``. Timed on an H200 at the 35B-A3B shape, batch 1 (bench/RESULTS.md, 2026-12-01 later): off 2.57 ms
per step, release first 2.51, late release 2.50. An earlier form in which the GEMV also read its
first weight chunk before the wait was slower than none (2.71 ms against 2.58).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import launch
from .triton_switch import INTERPRET


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(t: torch.Tensor) -> dict:
    """Launch options for a kernel taking a ``PDL`` constexpr, for a launch on ``t``'s device."""
    mode = launch.current().pdl_mode  # 0 off, 1 release first, 2 release after the wait
    on = mode != 0 and t.is_cuda and not INTERPRET and \
        _hopper(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": mode, "launch_pdl": True} if on else {"PDL": 0}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the kernels before this one and let the next one start, in the order of the mode
    (``PDL``: 1 release first, 2 release after the wait); a no-op without PDL."""
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif PDL == 2:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
