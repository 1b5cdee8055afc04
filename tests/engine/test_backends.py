"""The token mixers' kernels are chosen once, by the device a model is built on
(``layers/backends.py``), and a step over the pools gives the same tokens through any backend
that runs on this machine as the models' reference path does."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.layers.attention import Attention
from ninfer.engine.layers.backends import Backends, use_backends
from ninfer.engine.layers.gated_delta_net import GatedDeltaNet
from ninfer.engine.models.registry import build_model
from support.decode_paths import load_parts, reference, run


def mixers(model) -> dict[str, str]:
    return {type(m).__name__: m.backend.name for m in model.modules() if isinstance(m, (Attention, GatedDeltaNet))}


def test_a_model_takes_the_backends_of_its_device(tmp_path_factory):
    model, _ = load_parts("qwen3_5", tmp_path_factory)
    assert mixers(model) == {"Attention": "torch", "GatedDeltaNet": "torch"}
    meta = build_model(model.config, torch.bfloat16, "meta")
    assert set(mixers(meta).values()) == {"torch"}
    cuda = Backends.for_device("cuda")  # chosen by the device's kind alone: no GPU needed to name them
    assert (cuda.attention.name, cuda.linear_attention.name) == ("triton", "triton")
    assert cuda.attention.fused_write and not Backends.for_device("cpu").attention.fused_write


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "llama"])
def test_steps_through_the_torch_backend_keep_the_reference_tokens(name, tmp_path_factory):
    """Four requests whose prompt chunks and decode rows share steps: each one's greedy tokens
    are those of its own reference run (the backends' step path against the sequence path)."""
    parts = load_parts(name, tmp_path_factory)
    use_backends(parts[0], Backends.named("torch"))
    assert run(parts) == reference(parts)
