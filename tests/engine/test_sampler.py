"""Token selection: filters, penalties, per-request generators, and one read for a mixed batch."""
from __future__ import annotations

import torch

from ninfer.engine.request import Request
from ninfer.engine.sampler import apply_penalties, filtered_probs, make_generator, sample
from ninfer.engine.sampling_params import SamplingParams


def req(prompt=(1, 2), output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), max_total_tokens=100)
    r.output_ids = list(output)
    r.generator = make_generator(r.params, torch.device("cpu"))
    return r


def test_filters_keep_only_the_allowed_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert torch.count_nonzero(filtered_probs(logits, SamplingParams(top_k=2))) == 2
    p = filtered_probs(logits, SamplingParams(top_p=0.8))
    full = torch.softmax(logits, -1)
    assert torch.count_nonzero(p) == 2 and full[0] < 0.8 <= full[:2].sum()  # smallest set reaching top_p
    assert torch.count_nonzero(filtered_probs(logits, SamplingParams(min_p=0.3))) == 2  # e^-1 >= 0.3 > e^-2
    assert torch.isclose(filtered_probs(logits, SamplingParams(temperature=0.5)).sum(), torch.tensor(1.0))


def test_penalties_follow_their_definitions():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    out = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert out.tolist() == [1.0, -4.0, 1.0, 1.0]  # seen tokens: positive / 2, negative * 2
    out = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2], [3, 3])
    assert out.tolist() == [2.0, -2.0, 1.0, 1.0 - 0.5 - 0.5]  # output only: prompt token 2 untouched


def test_mixed_batch_matches_each_row_alone():
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    reqs = [req(temperature=0.0), req(temperature=0.9, seed=11), req(temperature=0.0, repetition_penalty=1.3),
            req(temperature=1.2, top_k=5, seed=12)]
    together = sample(logits, reqs)
    alone = [sample(logits[i : i + 1], [r])[0] for i, r in enumerate(
        [req(temperature=0.0), req(temperature=0.9, seed=11), req(temperature=0.0, repetition_penalty=1.3),
         req(temperature=1.2, top_k=5, seed=12)])]
    assert together == alone
    assert together[0] == int(torch.argmax(logits[0]))


def test_seeded_generator_repeats_and_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: the draw depends on the generator alone

    def draws(seed: int) -> list[int]:
        r = req(temperature=1.0, seed=seed)
        return [sample(logits, [r])[0] for _ in range(20)]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)
