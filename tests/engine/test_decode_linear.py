"""``decode_linear`` off Triton is ``F.linear``, and ``gemv_tiles`` keeps many rows on cuBLAS."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.engine.layers import fused_linear
from ninfer.engine.layers.fused_linear import GEMV_MAX_ROWS, decode_linear, gemv_tiles, split_linear


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_linear_is_f_linear_on_cpu(m, with_bias, monkeypatch):
    monkeypatch.setattr(fused_linear, "on_triton", lambda t: t.is_cuda)  # interpreter off
    x, w = torch.randn(m, 48), torch.randn(20, 48)
    bias = torch.randn(20) if with_bias else None
    assert torch.equal(decode_linear(x, w, bias), F.linear(x, w, bias))
    parts = split_linear(x, w, [12, 8])
    assert all(torch.equal(p, r) for p, r in zip(parts, F.linear(x, w).split([12, 8], dim=-1)))


def test_gemv_tiles_rule():
    assert gemv_tiles(1, 2048, 4096) is not None  # tall K: cuBLAS would split it
    assert gemv_tiles(1, 12352, 2048) is None  # wide: cuBLAS streams it well
    assert gemv_tiles(0, 2048, 4096) is None
    for m in (GEMV_MAX_ROWS + 1, 64, 4096):
        assert gemv_tiles(m, 2048, 4096) is None
