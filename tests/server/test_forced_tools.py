"""Forced and strict tool calls on a tiny random Llama served for real, through the ``openai`` and
``anthropic`` SDKs: ``tool_choice`` ``required`` and a named function (Chat, Responses), ``any``
and ``tool`` (Anthropic Messages) always answer with calls to an allowed function whose arguments
validate against its schema, aggregate and streamed; strict functions under ``auto`` hold every
call the model starts; after a reasoning block (a tiny Qwen3 on the Qwen3.5 template) the reasoning
stays free and the call follows it. The model is random: the grammar alone makes the calls. Its
strings and numbers are bounded, as one does for a model this small."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.tiny import save_tiny_llama

MODEL = "tiny-llama"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "[A-Za-z ]{1,12}", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}, "hours": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3}},
        "required": ["hourly"], "additionalProperties": False},
}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
              for n, s in SCHEMAS.items()]
RESPONSE_TOOLS = [{"type": "function", "name": n, "description": f"{n} tool", "parameters": s}
                  for n, s in SCHEMAS.items()]
MESSAGE_TOOLS = [{"name": n, "description": f"{n} tool", "input_schema": s} for n, s in SCHEMAS.items()]
ASK = "What is the weather in Paris, and the time?"
SEEDS = range(4)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("ckpt") / MODEL)
    state, loop = build_state(build_parser().parse_args([str(path), "--max-context", "512", "--temperature", "1"]))
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield live
    loop.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served.base_url, api_key="none", max_retries=0, timeout=120)


def check_calls(calls: list[tuple[str, str | dict]], allowed: set[str], single: bool = False) -> None:
    """At least one call (exactly one when ``single``), each to an allowed function, with
    arguments that validate against its schema."""
    assert calls and (len(calls) == 1 or not single), calls
    for name, arguments in calls:
        assert name in allowed, calls
        jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


# ---------------------------------------------------------------------------- Chat Completions
def chat_calls(client, stream: bool, **kw) -> tuple[list[tuple[str, str]], str | None]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "tools": CHAT_TOOLS,
            "max_tokens": 300, **kw}
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []], \
            choice.finish_reason
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", ""])
                entry[0] += (d.function.name or "") if d.function else ""
                entry[1] += (d.function.arguments or "") if d.function else ""
            reason = choice.finish_reason or reason
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], reason


@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "streamed"])
@pytest.mark.parametrize("choice, allowed", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}, {"get_time"}),
], ids=["required", "named", "allowed-required"])
def test_chat_forced_choice_always_calls_with_valid_arguments(client, stream, choice, allowed):
    for seed in SEEDS:
        calls, reason = chat_calls(client, stream, tool_choice=choice, seed=seed, parallel_tool_calls=False)
        check_calls(calls, allowed, single=True)
        assert reason == "tool_calls"


def test_chat_required_with_parallel_calls(client):
    for seed in SEEDS:
        calls, reason = chat_calls(client, False, tool_choice="required", seed=seed, max_tokens=400)
        # every finished call validates; the token limit may cut a later one short (then it is not a call)
        check_calls(calls, {"get_weather", "get_time"})


def test_chat_strict_tools_under_auto_hold_every_call(client):
    tools = [{"type": "function", "function": {**t["function"], "strict": True}} for t in CHAT_TOOLS]
    for seed in range(8):
        body = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "tools": tools, "max_tokens": 120,
                "seed": seed}
        choice = client.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        if calls:
            check_calls(calls, set(SCHEMAS))
        if choice.finish_reason == "stop":  # a call once started was finished
            assert "<tool_call>" not in (choice.message.content or "")


# ---------------------------------------------------------------------------- Responses
def response_calls(client, stream: bool, **kw) -> list[tuple[str, str]]:
    body = {"model": MODEL, "input": ASK, "tools": RESPONSE_TOOLS, "max_output_tokens": 300, **kw}
    if not stream:
        out = client.responses.create(**body).output
    else:
        out = [e.item for e in client.responses.create(**body, stream=True) if e.type == "response.output_item.done"]
    return [(i.name, i.arguments) for i in out if i.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "streamed"])
@pytest.mark.parametrize("choice, allowed", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "name": "get_time"}, {"get_time"}),
], ids=["required", "named"])
def test_responses_forced_choice_always_calls_with_valid_arguments(client, stream, choice, allowed):
    for _ in SEEDS:
        calls = response_calls(client, stream, tool_choice=choice, parallel_tool_calls=False)
        check_calls(calls, allowed, single=True)


# ---------------------------------------------------------------------------- Anthropic Messages
@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "streamed"])
@pytest.mark.parametrize("choice, allowed", [
    ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "get_time"}),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}, {"get_weather"}),
], ids=["any", "tool"])
def test_messages_forced_choice_always_calls_with_valid_input(claude, stream, choice, allowed):
    body = {"model": MODEL, "max_tokens": 300, "messages": [{"role": "user", "content": ASK}],
            "tools": MESSAGE_TOOLS, "tool_choice": choice}
    for _ in SEEDS:
        if stream:
            with claude.messages.stream(**body) as s:
                msg = s.get_final_message()
        else:
            msg = claude.messages.create(**body)
        assert msg.stop_reason == "tool_use"
        check_calls([(b.name, b.input) for b in msg.content if b.type == "tool_use"], allowed, single=True)


# ---------------------------------------------------------------------------- after reasoning
@pytest.fixture(scope="module")
def thinking_client(tmp_path_factory):
    """A tiny Qwen3 whose vocabulary has the reasoning and tool-call tags as tokens, served with
    the Qwen3.5 chat template: its output starts inside a reasoning block."""
    from pathlib import Path

    from support.tiny import save_tiny_qwen3

    path = save_tiny_qwen3(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3",
                           special=["<think>", "</think>", "<tool_call>", "</tool_call>"])
    template = Path(__file__).resolve().parents[2] / "engine" / "frontend" / "templates" / "qwen3_5.jinja"
    state, loop = build_state(build_parser().parse_args([str(path), "--max-context", "2048", "--temperature", "1",
                                                         "--chat-template", str(template)]))
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    loop.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "streamed"])
def test_reasoning_stays_free_and_the_call_follows_it(thinking_client, stream):
    """The thinking budget closes the model's (random) reasoning; the forced call comes after."""
    for seed in SEEDS:
        kw = {"tool_choice": "required", "seed": seed, "parallel_tool_calls": False,
              "extra_body": {"enable_thinking": True, "thinking_budget": 16}}
        calls, reason = chat_calls(thinking_client, stream, **kw)
        check_calls(calls, {"get_weather", "get_time"}, single=True)
        assert reason == "tool_calls"
    r = thinking_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                                tools=CHAT_TOOLS, max_tokens=300, **kw)
    assert r.choices[0].message.model_extra["reasoning_content"]  # the reasoning came back apart
    assert r.usage.completion_tokens_details.reasoning_tokens > 16
