"""The OpenAI API surface through the official SDK, against a real server (uvicorn over HTTP) with
the scripted model: chat, reasoning, tool calls, thinking budget, Responses, legacy completions."""
from __future__ import annotations

import json

import openai
import pytest

from ninfer.server.app import create_app
from ninfer.server.generation import THINKING_CLOSE_TEXT
from ninfer.server.state import ThinkingDefaults
from support.live_server import LiveServer
from support.scripted import scripted_state

MODEL = "scripted"
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
SCRIPTS = {
    "capital": "The user asks for a capital.\n</think>\n\nThe capital of France is Paris.",
    "weather": "The user wants the weather. I should call the tool.\n</think>\n\nLet me check.\n\n" + CALL,
    "sunny-22C": "The tool answered.\n</think>\n\nIt is sunny in Paris, 22°C.",
    "ponder": "Step one. " * 30 + "\n</think>\n\nThe answer is 42.",
    "pineapple": "A fruit to remember.\n</think>\n\nNoted, banana-split.",
    "banana-split": "I recall it.\n</think>\n\nYou said pineapple.",
    "namespaced": "Use the namespace.\n</think>\n\n<tool_call>\n<function=mcp__weather.get_current>\n"
                  "<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>",
    "undeclared": "Hmm.\n</think>\n\n<tool_call>\n<function=launch_rockets>\n<parameter=n>\n3\n</parameter>\n"
                  "</function>\n</tool_call>",
}
DEFAULT = "Nothing special.\n</think>\n\nHello! How can I help?"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    state, loop = scripted_state(SCRIPTS, DEFAULT)
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield live, state
    loop.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].base_url + "/v1", api_key="none", max_retries=0)


def tokens(state, text: str) -> int:
    return len(state.tokenizer.encode(text))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------- chat
def test_chat_separates_reasoning_and_counts_usage(client, server):
    state = server[1]
    reply = client.chat.completions.create(model=MODEL, messages=user("What is the capital of France?"))
    msg = reply.choices[0].message
    assert msg.content == "The capital of France is Paris."
    assert msg.reasoning_content == "The user asks for a capital."
    assert msg.refusal is None and reply.choices[0].finish_reason == "stop"
    prompt = state.template.render(user("What is the capital of France?"), add_generation_prompt=True)
    script = SCRIPTS["capital"]
    usage = reply.usage
    assert usage.prompt_tokens == tokens(state, prompt)
    assert usage.completion_tokens == tokens(state, script) + 1  # the script, then eos
    assert usage.completion_tokens_details.reasoning_tokens == tokens(state, script.split("</think>")[0]) + 1
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert reply.timings["predicted_n"] == usage.completion_tokens  # llama.cpp-style extension
    assert reply.timings["cache_n"] + reply.timings["prompt_n"] == usage.prompt_tokens


def test_chat_stream_matches_aggregate(client):
    whole = client.chat.completions.create(model=MODEL, messages=user("capital?"))
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("capital?"), stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert reasoning == whole.choices[0].message.reasoning_content
    assert content == whole.choices[0].message.content
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_content:])  # reasoning first
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert chunks[-1].timings["predicted_n"] == whole.usage.completion_tokens


def test_thinking_off_puts_everything_in_content(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("hi"), reasoning_effort="none")
    assert reply.choices[0].message.content == DEFAULT
    assert getattr(reply.choices[0].message, "reasoning_content", None) is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_thinking_budget_closes_reasoning_and_the_answer_continues(client, server):
    state = server[1]
    kwargs = dict(model=MODEL, messages=user("Please ponder."), extra_body={"thinking_budget": 10})
    reply = client.chat.completions.create(**kwargs)
    msg = reply.choices[0].message
    close = THINKING_CLOSE_TEXT.split("\n</think>")[0]
    assert msg.reasoning_content == state.tokenizer.decode(state.tokenizer.encode(SCRIPTS["ponder"])[:10]) + close
    assert msg.content == "The answer is 42."
    forced = tokens(state, THINKING_CLOSE_TEXT)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 10 + forced - 1  # up to </think>
    assert reply.usage.completion_tokens == 10 + forced + tokens(state, "The answer is 42.") + 1
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_thinking_budget_that_cannot_fit_its_close_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("ponder"), max_tokens=15,
                                       extra_body={"thinking_budget": 10})
    assert e.value.body["code"] == "thinking_budget_capacity_insufficient"


def test_max_tokens_zero_processes_the_prompt_only(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("capital"), max_completion_tokens=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 0
    assert reply.usage.prompt_tokens > 0


def test_stop_applies_to_reasoning_too(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("capital"), stop=["a capital"])
    assert reply.choices[0].message.reasoning_content == "The user asks for "
    assert reply.choices[0].message.content == "" and reply.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- tools
def test_tool_call_round_trip(client):
    messages = user("What's the weather in Paris?")
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris", "days": 3}'  # typed, in the model's order
    messages = messages + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": "sunny-22C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "It is sunny in Paris, 22°C."
    assert second.choices[0].finish_reason == "stop"


def test_streamed_tool_call_equals_aggregate(client):
    kwargs = dict(model=MODEL, messages=user("weather in Paris"), tools=[WEATHER_TOOL])
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert content == whole.message.content and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_choice_none_and_undeclared_functions_give_text(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("weather"), tools=[WEATHER_TOOL],
                                           tool_choice="none")
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == "Let me check.\n\n" + CALL
    reply = client.chat.completions.create(model=MODEL, messages=user("undeclared"), tools=[WEATHER_TOOL])
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == SCRIPTS["undeclared"].split("\n</think>\n\n")[1]


def test_allowed_tools_filters_the_callable_set(client):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "get_time"}}]}}
    reply = client.chat.completions.create(model=MODEL, messages=user("weather"), tools=[WEATHER_TOOL, other],
                                           tool_choice=choice)
    assert reply.choices[0].message.tool_calls is None  # get_weather is declared but not allowed


# ---------------------------------------------------------------------------- responses
def test_responses_conversation_retrieve_delete(client):
    first = client.responses.create(model=MODEL, input="Remember: pineapple.", instructions="Be brief.")
    assert first.status == "completed" and first.output_text == "Noted, banana-split."
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "message"]
    assert first.output[0].content[0].text == "A fruit to remember."
    assert first.usage.output_tokens_details.reasoning_tokens > 0
    second = client.responses.create(model=MODEL, input="Which fruit?", previous_response_id=first.id)
    assert second.output_text == "You said pineapple."  # the stored history reached the prompt
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 10
    count = client.responses.input_tokens.count(model=MODEL, input="Which fruit?", previous_response_id=first.id)
    assert count.input_tokens == second.usage.input_tokens

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Which fruit?"
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    third = client.responses.create(model=MODEL, input="Which fruit?", previous_response_id=second.id)
    # a deleted parent leaves its children usable: the last keyword is now in second's answer
    assert third.output_text == "Noted, banana-split."
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens - 10


def test_responses_input_tokens_matches_create(client):
    count = client.responses.input_tokens.count(model=MODEL, input="capital?", instructions="Short answers.")
    created = client.responses.create(model=MODEL, input="capital?", instructions="Short answers.", store=False)
    assert count.input_tokens == created.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)  # store: false


def test_responses_stream_lifecycle(client):
    with client.responses.stream(model=MODEL, input="capital?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == "The user asks for a capital." and text == final.output_text
    assert final.output_text == "The capital of France is Paris."


def test_responses_function_call_round_trip(client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    first = client.responses.create(model=MODEL, input="weather in Paris?", tools=[tool])
    calls = [i for i in first.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    assert calls[0].id.startswith("fc_") and calls[0].call_id.startswith("call_")
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[tool], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny-22C"}])
    assert second.output_text == "It is sunny in Paris, 22°C."

    with client.responses.stream(model=MODEL, input="weather in Paris?", tools=[tool]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (fc,) = [i for i in final.output if i.type == "function_call"]
    assert args == fc.arguments == calls[0].arguments


def test_responses_namespaced_function(client):
    ns = {"type": "namespace", "name": "mcp__weather", "description": "Weather service",
          "tools": [{"type": "function", "name": "get_current",
                     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]}
    out = client.responses.create(model=MODEL, input="namespaced call please", tools=[ns])
    (fc,) = [i for i in out.output if i.type == "function_call"]
    assert (fc.namespace, fc.name, fc.arguments) == ("mcp__weather", "get_current", '{"city": "Lima"}')


def test_responses_effort_none_disables_thinking(client):
    out = client.responses.create(model=MODEL, input="capital?", reasoning={"effort": "none"})
    assert [i.type for i in out.output] == ["message"] and out.output_text == SCRIPTS["capital"]
    assert out.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_incomplete_on_max_output_tokens(client):
    out = client.responses.create(model=MODEL, input="ponder", max_output_tokens=5)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in out.output] == ["reasoning"]  # no invented empty message


# ---------------------------------------------------------------------------- legacy completions
def test_legacy_completions(client, server):
    state = server[1]
    prompt = "Tell me the capital"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=200)
    assert out.choices[0].text == SCRIPTS["capital"] and out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == tokens(state, prompt)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith(prompt) and echoed.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=200, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == SCRIPTS["capital"]
    by_ids = client.completions.create(model=MODEL, prompt=state.tokenizer.encode(prompt), max_tokens=200)
    assert by_ids.choices[0].text == SCRIPTS["capital"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, suffix="end")
    assert e.value.body["param"] == "suffix"


# ---------------------------------------------------------------------------- server reasoning defaults
@pytest.fixture
def defaults(server):
    """Set the server's reasoning defaults (as --no-thinking / --preserve-thinking /
    --default-thinking-budget would) for one test."""
    state = server[1]
    saved = state.thinking
    yield lambda **kw: setattr(state, "thinking", ThinkingDefaults(**kw))
    state.thinking = saved


def test_default_thinking_budget_and_natural_close(client, defaults):
    defaults(budget=10)
    forced = client.chat.completions.create(model=MODEL, messages=user("ponder"))
    assert forced.choices[0].message.content == "The answer is 42."
    assert "Considering the limited time" in forced.choices[0].message.reasoning_content
    natural = client.chat.completions.create(model=MODEL, messages=user("capital"))  # 7 reasoning tokens
    assert natural.choices[0].message.reasoning_content == "The user asks for a capital."
    off = client.chat.completions.create(model=MODEL, messages=user("ponder"), extra_body={"enable_thinking": False})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0  # non-thinking requests get no cap


def test_reasoning_loop_stop_and_conclude(client, defaults):
    """The "ponder" reasoning says "Step one." thirty times over: the guard catches it."""
    whole = client.chat.completions.create(model=MODEL, messages=user("ponder"))
    assert whole.choices[0].message.reasoning_content.count("Step one.") == 30
    defaults(loop="stop")
    stopped = client.chat.completions.create(model=MODEL, messages=user("ponder"))
    c = stopped.choices[0]
    assert c.finish_reason == "stop" and not c.message.content
    assert 3 <= c.message.reasoning_content.count("Step one.") < 30
    defaults(loop="conclude")
    concluded = client.chat.completions.create(model=MODEL, messages=user("ponder"))
    c = concluded.choices[0]
    assert c.message.content == "The answer is 42."
    assert "Considering the limited time" in c.message.reasoning_content
    assert c.message.reasoning_content.count("Step one.") < 30
    natural = client.chat.completions.create(model=MODEL, messages=user("capital"))  # no repeat: untouched
    assert natural.choices[0].message.reasoning_content == "The user asks for a capital."


def test_no_thinking_default_and_request_override(client, defaults):
    defaults(enable_thinking=False)
    plain = client.chat.completions.create(model=MODEL, messages=user("capital"))
    assert plain.choices[0].message.content == SCRIPTS["capital"]
    on = client.chat.completions.create(model=MODEL, messages=user("capital"), reasoning_effort="high")
    assert on.choices[0].message.reasoning_content == "The user asks for a capital."
    on = client.chat.completions.create(model=MODEL, messages=user("capital"),
                                        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert on.choices[0].message.content == "The capital of France is Paris."


def test_preserve_thinking_keeps_past_reasoning(client, defaults):
    history = user("first") + [{"role": "assistant", "content": "A.", "reasoning_content": "secret " * 20}] + \
        user("capital")
    dropped = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1).usage.prompt_tokens
    kept = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1,
                                          extra_body={"preserve_thinking": True}).usage.prompt_tokens
    assert kept >= dropped + 20
    defaults(preserve_thinking=True)
    assert client.chat.completions.create(model=MODEL, messages=history, max_tokens=1).usage.prompt_tokens == kept
    back = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1,
                                          extra_body={"chat_template_kwargs": {"preserve_thinking": False}})
    assert back.usage.prompt_tokens == dropped


def test_cli_flags_reach_the_state():
    from ninfer.server.bootstrap import gateway_settings
    from ninfer.server.cli import build_parser

    args = build_parser().parse_args(["--no-thinking", "--preserve-thinking", "--default-thinking-budget", "64",
                                      "--reasoning-loop", "conclude",
                                      "--cors", "https://a.example, https://b.example", "--max-request-mib", "2",
                                      "--default-max-tokens", "100", "--response-store-mib", "1"])
    s = gateway_settings(args)
    assert s["thinking"] == ThinkingDefaults(enable_thinking=False, preserve_thinking=True, budget=64, loop="conclude")
    assert s["cors_origins"] == ("https://a.example", "https://b.example")
    assert s["max_request_bytes"] == 2 << 20 and s["default_max_tokens"] == 100
    assert s["responses"].capacity == 1 << 20
    with pytest.raises(ValueError):
        gateway_settings(build_parser().parse_args(["--default-thinking-budget", "0"]))
