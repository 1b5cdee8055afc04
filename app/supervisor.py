"""Runs ninfer-serve as a child process and keeps it running.

start -> wait for ``/health`` -> watch; when the child exits: exit code 2 (engine failure) is
reloaded at once, other exits are restarted after a backoff that doubles with each crash in a row
(reset once the server has stayed healthy for ``stable_after_s``). A server that fails to start
(exit 1 before ever being healthy) ``max_startup_failures`` times in a row is left stopped: that
is a bad model or flag, and the user must pick other settings. Stopping is graceful (SIGTERM to the
child's process group), then SIGKILL after ``stop_grace_s`` (5 s). The child's output goes to a
rotating log; its pid to a pid file.
"""
from __future__ import annotations

import enum
import logging
import logging.handlers
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from . import _process

EXIT_ENGINE_FAILURE = 2
EXIT_STARTUP_FAILURE = 1


class State(str, enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"  # crashed, waiting to restart
    FAILED = "failed"  # gave up: it does not start with these settings


@dataclass
class Status:
    state: State = State.STOPPED
    pid: int | None = None
    crashes: int = 0  # in a row
    last_exit: int | None = None
    retry_at: float | None = None  # time.monotonic() of the next start while in BACKOFF
    message: str = ""

    def describe(self) -> str:
        if self.state == State.BACKOFF and self.retry_at is not None:
            wait = max(0.0, self.retry_at - time.monotonic())
            return f"restarting in {wait:.0f} s (crashed {self.crashes}x, last exit {self.last_exit})"
        return self.message or self.state.value


@dataclass
class SupervisorConfig:
    command: list[str]
    health_url: str
    log_dir: Path
    pid_file: Path
    env: dict[str, str] | None = None
    stop_grace_s: float = 5.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    stable_after_s: float = 60.0
    health_timeout_s: float = 900.0  # a large checkpoint can take minutes to load
    max_startup_failures: int = 5
    poll_s: float = 0.2
    log_max_bytes: int = 5 << 20
    log_backups: int = 3
    echo: Callable[[str], None] | None = None  # also show each log line (the console launcher)


def server_logger(config: SupervisorConfig) -> logging.Logger:
    config.log_dir.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"ninfer.app.server.{config.log_dir}")
    log.propagate = False
    log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.handlers.RotatingFileHandler(
            config.log_dir / "server.log", maxBytes=config.log_max_bytes, backupCount=config.log_backups,
            encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
    return log


class Supervisor:
    def __init__(self, config: SupervisorConfig, on_change: Callable[[Status], None] | None = None) -> None:
        self.config = config
        self.on_change = on_change
        self.status = Status()
        self.starts: list[float] = []  # monotonic start times, for the tests and the tray
        self.delays: list[float] = []  # the backoff chosen after each exit
        self._log = server_logger(config)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._restart = False
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ninfer-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> int | None:
        """Stop the server (graceful, then killed after ``stop_grace_s``); its exit code."""
        self._stopping = True
        self._wake.set()
        code = self._terminate()
        if self._thread is not None:
            self._thread.join(self.config.stop_grace_s + 10)
        self._set(state=State.STOPPED, pid=None, message="stopped")
        return code

    def restart(self, command: list[str] | None = None, health_url: str | None = None) -> None:
        """Restart now, with a new command when the user picked new settings; clears FAILED."""
        with self._lock:
            if command is not None:
                self.config = replace(self.config, command=command, health_url=health_url or self.config.health_url)
            self._restart = True
        self._set(state=State.STARTING, message="restarting", retry_at=None)
        self._wake.set()
        self._terminate()
        self.start()

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status.state == State.READY:
                return True
            if self.status.state == State.FAILED:
                return False
            time.sleep(0.05)
        return False

    def log_line(self, text: str) -> None:
        self._log.info(text)
        if self.config.echo:
            self.config.echo(text)

    # ------------------------------------------------------------------ the loop
    def _set(self, **changes) -> None:
        self.status = replace(self.status, **changes)
        if self.on_change is not None:
            try:
                self.on_change(self.status)
            except Exception:  # a broken display must not stop the supervisor
                logging.getLogger("ninfer.app").exception("status callback failed")

    def _run(self) -> None:
        if _process.stop_pid(self.config.pid_file, self.config.stop_grace_s):
            self.log_line("supervisor: stopped a server left running by an earlier launcher")
        startup_failures = 0
        while not self._stopping:
            with self._lock:
                self._restart = False
                config = self.config
            code, was_ready, healthy_for = self._run_once(config)
            if self._stopping:
                break
            if self._restart:
                self.status.crashes = 0
                startup_failures = 0
                continue
            crashes = 0 if healthy_for >= config.stable_after_s else self.status.crashes
            crashes += 1
            why = {EXIT_ENGINE_FAILURE: "engine failure", EXIT_STARTUP_FAILURE: "failed to start"}.get(code, "crashed")
            if code == EXIT_STARTUP_FAILURE and not was_ready:
                startup_failures += 1
                if startup_failures >= config.max_startup_failures:
                    self.log_line(f"supervisor: the server failed to start {startup_failures} times; "
                                  "stopped until new settings are picked (see the log above)")
                    self._set(state=State.FAILED, pid=None, crashes=crashes, last_exit=code,
                              message=f"failed to start {startup_failures}x: pick other settings or see the log")
                    self._wait_for(None)
                    startup_failures = 0
                    self.status.crashes = 0
                    continue
            else:
                startup_failures = 0
            # an engine failure reloads at once the first time; any repeated crash backs off
            steps = crashes - 1 if code == EXIT_ENGINE_FAILURE else crashes
            delay = 0.0 if steps <= 0 else min(config.backoff_initial_s * 2 ** (steps - 1), config.backoff_max_s)
            self.delays.append(delay)
            then = "reloading now" if delay == 0 else f"restarting in {delay:.1f} s (crash {crashes} in a row)"
            self.log_line(f"supervisor: server exited with code {code} ({why}); {then}")
            self._set(state=State.BACKOFF, pid=None, crashes=crashes, last_exit=code,
                      retry_at=time.monotonic() + delay, message=f"{why}, exit {code}")
            self._wait_for(delay)
        self._set(state=State.STOPPED, pid=None, message="stopped")

    def _wait_for(self, delay: float | None) -> None:
        self._wake.clear()
        if not (self._stopping or self._restart):
            self._wake.wait(delay)

    def _run_once(self, config: SupervisorConfig) -> tuple[int, bool, float]:
        """Start the child, watch it until it exits; (exit code, was it ever healthy, seconds healthy)."""
        self.log_line("supervisor: starting " + " ".join(config.command))
        self._set(state=State.STARTING, message="starting", retry_at=None)
        with self._lock:
            if self._stopping:
                return 0, False, 0.0
            proc = _process.spawn(config.command, config.env)
            self._proc = proc
        self.starts.append(time.monotonic())
        _process.write_pid_file(config.pid_file, proc.pid)
        self._set(pid=proc.pid)
        reader = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        reader.start()
        ready_at: float | None = None
        started = time.monotonic()
        while proc.poll() is None:
            if ready_at is None and not self._stopping:
                if _healthy(config.health_url):
                    ready_at = time.monotonic()
                    self._set(state=State.READY, message=f"ready at {config.health_url.rsplit('/health', 1)[0]}")
                    self.log_line("supervisor: server is healthy")
                elif time.monotonic() - started > config.health_timeout_s:
                    self.log_line(f"supervisor: no healthy answer after {config.health_timeout_s:.0f} s; stopping it")
                    self._terminate()
            time.sleep(config.poll_s)
        reader.join(5)
        _process.remove_pid_file(config.pid_file, proc.pid)
        with self._lock:
            self._proc = None
        healthy_for = time.monotonic() - ready_at if ready_at is not None else 0.0
        return proc.returncode, ready_at is not None, healthy_for

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.log_line(raw.decode("utf-8", "replace").rstrip("\n"))

    def _terminate(self) -> int | None:
        with self._lock:
            proc = self._proc
        if proc is None:
            return None
        code = _process.stop_process(proc, self.config.stop_grace_s)
        if code is not None and code < 0:
            self.log_line(f"supervisor: server stopped by signal {-code}")
        return code


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 - our own loopback URL
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
