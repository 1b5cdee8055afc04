"""Anthropic Messages on the embedded default model (SmolLM2-135M-Instruct, whose template
concatenates ``message['content']`` as a string), through the official SDK and litellm's
``anthropic/`` provider, and the exact requests that used to fail on it."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer

pytestmark = pytest.mark.slow
KEY = "sk-local-test"
MODEL = "smollm2-135m-instruct"
HELLO = [{"role": "user", "content": [{"type": "text", "text": "Say hello "}, {"type": "text", "text": "to me."}]}]


@pytest.fixture(scope="module")
def server():
    state, loop = build_state(build_parser().parse_args(["--max-context", "1024", "--api-key", KEY]))
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield live.base_url
    loop.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def post(server, path, body):
    return httpx.post(server + path, headers={"x-api-key": KEY}, json=body, timeout=120)


def assert_healthy(server):
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_the_plain_request_that_used_to_fail(server):
    body = {"model": "smollm2-135m-instruct", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    r = post(server, "/v1/messages", body)
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["content"][0]["type"] == "text" and message["content"][0]["text"]
    assert message["stop_reason"] in ("end_turn", "max_tokens") and 0 < message["usage"]["output_tokens"] <= 8
    counted = post(server, "/v1/messages/count_tokens", body)
    assert counted.status_code == 200 and counted.json() == {"input_tokens": message["usage"]["input_tokens"]}
    assert_healthy(server)


def test_claude_codes_context_management_request(server):
    body = {"model": "smollm2-135m-instruct", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
    r = httpx.post(server + "/v1/messages?beta=true", json=body, timeout=120,
                   headers={"x-api-key": KEY, "anthropic-beta": "context-management-2025-06-27"})
    assert r.status_code == 200, r.text
    assert r.json()["context_management"] == {"applied_edits": []}
    bad = {**body, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "some"}]}}
    refused = post(server, "/v1/messages", bad)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith("context_management.edits[0].keep:")
    assert_healthy(server)


def test_sdk_create_completes_a_turn(client):
    msg = client.messages.create(model=MODEL, max_tokens=24, system=[{"type": "text", "text": "Be brief."}],
                                 messages=HELLO)
    assert msg.role == "assistant" and [b.type for b in msg.content] == ["text"] and msg.content[0].text.strip()
    assert msg.stop_reason in ("end_turn", "max_tokens") and 0 < msg.usage.output_tokens <= 24
    counted = client.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                           messages=HELLO)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens


def test_sdk_stream_completes_a_turn(client):
    with client.messages.stream(model=MODEL, max_tokens=24, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 24
    counted = client.messages.count_tokens(model=MODEL, messages=HELLO)
    assert counted.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_sdk_count_tokens_counts_the_joined_text(client):
    as_parts = client.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens
    as_string = client.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": "Say hello to me."}]).input_tokens
    assert as_parts == as_string > 5


def test_litellm_anthropic_provider_completes_a_turn(server, client, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its price table from the package, not a download
    import litellm

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to me."}]
    reply = litellm.completion(model=f"anthropic/{MODEL}", api_base=server, api_key=KEY, messages=messages,
                               max_tokens=24, num_retries=0)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason in ("stop", "length")
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.",
                                           messages=[{"role": "user", "content": "Say hello to me."}])
    assert reply.usage.prompt_tokens == counted.input_tokens and 0 < reply.usage.completion_tokens <= 24
