"""/metrics (Prometheus text) and /stats (monitor JSON) against the scripted model over HTTP."""
from __future__ import annotations

import logging
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from ninfer.engine.engine import LLMEngine
from ninfer.server.app import create_app
from support.scripted import scripted_state

ANSWER = "The capital of France is Paris."
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
KEY = {"Authorization": "Bearer k3y"}


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state({"capital": ANSWER}, "Hello!", "--api-key", "k3y")
    loop.start()
    with TestClient(create_app(state), headers=KEY) as client:
        yield client, state
    loop.stop()


@pytest.fixture
def client(served):
    return served[0]


def scrape(client) -> dict[str, float]:
    """Every sample as ``name{label="v",...}`` -> value, after a strict parse."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(before: dict, after: dict, name: str) -> float:
    return after[name] - before.get(name, 0.0)


def test_metrics_need_the_key_and_name_the_seed_families(served):
    client, state = served
    with TestClient(create_app(state)) as anonymous:
        assert anonymous.get("/metrics").status_code == 401
    m = scrape(client)
    for name in ["ninfer_engine_ready", "ninfer_requests_running", "ninfer_requests_waiting", "ninfer_requests_paused",
                 "ninfer_prompt_tokens_total", "ninfer_prompt_tokens_cached_total", "ninfer_prefill_tokens_total",
                 "ninfer_generation_tokens_total", "ninfer_decode_tokens_total", "ninfer_preemptions_total",
                 "ninfer_snapshot_restores_total", "ninfer_replay_restores_total",
                 "ninfer_spec_decode_draft_tokens_total", "ninfer_spec_decode_accepted_tokens_total",
                 "ninfer_device_kv_used_pages", "ninfer_device_kv_capacity_pages",
                 "ninfer_device_state_used_slots", "ninfer_device_state_capacity_slots",
                 "ninfer_time_to_first_token_seconds_count", "ninfer_request_duration_seconds_count",
                 "ninfer_request_queue_seconds_count", 'ninfer_requests_total{outcome="done"}',
                 "ninfer_response_failures_total",
                 "ninfer_max_concurrency", "ninfer_max_context_tokens"]:
        assert name in m, name
    assert m["ninfer_engine_ready"] == 1
    assert m["ninfer_spec_decode_draft_tokens_total"] == m["ninfer_spec_decode_accepted_tokens_total"] == 0
    assert m["ninfer_max_concurrency"] == state.engine.config.max_concurrency


def test_counters_move_by_exactly_one_request(client):
    before = scrape(client)
    usage = client.post("/v1/chat/completions", json=CHAT).json()["usage"]
    after = scrape(client)
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert completion > 3
    assert delta(before, after, "ninfer_prompt_tokens_total") == prompt
    assert delta(before, after, "ninfer_prompt_tokens_cached_total") == cached
    assert delta(before, after, "ninfer_prefill_tokens_total") == prompt - cached
    assert delta(before, after, "ninfer_generation_tokens_total") == completion
    assert delta(before, after, "ninfer_decode_tokens_total") == completion - 1
    assert delta(before, after, 'ninfer_requests_total{outcome="done"}') == 1
    for hist in ("time_to_first_token", "request_duration", "request_queue"):
        assert delta(before, after, f"ninfer_{hist}_seconds_count") == 1
        assert delta(before, after, f"ninfer_{hist}_seconds_sum") > 0
    assert after["ninfer_requests_running"] == after["ninfer_requests_waiting"] == 0


def test_rejected_requests_are_counted(client):
    before = scrape(client)
    assert client.post("/v1/chat/completions", json={**CHAT, "temperature": -1}).status_code == 400
    after = scrape(client)
    assert delta(before, after, 'ninfer_requests_total{outcome="rejected"}') == 1
    assert delta(before, after, "ninfer_prompt_tokens_total") == 0
    assert delta(before, after, "ninfer_response_failures_total") == 0  # a validation failure is not one


def test_stats_shape_and_agreement_with_metrics(client, served):
    state = served[1]
    client.post("/completion", json={"prompt": "capital", "n_predict": 16})
    time.sleep(1.05)  # the throughput windows count whole seconds
    stats = client.get("/stats").json()
    m = scrape(client)
    assert stats["model"] == "scripted" and stats["healthy"] is True and stats["uptime_s"] > 0
    assert set(stats["throughput"]) == {"1s", "10s", "60s"}
    assert all(set(w) == {"prefill_tps", "decode_tps"} for w in stats["throughput"].values())
    # everything this server generated happened within the last minute
    assert stats["throughput"]["60s"]["decode_tps"] * 60 == pytest.approx(m["ninfer_generation_tokens_total"])
    assert stats["throughput"]["60s"]["prefill_tps"] * 60 == pytest.approx(m["ninfer_prefill_tokens_total"])
    assert stats["cache"] == {"prompt_tokens_total": m["ninfer_prompt_tokens_total"],
                              "cached_tokens_total": m["ninfer_prompt_tokens_cached_total"],
                              "checkpoints": m["ninfer_prefix_checkpoints"], "checkpoints_max": 0,
                              "checkpoint_kv_pages": m["ninfer_prefix_checkpoint_kv_pages"],
                              "host_checkpoints": m["ninfer_prefix_host_checkpoints"],
                              "host_checkpoint_kv_bytes": m['ninfer_prefix_host_checkpoint_bytes{kind="kv"}'],
                              "host_checkpoint_state_bytes": m['ninfer_prefix_host_checkpoint_bytes{kind="state"}'],
                              "hits": {"gpu": m['ninfer_prefix_hits_total{tier="gpu"}'],
                                       "host": m['ninfer_prefix_hits_total{tier="host"}']},
                              "evictions": {"host": m['ninfer_prefix_evictions_total{to="host"}'],
                                            "dropped": m['ninfer_prefix_evictions_total{to="dropped"}']},
                              "copy_waits": m["ninfer_prefix_copy_waits_total"]}  # scripted: off
    assert stats["requests"] == {"running": m["ninfer_requests_running"], "waiting": m["ninfer_requests_waiting"],
                                 "paused": m["ninfer_requests_paused"]}
    mem = stats["memory"]
    assert mem["kv_pages_used"] == m["ninfer_device_kv_used_pages"]
    assert mem["kv_pages_total"] == m["ninfer_device_kv_capacity_pages"]
    assert mem["state_slots_total"] == m["ninfer_device_state_capacity_slots"]
    assert mem["host_cache_bytes_total"] == m["ninfer_host_context_capacity_bytes"]
    assert set(mem) == {"kv_pages_used", "kv_pages_total", "kv_page_size", "state_slots_used", "state_slots_total",
                        "host_cache_bytes_used", "host_cache_bytes_total"}
    assert stats["preemptions"]["snapshot"] + stats["preemptions"]["replay"] == m["ninfer_preemptions_total"]
    assert stats["preemptions"]["restored"] == m["ninfer_snapshot_restores_total"]
    assert stats["speculative"] == {"enabled": False, "drafted": 0, "accepted": 0, "acceptance_by_position": []}
    assert stats["ttft_ms"]["last"] > 0 and stats["ttft_ms"]["p50_60s"] > 0
    assert isinstance(stats["gpu"], list)
    newest = stats["recent"][0]
    assert newest["id"].startswith("cmpl-") and newest["finish_reason"] == "stop"
    assert newest["output_tokens"] == len(state.tokenizer.encode(ANSWER)) + 1  # + the eos token
    assert newest["prompt_tokens"] == 1 and newest["cached_tokens"] == 0
    assert newest["ttft_ms"] > 0 and newest["ended_at"] <= time.time()
    assert set(newest) == {"id", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_ms", "decode_tps",
                           "finish_reason", "ended_at"}
    assert len(stats["recent"]) == m['ninfer_requests_total{outcome="done"}']


def test_stats_is_cheap(client):
    client.get("/stats")
    started = time.perf_counter()
    for _ in range(50):
        client.get("/stats")
    assert (time.perf_counter() - started) / 50 < 0.02


def test_throughput_line_on_stderr(caplog):
    state, loop = scripted_state({"capital": ANSWER}, "Hello!", "--log-stats-interval-ms", "100")
    loop.start()
    try:
        with caplog.at_level(logging.INFO, logger="ninfer.stats"), TestClient(create_app(state)) as client:
            client.post("/v1/chat/completions", json=CHAT)
            time.sleep(0.35)
    finally:
        loop.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "ninfer.stats"]
    assert any(line.startswith("throughput: ") and "tok/s" in line for line in lines), lines


def test_engine_failure_leaves_metrics_readable(monkeypatch):
    state, loop = scripted_state({}, "Hello!")
    loop.on_failure = lambda exc: None

    def broken_step(self):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(LLMEngine, "step", broken_step)
    loop.start()
    try:
        with TestClient(create_app(state)) as client:
            assert scrape(client)["ninfer_engine_ready"] == 1
            assert client.post("/v1/chat/completions", json=CHAT).status_code == 503
            m = scrape(client)
            assert m["ninfer_engine_ready"] == 0
            assert m['ninfer_requests_total{outcome="error"}'] + m['ninfer_requests_total{outcome="rejected"}'] == 1
            assert m["ninfer_response_failures_total"] == 1
            assert client.get("/stats").json()["healthy"] is False
    finally:
        loop.stop()
