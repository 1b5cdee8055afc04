"""Qwen XML tool calls: aggregate and streamed parses agree at every split point, typed values,
member order, and malformed markup back as content byte for byte."""
from __future__ import annotations

import json

import pytest

from ninfer.engine.frontend.assistant_output import (AssistantOutputParser, ContentText, ReasoningText,
                                                      parse_assistant_output)
from ninfer.engine.frontend.tool_parser import ToolCall, ToolCallParser, ToolSpec, convert_parameter, parse_tool_calls

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "tags": {"type": "array"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "limit": {"type": ["integer", "null"]}}})
WRITE = ToolSpec("write_file", {"type": "object", "properties": {"path": {"type": "string"},
                                                                  "content": {"type": "string"}}})
TOOLS = [WEATHER, WRITE]


def call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def streamed(text: str, cuts: list[int]) -> tuple[str, list[ToolCall], list]:
    parser = ToolCallParser(TOOLS)
    events, last = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.push(text[last:cut])
        last = cut
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)], events


def every_split(text: str):
    yield []
    for i in range(1, len(text)):
        yield [i]
    yield list(range(1, len(text)))  # one character at a time


VALID = [
    "Let me check.\n\n" + call("get_weather", ("city", "Paris"), ("days", "3")),
    call("get_weather", ("city", "Paris")) + "\n" + call("write_file", ("path", "a.txt"), ("content", "hi")),
    call("write_file", ("path", "x.py"), ("content", 'print("<tool_call>")\n</function>\n</tool_call>')),
    call("write_file", ("path", "doc"), ("content", "a <parameter=x>\ny\n</parameter> b")),
    call("get_weather"),
    "Sure: " + call("get_weather", ("city", "Oslo")) + "\n\nDone.",
]
MALFORMED = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</parameter>\n</function>\n"
    "</tool_call>",  # standalone </parameter>
    "<tool_call>\n<function=write_file>\n<parameter=content>\na <parameter=x> b\n</parameter>\n</function>\n"
    "</tool_call>",  # unmatched nested opener
    call("delete_everything", ("path", "/")),  # undeclared function
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",  # never closed
    "text <tool_call> is a tag",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n</parameter>\n"
    "</function>\n</tool_call>",  # a parameter twice
    "trailing <tool_",
    "<tool_call><function=get weather>\n</function></tool_call>",
    "a\n\n<tool_call>\nnot markup\n</tool_call>\n\n",
]


@pytest.mark.parametrize("text", VALID)
def test_valid_calls_agree_at_every_split(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert calls
    for cuts in every_split(text):
        got_content, got_calls, events = streamed(text, cuts)
        assert got_content == content, cuts
        assert got_calls == calls, cuts
        for c in got_calls:
            assert "".join(c.argument_pieces) == c.arguments  # streamed deltas join to the final arguments


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_markup_is_content_byte_for_byte(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])
    for cuts in every_split(text):
        content, calls, _ = streamed(text, cuts)
        assert (content, calls) == (text, []), cuts


def test_content_and_calls_in_order():
    text = VALID[5]
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Sure:Done."
    assert [c.name for c in calls] == ["get_weather"] and calls[0].arguments_dict == {"city": "Oslo"}
    _, _, events = streamed(text, [])
    assert [type(e).__name__ for e in events] == ["str", "ToolCall", "str"]


def test_values_keep_markup_and_nested_parameters():
    _, calls = parse_tool_calls(VALID[2], TOOLS)
    assert calls[0].arguments_dict["content"] == 'print("<tool_call>")\n</function>\n</tool_call>'
    _, calls = parse_tool_calls(VALID[3], TOOLS)
    assert calls[0].arguments_dict["content"] == "a <parameter=x>\ny\n</parameter> b"


def test_member_order_is_the_models():
    text = call("get_weather", ("metric", "true"), ("city", "Rome"), ("days", "2"))
    _, calls = parse_tool_calls(text, TOOLS)
    assert calls[0].arguments == '{"metric": true, "city": "Rome", "days": 2}'
    assert list(json.loads(calls[0].arguments)) == ["metric", "city", "days"]


@pytest.mark.parametrize("key, text, expected", [
    ("city", "123", "123"),  # string-admitting stays a string
    ("city", "", ""),  # even empty
    ("days", "7", 7),
    ("days", "seven", "seven"),  # mismatch: other text becomes a JSON string
    ("days", "7.5", 7.5),  # mismatch, valid JSON: keeps its type
    ("metric", "True", True),  # booleans case-insensitive
    ("metric", "FALSE", False),
    ("tags", '["a", "b"]', ["a", "b"]),
    ("note", "null", "null"),  # anyOf with string: a string
    ("limit", "null", None),
    ("limit", "5", 5),
    ("undeclared", '{"b": 1, "a": 2}', {"b": 1, "a": 2}),  # untyped: JSON when it parses
    ("undeclared", "hello", "hello"),
])
def test_typed_conversion(key, text, expected):
    out = call("get_weather", (key, text))
    _, calls = parse_tool_calls(out, TOOLS)
    args = calls[0].arguments_dict
    assert args[key] == expected and type(args[key]) is type(expected)


def test_empty_non_string_parameter_is_omitted():
    _, calls = parse_tool_calls(call("get_weather", ("city", "Nice"), ("days", "")), TOOLS)
    assert calls[0].arguments_dict == {"city": "Nice"}


def test_convert_parameter_without_schema():
    assert convert_parameter("42", None) == 42
    assert convert_parameter("x y", {"description": "no type"}) == "x y"


def test_assistant_output_splits_reasoning_content_and_calls():
    text = ("Let me think.\nThe user wants weather.\n</think>\n\nChecking.\n\n"
            + call("get_weather", ("city", "Paris")))
    whole = parse_assistant_output(text, True, TOOLS)
    assert whole.reasoning == "Let me think.\nThe user wants weather."
    assert whole.content == "Checking."
    assert [c.name for c in whole.tool_calls] == ["get_weather"]
    for cut in range(1, len(text)):
        parser = AssistantOutputParser(True, TOOLS)
        events = parser.push(text[:cut]) + parser.push(text[cut:]) + parser.finish()
        assert "".join(e.text for e in events if isinstance(e, ReasoningText)) == whole.reasoning
        assert "".join(e.text for e in events if isinstance(e, ContentText)) == whole.content
        assert parser.message == whole


def test_markup_inside_reasoning_is_not_a_call():
    text = call("get_weather", ("city", "Paris")) + "\n</think>\n\nNo call."
    out = parse_assistant_output(text, True, TOOLS)
    assert out.tool_calls == [] and out.content == "No call." and out.reasoning.startswith("<tool_call>")


def test_no_tools_means_plain_content():
    text = call("get_weather", ("city", "Paris"))
    assert parse_assistant_output(text, False, None).content == text
