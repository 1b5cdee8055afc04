"""Reading a model from disk: a Hugging Face checkpoint directory or a GGUF file."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

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
    stay quantized (``Checkpoint.quantized_weights``); "int8" / "int4" quantize the projections
    at load (``quantized_at_load``)."""
    from ..engine_config import QUANTIZED_AT_LOAD, WEIGHT_FORMATS
    from ..models.registry import build_model

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    on_cpu = torch.device(device).type == "cpu"
    start = time.perf_counter()
    model = build_model(ckpt.config, dtype=dtype, device=device)
    keep = weights == "auto" and on_cpu and ckpt.quantized_weights is not None
    if weights in QUANTIZED_AT_LOAD:
        keep = True
        tensors = quantized_at_load(model, ckpt.weights(), QUANTIZED_AT_LOAD[weights], torch.device(device))
    else:
        tensors = ckpt.quantized_weights() if keep else ckpt.weights()
    model.load_weights(tensors)
    model.eval()
    if torch.device(device).type == "cuda" or keep:
        # on the CPU only a checkpoint held quantized: one int4 product for q/k/v, one for gate/up
        from ..layers.fused_linear import fuse_model_projections

        fuse_model_projections(model)
    log.info("loaded %s (%s) on %s as %s (weights %s) in %.1f s", ckpt.source, ckpt.config.model_type, device,
             str(dtype).removeprefix("torch."), weights, time.perf_counter() - start)
    return model


def quantized_at_load(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]],
                      bits: int, device: torch.device = torch.device("cpu")) -> Iterator[tuple[str, Any]]:
    """``weights`` with each projection's (a ``Linear`` module's) dense weight quantized to
    ``bits`` (``linear.quantize_rtn``) where a method on ``device`` takes its shape
    (``linear.method_fits``), and off the CPU the LM head's to 8 bits (sampling reads its logits:
    4 bits there cost more than they save); every other tensor (norms, embeddings, routers, MoE
    experts) as it is."""
    from ..layers.embedding import LMHead
    from ..layers.linear import Linear, method_fits, quantize_rtn

    for name, tensor in weights:
        owner, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            module = None
        if isinstance(module, Linear) and attr == "weight" and tensor.dim() == 2:
            q = quantize_rtn(tensor, bits)
            if q is not None and method_fits(q, device):
                yield name, q
                continue
        if isinstance(module, LMHead) and not module.tied and attr == "weight" and device.type != "cpu":
            q = quantize_rtn(tensor, 8)
            if q is not None and method_fits(q, device):
                yield name, q
                continue
        yield name, tensor
