"""Reading a model from disk: a Hugging Face checkpoint directory or a GGUF file."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..models.base import CausalLM
from .checkpoint import Checkpoint, GenerationDefaults

log = logging.getLogger("ninfer.loader")

__all__ = ["Checkpoint", "GenerationDefaults", "load_checkpoint", "load_model"]


def load_checkpoint(path: str | Path | None) -> Checkpoint:
    """Checkpoint at ``path``; the embedded default model when ``path`` is None."""
    if path is None:
        from .embedded import embedded_model_path

        path = embedded_model_path()
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        from .gguf_loader import load_gguf

        return load_gguf(p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"{p} has no config.json: not a Hugging Face checkpoint directory")
        from .hf_loader import load_hf_dir

        return load_hf_dir(p)
    if p.exists():
        raise ValueError(f"{p} is neither a checkpoint directory nor a .gguf file")
    raise FileNotFoundError(f"model path {p} does not exist")


def load_model(ckpt: Checkpoint, device: str | torch.device, dtype: torch.dtype,
               weights: str = "auto") -> CausalLM:
    """The model of ``ckpt`` on ``device``, weights held as ``weights`` says
    (``engine_config.WEIGHT_FORMATS``): with "auto" on the CPU a checkpoint's quantized matrices
    stay quantized (``Checkpoint.quantized_weights``)."""
    from ..engine_config import WEIGHT_FORMATS
    from ..models.registry import build_model

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    start = time.perf_counter()
    model = build_model(ckpt.config, dtype=dtype, device=device)
    keep = weights == "auto" and torch.device(device).type == "cpu" and ckpt.quantized_weights is not None
    model.load_weights(ckpt.quantized_weights() if keep else ckpt.weights())
    model.eval()
    if torch.device(device).type == "cuda" or keep:
        # on the CPU only a checkpoint held quantized: one int4 product for q/k/v, one for gate/up
        from ..layers.fused_linear import fuse_model_projections

        fuse_model_projections(model)
    log.info("loaded %s (%s) on %s as %s in %.1f s", ckpt.source, ckpt.config.model_type, device,
             str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return model
