"""Our Llama / Qwen3 dense models against transformers on tiny random checkpoints, fp32 on CPU."""
from __future__ import annotations

import pytest
import torch
import transformers

from ninfer.engine.loader.hf_loader import load_hf_dir
from ninfer.engine.models.base import CausalLM, ForwardBatch
from ninfer.engine.models.registry import build_model

SMALL = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}
VARIANTS = {
    "llama-untied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
    "llama-tied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama3-rope-bias": lambda: transformers.LlamaConfig(
        **SMALL, rope_scaling=LLAMA3_ROPE, attention_bias=True, mlp_bias=True
    ),
    "qwen3-tied": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),
    "qwen3-untied": lambda: transformers.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False),
}
PROMPT_LEN, NEW_TOKENS = 120, 32


def _make_hf(variant: str, path) -> transformers.PreTrainedModel:
    torch.manual_seed(1234)
    config = VARIANTS[variant]()
    config._attn_implementation = "eager"
    config.initializer_range = 0.1  # sharper logits than the default, so greedy choices are clear
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # random norm weights, so a norm applied in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def _load_ours(path) -> CausalLM:
    ckpt = load_hf_dir(path)
    model = build_model(ckpt.config, dtype=torch.float32, device="cpu")
    model.load_weights(ckpt.weights())
    return model


def _greedy(model: CausalLM, prompt: torch.Tensor, n: int) -> list[int]:
    cache = model.new_cache()
    ids, out = prompt, []
    for _ in range(n):
        hidden = model(ids, ForwardBatch.single(ids.shape[0], cache))
        nxt = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(nxt)
        ids = torch.tensor([nxt])
    assert cache.num_tokens == prompt.shape[0] + n - 1
    return out


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _make_hf(request.param, path)
    return request.param, hf, _load_ours(path)


def test_prompt_logits_match_transformers(pair):
    variant, hf, ours = pair
    prompt = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(prompt[None]).logits[0].float()
    cache = ours.new_cache()
    logits = ours.compute_logits(ours(prompt, ForwardBatch.single(PROMPT_LEN, cache)))
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    assert (logits - ref).abs().max().item() < 1e-4, variant
    assert cache.num_tokens == PROMPT_LEN


def test_greedy_decode_matches_transformers_generate(pair):
    variant, hf, ours = pair
    prompt = torch.randint(0, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf.generate(
            prompt[None], attention_mask=torch.ones(1, PROMPT_LEN, dtype=torch.long), do_sample=False,
            max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0,
        )[0, PROMPT_LEN:].tolist()
    assert len(ref) == NEW_TOKENS
    assert _greedy(ours, prompt, NEW_TOKENS) == ref, variant


def test_tied_embeddings_share_one_tensor(pair):
    variant, _, ours = pair
    names = [n for n, _ in ours.named_parameters()]
    assert "model.embed_tokens.weight" in names
    assert ("lm_head.weight" in names) == (not ours.config.tie_word_embeddings), variant


def test_mixed_batch_equals_sequences_alone(pair):
    """One flat run holding a decode step of one sequence and a prompt of another."""
    _, _, ours = pair
    gen = torch.Generator().manual_seed(9)
    a_hist, a_new, b_new = (torch.randint(0, 512, (n,), generator=gen) for n in (20, 1, 13))

    cache_a = ours.new_cache()
    ours(a_hist, ForwardBatch.single(20, cache_a))
    alone_a = ours.compute_logits(ours(a_new, ForwardBatch.single(1, cache_a)))
    alone_b = ours.compute_logits(ours(b_new, ForwardBatch.single(13, ours.new_cache())))

    cache_a2, cache_b2 = ours.new_cache(), ours.new_cache()
    ours(a_hist, ForwardBatch.single(20, cache_a2))
    batch = ForwardBatch(
        positions=torch.cat([torch.tensor([20]), torch.arange(13)]), seq_lens=[1, 13], caches=[cache_a2, cache_b2]
    )
    both = ours.compute_logits(ours(torch.cat([a_new, b_new]), batch))
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), atol=1e-5, rtol=1e-5)
    assert (cache_a2.num_tokens, cache_b2.num_tokens) == (21, 13)


def test_bf16_build_runs_close_to_fp32(pair, tmp_path):
    _, hf, ours = pair
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(10))
    path = tmp_path / "m"
    hf.save_pretrained(path)
    ckpt = load_hf_dir(path)
    low = build_model(ckpt.config, dtype=torch.bfloat16)
    low.load_weights(ckpt.weights())
    assert all(p.dtype == torch.bfloat16 for p in low.parameters())
    ref = ours.compute_logits(ours(prompt, ForwardBatch.single(40, ours.new_cache())))
    got = low.compute_logits(low(prompt, ForwardBatch.single(40, low.new_cache())))
    assert got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 0.1 * ref.abs().max().item()
