"""Constrained decoding in the engine: outputs held to a grammar, beside free requests, after a
reasoning block, and a grammar that cannot compile ending its request only."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.grammar import GrammarError, GrammarSpec
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams, ThinkingControl
from support.overlap import count_launched_ahead
from support.tiny import save_tiny_llama

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "sizes": {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3},
        "note": {"anyOf": [{"type": "null"}, {"enum": ["a", "b"]}]},
    },
    "required": ["colour", "ok", "sizes", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    ckpt = load_checkpoint(save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def engine(parts, **kw) -> LLMEngine:
    model, tok = parts
    return LLMEngine(model, tok, EngineConfig(**{"max_context": 256, "prefill_chunk": 64, "max_concurrency": 8, **kw}))


def run(eng: LLMEngine, requests: list[Request]) -> dict[str, dict]:
    for r in requests:
        eng.add_request(r)
    done: dict[str, dict] = {}
    text: dict[str, str] = {r.request_id: "" for r in requests}
    while eng.has_work:
        for out in eng.step():
            text[out.request_id] += out.text
            if out.finished:
                r = next(q for q in requests if q.request_id == out.request_id)
                done[out.request_id] = {"ids": list(r.output_ids), "text": text[out.request_id],
                                        "reason": out.finish_reason, "error": out.error, "code": out.error_code}
    return done


def req(name: str, prompt: list[int], **params) -> Request:
    return Request(name, prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 80, **params}),
                   max_total_tokens=256, eos_ids=frozenset({EOS}))


def prompt(tok, i: int = 0) -> list[int]:
    return tok.encode(f"Request {i}: describe the weather in one word, then stop. ")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_schema_holds_the_output_and_it_ends_with_the_document(parts, temperature):
    tok = parts[1]
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    reqs = [req(f"s{i}", prompt(tok, i), temperature=temperature, seed=i, grammar=spec) for i in range(4)]
    done = run(engine(parts), reqs)
    for name, out in done.items():
        assert out["reason"] == "stop", (name, out)
        assert out["ids"][-1] == EOS  # the model was let stop only where the document was whole
        jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_a_regex_and_a_choice(parts):
    tok = parts[1]
    done = run(engine(parts), [
        req("re", prompt(tok), temperature=1.0, seed=3, grammar=GrammarSpec("regex", r"[0-9]{3}-[a-c]{2}", "guided_regex")),
        req("ch", prompt(tok, 1), temperature=1.0, seed=4, grammar=GrammarSpec.choice(["yes", "no", "maybe"], "guided_choice")),
    ])
    assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", done["re"]["text"]), done["re"]
    assert done["ch"]["text"] in ("yes", "no", "maybe")


def test_free_requests_beside_constrained_ones_keep_their_tokens(parts):
    tok = parts[1]
    alone = run(engine(parts), [req("free", prompt(tok, 7), max_tokens=24)])["free"]["ids"]
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    mixed = run(engine(parts), [req("g0", prompt(tok, 1), grammar=spec), req("free", prompt(tok, 7), max_tokens=24),
                                req("g1", prompt(tok, 2), temperature=1.0, seed=9, grammar=spec)])
    assert mixed["free"]["ids"] == alone
    assert mixed["g0"]["reason"] == mixed["g1"]["reason"] == "stop"


def test_the_grammar_holds_from_the_token_after_the_reasoning_block(parts):
    tok = parts[1]
    free = run(engine(parts), [req("free", prompt(tok), max_tokens=5)])["free"]["ids"]
    end = 7  # the close token; the budget forces it after four free tokens
    think = ThinkingControl(end_id=end, budget=4, close_ids=(end,))
    if end in free[:4]:
        pytest.skip("the random model closes the block itself")
    out = run(engine(parts), [req("t", prompt(tok), thinking=think,
                                  grammar=GrammarSpec("regex", r"(ab|cd){2}", "guided_regex"))])["t"]
    assert out["ids"][:4] == free[:4]  # the reasoning is the model's own
    assert out["ids"][4] == end
    answer = tok.decode(out["ids"][5:-1])
    assert re.fullmatch(r"(ab|cd){2}", answer), answer


def test_what_the_budget_forces_after_the_close_is_not_held_to_the_grammar(parts):
    """A budget's close text may go on past the close token (Qwen's ends with a blank line): the
    grammar holds from the first token drawn after it."""
    tok = parts[1]
    free = run(engine(parts), [req("free", prompt(tok), max_tokens=5)])["free"]["ids"]
    end = 7
    tail = tok.encode("\n\n")
    if end in free[:4]:
        pytest.skip("the random model closes the block itself")
    think = ThinkingControl(end_id=end, budget=4, close_ids=(end, *tail))
    out = run(engine(parts), [req("t", prompt(tok), thinking=think,
                                  grammar=GrammarSpec("regex", r"(ab|cd){2}", "guided_regex"))])["t"]
    assert out["ids"][4: 5 + len(tail)] == [end, *tail]
    answer = tok.decode(out["ids"][5 + len(tail):-1])
    assert out["reason"] == "stop" and re.fullmatch(r"(ab|cd){2}", answer), answer


def test_a_grammar_that_cannot_compile_ends_its_request_only(parts):
    tok = parts[1]
    bad = GrammarSpec("regex", "(unclosed", "guided_regex")
    with pytest.raises(GrammarError) as err:
        bad.check()
    assert err.value.param == "guided_regex"
    done = run(engine(parts), [req("bad", prompt(tok), grammar=bad), req("ok", prompt(tok, 1), max_tokens=4)])
    assert done["bad"]["reason"] == "error" and done["bad"]["code"] == "invalid_grammar"
    assert "guided_regex" in done["bad"]["error"]
    assert done["ok"]["reason"] == "length" and len(done["ok"]["ids"]) == 4


def test_a_request_aborted_while_its_grammar_compiles_is_not_run(parts):
    tok = parts[1]
    eng = engine(parts)
    eng.add_request(req("a", prompt(tok), grammar=GrammarSpec.json_schema(SCHEMA, "response_format")))
    out = eng.abort("a")
    assert out is not None and out.finish_reason == "abort"
    while eng.has_work:
        assert not eng.step()
    assert not eng.running and not eng.waiting


@pytest.mark.parametrize("schema", [["not", "an", "object"], "{broken", True])
def test_a_schema_that_is_not_one_is_the_clients_error(schema):
    with pytest.raises(GrammarError) as err:
        GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
    assert err.value.param == "response_format.json_schema.schema"


def _launch_ahead_batch(parts, overlap: bool) -> tuple[dict[str, dict], int]:
    """A batch of constrained rows (greedy and sampled, JSON schema, regex, a choice, log-probabilities,
    two choices of one prompt, one after a reasoning block, one aborted mid-way) beside free ones,
    stepped with decode steps launched ahead or not. Returns each request's outputs as its user
    saw them, and how many steps were launched ahead."""
    tok = parts[1]
    eng = engine(parts, overlap=overlap)
    ahead = count_launched_ahead(eng)
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    words = GrammarSpec("regex", r"[a-z ]{6,40}", "guided_regex")
    think = ThinkingControl(end_id=7, budget=5, close_ids=(7,))
    reqs = [
        req("g0", prompt(tok, 1), grammar=spec),
        req("g1", prompt(tok, 2), temperature=1.0, seed=9, grammar=spec),
        req("g2", prompt(tok, 3), grammar=words, logprobs=2),
        req("g3", prompt(tok, 4), temperature=0.7, top_k=20, seed=2, grammar=words, logprobs=1),
        req("ch", prompt(tok, 5), grammar=GrammarSpec.choice(["yes", "no", "maybe"], "guided_choice")),
        req("t", prompt(tok, 6), thinking=think, grammar=GrammarSpec("regex", r"(ab|cd){2,4}", "guided_regex")),
        req("cut", prompt(tok, 8), grammar=spec),  # aborted once it has 6 tokens
        req("free", prompt(tok, 7), max_tokens=24),
        req("hot", prompt(tok, 9), max_tokens=30, temperature=0.9, seed=4),
    ]
    fork = prompt(tok, 10)
    reqs += [Request("n0", fork, SamplingParams(temperature=1.0, seed=20, max_tokens=80, grammar=words),
                     max_total_tokens=256, eos_ids=frozenset({EOS}), forks=1),
             Request("n1", fork, SamplingParams(temperature=1.0, seed=21, max_tokens=80, grammar=words),
                     max_total_tokens=256, eos_ids=frozenset({EOS}), fork_of="n0")]
    for r in reqs:
        eng.add_request(r)
    seen = {r.request_id: {"ids": [], "text": "", "logprobs": [], "reason": None} for r in reqs}

    def collect(out):
        s = seen[out.request_id]
        s["ids"] += out.token_ids
        s["text"] += out.text
        s["logprobs"] += out.logprobs or []
        s["reason"] = out.finish_reason or s["reason"]

    cut = next(r for r in reqs if r.request_id == "cut")
    while eng.has_work:
        if len(cut.output_ids) >= 6 and not cut.is_finished:
            collect(eng.abort("cut"))
        for out in eng.step():
            collect(out)
    assert eng.caches.idle()
    return seen, ahead()


def test_constrained_rows_launched_ahead_keep_every_token(parts):
    """Decode steps launched ahead with rows under a grammar (their tokens drawn once the step
    before has been read and its tokens taken by the matchers) give exactly the tokens, text,
    log-probabilities and finish reasons of stepping one at a time, and every output holds."""
    plain, none_ahead = _launch_ahead_batch(parts, overlap=False)
    overlapped, ahead = _launch_ahead_batch(parts, overlap=True)
    assert none_ahead == 0 and ahead >= 20
    # a step launched ahead for rows that finish with the token being read has more rows than
    # the step one at a time would: the same logits to the last bits, not always in them
    assert {k: {**v, "logprobs": None} for k, v in overlapped.items()} == \
        {k: {**v, "logprobs": None} for k, v in plain.items()}
    for name in plain:
        for got, want in zip(overlapped[name]["logprobs"], plain[name]["logprobs"], strict=True):
            assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-5)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
    for name in ("g0", "g1"):
        assert plain[name]["reason"] == "stop", plain[name]
        jsonschema.validate(json.loads(plain[name]["text"]), SCHEMA)
    for name in ("g2", "g3", "n0", "n1"):
        assert re.fullmatch(r"[a-z ]{6,40}", plain[name]["text"]), plain[name]
    assert plain["n0"]["ids"] != plain["n1"]["ids"]
    assert len(plain["g2"]["logprobs"]) == len(plain["g2"]["ids"])
    assert plain["ch"]["text"] in ("yes", "no", "maybe")
    answer = plain["t"]["ids"][plain["t"]["ids"].index(7) + 1:-1]
    assert re.fullmatch(r"(ab|cd){2,4}", parts[1].decode(answer)), plain["t"]
    assert plain["cut"]["reason"] == "abort" and len(plain["cut"]["ids"]) == 6
    assert plain["free"]["reason"] == "length" and len(plain["free"]["ids"]) == 24


def test_masks_line_up_with_their_rows_beside_free_ones(parts):
    """A step's rows under a grammar beside free rows, in any order: each row masked by its own
    matcher, free rows left as they are (a free row before a held one once read a mask row that
    was not there); the CPU's table lookup masks what xgrammar's own kernel masks, NaN and
    infinities included, in fp32 and bf16."""
    import xgrammar as xgr

    from ninfer.engine.grammar import GrammarMasks, Grammars, apply_bitmask, constrain

    tok = parts[1]
    grammars = Grammars(tok, tok.vocab_size)
    digits = grammars.compile(GrammarSpec("regex", "[0-9]+", "guided_regex")).result()
    letters = grammars.compile(GrammarSpec("regex", "[a-c]+", "guided_regex")).result()
    states = [None, grammars.matcher(digits, [EOS], True), None, grammars.matcher(letters, [EOS], True)]
    logits = torch.zeros(4, tok.vocab_size)
    constrain(logits, states)
    allowed = [{i for i in range(tok.vocab_size) if logits[r, i] == 0} for r in range(4)]
    assert allowed[0] == allowed[2] == set(range(tok.vocab_size))
    assert allowed[1] and all(re.fullmatch("[0-9]+", tok.decode([i])) for i in allowed[1])
    assert allowed[3] and all(re.fullmatch("[a-c]+", tok.decode([i])) for i in allowed[3])
    masks = GrammarMasks(torch.device("cpu"), rows=2)  # grows past the rows it was sized for
    mask = masks.fill(states, tok.vocab_size).clone()
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(4, tok.vocab_size, generator=gen) * 5).to(dtype)
        x[1, 5], x[1, 6], x[3, 7], x[3, 8] = float("nan"), float("inf"), float("-inf"), float("inf")
        want = x.clone()
        xgr.apply_token_bitmask_inplace(want, mask)
        apply_bitmask(x, mask)
        want = want.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        assert torch.equal(x, want)
    grammars.close()
