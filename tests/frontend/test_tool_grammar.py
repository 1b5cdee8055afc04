"""The grammar of held tool calls: what it lets through parses (``tool_parser``) into calls whose
arguments validate, and what would not is refused."""
from __future__ import annotations

import jsonschema
import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from ninfer.engine.frontend.tool_grammar import tool_call_grammar
from ninfer.engine.frontend.tool_parser import ToolSpec, parse_tool_calls
from ninfer.engine.grammar import GrammarError, grammar

WEATHER = ToolSpec("get_weather", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "where": {"$ref": "#/$defs/Point"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["city", "unit"],
    "$defs": {"Point": {"type": "object", "properties": {"lat": {"type": "number"}, "name": {
        "type": "string", "maxLength": 4}}, "required": ["lat"]}},
})
NOOP = ToolSpec("noop", None)
TOOLS = [WEATHER, NOOP]


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


GOOD = call("get_weather", ("city", "Paris"), ("unit", '"c"'))
FULL = call("get_weather", ("city", "Oslo & more"), ("unit", '"f"'), ("days", "3"),
            ("where", '{"lat": 1.5, "name": "x"}'), ("note", "a <b> c"))


def check_parsed(text: str) -> None:
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "" and calls
    for c in calls:
        schema = {t.name: t.parameters for t in TOOLS}[c.name] or {"type": "object"}
        jsonschema.validate(c.arguments_dict, schema)


@pytest.mark.parametrize("text", [GOOD, FULL, call("noop"), GOOD + "\n" + call("noop"), "\n\n" + GOOD])
def test_a_forced_answer_is_calls_that_parse_and_validate(text):
    g = grammar(tool_call_grammar(TOOLS, forced=True, parallel=True))
    assert accepts(g, text)
    check_parsed(text)


@pytest.mark.parametrize("text", [
    "",  # no call
    "Sure. " + GOOD,  # text before the call
    "\n\n\n" + GOOD,  # more than the blank line after reasoning
    call("get_weather", ("city", "Paris")),  # a required parameter left out
    call("get_weather", ("unit", '"c"'), ("city", "Paris")),  # out of the schema's order
    call("get_weather", ("city", "Paris"), ("unit", '"k"')),  # not in the enum
    call("get_weather", ("city", "Paris"), ("unit", '"c"'), ("days", "9")),  # past the maximum
    call("get_weather", ("city", "Paris, France!"), ("unit", '"c"')),  # longer than maxLength
    call("get_weather", ("city", "a</parameter>"), ("unit", '"c"')),  # would end the value early
    call("get_weather", ("city", "<parameter=x>"), ("unit", '"c"')),  # would nest a parameter
    call("get_weather", ("city", "Paris"), ("unit", '"c"'), ("where", '{"name": "x"}')),  # nested required
    call("get_weather", ("city", "Paris"), ("unit", '"c"'), ("where", '{"lat": 1, "name": "abcde"}')),
    call("get_weather", ("city", "Paris"), ("unit", '"c"'), ("zone", "1")),  # undeclared parameter
    call("get_weather", ("city", "Paris"), ("unit", '"c"'), ("where", '{"lat":  1}')),  # two blanks in JSON
    call("other"),  # not a callable function
    call("noop", ("x", "1")),  # noop declares no parameters
])
def test_a_forced_answer_refuses_what_would_not_validate(text):
    assert not accepts(grammar(tool_call_grammar(TOOLS, forced=True, parallel=True)), text)


def test_parallel_false_allows_one_call():
    g = grammar(tool_call_grammar(TOOLS, forced=True, parallel=False))
    assert accepts(g, GOOD) and not accepts(g, GOOD + "\n" + call("noop"))


def test_strict_under_auto_leaves_text_free_and_holds_calls():
    g = grammar(tool_call_grammar(TOOLS, forced=False, parallel=True, strict=["get_weather"]))
    assert accepts(g, "It is sunny.")
    assert accepts(g, "Let me look. " + GOOD)
    assert not accepts(g, "Let me look. " + call("get_weather", ("city", "Paris")))
    # a function that is not strict takes any parameters
    assert accepts(g, "x " + call("noop", ("anything", "goes")))
    check_parsed(GOOD)


def test_a_top_level_union_cannot_be_held():
    tool = ToolSpec("u", {"anyOf": [{"type": "object"}, {"type": "null"}]})
    with pytest.raises(GrammarError) as caught:
        tool_call_grammar([tool], forced=True, parallel=True, params={"u": "tools[0].function.parameters"})
    assert caught.value.param == "tools[0].function.parameters"


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from ninfer.engine.loader import load_checkpoint
    from support.tiny import save_tiny_llama

    return load_checkpoint(save_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny")).tokenizer


@pytest.mark.parametrize("seed", range(6))
def test_strict_calls_drawn_through_the_mask_parse_and_validate(tiny_tokenizer, seed):
    """Under ``auto`` with a strict function: text that opens a call, then random logits masked
    token by token (a model that knows nothing), always ends in a call whose arguments validate."""
    import torch

    from ninfer.engine.grammar import Grammars, constrain

    tok, eos = tiny_tokenizer, 2
    bounded = {k: v for k, v in WEATHER.parameters["properties"].items() if k != "note"}  # note: any length
    weather = ToolSpec(WEATHER.name, {**WEATHER.parameters, "properties": bounded})
    tools = [weather]
    grammars = Grammars(tok, tok.vocab_size)
    spec = tool_call_grammar(tools, forced=False, parallel=False, strict=["get_weather"])
    state = grammars.matcher(grammars.compile(spec).result(), [eos], True)
    ids = tok.encode(f"Let me look. <tool_call>\n<function={WEATHER.name}>\n")
    for t in ids:
        state.accept(t)
    assert not state.failed
    gen = torch.Generator().manual_seed(seed)
    while len(ids) < 400:
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 3
        constrain(logits, [state])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        if token == eos:
            break
        state.accept(token)
        ids.append(token)
    grammars.close()
    text = tok.decode(ids)
    content, calls = parse_tool_calls(text, tools)
    assert content.startswith("Let me look.") and len(calls) == 1, text
    jsonschema.validate(calls[0].arguments_dict, weather.parameters)


def test_the_call_tags_are_written_as_their_own_tokens(tmp_path):
    """Where ``<tool_call>`` and ``</tool_call>`` are added tokens (Qwen's vocabulary), a grammar
    of calls lets the model write them as those tokens, and the calls still parse; other added
    tokens stay unwritable."""
    import torch

    from ninfer.engine.grammar import Grammars, constrain
    from ninfer.engine.loader import load_checkpoint
    from support.tiny import save_tiny_qwen3

    tok = load_checkpoint(save_tiny_qwen3(tmp_path / "t", special=["<tool_call>", "</tool_call>", "<think>"])).tokenizer
    open_id, close_id, think_id = (tok.token_to_id(s) for s in ("<tool_call>", "</tool_call>", "<think>"))
    grammars = Grammars(tok, tok.vocab_size)
    clock = ToolSpec("get_time", {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]},
                                                                  "hours": {"type": "integer", "maximum": 99}}})
    state = grammars.matcher(grammars.compile(tool_call_grammar([clock], forced=True, parallel=False)).result(),
                             [2], True)
    logits = torch.zeros(1, tok.vocab_size)
    constrain(logits, [state])
    assert logits[0, open_id] == 0 and logits[0, think_id] == float("-inf")
    ids, gen = [], torch.Generator().manual_seed(0)
    while len(ids) < 400:
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 3
        # where a trained model writes the tags, it writes these tokens
        if not ids:
            logits[0, open_id] += 50
        if tok.decode(ids).endswith("</function>\n"):
            logits[0, close_id] += 50
        constrain(logits, [state])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        if token == 2:
            break
        state.accept(token)
        ids.append(token)
    grammars.close()
    assert ids[0] == open_id and ids[-1] == close_id and not state.failed
    content, calls = parse_tool_calls(tok.decode(ids), [clock])
    assert content == "" and len(calls) == 1
    jsonschema.validate(calls[0].arguments_dict, clock.parameters)


@pytest.mark.parametrize("schema", [{"type": "object", "properties": ["a"]}, {"type": "object", "required": "a"},
                                    {"type": "array"}, {"type": "object", "properties": {"a<": {}}}])
def test_parameters_that_cannot_be_written_are_the_clients_error(schema):
    with pytest.raises(GrammarError) as caught:
        tool_call_grammar([ToolSpec("f", schema)], forced=True, parallel=True, params={"f": "tools[0].parameters"})
    assert caught.value.param == "tools[0].parameters"
