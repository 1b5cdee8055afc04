"""``gdn_chunk_fla.FixedLaunch`` under Triton's CPU interpreter: a kernel behind
``triton.heuristics`` and ``triton.autotune`` launched once through them, then as its jit
function with what they chose, giving the same result. (fla-core's own kernels run on the GPU
only: ``tests/gpu/test_kernels.py::test_the_chunked_rules_thin_call_equals_fla_cores_forward``.)"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from ninfer.engine.layers.gdn_chunk_fla import FixedLaunch


@triton.heuristics({"HAS_BIAS": lambda args: args["bias"] is not None})
@triton.autotune(configs=[triton.Config({"BLOCK": 16}, num_warps=2)], key=["n"])
@triton.jit
def _scaled(x, bias, y, scale, n, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < n, other=0.0) * scale
    if HAS_BIAS:
        v += tl.load(bias + i, mask=i < n, other=0.0)
    tl.store(y + i, v, mask=i < n)


def test_a_fixed_launch_passes_the_tuners_and_heuristics_choices_after_its_first(monkeypatch):
    x, bias = torch.randn(40), torch.randn(40)
    launch = FixedLaunch(_scaled)
    grid = lambda meta: (triton.cdiv(40, meta["BLOCK"]),)  # noqa: E731
    first, second, plain = torch.empty(40), torch.empty(40), torch.empty(40)
    launch(("bias",), grid, x=x, bias=bias, y=first, scale=2.0, n=40)
    launch(("no bias",), grid, x=x, bias=None, y=plain, scale=2.0, n=40)
    chosen = launch.fixed[("bias",)]
    assert (chosen["BLOCK"], chosen["num_warps"], chosen["HAS_BIAS"]) == (16, 2, True)
    assert launch.fixed[("no bias",)]["HAS_BIAS"] is False

    def tuner_called(*args, **kwargs):
        raise AssertionError("the autotuner ran again")

    monkeypatch.setattr(Autotuner, "run", tuner_called)
    launch(("bias",), grid, x=x, bias=bias, y=second, scale=2.0, n=40)
    assert torch.allclose(first, x * 2.0 + bias) and torch.equal(second, first)
    assert torch.allclose(plain, x * 2.0)
