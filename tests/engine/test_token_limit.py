"""Token ids stay where the tokenizer can decode them: a checkpoint declaring more LM-head rows
than its tokenizer has ids never gets those ids sampled, a prompt with such an id is refused, and
a request whose output handling fails ends alone while the engine serves the others."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.frontend.qwen_tiktoken import load_qwen_tiktoken
from ninfer.engine.loader import load_checkpoint, load_model
from ninfer.engine.loop import EngineLoop
from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.request import Request
from ninfer.engine.sampling_params import SamplingParams
from support.faults import FaultyDecode
from support.tiny import QWEN_CHECKPOINT_VOCAB, QWEN_TOKENIZER_IDS, save_tiny_qwen3_5_padded_vocab
from support.waiting import wait_until


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """The tiny Qwen3.5 with 248,320 LM-head rows, its loud rows past the tokenizer's ids."""
    ckpt = load_checkpoint(save_tiny_qwen3_5_padded_vocab(tmp_path_factory.mktemp("ckpt") / "padded"))
    return load_model(ckpt, "cpu", torch.float32), load_qwen_tiktoken("qwen3.6")


def engine_for(parts, **kw) -> LLMEngine:
    model, tok = parts
    return LLMEngine(model, tok, EngineConfig(**{"max_context": 256, "max_concurrency": 4, "kv_capacity": 1024,
                                                 "page_size": 8, **kw}))


def test_the_checkpoint_prefers_ids_past_the_tokenizer(padded):
    """What the tests below guard against: unmasked, this model's next token is past the
    tokenizer's last id at every position."""
    model, tok = padded
    ids = tok.encode("Tell me a story about the sea.")
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), ForwardBatch.single(len(ids), model.new_cache())))
    assert logits.shape[-1] == QWEN_CHECKPOINT_VOCAB and tok.vocab_size == QWEN_TOKENIZER_IDS
    assert (logits.argmax(-1) >= QWEN_TOKENIZER_IDS).all()


@pytest.mark.parametrize("temperature", [0.0, 1.5], ids=["greedy", "sampled"])
def test_sampled_ids_are_ones_the_tokenizer_decodes(padded, temperature):
    engine = engine_for(padded)
    tok = padded[1]
    prompts = [tok.encode(text) for text in ("Tell me a story.", "What is 2 + 2?", "Hello!")]
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True, seed=i),
                    max_total_tokens=256) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    text = {r.request_id: "" for r in reqs}
    while engine.has_work:
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            text[out.request_id] += out.text
    for r in reqs:
        assert len(r.output_ids) == 12 and all(0 <= t < QWEN_TOKENIZER_IDS for t in r.output_ids)
        assert text[r.request_id] == tok.decode(r.output_ids)


def run_loop(engine: LLMEngine, reqs: list[Request]) -> dict[str, list]:
    """Each request's outputs, through the engine thread as the server drives it."""
    loop = EngineLoop(engine)
    got: dict[str, list] = {r.request_id: [] for r in reqs}
    loop.start()
    try:
        for r in reqs:
            loop.submit(r, got[r.request_id].append)
        wait_until(lambda: all(outs and outs[-1].finished for outs in got.values()), timeout=120)
    finally:
        loop.stop()
    assert loop.failed is None
    return got


def test_a_prompt_id_past_the_tokenizer_fails_that_request_alone(padded):
    tok = padded[1]
    good, bad = tok.encode("Hello!"), tok.encode("Hello!") + [QWEN_TOKENIZER_IDS + 5]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = run_loop(engine_for(padded), [Request("bad", bad, params, 256), Request("good", good, params, 256)])
    (last,) = got["bad"]
    assert last.finish_reason == "error"
    assert last.error == f"prompt token at {len(bad) - 1} is out of range [0, {QWEN_TOKENIZER_IDS})"
    assert got["good"][-1].finish_reason == "length" and got["good"][-1].completion_tokens == 4


def test_a_request_whose_output_handling_fails_ends_alone(padded, caplog):
    """The faulty request ends with an error on its first token; the one beside it runs to its
    end, the engine thread goes on and takes a request after it; the log names the request and
    the error's type, not its text."""
    tok = padded[1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = {"faulty": tok.encode("Hello!"), "other": tok.encode("What is 2 + 2?")}
    clean = run_loop(engine_for(padded), [Request(k, p, params, 256) for k, p in prompts.items()])
    fault_id = [t for out in clean["faulty"] for t in out.token_ids][0]  # the faulty request's first token
    other_ids = prompts["other"] + [t for out in clean["other"] for t in out.token_ids]
    assert fault_id not in other_ids and fault_id not in prompts["faulty"]  # the fault is the faulty one's alone

    engine = engine_for(padded)
    engine.tokenizer = FaultyDecode(tok, fault_id)
    got = run_loop(engine, [Request(k, p, params, 256) for k, p in prompts.items()])
    last = got["faulty"][-1]
    assert last.finish_reason == "error" and last.error_code == "internal_error" and "KeyError" in last.error
    assert got["other"][-1].finish_reason == "length" and got["other"][-1].completion_tokens == 6
    assert "request faulty failed in postprocessing (KeyError)" in caplog.text
    assert f"cannot decode {fault_id}" not in caplog.text
    assert engine.caches.idle()
    after = run_loop(engine, [Request("after", prompts["other"], params, 256)])
    assert after["after"][-1].finish_reason == "length"
