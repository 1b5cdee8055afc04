"""The README's serve command on a fresh checkout answers through the official OpenAI SDK."""
from __future__ import annotations

import re

import openai
import pytest

from support.server_process import ROOT, ServerProcess

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess([str(ROOT / "launchers" / "serve.sh")], tmp_path_factory.mktemp("serve") / "server.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")


def test_serve_announces_its_address(server):
    assert f"serving 'smollm2-135m-instruct' at http://127.0.0.1:{server.port}" in server.output()


def test_capital_of_france_in_english(client):
    reply = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=48
    )
    answer = reply.choices[0].message.content
    assert "Paris" in answer
    words = re.findall(r"[A-Za-z]+", answer)
    assert {"the", "of", "is"} & {w.lower() for w in words}, answer  # an English sentence
    assert reply.usage.prompt_tokens > 10 and 0 < reply.usage.completion_tokens <= 48
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_stream_equals_aggregate(client):
    kwargs = dict(model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=48)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_models_lists_the_public_id(client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]


def test_any_model_name_is_answered_by_the_served_model(client):
    """OpenAI clients send their own model names (``gpt-4o``); llama-server answers them all."""
    reply = client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=8, temperature=0)
    assert reply.model == "smollm2-135m-instruct" and reply.choices[0].message.content