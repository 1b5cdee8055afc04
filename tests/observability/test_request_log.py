"""--request-log-jsonl: one start and exactly one terminal per request (done, error, cancelled),
a lone request_rejected for refused ones, and no prompt text or API key anywhere in the file."""
from __future__ import annotations

import json
import time
from collections import defaultdict

import httpx
import pytest

from ninfer.server.app import create_app
from ninfer.server.observability.request_log import RequestLog, redact_argv
from support.live_server import LiveServer
from support.scripted import scripted_state
from support.waiting import wait_for

SECRET = "zebra-cobalt-7731"  # placed in prompts: must never reach the log
API_KEY = "key-9f8e7d6c5b4a"
LONG = "word " * 400


def events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def logged(tmp_path):
    path = tmp_path / "requests.jsonl"
    state, loop = scripted_state({"capital": "Paris."}, LONG, "--request-log-jsonl", str(path), "--api-key", API_KEY,
                                 "--max-concurrency", "1", "--pending-timeout-ms", "400")
    state.engine.loop.engine.model.step_delay = 0.01
    loop.start()
    with LiveServer(create_app(state)) as server:
        client = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        yield client, path, state
        client.close()
    loop.stop()


def chat(content: str, **extra) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": content}], **extra}


def test_every_request_has_one_start_and_one_terminal(logged):
    client, path, state = logged
    expected: dict[str, int] = defaultdict(int)  # event kind -> how many requests should end so

    # finished, aggregate and streamed, on two protocols
    assert client.post("/v1/chat/completions", json=chat(f"capital of {SECRET}?")).status_code == 200
    expected["request_done"] += 1
    with client.stream("POST", "/v1/chat/completions", json=chat(f"capital {SECRET}", stream=True)) as r:
        assert "".join(r.iter_text()).endswith("[DONE]\n\n")
    expected["request_done"] += 1
    body = client.post("/completion", json={"prompt": f"{SECRET} capital", "n_predict": 8}).json()
    assert body["content"] == "Paris."
    expected["request_done"] += 1
    anthropic_body = {"model": "any", "max_tokens": 16, "messages": [{"role": "user", "content": f"capital {SECRET}"}]}
    assert client.post("/v1/messages", json=anthropic_body).status_code == 200
    expected["request_done"] += 1

    # refused before the engine: a value out of range, bad field, no key
    assert client.post("/v1/chat/completions", json=chat(SECRET, temperature=-1)).status_code == 400
    assert client.post("/completion", json={"prompt": SECRET, "bogus": 1}).status_code == 400
    assert httpx.post(str(client.base_url) + "/v1/chat/completions", json=chat(SECRET)).status_code == 401
    bad_thinking = {**anthropic_body, "thinking": {"type": "enabled", "budget_tokens": 10}}
    assert client.post("/v1/messages", json=bad_thinking).status_code == 400
    expected["request_rejected"] += 4

    # cancelled: the client closes a stream part way; meanwhile one waits past the pending timeout
    with client.stream("POST", "/v1/chat/completions", json=chat(f"{SECRET} go", stream=True)) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        timed_out = client.post("/v1/chat/completions", json=chat(f"{SECRET} again"))
        assert timed_out.status_code == 503
    expected["request_error"] += 2
    n_requests = sum(expected.values())

    def terminals():
        return [e for e in events(path) if e["event"] in ("request_done", "request_error", "request_rejected")]

    assert wait_for(lambda: len(terminals()) >= n_requests, 10), events(path)
    time.sleep(0.2)  # nothing more may arrive
    log = events(path)
    text = path.read_text()
    assert SECRET not in text and API_KEY not in text

    assert log[0]["event"] == "server_start"
    assert "--api-key" not in json.dumps(log[0]["argv"]) or "<redacted>" in json.dumps(log[0]["argv"])
    assert log[0]["settings"]["api_key"] == "<redacted>"
    ids = {e["server_instance_id"] for e in log}
    assert len(ids) == 1

    per_request: dict[str, list[str]] = defaultdict(list)
    for e in log[1:]:
        if e["event"] != "throughput":
            per_request[e["request_id"]].append(e["event"])
    assert len(per_request) == n_requests
    kinds: dict[str, int] = defaultdict(int)
    for request_id, seq in per_request.items():
        if seq[0] == "request_rejected":
            assert seq == ["request_rejected"], (request_id, seq)
        else:
            assert len(seq) == 2 and seq[0] == "request_start", (request_id, seq)
            assert seq[1] in ("request_done", "request_error"), (request_id, seq)
        kinds[seq[-1]] += 1
    assert kinds == expected

    errors = sorted(e["kind"] for e in log if e["event"] == "request_error")
    assert errors == ["cancelled", "request_queue_timeout"]
    rejected = sorted((e["status"], e["error"].get("param") or "") for e in log if e["event"] == "request_rejected")
    # an unknown field's name is the client's, not the server's: logged as "*"
    assert rejected == [(400, ""), (400, "*"), (400, "temperature"), (401, "")]
    anthropic_rejected = [e for e in log if e["event"] == "request_rejected" and e["protocol"] == "anthropic"]
    assert anthropic_rejected[0]["error"]["type"] == "invalid_request_error"
    assert "message" not in anthropic_rejected[0]["error"]  # messages quote requests: never logged
    assert anthropic_rejected[0]["request_id"].startswith("req_")
    done = [e for e in log if e["event"] == "request_done"]
    assert {e["protocol"] for e in done} == {"openai_chat", "llamacpp", "anthropic"}
    for e in done:
        assert e["finish_reason"] == "stop"
        assert e["usage"]["completion_tokens"] > 0 and e["usage"]["prompt_tokens"] > 0
        t = e["timings_seconds"]
        assert 0 <= t["prepare"] <= t["ttft"] <= t["total"]
    starts = [e for e in log if e["event"] == "request_start"]
    assert {e["shape"].get("stream") for e in starts if e["protocol"] == "openai_chat"} == {None, True}
    assert all(e["sampling"]["n_stop_strings"] == 0 for e in starts)



def test_the_timings_add_up_and_the_queue_ends_where_the_engine_admits(tmp_path):
    """``queue`` is the wait before admission by the engine's clock, not until the admission is
    published (with the first step's outputs): a request admitted at once waits next to nothing
    while its first step takes 0.3 s, and prepare + queue + prefill (admission to first token)
    come to the time to first token."""
    path = tmp_path / "requests.jsonl"
    state, loop = scripted_state({}, "Hi.", "--request-log-jsonl", str(path))
    state.engine.loop.engine.model.step_delay = 0.3
    loop.start()
    try:
        with LiveServer(create_app(state)) as server, httpx.Client(base_url=server.base_url, timeout=60) as client:
            assert client.post("/completion", json={"prompt": "hello", "n_predict": 1}).status_code == 200
            wait_for(lambda: any(e["event"] == "request_done" for e in events(path)), timeout=10)
    finally:
        loop.stop()
    (done,) = [e for e in events(path) if e["event"] == "request_done"]
    t = done["timings_seconds"]
    assert 0 <= t["queue"] < 0.1 and t["prefill"] >= 0.3
    assert t["prepare"] + t["queue"] + t["prefill"] <= t["ttft"] <= t["prepare"] + t["queue"] + t["prefill"] + 0.1


def test_log_path_problems_fail_startup(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        scripted_state({}, "x", "--request-log-jsonl", str(tmp_path / "missing" / "log.jsonl"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    with pytest.raises(ValueError, match="model file"):
        RequestLog(model, str(model))


def test_argv_redaction():
    assert redact_argv(["m", "--api-key", "s3", "--port", "1", "--api-key=s4"]) == \
        ["m", "--api-key", "<redacted>", "--port", "1", "--api-key=<redacted>"]


def test_append_mode_and_flush(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"event":"earlier"}\n')
    log = RequestLog(path)
    log.write("server_start", n=1)
    assert [json.loads(x)["event"] for x in path.read_text().splitlines()] == ["earlier", "server_start"]
    log.close()


def test_a_returning_turn_logs_where_its_cached_tokens_came_from(tmp_path):
    path = tmp_path / "requests.jsonl"
    state, loop = scripted_state({}, "Paris.", "--request-log-jsonl", str(path), prefix_cache=True)
    loop.start()
    try:
        with LiveServer(create_app(state)) as server:
            messages = [{"role": "user", "content": "The capital of France? " * 20}]
            first = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                               json={"model": "scripted", "messages": messages}).json()
            messages += [first["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
            second = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                                json={"model": "scripted", "messages": messages}).json()
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert wait_for(lambda: sum(e["event"] == "request_done" for e in events(path)) == 2, 10)
    finally:
        loop.stop()
    done = [e["usage"] for e in events(path) if e["event"] == "request_done"]
    assert done[0]["cached_tokens"] == 0 and done[0]["reuse"] is None
    assert cached > 0 and done[1]["cached_tokens"] == cached and done[1]["prefill_tokens"] == done[1]["prompt_tokens"] - cached
    assert done[1]["reuse"] == {"tier": "gpu", "kind": "turn"}
