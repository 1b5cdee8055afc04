"""The monitor at /monitor/ in Chromium: live numbers from /stats while the chat page generates."""
from __future__ import annotations

import pytest
from playwright.sync_api import expect

from support.browser import KEY, MODEL, PHONE, ChatPage, screenshot

pytestmark = pytest.mark.slow


def number(locator) -> float:
    text = locator.inner_text().replace(",", "")
    return float(text) if text not in ("", "–") else 0.0


def test_decode_rate_moves_while_a_request_runs(context, server):
    monitor = context.new_page()
    monitor.goto(f"{server.base_url}/monitor/?key={KEY}")
    expect(monitor.get_by_test_id("model")).to_contain_text(MODEL)
    assert "key=" not in monitor.url
    decode = monitor.get_by_test_id("decode-tps")
    running = monitor.get_by_test_id("running")
    expect(running).to_have_text("0")
    monitor.wait_for_timeout(1500)
    idle = number(decode)

    chat = ChatPage.open(context, server.base_url)  # same profile: the key is remembered
    chat.configure(max_tokens=120, temperature=0.7)
    chat.send("Tell me about the history of the bicycle, in several paragraphs.")
    expect(running).to_have_text("1", timeout=10_000)
    monitor.wait_for_function(
        "() => parseFloat(document.querySelector('[data-testid=decode-tps]').textContent) > 0", timeout=15_000)
    busy = number(decode)
    assert busy > idle and busy > 0
    monitor.wait_for_timeout(4000)  # a few seconds of chart for the screenshot
    expect(monitor.get_by_test_id("banner")).to_be_hidden()
    screenshot(monitor, "monitor-desktop")
    monitor.set_viewport_size(PHONE)
    monitor.wait_for_timeout(500)
    screenshot(monitor, "monitor-phone")
    monitor.set_viewport_size({"width": 1280, "height": 800})

    chat.wait_answer()
    expect(running).to_have_text("0", timeout=10_000)
    recent = monitor.get_by_test_id("recent")
    expect(recent.locator("tbody tr").first).not_to_contain_text("No finished requests", timeout=5000)
    monitor.wait_for_function(
        "() => parseFloat(document.querySelector('[data-testid=decode-tps]').textContent || '0') === 0 "
        "|| document.querySelector('[data-testid=decode-tps]').textContent === '–'", timeout=10_000)

    # the conversation returns: its turn goes on from a checkpoint, and the prefix-cache card says so
    hits = number(monitor.get_by_test_id("cache-hits-gpu"))
    chat.send("And the tricycle?")
    chat.wait_answer()
    monitor.wait_for_function(
        "(before) => parseFloat(document.querySelector('[data-testid=cache-hits-gpu]').textContent.replace(/,/g, ''))"
        " > before", arg=hits, timeout=10_000)
    assert number(monitor.get_by_test_id("cache-hit")) > 0
    expect(monitor.get_by_test_id("cache-kept-gpu")).not_to_have_text("–")


def test_monitor_without_the_key_says_it_is_unauthorised(context, server):
    page = context.new_page()
    page.goto(f"{server.base_url}/monitor/")
    expect(page.get_by_test_id("banner")).to_contain_text("Unauthorised")
