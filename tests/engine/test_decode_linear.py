"""``decode_linear`` / ``norm_linear`` off Triton are ``F.linear`` (after the norm), and
``gemv_tiles`` keeps many rows and unmeasured wide weights on cuBLAS."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.engine.layers import fused_linear
from ninfer.engine import launch
from ninfer.engine.layers.fused_linear import decode_linear, gemv_tiles, norm_linear, split_linear
from ninfer.engine.layers.norm import RMSNorm


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("with_bias", [False, True])
def test_decode_linear_is_f_linear_on_cpu(m, with_bias, monkeypatch):
    """On the CPU it is ``weight @ x.T`` (the weight streamed once for few rows): ``F.linear``'s
    values up to the order of the sums, contiguous like it."""
    monkeypatch.setattr(fused_linear, "on_triton", lambda t: t.is_cuda)  # interpreter off
    x, w = torch.randn(m, 48), torch.randn(20, 48)
    bias = torch.randn(20) if with_bias else None
    out = decode_linear(x, w, bias)
    torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert out.shape == (m, 20) and out.is_contiguous()
    parts = split_linear(x, w, [12, 8])
    for p, r in zip(parts, F.linear(x, w).split([12, 8], dim=-1)):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-5)


def test_norm_linear_is_norm_then_f_linear_on_cpu(monkeypatch):
    monkeypatch.setattr(fused_linear, "on_triton", lambda t: t.is_cuda)
    norm = RMSNorm(48, 1e-6, zero_centered=True)
    torch.nn.init.normal_(norm.weight, 0.0, 0.3)
    x, res, w = torch.randn(2, 48), torch.randn(2, 48), torch.randn(20, 48)
    y, new_res = norm_linear(x, res, norm, w)
    hidden, ref_res = norm(x, res)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(y, F.linear(hidden, w), rtol=1e-5, atol=1e-5)


def test_gemv_tiles_rule(set_launch):
    h200 = set_launch(launch.load("NVIDIA H200"))
    assert gemv_tiles(1, 2000, 4096) is not None  # tall K: cuBLAS would split it
    assert gemv_tiles(1, 12000, 2048) is None  # wide and not measured: cuBLAS streams it well
    assert gemv_tiles(1, 12352, 2048) == h200.gemv_shape_tiles[(1, 12352, 2048)]  # measured: the GEMV won
    assert gemv_tiles(0, 2048, 4096) is None
    for m in (h200.gemv_max_rows + 1, 64, 4096):
        assert gemv_tiles(m, 2048, 4096) is None
