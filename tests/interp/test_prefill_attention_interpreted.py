"""The prompt attention kernel over the paged KV pool under Triton's CPU interpreter, against its
torch reference: several rows of different chunk and prefix lengths in one call, GQA, pages in a
shuffled order and partly filled."""
from __future__ import annotations

import pytest
import torch

from support.kernel_cases import rel_err
from support.prefill_cases import dense_reference, paged_rows

# (cached prefix, new queries): a whole first chunk, a decode-like row, prefixes that end inside a
# page, a row with no new query, a chunk longer than a tile of small tiles
ROWS = [(0, 20), (49, 1), (17, 33), (64, 7), (3, 0), (5, 40)]
SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("d, h, hkv", [(64, 4, 4), (128, 8, 2), (256, 12, 2)])  # GQA 1, 4, 6
@pytest.mark.parametrize("tiles", [None, SMALL], ids=["default", "small"])
def test_kernel_matches_reference(d, h, hkv, tiles):
    from ninfer.engine.layers.prefill_attention import prefill_attention_ref
    from ninfer.engine.layers.prefill_attention_triton import prefill_attention_triton

    case = paged_rows(ROWS, h, hkv, d, 16, torch.float32, "cpu", gated=True)
    out = prefill_attention_triton(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.max_q,
                                   case.scale, case.gate, tiles)
    ref = prefill_attention_ref(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.scale, case.gate)
    assert out.shape == (sum(n for _, n in ROWS), h, d)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("page, tiles", [(8, {"BLOCK_M": 32, "BLOCK_N": 16}), (5, {"BLOCK_M": 16, "BLOCK_N": 8}),
                                         (32, {"BLOCK_M": 64, "BLOCK_N": 16})])
def test_page_sizes_and_no_gate(page, tiles):
    """Key tiles spanning several pages, odd page sizes, tiles inside one page; ungated."""
    from ninfer.engine.layers.prefill_attention import prefill_attention_ref
    from ninfer.engine.layers.prefill_attention_triton import prefill_attention_triton

    case = paged_rows(ROWS, 6, 1, 32, page, torch.float32, "cpu")
    out = prefill_attention_triton(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.max_q,
                                   case.scale, None, tiles)
    ref = prefill_attention_ref(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.scale)
    assert rel_err(out, ref) < 1e-5


def test_reference_matches_dense_attention():
    """The reference (pages gathered per row, ``causal_attention``) against contiguous K/V read
    back token by token with an explicit position mask, in fp64."""
    from ninfer.engine.layers.prefill_attention import prefill_attention_ref

    case = paged_rows(ROWS, 8, 2, 32, 16, torch.float32, "cpu", gated=True)
    ref = prefill_attention_ref(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.scale, case.gate)
    assert rel_err(ref, dense_reference(case)) < 1e-5


def test_dispatch_takes_the_kernel_and_max_seqlen_bounds_the_grid():
    """``prefill_attention`` runs the kernel under the interpreter; a ``max_seqlen_q`` larger than
    the longest row only adds programs with nothing to do."""
    from ninfer.engine.layers.prefill_attention import prefill_attention, prefill_attention_ref

    case = paged_rows([(10, 9), (0, 4)], 4, 2, 16, 4, torch.float32, "cpu", gated=True)
    ref = prefill_attention_ref(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.scale, case.gate)
    for max_q in (9, 13):
        out = prefill_attention(case.q, case.k, case.v, case.tables, case.cu, case.ctx, max_q, case.scale, case.gate)
        assert rel_err(out, ref) < 1e-5


def test_bad_arguments_are_refused():
    from ninfer.engine.layers.prefill_attention_triton import prefill_attention_triton

    case = paged_rows([(3, 5)], 4, 2, 16, 4, torch.float32, "cpu")
    args = [case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.max_q, case.scale]
    with pytest.raises(ValueError, match="cu_seqlens_q must be int32"):
        prefill_attention_triton(*args[:4], case.cu.long(), *args[5:])
    with pytest.raises(ValueError, match="max_seqlen_q 0"):
        prefill_attention_triton(*args[:6], 0, case.scale)
    with pytest.raises(ValueError, match="3 query heads for 2 KV heads"):
        prefill_attention_triton(case.q[:, :3], *args[1:])
    with pytest.raises(ValueError, match="for 2 rows"):
        prefill_attention_triton(*args[:5], torch.tensor([8, 8], dtype=torch.int32), *args[6:])
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        odd = paged_rows([(3, 5)], 4, 2, 24, 4, torch.float32, "cpu")
        prefill_attention_triton(odd.q, odd.k, odd.v, odd.tables, odd.cu, odd.ctx, odd.max_q, odd.scale)
