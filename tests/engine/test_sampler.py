"""Token selection: filters, penalties from the device-side history, per-request generators, and
a whole step sampled together giving each row what it gets alone."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.request import Request
from ninfer.engine.sampler import Sampler, distribution, make_generator
from ninfer.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def req(prompt=(1, 2), output=(), rid="r", **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), max_total_tokens=100)
    r.output_ids = list(output)
    r.generator = make_generator(r.params, CPU)
    return r


def sample(logits: torch.Tensor, reqs: list[Request], sampler: Sampler | None = None) -> list[int]:
    return (sampler or Sampler(CPU)).sample(logits, reqs).tolist()


def test_filters_keep_only_the_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])

    def probs(**params):
        return distribution(logits, [SamplingParams(**params)])[0]

    assert torch.count_nonzero(probs(top_k=2)) == 2
    p = probs(top_p=0.8)
    full = torch.softmax(logits[0], -1)
    assert torch.count_nonzero(p) == 2 and full[0] < 0.8 <= full[:2].sum()  # smallest set reaching top_p
    assert torch.allclose(p[:2], full[:2] / full[:2].sum())
    assert torch.count_nonzero(probs(min_p=0.3)) == 2  # e^-1 >= 0.3 > e^-2
    assert torch.allclose(probs(temperature=0.5), torch.softmax(logits[0] / 0.5, -1))
    # top-k, then min-p and top-p among those: the same as the filters over the whole vocabulary
    both = probs(top_k=3, top_p=0.9)
    alone = torch.softmax(logits[0, :3], -1)
    assert torch.count_nonzero(both) == 2 and torch.allclose(both[:2], alone[:2] / alone[:2].sum())


def test_rows_of_one_step_keep_their_own_filters():
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(top_k=7, temperature=0.3),
              SamplingParams(), SamplingParams(min_p=0.2, top_k=30)]
    together = distribution(logits, params)
    for i, p in enumerate(params):
        assert torch.allclose(together[i], distribution(logits[i : i + 1], [p])[0])
    assert int(torch.count_nonzero(together[0])) == 3 and int(torch.count_nonzero(together[3])) == 40
    assert int(torch.count_nonzero(together[2])) <= 7


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    out = Sampler(CPU).penalized(logits, [req([0], [1], repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, 1.0]]  # seen tokens: positive / 2, negative * 2
    out = Sampler(CPU).penalized(logits, [req([2], [3, 3], presence_penalty=0.5, frequency_penalty=0.25)])
    assert out.tolist() == [[2.0, -2.0, 1.0, 1.0 - 0.5 - 0.5]]  # output only: prompt token 2 untouched


def test_penalty_history_follows_the_output_as_it_grows_and_rows_are_reused():
    sampler = Sampler(CPU)
    logits = torch.zeros(1, 6)
    r = req([5], [], rid="a", frequency_penalty=1.0, repetition_penalty=2.0)
    assert sampler.penalized(logits, [r]).tolist() == [[0.0] * 6]
    r.output_ids += [2, 2]  # counted once each, as the steps append them
    assert sampler.penalized(logits, [r]).tolist() == [[0.0, 0.0, -2.0, 0.0, 0.0, 0.0]]
    r.output_ids.append(4)  # e.g. a forced token: it counts the same
    assert sampler.penalized(logits + 1, [r]).tolist() == [[1.0, 1.0, 0.5 - 2.0, 1.0, 0.5 - 1.0, 0.5]]
    sampler.release(r)
    fresh = req([0], [], rid="b", frequency_penalty=1.0, repetition_penalty=2.0)  # takes the freed row
    assert sampler.penalized(logits + 1, [fresh]).tolist() == [[0.5, 1.0, 1.0, 1.0, 1.0, 1.0]]
    many = [req([i], [i], rid=f"m{i}", presence_penalty=1.0) for i in range(6)]  # the pool grows
    out = sampler.penalized(torch.zeros(6, 6), many)
    assert out.tolist() == [[-1.0 if j == i else 0.0 for j in range(6)] for i in range(6)]


def test_mixed_batch_matches_each_row_alone():
    torch.manual_seed(3)
    logits = torch.randn(6, 50)

    def reqs():
        return [req(temperature=0.0, rid="a"), req(temperature=0.9, seed=11, rid="b"),
                req(temperature=0.0, repetition_penalty=1.3, rid="c"), req(temperature=1.2, top_k=5, seed=12, rid="d"),
                req(temperature=0.7, top_p=0.9, top_k=20, seed=13, rid="e"),
                req(temperature=1.0, top_p=0.8, presence_penalty=0.5, output=(3, 4), seed=14, rid="f")]

    together = sample(logits, reqs())
    alone = [sample(logits[i : i + 1], [r])[0] for i, r in enumerate(reqs())]
    assert together == alone
    assert together[0] == int(torch.argmax(logits[0]))


def test_seeded_generator_repeats_and_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: the draw depends on the generator alone

    def draws(seed: int, **params) -> list[int]:
        r = req(temperature=1.0, seed=seed, **params)
        return [sample(logits, [r])[0] for _ in range(20)]

    assert draws(5) == draws(5) and draws(5, top_k=50) == draws(5, top_k=50)
    assert draws(5) != draws(6)


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.5, top_k=4), dict(top_p=0.7),
                                    dict(top_k=3, min_p=0.3)])
def test_draws_follow_the_distribution(params):
    """Over many draws, each id comes up as often as its filtered probability says."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    p = distribution(logits, [SamplingParams(**params)])[0]
    sampler = Sampler(CPU)
    r = req(seed=1, **params)
    n = 6000
    counts = torch.bincount(torch.tensor([sample(logits, [r], sampler)[0] for _ in range(n)]), minlength=6)
    assert torch.all(counts[p == 0] == 0)
    assert torch.allclose(counts.float() / n, p, atol=0.025)
