"""Text-only content reaches the chat template as one string from every API family: the embedded
model's template (SmolLM2) concatenates ``message['content']`` and fails on a list of parts."""
from __future__ import annotations

import httpx
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
JOINED = "<|im_start|>user\nSay hello to the moon.<|im_end|>"
TEXT_PARTS = [{"type": "text", "text": "Say hello "}, {"type": "text", "text": "to the moon."}]


@pytest.fixture(scope="module")
def served():
    state, loop = build_state(build_parser().parse_args(["--max-context", "1024"]))
    rendered: list[str] = []
    render = state.template.render

    def recording(*args, **kwargs):
        rendered.append(render(*args, **kwargs))
        return rendered[-1]

    state.template.render = recording  # the real template, its output kept
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield live.base_url, rendered
    loop.stop()


def post(served, path: str, body: dict) -> httpx.Response:
    served[1].clear()
    r = httpx.post(served[0] + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.get(served[0] + "/health", timeout=10).status_code == 200
    return r


def test_openai_chat(served):
    post(served, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": TEXT_PARTS}]})
    assert JOINED in served[1][-1] and "<|im_start|>system\nBe brief.<|im_end|>" in served[1][-1]


def test_responses(served):
    parts = [{"type": "input_text", "text": p["text"]} for p in TEXT_PARTS]
    post(served, "/v1/responses", {"model": MODEL, "max_output_tokens": 4,
                                   "input": [{"role": "user", "content": parts}]})
    assert JOINED in served[1][-1]
    r = post(served, "/v1/responses/input_tokens", {"model": MODEL, "input": [{"role": "user", "content": parts}]})
    assert JOINED in served[1][-1] and r.json()["input_tokens"] > 5


def test_anthropic_messages_and_count_tokens(served):
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    body = {"model": MODEL, "max_tokens": 4, "system": system, "messages": [{"role": "user", "content": TEXT_PARTS}]}
    usage = post(served, "/v1/messages", body).json()["usage"]
    assert JOINED in served[1][-1] and "<|im_start|>system\nBe brief.<|im_end|>" in served[1][-1]
    counted = post(served, "/v1/messages/count_tokens", body).json()
    # Anthropic's input_tokens leave out the tokens read from cache
    assert JOINED in served[1][-1] and counted["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    tool_turns = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": TEXT_PARTS}]}]}
    post(served, "/v1/messages", tool_turns)
    assert "Say hello to the moon." in served[1][-1]


def test_llamacpp_apply_template_and_chat(served):
    body = {"messages": [{"role": "user", "content": TEXT_PARTS}]}
    prompt = post(served, "/apply-template", body).json()["prompt"]
    assert JOINED in prompt and JOINED in served[1][-1]
    post(served, "/v1/chat/completions", {**body, "model": MODEL, "max_tokens": 4})
    assert served[1][-1] == prompt
