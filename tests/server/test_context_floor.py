"""A prompt that cannot fit the context even at the tokenizer's longest token is refused with the
same 400 ``context_length_exceeded`` as one counted in full, naming the same field, and without
being tokenized; a prompt one token short of the context at that longest token is served."""
from __future__ import annotations

import re

import httpx
import pytest

from support.scripted import scripted_servers
from support.tiny import longest_token_text


@pytest.fixture
def serve():
    with scripted_servers("Hi.") as start:
        yield start


@pytest.fixture
def encoded(monkeypatch):
    """Installs a spy on a state's tokenizer: the length of every text it encodes."""
    def install(state) -> list[int]:
        lengths: list[int] = []
        tok = state.tokenizer
        encode, literal = tok.encode, tok.encode_literal
        monkeypatch.setattr(tok, "encode", lambda text: (lengths.append(len(text)), encode(text))[1])
        monkeypatch.setattr(tok, "encode_literal", lambda text: (lengths.append(len(text)), literal(text))[1])
        return lengths

    return install


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"], err["type"]) == ("context_length_exceeded", param, "invalid_request_error")
    return err["message"]


ROUTES = [  # path, body for a prompt text, the field named
    ("/v1/chat/completions", lambda text: {"model": "scripted", "messages": [{"role": "user", "content": text}]},
     "messages"),
    ("/v1/chat/completions",  # a control token in the text: the guard's markers are left out of the count
     lambda text: {"model": "scripted", "messages": [{"role": "user", "content": "<|im_end|>" + text}]}, "messages"),
    ("/v1/completions", lambda text: {"model": "scripted", "prompt": text}, "prompt"),
    ("/v1/responses", lambda text: {"model": "scripted", "input": text}, "input"),
    ("/v1/responses/input_tokens", lambda text: {"model": "scripted", "input": text}, "input"),
    ("/completion", lambda text: {"prompt": text}, "prompt"),
    ("/completion", lambda text: {"prompt": [1, 2, text]}, "prompt"),
]


@pytest.mark.parametrize("path, body, param", ROUTES)
def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(serve, encoded, path, body, param):
    server, state = serve()
    lengths = encoded(state)
    size = state.tokenizer.max_token_bytes * state.max_context + 1  # cannot fit at the longest token
    with httpx.Client(timeout=120) as client:
        message = refused(client.post(server.base_url + path, json=body("x" * size)), param)
        least = int(re.search(r"has at least (\d+) tokens", message).group(1))
        assert least >= -(-size // state.tokenizer.max_token_bytes) > state.max_context
        assert max(lengths, default=0) < 100, "the long prompt was tokenized"
        assert client.get(server.base_url + "/health").json()["status"] == "ok"


def test_the_floor_refuses_nothing_that_fits(serve, encoded):
    """At the longest token every token holds ``max_token_bytes`` bytes: the floor is the exact
    count there, so the prompt one token short of the context is tokenized and served."""
    server, state = serve("--max-context", "512")
    lengths = encoded(state)
    longest = longest_token_text(state.tokenizer)
    with httpx.Client(timeout=120) as client:
        r = client.post(server.base_url + "/v1/completions",
                        json={"model": "scripted", "prompt": longest * 511, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 511
        assert max(lengths) == len(longest * 511)
        lengths.clear()
        message = refused(client.post(server.base_url + "/v1/completions",
                                      json={"model": "scripted", "prompt": longest * 512, "max_tokens": 1}), "prompt")
        assert "at least 512 tokens" in message and max(lengths, default=0) < 100
        # a floor below the context but more tokens than it holds: counted in full, refused by the count
        text = longest * 510 + "x y z"
        count = len(state.tokenizer.encode(text))
        assert state.tokenizer.min_tokens(text) < 512 <= count
        message = refused(client.post(server.base_url + "/v1/completions",
                                      json={"model": "scripted", "prompt": text, "max_tokens": 1}), "prompt")
        assert f"has {count} tokens" in message
