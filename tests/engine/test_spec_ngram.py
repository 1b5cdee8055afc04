"""Speculative decoding with n-gram drafts (``--spec ngram``, ``engine/spec.py``): what users get
is token for token what one-token steps give, on a tiny random Llama and on the embedded
SmolLM2, alone and beside other requests (prompts still being computed among them), through
every way a request ends (length cut inside an accepted run, stop tokens and strings, aborts,
a forced thinking close), with logprobs; drafts that hit are counted (hybrid models: test_spec_hybrid.py)."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams, ThinkingControl
from ninfer.engine.spec import Drafter, NgramIndex, accepted
from support.decode_paths import load_parts
from support.overlap import CLOSE, check_scenario, drive, scenario
from support.spec_drafts import use_drafter
from support.tiny import save_tiny_qwen3_5


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return load_parts("llama", tmp_path_factory)


def spec_drive(parts, specs, **kw):
    engines: list[LLMEngine] = []
    seen, ahead = drive(parts, kw.pop("overlap", False), specs, spec="ngram", engine_out=engines, **kw)
    return seen, ahead, engines[0].counters


# ---------------------------------------------------------------------------- the drafter
def test_ngram_lookup_takes_the_longest_suffix_at_its_latest_place():
    ids = [1, 2, 3, 9, 2, 3, 7, 5, 1, 2, 3]
    index = NgramIndex(1, 3)
    index.update(ids)
    assert index.propose(ids, 2) == [9, 2]  # "1 2 3" last seen at the start (longest first)
    ids2 = [4, 2, 3, 9, 2, 3, 7, 5, 2, 3]
    index2 = NgramIndex(1, 3)
    index2.update(ids2)
    assert index2.propose(ids2, 3) == [7, 5, 2]  # "2 3" (no "5 2 3" before): its latest place
    assert NgramIndex(2, 3).propose([1, 2, 3], 2) == []  # nothing indexed: no draft


def test_ngram_lookup_keeps_up_as_the_sequence_grows_and_repeats_its_period():
    index = NgramIndex(1, 3)
    ids = [5, 6, 7]
    index.update(ids)
    assert index.propose(ids, 4) == []
    ids += [5, 6]
    index.update(ids)
    assert index.propose(ids, 4) == [7, 5, 6, 7]  # the copy runs into the tail: the period goes on
    ids = [8, 8]
    index = NgramIndex(1, 3)
    index.update(ids)
    assert index.propose(ids, 3) == [8, 8, 8]
    assert accepted([1, 2, 3], [1, 2]) == 2 and accepted([1, 4, 3], [1, 2]) == 1 and accepted([0], []) == 0


def test_settings_are_checked_by_name():
    for field, value in (("spec", "eagle"), ("draft_tokens", 0), ("draft_tokens", 9), ("ngram_min", 0),
                         ("ngram_max", 0)):
        with pytest.raises(ValueError, match=f"^{field} "):
            EngineConfig(**{field: value})
    assert EngineConfig().spec == "off"


def test_a_hybrid_model_is_accepted(tmp_path):
    """Hybrid models speculate too (their verify rows keep per-position states: test_spec_hybrid.py)."""
    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path / "qwen3_5"))
    EngineConfig(spec="ngram").check_for_model(ckpt.config)


# ---------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("draft_tokens", [1, 4, 8])
def test_greedy_outputs_are_unchanged_beside_prompts_being_computed(parts, draft_tokens):
    """Six greedy requests of different prompt lengths, two of them arriving while the others
    decode (their prompt chunks share steps with rows that verify drafts)."""
    specs = {i: {"max_tokens": 30 + 7 * i} for i in range(6)}
    arrivals = {4: (0, 5), 5: (1, 11)}
    plain, _ = drive(parts, False, specs, arrivals=dict(arrivals))
    fast, _, counters = spec_drive(parts, specs, arrivals=dict(arrivals), draft_tokens=draft_tokens)
    assert fast == plain
    assert counters.spec_rounds > 0 and counters.spec_accepted_tokens > 0
    assert counters.spec_draft_tokens <= draft_tokens * counters.spec_rounds


def test_one_request_alone(parts):
    specs = {3: {"max_tokens": 80}}
    plain, _ = drive(parts, False, specs)
    fast, _, counters = spec_drive(parts, specs)
    assert fast == plain and counters.spec_accepted_tokens > 0


def test_every_ending_of_the_overlap_scenario(parts):
    """Length, abort, stop token, stop string, the thinking budget's forced close tokens, and a
    seeded sampled request (which does not speculate) arriving late. The abort comes once r1 has
    5 tokens: with drafts a step may have brought it more, all of them its own."""
    specs, kw = scenario(parts)
    plain, _ = drive(parts, False, specs, **kw)
    fast, _, counters = spec_drive(parts, specs, **kw)
    aborted = fast.pop("r1")
    assert aborted["finish"] == "abort" and aborted["tokens"][:5] == plain.pop("r1")["tokens"]
    assert fast == plain
    check_scenario({**fast, "r1": {**aborted, "tokens": aborted["tokens"][:5]}}, specs)
    assert counters.spec_rounds > 0


def test_max_tokens_and_stop_strings_cut_inside_accepted_runs(parts, monkeypatch):
    """Drafts are normally held short of ``max_tokens``; without that limit the cut falls inside
    an accepted run, as a stop string does: the output ends exactly where it does without drafts."""
    from ninfer.engine import spec

    _, tok = parts
    free, _ = drive(parts, False, {i: {"max_tokens": 60} for i in range(3)})
    specs = {}
    for i in range(3):
        text = tok.decode(free[f"r{i}"]["tokens"])
        specs[i] = {"max_tokens": 60, "stop": [text[20 + 9 * i : 23 + 9 * i]]}
    specs.update({3: {"max_tokens": 5}, 4: {"max_tokens": 13}, 5: {"max_tokens": 21}})
    plain, _ = drive(parts, False, specs)
    monkeypatch.setattr(spec.Drafter, "limit",
                        lambda self, req: min(self.draft_tokens, req.max_total_tokens - req.num_tokens - 1))
    fast, _, counters = spec_drive(parts, specs, draft_tokens=8)
    assert fast == plain
    for i in range(3):
        assert plain[f"r{i}"]["finish"] == "stop"
    assert counters.spec_accepted_tokens > 0


def test_logprobs_and_logit_bias_follow_the_tokens(parts):
    specs = {0: {"max_tokens": 40, "logprobs": 3}, 1: {"max_tokens": 40, "logit_bias": {5: 4.0, 9: -100.0}},
             2: {"max_tokens": 40, "logprobs": 2, "logprobs_after_sampling": True}}
    plain, _ = drive(parts, False, specs)
    fast, _, counters = spec_drive(parts, specs)
    assert counters.spec_accepted_tokens > 0
    for name in plain:
        a, b = plain[name], fast[name]
        assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}
    for name in ("r0", "r2"):
        a, b = plain[name]["logprobs"], fast[name]["logprobs"]
        assert len(a) == len(b) == 40
        for x, y in zip(a, b):
            assert x.token == y.token and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_thinking_budget_forces_its_close_inside_a_run(parts):
    control = ThinkingControl(end_id=2, budget=9, close_ids=CLOSE)
    specs = {0: {"max_tokens": 40, "thinking": control}, 1: {"max_tokens": 30}}
    plain, _ = drive(parts, False, specs)
    fast, _, _ = spec_drive(parts, specs)
    assert fast == plain and plain["r0"]["tokens"][9:13] == list(CLOSE)


def test_sampled_requests_speculate_and_penalised_ones_do_not(parts):
    """A seeded sampled request keeps its output (each position's token is drawn with the noise
    one-token steps would use: test_spec_sampled.py); a penalised one takes no draft."""
    specs = {0: {"max_tokens": 30, "temperature": 0.9, "seed": 11},
             1: {"max_tokens": 30, "repetition_penalty": 1.3}}
    plain, _ = drive(parts, False, specs)
    fast, _, counters = spec_drive(parts, specs)
    assert fast == plain
    assert counters.spec_fallback_steps > 0  # r0's steps without a draft (its text does not repeat); r1 none
    penalised, _, counters = spec_drive(parts, {1: specs[1]})
    assert counters.spec_rounds == 0 and counters.spec_fallback_steps == 0


def test_no_step_is_launched_ahead_of_a_request_that_may_speculate(parts):
    """Overlap launches a decode step from tokens not yet read: a speculating request's next step
    needs them on the host for its draft, so none is launched ahead of it (greedy or sampled);
    without drafts the same requests run ahead."""
    specs = {0: {"max_tokens": 30}, 1: {"max_tokens": 20, "temperature": 0.9, "seed": 1}}
    plain, ahead_plain = drive(parts, True, specs)
    fast, ahead, counters = spec_drive(parts, specs, overlap=True)
    assert fast == plain and ahead == 0 and counters.spec_rounds > 0 and ahead_plain > 5


def test_spec_off_makes_no_drafts(parts):
    engines: list[LLMEngine] = []
    drive(parts, False, {0: {"max_tokens": 20}}, engine_out=engines)
    engine = engines[0]
    assert engine.drafter is None and engine.scheduler.drafter is None
    assert not engine.counters.spec_enabled and engine.counters.spec_rounds == 0


# ---------------------------------------------------------------------------- the embedded model
@pytest.fixture(scope="module")
def smollm2():
    from support.embedded import embedded_parts

    return embedded_parts()


CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)
'''


def embedded_run(parts, spec: str, batch: int):
    model, tok = parts
    engine = LLMEngine(model, tok, EngineConfig(max_context=1024, max_concurrency=batch, prefill_chunk=64,
                                                spec=spec))
    ask = [f"Repeat this code exactly, with the function {name} renamed:\n\n{CODE}\n"
           for name in ("area", "perimeter", "width")]
    reqs = [Request(f"r{i}", tok.encode(ask[i % 3]) + tok.encode(CODE[: 20 * i]),
                    SamplingParams(temperature=0.0, max_tokens=48 - 5 * i, stop=["perimeter(width"] if i == 2 else []),
                    max_total_tokens=1024, eos_ids=frozenset({tok.eos_token_id}))
            for i in range(batch)]
    for r in reqs:
        engine.add_request(r)
    texts = {r.request_id: "" for r in reqs}
    while engine.has_work:
        for out in engine.step():
            texts[out.request_id] += out.text
    assert engine.caches.idle()
    return {r.request_id: (r.output_ids, texts[r.request_id], r.finish_reason) for r in reqs}, engine.counters


@pytest.mark.parametrize("batch", [1, 3])
def test_the_embedded_model_copies_a_code_block_with_drafts_kept(smollm2, batch):
    plain, _ = embedded_run(smollm2, "off", batch)
    fast, counters = embedded_run(smollm2, "ngram", batch)
    assert fast == plain
    assert counters.spec_accepted_tokens >= counters.spec_rounds > 0  # at least one a round on average


def test_qwen3_greedy_outputs_are_unchanged(tmp_path):
    """Qwen3 (attention only, per-head q/k norms) speculates as Llama does."""
    from ninfer.engine.loader import load_model
    from support.tiny import save_tiny_qwen3

    ckpt = load_checkpoint(save_tiny_qwen3(tmp_path / "qwen3"))
    parts = (load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer)
    specs = {i: {"max_tokens": 40} for i in range(3)}
    plain, _ = drive(parts, False, specs, arrivals={2: (0, 6)})
    fast, _, counters = spec_drive(parts, specs, arrivals={2: (0, 6)})
    assert fast == plain and counters.spec_rounds > 0


def test_a_conversation_goes_on_from_the_answer_checkpoint_of_a_speculated_turn(parts):
    """The checkpoint kept where a turn's answer ends holds no rejected draft's K/V: the next turn,
    which goes on from it, answers as it does without drafts."""
    from support.overlap import prompt
    from support.spec_drafts import two_turns

    def turns(spec: str):
        engine, *answers = two_turns(parts, spec, 37, 30)
        return (*answers, engine.counters.spec_accepted_tokens)

    plain, fast = turns("off"), turns("ngram")
    assert fast[:3] == plain[:3] and fast[2] > len(prompt(parts[1], 3)) and fast[3] > 0


class MissingDrafter(Drafter):
    """Drafts of as many tokens as a request takes now, never the model's (a token no greedy run
    of these requests gives), noting each draft's length."""

    def __init__(self, draft_tokens: int) -> None:
        super().__init__(draft_tokens, 1, 1)
        self.lengths: list[int] = []

    def propose(self, req: Request) -> list[int]:
        draft = [1] * self.limit(req) if self.eligible(req) else []
        self.lengths += [len(draft)] if draft else []
        return draft


def test_the_draft_length_shrinks_where_drafts_miss_and_grows_where_they_hold(parts):
    """A request whose drafts all miss is verified in rows of two after three rounds (4, 3, 2,
    then 1 draft), its tokens those of one-token steps; drafts that all hold stay full."""
    specs = {2: {"max_tokens": 24}}
    plain, _ = drive(parts, False, specs)
    drafter = MissingDrafter(4)
    fast, _ = drive(parts, False, specs, spec="ngram", draft_tokens=4, prepare=lambda e: use_drafter(e, drafter))
    assert fast == plain and 1 not in [t for r in plain.values() for t in r]  # every draft missed
    assert drafter.lengths[:5] == [4, 3, 2, 1, 1] and set(drafter.lengths[3:]) == {1}
    req = Request("x", [5, 6], SamplingParams(max_tokens=50), max_total_tokens=160)
    for kept_all in (False, True, True):  # a miss, then full rounds: back up by two, within the setting
        drafter.adapt(req, drafter.limit(req), drafter.limit(req) if kept_all else 0)
    assert req.spec_len == 4
