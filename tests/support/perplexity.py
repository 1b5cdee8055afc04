"""Perplexity of a model on a fixed English text that every test set-up has (numpy's license),
for the quality gates of the embedded SmolLM2: weights kept quantized or quantized at load
(``tests/loader/test_smollm2_quantized.py``) and the KV cache's element type
(``tests/loader/test_smollm2_kv_dtype.py``)."""
from __future__ import annotations

import importlib.metadata
import math

import pytest
import torch
import torch.nn.functional as F

from ninfer.engine.models.base import ForwardBatch

TEXT_TOKENS = 4096  # tokens scored
WINDOW = 1024  # each scored with the tokens before it in its window as context


def english_text() -> str:
    """numpy's license file (numpy is always installed: the loader reads GGUF through it), about
    47K characters of English, the GPL among them."""
    files = importlib.metadata.distribution("numpy").files or []
    paths = sorted((f for f in files if f.name == "LICENSE.txt" and "dist-info" in str(f)), key=lambda f: len(str(f)))
    if not paths:
        pytest.skip("numpy's LICENSE.txt is not installed")
    return paths[0].read_text(encoding="utf-8")


def text_ids(tokenizer) -> list[int]:
    """The text's first ``TEXT_TOKENS + 1`` token ids."""
    ids = tokenizer.encode(english_text())
    assert len(ids) > TEXT_TOKENS
    return ids[: TEXT_TOKENS + 1]


def _score(nll_count: tuple[float, int], logits: torch.Tensor, targets: list[int]) -> tuple[float, int]:
    nll = F.cross_entropy(logits.float(), torch.tensor(targets), reduction="sum").item()
    return nll_count[0] + nll, nll_count[1] + len(targets)


@torch.no_grad()
def perplexity(model, ids: list[int]) -> float:
    """Each window of ``WINDOW`` tokens through the reference path (a per-sequence cache)."""
    acc = (0.0, 0)
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start : start + WINDOW + 1]
        hidden = model(torch.tensor(window[:-1]), ForwardBatch.single(len(window) - 1, model.new_cache()))
        acc = _score(acc, model.compute_logits(hidden), window[1:])
    return math.exp(acc[0] / acc[1])


@torch.no_grad()
def paged_perplexity(model, ids: list[int], kv_dtype: torch.dtype | None = None, chunk: int = 256,
                     page_size: int = 16) -> float:
    """Each window through engine steps over the paged pools with pages of ``kv_dtype`` (None:
    the model's dtype) in prompt chunks of ``chunk`` tokens, each chunk's attention reading the
    window's earlier chunks from the pages as a served prompt's does."""
    from ninfer.engine.cache.manager import CacheManager
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams
    from ninfer.engine.step import build_step

    dtype = next(model.parameters()).dtype
    caches = CacheManager(model.config, -(-WINDOW // page_size), page_size, 1, dtype, "cpu", kv_dtype=kv_dtype)
    acc = (0.0, 0)
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start : start + WINDOW + 1]
        r = Request("w", window[:-1], SamplingParams(), max_total_tokens=WINDOW + 1)
        r.cache = caches.open()
        for at in range(0, len(window) - 1, chunk):
            n = min(chunk, len(window) - 1 - at)
            assert caches.reserve(r.cache, r.num_computed + n)
            step = build_step([(r, n)], caches, torch.device("cpu"))
            logits = model.compute_logits(model(step.input_ids, step.batch))
            acc = _score(acc, logits, window[at + 1 : at + 1 + n])
            r.num_computed += n
        caches.close(r.cache)
    return math.exp(acc[0] / acc[1])
