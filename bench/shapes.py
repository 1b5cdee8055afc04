"""Model shapes the benchmarks build (the launcher's table of known Qwen3.5 sizes), and random
checkpoints at those shapes for the benchmarks that go through the server."""
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


def random_checkpoint(shape: str | dict, path: Path, vocab_size: int | None = None) -> Path:
    """A checkpoint of random bf16 weights at ``shape`` (a name of ``SHAPES`` or a config dict)
    written by transformers into ``path``, on the GPU when there is one; reused when ``path``
    already holds one of the same config. ``vocab_size`` replaces the shape's, so that every id
    the model can sample is one the tokenizer can decode. Written beside ``path`` and renamed, so
    an interrupted write never leaves a checkpoint that looks whole."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SHAPES[shape.lower()] if isinstance(shape, str) else shape)
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    made = path / "random_shape.json"  # the config it was written from (transformers rewrites some keys)
    if made.exists() and json.loads(made.read_text()) == cfg:
        return path
    config = AutoConfig.for_model(**cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    (partial / made.name).write_text(json.dumps(cfg))
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)
    return path
