"""Windows side: the Start-NInfer.cmd parameters, and process plumbing for a native Windows run.

The supported Windows set-up runs the server inside WSL; Start-NInfer.cmd only hands its
parameters over, and ``windows_args`` turns them into serve.sh options here, inside WSL.
"""
from __future__ import annotations

import subprocess

# Start-NInfer.cmd parameter -> serve.sh option (None: a flag without a value)
PARAMETERS = {
    "-context": ("--context", True), "-concurrency": ("--concurrency", True),
    "-drafttokens": ("--drafts", True), "-model": ("--model", True), "-weights": ("--weights", True),
    "-port": ("--port", True), "-share": ("--share", False), "-localonly": (None, False),
    "-nobrowser": (None, False), "-print": ("--print", False),
}


def windows_args(argv: list[str]) -> tuple[list[str], bool]:
    """``-Context 65536 -Concurrency 2 -NoBrowser ...`` -> (serve.sh options, open the browser?).

    Names are case-insensitive as in PowerShell; ``--`` passes the rest through unchanged."""
    out: list[str] = []
    browser = True
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        key = arg.lower()
        if key not in PARAMETERS:
            raise SystemExit(f"Start-NInfer: unknown parameter {arg!r}; known: "
                             + ", ".join(p.title() for p in PARAMETERS))
        option, takes_value = PARAMETERS[key]
        if key == "-nobrowser":
            browser = False
        if takes_value:
            if i + 1 >= len(argv):
                raise SystemExit(f"Start-NInfer: {arg} needs a value")
            value = argv[i + 1]
            if key == "-model":
                value = windows_path_to_wsl(value)
            out += [option, value]
            i += 2
            continue
        if option:
            out.append(option)
        i += 1
    return out, browser


def windows_path_to_wsl(path: str) -> str:
    """``C:\\models\\x.gguf`` -> ``/mnt/c/models/x.gguf``; Linux paths are left alone."""
    if len(path) >= 3 and path[1] == ":" and path[2] in "\\/":
        return f"/mnt/{path[0].lower()}/" + path[3:].replace("\\", "/")
    return path


# ---------------------------------------------------------------------------------- native runs
def spawn(command: list[str], env: dict[str, str] | None) -> subprocess.Popen:
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, creationflags=subprocess.CREATE_NEW_PROCESS_GROUP)  # type: ignore[attr-defined]


def stop_process(proc: subprocess.Popen, grace_s: float) -> int | None:
    import signal

    try:
        proc.send_signal(signal.CTRL_BREAK_EVENT)  # type: ignore[attr-defined]
    except OSError:
        pass
    try:
        return proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def try_lock(fd: int) -> bool:
    import msvcrt

    try:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
        return True
    except OSError:
        return False
