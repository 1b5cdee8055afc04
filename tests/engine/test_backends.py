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


@pytest.mark.parametrize("widths, recurrent", [
    ((65,), True),  # a returning turn's new tokens
    ((128, 100), True),  # 2 x 128: the step's 256
    ((100, 100, 90), False),  # 3 x 100 past the step's 256
    ((64, 3, 50, 7), True),  # 4 x 64
    ((129,), False),  # a row past 128
    ((200,) * 10, False),  # a burst of short prompts: the GPU sets the pace, the chunked form wins
])
def test_which_gated_deltanet_prompt_rows_take_the_recurrent_form(widths, recurrent, monkeypatch):
    """On the GPU a step's prompt rows go through the verify kernel's recurrent form when they
    are few and short (``gdn_recurrent_prompt_tokens``, ``gdn_recurrent_step_tokens``), else
    through the conv and the chunked rule; a setting of 0 keeps every step on the chunked form."""
    from types import SimpleNamespace

    from ninfer.engine import launch
    from ninfer.engine.layers.backends import TritonLinearAttention

    taken = []
    monkeypatch.setattr(TritonLinearAttention, "short_rows", staticmethod(lambda *a: taken.append("recurrent")))
    layer = SimpleNamespace(layer_idx=3, head_k_dim=128, head_v_dim=128,
                            _mix_prompt_rows=lambda *a: taken.append("chunked"))
    meta = SimpleNamespace(gdn_ordinal={3: 0}, num_decode=2, slot_ids=torch.arange(2 + len(widths)),
                           states=SimpleNamespace(conv=[None], recurrent=[None]),
                           prompt=SimpleNamespace(max_seqlen=max(widths), slots_host=list(range(len(widths)))))
    backend = TritonLinearAttention()
    backend.prompt(layer, (None,), None, None, meta)
    with launch.using(gdn_recurrent_prompt_tokens=0):
        backend.prompt(layer, (None,), None, None, meta)
    assert taken == ["recurrent" if recurrent else "chunked", "chunked"]
