"""Observability: ``/metrics`` (Prometheus), ``/stats`` (JSON for the monitor), the JSONL request
log and the periodic throughput line on stderr.

``setup(args, state)`` (at startup, from ``bootstrap``) builds the ``Observability`` hub, opens the
request log (a bad path fails startup) and attaches the request monitor to the engine;
``install(app, state)`` (from ``create_app``) adds the tracing middleware, the routes and the
throughput reporter's lifespan hooks.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ...engine.snapshot import EngineSnapshot

from .metrics import CONTENT_TYPE, Metrics
from .monitor import RequestMonitor
from .request_log import RequestLog, redact_argv
from .gpu import GpuTelemetry
from .log_filter import RouteNameMiddleware
from .stats import build_stats
from .trace import TraceMiddleware

if TYPE_CHECKING:
    from ..state import ServerState

log = logging.getLogger("ninfer.stats")

DEFAULT_STATS_INTERVAL_MS = 5000


class Observability:
    def __init__(self, state: "ServerState", request_log: RequestLog | None = None,
                 stats_interval_ms: int = DEFAULT_STATS_INTERVAL_MS) -> None:
        self.state = state
        self.loop = state.engine.loop  # read only, through view(): counters, queues and pools
        self.started = time.monotonic()
        self.log = request_log
        self.stats_interval_s = stats_interval_ms / 1000.0
        self.metrics = Metrics(self)
        self.monitor = RequestMonitor(self)
        self.gpu = GpuTelemetry()
        state.engine.observer = self.monitor

    def view(self) -> EngineSnapshot:
        """The engine's counters, gauges and lanes now (or as its process last sent them)."""
        return self.loop.view()

    def server_start(self, settings: dict[str, Any], argv: list[str]) -> None:
        if self.log is None:
            return
        g, model = self.view().gauges, self.loop.model_config
        config = self.state.engine.config
        self.log.write(
            "server_start",
            model_id=self.state.model_id,
            family=model.family,
            model_type=model.model_type,
            settings=settings,
            argv=redact_argv(argv, secrets=(self.state.api_key,)),
            engine={
                "max_context": config.max_context, "max_concurrency": config.max_concurrency,
                "prefill_chunk": config.prefill_chunk, "max_pending": config.max_pending,
                "pending_timeout_s": config.pending_timeout_s, "device": config.device,
                "dtype": str(config.dtype).removeprefix("torch."),
            },
            memory={
                "kv_pages_total": g.kv_pages_total, "kv_page_size": g.kv_page_size,
                "state_slots_total": g.state_slots_total, "host_cache_bytes_total": g.host_cache_bytes_total,
            },
            sampling_defaults=vars(self.state.sampling),
            gpu=self.gpu.read(),
        )


def setup(args: argparse.Namespace, state: "ServerState") -> Observability:
    path = getattr(args, "request_log_jsonl", None)
    request_log = RequestLog(path, getattr(args, "model", None)) if path else None
    interval = getattr(args, "log_stats_interval_ms", DEFAULT_STATS_INTERVAL_MS)
    if interval is None or interval < 0:
        raise ValueError(f"--log-stats-interval-ms must be >= 0, got {interval}")
    hub = Observability(state, request_log, interval)
    settings = {k: ("<redacted>" if k == "api_key" and v else v) for k, v in vars(args).items()}
    hub.server_start(settings, sys.argv[1:])
    return hub


router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    hub: Observability = request.app.state.ninfer.observability
    return Response(hub.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/stats")
async def stats(request: Request) -> JSONResponse:
    hub: Observability = request.app.state.ninfer.observability
    return JSONResponse(build_stats(hub))


def install(app: FastAPI, state: "ServerState") -> None:
    hub: Observability | None = state.observability
    if hub is None:  # a state assembled by hand (tests): observe it all the same
        hub = state.observability = Observability(state)
    app.add_middleware(TraceMiddleware, hub=hub)
    app.add_middleware(RouteNameMiddleware)  # outside the trace: names the route for the access line
    app.include_router(router)
    reporter: list[asyncio.Task] = []

    async def start_reporter() -> None:
        if hub.stats_interval_s > 0:
            reporter.append(asyncio.get_running_loop().create_task(report_throughput(hub)))

    async def stop_reporter() -> None:
        for task in reporter:
            task.cancel()

    app.router.on_startup.append(start_reporter)
    app.router.on_shutdown.append(stop_reporter)


async def report_throughput(hub: Observability) -> None:
    """Every interval, one human line on stderr (and a ``throughput`` log event), unless idle."""
    def reading() -> tuple:
        snap = hub.view()
        c = snap.counters
        return (time.monotonic(), c.prefill_tokens, c.generation_tokens, c.replayed_tokens), snap.gauges

    interval = hub.stats_interval_s
    prev, _ = reading()
    while True:
        await asyncio.sleep(interval)
        now, g = reading()
        dt, prefill, generated, replayed = (b - a for a, b in zip(prev, now))
        prev = now
        if not (prefill or generated or replayed or g.running or g.waiting or g.paused):
            continue
        parts = [f"prefill {prefill / dt:.1f} tok/s", f"decode {generated / dt:.1f} tok/s",
                 f"running {g.running} ({g.prefilling} prefilling)"]
        if g.waiting or g.paused:
            parts.append(f"waiting {g.waiting}, paused {g.paused}")
        if g.kv_pages_total:
            parts.append(f"kv {g.kv_pages_used}/{g.kv_pages_total} pages")
        log.info("throughput: %s", ", ".join(parts))
        if hub.log is not None:
            hub.log.write("throughput", interval_seconds=dt, prefill_tokens=prefill, generation_tokens=generated,
                          replayed_tokens=replayed, gauges=vars(g))
