"""Claude Code, the npm CLI, completes a turn against the README's server on the embedded model.

``claude -p "Say hello"`` runs with only ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY`` set, so
it sends what it always sends: ``POST /v1/messages?beta=true`` with its beta headers, a
~6,000-character system prompt, 25 tools, adaptive thinking, ``context_management`` and
``max_tokens: 64000``, streamed (SmolLM2's template leaves the tools out: about 3,000 prompt
tokens). A reply cut at ``max_tokens`` or at the context window makes it ask for a continuation
three times and then exit 1, so the turn completes only when the model ends it. The server flags
see to that: Claude Code puts a system message after the user's, and SmolLM2, given it last,
comments on that list without end; ``--chat-template`` gives it SmolLM2's format with the system
messages joined at the start, and greedy decoding with ``--repetition-penalty 1.1`` ends its
greeting. ``--max-context 4096`` bounds a turn that would run on.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from support.npm_clients import CLAUDE_CODE, npm_install, readme_server

pytestmark = pytest.mark.slow
KEY = "sk-claude-code-test"
TEMPLATE = Path(__file__).with_name("smollm2_system_first.jinja")
SERVER_FLAGS = ("--api-key", KEY, "--max-context", "4096", "--temperature", "0", "--repetition-penalty", "1.1",
                "--chat-template", str(TEMPLATE))
ACCESS_LINE = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')


@pytest.fixture(scope="module")
def claude(tmp_path_factory):
    return npm_install(CLAUDE_CODE, "claude", tmp_path_factory.mktemp("claude-code"))


def test_claude_code_says_hello(claude, tmp_path):
    log = tmp_path / "requests.jsonl"
    server = readme_server(tmp_path / "server.log", *SERVER_FLAGS, "--request-log-jsonl", str(log))
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    try:
        env = claude.env(tmp_path / "home", ANTHROPIC_BASE_URL=server.base_url, ANTHROPIC_API_KEY=KEY)
        done = subprocess.run([str(claude.bin), "-p", "Say hello"], cwd=tmp_path / "work", env=env,
                              capture_output=True, text=True, timeout=600)
        answer = done.stdout.strip()
        tokens = httpx.post(server.base_url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                            json={"content": answer}, timeout=30).json()["tokens"]
    finally:
        server.stop()
    output = server.log_path.read_text(errors="replace")
    assert done.returncode == 0, \
        f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}\nserver:\n{output[-3000:]}"

    events = [json.loads(line) for line in log.read_text().splitlines()]
    started = [e for e in events if e["event"] == "request_start"]
    finished = [e for e in events if e["event"] == "request_done"]
    assert [e["event"] for e in events if e["event"] in ("request_rejected", "request_error")] == []
    assert started and [e["request_id"] for e in finished] == [e["request_id"] for e in started]
    assert {e["protocol"] for e in started} == {"anthropic"}
    assert finished[-1]["finish_reason"] == "stop"  # the model ended its turn
    # what Claude Code printed is the model's answer: as many tokens as it generated (its last, eos, aside)
    assert answer and abs(len(tokens) - (finished[-1]["usage"]["completion_tokens"] - 1)) <= 2, answer

    requests = ACCESS_LINE.findall(output)
    assert any(method == "POST" and status == "200" for method, _, status in requests), output[-3000:]
    assert [r for r in requests if int(r[2]) >= 400] == []
