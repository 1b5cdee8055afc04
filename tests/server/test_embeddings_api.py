"""Embeddings over HTTP from tiny random checkpoints: OpenAI's ``/v1/embeddings`` (through the
``openai`` SDK and LangChain's ``OpenAIEmbeddings`` too) and llama.cpp's ``/embedding`` and
``/embeddings`` equal transformers' last hidden state pooled the same way (fp32, CPU). The Qwen3
checkpoint is laid out as Qwen3-Embedding's (the base model alone, last-token pooling declared in
sentence-transformers files); the Qwen3.5 one declares nothing and is pooled by the mean."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.live_server import LiveServer
from support.tiny import save_tiny_qwen3_5, save_tiny_qwen3_embedding

TOL = 1e-4
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "Paris is the capital of France. " * 4]


# the Qwen3 one is saved as Qwen3-Embedding is: the base model alone, last-token pooling declared
CHECKPOINTS = {"qwen3": (save_tiny_qwen3_embedding, "last"), "qwen3_5": (save_tiny_qwen3_5, "mean")}


class Served:
    def __init__(self, live: LiveServer, state, reference, pooling: str) -> None:
        self.live, self.state, self.reference, self.pooling = live, state, reference, pooling
        self.http = httpx.Client(base_url=live.base_url, timeout=120)

    def ids(self, text: str) -> list[int]:
        """The ids of ``text`` as an input of its own (Qwen3-Embedding's closing token included)."""
        return self.state.tokenizer.encode_alone(text)

    def hidden(self, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.reference(torch.tensor([ids])).last_hidden_state[0]

    def expected(self, ids: list[int], pooling: str | None = None, normalize: bool = True) -> torch.Tensor:
        h = self.hidden(ids)
        pooled = {"none": h, "mean": h.mean(0, keepdim=True), "last": h[-1:]}[pooling or self.pooling]
        return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request, tmp_path_factory):
    build, pooling = CHECKPOINTS[request.param]
    path = build(tmp_path_factory.mktemp(request.param) / "tiny")
    reference = transformers.AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    args = build_parser().parse_args([str(path), "--device", "cpu", "--dtype", "float32", "--engine-thread",
                                      "--max-context", "256", "--prefill-chunk", "16", "--model-id", "tiny"])
    state, loop = build_state(args)
    loop.start()
    with LiveServer(create_app(state)) as live:
        yield Served(live, state, reference, pooling)
    loop.stop()


def close(got, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32).reshape(want.shape), want, atol=TOL, rtol=0)


def test_the_checkpoint_declares_its_pooling(served):
    assert served.state.pooling == served.pooling


def test_each_text_input_ends_as_the_tokenizer_closes_one(served):
    """The Qwen3-Embedding layout's tokenizer appends ``<|endoftext|>`` to an input (what its
    last-token pooling reads); the Qwen3.5 one appends nothing."""
    tok = served.state.tokenizer
    plain, alone = tok.encode(TEXTS[1]), tok.encode_alone(TEXTS[1])
    assert alone == (plain + [tok.token_to_id("<|endoftext|>")] if served.pooling == "last" else plain)
    body = served.http.post("/v1/embeddings", json={"input": TEXTS[1]}).json()
    assert body["usage"]["prompt_tokens"] == len(alone)
    close(body["data"][0]["embedding"], served.expected(alone)[0])
    given = served.http.post("/v1/embeddings", json={"input": plain}).json()  # token ids: as given
    assert given["usage"]["prompt_tokens"] == len(plain)
    empty = served.http.post("/v1/embeddings", json={"input": ""})  # only what the tokenizer adds
    if served.pooling == "last":
        close(empty.json()["data"][0]["embedding"], served.expected(tok.encode_alone(""))[0])
    else:
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"


def test_openai_route_pools_normalizes_and_counts(served):
    r = served.http.post("/v1/embeddings", json={"input": TEXTS[0], "model": "text-embedding-3-small"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny" and len(body["data"]) == 1
    assert body["data"][0]["object"] == "embedding" and body["data"][0]["index"] == 0
    ids = served.ids(TEXTS[0])
    close(body["data"][0]["embedding"], served.expected(ids)[0])
    assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}


def test_openai_route_takes_lists_and_token_ids(served):
    ids = [served.ids(t) for t in TEXTS]
    for given in (TEXTS, ids, [TEXTS[0], ids[1], TEXTS[2]]):
        body = served.http.post("/v1/embeddings", json={"input": given}).json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        for d, one in zip(body["data"], ids):
            close(d["embedding"], served.expected(one)[0])
        assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    one = served.http.post("/v1/embeddings", json={"input": ids[1]}).json()["data"]  # one prompt of ids
    assert len(one) == 1
    close(one[0]["embedding"], served.expected(ids[1])[0])


def test_base64_and_dimensions(served):
    plain = served.http.post("/v1/embeddings", json={"input": TEXTS[1]}).json()["data"][0]["embedding"]
    packed = served.http.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (64,)
    np.testing.assert_allclose(decoded, plain, atol=1e-6)
    unset = served.http.post("/v1/embeddings", json={"input": TEXTS[1], "encoding_format": None}).json()
    assert unset["data"][0]["embedding"] == plain
    cut = served.http.post("/v1/embeddings", json={"input": TEXTS[1], "dimensions": 16}).json()["data"][0]
    want = torch.nn.functional.normalize(served.expected(served.ids(TEXTS[1]), normalize=False)[0, :16], dim=-1)
    close(cut["embedding"], want)
    r = served.http.post("/v1/embeddings", json={"input": TEXTS[1], "dimensions": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"


def test_the_openai_sdk(served):
    client = openai.OpenAI(base_url=served.live.base_url + "/v1", api_key="none", max_retries=0)
    res = client.embeddings.create(model="text-embedding-3-small", input=TEXTS)  # the SDK asks for base64
    assert len(res.data) == 3 and res.usage.prompt_tokens == sum(len(served.ids(t)) for t in TEXTS)
    for d, text in zip(res.data, TEXTS):
        close(d.embedding, served.expected(served.ids(text))[0])
    res = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float", dimensions=32)
    assert len(res.data[0].embedding) == 32 and abs(np.linalg.norm(res.data[0].embedding) - 1) < 1e-5


def test_langchain_openai_embeddings(served):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="text-embedding-3-small", base_url=served.live.base_url + "/v1", api_key="none",
                           check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents(TEXTS)
    for got, text in zip(docs, TEXTS):
        close(got, served.expected(served.ids(text))[0])
    close(emb.embed_query(TEXTS[1]), served.expected(served.ids(TEXTS[1]))[0])


@pytest.mark.parametrize("path", ["/embedding", "/embeddings"])
def test_llamacpp_routes_pool_as_asked(served, path):
    ids = served.ids(TEXTS[0])
    body = served.http.post(path, json={"content": TEXTS[0]}).json()
    assert isinstance(body, list) and body[0]["index"] == 0
    close(body[0]["embedding"], served.expected(ids))  # the model's pooling, normalized
    every = served.http.post(path, json={"content": TEXTS[0], "pooling": "none"}).json()[0]["embedding"]
    assert len(every) == len(ids)  # a vector per token, not normalized
    close(every, served.expected(ids, "none", normalize=False))
    for pooling in ("mean", "last"):
        raw = served.http.post(path, json={"input": TEXTS[0], "pooling": pooling, "normalize": False}).json()
        close(raw[0]["embedding"], served.expected(ids, pooling, normalize=False))
        unit = served.http.post(path, json={"content": TEXTS[0], "pooling": pooling, "embd_normalize": 2}).json()
        close(unit[0]["embedding"], served.expected(ids, pooling))
    batch = served.http.post(path, json={"content": [TEXTS[1], served.ids(TEXTS[2])], "pooling": "mean"}).json()
    assert [b["index"] for b in batch] == [0, 1]
    close(batch[1]["embedding"], served.expected(served.ids(TEXTS[2]), "mean"))


@pytest.mark.parametrize("path, body, param", [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["a", []]}, "input[1]"),
    ("/v1/embeddings", {"input": [[1, 2], [3, 10**7]]}, "input[1][1]"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "a", "pooling": "mean"}, "pooling"),
    ("/v1/embeddings", {"input": "a " * 300}, "input"),
    ("/embeddings", {"content": "a", "pooling": "max"}, "pooling"),
    ("/embeddings", {"content": "a", "input": "b"}, "content"),
    ("/embeddings", {}, "content"),
    ("/embeddings", {"content": "a", "embd_normalize": 1}, "embd_normalize"),
    ("/embedding", {"content": [[1, 2], 3]}, "content"),
])
def test_bad_input_is_a_400_naming_the_field(served, path, body, param):
    r = served.http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert served.http.get("/health").status_code == 200


def test_any_model_name_and_generation_beside(served):
    """Embeddings and completions share the engine: both answered while the other runs."""
    r = served.http.post("/v1/embeddings", json={"input": TEXTS, "model": "anything"})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    done = served.http.post("/completion", json={"prompt": TEXTS[0], "n_predict": 4, "ignore_eos": True}).json()
    assert done["tokens_predicted"] == 4


def test_the_engine_in_a_process_of_its_own(tmp_path):
    """The default set-up: the pooled states cross the pipe from the engine's process."""
    path = save_tiny_qwen3_5(tmp_path / "tiny")
    reference = transformers.AutoModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    args = build_parser().parse_args([str(path), "--device", "cpu", "--dtype", "float32", "--max-context", "256",
                                      "--prefill-chunk", "16"])
    state, loop = build_state(args)
    loop.start()
    try:
        with LiveServer(create_app(state)) as live:
            served = Served(live, state, reference, "mean")
            body = served.http.post("/v1/embeddings", json={"input": TEXTS}).json()
            for d, text in zip(body["data"], TEXTS):
                close(d["embedding"], served.expected(served.ids(text))[0])
    finally:
        loop.stop()


def test_more_inputs_than_the_queue_holds(served):
    """A RAG client sends its chunks in one request (LangChain: up to 1000): a lane's worth run at
    a time, none refused."""
    texts = [f"chunk {i}: " + TEXTS[i % 3] for i in range(served.state.engine.capacity + 12)]
    r = served.http.post("/v1/embeddings", json={"input": texts})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(texts)))
    for i in (0, len(texts) - 1):
        close(data[i]["embedding"], served.expected(served.ids(texts[i]))[0])
    assert served.state.engine.outstanding == 0
