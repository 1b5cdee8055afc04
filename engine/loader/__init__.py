"""Reading a model from disk: a Hugging Face checkpoint directory or a GGUF file."""
from __future__ import annotations

import logging
import time
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ..layers.embedding import LMHead
from ..layers.linear import GroupQuantized, Linear, method_fits
from ..layers.moe import FusedExperts, QuantizedExperts
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
               weights: str = "auto", mtp: bool = False, vision: bool = False, shard=None,
               embedding_host: bool = False, head_bits: int | None = None) -> CausalLM:
    """The model of ``ckpt`` on ``device``, weights held as ``weights`` says
    (``engine_config.WEIGHT_FORMATS``): with "auto" a checkpoint's quantized matrices
    (``Checkpoint.quantized_weights``: a GGUF file's Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0, GPTQ / AWQ
    projections) stay quantized where a linear method on ``device`` takes them
    (``placed_quantized``); "int8" / "int4" quantize the projections at load
    (``quantized_at_load``). ``mtp``: with the checkpoint's MTP head (``models/mtp.py``, for
    ``--spec mtp``); without it ``model.config.mtp_layers`` is 0. ``vision``: with the
    checkpoint's vision tower as ``model.visual`` (``vision/encoder.py``, for ``--vision``; held
    in ``dtype``, never quantized); without it ``model.visual`` is None. ``shard``: one
    tensor-parallel rank's part (a ``parallel.Sharder``: its layers built from
    ``parallel.shard_config``, only its slices of the checkpoint read; quantized formats
    dequantized whole first, ``weights`` "auto" on a quantized checkpoint refused).
    ``embedding_host``: the token embedding's table in pinned host memory, read in place by the
    GPU's lookups (``layers/embedding.py``). ``head_bits``: off the CPU, the untied LM head's
    groups (``--head-weights``): with "int8" / "int4" 8 bits where None, or 4 where the card has no
    room for 8; a checkpoint kept quantized whose head is stored dense (GPTQ, AWQ) keeps it so
    where None, and quantizes it at load to ``head_bits`` where given; refused for dense weights.

    Parameters take device memory only as the checkpoint gives them (``build_model(lazy=True)``),
    so a projection held quantized never has a dense copy on the device."""
    from ..engine_config import QUANTIZED_AT_LOAD, WEIGHT_FORMATS
    from ..models.registry import build_model

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    start = time.perf_counter()
    config = ckpt.config
    if mtp and (ckpt.mtp_weights is None or not config.mtp_layers):
        raise ValueError(f"{ckpt.source} has no MTP weights (mtp.*): serve it with --spec off or ngram")
    keep = weights == "auto" and ckpt.quantized_weights is not None
    if shard is not None:
        from ..parallel import shard_config

        if keep:
            raise ValueError(f"{ckpt.source} holds quantized weights, which tensor parallelism splits only "
                             "dequantized: serve it with --weights dense")
        config = shard_config(config, shard.world)
    model = build_model(config, dtype=dtype, device=device, mtp=mtp, lazy=True)
    if embedding_host:
        model.model.embed_tokens.hold_on_host()
    source = ckpt.weights() if not mtp else chain(ckpt.weights(), ckpt.mtp_weights())
    if shard is not None:
        source = ckpt.sliced_weights(shard) if ckpt.sliced_weights is not None else \
            ((name, shard(name, tensor)) for name, tensor in ckpt.weights())
    if weights in QUANTIZED_AT_LOAD:
        keep = True
        tensors = quantized_at_load(model, source, QUANTIZED_AT_LOAD[weights], torch.device(device),
                                    head_bits or 8, requantized=ckpt.quantized_weights is not None)
    elif keep:
        quantized = ckpt.quantized_weights()
        tensors = placed_quantized(model, quantized if not mtp else chain(quantized, ckpt.mtp_weights()),
                                   torch.device(device))
        if head_bits is not None:
            tensors = _head_quantized(model, tensors, head_bits, torch.device(device))
    elif head_bits is not None:
        raise ValueError(f"--head-weights applies to quantized weights, and {ckpt.source} is served dense: "
                         "serve it with --weights int8 / int4, or without --head-weights")
    else:
        tensors = source
    model.load_weights(tensors)
    settled = sum(m.settle(dtype) for m in model.modules() if isinstance(m, FusedExperts))
    if settled:
        log.info("%d MoE layers' experts dequantized: one matrix of each came in a format the GPU does not "
                 "hold quantized", settled)
    if vision:
        if ckpt.vision_weights is None:
            raise ValueError(f"{ckpt.source} has no vision tower (model.visual.* and vision_config): "
                             "serve it without --vision")
        from ..vision.encoder import VisionEncoder

        visual = VisionEncoder(config.vision)
        visual.load_weights(ckpt.vision_weights())
        model.visual = visual.to(device=device, dtype=dtype).eval()
    model.eval()
    if torch.device(device).type == "cuda" or keep:
        # on the CPU only a checkpoint held quantized: one int4 product for q/k/v, one for gate/up
        from ..layers.fused_linear import fuse_model_projections

        fuse_model_projections(model)
    log.info("loaded %s (%s) on %s as %s (weights %s) in %.1f s", ckpt.source, ckpt.config.model_type, device,
             str(dtype).removeprefix("torch."), weights, time.perf_counter() - start)
    return model


def placed_quantized(model: CausalLM, weights: Iterable[tuple[str, Any]],
                     device: torch.device) -> Iterator[tuple[str, Any]]:
    """``weights`` with each ``GroupQuantized`` one kept where its module holds it quantized on
    ``device``: a projection (``Linear``) whose method there takes its bits and groups
    (``linear.method_fits``), and on the CPU an embedding table or an LM head, which hold it or
    dequantize it themselves (``embedding.py``), and the MoE experts' matrices where
    ``moe.QuantizedExperts`` holds them; every other one (odd group sizes on the GPU, say)
    dequantized here."""
    dequantized = 0
    for name, tensor in weights:
        if isinstance(tensor, GroupQuantized) and not _holds_quantized(model, name, tensor, device):
            tensor = tensor.dequantize()
            owner, _, attr = name.rpartition(".")
            module = _submodule(model, owner)
            if isinstance(module, FusedExperts):  # the experts' E * N rows back to [E, N, K]
                tensor = tensor.view(module.shapes()[attr])
            dequantized += 1
        yield name, tensor
    if dequantized:
        log.info("%d quantized matrices dequantized at load: no method on %s holds them as they are",
                 dequantized, device.type)


def _submodule(model: CausalLM, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _holds_quantized(model: CausalLM, name: str, w: GroupQuantized, device: torch.device) -> bool:
    owner, _, attr = name.rpartition(".")
    module = _submodule(model, owner)
    if module is None:
        return False
    if isinstance(module, FusedExperts):
        return attr in module.QUANTIZED and QuantizedExperts.fits(w, module.num_experts, device)
    if attr != "weight":
        return False
    if isinstance(module, Linear) or isinstance(module, LMHead) and device.type != "cpu":
        return method_fits(w, device)  # (on the CPU a head picks its own method: embedding.py)
    return device.type == "cpu" and hasattr(module, "take_quantized")


def quantized_at_load(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]],
                      bits: int, device: torch.device = torch.device("cpu"), head_bits: int = 8,
                      requantized: bool = False) -> Iterator[tuple[str, Any]]:
    """``weights`` with each projection's (a ``Linear`` module's) dense weight quantized to
    ``bits`` (``linear.quantize_rtn``) where a method on ``device`` takes its shape
    (``linear.method_fits``), the MoE experts' to ``bits`` where both their matrices are held so
    (``moe.QuantizedExperts``), and off the CPU the untied LM head's to ``head_bits`` (8 by
    default: sampling reads its logits; 4 where a card has no room for 8); every other tensor
    (norms, embeddings, routers) as it is. ``requantized``: the weights come from a quantized
    checkpoint, dequantized (``linear.quantize_rtn``'s groups for them)."""
    from ..layers.linear import quantize_rtn_rows
    from ..layers.moe import fuse_expert_weights

    if getattr(model.config, "is_moe", False):  # experts saved one by one come as the fused matrices
        weights = fuse_expert_weights(weights, model.config.num_experts)
    for name, tensor in weights:
        owner, _, attr = name.rpartition(".")
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            module = None
        if isinstance(module, Linear) and attr == "weight" and tensor.dim() == 2:
            q = quantize_rtn_rows(tensor, bits, device, requantized)  # on the GPU: the 27B's matrices in seconds
            if q is not None and method_fits(q, device):
                yield name, q
                continue
        if isinstance(module, FusedExperts) and attr in module.QUANTIZED and tensor.dim() == 3:
            q = _experts_at_load(module, attr, tensor, bits, device, requantized)
            if q is not None:
                yield name, q
                continue
        q = _head_at_load(module, attr, tensor, head_bits, device)
        yield name, tensor if q is None else q


def _head_at_load(module, attr: str, tensor: Any, bits: int, device: torch.device) -> GroupQuantized | None:
    """An untied LM head's dense weight quantized to ``bits`` off the CPU where a method on
    ``device`` holds it (None otherwise: it stays as it is)."""
    from ..layers.linear import quantize_rtn_rows

    if not (isinstance(module, LMHead) and not module.tied and attr == "weight" and device.type != "cpu"
            and isinstance(tensor, torch.Tensor) and tensor.dim() == 2):
        return None
    q = quantize_rtn_rows(tensor, bits, device)  # never the whole head in fp32 (or bf16) on the device
    return q if q is not None and method_fits(q, device) else None


def _head_quantized(model: CausalLM, weights: Iterable[tuple[str, Any]], bits: int,
                    device: torch.device) -> Iterator[tuple[str, Any]]:
    """``weights`` of a checkpoint kept quantized, its untied LM head's dense weight (GPTQ and AWQ
    store it in bf16) quantized to ``bits`` (``--head-weights``); every other tensor as it is."""
    for name, tensor in weights:
        owner, _, attr = name.rpartition(".")
        q = _head_at_load(_submodule(model, owner), attr, tensor, bits, device)
        yield name, tensor if q is None else q


def _experts_at_load(experts: FusedExperts, attr: str, tensor: torch.Tensor, bits: int,
                     device: torch.device, requantized: bool = False) -> GroupQuantized | None:
    """``tensor`` (``[E, N, K]``, one of ``experts``' two matrices) quantized over its ``E * N``
    rows, or None where either matrix's columns take no group or its held form (so both stay
    dense: the kernels take both held or neither)."""
    from ..layers.linear import quantize_rtn

    e = experts.num_experts
    for other, (_, n, k) in experts.shapes().items():
        if other == attr:
            continue
        probe = quantize_rtn(torch.zeros(n, k), bits, requantized)  # the groups one expert of the other would take
        if probe is None or not QuantizedExperts.fits(probe, 1, device):
            return None
    q = quantize_rtn(tensor.to(device).reshape(-1, tensor.shape[-1]), bits, requantized)
    return q if q is not None and QuantizedExperts.fits(q, e, device) else None
