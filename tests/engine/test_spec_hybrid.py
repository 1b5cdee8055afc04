"""Speculative decoding on hybrid models (Gated DeltaNet + attention): a verify row's GDN layers
run its positions one after another over the request's slot and keep the states after each, so
the state after the last accepted position goes back in the slot with nothing computed again
(``VerifyRows``). Greedy outputs with ``--spec ngram`` are token for token those without, on tiny
Qwen3.5 dense / MoE and Qwen3-Next checkpoints, alone and batched, through length cuts and stop
strings; an oracle drafter (the model's own greedy tokens) has every draft accepted and leaves
exactly the states a one-token run leaves."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.loader import load_checkpoint, load_model
from support.overlap import drive
from support.spec_drafts import AnswerDrafter, use_drafter
from support.tiny import save_tiny_qwen3_5, save_tiny_qwen3_next

BUILDERS = {"qwen3_5": save_tiny_qwen3_5, "qwen3_5_moe": lambda p: save_tiny_qwen3_5(p, moe=True),
            "qwen3_next": save_tiny_qwen3_next}


@pytest.fixture(scope="module", params=list(BUILDERS))
def hybrid(request, tmp_path_factory):
    ckpt = load_checkpoint(BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def spec_drive(parts, specs, **kw):
    engines: list[LLMEngine] = []
    seen, _ = drive(parts, False, specs, engine_out=engines, **kw)
    return seen, engines[0].counters


def test_greedy_outputs_are_unchanged_with_ngram_drafts(hybrid):
    """Five requests, one arriving while the others verify drafts (its prompt chunks share their
    steps), one cut by ``max_tokens`` and one by a stop string."""
    _, tok = hybrid
    free, _ = drive(hybrid, False, {1: {"max_tokens": 40}})
    text = tok.decode(free["r1"]["tokens"])
    specs = {0: {"max_tokens": 45}, 1: {"max_tokens": 40, "stop": [text[25:28]]}, 2: {"max_tokens": 7},
             3: {"max_tokens": 33}, 4: {"max_tokens": 26}}
    arrivals = {4: (0, 6)}
    plain, _ = drive(hybrid, False, specs, arrivals=dict(arrivals))
    fast, counters = spec_drive(hybrid, specs, arrivals=dict(arrivals), spec="ngram", draft_tokens=4)
    assert fast == plain
    assert plain["r1"]["finish"] == "stop"
    assert counters.spec_rounds > 0  # (random weights: the n-gram drafts are mostly rejected)


@pytest.mark.parametrize("draft_tokens", [1, 8])
def test_one_request_alone(hybrid, draft_tokens):
    specs = {3: {"max_tokens": 50}}
    plain, _ = drive(hybrid, False, specs)
    fast, counters = spec_drive(hybrid, specs, spec="ngram", draft_tokens=draft_tokens)
    assert fast == plain and counters.spec_rounds > 0


def answer_drive(parts, specs, spoil: bool, draft_tokens: int = 4, **kw):
    """``specs`` run with drafts from their own answers (``AnswerDrafter``)."""
    plain, _ = drive(parts, False, specs, **kw)
    answers = {name: seen["tokens"] for name, seen in plain.items()}
    fast, counters = spec_drive(parts, specs, spec="ngram", draft_tokens=draft_tokens,
                                prepare=lambda e: use_drafter(e, AnswerDrafter(answers, draft_tokens, spoil)), **kw)
    return plain, fast, counters


@pytest.mark.parametrize("draft_tokens", [3, 5])
def test_every_accepted_length_rolls_back_to_the_right_state(hybrid, draft_tokens):
    """Drafts from the answer with one token spoiled at a moving position: rounds accept 0 .. k
    drafts, batched and beside a prompt arriving late, cut by ``max_tokens`` mid-round."""
    specs = {0: {"max_tokens": 40}, 1: {"max_tokens": 31}, 2: {"max_tokens": 17}, 3: {"max_tokens": 29}}
    plain, fast, counters = answer_drive(hybrid, specs, True, draft_tokens, arrivals={3: (0, 9)})
    assert fast == plain
    assert 0 < counters.spec_accepted_tokens < counters.spec_draft_tokens
    assert len(counters.spec_accepted_by_position) == draft_tokens  # every position was accepted at times
