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


def states_by_position(parts, specs: dict, answers: dict | None = None, draft_tokens: int = 4):
    """Run ``specs`` (with drafts from ``answers`` when given: an oracle) and copy each request's
    Gated DeltaNet states (conv window, recurrent) after every step, by its computed tokens;
    also return the outputs and the counters."""
    from ninfer.engine.engine_config import EngineConfig
    from support.overlap import make

    model, tok = parts
    engine = LLMEngine(model, tok, EngineConfig(max_context=160, max_concurrency=4, prefill_chunk=32,
                                                kv_capacity=2048, page_size=8, overlap=False,
                                                spec="off" if answers is None else "ngram",
                                                draft_tokens=draft_tokens))
    if answers is not None:
        use_drafter(engine, AnswerDrafter(answers, draft_tokens))
    reqs = [make(i, tok, **p) for i, p in specs.items()]
    for r in reqs:
        engine.add_request(r)
    states: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    rounds = []
    while engine.has_work:
        before = engine.counters.spec_rounds
        engine.step()
        rounds.append(engine.counters.spec_rounds - before)
        pool = engine.caches.states
        for r in reqs:
            if not r.is_finished and r.num_computed > len(r.prompt_ids):
                slot = r.cache.slot
                states[r.request_id, r.num_computed] = (pool.conv[:, slot].clone(), pool.recurrent[:, slot].clone())
    return {r.request_id: r.output_ids for r in reqs}, states, engine.counters


@pytest.fixture
def row_by_row(monkeypatch):
    """Projections computed one token row at a time: a CPU GEMM rounds a row differently with the
    count of rows beside it (MKL's one-row and many-row kernels), which would make a verify
    row's projections differ from one-token steps' in the last bit before any state is kept.
    Decode attention likewise row by row over its own pages only (the padded width of a step's
    block table changes the fused attention's blocking)."""
    import torch.nn.functional as F

    from ninfer.engine.layers import fused_linear, paged_attention

    linear = F.linear

    def rows(x, weight, bias=None):
        flat = x.reshape(-1, x.shape[-1])
        out = torch.cat([linear(flat[i : i + 1], weight, bias) for i in range(flat.shape[0])]) if flat.shape[0] \
            else linear(flat, weight, bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    monkeypatch.setattr(F, "linear", rows)
    monkeypatch.setattr(fused_linear, "cpu_linear", rows)
    attend = paged_attention.paged_decode_attention_sdpa

    def attend_rows(q, k_pages, v_pages, block_tables, context_lens, scale, k_scale=None, v_scale=None):
        page = k_pages.shape[1]
        return torch.cat([attend(q[i : i + 1], k_pages, v_pages, block_tables[i : i + 1, : -(-int(n) // page)],
                                 context_lens[i : i + 1], scale, k_scale, v_scale)
                          for i, n in enumerate(context_lens.tolist())])

    monkeypatch.setattr(paged_attention, "paged_decode_attention_sdpa", attend_rows)


@pytest.mark.parametrize("batch", [1, 3])
def test_an_oracle_drafter_is_always_accepted_and_leaves_the_exact_states(hybrid, batch, row_by_row):
    """Done-when 3: drafts that are the model's own greedy tokens are all accepted, every round,
    and after each round the recurrent and conv states are exactly (fp32, CPU) those a run
    without drafts has at the same position (projections row by row in both: ``row_by_row``).
    Where kernels round a row differently with the rows beside it the states are held to 1e-4:
    batched (a plain run's states at batch 3 differ from its states alone by ~1e-5 already) and
    in MoE layers (an expert's elementwise work rounds differently with its token count)."""
    specs = {i: {"max_tokens": 26 + 3 * i} for i in range(batch)}
    plain, plain_states, _ = states_by_position(hybrid, specs)
    fast, fast_states, counters = states_by_position(hybrid, specs, answers=plain)
    assert fast == plain
    assert counters.spec_rounds > 0 and counters.spec_accepted_tokens == counters.spec_draft_tokens
    assert counters.spec_draft_tokens >= 4 * counters.spec_rounds - 3 * batch  # full drafts but near the end
    assert fast_states and set(fast_states) <= set(plain_states)
    for key, (conv, rec) in fast_states.items():
        if batch == 1 and not hybrid[0].config.is_moe:
            assert torch.equal(conv, plain_states[key][0]) and torch.equal(rec, plain_states[key][1]), key
        else:
            torch.testing.assert_close(conv, plain_states[key][0], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(rec, plain_states[key][1], rtol=1e-4, atol=1e-4)
