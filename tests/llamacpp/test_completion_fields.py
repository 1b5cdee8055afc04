"""``/completion`` as llama.cpp's clients send it: ``response_fields``, token ids mixed with text,
and a list of prompts (a batch, answered as a list in order), on the scripted model."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from ninfer.server.app import create_app
from support.scripted import record_prompts, scripted_state

SCRIPTS = {"capital": "Paris.", "story": "Once upon a time.", "colour": "Blue."}


@pytest.fixture(scope="module")
def served():
    state, loop = scripted_state(SCRIPTS, "Hello.")
    seen = record_prompts(state)
    loop.start()
    with TestClient(create_app(state)) as client:
        yield client, state, seen
    loop.stop()


@pytest.fixture
def client(served):
    return served[0]


def ids_of(client, text: str) -> list[int]:
    return client.post("/tokenize", json={"content": text}).json()["tokens"]


def test_response_fields_pick_nested_fields_by_path(client):
    fields = ["content", "generation_settings/n_predict", "prompt", "timings/predicted_n", "no/such"]
    body = client.post("/completion", json={"prompt": "The capital?", "n_predict": 32,
                                            "response_fields": fields}).json()
    assert body == {"content": "Paris.", "generation_settings/n_predict": 32, "prompt": "The capital?",
                    "timings/predicted_n": body["timings/predicted_n"]}
    assert body["timings/predicted_n"] == len(ids_of(client, "Paris.")) + 1  # and the eos token
    whole = client.post("/completion", json={"prompt": "The capital?", "response_fields": []}).json()
    assert {"content", "generation_settings", "timings", "tokens"} <= whole.keys()  # none named: everything


def test_response_fields_must_name_a_field(client):
    r = client.post("/completion", json={"prompt": "x", "response_fields": ["content", ""]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_fields"


def test_token_ids_mixed_with_text_are_one_prompt(served):
    client, _, seen = served
    head, tail = ids_of(client, "Tell me a "), ids_of(client, " about Paris")
    seen.clear()
    body = client.post("/completion", json={"prompt": [*head, "story", *tail]}).json()
    assert body["content"] == "Once upon a time." and seen == ["Tell me a story about Paris"]
    assert body["prompt"] == "Tell me a story about Paris" and body["index"] == 0


def test_a_list_of_prompts_is_a_batch_answered_in_order(served):
    client, _, seen = served
    story = ids_of(client, "a story")
    prompts = ["the capital", story, ["favourite ", *ids_of(client, "colour")], "hi"]
    seen.clear()
    r = client.post("/completion", json={"prompt": prompts, "n_predict": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body, list) and [b["index"] for b in body] == [0, 1, 2, 3]
    assert [b["content"] for b in body] == ["Paris.", "Once upon a time.", "Blue.", "Hello."]
    assert sorted(seen) == sorted(["the capital", "a story", "favourite colour", "hi"])
    assert all(b["stop"] and b["timings"]["predicted_n"] == len(b["tokens"]) for b in body)
    picked = client.post("/completion", json={"prompt": ["the capital", "a story"],
                                              "response_fields": ["content"]}).json()
    assert picked == [{"content": "Paris."}, {"content": "Once upon a time."}]


def test_a_batch_of_the_same_tokens_and_text_answers_the_same(client):
    ids = ids_of(client, "the capital")
    body = client.post("/completion", json={"prompt": [ids, "the capital"]}).json()
    assert len(body) == 2 and body[0]["content"] == body[1]["content"] == "Paris."
    assert body[0]["tokens"] == body[1]["tokens"]


def test_a_streamed_batch_interleaves_frames_by_index(client):
    with client.stream("POST", "/completion", json={"prompt": ["the capital", "a story"], "stream": True}) as r:
        assert r.status_code == 200
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for index, answer in ((0, "Paris."), (1, "Once upon a time.")):
        mine = [f for f in frames if f["index"] == index]
        assert "".join(f["content"] for f in mine) == answer
        assert [f["stop"] for f in mine][-1] is True and sum(f["stop"] for f in mine) == 1


@pytest.mark.parametrize("prompt, param", [
    (["ok", ""], "prompt[1]"),
    ([[1, 2], [3, -4]], "prompt[1][1]"),
    ([[1, 2], 5], "prompt"),
    ([], "prompt"),
])
def test_bad_prompts_in_a_batch_name_their_place(client, prompt, param):
    r = client.post("/completion", json={"prompt": prompt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_batch_beyond_the_servers_capacity_is_answered(served):
    """More prompts than the queue holds run a lane's worth at a time, never refused."""
    client, state, _ = served
    many = ["the capital", "a story"] * (state.engine.capacity // 2 + 3)
    r = client.post("/completion", json={"prompt": many, "n_predict": 8})
    assert r.status_code == 200, r.text
    assert [b["content"] for b in r.json()] == ["Paris.", "Once upon a time."] * (len(many) // 2)
    assert [b["index"] for b in r.json()] == list(range(len(many)))
    assert state.engine.outstanding == 0


def test_a_streamed_batch_beyond_the_servers_capacity_is_refused_whole(served):
    client, state, _ = served
    many = ["the capital"] * (state.engine.capacity + 1)
    r = client.post("/completion", json={"prompt": many, "stream": True})
    assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
    assert state.engine.outstanding == 0  # those admitted before the refusal were cancelled
    assert client.post("/completion", json={"prompt": "the capital"}).json()["content"] == "Paris."
