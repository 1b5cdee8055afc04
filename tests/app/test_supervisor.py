"""Supervisor with a real child process (tests/app/fake_server.py): restarts, backoff, stop, logs."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ninfer.app import _process
from ninfer.app.supervisor import State, Supervisor, SupervisorConfig, _healthy
from support.server_process import free_port
from support.waiting import wait_until

from support.app_fakes import FAKE_SERVER as FAKE


def make(tmp_path: Path, *flags: str, **options) -> tuple[Supervisor, Path]:
    port = free_port()
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    command = [sys.executable, str(FAKE), "--port", str(port), "--state", str(state), *flags]
    config = SupervisorConfig(command=command, health_url=f"http://127.0.0.1:{port}/health",
                              log_dir=tmp_path / "logs", pid_file=tmp_path / "ninfer-serve.pid",
                              backoff_initial_s=0.3, poll_s=0.05, stable_after_s=30, **options)
    return Supervisor(config), state


def log_text(tmp_path: Path) -> str:
    return (tmp_path / "logs" / "server.log").read_text()


def test_crash_restarts_with_doubling_backoff(tmp_path):
    sup, state = make(tmp_path, "--crash-first", "3", "--exit-code", "3", "--exit-after", "0.2")
    changes = []
    sup.on_change = changes.append
    sup.start()
    try:
        wait_until(lambda: len(sup.starts) == 4 and sup.status.state == State.READY)
        assert sup.delays == [0.3, 0.6, 1.2]
        gaps = [b - a for a, b in zip(sup.starts, sup.starts[1:])]
        assert all(gap >= 0.2 + delay for gap, delay in zip(gaps, sup.delays))
        # the tray saw the backoff: state, crash count and the time of the next start
        backoff = [c for c in changes if c.state == State.BACKOFF]
        assert [c.crashes for c in backoff] == [1, 2, 3] and all(c.last_exit == 3 for c in backoff)
        assert "restarting in" in backoff[-1].describe()
        assert "exited with code 3 (crashed); restarting in 1.2 s (crash 3 in a row)" in log_text(tmp_path)
    finally:
        sup.stop()


def test_exit_2_reloads_at_once_then_backs_off_when_repeated(tmp_path):
    sup, state = make(tmp_path, "--crash-first", "3", "--exit-code", "2", "--exit-after", "0.3")
    sup.start()
    try:
        wait_until(lambda: len(sup.starts) == 4 and sup.status.state == State.READY)
        assert sup.delays == [0.0, 0.3, 0.6]
        assert sup.starts[1] - sup.starts[0] < 0.3 + 1.5  # ran 0.3 s, reloaded with no wait
        assert "code 2 (engine failure); reloading now" in log_text(tmp_path)
    finally:
        sup.stop()


def test_stop_is_graceful_and_pid_file_follows_the_child(tmp_path):
    sup, _ = make(tmp_path)
    sup.start()
    assert sup.wait_ready(20)
    pid = sup.status.pid
    assert _process.read_pid_file(tmp_path / "ninfer-serve.pid")[0] == pid
    started = time.monotonic()
    assert sup.stop() == 0
    assert time.monotonic() - started < 3
    assert "graceful stop" in log_text(tmp_path)
    assert not (tmp_path / "ninfer-serve.pid").exists() and not _process.alive(pid)
    assert sup.status.state == State.STOPPED


def test_stop_kills_a_child_that_ignores_sigterm_after_5_s(tmp_path):
    sup, _ = make(tmp_path, "--ignore-term")
    sup.start()
    assert sup.wait_ready(20)
    pid = sup.status.pid
    started = time.monotonic()
    code = sup.stop()
    took = time.monotonic() - started
    assert code == -9 and 4.9 <= took < 8
    assert "ignoring SIGTERM" in log_text(tmp_path) and not _process.alive(pid)


def test_logs_rotate(tmp_path):
    sup, _ = make(tmp_path, "--spam", "3000", log_max_bytes=40_000, log_backups=2)
    sup.start()
    try:
        assert sup.wait_ready(20)
        wait_until(lambda: "log line 2999 " in log_text(tmp_path))
    finally:
        sup.stop()
    files = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert files == ["server.log", "server.log.1", "server.log.2"]
    assert all((tmp_path / "logs" / f).stat().st_size <= 40_000 for f in files)
    assert "log line 0 " not in "".join((tmp_path / "logs" / f).read_text() for f in files)  # rotated away


def test_startup_failures_stop_retrying_until_new_settings(tmp_path):
    sup, state = make(tmp_path, "--crash-first", "99", "--exit-code", "1", max_startup_failures=3)
    sup.start()
    try:
        wait_until(lambda: sup.status.state == State.FAILED)
        assert len(sup.starts) == 3 and "pick other settings" in sup.status.describe()
        time.sleep(0.5)
        assert len(sup.starts) == 3  # no more attempts on its own
        good = [a for a in sup.config.command if a not in ("--crash-first", "99")]
        sup.restart(good)
        assert sup.wait_ready(20)
    finally:
        sup.stop()


def test_server_left_by_an_earlier_launcher_is_stopped_by_its_pid(tmp_path):
    port = free_port()
    (tmp_path / "old").mkdir()
    orphan = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), "--state", str(tmp_path / "old")],
                              stdout=subprocess.PIPE, text=True)
    assert orphan.stdout.readline().startswith("fake server start")
    wait_until(lambda: _healthy(f"http://127.0.0.1:{port}/health"))
    _process.write_pid_file(tmp_path / "ninfer-serve.pid", orphan.pid)
    sup, _ = make(tmp_path)
    sup.start()
    try:
        assert sup.wait_ready(20)
        assert orphan.wait(10) == 0  # stopped gracefully
        assert "stopped a server left running" in log_text(tmp_path)
    finally:
        sup.stop()


def test_second_instance_is_refused(tmp_path):
    lock_path = tmp_path / "ninfer-app.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from ninfer.app._process import InstanceLock; "
         f"InstanceLock(__import__('pathlib').Path({str(lock_path)!r})).acquire(); print('held', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(_process.AlreadyRunning) as info:
            _process.InstanceLock(lock_path).acquire()
        assert info.value.pid == holder.pid and f"pid {holder.pid}" in str(info.value)
    finally:
        holder.kill()
        holder.wait()
    with _process.InstanceLock(lock_path):  # free again once the holder is gone
        assert _process.read_pid_file(lock_path)[0] == os.getpid()
