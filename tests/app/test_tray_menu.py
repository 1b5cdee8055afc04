"""Every tray menu entry's action, without a display: TrayApp with a recording opener and a
stand-in server (tests/app/fake_server.py) under the real supervisor."""
from __future__ import annotations

import time

import pytest
from ninfer.app.gpu_probe import Probe
from ninfer.app.menu import by_label, walk
from ninfer.app.model_info import embedded_module
from ninfer.app.settings import AppSettings, log_dir
from ninfer.app.supervisor import State
from ninfer.app.tray import TrayApp
from support.app_fakes import Recorder, fake_command
from support.server_process import free_port


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.fixture
def tray(tmp_path, qwen_08b_dir):
    gguf = str(embedded_module().embedded_model_path())
    opener = Recorder({"folder": str(qwen_08b_dir), "gguf": gguf})
    settings = AppSettings(port=free_port())
    app = TrayApp(settings, Probe([], note="No usable GPU: no NVIDIA driver is installed. CPU mode."), opener,
                  supervisor_options={"poll_s": 0.05, "backoff_initial_s": 0.2})
    app.command_for = fake_command(tmp_path / "fake")
    app.start()
    assert app.supervisor.wait_ready(20)
    yield app, opener
    app.quit()


def ready(app: TrayApp) -> bool:
    return app.supervisor.wait_ready(20)


def test_every_menu_entry_does_what_it_says(tray, qwen_08b_dir, app_home):
    app, opener = tray
    base = app.resolved.base_url
    menu = app.entries()
    assert menu[0].label.startswith("Server ready at http://127.0.0.1:") and "on CPU" in menu[0].label
    assert "CPU mode" in menu[1].label

    by_label(menu, "Open chat").action()
    by_label(menu, "Open monitor").action()
    assert opener.calls[-2:] == [("chat", base + "/"), ("url", base + "/monitor/")]

    starts = len(app.supervisor.starts)
    for entry in by_label(menu, "Context").children[1:]:  # every context that fits
        assert entry.enabled
        entry.action()
        value = int(entry.label.replace(",", ""))
        assert app.settings.context == value and flag(app.resolved.command, "--max-context") == str(value)
        assert ready(app)
    assert len(app.supervisor.starts) == starts + 3  # 4,096 / 6,144 / 8,192: each restarts the server
    by_label(app.entries(), "Context", "Auto").action()
    assert app.settings.context is None

    for entry in by_label(app.entries(), "Concurrency").children:
        entry.action()
        lanes = flag(app.resolved.command, "--max-concurrency")
        assert entry.label.startswith("Auto") or entry.label.startswith(lanes + " (")
        assert ready(app)

    # the embedded model has no MTP head: drafts cannot be picked
    drafts = by_label(app.entries(), "Speculative drafts").children
    assert [d.label for d in drafts] == ["This model has no MTP head"] and not drafts[0].enabled

    by_label(app.entries(), "Model", "Choose checkpoint folder").action()
    assert app.settings.model == str(qwen_08b_dir) and app.settings.recent == [str(qwen_08b_dir)]
    assert app.resolved.command[1] == str(qwen_08b_dir) and ready(app)
    for entry in by_label(app.entries(), "Speculative drafts").children:  # Qwen3.5 has an MTP head
        entry.action()
        assert entry.checked is not None and ready(app)
    assert app.settings.drafts == 4 and app.resolved.plan.settings.drafts == 4

    by_label(app.entries(), "Model", "Choose GGUF file").action()
    assert app.settings.model.endswith(".gguf") and len(app.settings.recent) == 2
    by_label(app.entries(), "Model", str(qwen_08b_dir)).action()  # a recent model
    assert app.settings.model == str(qwen_08b_dir)
    by_label(app.entries(), "Model", "Embedded").action()
    assert app.settings.model is None and ready(app)

    by_label(app.entries(), "Share on local network").action()
    key = app.settings.api_key
    assert app.settings.share and key and len(key) >= 24
    assert flag(app.resolved.command, "--host") == "0.0.0.0" and flag(app.resolved.command, "--api-key") == key
    assert AppSettings.load().api_key == key  # stored
    assert (app_home / "settings.json").stat().st_mode & 0o077 == 0
    lan = [e for e in app.entries() if "?key=" in e.label]
    for entry in lan:
        entry.action()
        assert opener.calls[-1] == ("url", entry.label.split(": ", 1)[1])
    assert ready(app)
    by_label(app.entries(), "Share on local network").action()
    assert not app.settings.share and flag(app.resolved.command, "--host") is None
    assert ready(app)  # that restart has its server up before the next one is counted

    by_label(app.entries(), "View logs").action()
    assert opener.calls[-1] == ("path", str(log_dir() / "server.log"))
    starts = len(app.supervisor.starts)
    by_label(app.entries(), "Restart server").action()
    assert ready(app) and len(app.supervisor.starts) == starts + 1
    by_label(app.entries(), "Quit").action()
    assert app.quit_requested and app.supervisor.status.state == State.STOPPED

    # every entry with an action was reached above
    labels = {e.label.split(" (")[0] for _, e in walk(menu) if e.action is not None}
    assert {"Open chat", "Open monitor", "Auto", "View logs", "Restart server", "Quit",
            "Share on local network", "Choose checkpoint folder...", "Choose GGUF file..."} <= labels


def test_a_setting_that_does_not_fit_is_refused_and_nothing_restarts(tray):
    app, opener = tray
    starts = len(app.supervisor.starts)
    assert not app.apply(context=10_000_000)
    assert opener.calls[-1][0] == "notify" and "Not changed:" in opener.calls[-1][1]
    assert app.settings.context is None and len(app.supervisor.starts) == starts
    time.sleep(0.3)
    assert app.supervisor.status.state == State.READY


def test_crashes_show_in_the_headline(tray, tmp_path):
    app, _ = tray
    app.supervisor.restart([*app.supervisor.config.command, "--crash-first", "99", "--exit-code", "3"])
    deadline = time.monotonic() + 10
    while app.supervisor.status.state != State.BACKOFF and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "restarting in" in app.headline() and "crashed" in app.headline()


def test_chat_window_falls_back_to_the_browser_without_pywebview(monkeypatch):
    """pywebview runs in its own process; where it is missing (or has no GUI backend) that process
    exits at once with NO_WEBVIEW and the default browser opens instead."""
    import importlib.util

    from ninfer.app import window

    opened = []
    monkeypatch.setattr(window, "open_browser", opened.append)
    monkeypatch.setattr(window._wsl, "in_wsl", lambda: False)
    proc = window.open_window("http://127.0.0.1:1/")
    if importlib.util.find_spec("webview") is None:
        assert proc is None and opened == ["http://127.0.0.1:1/"]
    else:  # a real window may have opened: close it
        if proc is not None:
            proc.kill()
    code = window.main(["http://127.0.0.1:1/"]) if importlib.util.find_spec("webview") is None else None
    assert code in (None, window.NO_WEBVIEW)


def test_a_menu_that_fails_is_logged_and_the_icon_keeps_answering(monkeypatch, caplog):
    """The popup runs inside pystray's event loop: whatever goes wrong there is logged and the
    next click is answered, never an exception that ends the loop (a dead icon)."""
    import subprocess

    from ninfer.app.tray import TrayIcon

    class App:
        calls = 0

        def entries(self):
            App.calls += 1
            if App.calls == 1:
                raise RuntimeError("the plan broke")
            return []

    icon = object.__new__(TrayIcon)  # no display: the popup's own logic
    icon.app = App()
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "TclError: no display"))
    with caplog.at_level("ERROR", logger="ninfer.app"):
        icon.popup()
        icon.popup()
    messages = [r.getMessage() for r in caplog.records]
    assert any("the tray menu failed" in m for m in messages) and caplog.records[0].exc_info[1].args == ("the plan broke",)
    assert any("exit 1" in m and "TclError: no display" in m for m in messages)
    assert App.calls == 2
