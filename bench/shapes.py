"""Model shapes the benchmarks build (the launcher's table of known Qwen3.5 sizes), the
multimodal checkpoints' configs at those shapes (``vision_shape``: the language model, its
M-RoPE and the vision tower), and random checkpoints at those shapes for the benchmarks that go
through the server."""
from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

from ninfer.engine.config import ModelConfig

_KNOWN = json.loads((Path(__file__).resolve().parents[1] / "app" / "known_models.json").read_text())
SHAPES = {name.lower(): cfg for name, cfg in _KNOWN.items() if not name.startswith("_")}


def shape_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(SHAPES[name.lower()])


# The vision towers of the multimodal checkpoints (``vision_config``), by shape: the 27B's is
# transformers' ``Qwen3_5VisionConfig`` (27 blocks of 1152, SigLIP-2 so400m) projecting to the
# language model's 5120. "tiny" is a two-block tower over a four-layer model, for the CPU.
VISION = {
    "qwen3.5-27b": dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                        spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=5120,
                        num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh"),
    "tiny": dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16, spatial_merge_size=2,
                 temporal_patch_size=2, in_channels=3, out_hidden_size=64, num_position_embeddings=16,
                 hidden_act="gelu_pytorch_tanh"),
}
TINY_TEXT = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "full_attention_interval": 4,
}
# the multimodal checkpoints' text rotation: interleaved M-RoPE over a quarter of each head
# (time, row, column sections of frequency pairs); the tiny one over half of its 16
MROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
         "mrope_section": [11, 11, 10], "mrope_interleaved": True}
TINY_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "mrope_section": [2, 1, 1], "mrope_interleaved": True}
# Qwen3.5's preprocessor_config.json: patches of 16, 2 x 2 merged, 64 Ki .. 16 Mi pixels
PREPROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"shortest_edge": 65536, "longest_edge": 16 << 20},
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
VISION_TOKENS = {
    "qwen3.5-27b": dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                        vision_end_token_id=248054),
    "tiny": dict(image_token_id=5, video_token_id=6, vision_start_token_id=3, vision_end_token_id=4),
}


def vision_shape(name: str) -> dict:
    """The config dict of the multimodal checkpoint at shape ``name`` (a key of ``VISION``), as
    its ``config.json`` nests it: ``text_config`` (with its M-RoPE), ``vision_config`` and the
    placeholder token ids."""
    name = name.lower()
    text = dict(TINY_TEXT if name == "tiny" else SHAPES[name])
    text["rope_parameters"] = TINY_MROPE if name == "tiny" else MROPE
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
            "vision_config": dict(VISION[name]), "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
            **VISION_TOKENS[name]}


def random_checkpoint(shape: str | dict, path: Path, vocab_size: int | None = None) -> Path:
    """A checkpoint of random bf16 weights at ``shape`` (a name of ``SHAPES`` or a config dict)
    written by transformers into ``path``, on the GPU when there is one; reused when ``path``
    already holds one of the same config. ``vocab_size`` replaces the shape's, so that every id
    the model can sample is one the tokenizer can decode. Written beside ``path`` and renamed, so
    an interrupted write never leaves a checkpoint that looks whole."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _shape_dict(shape, vocab_size)
    if _written_from(path, cfg):
        return path
    config = AutoConfig.for_model(**cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = _partial(path)
    model.save_pretrained(partial)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return _finish(partial, path, cfg)


MADE = "random_shape.json"  # what a random checkpoint was written from (transformers rewrites some keys)


def _shape_dict(shape: str | dict, vocab_size: int | None) -> dict:
    cfg = dict(SHAPES[shape.lower()] if isinstance(shape, str) else shape)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    return cfg


def _written_from(path: Path, record: dict) -> bool:
    """Whether ``path`` holds a checkpoint written from ``record`` already."""
    made = path / MADE
    return made.exists() and json.loads(made.read_text()) == record


def _partial(path: Path) -> Path:
    """The empty folder beside ``path`` a checkpoint is written into first."""
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def _finish(partial: Path, path: Path, record: dict) -> Path:
    """``partial``, written whole, becomes ``path`` (an interrupted write never leaves a
    checkpoint that looks whole there), marked as written from ``record``."""
    (partial / MADE).write_text(json.dumps(record))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)
    return path


# the projections a GPTQ quantizer takes in a Qwen3.5 checkpoint (the GDN's in_proj_a / in_proj_b,
# norms, conv, embedding and LM head stay bf16, as in Qwen's and gptqmodel's int4 releases)
GPTQ_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "in_proj_qkv", "in_proj_z", "out_proj")
SHARD_BYTES = 4 << 30


def random_gptq_checkpoint(shape: str | dict, path: Path, vocab_size: int | None = None, group: int = 128) -> Path:
    """A checkpoint at ``shape`` as gptqmodel saves a 4-bit one (symmetric, groups of ``group``,
    the classic format): random packed integers in every projection of ``GPTQ_MODULES``, small
    random bf16 values in the other matrices, zeros in the vectors (the zero-centred norms then
    scale by one; the Gated DeltaNet's output norm, which is not, ones). Written tensor by
    tensor in shards, with no model built: the 27B's is 15 GB where the bf16 one is 54 GB. The tensor names and shapes are those transformers saves at
    that config (``random_checkpoint``); reused, and written beside ``path`` first, as there."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = _shape_dict(shape, vocab_size)
    record = {"config": cfg, "weights": "gptq", "group": group}
    if _written_from(path, record):
        return path
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    names = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
    del model
    partial = _partial(path)
    config.save_pretrained(partial)
    saved = json.loads((partial / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                    "sym": True, "checkpoint_format": "gptq"}
    (partial / "config.json").write_text(json.dumps(saved, indent=2))
    gen = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    nbytes = [0, 0]  # the shard's, the whole checkpoint's

    def flush() -> None:
        if shard:
            name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(partial / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard.clear()
            nbytes[0] = 0

    def put(name: str, t: torch.Tensor) -> None:
        shard[name] = t
        nbytes[0] += t.numel() * t.element_size()
        nbytes[1] += t.numel() * t.element_size()
        if nbytes[0] >= SHARD_BYTES:
            flush()

    for name, (dims, dtype) in names.items():
        module, leaf = name.rsplit(".", 1)
        if leaf == "weight" and len(dims) == 2 and module.rsplit(".", 1)[-1] in GPTQ_MODULES \
                and dims[1] % group == 0 and dims[0] % 8 == 0:
            out, cols = dims
            put(f"{module}.qweight", torch.randint(-2**31, 2**31, (cols // 8, out), dtype=torch.int32, generator=gen))
            put(f"{module}.qzeros", torch.full((cols // group, out // 8), 0x77777777, dtype=torch.int32))  # zero 8, stored - 1
            # |scale * (q - 8)| <= 8 * scale: weights of about the spread of a 0.02-std matrix
            put(f"{module}.scales", (0.003 + 0.002 * torch.rand(cols // group, out, generator=gen)).half())
            put(f"{module}.g_idx", torch.arange(cols, dtype=torch.int32) // group)
        elif len(dims) >= 2:
            put(name, (torch.randn(dims, generator=gen) * 0.02).to(dtype))
        elif name.endswith("linear_attn.norm.weight"):  # the gated output norm scales by its weight itself
            put(name, torch.ones(dims, dtype=dtype))
        else:
            put(name, torch.zeros(dims, dtype=dtype))
    flush()
    (partial / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": nbytes[1]}, "weight_map": weight_map}, indent=2))
    return _finish(partial, path, record)
