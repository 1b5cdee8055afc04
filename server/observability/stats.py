"""Engine gauges read without locks, and the ``/stats`` JSON document (GPU telemetry: ``gpu.py``).

Gauges come from the scheduler's queues and the cache pools as the engine thread leaves them:
a list is copied in one C call and sizes are plain ints, so reading never blocks the engine and
at worst sees the state of a step boundary ago. ``/stats`` is what the monitor page polls every
second; it costs a few list copies and, at most once a second, an NVML query.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...engine.engine import LLMEngine
from ...engine.request import Status

if TYPE_CHECKING:
    from . import Observability

WINDOWS = (("1s", 1), ("10s", 10), ("60s", 60))


@dataclass
class Gauges:
    running: int = 0  # resident: prefilling + decoding
    prefilling: int = 0
    decode_ready: int = 0
    waiting: int = 0  # never admitted yet
    paused: int = 0  # preempted, waiting to resume
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    kv_page_size: int = 0
    state_slots_used: int = 0
    state_slots_total: int = 0
    host_cache_bytes_used: int = 0
    host_cache_bytes_total: int = 0


def read_gauges(engine: LLMEngine) -> Gauges:
    running = list(engine.scheduler.running)
    waiting = list(engine.scheduler.waiting)
    paused = sum(r.status is Status.PAUSED for r in waiting)
    g = Gauges(
        running=len(running),
        prefilling=sum(r.status is Status.PREFILL for r in running),
        decode_ready=sum(r.status is Status.DECODE for r in running),
        waiting=len(waiting) - paused,
        paused=paused,
    )
    caches = engine.caches
    if caches.kv is not None:
        g.kv_pages_total = caches.kv.num_pages
        g.kv_pages_used = caches.kv.num_used
        g.kv_page_size = caches.kv.page_size
    if caches.states is not None:
        g.state_slots_total = caches.states.num_slots
        g.state_slots_used = caches.states.num_used
    g.host_cache_bytes_used = caches.host_bytes_used
    g.host_cache_bytes_total = caches.host_cache_bytes
    return g


def build_stats(hub: "Observability") -> dict[str, Any]:
    engine = hub.engine
    counters = engine.counters
    sched = engine.scheduler.stats
    g = read_gauges(engine)
    now = time.monotonic()
    throughput = {}
    for label, seconds in WINDOWS:
        prefill, generated = counters.window(seconds, now)
        throughput[label] = {"prefill_tps": prefill / seconds, "decode_tps": generated / seconds}
    rounds = counters.spec_rounds
    p50 = hub.monitor.ttft_p50()
    last = hub.monitor.last_ttft()
    return {
        "model": hub.state.model_id,
        "uptime_s": now - hub.started,
        "healthy": hub.state.engine.healthy,
        "throughput": throughput,
        "requests": {"running": g.running, "waiting": g.waiting, "paused": g.paused},
        "memory": {
            "kv_pages_used": g.kv_pages_used,
            "kv_pages_total": g.kv_pages_total,
            "kv_page_size": g.kv_page_size,
            "state_slots_used": g.state_slots_used,
            "state_slots_total": g.state_slots_total,
            "host_cache_bytes_used": g.host_cache_bytes_used,
            "host_cache_bytes_total": g.host_cache_bytes_total,
        },
        "cache": {"prompt_tokens_total": counters.prompt_tokens, "cached_tokens_total": counters.cached_tokens},
        "ttft_ms": {"last": None if last is None else last * 1000.0, "p50_60s": None if p50 is None else p50 * 1000.0},
        "preemptions": {"snapshot": sched.preempted_snapshot, "replay": sched.preempted_replay,
                        "restored": sched.restored},
        "speculative": {
            "enabled": counters.spec_enabled,
            "drafted": counters.spec_draft_tokens,
            "accepted": counters.spec_accepted_tokens,
            # the share of rounds whose draft at position i was accepted
            "acceptance_by_position": [n / rounds for n in counters.spec_accepted_by_position] if rounds else [],
        },
        "recent": list(hub.monitor.recent),  # newest first
        "gpu": hub.gpu.read(),
    }
