"""Every kernel variant the interpreter tests launched, lowered to Triton IR for an sm_90 GPU.

The interpreter runs a kernel's body as Python and accepts code that Triton's compiler front end
rejects; this test (collected last, see conftest.py) finds such a kernel on the CPU, naming the
kernel, its launch's constexprs, its file and the compiler's message, instead of on the first GPU
launch."""
from __future__ import annotations

import pytest

from support import kernel_lowering


def test_launched_kernels_lower_for_sm90():
    launches = kernel_lowering.recorded()
    if not launches:
        pytest.skip("no kernel launched before this test (run it with the other tests of tests/interp)")
    failures = kernel_lowering.lower_recorded(launches)
    assert not failures, (f"{len(failures)} of {len(launches)} kernel variants do not lower to TTIR:\n\n"
                          + kernel_lowering.report(failures))
