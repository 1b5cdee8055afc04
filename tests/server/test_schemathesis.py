"""The OpenAPI document at /openapi.json, and a bounded schemathesis run over it against a live
server: whatever body, query or path the fuzzer derives from the document, no answer is a 5xx."""
from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from ninfer.server.app import create_app
from support.live_server import LiveServer
from support.scripted import scripted_state

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RUN_S = 60  # schemathesis' budget for the whole run (coverage, then fuzzing until it is spent)


@pytest.fixture(scope="module")
def live():
    # a short context and default output keep every generated request quick on a CPU
    state, loop = scripted_state({}, "Hello", "--api-key", KEY, "--max-context", "512",
                                 "--default-max-tokens", "8")
    loop.start()
    with LiveServer(create_app(state)) as server:
        yield server
    loop.stop()


def test_the_document_describes_the_api(live):
    assert httpx.get(live.base_url + "/openapi.json").status_code == 401  # behind the key, as the API
    doc = httpx.get(live.base_url + "/openapi.json", headers=AUTH).json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"bearer": []}] and "security" not in doc["paths"]["/health"]["get"]
    assert set(chat["responses"]) == {"200", "400", "401"}  # no 422: invalid bodies get 400
    body = doc["components"]["schemas"][chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                                        .rsplit("/", 1)[-1]]
    assert "messages" in body["required"] and {"temperature", "tools", "stream"} <= body["properties"].keys()
    assert body["properties"]["model"]["anyOf"][0]["examples"] == ["scripted"]  # any name is answered
    generation = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/completion"}
    assert all("requestBody" in doc["paths"][p]["post"] for p in generation)


def test_no_generated_request_gets_a_server_error(live, tmp_path):
    command = [sys.executable, "-m", "schemathesis.cli", "run", live.base_url + "/openapi.json",
               "--header", f"Authorization: Bearer {KEY}", "--checks", "not_a_server_error",
               "--phases", "examples,coverage,fuzzing", "--max-examples", "20", "--max-time", str(RUN_S),
               "--seed", "1", "--workers", "1", "--request-timeout", "30", "--generation-database", "none",
               "--no-color"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_S + 90)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-8000:]
    paths = httpx.get(live.base_url + "/openapi.json", headers=AUTH).json()["paths"]
    tested = re.search(r"Tested: (\d+)", report)
    cases = re.search(r"(\d+) generated, (\d+) passed", report)
    assert tested and int(tested.group(1)) == sum(map(len, paths.values())), report[-4000:]  # every operation
    assert cases and int(cases.group(1)) == int(cases.group(2)) >= 500, report[-4000:]
    assert httpx.get(live.base_url + "/health").status_code == 200
