"""The chat page at / in Chromium: streaming, timings, stop, reload, export / import, key, markdown."""
from __future__ import annotations

import json
import time

import pytest
from playwright.sync_api import expect

from support.browser import KEY, MODEL, PHONE, TIMING, ChatPage, screenshot

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France?"


def record_answer_growth(page) -> None:
    """Note every length the last answer's text takes, to tell a stream from a single paint."""
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('[data-testid=message-assistant] [data-testid=answer]');
            const last = answers[answers.length - 1];
            if (last) window.__lengths.push(last.innerText.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")


def test_answer_streams_in_with_its_timing_line(context, server):
    chat = ChatPage.open(context, server.base_url)
    assert "key=" not in chat.page.url, "the key stays out of the address bar once it is remembered"
    chat.configure(max_tokens=48, temperature=0)
    record_answer_growth(chat.page)
    chat.send(QUESTION)
    expect(chat.by("stop")).to_be_visible()
    text, timing = chat.wait_answer()

    assert "Paris" in text
    lengths = [n for n in chat.page.evaluate("window.__lengths") if n > 0]
    assert len(set(lengths)) >= 3, f"the answer appeared in one piece, not streamed: {lengths}"
    assert TIMING.match(timing), timing
    tokens = int(timing.split()[0])
    assert 0 < tokens <= 48
    expect(chat.by("stop")).to_be_hidden()
    expect(chat.by("message-user")).to_have_text(QUESTION)
    expect(chat.page.locator("#conv-title")).to_have_text(QUESTION)


def test_stop_cancels_the_request_on_the_server(context, server, stats):
    chat = ChatPage.open(context, server.base_url)
    chat.configure(max_tokens=2000, temperature=0.8)
    chat.send("Write a very long story about a dragon who learns to bake bread. Use many chapters.")
    answer = chat.page.get_by_test_id("answer")
    chat.page.wait_for_function(
        "() => (document.querySelector('[data-testid=answer]')?.innerText || '').length > 40", timeout=30_000)
    assert stats.running() == 1, "the request is running while its answer streams in"

    chat.by("stop").click()
    stats.wait(lambda s: s["requests"]["running"] == 0, timeout=10, what="the stopped request leaving")
    expect(chat.by("send")).to_be_visible()
    stopped_text = answer.inner_text()
    assert len(stopped_text) > 40
    expect(chat.assistant().get_by_test_id("timing")).to_contain_text("stopped")
    time.sleep(1.0)
    assert answer.inner_text() == stopped_text, "no text arrives after Stop"


def test_conversation_survives_reload_and_round_trips_through_export(context, server, tmp_path):
    chat = ChatPage.open(context, server.base_url)
    chat.configure(max_tokens=32, temperature=0)
    chat.send(QUESTION)
    text, timing = chat.wait_answer()

    chat.page.reload()
    chat.wait_ready()
    conversations = chat.by("conversation")
    expect(conversations).to_have_count(1)
    expect(conversations.first).to_contain_text(QUESTION)
    expect(chat.by("message-user")).to_have_text(QUESTION)
    expect(chat.assistant().get_by_test_id("answer")).to_have_text(text)
    expect(chat.assistant().get_by_test_id("timing")).to_have_text(timing)

    # rename, so that the export carries a name of the user's
    conversations.first.hover()
    conversations.first.get_by_test_id("rename").click()
    chat.by("rename-input").fill("Capitals")
    chat.by("rename-input").press("Enter")
    expect(chat.by("conversation").first).to_contain_text("Capitals")

    with chat.page.expect_download() as download:
        chat.by("export-one").click()
    exported = tmp_path / download.value.suggested_filename
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert data["format"] == "ninfer.conversations"
    (conv,) = data["conversations"]
    assert conv["title"] == "Capitals"
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][0]["content"] == QUESTION
    assert conv["messages"][1]["timings"]["predicted_n"] > 0

    delete = chat.by("conversation").first.get_by_test_id("delete")
    delete.click()
    delete.click()  # the second click confirms
    expect(chat.by("conversation")).to_have_count(0)
    expect(chat.by("empty")).to_be_visible()

    chat.by("import-file").set_input_files(str(exported))
    expect(chat.by("conversation")).to_have_count(1)
    expect(chat.by("conversation").first).to_contain_text("Capitals")
    expect(chat.by("message-user")).to_have_text(QUESTION)
    expect(chat.assistant().get_by_test_id("answer")).to_have_text(text)
    expect(chat.assistant().get_by_test_id("timing")).to_have_text(timing)

    chat.page.reload()
    expect(chat.by("conversation")).to_have_count(1)


def test_a_page_without_the_key_says_it_is_unauthorised(context, server):
    chat = ChatPage.open(context, server.base_url, key=None)
    expect(chat.by("banner")).to_contain_text("Unauthorised")
    chat.configure(api_key=KEY)
    chat.wait_ready()
    expect(chat.by("banner")).to_be_hidden()


def test_errors_say_what_to_do(context, server):
    chat = ChatPage.open(context, server.base_url)
    chat.configure(max_tokens=8)
    chat.send("word " * 9000)  # longer than the embedded model's 8192-token context
    chat.wait_for_error("Too long for the model's context")
    expect(chat.assistant().get_by_test_id("message-error")).to_contain_text("tokens")

    # a full queue takes dozens of concurrent requests to reach on this server: answer one
    # request with the server's own 429 envelope instead
    def overloaded(route):
        route.fulfill(status=429, content_type="application/json", body=json.dumps({"error": {
            "message": "server is at capacity (68 outstanding requests); retry later",
            "type": "rate_limit_error", "param": None, "code": "server_overloaded"}}))

    chat.page.route("**/v1/chat/completions", overloaded, times=1)
    chat.send(QUESTION)
    chat.wait_for_error("The server is busy: its request queue is full")


def test_edit_and_resend_then_regenerate(context, server):
    chat = ChatPage.open(context, server.base_url)
    chat.configure(max_tokens=24, temperature=0)
    chat.send("What is the capital of Italy?")
    chat.wait_answer()

    chat.by("message-user").hover()
    chat.by("edit").click()
    chat.by("edit-input").fill(QUESTION)
    chat.by("edit-send").click()
    text, _ = chat.wait_answer()
    expect(chat.by("message-user")).to_have_count(1)
    expect(chat.by("message-user")).to_have_text(QUESTION)
    assert "Paris" in text

    chat.assistant().hover()
    chat.assistant().get_by_test_id("regenerate").click()
    again, _ = chat.wait_answer()
    expect(chat.by("message-assistant")).to_have_count(1)
    assert again == text, "greedy decoding gives the same answer again"


def test_markdown_code_and_reasoning_render_safely(context, server, tmp_path):
    """An imported reply with code, reasoning, raw HTML and a remote image: highlighted, collapsible,
    escaped, and nothing fetched (the context's request check fails the test otherwise)."""
    reply = ("Here is the function:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
             "<img src=\"http://203.0.113.9/x.png\" onerror=\"alert(1)\"> and ![chart](http://203.0.113.9/c.png)")
    file = tmp_path / "conv.json"
    file.write_text(json.dumps({"title": "Markdown", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add two numbers in Python"},
        {"role": "assistant", "content": "<think>The user wants a function.</think>" + reply},
    ]}))
    chat = ChatPage.open(context, server.base_url)
    chat.by("import-file").set_input_files(str(file))
    answer = chat.assistant()
    code = answer.locator(".code-block code")
    expect(code).to_have_text("def add(a, b):\n    return a + b")
    expect(code.locator(".hljs-keyword").first).to_have_text("def")
    expect(answer.locator("img")).to_have_count(0)
    expect(answer.get_by_test_id("answer")).to_contain_text('<img src="http://203.0.113.9/x.png"')

    reasoning = answer.get_by_test_id("reasoning")
    expect(reasoning).to_be_visible()
    expect(reasoning).not_to_have_attribute("open", "")
    expect(reasoning.locator("summary")).to_contain_text("Reasoning")
    reasoning.locator("summary").click()
    expect(reasoning).to_contain_text("The user wants a function.")
    expect(answer.get_by_test_id("answer")).not_to_contain_text("The user wants")

    answer.locator(".copy-code").click()
    expect(answer.locator(".copy-code")).to_have_text("Copied")
    assert chat.page.evaluate("navigator.clipboard.readText()") == "def add(a, b):\n    return a + b"


def test_screenshots_of_the_chat(context, server):
    chat = ChatPage.open(context, server.base_url)
    chat.configure(max_tokens=160, temperature=0)
    chat.send("Write a Python function that reverses a string, with a short explanation.")
    chat.wait_answer()
    chat.page.mouse.move(0, 0)
    screenshot(chat.page, "chat-desktop")

    phone = context.new_page()
    phone.set_viewport_size(PHONE)
    phone.goto(server.base_url + "/")
    ChatPage(phone).wait_ready()
    expect(phone.get_by_test_id("timing")).not_to_be_empty()
    screenshot(phone, "chat-phone")
    phone.get_by_role("button", name="Conversations").click()
    expect(phone.get_by_test_id("conversation")).to_be_in_viewport()
    phone.wait_for_timeout(300)  # the drawer's slide
    screenshot(phone, "chat-phone-conversations")
    assert MODEL in phone.get_by_test_id("model").inner_text()
