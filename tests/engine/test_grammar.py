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
