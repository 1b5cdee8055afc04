"""The ``/stats`` JSON document (GPU telemetry: ``gpu.py``), from the engine's snapshot
(``engine/snapshot.py``: counters, gauges, lanes, read without locks). ``/stats`` is what the
monitor page polls every second; it costs a snapshot and, at most once a second, an NVML query.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import Observability

WINDOWS = (("1s", 1), ("10s", 10), ("60s", 60))


def build_stats(hub: "Observability") -> dict[str, Any]:
    snap = hub.view()
    counters, sched, g = snap.counters, snap.scheduler, snap.gauges
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
        "cache": {"prompt_tokens_total": counters.prompt_tokens, "cached_tokens_total": counters.cached_tokens,
                  "checkpoints": g.prefix_checkpoints, "checkpoints_max": g.prefix_checkpoints_max,
                  "checkpoint_kv_pages": g.prefix_pages, "host_checkpoints": g.prefix_host_checkpoints,
                  "host_checkpoint_kv_bytes": g.prefix_host_kv_bytes,
                  "host_checkpoint_state_bytes": g.prefix_host_state_bytes,
                  "hits": {"gpu": g.prefix_hits_gpu, "host": g.prefix_hits_host},
                  "evictions": {"host": g.prefix_evicted_host, "dropped": g.prefix_evicted_dropped},
                  "copy_waits": g.prefix_copy_waits},
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
