"""Speculative decoding with the checkpoint's MTP head (``--spec mtp``, ``spec.MTPDrafter``,
``models/mtp.py``) on tiny Qwen3.5 dense / MoE and Qwen3-Next checkpoints with random MTP
weights added (``support/mtp_weights.py``): greedy outputs are token for token those without
drafts, alone and batched, through stop strings and ``max_tokens`` cut inside a round; the drafts
are the head's own greedy chain, as a reference computation of the head over the whole sequence
gives them; settings are checked."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from support.mtp_weights import add_mtp_weights
from support.overlap import drive, make
from support.tiny import save_tiny_qwen3_5, save_tiny_qwen3_next

BUILDERS = {"qwen3_5": save_tiny_qwen3_5, "qwen3_5_moe": lambda p: save_tiny_qwen3_5(p, moe=True),
            "qwen3_next": save_tiny_qwen3_next}


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param) / "ckpt")
    return load_checkpoint(add_mtp_weights(path, count_in_config=request.param != "qwen3_next"))


@pytest.fixture(scope="module")
def with_mtp(checkpoint):
    return load_model(checkpoint, "cpu", torch.float32, mtp=True), checkpoint.tokenizer


def mtp_drive(parts, specs, draft_tokens=3, **kw):
    engines: list[LLMEngine] = []
    seen, _ = drive(parts, False, specs, engine_out=engines, spec="mtp", draft_tokens=draft_tokens, **kw)
    return seen, engines[0].counters


def test_greedy_outputs_are_unchanged(with_mtp):
    _, tok = with_mtp
    free, _ = drive(with_mtp, False, {1: {"max_tokens": 40}})
    text = tok.decode(free["r1"]["tokens"])
    specs = {0: {"max_tokens": 45}, 1: {"max_tokens": 40, "stop": [text[25:28]]}, 2: {"max_tokens": 7},
             3: {"max_tokens": 33}}
    plain, _ = drive(with_mtp, False, specs, arrivals={3: (0, 6)})
    fast, counters = mtp_drive(with_mtp, specs, arrivals={3: (0, 6)})
    assert fast == plain
    assert counters.spec_rounds > 0 and counters.spec_draft_tokens > counters.spec_rounds


def reference_draft(model, ids: list[int], k: int) -> list[int]:
    """The head's greedy draft after ``ids`` (the last one not yet computed by the main model),
    on the models' reference path: the main model over ``ids[:-1]``, the head over every position
    ``i`` with ``x_{i+1}`` (one run), then ``k - 1`` steps on its own output."""
    from ninfer.engine.cache.sequence import SequenceCache
    from ninfer.engine.models.base import ForwardBatch

    n = len(ids) - 1
    with torch.inference_mode():
        hidden = model(torch.tensor(ids[:-1]), ForwardBatch.single(n, model.new_cache()))
        cache = SequenceCache(model.config.num_hidden_layers + model.config.mtp_layers)
        out = model.mtp_forward(torch.tensor(ids[1:]), hidden, ForwardBatch.single(n, cache))[-1:]
        cache.num_tokens += n
        draft = [int(model.compute_logits(out).argmax())]
        for _ in range(k - 1):
            out = model.mtp_forward(torch.tensor(draft[-1:]), out, ForwardBatch.single(1, cache))
            cache.num_tokens += 1
            draft.append(int(model.compute_logits(out).argmax()))
    return draft


def test_drafts_are_the_heads_greedy_chain_over_the_whole_sequence(with_mtp):
    """The head's K/V, caught up step by step over prompt chunks, verify rows and rejected drafts,
    is the K/V of the committed tokens: each draft equals the reference computation's."""
    model, tok = with_mtp
    engine = LLMEngine(model, tok, EngineConfig(max_context=160, max_concurrency=4, prefill_chunk=16,
                                                kv_capacity=2048, page_size=8, overlap=False, spec="mtp",
                                                draft_tokens=3))
    reqs = [make(i, tok, max_tokens=24) for i in (2, 3)]
    for r in reqs:
        engine.add_request(r)
    checked = 0
    while engine.has_work:
        engine.step()
        for r in reqs:
            if r.mtp_draft:
                assert r.mtp_draft == reference_draft(model, r.all_ids, len(r.mtp_draft)), (r.request_id, r.num_tokens)
                checked += 1
    assert checked >= 10 and engine.counters.spec_rounds >= 10


@pytest.mark.parametrize("batch", [1, 4])
def test_batch_sizes_and_max_tokens_cut_inside_a_round(with_mtp, batch, monkeypatch):
    """Drafts are normally held short of ``max_tokens``; without that limit the cut falls inside
    a round: the output ends exactly where it does without drafts."""
    from ninfer.engine import spec

    specs = {i: {"max_tokens": 9 + 5 * i} for i in range(batch)}
    plain, _ = drive(with_mtp, False, specs)
    monkeypatch.setattr(spec.Drafter, "limit",
                        lambda self, req: min(self.draft_tokens, req.max_total_tokens - req.num_tokens - 1))
    fast, counters = mtp_drive(with_mtp, specs, draft_tokens=5)
    assert fast == plain and counters.spec_rounds > 0


def test_settings_are_checked(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="^draft_tokens must be between 1 and 5 with spec 'mtp'"):
        EngineConfig(spec="mtp", draft_tokens=6)
    EngineConfig(spec="mtp", draft_tokens=5).check_for_model(checkpoint.config)
    plain = load_model(checkpoint, "cpu", torch.float32)  # loaded without its head
    assert plain.mtp is None and plain.config.mtp_layers == 0
    with pytest.raises(ValueError, match="spec 'mtp' needs the checkpoint's MTP head"):
        LLMEngine(plain, checkpoint.tokenizer, EngineConfig(spec="mtp"))
    bare = load_checkpoint(save_tiny_qwen3_5(tmp_path / "bare"))
    assert bare.mtp_weights is None
    with pytest.raises(ValueError, match="spec 'mtp' needs the checkpoint's MTP head"):
        EngineConfig(spec="mtp").check_for_model(bare.config)
    with pytest.raises(ValueError, match="has no MTP weights"):
        load_model(bare, "cpu", torch.float32, mtp=True)


def test_seeded_sampled_requests_keep_their_outputs(with_mtp):
    """Sampled requests take the head's drafts too (rejection sampling, test_spec_sampled.py):
    seeded, they give their outputs without drafts."""
    specs = {0: {"max_tokens": 30, "temperature": 0.7, "top_p": 0.9, "seed": 3},
             1: {"max_tokens": 22, "temperature": 1.0, "top_k": 4, "seed": 8}}
    plain, _ = drive(with_mtp, False, specs)
    fast, counters = mtp_drive(with_mtp, specs)
    assert fast == plain and counters.spec_rounds > 5


def test_a_conversation_goes_on_from_the_answer_checkpoint_with_the_head(with_mtp):
    """The prefix checkpoint kept where a turn's answer ends (its pages hold the head's K/V too)
    serves the next turn, which answers as it does without drafts."""
    from support.overlap import prompt
    from support.spec_drafts import two_turns

    def turns(spec: str):
        engine, *answers = two_turns(with_mtp, spec, 23, 20, draft_tokens=3)
        assert engine.caches.idle()
        return (*answers, engine.counters.spec_rounds)

    plain, fast = turns("off"), turns("mtp")
    assert fast[:3] == plain[:3] and fast[2] > len(prompt(with_mtp[1], 3)) and fast[3] > 0


def test_every_ending_of_the_overlap_scenario(with_mtp):
    """Length, abort, stop token, stop string, the thinking budget's forced close tokens and a
    seeded sampled request arriving late, with the head's drafts."""
    from support.overlap import check_scenario, scenario

    specs, kw = scenario(with_mtp)
    plain, _ = drive(with_mtp, False, specs, **kw)
    fast, counters = mtp_drive(with_mtp, specs, **kw)
    aborted = fast.pop("r1")
    assert aborted["finish"] == "abort" and aborted["tokens"][:5] == plain.pop("r1")["tokens"]
    assert fast == plain
    check_scenario({**fast, "r1": {**aborted, "tokens": aborted["tokens"][:5]}}, specs)
    assert counters.spec_rounds > 0


@pytest.mark.parametrize("spec", ["mtp", "ngram"])
def test_requests_paused_for_pages_come_back_with_the_same_outputs(with_mtp, spec):
    """A KV pool too small for every request at once: the youngest are paused (snapshots, or
    rebuilt by replay without host memory) and resumed; drafts go on after them."""
    specs = {i: {"max_tokens": 40 + 4 * i} for i in range(4)}
    for host in (0, 64):
        plain, _ = drive(with_mtp, False, specs, kv_capacity=160, host_cache_mib=host)
        engines: list[LLMEngine] = []
        fast, _ = drive(with_mtp, False, specs, kv_capacity=160, host_cache_mib=host, spec=spec, draft_tokens=3,
                        engine_out=engines)
        assert fast == plain
        stats = engines[0].scheduler.stats
        assert stats.preempted_snapshot + stats.preempted_replay > 0 and engines[0].counters.spec_rounds > 0


def test_the_server_refuses_spec_mtp_for_a_checkpoint_without_the_head(tmp_path, capsys):
    from ninfer.server import cli

    path = save_tiny_qwen3_5(tmp_path / "bare")
    assert cli.main([str(path), "--spec", "mtp", "--engine-thread", "--device", "cpu"]) == 1
    assert "spec 'mtp' needs the checkpoint's MTP head" in capsys.readouterr().err


def test_the_server_builds_its_engine_with_the_head(checkpoint):
    from ninfer.server import bootstrap

    engine = bootstrap._engine(checkpoint, checkpoint.tokenizer, EngineConfig(spec="mtp", max_context=256,
                                                                             draft_tokens=2), None)
    assert engine.model.mtp is not None and engine.runner.keep_hidden
    assert engine.caches.kv.keys.shape[0] == 2  # the stack's attention layer and the head's
