"""``GET /metrics``: Prometheus text format through ``prometheus-client``, families ``ninfer_*``.

Engine counters and gauges are collected at scrape time from plain ints the engine thread leaves
behind (``engine/stats.py``, the scheduler's stats, the cache pools); nothing waits for the engine
and a scrape resets nothing. Request outcomes and the latency histograms are recorded by the
gateway (``monitor.py``). Each app has its own registry, so several servers may share a process.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


if TYPE_CHECKING:
    from . import Observability

prometheus_client.disable_created_metrics()  # no *_created series: they double the output for nothing

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
OUTCOMES = ("done", "error", "cancelled", "rejected")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, hub: "Observability") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("ninfer_requests", "Generation requests by outcome: done, error (engine error or "
                                "timeout), cancelled (client left), rejected (refused before the engine)",
                                ["outcome"], registry=self.registry)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.failures = Counter("ninfer_response_failures", "Generation requests that passed validation and then "
                                "got no answer: engine errors, queue timeouts, overload (validation failures and "
                                "token counting excluded)", registry=self.registry)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "From HTTP arrival to the first output token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.duration = Histogram("ninfer_request_duration_seconds",
                                  "From HTTP arrival to the end, for finished and cancelled requests",
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.queue = Histogram("ninfer_request_queue_seconds", "From submission to first admission",
                               buckets=QUEUE_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(hub))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, hub: "Observability") -> None:
        self.hub = hub

    def describe(self) -> list[Metric]:
        return []  # collected fresh at each scrape

    def collect(self) -> Iterator[Metric]:
        hub = self.hub
        snap = hub.view()
        c, s, g = snap.counters, snap.scheduler, snap.gauges
        config = hub.state.engine.config

        info = GaugeMetricFamily("ninfer_model_info", "The served model", labels=["model", "family", "device", "dtype"])
        info.add_metric([hub.state.model_id, hub.loop.model_config.family, config.device,
                         str(config.dtype).removeprefix("torch.")], 1)
        yield info
        yield _gauge("ninfer_engine_ready", "1 while the engine accepts work, 0 after an engine failure",
                     1 if hub.state.engine.healthy else 0)
        yield _gauge("ninfer_max_concurrency", "Resident execution lanes", config.max_concurrency)
        yield _gauge("ninfer_max_context_tokens", "Prompt + output tokens per request", config.max_context)

        yield _gauge("ninfer_requests_running", "Resident requests (prefilling + decoding)", g.running)
        yield _gauge("ninfer_requests_prefilling", "Resident requests computing their prompt", g.prefilling)
        yield _gauge("ninfer_requests_decode_ready", "Resident requests generating tokens", g.decode_ready)
        yield _gauge("ninfer_requests_waiting", "Requests not admitted yet", g.waiting)
        yield _gauge("ninfer_requests_paused", "Requests paused under memory pressure", g.paused)

        yield _counter("ninfer_prompt_tokens", "Prompt tokens, counted once at first admission", c.prompt_tokens)
        yield _counter("ninfer_prompt_tokens_cached", "Prompt tokens reused from cache", c.cached_tokens)
        yield _counter("ninfer_prefill_tokens", "Prompt tokens computed (cache hits excluded)", c.prefill_tokens)
        yield _counter("ninfer_replayed_tokens", "Tokens recomputed to rebuild dropped state", c.replayed_tokens)
        yield _counter("ninfer_generation_tokens", "Committed output tokens", c.generation_tokens)
        yield _counter("ninfer_decode_tokens", "Committed output tokens after each request's first",
                       c.decode_tokens)
        yield _counter("ninfer_images_encoded", "Images run through the vision tower (--vision)", c.images_encoded)

        yield _counter("ninfer_spec_decode_rounds", "Speculative decoding rounds", c.spec_rounds)
        yield _counter("ninfer_spec_decode_draft_tokens", "Drafted tokens", c.spec_draft_tokens)
        yield _counter("ninfer_spec_decode_accepted_tokens", "Accepted drafted tokens", c.spec_accepted_tokens)
        yield _counter("ninfer_spec_decode_fallback_steps", "Steps decoded without drafts", c.spec_fallback_steps)

        yield _counter("ninfer_preemptions", "Requests paused under memory pressure",
                       s.preempted_snapshot + s.preempted_replay)
        yield _counter("ninfer_snapshot_restores", "Paused requests resumed from a host snapshot", s.restored)
        yield _counter("ninfer_replay_restores", "Paused requests resumed by replaying their tokens",
                       s.replay_restored)

        yield _gauge("ninfer_device_kv_used_pages", "KV cache pages in use", g.kv_pages_used)
        yield _gauge("ninfer_device_kv_capacity_pages", "KV cache pages in the pool", g.kv_pages_total)
        yield _gauge("ninfer_device_state_used_slots", "Recurrent-state slots in use", g.state_slots_used)
        yield _gauge("ninfer_prefix_checkpoints", "Prefix checkpoints kept on the device", g.prefix_checkpoints)
        yield _gauge("ninfer_prefix_checkpoint_kv_pages", "KV cache pages the prefix checkpoints hold", g.prefix_pages)
        yield _gauge("ninfer_prefix_host_checkpoints", "Prefix checkpoints kept in host memory",
                     g.prefix_host_checkpoints)
        host = GaugeMetricFamily("ninfer_prefix_host_checkpoint_bytes",
                                 "Host memory the host prefix checkpoints hold: KV rows, recurrent states",
                                 labels=["kind"])
        host.add_metric(["kv"], g.prefix_host_kv_bytes)
        host.add_metric(["state"], g.prefix_host_state_bytes)
        yield host
        hits = CounterMetricFamily("ninfer_prefix_hits", "Requests that went on from a prefix checkpoint, by the "
                                   "tier it was in (host: copied back to the device first)", labels=["tier"])
        hits.add_metric(["gpu"], g.prefix_hits_gpu)
        hits.add_metric(["host"], g.prefix_hits_host)
        yield hits
        evicted = CounterMetricFamily("ninfer_prefix_evictions", "Device prefix checkpoints evicted, by where they "
                                      "went (host memory, or dropped)", labels=["to"])
        evicted.add_metric(["host"], g.prefix_evicted_host)
        evicted.add_metric(["dropped"], g.prefix_evicted_dropped)
        yield evicted
        yield _counter("ninfer_prefix_copy_waits", "Times the GPU waited for a checkpoint's copy to host memory "
                       "to finish, to reuse its pages or state slot", g.prefix_copy_waits)
        yield _gauge("ninfer_device_state_capacity_slots", "Recurrent-state slots in the pool", g.state_slots_total)
        yield _gauge("ninfer_host_context_used_bytes", "Host memory holding paused requests' state",
                     g.host_cache_bytes_used)
        yield _gauge("ninfer_host_context_capacity_bytes", "Host memory budget for paused requests' state and "
                     "host prefix checkpoints together",
                     g.host_cache_bytes_total)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
