"""The quality gate of ``--kv-dtype`` on the embedded SmolLM2 (trained, so perplexity means
something): the numpy license text scored through engine steps over the paged pools, prompt
chunks reading the earlier chunks' pages, with int8 and fp8 (e4m3) pages (a scale per token and
KV head; keys and queries rotated before the keys are stored, ``cache/kv_quant.py``) within the
issue's 0.5% of the perplexity with pages in the model's dtype (fp32 on the CPU). Without the
rotation fp8 cost +1.64%: nearly all of it the keys' (e4m3 keys alone +2.1%, values alone +0.09%
on the first 2048 tokens).

4-bit pages (two elements a byte; keys with a step and minimum per page of 16 and channel, values
with a scale per 32 of the head dim) within the issue's 3%: measured +1.9%. Per-row groups of the
rotated keys (the first version, groups of 32) cost +11.7%; a key's outlier channels keep their
size from token to token, which a range per channel over a page fits (``cache/kv_quant.py``,
``bench/RESULTS.md``). The prompt chunks here fill whole pages at a time; a decode step writes one
row and requantizes its page from the exact keys its sequence's write slot holds, which
``bench/RESULTS.md`` measures apart, a token a step: +1.66% over the whole text (+3.55% when the
earlier rows were dequantized and rounded again)."""
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


def test_perplexity_with_4bit_kv_within_three_percent(model, ids, default_ppl):
    ppl = paged_perplexity(model, ids, torch.uint8)
    print(f"kv 4bit: perplexity {ppl:.4f} against {default_ppl:.4f} ({(ppl / default_ppl - 1) * 100:+.3f}%)")
    assert ppl != default_ppl
    assert abs(ppl - default_ppl) / default_ppl < 0.03, (ppl, default_ppl)  # measured +1.9%
