"""Every kernel variant the interpreter tests launched, lowered to Triton IR for an sm_90 GPU.

The interpreter runs a kernel's body as Python and accepts code that Triton's compiler front end
rejects; this test (collected last, see conftest.py) finds such a kernel on the CPU, naming the
kernel, its launch's constexprs, its file and the compiler's message, instead of on the first GPU
launch."""
from __future__ import annotations

import pytest
import torch

from support import kernel_lowering


def test_launched_kernels_lower_for_sm90():
    """Each distinct (kernel, argument types, constexprs) launched by the tests before this one
    lowers to TTIR for sm_90; the ones that do not are listed by kernel and compiler message."""
    launches = kernel_lowering.recorded()
    if not launches:
        pytest.skip("no kernel launched before this test (run it with the other tests of tests/interp)")
    failures = kernel_lowering.lower_recorded(launches)
    assert not failures, (f"{len(failures)} of {len(launches)} kernel variants do not lower to TTIR:\n\n"
                          + kernel_lowering.report(failures))


def test_a_kernel_the_compiler_rejects_is_reported(monkeypatch):
    """The check itself: a kernel whose helper returns None runs under the interpreter, and its
    lowering fails naming the kernel, its file, the variant and the compiler's error; the variant
    that never returns None lowers."""
    from support import unlowerable

    monkeypatch.setattr(kernel_lowering, "_recorded", dict(kernel_lowering._recorded))  # its launches stay here
    x = torch.arange(8, dtype=torch.float32)
    launches = []
    for scaled in (False, True):
        out = torch.empty_like(x)
        launches.append(kernel_lowering.launch_of(unlowerable.double_kernel, (x, out), {"N": 8, "SCALED": scaled}))
        unlowerable.double_kernel[(1,)](x, out, N=8, SCALED=scaled)
        assert torch.equal(out, 2 * x)
    failures = kernel_lowering.lower_recorded(launches)
    assert [f.launch for f in failures] == launches[:1]
    report = kernel_lowering.report(failures)
    assert "support.unlowerable.double_kernel" in report and "unlowerable.py:" in report
    assert "(N=8, SCALED=False)" in report
    assert "'NoneType' object has no attribute 'type'" in report
