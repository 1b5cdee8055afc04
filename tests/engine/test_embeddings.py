"""Embedding requests in the engine: the final hidden states of a tiny random Qwen3 and Qwen3.5
(hybrid) checkpoint, pooled none / mean / last over prompts computed in several chunks beside
generating requests, equal transformers' last hidden state pooled the same way (fp32, CPU)."""
from __future__ import annotations

import pytest
import torch
import transformers

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.pooling import Pooled
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParamError, SamplingParams
from support.tiny import save_tiny_qwen3, save_tiny_qwen3_5

TOL = 1e-4
SAVERS = {"qwen3": save_tiny_qwen3, "qwen3_5": save_tiny_qwen3_5}


@pytest.fixture(scope="module", params=list(SAVERS))
def checkpoint(request, tmp_path_factory):
    path = SAVERS[request.param](tmp_path_factory.mktemp(request.param) / "tiny")
    ckpt = load_checkpoint(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer, reference


def hidden_reference(reference, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # after the final norm: the base model's last_hidden_state


def pooled_reference(reference, ids: list[int], mode: str) -> torch.Tensor:
    h = hidden_reference(reference, ids)
    return {"none": h, "mean": h.mean(dim=0, keepdim=True), "last": h[-1:]}[mode]


def run(engine: LLMEngine, requests: list[Request]) -> dict[str, object]:
    for r in requests:
        engine.add_request(r)
    done = {}
    while engine.has_work:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def embed(i: int, ids: list[int], mode: str) -> Request:
    return Request(f"e{i}", ids, SamplingParams(max_tokens=0, pooling=mode), max_total_tokens=256)


def test_pooled_states_equal_transformers_in_chunks_beside_generation(checkpoint):
    model, tok, reference = checkpoint
    engine = LLMEngine(model, tok, EngineConfig(max_context=256, prefill_chunk=16, max_concurrency=6))
    texts = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world!", "def add(a, b):",
             "Paris is the capital of France. " * 2, "x"]
    prompts = [tok.encode(t) for t in texts]
    assert max(map(len, prompts)) > 32 and min(map(len, prompts)) == 1  # several chunks; one token alone
    modes = ["none", "mean", "last", "mean", "last"]
    chat = Request("gen", tok.encode("Hello world! How are"), SamplingParams(temperature=0.0, max_tokens=12,
                                                                             ignore_eos=True), 256)
    done = run(engine, [chat] + [embed(i, p, m) for i, (p, m) in enumerate(zip(prompts, modes))])
    assert done["gen"].finish_reason == "length" and done["gen"].completion_tokens == 12
    assert done["gen"].embedding is None
    for i, (ids, mode) in enumerate(zip(prompts, modes)):
        out = done[f"e{i}"]
        assert out.finish_reason == "length" and out.completion_tokens == 0 and out.prompt_tokens == len(ids)
        got = torch.tensor(out.embedding)
        want = pooled_reference(reference, ids, mode)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_a_prompt_a_checkpoint_holds_is_still_computed_whole(checkpoint):
    """A generation request leaves a prefix checkpoint of its prompt; an embedding of the same
    prompt must not go on from it (it would pool only the tokens after it)."""
    model, tok, reference = checkpoint
    engine = LLMEngine(model, tok, EngineConfig(max_context=256, prefill_chunk=64, prefix_cache=True))
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of France.")
    run(engine, [Request("gen", ids[:-3], SamplingParams(temperature=0.0, max_tokens=2), 256)])
    assert run(engine, [Request("again", ids, SamplingParams(max_tokens=1), 256)])["again"].cached_tokens > 0
    out = run(engine, [embed(0, ids, "mean")])["e0"]
    assert out.cached_tokens == 0
    torch.testing.assert_close(torch.tensor(out.embedding), pooled_reference(reference, ids, "mean"),
                               atol=TOL, rtol=0)


def test_rows_computed_again_are_gathered_once():
    pooled = Pooled("mean")
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)
    pooled.add(rows[:4], 0)
    pooled.add(rows[:2], 0)  # a replay of what was gathered
    pooled.add(rows[2:6], 2)  # overlapping: only positions 4 and 5 are new
    assert pooled.seen == 6
    assert torch.tensor(pooled.result()).tolist() == [rows.mean(dim=0).tolist()]
    everything = Pooled("none")
    everything.add(rows[:3], 0)
    everything.add(rows, 0)
    assert everything.result() == rows.tolist()


def test_embedding_params_are_checked():
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(max_tokens=0, pooling="max")
    assert err.value.param == "pooling"
    with pytest.raises(SamplingParamError) as err:
        SamplingParams(max_tokens=5, pooling="mean")
    assert err.value.param == "max_tokens"
