"""Anthropic Messages through the official ``anthropic`` SDK, against the scripted model: it writes
Qwen reasoning and tool-call markup on cue, through the real tokenizer, template and engine."""
from __future__ import annotations

import json
import threading

import anthropic
import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import record_prompts, scripted_state

KEY = "sk-local-test"
MODEL = "claude-sonnet-local"  # any label: echoed, never selects the model
THINK_ANSWER = "The user asks about France.\n</think>\n\nThe capital of France is Paris."
TOOL_CALL = ("I will look it up.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
STORY = "Once upon a time there was a fox. THE END. And then more text."
SCRIPTS = {"capital": THINK_ANSWER, "weather": TOOL_CALL, "story": STORY, "continue": " four, five."}
WEATHER_TOOL = {"name": "get_weather", "description": "Weather forecast for a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                                  "days": {"type": "integer"}},
                                 "required": ["city"]}}
THINKING = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state(SCRIPTS, "Hello! How can I help?", "--api-key", KEY)
    prompts = record_prompts(state)
    loop.start()
    with LiveServer(create_app(state)) as server:
        yield anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0), prompts, server
    loop.stop()


@pytest.fixture
def client(served):
    return served[0]


def ask(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def test_create_with_thinking_and_text(client):
    msg = client.messages.create(model=MODEL, max_tokens=2048, thinking=THINKING,
                                 messages=ask("What is the capital of France?"))
    assert msg.model == MODEL and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user asks about France." and msg.content[0].signature
    assert msg.content[1].text == "The capital of France is Paris."
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.usage.output_tokens > 0 and msg.usage.input_tokens > 0
    assert msg.usage.cache_read_input_tokens == 0


def test_stream_has_the_full_block_lifecycle_and_equals_create(client, served):
    kwargs = dict(model=MODEL, max_tokens=2048, thinking=THINKING, tools=[WEATHER_TOOL],
                  messages=ask("What's the weather in Paris?"))
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert streamed.content[0].thinking == whole.content[0].thinking == "I will look it up."
    assert streamed.content[0].signature == whole.content[0].signature
    assert streamed.content[1].text == whole.content[1].text == "Let me check."
    for call in (whole.content[2], streamed.content[2]):
        assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 3}
        assert call.id.startswith("toolu_")
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens

    # the raw wire: ping, and every block opened, filled and closed in order
    base = served[2].base_url
    with httpx.stream("POST", base + "/v1/messages", headers={"x-api-key": KEY},
                      json={**kwargs, "stream": True}, timeout=30) as r:
        assert r.headers["request-id"].startswith("req_")
        raw = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert raw[:2] == ["message_start", "ping"] and raw[-2:] == ["message_delta", "message_stop"]
    lifecycle = [e for e in raw if e.startswith("content_block")]
    starts = [i for i, e in enumerate(lifecycle) if e == "content_block_start"]
    stops = [i for i, e in enumerate(lifecycle) if e == "content_block_stop"]
    assert len(starts) == len(stops) == 3 and all(a < b for a, b in zip(starts, stops))
    assert events[0] == "message_start" and events[-1] == "message_stop"


def test_signature_delta_precedes_thinking_block_stop(served):
    base = served[2].base_url
    body = {"model": MODEL, "max_tokens": 2048, "thinking": THINKING, "stream": True,
            "messages": ask("capital of France?")}
    with httpx.stream("POST", base + "/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=30) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    thinking = [d for d in data if d.get("index") == 0]
    assert thinking[0]["content_block"]["type"] == "thinking"
    assert thinking[-2]["delta"]["type"] == "signature_delta" and thinking[-1]["type"] == "content_block_stop"
    final = [d for d in data if d["type"] == "message_delta"][0]
    assert final["delta"]["stop_reason"] == "end_turn" and final["usage"]["output_tokens"] > 0


def test_tool_result_round_trip_keeps_order_and_marks_errors(client, served):
    prompts = served[1]
    history = ask("What's the weather in Paris?") + [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I will look it up.", "signature": "anything"},
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Lyon"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_b", "is_error": True, "content": "timeout LYON"},
            {"type": "tool_result", "tool_use_id": "toolu_a",
             "content": [{"type": "text", "text": "sunny "}, {"type": "text", "text": "PARIS 21C"}]},
            {"type": "text", "text": "Summarise."}]},
    ]
    prompts.clear()
    client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER_TOOL], messages=history)
    prompt = prompts[-1]
    assert prompt.index("sunny PARIS 21C") < prompt.index("[tool error] timeout LYON") < prompt.index("Summarise.")
    assert "<function=get_weather>\n<parameter=city>\nLyon" in prompt
    bad = [*history[:2], {"role": "user", "content": [history[2]["content"][0]]}]
    with pytest.raises(anthropic.BadRequestError, match="toolu_a"):
        client.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER_TOOL], messages=bad)


def test_stop_sequences(client):
    off = {"type": "disabled"}
    msg = client.messages.create(model=MODEL, max_tokens=100, stop_sequences=["THE END", "never"], thinking=off,
                                 messages=ask("tell a story"))
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "THE END"
    assert msg.content[-1].text.endswith("there was a fox. ")
    limited = client.messages.create(model=MODEL, max_tokens=3, thinking=off, messages=ask("tell a story"))
    assert limited.stop_reason == "max_tokens" and limited.usage.output_tokens == 3


@pytest.mark.parametrize("extra", [
    {},
    {"system": "You are terse."},
    {"system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
     "tools": [WEATHER_TOOL], "thinking": THINKING},
    {"thinking": {"type": "disabled"}},
])
def test_count_tokens_equals_the_input_tokens_of_the_same_request(client, extra):
    messages = ask("What is the capital of France?")
    counted = client.messages.count_tokens(model=MODEL, messages=messages, **extra)
    msg = client.messages.create(model=MODEL, max_tokens=2048, messages=messages, **extra)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_billing_header_block_is_consumed_only_in_first_position(client):
    plain = client.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be kind."}],
                                         messages=ask("hi")).input_tokens
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cc_entrypoint=cli",
              "cache_control": {"type": "ephemeral"}}
    first = client.messages.count_tokens(model=MODEL, system=[header, {"type": "text", "text": "Be kind."}],
                                         messages=ask("hi")).input_tokens
    later = client.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be kind."}, header],
                                         messages=ask("hi")).input_tokens
    as_string = client.messages.count_tokens(model=MODEL, system=header["text"], messages=ask("hi")).input_tokens
    assert first == plain < later and as_string > 0


def test_assistant_prefill_continues_the_text(client, served):
    prompts = served[1]
    prompts.clear()
    msg = client.messages.create(model=MODEL, max_tokens=32, messages=[
        {"role": "user", "content": "Count: continue"}, {"role": "assistant", "content": "one, two, three,"}])
    assert prompts[-1].endswith("<think>\n\n</think>\n\none, two, three,")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == " four, five."
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        client.messages.create(model=MODEL, max_tokens=2048, thinking=THINKING, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}])


def test_history_shapes_reach_the_template(client, served):
    prompts = served[1]
    prompts.clear()
    client.messages.create(model=MODEL, max_tokens=16, thinking={"type": "disabled"}, messages=[
        {"role": "user", "content": "first "}, {"role": "user", "content": [{"type": "text", "text": "second"}]},
        {"role": "assistant", "content": "ok"}, {"role": "system", "content": "Mid note."},
        {"role": "user", "content": "again"}])
    prompt = prompts[-1]
    assert "<|im_start|>user\nfirst second<|im_end|>" in prompt
    assert prompt.index("ok<|im_end|>") < prompt.index("<|im_start|>system\nMid note.") < prompt.index("again")
    assert prompt.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("extra, match", [
    ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}, "thinking.display"),
    ({"tool_choice": {"type": "any"}}, "tool_choice.type"),  # no tool to call
    ({"tool_choice": {"type": "tool", "name": "get_time"}, "tools": [WEATHER_TOOL]}, "tool_choice.name"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "tools": [WEATHER_TOOL]},
     "disable_parallel_tool_use"),
    ({"tools": [{**WEATHER_TOOL, "strict": "yes"}]}, "strict"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools\\[0\\].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "without vision"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)]}]}, "at most 4"),
    ({"cache_control": {"type": "ephemeral", "ttl": "1h"}, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}]}, "conflicts"),
    ({"extra_body": {"container": "c1"}}, "container"),
])
def test_bad_requests_raise_the_sdk_bad_request_error(client, extra, match):
    kwargs = {"model": MODEL, "max_tokens": 2048, "messages": ask("hi"), **extra}
    with pytest.raises(anthropic.BadRequestError, match=match) as caught:
        client.messages.create(**kwargs)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert caught.value.request_id and caught.value.body["request_id"] == caught.value.request_id


def test_accepted_hints_and_advisory_fields(client):
    msg = client.messages.create(
        model=MODEL, max_tokens=64, metadata={"user_id": "u1"}, service_tier="auto",
        cache_control={"type": "ephemeral"},
        tools=[{"name": "lookup", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}],
        system=[{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]}],
        extra_body={"inference_geo": "local"}, extra_headers={"anthropic-beta": "whatever-2025"})
    assert msg.stop_reason == "end_turn"


def test_authentication_and_not_found_errors(served):
    base = served[2].base_url
    stranger = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        stranger.messages.create(model=MODEL, max_tokens=8, messages=ask("hi"))
    assert caught.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(base + "/v1/messages/nope", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and r.headers["request-id"]


def test_overloaded_is_529():
    state, loop = scripted_state({}, "word " * 300, "--max-concurrency", "1", "--max-pending-requests", "0")
    state.engine.loop.engine.model.step_delay = 0.02
    loop.start()
    try:
        with LiveServer(create_app(state)) as server:
            client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
            opened, release = threading.Event(), threading.Event()

            def hold():
                with client.messages.stream(model=MODEL, max_tokens=250, messages=ask("go")) as stream:
                    for _ in stream:
                        opened.set()
                        if release.wait(20):
                            break

            t = threading.Thread(target=hold)
            t.start()
            assert opened.wait(10)
            with pytest.raises(anthropic.OverloadedError) as caught:
                client.messages.create(model=MODEL, max_tokens=8, messages=ask("hi"))
            release.set()
            t.join(20)
            assert caught.value.status_code == 529
            assert caught.value.body["error"]["type"] == "overloaded_error"
    finally:
        loop.stop()


def test_results_may_open_a_conversation_but_not_appear_from_nowhere(client):
    result = {"type": "tool_result", "tool_use_id": "toolu_old", "content": "42"}
    opened = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [result]}])
    assert opened.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="toolu_old|tool_use"):
        client.messages.count_tokens(model=MODEL, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [result]}])


def test_input_examples_reach_the_prompt(client, served):
    prompts = served[1]
    tool = {**WEATHER_TOOL, "name": "forecast", "input_examples": [{"city": "Oslo", "days": 2}]}
    prompts.clear()
    client.messages.create(model=MODEL, max_tokens=8, tools=[tool], messages=ask("hi"))
    shown = json.dumps("Example inputs:\n" + json.dumps({"city": "Oslo", "days": 2}))[1:-1]  # inside the tool's JSON
    assert shown in prompts[-1] and '"name": "forecast"' in prompts[-1]


def test_queue_timeout_is_504():
    state, loop = scripted_state({}, "word " * 300, "--max-concurrency", "1", "--pending-timeout-ms", "300")
    state.engine.loop.engine.model.step_delay = 0.02
    loop.start()
    try:
        with LiveServer(create_app(state)) as server:
            client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
            with client.messages.stream(model=MODEL, max_tokens=250, messages=ask("go")) as stream:
                next(iter(stream))
                with pytest.raises(anthropic.GatewayTimeoutError) as caught:
                    client.messages.create(model=MODEL, max_tokens=8, messages=ask("hi"))
            assert caught.value.body["error"]["type"] == "timeout_error"
    finally:
        loop.stop()
