"""Every field the OpenAI surface refuses gets a 400 naming it; neutral values are accepted."""
from __future__ import annotations

import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import scripted_state

MODEL = "scripted"
FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
RFN = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.fixture(scope="module")
def http():
    state, loop = scripted_state({}, "Thinking.\n</think>\n\nOk.")
    loop.start()
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client
    loop.stop()


def user_part(part: dict) -> list:
    return [{"role": "user", "content": [part]}]


CHAT_REJECTED = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"logit_bias": {"42": 500}}, "logit_bias.42"),
    ({"logit_bias": {"forty-two": 5}}, "logit_bias.forty-two"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"messages": user_part({"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}})},
     "messages[0].content[0]"),
    ({"messages": user_part({"type": "file", "file": {"file_id": "f1"}})}, "messages[0].content[0]"),
    ({"messages": user_part({"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "high"}})},
     "messages[0].content[0].image_url.detail"),
    ({"messages": user_part({"type": "image_url", "image_url": {"url": "https://x/y.png"}})},
     "messages[0].content[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"anyOf": [
        {"type": "object"}, {"type": "null"}]}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "custom", "custom": {"name": "c"}}]}, "tools[0].type"),
    ({"tool_choice": "required"}, "tool_choice"),  # no function to call
    ({"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": [FN], "tool_choice": {"type": "custom", "custom": {"name": "f"}}}, "tool_choice"),
    ({"tools": [FN], "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "always", "tools": []}}},
     "tool_choice.allowed_tools.mode"),
    ({"tools": [FN], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [FN], "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    ({"verbosity": "high"}, "verbosity"),
    ({"verbosity": "low"}, "verbosity"),
    ({"store": True}, "store"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"grammar": "root ::= x"}, "grammar"),  # x is no rule
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"json_schema": {}}}, "structured_outputs.json_schema"),
    ({"guided_json": "[1,"}, "guided_json"),
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "x"}, "guided_grammar"),
    ({"guided_json": {}, "guided_regex": "a+"}, "guided_regex"),  # one constraint per request
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a+", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"n": 65}, "n"),  # more choices than lanes
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"mm_processor_kwargs": {"fps": 2}}, "mm_processor_kwargs"),
    ({"messages": [{"role": "user", "content": "hi", "name": "alice"}]}, "messages[0].name"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": None, "audio": {"id": "a1"}}, {"role": "user", "content": "x"}]},
     "messages[0].audio"),
    ({"reasoning_effort": "none", "enable_thinking": True}, "reasoning_effort"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"top_k": 21}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]

CHAT_NEUTRAL = [
    {"logit_bias": {"42": 0}},
    {"logprobs": False, "top_logprobs": 0},
    {"verbosity": "medium"},
    {"functions": [], "function_call": "none"},
    {"modalities": ["text"], "audio": {"voice": "alloy", "format": "wav"}},
    {"prediction": {"type": "content", "content": "Ok."}},
    {"metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "service_tier": "auto"},
    {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit"}},
    {"store": False, "n": 1, "response_format": {"type": "text"}},
    {"parallel_tool_calls": False},
    {"repetition_penalty": 1, "mm_processor_kwargs": {"fps": None}},
    {"messages": [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "done"}]},
    {"some_future_field": {"x": 1}},
    {"reasoning_effort": "high", "seed": -5, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"top_k": 20, "min_p": 0.1, "top_p": 0.9, "temperature": 0.7},
]


@pytest.mark.parametrize("fields, param", CHAT_REJECTED, ids=[p for _, p in CHAT_REJECTED])
def test_chat_refusals_name_the_field(http, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err


@pytest.mark.parametrize("fields", CHAT_NEUTRAL)
def test_chat_neutral_values_are_accepted(http, fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


RESPONSES_REJECTED = [
    ({"some_unknown_field": 1}, "some_unknown_field", "unknown_parameter"),
    ({"conversation": "conv_1"}, "conversation", None),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", None),
    ({"context_management": [{"type": "compaction"}]}, "context_management", None),
    ({"moderation": {"model": "m"}}, "moderation", None),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", None),
    ({"include": ["file_search_call.results"]}, "include[0]", None),
    ({"background": True}, "background", None),
    ({"truncation": "auto"}, "truncation", None),
    ({"top_logprobs": 21}, "top_logprobs", None),
    ({"service_tier": "flex"}, "service_tier", None),
    ({"tools": [{"type": "shell"}]}, "tools[0].type", None),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice", None),
    ({"tools": [{"type": "custom", "name": "c"}]}, "tools[0].type", None),
    ({"tools": [{**RFN, "strict": 1}]}, "tools[0].strict", None),
    ({"tools": [{**RFN, "strict": True, "parameters": {"$ref": "#/$defs/A", "$defs": {"A": {"type": "object"}}}}]},
     "tools[0].parameters", None),
    ({"tools": [{**RFN, "defer_loading": True}]}, "tools[0].defer_loading", None),
    ({"tool_choice": "required"}, "tool_choice", None),  # no function to call
    ({"tools": [RFN], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", None),
    ({"tools": [RFN], "tool_choice": {"type": "function"}}, "tool_choice.name", None),
    ({"tools": [RFN], "tool_choice": {"type": "allowed_tools", "mode": "always", "tools": []}}, "tool_choice.mode",
     None),
    ({"tools": [RFN], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format", None),
    ({"tools": [RFN], "parallel_tool_calls": False}, "parallel_tool_calls", None),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]", None),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", None),
    ({"input": [{"role": "user", "content": "a"}, {"type": "reasoning", "summary": [{"type": "summary_text",
                                                                                   "text": "s"}]}]},
     "input[1].content", None),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "message", "role": "assistant", "content": "late"}]}, "input", "invalid_assistant_history"),
    ({"input": [{"role": "user", "content": "a"},
                {"type": "function_call_output", "call_id": "c9", "output": "x"}]}, "input", "invalid_tool_history"),
    ({"input": [{"role": "user", "content": "a", "id": "m1"}, {"role": "user", "content": "b", "id": "m1"}]},
     "input[1].id", None),
    ({"temperature": 2.5}, "temperature", None),
]


@pytest.mark.parametrize("fields, param, code", RESPONSES_REJECTED, ids=[p for _, p, _ in RESPONSES_REJECTED])
def test_responses_refusals_name_the_field(http, fields, param, code):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    r = http.post("/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if code:
        assert err["code"] == code


def test_responses_neutral_values_are_accepted(http):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 8, "text": {"format": {"type": "text"},
            "verbosity": "medium"}, "truncation": "disabled", "include": [], "background": False,
            "service_tier": "auto", "top_logprobs": 0, "max_tool_calls": 2, "parallel_tool_calls": False,
            "metadata": {"a": "b"}, "client_metadata": {"x": 1}, "prompt_cache_key": "k",
            "safety_identifier": "s", "user": "u", "reasoning": {"effort": "medium", "summary": "auto"},
            "stream_options": None, "store": False}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["status"] in ("completed", "incomplete")


def test_legacy_completions_refusals(http):
    for fields, param in [({"n": 100}, "n"), ({"best_of": 3}, "best_of"), ({"logprobs": 6}, "logprobs"),
                          ({"logprobs": 2, "echo": True}, "logprobs"),
                          ({"suffix": "x"}, "suffix"), ({"logit_bias": {"1": -101}}, "logit_bias.1"),
                          ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [10 ** 9]}, "prompt[0]")]:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **fields})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "logprobs": 0, "best_of": 1,
                                           "logit_bias": {"1": 0}, "max_tokens": 2})
    assert r.status_code == 200, r.text
