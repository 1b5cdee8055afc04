"""MTP head tensors (``mtp.*``, as Qwen3.5 / Qwen3-Next checkpoints save them) added to a tiny
checkpoint saved by transformers, which has no MTP module of its own."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def add_mtp_weights(path: Path, seed: int = 1, std: float = 0.3, count_in_config: bool = True) -> Path:
    """Add one MTP layer to the checkpoint at ``path``: ``mtp.fc`` (2H -> H), its three norms
    and ``mtp.layers.0.*`` shaped as the checkpoint's first full-attention layer (gated
    attention, dense or MoE MLP), all random (``std``); ``count_in_config``: also write
    ``mtp_num_hidden_layers: 1`` into ``config.json`` (Qwen3-Next configs do not count them)."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    hidden = text["hidden_size"]
    full = text["layer_types"].index("full_attention")
    prefix = next(p for p in ("model.language_model.layers.", "model.layers.") if any(k.startswith(p) for k in tensors))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    mtp = {"mtp.fc.weight": rand(hidden, 2 * hidden), "mtp.pre_fc_norm_embedding.weight": rand(hidden),
           "mtp.pre_fc_norm_hidden.weight": rand(hidden), "mtp.norm.weight": rand(hidden)}
    layer = f"{prefix}{full}."
    for name, tensor in tensors.items():
        if name.startswith(layer):
            mtp["mtp.layers.0." + name[len(layer):]] = rand(*tensor.shape).to(tensor.dtype)
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
    if count_in_config:
        text["mtp_num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
