"""``ModelConfig.family`` -> model class, built without wasting time on random initialisation."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..config import ModelConfig, UnsupportedModelError
from ..layers.backends import Backends, use_backends
from .base import CausalLM


def model_class(family: str) -> type[CausalLM]:
    """The class for a family; hybrid families are imported only when asked for."""
    if family == "llama":
        from .llama import LlamaForCausalLM

        return LlamaForCausalLM
    if family == "qwen3":
        from .qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    if family in ("qwen3_5", "qwen3_5_moe"):
        from . import qwen3_5

        return _pick(qwen3_5, family)
    if family == "qwen3_next":
        from . import qwen3_next

        return _pick(qwen3_next, family)
    raise UnsupportedModelError(f"no model implementation for family {family!r}")


def _pick(module, family: str) -> type[CausalLM]:
    """The family's class by its agreed name in the hybrid-model modules."""
    names = {
        "qwen3_5": "Qwen3_5ForCausalLM",
        "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
        "qwen3_next": "Qwen3NextForCausalLM",
    }
    cls = getattr(module, names[family], None)
    if cls is None:
        raise UnsupportedModelError(f"{module.__name__} has no {names[family]} for family {family!r}")
    return cls


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", mtp: bool = False,
    lazy: bool = False,
) -> CausalLM:
    """An uninitialised model of ``dtype`` on ``device``, in eval mode; call ``load_weights`` next.
    ``mtp``: with the MTP head the config counts (``models/mtp.py``); without it the model's
    config counts none.

    The modules are created on the ``meta`` device (no memory, no random init) and then given
    empty storage on ``device``, so parameter values are garbage until the checkpoint is loaded.
    ``lazy``: the parameters stay on ``meta`` and each takes its storage on ``device`` when the
    checkpoint gives it (``weights.load_parameters``), so a weight held quantized never has a
    dense copy on the device (the 27B's bf16 matrices would take 54 GB before their 4-bit
    forms replaced them). The token mixers take the kernels of ``device`` (``layers/backends.py``).
    """
    if not mtp and config.mtp_layers:
        config = replace(config, mtp_layers=0)
    cls = model_class(config.family)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype)
    if lazy:
        model.load_device = torch.device(device)
    else:
        model = model.to_empty(device=device)
    use_backends(model, Backends.for_device(device))  # the token mixers' kernels for this device
    return model.eval().requires_grad_(False)
