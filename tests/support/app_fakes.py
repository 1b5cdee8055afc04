"""Stand-ins for the tray launcher's tests (tests/app): the fake server command and an opener
that records what the tray asked to open."""
from __future__ import annotations

import sys
from pathlib import Path

FAKE_SERVER = Path(__file__).resolve().parents[1] / "app" / "fake_server.py"


def fake_command(state: Path):
    """TrayApp.command_for: run tests/app/fake_server.py on the port the plan resolved."""
    state.mkdir(parents=True, exist_ok=True)
    return lambda resolved: [sys.executable, str(FAKE_SERVER), "--port", str(resolved.port), "--state", str(state)]


class Recorder:
    """TrayApp's opener: records calls; ``choose`` answers from ``choices``; with ``log`` set,
    each call is also appended to that file (for a tray running in another process)."""

    def __init__(self, choices: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.choices = choices or {}
        self.log = log

    def _record(self, kind: str, value: str) -> None:
        self.calls.append((kind, value))
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(f"{kind} {value}\n")

    def chat(self, url):
        self._record("chat", url)

    def url(self, url):
        self._record("url", url)

    def path(self, path):
        self._record("path", path)

    def choose(self, kind):
        self._record("choose", kind)
        return self.choices.get(kind)

    def notify(self, text):
        self._record("notify", text)
