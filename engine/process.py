"""The engine in a process of its own, so the gateway's Python (HTTP, JSON, SSE framing) and the
engine's (scheduling, launching, detokenizing) never wait on one interpreter lock.

``EngineProcess`` has the face of ``EngineLoop`` (``submit``, ``abort``, ``failed``,
``on_failure``, ``view``, ``model_config``, ``token_limit``, ``start``, ``stop``). ``launch``
spawns the child, which builds its engine with ``build(*args)`` (a module-level function: the
child imports it anew) and runs an ``EngineLoop``; ``start`` begins reading what it sends; one pipe carries commands to it and, after each
step, that step's outputs back in one message, with an ``EngineSnapshot`` whenever a request
was admitted or finished, or 50 ms have passed (the gateway's ``/stats`` and ``/metrics`` read the latest one). A
reader thread here hands the outputs to their requests' sinks.

With tensor parallelism (``ranks`` > 1, ``parallel.py``) the child is rank 0 and ranks 1 .. N-1
are processes of their own beside it, each running ``serve_rank(*args, rendezvous)``; they find
each other through rank 0's store on a free local port, with ``NCCL_NVLS_ENABLE=0`` set for all.

A failed step in the child, the child's death, or its pipe breaking is an engine failure:
every request in flight ends with an error, ``failed`` is set and ``on_failure`` is called; so is
the end of any other rank (the others are then stopped: the group is restarted whole). The
gateway stops the child in order (``stop``, also at interpreter exit); the child ignores SIGINT
(Ctrl+C reaches the whole process group; the gateway shuts down first), gives the gateway
``TERM_GRACE_S`` to stop it after a SIGTERM, and ends when its pipe closes, so it never outlives
the gateway.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
import traceback
from typing import Any, Callable

from .config import ModelConfig
from .loop import EngineFailedError, EngineLoop, Sink
from .parallel import Rendezvous
from .outputs import RequestOutput
from .request import Request
from .snapshot import EngineSnapshot, take_snapshot

log = logging.getLogger("ninfer.engine")

SNAPSHOT_EVERY_S = 0.05
TERM_GRACE_S = 5.0


class EngineProcessError(RuntimeError):
    """The engine process could not start, or has stopped."""


class EngineProcess:
    def __init__(self, build: Callable[..., Any], args: tuple = (), log_level: int = logging.INFO,
                 on_failure: Callable[[BaseException], None] | None = None, ranks: int = 1,
                 serve_rank: Callable[..., None] | None = None) -> None:
        if ranks > 1 and serve_rank is None:
            raise ValueError("more than one rank needs serve_rank")
        self.on_failure = on_failure
        self.failed: BaseException | None = None
        self._build, self._args, self._log_level = build, args, log_level
        self._world, self._serve_rank = ranks, serve_rank
        self._ranks: list = []  # the processes of ranks 1 .. N-1
        self._sinks: dict[str, Sink] = {}
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()  # orders submit() against a failure
        self._stopping = False
        self._snapshot: EngineSnapshot | None = None
        self._proc = self._conn = self._reader = None
        self.model_config: ModelConfig | None = None
        self.token_limit = 0

    # ------------------------------------------------------------------ lifecycle
    def launch(self) -> None:
        """Spawn the child and wait until its engine is built (weights loaded, warmed up); a
        failure to build raises ``EngineProcessError`` with the child's reason."""
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        self._conn, child = ctx.Pipe()
        args = self._args
        if self._world > 1:
            os.environ["NCCL_NVLS_ENABLE"] = "0"  # (the spawned ranks inherit it)
            init = f"tcp://127.0.0.1:{_free_port()}"
            args = (*args, Rendezvous(0, self._world, init))
            self._ranks = [ctx.Process(target=_rank_main, args=(self._serve_rank, self._args,
                                                                 Rendezvous(r, self._world, init), self._log_level),
                                       name=f"ninfer-rank-{r}", daemon=True) for r in range(1, self._world)]
        self._proc = ctx.Process(target=_child_main, args=(self._build, args, self._log_level, child),
                                 name="ninfer-engine", daemon=True)
        self._proc.start()
        for proc in self._ranks:
            proc.start()
        child.close()
        atexit.register(self.stop)  # before multiprocessing's own exit hook, which would SIGTERM it
        try:
            while not self._conn.poll(0.2):
                if not self._proc.is_alive():
                    raise EngineProcessError(f"the engine process exited with code {self._proc.exitcode} "
                                             "while starting")
                dead = self._dead_rank()
                if dead is not None:
                    raise EngineProcessError(f"{dead} while starting (its reason is in the log above)")
            try:
                kind, *rest = self._conn.recv()
            except (EOFError, OSError) as exc:
                raise EngineProcessError(f"the engine process exited while starting ({exc})") from None
            if kind == "error":
                self._proc.join(10)
                raise EngineProcessError(rest[0])
        except EngineProcessError:
            self._stopping = True
            self._end_all()
            raise
        self.model_config, self.token_limit, self._snapshot = rest

    def _dead_rank(self) -> str | None:
        """Which of ranks 1 .. N-1 has ended, and how; None while all run."""
        for rank, proc in enumerate(self._ranks, 1):
            if proc.exitcode is not None:
                return f"tensor-parallel rank {rank} exited with code {proc.exitcode}"
        return None

    def _watch_ranks(self) -> None:
        """The end of a rank other than 0 is an engine failure (rank 0 goes too)."""
        while not self._stopping:
            dead = self._dead_rank()
            if dead is not None:
                if self._stopping:
                    return
                self._fail(EngineProcessError(dead))
                self._end_all()
                return
            time.sleep(0.1)

    def _end_all(self) -> None:
        """Kill every rank's process still running (rank 0 last, its reader then sees the pipe close)."""
        for proc in [*self._ranks, self._proc]:
            if proc is not None and proc.is_alive():
                proc.kill()
        for proc in [*self._ranks, self._proc]:
            if proc is not None:
                proc.join(10)

    def start(self) -> None:
        """Begin handing the child's outputs to their requests (``launch`` first)."""
        if self._conn is None:
            self.launch()
        self._reader = threading.Thread(target=self._read, name="ninfer-engine-reader", daemon=True)
        self._reader.start()
        if self._ranks:
            threading.Thread(target=self._watch_ranks, name="ninfer-rank-watch", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._proc is None or not self._proc.is_alive() and self._reader is None:
            return
        try:
            self._send(("stop",))
        except EngineProcessError:
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._kill()
        for proc in self._ranks:  # rank 0 has ended them in order; what is left is killed
            proc.join(timeout)
        self._end_all()
        if self._reader is not None:
            self._reader.join(timeout)

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.join(10)

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request, sink: Sink) -> None:
        with self._state_lock:
            if self.failed is not None:
                raise EngineFailedError(f"engine failed: {self.failed}")
            self._sinks[request.request_id] = sink
        try:
            self._send(("add", request))
        except EngineProcessError as exc:
            self._sinks.pop(request.request_id, None)
            raise EngineFailedError(f"engine failed: {exc}") from None

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineProcessError:
            pass  # the engine is gone: the request has ended with it

    def view(self) -> EngineSnapshot:
        return self._snapshot

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError, AttributeError) as exc:
            raise EngineProcessError(f"the engine process is gone ({exc})") from None

    # ------------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        reason = None
        try:
            while True:
                kind, *rest = self._conn.recv()
                if kind == "outputs":
                    outputs, snapshot = rest
                    if snapshot is not None:  # before the outputs: a finished request is counted
                        self._snapshot = snapshot
                    for out in outputs:
                        self._deliver(out)
                elif kind == "failed":
                    reason = rest[0]
                    break
        except (EOFError, OSError):
            if self._stopping:
                return
            self._proc.join(5)
            reason = f"the engine process exited (code {self._proc.exitcode})"
        except Exception as exc:  # noqa: BLE001 - a message this side cannot read ends the engine too
            reason = f"the engine process sent what could not be read ({type(exc).__name__})"
        self._fail(EngineProcessError(reason))

    def _deliver(self, out: RequestOutput) -> None:
        sink = self._sinks.pop(out.request_id, None) if out.finished else self._sinks.get(out.request_id)
        if sink is not None:
            sink(out)

    def _fail(self, exc: BaseException) -> None:
        with self._state_lock:
            if self.failed is not None:  # (a dead rank is seen both here and by rank 0)
                return
            self.failed = exc
        log.error("engine failed: %s", exc)
        with self._state_lock:
            sinks, self._sinks = self._sinks, {}
        for request_id, sink in sinks.items():
            sink(RequestOutput(request_id, finished=True, finish_reason="error", error=str(exc),
                               error_code="engine_failed"))
        if self.on_failure is not None:
            self.on_failure(exc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- the child
def _exit_later(seconds: float) -> None:
    timer = threading.Timer(seconds, os._exit, (0,))
    timer.daemon = True  # a child stopped in order before then is not held back by it
    timer.start()


def _child_main(build: Callable[..., Any], args: tuple, log_level: int, conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gateway stops the engine in order
    signal.signal(signal.SIGTERM, lambda *_: _exit_later(TERM_GRACE_S))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build(*args)
    except (ValueError, FileNotFoundError) as exc:  # what the settings or the files are: the reason says it
        conn.send(("error", str(exc)))
        return
    except BaseException as exc:  # noqa: BLE001 - the reason goes to the gateway, which exits with it
        log.error("the engine could not be built:\n%s", traceback.format_exc())
        conn.send(("error", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__))
        return
    send_lock = threading.Lock()
    batch: list[RequestOutput] = []
    last = [0.0]

    def send(message: tuple) -> None:
        with send_lock:
            conn.send(message)

    def flush() -> None:
        """This step's outputs in one message; a snapshot with them when a request was admitted
        or finished, or ``SNAPSHOT_EVERY_S`` has passed since the last."""
        now = time.monotonic()
        due = now - last[0] >= SNAPSHOT_EVERY_S
        if not batch and not due:
            return
        outputs = batch[:]
        batch.clear()
        snapshot = None
        if due or any(o.finished or o.admitted for o in outputs):
            snapshot, last[0] = take_snapshot(engine), now
        try:
            send(("outputs", outputs, snapshot))
        except OSError:  # the gateway has ended before the engine (its shutdown): no one to serve
            loop.request_stop()

    failure: list[str] = []
    loop = EngineLoop(engine, on_failure=lambda exc: failure.append(str(exc) or type(exc).__name__), flush=flush)
    send(("ready", engine.model.config, engine.token_limit, take_snapshot(engine)))
    loop.start()
    try:
        while not failure:
            if not conn.poll(0.2):
                continue
            kind, *rest = conn.recv()
            if kind == "add":
                try:
                    loop.submit(rest[0], batch.append)
                except EngineFailedError:
                    break
            elif kind == "abort":
                loop.abort(rest[0])
            elif kind == "stop":
                break
    except (EOFError, OSError):
        pass  # the gateway is gone
    loop.stop()
    if failure:
        try:
            send(("failed", f"engine step failed: {failure[0]}"))
        except OSError:
            pass
    close = getattr(engine, "close", None)  # the other tensor-parallel ranks, ended in order
    try:
        if close is not None:
            close()
    except Exception as exc:  # noqa: BLE001 - a rank already gone: the gateway ends what is left
        log.info("the other ranks could not be ended in order: %s", exc)


def _rank_main(serve: Callable[..., None], args: tuple, rendezvous: Rendezvous, log_level: int) -> None:
    """A tensor-parallel rank >= 1: ``serve(*args, rendezvous)`` until rank 0 ends it. It ends
    with its parent too, and with code 1 when its group breaks (rank 0 gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _exit_later(TERM_GRACE_S))
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    log.info("tensor-parallel rank %d of %d (pid %d)", rendezvous.rank, rendezvous.world_size, os.getpid())
    try:
        serve(*args, rendezvous)
    except BaseException as exc:  # noqa: BLE001 - the rank ends; the gateway sees it and ends the rest
        log.error("tensor-parallel rank %d stopped: %s", rendezvous.rank, f"{type(exc).__name__}: {exc}")
        logging.shutdown()
        os._exit(1)
