"""Process plumbing for the supervisor on Linux / WSL: spawn in its own process group, graceful
stop then kill, pid files that name the exact process (pid + start time), one app instance.

Processes are only ever signalled by the pid this code started and recorded, never by name.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

if os.name == "nt":  # native Windows (not the supported set-up: the server runs inside WSL)
    from . import _windows as _platform
else:
    _platform = None


def spawn(command: list[str], env: dict[str, str] | None) -> subprocess.Popen:
    if _platform is not None:
        return _platform.spawn(command, env)
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def stop_process(proc: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM to the child's process group, SIGKILL after ``grace_s``; the exit code."""
    if proc.poll() is not None:
        return proc.returncode
    if _platform is not None:
        return _platform.stop_process(proc, grace_s)
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        return proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session: its group id is its pid
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


# ---------------------------------------------------------------------------------- identity
def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell it from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def alive(pid: int, started: str | None = None) -> bool:
    """Running (not a zombie) and, when ``started`` is given, still the same process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    return started is None or start_time(pid) in (None, started)


def write_pid_file(path: Path, pid: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid} {start_time(pid) or '-'}\n")


def read_pid_file(path: Path) -> tuple[int, str | None] | None:
    try:
        pid, started = path.read_text().split()[:2]
        return int(pid), None if started == "-" else started
    except (OSError, ValueError):
        return None


def remove_pid_file(path: Path, pid: int) -> None:
    entry = read_pid_file(path)
    if entry is not None and entry[0] == pid:
        path.unlink(missing_ok=True)


def stop_pid(path: Path, grace_s: float = 5.0) -> bool:
    """Stop the process a pid file names (if it is still that process): SIGTERM, SIGKILL after grace."""
    entry = read_pid_file(path)
    if entry is None or not alive(*entry):
        path.unlink(missing_ok=True)
        return False
    pid, started = entry
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not alive(pid, started):
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)
    return True


# ---------------------------------------------------------------------------------- one instance
class AlreadyRunning(RuntimeError):
    def __init__(self, pid: int | None) -> None:
        super().__init__(f"NInfer is already running (pid {pid})" if pid else "NInfer is already running")
        self.pid = pid


class InstanceLock:
    """An exclusive lock on a file held for the life of the process; a second holder is refused.
    The file also names the holder (pid + start time) so that ``--stop`` can reach it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> "InstanceLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if _platform is not None:
            locked = _platform.try_lock(fd)
        else:
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except OSError:
                locked = False
        if not locked:
            os.close(fd)
            entry = read_pid_file(self.path)
            raise AlreadyRunning(entry[0] if entry else None)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {start_time(os.getpid()) or '-'}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "InstanceLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
