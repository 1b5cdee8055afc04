"""``/infill`` (fill-in-the-middle) on a tiny Qwen3 whose tokenizer has Qwen's FIM tokens: the
prompt the model is given is llama.cpp's repository-level FIM order; a model without FIM tokens
answers a 400 naming the ones it lacks."""
from __future__ import annotations

import json

import httpx
import pytest

from ninfer.engine.frontend import fim
from ninfer.engine.loader import load_checkpoint
from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.tiny import FIM_TOKENS, save_tiny_llama, save_tiny_qwen3

EXTRA = [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"}, {"text": "x = 1\n"}]
PREFIX, SUFFIX = "def main():\n    ", "\n    print(total)\n"
REFERENCE = ("<|repo_name|>myproject\n<|file_sep|>util.py\ndef add(a, b):\n    return a + b\n"
             "<|file_sep|>tmp\nx = 1\n<|file_sep|>filename\n"
             "<|fim_prefix|>def main():\n    total = <|fim_suffix|>\n    print(total)\n<|fim_middle|>")


def serve(path, *flags: str):
    args = build_parser().parse_args([str(path), "--device", "cpu", "--dtype", "float32", "--engine-thread",
                                      "--max-context", "256", "--model-id", "tiny", *flags])
    state, loop = build_state(args)
    loop.start()
    return state, loop


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    state, loop = serve(save_tiny_qwen3(tmp_path_factory.mktemp("fim") / "tiny", special=FIM_TOKENS))
    with LiveServer(create_app(state)) as live, httpx.Client(base_url=live.base_url, timeout=60) as http:
        yield http, state
    loop.stop()


def test_infill_renders_llamacpp_fim_order(served):
    http, state = served
    r = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
                                   "prompt": "total = ", "n_predict": 4, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt"] == REFERENCE  # the ids the model was given, decoded
    assert body["tokens_predicted"] == 4 and body["stop_type"] == "limit" and body["content"]
    # each marker is its special token, not its text: the rendered ids hold one of each, in order
    tok = state.tokenizer
    ids = fim.render(tok, fim.FimTokens.of(tok), tok.encode(PREFIX), tok.encode(SUFFIX), tok.encode("total = "),
                     [fim.ExtraChunk(**c) for c in EXTRA])
    assert body["tokens_evaluated"] == len(ids) and tok.decode(ids) == REFERENCE
    marks = [tok.token_to_id(t) for t in ("<|repo_name|>", "<|file_sep|>", "<|file_sep|>", "<|file_sep|>",
                                           "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")]
    assert [i for i in ids if i in marks] == marks


def test_infill_streams_and_takes_an_empty_prompt(served):
    http, _ = served
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 3, "ignore_eos": True, "temperature": 0}
    whole = http.post("/infill", json=body).json()
    assert whole["prompt"] == ("<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>" + PREFIX +
                               "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>")
    with http.stream("POST", "/infill", json={**body, "stream": True}) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert "".join(f["content"] for f in frames) == whole["content"] and frames[-1]["stop"] is True


def test_long_extra_context_gives_way_first(served):
    http, state = served
    extra = [{"filename": f"f{i}.py", "text": "The quick brown fox jumps over the lazy dog. " * 8} for i in range(10)]
    body = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra,
                                      "n_predict": 16, "ignore_eos": True}).json()
    assert body["tokens_evaluated"] <= 256 - 1 - 16 and body["tokens_predicted"] == 16
    assert body["prompt"].endswith("<|fim_prefix|>" + PREFIX + "<|fim_suffix|>" + SUFFIX + "<|fim_middle|>")
    assert "<|file_sep|>f9.py" in body["prompt"] and "<|file_sep|>f0.py" not in body["prompt"]


@pytest.mark.parametrize("body, param", [
    ({"input_prefix": 5}, "input_prefix"),
    ({"input_extra": [{"filename": "a.py"}]}, "input_extra[0].text"),
    ({"input_extra": [{"text": "x", "name": "a"}]}, "input_extra[0].name"),
    ({"input_prefix": "x", "prompt": [10**7]}, "prompt[0]"),
    ({"input_prefix": "a " * 300}, "input_prefix"),
    ({"input_prefix": "a " * 60, "input_suffix": "b " * 200}, "input_suffix"),
])
def test_bad_infill_fields_are_named(served, body, param):
    r = served[0].post("/infill", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_model_without_fim_tokens_names_them(tmp_path):
    state, loop = serve(save_tiny_llama(tmp_path / "plain"))
    try:
        with LiveServer(create_app(state)) as live:
            r = httpx.post(live.base_url + "/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
    finally:
        loop.stop()
    assert r.status_code == 400 and r.json()["error"]["code"] == "fim_not_supported"
    message = r.json()["error"]["message"]
    assert all(t in message for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>"))


def test_without_repository_tokens_chunks_are_set_apart_by_a_snippet_line(tmp_path):
    tok = load_checkpoint(save_tiny_qwen3(tmp_path / "t", special=FIM_TOKENS[:3])).tokenizer
    tokens = fim.FimTokens.of(tok)
    assert tokens.repo is None and tokens.file_sep is None
    ids = fim.render(tok, tokens, tok.encode("a = "), tok.encode("\n"), [], [fim.ExtraChunk("b = 2\n", "b.py")])
    assert tok.decode(ids) == "\n\n--- snippet ---\n\nb = 2\n<|fim_prefix|>a = <|fim_suffix|>\n<|fim_middle|>"
