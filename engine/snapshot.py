"""What the gateway reads of the engine: counters, queue and pool gauges, the resident lanes.

``take_snapshot(engine)`` reads them without locks, as the engine thread leaves them: a list is
copied in one C call and sizes are plain ints, so reading never blocks the engine and at worst
sees the state of a step boundary ago. With the engine in this process the gateway takes one
whenever it asks (``EngineLoop.view``); with the engine in a process of its own (``process.py``)
the engine sends them, and the gateway reads the latest one it got. A snapshot pickles small:
no prompt, no output, no tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .request import Status
from .sampling_params import SamplingParams
from .scheduler import SchedulerStats
from .stats import EngineCounters


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
    host_cache_bytes_used: int = 0  # paused requests' snapshots
    host_cache_bytes_total: int = 0  # the budget of the snapshots and the host checkpoints together
    prefix_checkpoints: int = 0  # on the device now (each with a state slot of its own, on hybrid models)
    prefix_checkpoints_max: int = 0
    prefix_pages: int = 0  # KV pages the checkpoints hold (some shared with running requests)
    prefix_host_checkpoints: int = 0  # in host memory now
    prefix_host_kv_bytes: int = 0  # host memory they hold: KV rows, GDN states
    prefix_host_state_bytes: int = 0
    prefix_hits_gpu: int = 0  # requests that went on from a device checkpoint, from a host one (counts)
    prefix_hits_host: int = 0
    prefix_evicted_host: int = 0  # device checkpoints moved to host memory, dropped (counts)
    prefix_evicted_dropped: int = 0
    prefix_copy_waits: int = 0  # the GPU told to wait for a copy to host in flight (counts)


class Lane(NamedTuple):
    """One resident request, as counts: what ``/slots`` shows of it."""

    request_id: str
    prefilling: bool
    prompt_tokens: int
    prompt_computed: int  # prompt tokens in the cache
    output_tokens: int
    params: SamplingParams
    arrival: float  # time.monotonic() at submission


@dataclass
class EngineSnapshot:
    counters: EngineCounters
    scheduler: SchedulerStats
    gauges: Gauges
    lanes: list[Lane] = field(default_factory=list)  # resident requests in admission order


def take_snapshot(engine) -> EngineSnapshot:
    """The engine's counters (the live object: its fields are whole values), scheduler stats,
    gauges and lanes, read from another thread without locks."""
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
    if caches.prefix is not None:
        g.prefix_checkpoints = len(caches.prefix)
        g.prefix_checkpoints_max = caches.prefix.max_entries
        g.prefix_pages = len(caches.prefix.pages_held())
        g.prefix_host_checkpoints = caches.prefix.num_host
        g.prefix_host_kv_bytes = caches.prefix.host_kv_bytes
        g.prefix_host_state_bytes = caches.prefix.host_state_bytes
        g.prefix_hits_gpu = caches.prefix.hits_gpu
        g.prefix_hits_host = caches.prefix.hits_host
        g.prefix_evicted_host = caches.prefix.evicted_host
        g.prefix_evicted_dropped = caches.prefix.evicted_dropped
        g.prefix_copy_waits = caches.prefix.copy_waits
    lanes = [Lane(r.request_id, r.status is Status.PREFILL, len(r.prompt_ids), min(r.num_computed, len(r.prompt_ids)),
                  len(r.output_ids), r.params, r.arrival) for r in running]
    return EngineSnapshot(engine.counters, engine.scheduler.stats, g, lanes)
