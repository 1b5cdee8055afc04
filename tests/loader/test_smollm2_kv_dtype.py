"""The quality gate of ``--kv-dtype`` on the embedded SmolLM2 (trained, so perplexity means
something): the numpy license text scored through engine steps over the paged pools, prompt
chunks reading the earlier chunks' pages, with int8 and fp8 (e4m3) pages (a scale per token and
KV head; keys and queries rotated before the keys are stored, ``cache/kv_quant.py``) within the
issue's 0.5% of the perplexity with pages in the model's dtype (fp32 on the CPU). Without the
rotation fp8 cost +1.64%: nearly all of it the keys' (e4m3 keys alone +2.1%, values alone +0.09%
on the first 2048 tokens).

4-bit pages (two elements a byte, a scale per 32 of the head dim, keys rotated) cost +11.7%:
more than the issue's 3%, which stays an expected failure. Nearly all of it is the keys':
4-bit keys with int8 values cost +7.7%, and neither keeping the first token's key exact, random
signs in the rotation nor scales per channel over each page's 16 tokens took keys alone below
+5.9% (``bench/RESULTS.md``); a 135M model with 64-wide heads is more sensitive to key noise
than the large models 4-bit KV is meant for."""
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


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_perplexity_with_one_byte_kv_within_half_a_percent(model, ids, default_ppl, kv_dtype):
    ppl = paged_perplexity(model, ids, kv_dtype)
    print(f"kv {kv_dtype}: perplexity {ppl:.4f} against {default_ppl:.4f} ({(ppl / default_ppl - 1) * 100:+.3f}%)")
    assert ppl != default_ppl  # the pages were quantized
    assert abs(ppl - default_ppl) / default_ppl < 0.005, (ppl, default_ppl)


@pytest.fixture(scope="module")
def ppl_4bit(model, ids) -> float:
    return paged_perplexity(model, ids, torch.uint8)


def test_perplexity_with_4bit_kv(ids, default_ppl, ppl_4bit):
    print(f"kv 4bit: perplexity {ppl_4bit:.4f} against {default_ppl:.4f} ({(ppl_4bit / default_ppl - 1) * 100:+.3f}%)")
    assert ppl_4bit != default_ppl
    assert abs(ppl_4bit - default_ppl) / default_ppl < 0.14, (ppl_4bit, default_ppl)  # measured +11.7%


@pytest.mark.xfail(reason="4-bit keys: +11.7% against the issue's 3% (see the module's docstring)", strict=True)
def test_perplexity_with_4bit_kv_within_the_issues_bar(default_ppl, ppl_4bit):
    assert abs(ppl_4bit - default_ppl) / default_ppl < 0.03, (ppl_4bit, default_ppl)
