"""Gateway-side accounting of each generation request, from the outputs the engine publishes.

``RequestMonitor`` is the ``AsyncEngine.observer``: ``begin`` is called when a request has been
submitted, the returned ``RequestWatch`` sees every ``RequestOutput`` and is closed when the
caller stops iterating. It measures what only the gateway can (time to first token from HTTP
arrival, queue time, duration), feeds the histograms and the recent-request list, and writes the
request log's start and its one terminal event. Everything runs on the event loop.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from typing import TYPE_CHECKING, Any

from ...engine.outputs import RequestOutput
from ...engine.request import Request
from .request_log import request_shape
from .trace import HttpTrace, current_trace

if TYPE_CHECKING:
    from . import Observability

log = logging.getLogger("ninfer.requests")

RECENT = 50  # requests kept for /stats
TTFT_WINDOW_S = 60.0


class RequestMonitor:
    def __init__(self, hub: "Observability") -> None:
        self.hub = hub
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=4096)  # (monotonic time, seconds)

    def begin(self, request: Request) -> "RequestWatch | _NullWatch":
        try:
            return RequestWatch(self, request, current_trace())
        except Exception:  # noqa: BLE001 - accounting must never fail a request
            log.exception("request accounting failed")
            return _NullWatch()

    def last_ttft(self) -> float | None:
        return self.ttfts[-1][1] if self.ttfts else None

    def ttft_p50(self, window_s: float = TTFT_WINDOW_S) -> float | None:
        since = time.monotonic() - window_s
        values = sorted(v for t, v in list(self.ttfts) if t >= since)
        if not values:
            return None
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    def rejected(self, trace: HttpTrace) -> None:
        """A generation request that ended in an error before reaching the engine."""
        gone = trace.status == 499  # the client left before any answer: cancelled, not refused
        self.hub.metrics.requests.labels("cancelled" if gone else "rejected").inc()
        if trace.status is not None and (trace.status == 429 or trace.status >= 500):
            self.hub.metrics.failures.inc()  # valid, but refused for lack of capacity or a broken engine
        if self.hub.log is None:
            return
        self.hub.log.write(
            "request_rejected",
            request_id=trace.request_id or "rej-" + uuid.uuid4().hex,
            protocol=trace.protocol,
            path=trace.path,
            phase="prepare",
            status=trace.status,
            error=trace.error(),
            shape=request_shape(trace.parsed_body()),
            elapsed_seconds=time.monotonic() - trace.t0,
        )


class _NullWatch:
    def output(self, out: RequestOutput) -> None:
        pass

    def close(self) -> None:
        pass


class RequestWatch:
    def __init__(self, monitor: RequestMonitor, request: Request, trace: HttpTrace | None) -> None:
        self.monitor = monitor
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_ids)
        self.submitted = time.monotonic()
        self.t0 = trace.t0 if trace is not None else self.submitted
        self.protocol = trace.protocol if trace is not None else None
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.tokens = 0
        self.ended = False
        if trace is not None:
            trace.started.append(self.request_id)
        hub = monitor.hub
        if hub.log is not None:
            p = request.params
            hub.log.write(
                "request_start",
                request_id=self.request_id,
                protocol=self.protocol,
                path=trace.path if trace is not None else None,
                prompt_tokens=self.prompt_tokens,
                max_total_tokens=request.max_total_tokens,
                sampling={
                    "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
                    "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
                    "repetition_penalty": p.repetition_penalty, "seed": p.seed, "max_tokens": p.max_tokens,
                    "n_stop_strings": len(p.stop), "n_stop_token_ids": len(p.stop_token_ids),
                    "ignore_eos": p.ignore_eos,
                },
                shape=request_shape(trace.parsed_body()) if trace is not None else {},
                prepare_seconds=self.submitted - self.t0,
            )

    def output(self, out: RequestOutput) -> None:
        if self.ended:
            return
        try:
            now = time.monotonic()
            if out.admitted and self.admitted_at is None:  # when the engine admitted it, where it says
                self.admitted_at = now if out.queue_time is None else min(now, self.submitted + out.queue_time)
            if out.token_ids:
                self.tokens += len(out.token_ids)
                if self.first_token_at is None:
                    self.first_token_at = now
                    ttft = now - self.t0
                    self.monitor.ttfts.append((now, ttft))
                    self.monitor.hub.metrics.ttft.observe(ttft)
            if out.finished:
                self._end(out, now)
        except Exception:  # noqa: BLE001
            log.exception("request accounting failed")

    def close(self) -> None:
        if not self.ended:
            try:
                self._end(None, time.monotonic())
            except Exception:  # noqa: BLE001
                log.exception("request accounting failed")

    # ------------------------------------------------------------------ the one terminal
    def _end(self, final: RequestOutput | None, now: float) -> None:
        self.ended = True
        hub = self.monitor.hub
        if final is None or final.finish_reason == "abort":
            outcome, reason = "cancelled", "cancelled"
        elif final.finish_reason == "error":
            outcome, reason = "error", final.error_code or "error"
        else:
            outcome, reason = "done", final.finish_reason or "stop"
        hub.metrics.requests.labels(outcome).inc()
        if outcome == "error":
            hub.metrics.failures.inc()
        queue = (self.admitted_at if self.admitted_at is not None else now) - self.submitted
        total = now - self.t0
        if outcome != "error":  # settled outcomes; failures are counted apart
            hub.metrics.duration.observe(total)
            hub.metrics.queue.observe(queue)
        completion = final.completion_tokens if final is not None and final.completion_tokens else self.tokens
        cached = final.cached_tokens if final is not None else 0
        ttft = None if self.first_token_at is None else self.first_token_at - self.t0
        decode_s = final.decode_time if final is not None else None
        decode_tps = (completion - 1) / decode_s if decode_s and completion > 1 else None
        self.monitor.recent.appendleft({
            "id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": cached,
            "output_tokens": completion,
            "ttft_ms": None if ttft is None else ttft * 1000.0,
            "decode_tps": decode_tps,
            "finish_reason": reason,
            "ended_at": time.time(),
        })
        if hub.log is None:
            return
        prefill_s = final.prefill_time if final is not None else None  # admission -> first token
        record: dict[str, Any] = {
            "request_id": self.request_id,
            "protocol": self.protocol,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": cached,
                "prefill_tokens": self.prompt_tokens - cached,
                # where the cached tokens came from: {"tier": "gpu" | "host", "kind": "turn" | "anchor"}
                "reuse": final.reuse if final is not None else None,
                "completion_tokens": completion,
            },
            "timings_seconds": {
                "prepare": self.submitted - self.t0,
                "queue": queue if self.admitted_at is not None else None,
                "ttft": ttft,
                "prefill": prefill_s,
                "decode": decode_s,
                "total": total,
            },
        }
        if outcome == "done":
            stop = final.stop_reason
            record["finish_reason"] = reason
            record["stop_kind"] = None if stop is None else "stop_string" if isinstance(stop, str) else "token"
            record["decode_tps"] = decode_tps
            if final.reasoning_loop:
                record["reasoning_loop"] = True  # its reasoning repeated itself and was ended (--reasoning-loop)
            hub.log.write("request_done", **record)
        else:
            record["kind"] = reason  # the error's code; its message may quote the request, so it stays out
            hub.log.write("request_error", **record)
