"""Triton kernels under Triton's CPU interpreter.

``launchers/test.sh`` runs this folder as a second pass with ``TRITON_INTERPRET=1`` (the variable
must be set before any kernel is defined, so it cannot share a process with the main pass, which
leaves this folder out). Every kernel then runs on CPU tensors with numpy, checking what it
computes on machines without a GPU. Each launch is also noted, and test_kernels_lower.py, run
last, lowers every variant launched to Triton IR for an sm_90 GPU, which finds what the compiler's
front end rejects but the interpreter runs; speed and the rest of compilation are the GPU tests'
part.
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    raise pytest.UsageError("tests/interp needs TRITON_INTERPRET=1 (see launchers/test.sh)")

from triton.runtime import interpreter  # noqa: E402

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_with_scalar_index(tensor, scope) -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and calls ``int()`` on them for
    ``range`` bounds, which NumPy 2.4 refuses; read the one element instead."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_with_scalar_index

from support import kernel_lowering  # noqa: E402

# every interpreted launch is noted; test_kernels_lower.py lowers them for the GPU at the end
kernel_lowering.record_launches()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The lowering check runs after every test that launches kernels."""
    items.sort(key=lambda item: item.path.name == "test_kernels_lower.py")
