"""Codex CLI from the npm registry against the README's server on the embedded model.

Codex talks only the Responses API: every request is stateless (``store: false``), asks for
sealed reasoning (``include: ["reasoning.encrypted_content"]``) and declares a hosted web_search
tool beside its function tools. Its instructions and tools make a prompt of about 4,600 tokens,
which fits the embedded model's 8,192-token context. The server's own flags bound the time:
``--default-max-tokens`` caps the answer (Codex sets no limit), and ``--temperature 0`` makes the
small model's answer one that ends well inside that cap (a cut answer is ``incomplete``, which
Codex reports as an error).
"""
from __future__ import annotations

import json
import stat
import subprocess

import httpx
import pytest

from support.npm_clients import CODEX, npm_install, readme_server

pytestmark = pytest.mark.slow

KEY = "codex-test-key"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def codex(tmp_path_factory):
    return npm_install(CODEX, "codex", tmp_path_factory.mktemp("npm"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("codex-server")
    log, key = tmp / "requests.jsonl", tmp / "reasoning.key"
    proc = readme_server(tmp / "server.log", "--api-key", KEY, "--temperature", "0", "--default-max-tokens", "512",
                         "--reasoning-key-file", str(key), "--request-log-jsonl", str(log))
    yield proc, log, key
    proc.stop()


def logged(log, event: str) -> list[dict]:
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == event]


def codex_home(tmp_path, base_url: str):
    """A CODEX_HOME whose config.toml adds one model provider, the server; all else default."""
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(f'''model = "{MODEL}"
model_provider = "ninfer"

[model_providers.ninfer]
name = "NInfer"
base_url = "{base_url}/v1"
env_key = "NINFER_API_KEY"
wire_api = "responses"
''')
    return home


def test_codex_exec_completes_a_turn(codex, server, tmp_path):
    proc, log, key = server
    project = tmp_path / "project"  # a user runs Codex inside their repository
    project.mkdir()
    (project / "README.md").write_text("A small project.\n")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    env = codex.env(tmp_path / "user", CODEX_HOME=str(codex_home(tmp_path, proc.base_url)), NINFER_API_KEY=KEY)
    (tmp_path / "user").mkdir()
    done = subprocess.run([str(codex.bin), "exec", "Say hello"], cwd=project, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"codex exited {done.returncode}:\n{done.stderr[-4000:]}\n{proc.output()}"

    # every request Codex made was served over the Responses API, none refused
    assert [r["error"] for r in logged(log, "request_rejected")] == []
    (served,) = logged(log, "request_done")
    assert served["protocol"] == "openai_responses" and served["finish_reason"] == "stop"
    usage = served["usage"]
    # stdout is the model's answer: as many tokens as the server generated (its eos aside, and
    # allowing for retokenization), and stderr reports the usage the server returned
    answer = done.stdout.strip()
    ids = httpx.post(proc.base_url + "/tokenize", json={"content": answer},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    assert answer and usage["completion_tokens"] - 3 <= len(ids) <= usage["completion_tokens"]
    assert f"{usage['prompt_tokens'] + usage['completion_tokens']:,}" in done.stderr
    # the hosted web_search tool was left out, with one warning naming only its type
    warnings = [line for line in proc.log_path.read_text().splitlines() if "hosted tools left out" in line]
    assert len(warnings) == 1 and warnings[0].endswith("left out of the prompt: web_search")
    # reasoning sealing is ready: its key was made private on first start
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert httpx.get(proc.base_url + "/health").status_code == 200
