"""``serve.sh`` front end (``python -m ninfer.app.console``) and the console launcher for Windows.

    serve.sh [options] [-- more ninfer-serve args]

Options: --context N|auto, --concurrency N|auto, --drafts N|auto, --weights bf16|int8|4bit|...,
--model PATH, --share (all interfaces + API key), --print (show the resolved ninfer-serve
command, run nothing), --plan (also show the memory plan), --supervise (run under the supervisor:
restarts, logs, pid file), --open (open the chat once healthy), --stdin-lifetime (stop when stdin
closes: the Windows console went away), --stop (stop the running launcher), --windows
(Start-NInfer.cmd parameters follow). Without any of them, ninfer-serve runs with exactly the
arguments given.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import webbrowser

from . import _process, _wsl
from .launch import Resolved, child_env, parse_options, resolve, shell_line
from .plan import DoesNotFit
from .settings import AppSettings, data_dir, log_dir
from .supervisor import State, Supervisor, SupervisorConfig

SERVER_PID = "ninfer-serve.pid"
LOCK = "ninfer-app.lock"


def lan_addresses() -> list[str]:
    """IPv4 addresses other devices on the network can try (Windows' own ones under WSL)."""
    if _wsl.in_wsl():
        found = _wsl.windows_addresses()
        if found:
            return found
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[3].split("/")[0] for line in out.splitlines() if len(line.split()) > 3]


def addresses(resolved: Resolved) -> list[str]:
    lines = [f"This computer: {resolved.base_url}/"]
    if resolved.host in ("0.0.0.0", "::"):
        key = f"?key={resolved.api_key}" if resolved.api_key else ""
        lines += [f"Other devices: http://{a}:{resolved.port}/{key}" for a in lan_addresses()]
        if _wsl.in_wsl() and _wsl.networking_mode() != "mirrored":
            lines.append("(WSL runs with NAT networking: other devices reach this server only with "
                         "networkingMode=mirrored in .wslconfig, or a port proxy)")
    return lines


def open_chat(url: str) -> None:
    if not (_wsl.in_wsl() and _wsl.open_in_windows(url)):
        webbrowser.open(url)


def stop_running(grace_s: float = 5.0) -> bool:
    """Stop a running launcher (which stops its server), or an orphaned server, by their pid files."""
    home = data_dir()
    stopped = _process.stop_pid(home / LOCK, grace_s + 5)
    return _process.stop_pid(home / SERVER_PID, grace_s) or stopped


def run_supervised(resolved: Resolved, open_browser: bool, stdin_lifetime: bool) -> int:
    try:
        lock = _process.InstanceLock(data_dir() / LOCK).acquire()
    except _process.AlreadyRunning as exc:
        print(f"{exc}; stop it first (serve.sh --stop)", file=sys.stderr)
        return 1
    done = threading.Event()
    sup = Supervisor(SupervisorConfig(command=resolved.command, health_url=resolved.base_url + "/health",
                                      log_dir=log_dir(), pid_file=data_dir() / SERVER_PID, env=child_env(),
                                      echo=lambda line: print(line, flush=True)))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    if stdin_lifetime and not _stdin_is_null():  # the Windows console closing ends wsl.exe: stdin closes
        threading.Thread(target=lambda: (sys.stdin.buffer.read(), done.set()), daemon=True).start()
    try:
        sup.start()
        while not done.is_set():
            if sup.wait_ready(0.5):
                print("\nNInfer is ready.\n" + "\n".join("  " + a for a in addresses(resolved))
                      + f"\n  Logs: {log_dir() / 'server.log'}\nClose this window or press Ctrl+C to stop.\n",
                      flush=True)
                if open_browser:
                    open_chat(resolved.base_url + "/")
                break
            if sup.status.state == State.FAILED:
                print(f"NInfer: the server does not start with these settings; see {log_dir() / 'server.log'}",
                      file=sys.stderr)
                return 1
        done.wait()
    finally:
        print("NInfer: stopping the server", flush=True)
        sup.stop()
        lock.release()
    return 0


def _stdin_is_null() -> bool:
    try:
        return os.path.samefile("/proc/self/fd/0", os.devnull)
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_options(argv)
    browser = opts.open
    if opts.windows:
        from ._windows import windows_args

        translated, browser = windows_args(opts.serve_args)
        opts = parse_options(translated)
        opts.supervise = opts.stdin_lifetime = True
        opts.given.add("supervise")
    if opts.open or opts.stdin_lifetime:
        opts.supervise = True
        opts.given.add("supervise")
    if opts.stop:
        print("NInfer: stopped" if stop_running() else "NInfer: nothing was running")
        return 0
    if not opts.wants_plan:
        command = [*resolve_executable(), *opts.serve_args]
        os.execv(command[0], command)
    if opts.share and "--api-key" not in opts.serve_args:
        settings = AppSettings.load()
        opts.serve_args += ["--api-key", settings.ensure_api_key()]
        settings.save()
    try:
        resolved = resolve(opts)
    except (DoesNotFit, FileNotFoundError) as exc:
        print(f"serve.sh: {exc}", file=sys.stderr)
        return 1
    if opts.print or opts.plan:
        print(resolved.plan.describe(), file=sys.stderr)
    if opts.print:
        print(shell_line(resolved.command))
        return 0
    if opts.supervise:
        return run_supervised(resolved, browser, opts.stdin_lifetime)
    os.execve(resolved.command[0], resolved.command, child_env())
    return 0


def resolve_executable() -> list[str]:
    from .launch import serve_executable

    return serve_executable()


if __name__ == "__main__":
    raise SystemExit(main())
