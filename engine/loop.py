"""The engine thread: the only place that mutates engine state.

Other threads talk to it through ``submit`` / ``abort``, which only enqueue commands. Each request
gets a sink callback that receives its ``RequestOutput`` objects, the last one with ``finished``;
``flush``, when given, is called after each batch of outputs (a step's, or a batch of commands'),
so a sink may collect and ``flush`` send them on together. If a step raises, every live request
receives an error output, ``failed`` is set, and ``on_failure`` is called so the process can
report it and exit. ``process.py`` runs the same loop in a process of its own.
"""
from __future__ import annotations

import logging
import queue
import threading
import traceback
from typing import Callable

from .config import ModelConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .request import Request
from .snapshot import EngineSnapshot, take_snapshot

log = logging.getLogger("ninfer.engine")

Sink = Callable[[RequestOutput], None]


class EngineFailedError(RuntimeError):
    """The engine thread has stopped after a failure; no request can be served."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_failure: Callable[[BaseException], None] | None = None,
                 flush: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.on_failure = on_failure
        self.flush = flush
        self.failed: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self._submit_lock = threading.Lock()  # orders submit() against a failure
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.request_stop()
        self._thread.join(timeout)

    def request_stop(self) -> None:
        """End the loop after its current step, without waiting for it (callable from the loop's
        own thread: its ``flush``)."""
        self._stop.set()
        self._commands.put(("wake", None, None))

    def submit(self, request: Request, sink: Sink) -> None:
        with self._submit_lock:
            if self.failed is not None:
                raise EngineFailedError(f"engine failed: {self.failed}")
            self._commands.put(("add", request, sink))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    def view(self) -> EngineSnapshot:
        return take_snapshot(self.engine)

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model.config

    @property
    def token_limit(self) -> int:
        return self.engine.token_limit

    # ------------------------------------------------------------------ thread body
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_work
                self._drain(block=idle and not self.engine.idle_work())
                if self.engine.has_work:
                    for out in self.engine.step():
                        self._publish(out)
                if self.flush is not None:
                    self.flush()
        except BaseException as exc:  # noqa: BLE001 - any failure ends the engine
            log.error("engine step failed:\n%s", traceback.format_exc())
            with self._submit_lock:
                self.failed = exc
            self._fail_all(exc)
            if self.flush is not None:
                self.flush()
            if self.on_failure is not None:
                self.on_failure(exc)

    def _fail_all(self, exc: BaseException) -> None:
        """Every live or still-queued request ends with the error; none is left waiting."""
        for request_id in list(self._sinks):
            self._publish(RequestOutput(request_id, finished=True, finish_reason="error", error=str(exc),
                                        error_code="engine_failed"))
        while True:
            try:
                kind, arg, sink = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                sink(RequestOutput(arg.request_id, finished=True, finish_reason="error", error=str(exc),
                                   error_code="engine_failed"))

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, arg, sink: Sink | None) -> None:
        if kind == "add":
            try:
                self.engine.add_request(arg)
            except ValueError as exc:
                sink(RequestOutput(arg.request_id, finished=True, finish_reason="error", error=str(exc)))
                return
            except Exception as exc:  # noqa: BLE001 - a request that cannot be taken fails alone
                log.error("request %s could not be added (%s):\n%s", arg.request_id, type(exc).__name__,
                          "".join(traceback.format_tb(exc.__traceback__)).rstrip())
                sink(RequestOutput(arg.request_id, finished=True, finish_reason="error",
                                   error=f"the server failed to take this request ({type(exc).__name__})",
                                   error_code="internal_error"))
                return
            self._sinks[arg.request_id] = sink
        elif kind == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._publish(out)

    def _publish(self, out: RequestOutput) -> None:
        sink = self._sinks.get(out.request_id)
        if out.finished:
            self._sinks.pop(out.request_id, None)
        if sink is not None:
            sink(out)
