"""The scripted test model drives the real tokenizer, template and engine through HTTP."""
from __future__ import annotations

import openai
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import scripted_state


@pytest.fixture(scope="module")
def client():
    # thinking off: the scripts are answers, not reasoning
    state, loop = scripted_state({"capital": "The capital of France is Paris. 巴黎 🇫🇷"}, "Hello! How can I help?",
                                 "--no-thinking")
    loop.start()
    with LiveServer(create_app(state)) as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
    loop.stop()


def test_scripted_text_comes_back_exactly(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="scripted", messages=msgs)
    assert reply.choices[0].message.content == "The capital of France is Paris. 巴黎 🇫🇷"
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="scripted", messages=msgs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply.choices[0].message.content


def test_default_script_when_no_keyword(client):
    reply = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content == "Hello! How can I help?"
