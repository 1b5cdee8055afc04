"""The server on the GPU path end to end: a chat request through the official SDK."""
from __future__ import annotations

import sys

import openai
import pytest

from support.server_process import ServerProcess
from support.tiny import save_tiny_qwen3_5

pytestmark = pytest.mark.gpu


def test_chat_through_the_sdk_on_cuda(tmp_path):
    path = save_tiny_qwen3_5(tmp_path / "tiny-qwen")
    server = ServerProcess([sys.executable, "-m", "ninfer.server.cli", str(path), "--device", "cuda",
                            "--max-context", "512", "--temperature", "0"], tmp_path / "server.log", timeout=600)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        reply = client.chat.completions.create(model="tiny-qwen", max_tokens=16,
                                               messages=[{"role": "user", "content": "Hello world!"}])
        assert reply.usage.completion_tokens > 0
        assert reply.choices[0].finish_reason in ("stop", "length")
        streamed = client.chat.completions.create(model="tiny-qwen", max_tokens=16, stream=True,
                                                  messages=[{"role": "user", "content": "Hello world!"}])
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            reply.choices[0].message.content
        assert "captured decode CUDA graphs" in server.output()
    finally:
        server.stop()
