"""The chat page with images: a person attaches an image (file picker or paste), sees it in the
conversation, the answer streams in from a server with ``--vision`` (a tiny random Qwen3.5 with its
vision tower, served in this process), and the export keeps the image."""
from __future__ import annotations

import base64
import json

import pytest
from playwright.sync_api import expect

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.browser import KEY, ChatPage
from support.live_server import LiveServer
from support.tiny import save_tiny_qwen3_5_vl, tiny_png

pytestmark = pytest.mark.slow
MODEL = "tiny-vl"
PNG = tiny_png(40, 24, seed=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Overrides the suite's server (the embedded model) for this module's pages."""
    path, _ = save_tiny_qwen3_5_vl(tmp_path_factory.mktemp("vl") / MODEL)
    state, loop = build_state(build_parser().parse_args([str(path), "--model-id", MODEL, "--max-context", "512",
                                                         "--vision", "--engine-thread", "--api-key", KEY]))
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield live
    loop.stop()


def open_chat(context, base_url: str) -> ChatPage:
    page = context.new_page()
    page.goto(f"{base_url}/?key={KEY}")
    chat = ChatPage(page)
    expect(chat.by("model")).to_contain_text(MODEL, timeout=15_000)
    return chat


def test_attached_image_is_sent_shown_and_exported(context, server, tmp_path):
    chat = open_chat(context, server.base_url)
    chat.configure(max_tokens=8, temperature=0)
    bodies = []
    chat.page.on("request", lambda r: bodies.append(r.post_data) if r.url.endswith("/v1/chat/completions") else None)

    chat.page.set_input_files("[data-testid=attach-file]",
                              files=[{"name": "picture.png", "mimeType": "image/png", "buffer": PNG}])
    expect(chat.by("attachment")).to_have_count(1)
    chat.send("What is in the picture?")
    text, timing = chat.wait_answer()
    assert timing.split()[0].isdigit() and int(timing.split()[0]) > 0

    expect(chat.by("attachments")).to_be_hidden()  # sent with the message
    shown = chat.by("message-user").get_by_test_id("message-image")
    expect(shown).to_have_count(1)
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    assert shown.get_attribute("src") == uri
    sent = json.loads(bodies[-1])["messages"][-1]["content"]
    assert {"type": "image_url", "image_url": {"url": uri}} in sent
    assert {"type": "text", "text": "What is in the picture?"} in sent

    with chat.page.expect_download() as download:
        chat.by("export-one").click()
    exported = tmp_path / download.value.suggested_filename
    download.value.save_as(exported)
    conv = json.loads(exported.read_text())
    conv = conv[0] if isinstance(conv, list) else conv.get("conversations", [conv])[0]
    assert conv["messages"][0]["images"] == [uri]


def test_pasted_image_is_attached(context, server):
    chat = open_chat(context, server.base_url)
    chat.page.evaluate("""async (b64) => {
        const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], "pasted.png", {type: "image/png"}));
        const input = document.getElementById("input");
        input.dispatchEvent(new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true}));
    }""", base64.b64encode(PNG).decode())
    expect(chat.by("attachment")).to_have_count(1)
    chat.page.get_by_title("Remove").click()
    expect(chat.by("attachments")).to_be_hidden()
