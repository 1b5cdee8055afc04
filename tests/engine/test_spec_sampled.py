"""Speculative decoding of sampled requests (``spec.py``): the drafts (n-gram, MTP: fixed
tokens, a one-hot draft distribution q) are checked by rejection sampling against the target
distribution p (temperature, top-k / top-p / min-p, logit bias): each position of a verify row
draws its own token from p with the noise a one-token step would use there, the draft is kept
while the draw equals it (probability p(d) = min(1, p/q)), and the first draw that differs is
the token from (p - q)+ renormalised (p without d). Then the request's generator is set back to
the draws committed. So the first token of a round follows p exactly (a chi-square test over
20,000 rounds at temperature 0.7, top-p 0.9), and a seeded request gives the output it gives
without drafts, whatever is accepted."""
from __future__ import annotations

import math

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.request import Request
from ninfer.engine.sampler import Sampler, make_generator
from ninfer.engine.sampling_params import SamplingParams
from ninfer.engine.spec import accepted
from support.decode_paths import load_parts
from support.overlap import drive
from support.spec_drafts import AnswerDrafter, use_drafter


def target(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution a row samples from, by the definitions: softmax(logits / T), then the
    smallest set of most likely ids whose mass reaches top_p, renormalised."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    ordered, order = torch.sort(p, descending=True)
    keep = (torch.cumsum(ordered, dim=-1) - ordered) < top_p
    out = torch.zeros_like(p).scatter_(-1, order, ordered * keep)
    return out / out.sum(dim=-1, keepdim=True)


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square statistic of ``counts`` against ``expected`` (the bins
    expected empty must be empty)."""
    assert counts[expected == 0].sum() == 0
    live = expected > 0
    stat = (((counts[live] - expected[live]) ** 2) / expected[live]).sum()
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def verify_rounds(logits: torch.Tensor, draft: list[int], n: int, params: SamplingParams) -> list[list[int]]:
    """``n`` verify rows of ``1 + k`` positions (``logits`` ``[1 + k, V]``, the same for all),
    each request with its own generator, drawn in one batched ``Sampler.sample``: each row's
    targets."""
    reqs = [Request(f"q{i}", [0], params, max_total_tokens=64) for i in range(n)]
    for r in reqs:
        r.generator = make_generator(params, torch.device("cpu"))
    width = logits.shape[0]
    rows = [r for r in reqs for _ in range(width)]
    tokens = Sampler(torch.device("cpu"), max_rows=len(rows)).sample(logits.repeat(n, 1), rows).tolist()
    return [tokens[i * width : (i + 1) * width] for i in range(n)]


def test_the_first_token_of_a_round_follows_the_target_distribution():
    """Done-when 2: 20,000 rounds of 3 drafts over a 12-token vocabulary at temperature 0.7 and
    top-p 0.9; the drafts are second-likeliest tokens, then one top-p leaves out. The first
    committed token (the first draft kept, or what replaced it) and, in rounds that kept it, the
    second follow p (chi-square, p > 0.01), and the acceptance rate of the first draft is p(d)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 12, generator=gen) * 1.2
    p = target(logits, 0.7, 0.9)
    draft = [int(torch.argsort(p[0], descending=True)[1]), int(torch.argsort(p[1], descending=True)[1]),
             int(torch.argmin(p[2]))]
    assert p[2, draft[2]] == 0 and p[0, draft[0]] > 0.05 and p[1, draft[1]] > 0
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8)
    n = 20_000
    rounds = verify_rounds(logits, draft, n, params)
    kept = torch.tensor([accepted(t, draft) for t in rounds])
    first = torch.bincount(torch.tensor([t[0] for t in rounds]), minlength=12).double()
    assert chi_square_p(first, n * p[0]) > 0.01
    second = torch.bincount(torch.tensor([t[1] for t, a in zip(rounds, kept) if a >= 1]), minlength=12).double()
    assert chi_square_p(second, second.sum() * p[1]) > 0.01
    rate = (kept >= 1).double().mean()
    assert abs(rate - p[0, draft[0]]) < 4 * math.sqrt(p[0, draft[0]] * (1 - p[0, draft[0]]) / n)
    assert int((kept >= 3).sum()) == 0  # the third draft is outside the nucleus: never kept


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_parts("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return load_parts("qwen3_5", tmp_path_factory)


SAMPLED = {0: {"max_tokens": 30, "temperature": 0.7, "top_p": 0.9, "seed": 3},
           1: {"max_tokens": 26, "temperature": 1.0, "top_k": 5, "seed": 4},
           2: {"max_tokens": 21, "temperature": 0.0},
           3: {"max_tokens": 24, "temperature": 0.8, "min_p": 0.05, "seed": 9, "logit_bias": {7: 2.0}}}


@pytest.mark.parametrize("spoil", [False, True])
@pytest.mark.parametrize("model", ["llama", "hybrid"])
def test_seeded_outputs_are_unchanged_whatever_is_accepted(request, model, spoil):
    """Drafts from the requests' own answers (all kept), or with one token spoiled at a moving
    place (every accepted length, rejections resampled): each seeded request gives exactly its
    output without drafts, beside a greedy one."""
    parts = request.getfixturevalue(model)
    plain, _ = drive(parts, False, SAMPLED)
    answers = {name: seen["tokens"] for name, seen in plain.items()}
    engines: list[LLMEngine] = []
    fast, _ = drive(parts, False, SAMPLED, spec="ngram", draft_tokens=4, engine_out=engines,
                    prepare=lambda e: use_drafter(e, AnswerDrafter(answers, 4, spoil)))
    assert fast == plain
    c = engines[0].counters
    assert c.spec_rounds > 10 and c.spec_accepted_tokens > 0
    if not spoil:
        assert c.spec_accepted_tokens == c.spec_draft_tokens
    else:
        assert c.spec_accepted_tokens < c.spec_draft_tokens


def test_unseeded_sampled_requests_speculate_with_ngram_drafts(llama):
    """Unseeded sampled requests run verify rounds and end as asked."""
    specs = {i: {"max_tokens": 25, "temperature": 0.6, "top_p": 0.9} for i in range(3)}
    engines: list[LLMEngine] = []
    seen, _ = drive(llama, False, specs, spec="ngram", draft_tokens=4, engine_out=engines)
    assert all(len(s["tokens"]) == 25 and s["finish"] == "length" for s in seen.values())
    assert engines[0].counters.spec_rounds + engines[0].counters.spec_fallback_steps > 0
