"""Acceptance: the SmolLM2 GGUF loads, and its greedy continuation of a fixed raw prompt equals what
transformers gives for the same GGUF file (``from_pretrained(..., gguf_file=...)``)."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.models.base import ForwardBatch
from ninfer.engine.models.registry import build_model

PROMPT = "The capital of France is Paris. The capital of Germany is"
NEW_TOKENS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ours(smollm2):
    model = build_model(smollm2.config, dtype=torch.float32, device="cpu")
    model.load_weights(smollm2.weights())
    return model


@pytest.fixture(scope="module")
def theirs(smollm2_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    )
    return model.eval()


@torch.no_grad()
def greedy(model, prompt_ids: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits and ``steps`` greedy tokens, decoding one token at a time through the cache."""
    cache = model.new_cache()
    hidden = model(torch.tensor(prompt_ids), ForwardBatch.single(len(prompt_ids), cache))
    prompt_logits = model.compute_logits(hidden)
    out = [int(prompt_logits[-1].argmax())]
    while len(out) < steps:
        hidden = model(torch.tensor([out[-1]]), ForwardBatch.single(1, cache))
        out.append(int(model.compute_logits(hidden)[-1].argmax()))
    assert cache.num_tokens == len(prompt_ids) + steps - 1
    return prompt_logits, out


@torch.no_grad()
def test_greedy_continuation_matches_transformers(smollm2, ours, theirs):
    prompt_ids = smollm2.tokenizer.encode(PROMPT)
    our_logits, our_tokens = greedy(ours, prompt_ids, NEW_TOKENS)

    input_ids = torch.tensor([prompt_ids])
    their_logits = theirs(input_ids).logits[0].float()
    generated = theirs.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=NEW_TOKENS, do_sample=False,
        pad_token_id=smollm2.tokenizer.eos_token_id,
    )
    their_tokens = generated[0, len(prompt_ids):].tolist()

    assert our_tokens == their_tokens, (smollm2.tokenizer.decode(our_tokens), smollm2.tokenizer.decode(their_tokens))
    assert (our_logits - their_logits).abs().max().item() < 1e-3
    assert smollm2.tokenizer.decode(our_tokens).startswith(" Berlin")
