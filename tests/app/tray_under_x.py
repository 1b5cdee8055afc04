"""Run the real tray (pystray's X backend) with a stand-in server, for tests/app/test_tray.py.

    DISPLAY=:N NINFER_APP_HOME=DIR python tray_under_x.py STATE_DIR

What the tray opens is appended to STATE_DIR/opened; it exits when Quit is chosen.
"""
from __future__ import annotations

import faulthandler
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package

from support.app_fakes import Recorder, fake_command  # noqa: E402

from ninfer.app.gpu_probe import Probe  # noqa: E402
from ninfer.app.settings import AppSettings  # noqa: E402
from ninfer.app.tray import TrayApp, TrayIcon  # noqa: E402


def main() -> int:
    state = Path(sys.argv[1])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where a tray that stopped answering is
    probe = Probe([], note="No usable GPU: no NVIDIA driver is installed. CPU mode with the embedded model.")
    app = TrayApp(AppSettings.load(), probe, Recorder(log=state / "opened"), supervisor_options={"poll_s": 0.05})
    app.command_for = fake_command(state / "fake")
    tray = TrayIcon(app)
    print(f"has_menu {tray.has_menu}", flush=True)
    tray.run()
    app.quit()
    print("quit", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
