"""Sampling values at the edge of fp32 still give a distribution with the most likely token in it."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.request import Request
from ninfer.engine.sampler import Sampler, distribution
from ninfer.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=5e-324),
    SamplingParams(top_p=5e-324),
    SamplingParams(temperature=1e-45, top_p=1e-45, min_p=1.0),
    SamplingParams(repetition_penalty=5e-324),
])
def test_the_best_token_survives(params):
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.0, 2.5]])
    logits = Sampler(torch.device("cpu")).penalized(logits, [Request("r", [1, 3], params, max_total_tokens=10)])
    probs = distribution(logits, [params])[0]
    assert torch.isfinite(probs).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
    assert probs.argmax().item() == 1 and probs[1] > 0


def test_infinite_and_nan_logits():
    probs = distribution(torch.tensor([[float("inf"), float("nan"), 1.0, float("inf")]]), [SamplingParams()])[0]
    assert probs.tolist() == [0.5, 0.0, 0.0, 0.5]
