"""The prompt attention kernel over the paged KV pool at real sizes in bf16 against its torch
reference: head_dim 128 and 256, GQA, cached prefixes from 0 to 128K tokens, pages partly filled."""
from __future__ import annotations

import pytest
import torch

from support.kernel_cases import rel_err
from support.prefill_cases import paged_rows

pytestmark = pytest.mark.gpu

# (cached prefix, new queries): a first chunk, a decode-like row, a chunk over a 16K prefix ending
# inside a page, a chunk over a 128K prefix
ROWS = [(0, 700), (5003, 1), (16381, 1000), (131072, 512)]


def _compiled(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("d, h, hkv, page", [(256, 24, 4, 16), (256, 8, 2, 16), (128, 32, 8, 16),
                                             (128, 16, 16, 32), (64, 12, 2, 16)])
def test_prefill_attention_vs_reference(d, h, hkv, page, gated):
    from ninfer.engine.layers.prefill_attention import prefill_attention, prefill_attention_ref

    torch.manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    case = paged_rows(ROWS, h, hkv, d, page, torch.bfloat16, "cuda", gated)
    out = prefill_attention(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.max_q, case.scale,
                            case.gate)
    ref = prefill_attention_ref(case.q.float(), case.k.float(), case.v.float(), case.tables, case.cu, case.ctx,
                                case.scale, None if case.gate is None else case.gate.float())
    for r in range(len(ROWS)):  # each row on its own: the 128K row must not hide a bad short one
        rows = slice(case.cu[r].item(), case.cu[r + 1].item())
        assert rel_err(out[rows], ref[rows]) < 1e-2


def test_new_token_counts_do_not_compile_again():
    """Steps of other row counts, chunk lengths, block-table widths and gate strides reuse the one
    compiled kernel."""
    from ninfer.engine.layers import prefill_attention_triton as kernel_mod

    before = None
    for step, rows in enumerate([[(0, 37)], [(100, 1), (7, 300)], [(16, 16), (0, 5), (999, 64)], [(3, 1)] * 9]):
        case = paged_rows(rows, 24, 4, 256, 16, torch.bfloat16, "cuda", gated=True, spare_pages=step)
        kernel_mod.prefill_attention_triton(case.q, case.k, case.v, case.tables, case.cu, case.ctx, case.max_q,
                                            case.scale, case.gate)
        if before is None:
            before = _compiled(kernel_mod._prefill_kernel)
    torch.cuda.synchronize()
    assert _compiled(kernel_mod._prefill_kernel) == before
