"""A returning conversation through the APIs: each turn's checkpoint is where its messages end
(before the generation prompt), the next turn goes on from it, and every API reports the reused
tokens in its own field; ``--no-prefix-cache`` reports none."""
from __future__ import annotations

import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import scripted_state

ANSWER = "Four."


@pytest.fixture(scope="module", params=[True, False], ids=["cache", "no-cache"])
def served(request):
    state, loop = scripted_state({}, ANSWER, prefix_cache=request.param)
    loop.start()
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client, state, request.param
    loop.stop()


def turn_end(state, messages: list[dict]) -> int:
    """Tokens of the conversation so far, without the generation prompt."""
    return len(state.tokenizer.encode(state.template.render(messages, add_generation_prompt=False)))


def test_each_turn_goes_on_from_where_the_last_one_ended(served):
    http, state, cache = served
    messages = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "2+2?"}]
    first = http.post("/v1/chat/completions", json={"model": "scripted", "messages": messages})
    assert first.status_code == 200 and first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answered = messages + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]

    chat = http.post("/v1/chat/completions", json={"model": "scripted",
                                                   "messages": answered + [{"role": "user", "content": "And 3+3?"}]})
    assert chat.status_code == 200
    usage = chat.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == (turn_end(state, messages) if cache else 0)

    later = answered + [{"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": ANSWER},
                        {"role": "user", "content": "And 4+4?"}]
    anthropic = http.post("/v1/messages", json={"model": "scripted", "max_tokens": 16, "system": "Be brief. " * 30,
                                                "messages": later[1:]})
    assert anthropic.status_code == 200, anthropic.text
    reused = anthropic.json()["usage"]["cache_read_input_tokens"]
    assert reused == (turn_end(state, later[:4]) if cache else 0)
    assert anthropic.json()["usage"]["input_tokens"] + reused == len(
        state.tokenizer.encode(state.template.render(later, add_generation_prompt=True)))

    responses = http.post("/v1/responses", json={"model": "scripted", "instructions": "Be brief. " * 30,
                                                 "input": later[1:]})
    assert responses.status_code == 200, responses.text
    details = responses.json()["usage"]["input_tokens_details"]
    assert details["cached_tokens"] == (len(state.tokenizer.encode(state.template.render(
        later, add_generation_prompt=False))) if cache else 0)  # the same conversation, sent again


def test_a_new_conversation_with_the_same_long_system_prompt_goes_on_from_it(served):
    """An agent's second session (or a subagent) sends the same long system prompt and tools
    with another first question: a checkpoint where the system part ends serves it, so all it
    shares with the first session but at most one token is reused."""
    http, state, cache = served
    system = {"role": "system", "content": "You are a coding agent. Read each file before you edit it. " * 50}
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                               "parameters": {"type": "object",
                                                              "properties": {"path": {"type": "string"}}}}}]
    prompts, cached = [], []
    for question in ("Fix the failing test.", "Write the docs for the parser."):
        messages = [system, {"role": "user", "content": question}]
        r = http.post("/v1/chat/completions", json={"model": "scripted", "messages": messages, "tools": tools})
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        prompts.append(state.tokenizer.encode(state.template.render(messages, tools=tools)))
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert cached[0] == 0
    assert (shared - 1 <= cached[1] <= shared) if cache else cached[1] == 0
