"""Images in through the real clients: the openai SDK (Chat ``image_url`` data URIs, Responses
``input_image``) and the anthropic SDK (base64 ``image`` blocks) against a server on a tiny
random Qwen3.5 with its vision tower (``--vision``, the engine in a process of its own). Each
gets an answer; the counted input tokens (``input_tokens`` / ``count_tokens``) equal the
answer's usage and include the image's tokens; a broken image is a 400 ``invalid_media`` naming
its part; a URL is refused; a server without ``--vision`` says so."""
from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.tiny import save_tiny_qwen3_5_vl, tiny_png

MODEL = "tiny-vl"
PNG = tiny_png(40, 24, seed=3)  # 6 x 10 patches: 15 tokens
DATA_URI = "data:image/png;base64," + base64.b64encode(PNG).decode()
IMAGE_TOKENS = 15


def serve(path, *flags):
    state, loop = build_state(build_parser().parse_args([str(path), "--model-id", MODEL, "--max-context", "512",
                                                         *flags]))
    loop.start()
    return state, loop


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = save_tiny_qwen3_5_vl(tmp_path_factory.mktemp("vl") / MODEL)
    return path


@pytest.fixture(scope="module")
def served(ckpt):
    state, loop = serve(ckpt, "--vision")
    with LiveServer(create_app(state)) as live:
        yield live, state
    loop.stop()


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0)


def chat_messages(uri: str = DATA_URI) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is in the picture?"},
                                         {"type": "image_url", "image_url": {"url": uri}}]}]


def text_tokens(state, text: str) -> int:
    return len(state.tokenizer.encode(text))


def test_chat_image_url(served, oai):
    _, state = served
    out = oai.chat.completions.create(model=MODEL, messages=chat_messages(), max_tokens=8, temperature=0)
    assert out.choices[0].message.content is not None and out.usage.completion_tokens > 0
    rendered = ("<|im_start|>user\nWhat is in the picture?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                "<|im_start|>assistant\n")
    assert out.usage.prompt_tokens == text_tokens(state, rendered) + IMAGE_TOKENS - 1
    # another image of the same size: the same count, another answer's prompt
    other = "data:image/png;base64," + base64.b64encode(tiny_png(40, 24, seed=4, noise=True)).decode()
    again = oai.chat.completions.create(model=MODEL, messages=chat_messages(other), max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens == out.usage.prompt_tokens


def test_responses_input_image_counted_as_used(oai):
    content = [{"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": DATA_URI}]
    items = [{"role": "user", "content": content}]
    count = oai.responses.input_tokens.count(model=MODEL, input=items)
    out = oai.responses.create(model=MODEL, input=items, max_output_tokens=8, temperature=0)
    assert out.status in ("completed", "incomplete") and out.usage.output_tokens > 0
    assert count.input_tokens == out.usage.input_tokens
    text_only = oai.responses.input_tokens.count(model=MODEL, input=[{"role": "user", "content": content[:1]}])
    assert count.input_tokens > text_only.input_tokens + IMAGE_TOKENS - 2


def test_anthropic_image_block(served):
    client = anthropic.Anthropic(base_url=served[0].base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}},
        {"type": "text", "text": "What is this?"}]}]
    count = client.messages.count_tokens(model=MODEL, messages=messages)
    out = client.messages.create(model=MODEL, messages=messages, max_tokens=8)
    assert out.usage.output_tokens > 0 and out.content
    assert count.input_tokens == out.usage.input_tokens
    text_only = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "What is this?"}])
    assert count.input_tokens >= text_only.input_tokens + IMAGE_TOKENS


def test_broken_image_names_its_part(oai, served):
    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really an image").decode()
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=chat_messages(broken), max_tokens=4)
    body = err.value.body
    assert body["code"] == "invalid_media" and body["param"] == "messages[0].content[1]"

    client = anthropic.Anthropic(base_url=served[0].base_url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!notbase64!!"}}]}])
    assert "messages[0].content[1]" in str(aerr.value)


def test_remote_image_refused(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=chat_messages("https://example.com/cat.png"), max_tokens=4)
    assert err.value.body["code"] == "remote_media_disabled"
    assert "--allow-remote-media" in err.value.body["message"]


def test_without_vision_an_image_is_refused(ckpt):
    state, loop = serve(ckpt, "--engine-thread")
    try:
        with LiveServer(create_app(state)) as live:
            client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model=MODEL, messages=chat_messages(), max_tokens=4)
            assert err.value.body["code"] == "vision_disabled" and "--vision" in err.value.body["message"]
            # text alone is served
            assert client.chat.completions.create(model=MODEL, max_tokens=2,
                                                  messages=[{"role": "user", "content": "Hi"}]).choices
    finally:
        loop.stop()


def images_encoded(served) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(served[0].base_url + "/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "ninfer_images_encoded_total")


def test_returning_conversation_goes_on_past_its_image(served, oai):
    """The second turn resends the image in its history: the prompt goes on from the first turn's
    checkpoint, past the image, and the vision tower does not run again."""
    image = "data:image/png;base64," + base64.b64encode(tiny_png(48, 32, seed=9)).decode()  # a new image
    first_turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                               {"type": "text", "text": "What is this?"}]}]
    before = images_encoded(served)
    first = oai.chat.completions.create(model=MODEL, messages=first_turn, max_tokens=6, temperature=0)
    assert images_encoded(served) == before + 1
    history = first_turn + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "And the colours?"}]
    second = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0)
    # the turn's opening, the vision start token and the 6 x 8 / 4 image tokens: all reused, and
    # the rest of the first turn up to its generation prompt (the first prompt's checkpoint)
    image_end = text_tokens(served[1], "<|im_start|>user\n<|vision_start|>") + 12
    generation_prompt = text_tokens(served[1], "<|im_start|>assistant\n")
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - generation_prompt > image_end
    assert images_encoded(served) == before + 1


def test_anthropic_image_in_a_tool_result(served):
    """A tool result may carry an image: it is read and counted as one in a user turn."""
    client = anthropic.Anthropic(base_url=served[0].base_url, api_key="none", max_retries=0)
    tool = {"name": "screenshot", "description": "Take a screenshot", "input_schema": {"type": "object"}}

    def messages(result_content):
        return [{"role": "user", "content": "Take a screenshot."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result_content}]}]

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}
    with_image = client.messages.count_tokens(model=MODEL, tools=[tool], messages=messages([image]))
    without = client.messages.count_tokens(model=MODEL, tools=[tool], messages=messages([]))
    assert with_image.input_tokens >= without.input_tokens + IMAGE_TOKENS
    out = client.messages.create(model=MODEL, tools=[tool], max_tokens=6, messages=messages([image]))
    assert out.usage.input_tokens == with_image.input_tokens


def test_responses_image_in_a_function_result(oai):
    """A function_call_output's parts may hold an image: read and counted in the tool turn."""
    call = {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"}
    tools = [{"type": "function", "name": "screenshot", "parameters": {"type": "object", "properties": {}}}]

    def items(output):
        return [{"role": "user", "content": "Take a screenshot."}, call,
                {"type": "function_call_output", "call_id": "c1", "output": output}]

    image = [{"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": DATA_URI}]
    with_image = oai.responses.input_tokens.count(model=MODEL, tools=tools, input=items(image))
    without = oai.responses.input_tokens.count(model=MODEL, tools=tools, input=items("here"))
    assert with_image.input_tokens >= without.input_tokens + IMAGE_TOKENS
    broken = [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.input_tokens.count(model=MODEL, tools=tools, input=items(broken))
    assert err.value.body["code"] == "invalid_media" and err.value.body["param"] == "input[2].output[0]"


def test_images_in_flight_are_bounded(served, oai):
    """--media-live-mib: the images of requests in flight are counted until each ends; past the
    bound a request is a 429 ``media_overloaded``, but one alone always goes."""
    from ninfer.engine.vision.media import expand_images
    from ninfer.server.errors import APIError

    _, state = served
    media = state.media
    assert media.held == 0
    oai.chat.completions.create(model=MODEL, messages=chat_messages(), max_tokens=2)
    assert media.held == 0  # released when the request ended
    image = media.processor.process_bytes(PNG)
    _, prompt = expand_images([media.image_token_id], [image], media.image_token_id)
    limit = media.live_bytes
    try:
        media.live_bytes = image.nbytes  # room for one such image
        first = media.hold(prompt)
        with pytest.raises(APIError) as err:
            media.hold(prompt)
        assert err.value.status == 429 and err.value.code == "media_overloaded"
        media.release(first)
        media.release(media.hold(prompt))
        media.live_bytes = 1  # smaller than any image: one alone still goes
        media.release(media.hold(prompt))
    finally:
        media.live_bytes = limit
    assert media.held == 0


def test_remote_image_fetched_when_allowed(served, oai):
    """--allow-remote-media (set here on the running server's settings): an http URL is fetched
    and read as the same image sent inline; a missing one is a 400 ``invalid_media`` naming it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Images(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path != "/cat.png":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    media = served[1].media
    media.allow_remote = True
    try:
        inline = oai.chat.completions.create(model=MODEL, messages=chat_messages(), max_tokens=4, temperature=0)
        remote = oai.chat.completions.create(model=MODEL, messages=chat_messages(base + "/cat.png"), max_tokens=4,
                                             temperature=0)
        assert remote.usage.prompt_tokens == inline.usage.prompt_tokens
        assert remote.choices[0].message.content == inline.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL, messages=chat_messages(base + "/dog.png"), max_tokens=4)
        assert err.value.body["code"] == "invalid_media" and "404" in err.value.body["message"]
        assert err.value.body["param"] == "messages[0].content[1]"
    finally:
        media.allow_remote = False
        httpd.shutdown()
