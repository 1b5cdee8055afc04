"""Log-probabilities and logit bias in the batched sampler and the engine's outputs: raw
log-softmax for the rows that ask (nothing for the others), the sampling chain's distribution
after sampling, and a bias that forces or forbids a token; against transformers on a tiny Llama."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampler import Sampler, make_generator
from ninfer.engine.sampling_params import SamplingParamError, SamplingParams
from support.tiny import save_tiny_llama

CPU = torch.device("cpu")


def req(rid: str = "r", prompt=(1, 2), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), max_total_tokens=100)
    r.generator = make_generator(r.params, CPU)
    return r


def step(logits: torch.Tensor, reqs: list[Request]):
    sampler = Sampler(CPU)
    tokens = sampler.sample(logits, reqs)
    probs = sampler.logprobs(logits, reqs, tokens)
    values = None if probs is None else probs.unpack(probs.table.tolist(), tokens.tolist())
    return tokens.tolist(), probs, values


def test_only_the_rows_that_ask_get_log_softmax_of_their_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    reqs = [req("a", temperature=0.0, logprobs=5), req("b", temperature=0.0),
            req("c", temperature=0.7, top_k=10, seed=1, logprobs=0), req("d", temperature=1.3, seed=2, logprobs=20)]
    tokens, probs, values = step(logits, reqs)
    assert probs.rows == [0, 2, 3] and values[1] is None
    reference = torch.log_softmax(logits, dim=-1)
    for i, k in ((0, 5), (2, 0), (3, 20)):
        got = values[i]
        assert got.token == tokens[i] and got.logprob == pytest.approx(float(reference[i, tokens[i]]), abs=1e-5)
        best = torch.topk(reference[i], k) if k else None
        assert [t for t, _ in got.top] == ([] if best is None else best.indices.tolist())
        assert [v for _, v in got.top] == pytest.approx([] if best is None else best.values.tolist(), abs=1e-5)
        assert [v for _, v in got.top] == sorted((v for _, v in got.top), reverse=True)
    assert step(logits, [req("e", temperature=0.0), req("f", seed=3)])[1] is None  # no row asks: nothing done


def test_after_sampling_they_are_the_chains_distribution():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 5.0, 2.0, 3.0]])
    reqs = [req("a", temperature=0.5, top_k=2, seed=0, logprobs=4, logprobs_after_sampling=True),
            req("b", temperature=0.0, logprobs=3, logprobs_after_sampling=True)]
    tokens, _, values = step(logits, reqs)
    kept = torch.softmax(logits[0, :2] / 0.5, -1)
    assert [t for t, _ in values[0].top] == [0, 1]  # ids outside the top 2 have probability 0: left out
    assert [math.exp(v) for _, v in values[0].top] == pytest.approx(kept.tolist(), abs=1e-5)
    assert values[1].token == tokens[1] == 2 and values[1].logprob == 0.0 and values[1].top == ((2, 0.0),)


def test_logit_bias_forces_and_forbids_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 30)
    best = int(logits[0].argmax())
    forced = (best + 7) % 30
    tokens, _, values = step(logits, [req("a", temperature=0.0, logit_bias={forced: 100.0}, logprobs=1),
                                      req("b", temperature=0.0, logit_bias={best: -math.inf}),
                                      req("c", temperature=0.0)])
    assert tokens[0] == forced and tokens[2] == int(logits[2].argmax())
    assert tokens[1] == int(logits[1].masked_fill(torch.arange(30) == best, -math.inf).argmax())
    # the reported values are the model's, before the bias
    assert values[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[forced]), abs=1e-5)
    # sampled rows never draw a forbidden id, whatever their seed
    banned = {i: -math.inf for i in range(0, 30, 2)}
    many = [req(f"s{i}", temperature=2.0, seed=i, logit_bias=banned) for i in range(64)]
    drawn = Sampler(CPU).sample(torch.zeros(64, 30), many).tolist()
    assert all(t % 2 == 1 for t in drawn) and len(set(drawn)) > 5


@pytest.mark.parametrize("params,name", [(dict(logprobs=-1), "logprobs"), (dict(logprobs=101), "logprobs"),
                                         (dict(logit_bias={3: 101.0}), "logit_bias"),
                                         (dict(logit_bias={-1: 1.0}), "logit_bias")])
def test_bad_values_are_refused_by_name(params, name):
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(**params)
    assert err.value.param == name


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def tiny(checkpoint):
    ckpt = load_checkpoint(checkpoint)
    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer, reference


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def check_engine_logprobs(engine: LLMEngine, tok, reference, tolerance: float) -> None:
    """A greedy row with 20 alternatives, a sampled one with 3 and a plain greedy row beside them:
    every token's values against transformers' log-softmax, the plain row without any."""
    prompt = tok.encode("Hello world! How are you today? The quick brown fox")
    reqs = [Request("greedy", prompt, SamplingParams(temperature=0.0, max_tokens=10, logprobs=20, ignore_eos=True),
                    max_total_tokens=256),
            Request("sampled", prompt[:9], SamplingParams(temperature=1.0, seed=7, max_tokens=10, logprobs=3,
                                                          ignore_eos=True), max_total_tokens=256),
            Request("plain", prompt[:5], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                    max_total_tokens=256)]
    for r in reqs:
        engine.add_request(r)
    got: dict[str, list] = {r.request_id: [] for r in reqs}
    while engine.has_work:
        for out in engine.step():
            if out.token_ids:
                assert (out.logprobs is None) == (out.request_id == "plain")
                got[out.request_id] += out.logprobs or []
    for r in reqs[:2]:
        assert [p.token for p in got[r.request_id]] == r.output_ids and len(r.output_ids) == 10
        ref = reference_logprobs(reference, r.prompt_ids + r.output_ids)[len(r.prompt_ids) - 1:-1]
        for row, p in zip(ref, got[r.request_id]):
            assert p.logprob == pytest.approx(float(row[p.token]), abs=tolerance)
            best = torch.topk(row, r.params.logprobs)
            assert [t for t, _ in p.top] == best.indices.tolist()
            assert [v for _, v in p.top] == pytest.approx(best.values.tolist(), abs=tolerance)


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "launched-ahead"])
def test_engine_logprobs_match_transformers(tiny, overlap):
    model, tok, reference = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_context=256, prefill_chunk=16, overlap=overlap))
    check_engine_logprobs(engine, tok, reference, 1e-3)


@pytest.mark.gpu
def test_engine_logprobs_on_cuda_graphs_and_overlap(checkpoint, tiny):
    """On CUDA: decode steps replayed from captured graphs (the plain greedy row's argmax inside
    them), launched ahead of the read-back, the tables read through pinned memory."""
    ckpt = load_checkpoint(checkpoint)
    engine = LLMEngine(load_model(ckpt, "cuda", torch.float32), ckpt.tokenizer,
                       EngineConfig(max_context=256, prefill_chunk=16, device="cuda", max_concurrency=4))
    assert engine.runner.graphs is not None and engine.overlap
    check_engine_logprobs(engine, ckpt.tokenizer, tiny[2], 5e-3)


def test_forced_tokens_have_an_entry_of_their_own(tiny):
    """A thinking budget's close tokens are committed, not sampled: each still has its entry (0.0,
    no alternatives), so the entries stay one per output token."""
    from ninfer.engine.sampling_params import ThinkingControl

    model, tok, _ = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_context=256, prefill_chunk=16))
    close = (5, 6, 7, 2)
    r = Request("r", tok.encode("Hello world!"), SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2,
        thinking=ThinkingControl(end_id=2, budget=3, close_ids=close)), max_total_tokens=256)
    engine.add_request(r)
    entries = []
    while engine.has_work:
        for out in engine.step():
            entries += out.logprobs or []
    assert [e.token for e in entries] == r.output_ids and len(entries) == 10
    assert entries[3:7] == [(t, 0.0, ()) for t in close]
    assert all(len(e.top) == 2 for i, e in enumerate(entries) if not 3 <= i < 7)
