"""The quality gate of ``--kv-dtype`` on the embedded SmolLM2 (trained, so perplexity means
something): the numpy license text scored through engine steps over the paged pools, prompt
chunks reading the earlier chunks' pages, with int8 and fp8 (e4m3) pages (a scale per token and
KV head) against the perplexity with pages in the model's dtype (fp32 on the CPU). The issue's bar
is 0.5% for both: int8 meets it (+0.32%), fp8 does not yet (+1.64%; the keys' error is nearly all
of it: e4m3 keys alone +2.1%, values alone +0.09% on the first 2048 tokens; a Hadamard rotation of
keys and queries before the keys are stored took keys alone to +0.65% there), so fp8 is held to
2% here and its 0.5% check is an expected failure until then."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.loader import load_model
from support.perplexity import paged_perplexity, perplexity, text_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(smollm2):
    return load_model(smollm2, "cpu", torch.float32)  # the Q4_1 matrices kept quantized, as served


@pytest.fixture(scope="module")
def ids(smollm2) -> list[int]:
    return text_ids(smollm2.tokenizer)


@pytest.fixture(scope="module")
def default_ppl(model, ids) -> float:
    ppl = paged_perplexity(model, ids)
    # the paged steps score as the reference path (measured 3.5e-4 apart: the chunks run the
    # quantized matrices on other row counts)
    assert abs(ppl - perplexity(model, ids)) / ppl < 1e-3
    assert ppl < 30, ppl
    return ppl


_PPL: dict[torch.dtype, float] = {}


def one_byte_ppl(model, ids, kv_dtype: torch.dtype, default_ppl: float) -> float:
    if kv_dtype not in _PPL:
        _PPL[kv_dtype] = ppl = paged_perplexity(model, ids, kv_dtype)
        print(f"kv {kv_dtype}: perplexity {ppl:.4f} against {default_ppl:.4f} ({(ppl / default_ppl - 1) * 100:+.3f}%)")
    return _PPL[kv_dtype]


@pytest.mark.parametrize("kv_dtype, bound", [(torch.int8, 0.005), (torch.float8_e4m3fn, 0.02)], ids=["int8", "fp8"])
def test_perplexity_with_one_byte_kv(model, ids, default_ppl, kv_dtype, bound):
    """Measured: int8 +0.32%, fp8 +1.64% (11.8073 / 11.9625 against 11.7695)."""
    ppl = one_byte_ppl(model, ids, kv_dtype, default_ppl)
    assert ppl != default_ppl  # the pages were quantized
    assert abs(ppl - default_ppl) / default_ppl < bound, (ppl, default_ppl)


@pytest.mark.xfail(reason="e4m3 keys: +1.64% against the issue's 0.5% (see the module's docstring)", strict=True)
def test_perplexity_with_fp8_kv_within_the_issues_bar(model, ids, default_ppl):
    ppl = one_byte_ppl(model, ids, torch.float8_e4m3fn, default_ppl)
    assert abs(ppl - default_ppl) / default_ppl < 0.005, (ppl, default_ppl)
