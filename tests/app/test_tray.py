"""The real tray under Xvfb: pystray's X backend docks the icon in a system tray (xembed_host.py),
a click opens the menu, keys pick entries, and a screenshot goes to docs/screenshots/tray.png."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ninfer.app._process import stop_pid
from ninfer.app.console import SERVER_PID
from support.server_process import free_port
from support.waiting import wait_for, wait_until

HERE = Path(__file__).resolve().parent
SCREENSHOT = HERE.parents[1] / "docs" / "screenshots" / "tray.png"

pytestmark = pytest.mark.skipif(not (shutil.which("Xvfb") and shutil.which("xdotool")),
                                reason="needs Xvfb and xdotool (launchers/setup.sh test installs them)")


@pytest.fixture
def display():
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", "1", "-screen", "0", "1024x640x24", "-nolisten", "tcp"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    number = xvfb.stdout.readline().strip()
    assert number, "Xvfb did not start"
    yield f":{number}"
    xvfb.terminate()
    xvfb.wait(10)


def xdotool(env: dict, *args: str) -> None:
    subprocess.run(["xdotool", *args], env=env, check=True, timeout=10)


def menu_shown(env: dict) -> bool:
    found = subprocess.run(["xdotool", "search", "--onlyvisible", "--class", "Menu"], env=env,
                           capture_output=True, text=True)
    return bool(found.stdout.strip())


def open_menu(env: dict, x: str, y: str, tray: subprocess.Popen) -> None:
    """Click the icon until its menu shows. On a loaded 2-core machine a click that lands while
    the tray is still busy starting can go unanswered; a user clicks again, and so do we (a hung
    tray still fails: three clicks, 15 s each, and the failure says where its threads were)."""
    for _ in range(3):
        xdotool(env, "mousemove", x, y, "click", "1")
        if wait_for(lambda: menu_shown(env), 15.0, interval=0.2):  # (each look starts a process)
            return
    raise AssertionError(f"the popup menu did not open after three clicks\n{hung_report(tray, env)}")


def hung_report(tray: subprocess.Popen, env: dict) -> str:
    """The windows on the display (class, mapped or not) and the tray's threads' stacks (it dumps
    them on SIGUSR1, tray_under_x.py), then its output: the tray is killed to read it."""
    import Xlib.display

    display = Xlib.display.Display(env["DISPLAY"])
    windows = []

    def walk(w, depth: int) -> None:
        try:
            cls, state = w.get_wm_class(), w.get_attributes().map_state
            windows.append(f"{'  ' * depth}{w.id:#x} class={cls} map_state={state}")
            for child in w.query_tree().children:
                walk(child, depth + 1)
        except Exception as exc:  # a window closing while we look
            windows.append(f"{'  ' * depth}{w.id:#x} {type(exc).__name__}")

    walk(display.screen().root, 0)
    display.close()
    alive = tray.poll() is None
    if alive:
        tray.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        tray.kill()
    output = tray.communicate(timeout=10)[0]
    return (f"tray {'was running' if alive else f'had exited ({tray.returncode})'}; windows:\n" +
            "\n".join(windows) + f"\ntray output:\n{output[-6000:]}")


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def startup_report(tray: subprocess.Popen, state: Path, app_home: Path) -> str:
    """What the tray printed (with its threads' stacks, dumped on SIGUSR1), how often it started
    the stand-in server and the server log: why the server never answered (the tray is killed to
    read its output; the test's cleanup stops the server it may have left)."""
    if tray.poll() is None:
        tray.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
    tray.kill()
    output = tray.communicate(timeout=10)[0]
    starts = state / "fake" / "starts"
    logs = sorted(app_home.rglob("*.log"))
    tails = "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-2000:]}" for p in logs)
    pid_files = [f"{p.name}: {p.read_text().strip()}" for p in app_home.rglob(SERVER_PID)] or ["no server pid file"]
    return (f"tray exit {tray.returncode}, output:\n{output[-4000:]}\nstand-in server starts: "
            f"{starts.read_text() if starts.exists() else 0}; {'; '.join(pid_files)}\n{tails}")


def test_only_the_loop_thread_uses_the_icons_connection(display):
    """LoopOnlyDisplay: pystray's loop thread gets the icon's connection; another thread gets one of
    its own, closed when it ends, and a ClientMessage sent on it still reaches the icon's window
    (the thread ends right after sending: the close must not lose it)."""
    import threading
    import types

    import Xlib.X
    import Xlib.display
    import Xlib.protocol.event

    from ninfer.app.tray import LoopOnlyDisplay

    real = Xlib.display.Display(display)
    try:
        screen = real.screen()
        window = screen.root.create_window(0, 0, 1, 1, 0, screen.root_depth)
        real.sync()  # the window exists before another connection names it (pystray syncs too)
        icon = types.SimpleNamespace(_display=real, _thread=threading.current_thread())
        proxy = LoopOnlyDisplay(icon)
        assert proxy.flush == real.flush
        seen = {}

        def other() -> None:  # as pystray's dispatcher does from a thread other than the loop's
            seen["own"] = proxy._display()
            proxy.send_event(window, Xlib.protocol.event.ClientMessage(
                window=window.id, client_type=Xlib.X.NONE, data=(32, (7, 0, 0, 0, 0))), event_mask=0)
            proxy.flush()

        worker = threading.Thread(target=other)
        worker.start()
        worker.join(30)
        assert seen["own"] is not real and seen["own"].display.socket_error is not None  # closed as it ended
        wait_until(lambda: real.pending_events(), what="the ClientMessage")
        event = real.next_event()
        assert event.type == Xlib.X.ClientMessage and event.window.id == window.id and event.data[1][0] == 7
    finally:
        real.close()


def test_tray_menu_under_xvfb(display, tmp_path, app_home):
    env = {**os.environ, "DISPLAY": display, "PYSTRAY_BACKEND": "xorg", "NINFER_APP_HOME": str(app_home)}
    port = free_port()
    app_home.mkdir(parents=True, exist_ok=True)
    (app_home / "settings.json").write_text(json.dumps({"port": port}))
    host = subprocess.Popen([sys.executable, str(HERE / "xembed_host.py")], env=env, stdout=subprocess.PIPE, text=True)
    tray = None
    try:
        assert host.stdout.readline().strip() == "ready"
        tray = subprocess.Popen([sys.executable, str(HERE / "tray_under_x.py"), str(tmp_path)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert tray.stdout.readline().strip() == "has_menu False"  # the X backend: our popup menu
        docked = host.stdout.readline().split()
        assert docked[0] == "docked", docked
        x, y = docked[3], docked[4]
        # generous: on a loaded 2-core CI machine the tray's start-up (plan, supervisor, child) can be slow
        if not wait_for(lambda: healthy(f"http://127.0.0.1:{port}/health"), 60.0):
            raise AssertionError(f"the stand-in server never answered on port {port}\n{startup_report(tray, tmp_path, app_home)}")
        time.sleep(0.5)  # the icon turns green

        open_menu(env, x, y, tray)
        for _ in range(4):  # Open chat, Open monitor, Context, Concurrency (disabled lines are skipped)
            xdotool(env, "key", "Down")
        xdotool(env, "key", "Right")
        time.sleep(1.0)
        from PIL import ImageGrab

        shot = ImageGrab.grab(xdisplay=display)
        left, top, right, bottom = shot.convert("L").point(lambda v: 255 if v else 0).getbbox()  # tray + menu
        shot = shot.crop((max(left - 16, 0), 0, shot.width, min(bottom + 16, shot.height)))
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shot.save(SCREENSHOT)
        assert shot.width > 300 and shot.height > 200 and len(shot.getcolors(1 << 16) or []) > 20  # a menu, not blank
        xdotool(env, "key", "Escape")
        xdotool(env, "key", "Escape")
        wait_until(lambda: not menu_shown(env), what="the menu to close")

        open_menu(env, x, y, tray)
        xdotool(env, "key", "Down")
        xdotool(env, "key", "Return")
        opened = tmp_path / "opened"
        wait_until(opened.exists, what="Open chat")
        assert opened.read_text().splitlines() == [f"chat http://127.0.0.1:{port}/"]

        wait_until(lambda: not menu_shown(env), what="the menu to close")
        open_menu(env, x, y, tray)
        xdotool(env, "key", "Up")  # wraps to the last entry: Quit
        xdotool(env, "key", "Return")
        try:
            code = tray.wait(20)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the tray did not exit after Quit\n{hung_report(tray, env)}") from None
        assert code == 0
        assert "quit" in tray.stdout.read()
        assert not healthy(f"http://127.0.0.1:{port}/health")  # the server stopped with the tray
    finally:
        if tray is not None and tray.poll() is None:
            tray.kill()
        for pid_file in app_home.rglob(SERVER_PID):  # a killed tray leaves its server running
            stop_pid(pid_file)
        host.kill()
        host.wait()
