"""Browser tests: Debian's Chromium, driven by Playwright, against a real server on the embedded model.

The server requires an API key; the pages get it from a ``?key=`` link, as a phone on the LAN
would. Every request a page makes is recorded, and a test fails if one leaves the server.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.browser import CHROMIUM, CHROMIUM_ARGS, DESKTOP, KEY, Stats, Traffic
from support.server_process import ROOT, ServerProcess


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("web") / "server.log"
    proc = ServerProcess([str(ROOT / "launchers" / "serve.sh"), "--api-key", KEY], log)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: ./launchers/test.sh installs Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def traffic():
    return Traffic()


@pytest.fixture
def context(browser, server, traffic):
    """A fresh browser profile (empty storage) whose every request is checked at the end."""
    ctx = browser.new_context(viewport=DESKTOP, accept_downloads=True)
    ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.base_url)
    ctx.on("request", traffic.record)
    yield ctx
    ctx.close()
    assert traffic.urls, "the pages made no request at all"
    assert traffic.foreign(server.base_url) == [], "a page sent requests somewhere other than the server"


@pytest.fixture
def stats(server):
    return Stats(server.base_url)
