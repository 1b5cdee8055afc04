"""Anthropic ``context_management`` edits (clear thinking, clear tool uses) as prompt rewrites,
through the official SDK's beta client, against the scripted model (Qwen template)."""
from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import record_prompts, scripted_state

KEY = "sk-local-test"
MODEL = "claude-local"
BETA = ["context-management-2025-06-27"]
CLEARED = "[tool result cleared from the context]"
SEARCH = {"name": "search", "description": "Search the notes",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
CLOCK = {"name": "clock", "description": "The time", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state({}, "Done.", "--api-key", KEY)
    prompts = record_prompts(state)
    loop.start()
    with LiveServer(create_app(state)) as server:
        yield anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0), prompts, server.base_url
    loop.stop()


@pytest.fixture
def client(served):
    return served[0]


def thinking_history(turns: int) -> list[dict]:
    """``turns`` answered user questions, each answer with its own reasoning, then a new question."""
    out = []
    for n in range(turns):
        out += [{"role": "user", "content": f"question {n}"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": f"REASONING-{n} " + "step " * 20, "signature": "s"},
                    {"type": "text", "text": f"answer {n}"}]}]
    return out + [{"role": "user", "content": "next question"}]


def tool_history(calls: list[tuple[str, dict, str]]) -> list[dict]:
    """One tool-calling loop: each call and its result in turn, then the model's summary request."""
    out = [{"role": "user", "content": "look things up"}]
    for n, (name, args, result) in enumerate(calls):
        out += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{n}", "name": name,
                                                    "input": args}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{n}",
                                              "content": [{"type": "text", "text": result}]}]}]
    return out


def create(client, messages, edits, **extra):
    return client.beta.messages.create(model=MODEL, max_tokens=16, messages=messages, betas=BETA,
                                       context_management={"edits": edits}, **extra)


def counted(client, messages, **extra) -> int:
    return client.messages.count_tokens(model=MODEL, messages=messages, **extra).input_tokens


def test_clear_thinking_keeps_the_latest_turns_and_reports_the_tokens(client, served):
    prompts = served[1]
    history = thinking_history(3)
    full = counted(client, history, extra_body={"preserve_thinking": True})
    prompts.clear()
    msg = create(client, history, [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}],
                 extra_body={"preserve_thinking": True})
    prompt = prompts[-1]
    assert "REASONING-2" in prompt and "REASONING-1" not in prompt and "REASONING-0" not in prompt
    assert "answer 0" in prompt and "answer 1" in prompt  # only the reasoning goes
    (edit,) = msg.context_management.applied_edits
    assert edit.type == "clear_thinking_20251015" and edit.cleared_thinking_turns == 2
    assert edit.cleared_input_tokens > 40
    assert msg.usage.input_tokens == full - edit.cleared_input_tokens


def test_clear_thinking_default_and_all(client, served):
    prompts = served[1]
    history = thinking_history(2)
    kept = create(client, history, [{"type": "clear_thinking_20251015", "keep": "all"}],
                  extra_body={"preserve_thinking": True})
    assert kept.context_management.applied_edits == [] and "REASONING-0" in prompts[-1]
    also_kept = create(client, history, [{"type": "clear_thinking_20251015", "keep": {"type": "all"}}],
                       extra_body={"preserve_thinking": True})
    assert also_kept.context_management.applied_edits == [] and "REASONING-0" in prompts[-1]
    default = create(client, history, [{"type": "clear_thinking_20251015"}], extra_body={"preserve_thinking": True})
    assert [e.cleared_thinking_turns for e in default.context_management.applied_edits] == [1]
    assert "REASONING-0" not in prompts[-1] and "REASONING-1" in prompts[-1]
    # the template alone drops reasoning before the last user turn: the turns go, no tokens do
    plain = create(client, history, [{"type": "clear_thinking_20251015"}])
    (edit,) = plain.context_management.applied_edits
    assert edit.cleared_thinking_turns == 1 and edit.cleared_input_tokens == 0


def test_a_tool_loop_is_one_thinking_turn(client, served):
    prompts = served[1]
    loop = [{"role": "user", "content": "find it"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "LOOP-A", "signature": "s"},
                                              {"type": "tool_use", "id": "toolu_a", "name": "search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "r"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "LOOP-B", "signature": "s"},
                                              {"type": "tool_use", "id": "toolu_b", "name": "search", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_b", "content": "r"}]}]
    msg = create(client, thinking_history(1)[:-1] + loop, [{"type": "clear_thinking_20251015"}], tools=[SEARCH],
                 extra_body={"preserve_thinking": True})
    assert [e.cleared_thinking_turns for e in msg.context_management.applied_edits] == [1]
    assert "REASONING-0" not in prompts[-1] and "LOOP-A" in prompts[-1] and "LOOP-B" in prompts[-1]


def test_clear_tool_uses_keeps_recent_and_excluded_results(client, served):
    prompts = served[1]
    history = tool_history([("search", {"query": "alpha"}, "RESULT-0 " * 10), ("clock", {}, "RESULT-1 " * 10),
                            ("search", {"query": "gamma"}, "RESULT-2 " * 10), ("search", {"query": "delta"},
                                                                               "RESULT-3 " * 10)])
    full = counted(client, history, tools=[SEARCH, CLOCK])
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 3},
            "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["clock"]}
    prompts.clear()
    msg = create(client, history, [edit], tools=[SEARCH, CLOCK])
    prompt = prompts[-1]
    assert "RESULT-0" not in prompt and "RESULT-2" not in prompt and prompt.count(CLEARED) == 2
    assert "RESULT-1" in prompt and "RESULT-3" in prompt
    assert "alpha" in prompt and "gamma" in prompt  # inputs stay unless asked
    (applied,) = msg.context_management.applied_edits
    assert applied.type == "clear_tool_uses_20250919" and applied.cleared_tool_uses == 2
    assert applied.cleared_input_tokens > 20 and msg.usage.input_tokens == full - applied.cleared_input_tokens

    create(client, history, [{**edit, "clear_tool_inputs": ["search"]}], tools=[SEARCH, CLOCK])
    assert "alpha" not in prompts[-1] and "gamma" not in prompts[-1] and "delta" in prompts[-1]


def test_clear_tool_uses_waits_for_its_trigger_and_clear_at_least(client, served):
    prompts = served[1]
    history = tool_history([("search", {"query": "q"}, "RESULT-0 " * 10), ("search", {}, "RESULT-1")])
    quiet = create(client, history, [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 0}}],
                   tools=[SEARCH])  # default trigger: 100,000 input tokens
    assert quiet.context_management.applied_edits == [] and "RESULT-0" in prompts[-1]
    low = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10},
           "keep": {"type": "tool_uses", "value": 1}}
    applied = create(client, history, [low], tools=[SEARCH]).context_management.applied_edits
    assert [e.cleared_tool_uses for e in applied] == [1] and "RESULT-0" not in prompts[-1]
    needs_more = {**low, "clear_at_least": {"type": "input_tokens", "value": applied[0].cleared_input_tokens + 1}}
    assert create(client, history, [needs_more], tools=[SEARCH]).context_management.applied_edits == []
    assert "RESULT-0" in prompts[-1]


def test_stream_reports_the_edits_in_message_delta(client, served):
    history = thinking_history(2)
    edits = [{"type": "clear_thinking_20251015"}]
    with client.beta.messages.stream(model=MODEL, max_tokens=16, messages=history, betas=BETA,
                                     context_management={"edits": edits},
                                     extra_body={"preserve_thinking": True}) as stream:
        final = stream.get_final_message()
    whole = create(client, history, edits, extra_body={"preserve_thinking": True})
    assert final.context_management == whole.context_management
    assert final.context_management.applied_edits[0].cleared_thinking_turns == 1
    body = {"model": MODEL, "max_tokens": 16, "messages": history, "stream": True, "preserve_thinking": True,
            "context_management": {"edits": edits}}
    with httpx.stream("POST", served[2] + "/v1/messages?beta=true", headers={"x-api-key": KEY}, json=body,
                      timeout=30) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    (delta,) = [d for d in data if d["type"] == "message_delta"]
    assert delta["context_management"] == whole.context_management.model_dump()
    assert "context_management" not in data[0]["message"]


def test_count_tokens_reports_the_original_count(client):
    history = thinking_history(3)
    edits = [{"type": "clear_thinking_20251015"}]
    count = client.beta.messages.count_tokens(model=MODEL, messages=history, betas=BETA,
                                              context_management={"edits": edits},
                                              extra_body={"preserve_thinking": True})
    msg = create(client, history, edits, extra_body={"preserve_thinking": True})
    assert count.input_tokens == msg.usage.input_tokens
    assert count.context_management.original_input_tokens == count.input_tokens + \
        msg.context_management.applied_edits[0].cleared_input_tokens


def test_without_context_management_the_field_is_absent(client):
    msg = client.beta.messages.create(model=MODEL, max_tokens=8, messages=thinking_history(1))
    assert msg.context_management is None
    assert client.beta.messages.count_tokens(model=MODEL, messages=thinking_history(1)).context_management is None


@pytest.mark.parametrize("context_management, field", [
    ({"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}, "context_management.edits[0].keep"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]},
     "context_management.edits[0].keep.value"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "tool_uses", "value": 1}}]},
     "context_management.edits[0].keep.type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}]},
     "context_management.edits[0].keep.value"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "messages", "value": 5}}]},
     "context_management.edits[0].trigger.type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": True}}]},
     "context_management.edits[0].trigger.value"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "clear_at_least": {"type": "tool_uses", "value": 1}}]},
     "context_management.edits[0].clear_at_least.type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "search"}]},
     "context_management.edits[0].exclude_tools"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": 1}]},
     "context_management.edits[0].clear_tool_inputs"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "keep_last": 1}]}, "context_management.edits[0].keep_last"),
    ({"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]},
     "context_management.edits[1].type"),
    ({"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_tool_uses_20250919"}]},
     "context_management.edits[1].type"),
    ({"edits": [{"type": "clear_everything"}]}, "context_management.edits[0].type"),
    ({"edits": [{"type": "compact_20260112"}]}, "context_management.edits[0].type"),
    ({"edits": ["clear_thinking_20251015"]}, "context_management.edits[0]"),
    ({"edits": {"type": "clear_thinking_20251015"}}, "context_management.edits"),
    ({"strategy": "auto"}, "context_management.strategy"),
    ("clear", "context_management"),
])
def test_bad_edits_are_a_400_naming_the_field(served, context_management, field):
    base = served[2]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(base + path, headers={"x-api-key": KEY}, json={
            "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "context_management": context_management})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error", error
        assert error["message"].startswith((f"{field}:", f"'{field}' is not supported")), error
    assert httpx.get(base + "/health").status_code == 200
