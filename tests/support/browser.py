"""Helpers for the browser tests (tests/web): Chromium settings, request recording, the chat page."""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from .server_process import ROOT

CHROMIUM = os.environ.get("NINFER_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium reaches out to the internet on its own.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
KEY = "web-test-key"
MODEL = "smollm2-135m-instruct"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = ROOT / "docs" / "screenshots"
TIMING = re.compile(r"^\d+ tokens · [\d.]+ tok/s · TTFT [\d.]+ m?s")


class Traffic:
    """Every URL the pages of one browser context asked for."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    def record(self, request) -> None:
        self.urls.append(request.url)

    def foreign(self, origin: str) -> list[str]:
        out = []
        for url in self.urls:
            if url.startswith("data:"):
                continue  # inline data, no network
            parts = urlsplit(url[5:] if url.startswith("blob:") else url)
            if f"{parts.scheme}://{parts.netloc}" != origin:
                out.append(url)
        return out


class Stats:
    """The server's /stats, read the way a script would (with the key)."""

    def __init__(self, base_url: str) -> None:
        self.url = base_url + "/stats"

    def get(self) -> dict:
        response = httpx.get(self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        response.raise_for_status()
        return response.json()

    def running(self) -> int:
        return self.get()["requests"]["running"]

    def wait(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.get()
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"/stats never showed {what} within {timeout} s: {stats['requests']}")
            time.sleep(0.1)


def screenshot(page, name: str) -> Path:
    """Write docs/screenshots/NAME.png; the README shows the committed ones."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


class ChatPage:
    """The chat page at /, operated through what a person sees and clicks."""

    def __init__(self, page) -> None:
        self.page = page

    @classmethod
    def open(cls, context, base_url: str, key: str | None = KEY) -> "ChatPage":
        page = context.new_page()
        page.goto(base_url + "/" + (f"?key={key}" if key else ""))
        chat = cls(page)
        if key:
            chat.wait_ready()
        return chat

    def by(self, test_id: str):
        return self.page.get_by_test_id(test_id)

    def wait_ready(self) -> None:
        from playwright.sync_api import expect

        expect(self.by("model")).to_contain_text(MODEL, timeout=15_000)

    def configure(self, **settings) -> None:
        """Set fields of the settings dialog (max_tokens=48, temperature=0, system=..., thinking=True)."""
        self.by("settings").click()
        dialog = self.by("settings-dialog")
        for name, value in settings.items():
            field = dialog.locator(f"[name={name}]")
            if isinstance(value, bool):
                field.set_checked(value)
            else:
                field.fill("" if value is None else str(value))
        self.by("settings-save").click()

    def send(self, text: str) -> None:
        self.by("input").fill(text)
        self.by("send").click()

    def assistant(self, index: int = -1):
        answers = self.by("message-assistant")
        return answers.nth(index if index >= 0 else answers.count() + index)

    def wait_answer(self, timeout: float = 60) -> tuple[str, str]:
        """Wait until the last answer is complete; its (text, timing line)."""
        from playwright.sync_api import expect

        expect(self.by("send")).to_be_visible(timeout=timeout * 1000)
        last = self.assistant()
        timing = last.get_by_test_id("timing")
        expect(timing).not_to_be_empty(timeout=5000)
        return last.get_by_test_id("answer").inner_text(), timing.inner_text()

    def wait_for_error(self, title: str) -> None:
        from playwright.sync_api import expect

        expect(self.by("send")).to_be_visible(timeout=30_000)
        expect(self.assistant().get_by_test_id("message-error")).to_contain_text(title)
