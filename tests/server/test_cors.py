"""CORS as llama-server has it: without ``--cors`` pages served from this machine (any port;
localhost, 127.0.0.1, [::1]) may call the API, preflights included; other origins only when
``--cors`` names them (the ``localhost`` keyword keeps the local pages)."""
from __future__ import annotations

import httpx
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import gateway_settings
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.scripted import scripted_state

KEY = "cors-key"
LOCAL = ["http://localhost:5173", "http://127.0.0.1:8000", "http://[::1]:3000", "https://localhost",
         "http://localhost"]
FOREIGN = ["https://app.example", "http://localhost.evil.example", "http://127.0.0.1.evil.example:80",
           "http://evil.example/?http://localhost", "null"]


def preflight(client: httpx.Client, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return client.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                         "Access-Control-Request-Headers": "authorization, content-type"})


@pytest.fixture(scope="module")
def servers():
    started = []

    def start(*args: str) -> httpx.Client:
        state, loop = scripted_state({}, "Hi.", "--api-key", KEY, "--no-thinking", *args)
        loop.start()
        live = LiveServer(create_app(state)).__enter__()
        started.append((live, loop))
        return httpx.Client(base_url=live.base_url, timeout=30)

    yield start
    for live, loop in started:
        live.__exit__(None, None, None)
        loop.stop()


@pytest.fixture(scope="module")
def default(servers):
    return servers()


@pytest.mark.parametrize("origin", LOCAL)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion", "/v1/embeddings"])
def test_default_reflects_local_origins_in_preflights(default, origin, path):
    r = preflight(default, origin, path)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


@pytest.mark.parametrize("origin", LOCAL[:3])
def test_default_reflects_local_origins_on_answers(default, origin):
    r = default.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                     headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hi."
    assert r.headers["access-control-allow-origin"] == origin
    assert "x-request-id" in r.headers["access-control-expose-headers"]


@pytest.mark.parametrize("origin", FOREIGN)
def test_default_refuses_other_origins(default, origin):
    r = preflight(default, origin)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = default.get("/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_named_origins_replace_the_default_and_localhost_keeps_it(servers):
    named = servers("--cors", "https://app.example")
    assert preflight(named, "https://app.example").headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in preflight(named, "http://localhost:5173").headers
    both = servers("--cors", "localhost, https://app.example")
    for origin in ("https://app.example", "http://localhost:5173", "http://[::1]:9"):
        assert preflight(both, origin).headers["access-control-allow-origin"] == origin
    assert "access-control-allow-origin" not in preflight(both, "https://other.example").headers
    none = servers("--cors", "")
    assert "access-control-allow-origin" not in preflight(none, "http://localhost:5173").headers


def test_cors_flag_refuses_what_is_not_an_origin():
    for bad in ("app.example", "https://app.example/path", "local host"):
        with pytest.raises(ValueError, match="--cors"):
            gateway_settings(build_parser().parse_args(["--cors", bad]))
    assert gateway_settings(build_parser().parse_args([]))["cors_origins"] == ("localhost",)
