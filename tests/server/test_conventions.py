"""Local-server conventions: ``model`` may be left out or name any model (the served model
answers, as llama-server does; ``--strict-model-names`` refuses names that are not public),
``--served-model-name`` aliases are accepted everywhere and listed by ``/v1/models``, and
llama.cpp's spellings without ``/v1`` answer as their ``/v1`` routes."""
from __future__ import annotations

import argparse
import json

import httpx
import openai
import pytest

from ninfer.server.app import create_app
from ninfer.server.bootstrap import public_names
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.scripted import scripted_state

KEY = "conventions-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ["scripted", "alias-a", "alias-b"]  # --model-id scripted, then --served-model-name alias-a alias-b
ANSWER = "Four."
MESSAGES = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state({}, ANSWER, "--api-key", KEY, "--no-thinking", "--served-model-name", "alias-a",
                                 "alias-b")
    loop.start()
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, headers=AUTH,
                                                             timeout=30) as client:
        yield client, live
    loop.stop()


@pytest.fixture(scope="module")
def strict():
    """The same server under ``--strict-model-names``."""
    state, loop = scripted_state({}, ANSWER, "--no-thinking", "--strict-model-names", "--served-model-name",
                                 "alias-a", "alias-b")
    loop.start()
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, timeout=30) as client:
        yield client
    loop.stop()


@pytest.fixture
def http(served):
    client = served[0]
    yield client
    assert client.get("/health").status_code == 200  # every request left the server healthy


def error_of(r: httpx.Response) -> tuple[int, str | None, str | None]:
    err = r.json()["error"]
    return r.status_code, err["param"], err["code"]


@pytest.mark.parametrize("path", ["/v1/models", "/models"])
def test_models_lists_every_public_name(http, path):
    r = http.get(path)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == NAMES
    assert all(m["object"] == "model" and m["max_model_len"] > 0 for m in r.json()["data"])


@pytest.mark.parametrize("path", ["/v1/models/alias-b", "/models/alias-a", "/v1/models/scripted"])
def test_each_name_retrieves_itself(http, path):
    r = http.get(path)
    assert r.status_code == 200 and r.json()["id"] == path.rsplit("/", 1)[1]


@pytest.mark.parametrize("path", ["/v1/models/gpt-4o", "/models/gpt-4o"])
def test_an_unknown_name_is_a_404_naming_model(http, path):
    assert error_of(http.get(path)) == (404, "model", "model_not_found")


def test_aliases_need_the_key_as_their_routes_do(served):
    client, live = served
    for method, path in (("GET", "/models"), ("POST", "/chat/completions"), ("POST", "/completions")):
        r = httpx.request(method, live.base_url + path, json={"prompt": "x", "messages": MESSAGES})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
def test_chat_without_model_answers_as_the_served_model(http, path):
    r = http.post(path, json={"messages": MESSAGES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "scripted" and body["choices"][0]["message"]["content"] == ANSWER


def test_chat_with_null_model_and_with_an_alias(http):
    assert http.post("/v1/chat/completions", json={"model": None, "messages": MESSAGES}).json()["model"] == "scripted"
    r = http.post("/chat/completions", json={"model": "alias-b", "messages": MESSAGES})
    assert r.status_code == 200 and r.json()["model"] == "alias-b"  # the name the request used, as vLLM does


def test_streamed_chat_without_model(http):
    with http.stream("POST", "/chat/completions", json={"messages": MESSAGES, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"scripted"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == ANSWER


ANY_NAME = ["gpt-4o", "gpt-3.5-turbo", "davinci-002", "Alias-A"]
ROUTES = [("/v1/chat/completions", {"messages": MESSAGES}), ("/chat/completions", {"messages": MESSAGES}),
          ("/v1/completions", {"prompt": "2+2=", "max_tokens": 8}),
          ("/v1/responses", {"input": "2+2?", "store": False}),
          ("/completion", {"prompt": "2+2=", "n_predict": 8})]


@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
@pytest.mark.parametrize("model", ANY_NAME)
def test_any_model_name_is_answered_by_the_served_model(http, path, body, model):
    r = http.post(path, json={"model": model, **body})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "scripted"  # the model that answered, not the name asked for


def test_any_model_name_on_the_other_routes(http):
    r = http.post("/apply-template", json={"model": "gpt-4o", "messages": MESSAGES})
    assert r.status_code == 200 and "2+2?" in r.json()["prompt"]
    r = http.post("/v1/messages", json={"model": "claude-x", "max_tokens": 8, "messages": MESSAGES})
    assert r.status_code == 200 and r.json()["model"] == "claude-x"  # Messages echo the label, as before
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == NAMES  # the listing is unchanged


@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
@pytest.mark.parametrize("model", ["gpt-4o", "Alias-A"])
def test_strict_model_names_refuse_an_unknown_name(strict, path, body, model):
    assert error_of(strict.post(path, json={"model": model, **body})) == (400, "model", "model_not_found")


def test_strict_model_names_refuse_it_on_every_route(strict):
    assert error_of(strict.post("/apply-template", json={"model": "nope", "messages": MESSAGES})) == (
        400, "model", "model_not_found")
    r = strict.post("/v1/messages", json={"model": "claude-x", "max_tokens": 8, "messages": MESSAGES})
    assert r.status_code == 400 and "claude-x" in r.json()["error"]["message"]
    r = strict.post("/v1/responses/input_tokens", json={"model": "nope", "input": "2+2?"})
    assert error_of(r) == (400, "model", "model_not_found")


@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
def test_strict_model_names_take_the_public_names(strict, path, body):
    for name in ("scripted", "alias-a", None):
        r = strict.post(path, json={"model": name, **body})
        assert r.status_code == 200, r.text
        assert r.json()["model"] in (name or "scripted", "scripted")


@pytest.mark.parametrize("path", ["/v1/completions"])
def test_completions_without_model_and_with_an_alias(http, path):
    r = http.post(path, json={"prompt": "2+2=", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["model"] == "scripted"
    r = http.post(path, json={"model": "alias-a", "prompt": "2+2=", "max_tokens": 8})
    assert r.status_code == 200 and r.json()["model"] == "alias-a"
    assert r.json()["object"] == "text_completion" and r.json()["choices"][0]["text"] == ANSWER


@pytest.mark.parametrize("path", ["/completion", "/completions"])
def test_completions_without_v1_is_llamacpp_native(http, path):
    """As in llama-server: ``/completions`` is ``/completion``, ``/v1/completions`` the OpenAI one."""
    r = http.post(path, json={"prompt": "2+2=", "n_predict": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == ANSWER and body["stop"] is True and "choices" not in body
    assert body["tokens"] and all(isinstance(t, int) for t in body["tokens"])
    assert body["timings"]["predicted_n"] == len(body["tokens"]) and body["tokens_evaluated"] > 0
    with http.stream("POST", path, json={"prompt": "2+2=", "n_predict": 8, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(c["content"] for c in chunks) == ANSWER and chunks[-1]["stop"] is True


def test_responses_without_model_and_with_an_alias(http):
    r = http.post("/v1/responses", json={"input": "2+2?", "store": False})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "scripted" and r.json()["status"] == "completed"
    r = http.post("/v1/responses", json={"model": "alias-b", "input": "2+2?", "store": False})
    assert r.status_code == 200, r.text
    counted = http.post("/v1/responses/input_tokens", json={"model": "alias-a", "input": "2+2?"})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0


def test_llamacpp_routes_take_the_aliases(http):
    r = http.post("/completion", json={"model": "alias-a", "prompt": "2+2=", "n_predict": 8})
    assert r.status_code == 200 and r.json()["content"] == ANSWER
    r = http.post("/apply-template", json={"model": "alias-b", "messages": MESSAGES})
    assert r.status_code == 200 and "2+2?" in r.json()["prompt"]


def test_the_openai_sdk_without_v1_in_its_base_url(served):
    """llama.cpp's own clients and some tools put the server's root in ``base_url``."""
    client = openai.OpenAI(base_url=served[1].base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == NAMES
    reply = client.chat.completions.create(model="alias-a", messages=MESSAGES)
    assert reply.model == "alias-a" and reply.choices[0].message.content == ANSWER
    # /completions is llama.cpp's native completion, as in llama-server: legacy Completions need /v1


def _names(*argv: str) -> dict:
    return public_names(build_parser().parse_args(list(argv)), lambda model: "default-name")


def test_how_model_id_and_served_model_name_combine():
    assert _names() == {"model_id": "default-name", "aliases": ()}
    assert _names("--served-model-name", "a", "b") == {"model_id": "a", "aliases": ("b",)}
    assert _names("--model-id", "x") == {"model_id": "x", "aliases": ()}
    assert _names("--model-id", "x", "--served-model-name", "a", "x", "a") == {"model_id": "x", "aliases": ("a",)}
    with pytest.raises(ValueError, match="must not be empty"):
        _names("--served-model-name", " ")
    # a hand-built Namespace (no served_model_name attribute) keeps working
    assert public_names(argparse.Namespace(model=None, model_id=None), lambda m: "d") == {"model_id": "d",
                                                                                        "aliases": ()}
