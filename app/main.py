"""``ninfer-app``: the tray launcher (GPU probe, memory plan, supervised server, tray).

    ninfer-app                 tray icon; the server starts with settings that fit this machine
    ninfer-app --probe         what GPUs (or CPU mode) the launcher sees, as JSON
    ninfer-app --print [...]   the ninfer-serve command the tray would run, and its memory plan
    ninfer-app --no-tray       the same supervised server in the foreground, without a tray
"""
from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading

from . import _process
from .settings import AppSettings, data_dir

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    if "--probe" in argv:
        from .gpu_probe import main as probe_main

        return probe_main()
    settings = AppSettings.load()
    if "--print" in argv or "--no-tray" in argv:
        from .console import main as console_main

        rest = [a for a in argv if a not in ("--no-tray",)]
        extra = [] if settings.model is None or "--model" in rest else ["--model", settings.model]
        return console_main([*extra, *rest] + ([] if "--print" in rest else ["--supervise", "--open"]))
    return run_tray(settings)


def run_tray(settings: AppSettings) -> int:
    from .console import LOCK
    from .gpu_probe import probe

    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        print("ninfer-app: no graphical display; use `ninfer-app --no-tray` (or launchers/serve.sh) instead",
              file=sys.stderr)
        return 1
    if importlib.util.find_spec("pystray") is None or importlib.util.find_spec("PIL") is None:
        print("ninfer-app: the tray needs pystray and pillow (pip install 'ninfer[app]'); "
              "`ninfer-app --no-tray` runs without them", file=sys.stderr)
        return 1
    try:
        lock = _process.InstanceLock(data_dir() / LOCK).acquire()
    except _process.AlreadyRunning as exc:
        print(f"ninfer-app: {exc}", file=sys.stderr)
        return 1
    from .tray import TrayApp, TrayIcon

    app = TrayApp(settings, probe())
    tray = TrayIcon(app)

    def on_signal(*_: object) -> None:  # off the X thread: its display lock may be held right now
        threading.Thread(target=lambda: (app.quit(), tray.icon.stop()), daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        tray.run()
    finally:
        app.quit()
        lock.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
