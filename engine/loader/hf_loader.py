"""Read a Hugging Face model directory: config, safetensors weights (lazily), tokenizer, defaults.

Weight names are normalised to what the text models expect: ``model.language_model.X`` (saved by
``Qwen3_5ForConditionalGeneration``) becomes ``model.X``. MTP heads and vision towers are left
out of the main weights and reported once (read apart: ``Checkpoint.mtp_weights`` for --spec mtp,
``vision_weights`` for --vision); any other tensor goes to the model's
``load_weights``, which rejects what it does not know.

A pre-quantized checkpoint (``quantization_config``: FP8 block-wise, GPTQ, AWQ; ``hf_quant.py``)
gives each quantized projection as ``P.weight``: dequantized by ``Checkpoint.weights()``, and by
``Checkpoint.quantized_weights()`` (GPTQ / AWQ) as a ``GroupQuantized`` weight where its groups
are runs of consecutive columns, for the layers' linear methods (``loader.load_model``).
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from contextlib import ExitStack
from typing import Any, Iterator

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..layers.linear import GroupQuantized
from .checkpoint import Checkpoint, GenerationDefaults
from .hf_quant import FP8_DTYPES, FP8_SCALE, READERS, QuantConfig, QuantPlan, fp8_dequantize, plan_tensors, \
    read_quant_config

log = logging.getLogger("ninfer.loader")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# weight groups that belong to parts we do not run yet (checked on the names as saved)
SKIPPED_PREFIXES = ("mtp.", "model.mtp.", "model.visual.", "visual.")
MTP_PREFIXES = ("mtp.", "model.mtp.")  # read apart, for --spec mtp (``Checkpoint.mtp_weights``)
VISION_PREFIXES = ("model.visual.", "visual.")  # read apart, for --vision (``Checkpoint.vision_weights``)
# a base model saved alone (Qwen3-Embedding's ``Qwen3Model``) has its stack's names without
# ``model.``; tied, its LM head is its embedding
_RENAMES = (("model.language_model.", "model."), ("embed_tokens.", "model.embed_tokens."),
            ("layers.", "model.layers."), ("norm.", "model.norm."))


def normalise_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def skipped_prefix(name: str) -> str | None:
    """The skipped group ``name`` (as saved) belongs to, or None."""
    return next((p for p in SKIPPED_PREFIXES if name.startswith(p)), None)


def _named(name: str, mtp: bool) -> str:
    return name.removeprefix("model.") if mtp else normalise_name(name)


def mtp_layer_count(names) -> int:
    """MTP layers a checkpoint's tensor names hold (``mtp.layers.N.*``)."""
    found = {int(n.split(".")[2]) for n in (x.removeprefix("model.") for x in names)
             if n.startswith("mtp.layers.") and n.split(".")[2].isdigit()}
    return max(found) + 1 if found else 0


def weight_files(path: str) -> dict[str, list[str]]:
    """Safetensors file -> tensor names in it, for a single-file or sharded checkpoint."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return {os.path.join(path, f): names for f, names in sorted(files.items())}
    single = os.path.join(path, SINGLE_FILE)
    if os.path.exists(single):
        with _opened(single) as f:
            return {single: list(f.keys())}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def _opened(file: str):
    """``safe_open`` of a weights file; one that is not whole (an interrupted download) is a
    ValueError naming it, which the server reports at start without a traceback."""
    try:
        return safe_open(file, framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (not exported as a base)
        if isinstance(exc, (FileNotFoundError, PermissionError)):
            raise
        raise ValueError(f"{file} is not a readable safetensors file ({exc}); it may be an incomplete download") \
            from None


def vision_weights(files: dict[str, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision tower's tensors, named as saved (``model.visual.*``)."""
    for file, names in files.items():
        with _opened(file) as f:
            for name in names:
                if name.startswith(VISION_PREFIXES):
                    yield name, f.get_tensor(name)


def iter_weights(files: dict[str, list[str]], quant: QuantConfig | None = None, plan: QuantPlan | None = None,
                 keep_quantized: bool = False, mtp: bool = False,
                 take=None) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
    """``(normalised name, tensor)`` one at a time, skipping the groups in ``SKIPPED_PREFIXES``
    (``mtp``: the MTP head's tensors only, named ``mtp.*``). With ``take`` each tensor is
    ``take(name, slice)``, the file's slice (``get_slice``) read only where ``take`` indexes it;
    a quantized projection is read whole, dequantized, then given to ``take``.

    In a pre-quantized checkpoint (``quant``, its tensors ``plan``: ``hf_quant.py``) each
    quantized projection comes once, as ``P.weight``, when its anchor tensor comes: FP8 ones
    dequantized to fp32; GPTQ / AWQ ones dequantized too, or with ``keep_quantized`` as
    ``GroupQuantized`` where their groups allow it. The parts of a projection may lie in other
    shards: every file stays open until the iteration ends.
    """
    where = {name: file for file, names in files.items() for name in names}
    skip = set() if plan is None else plan.parts | plan.dropped
    anchors = {} if plan is None else plan.anchors
    dequantized: list[str] = []
    with ExitStack() as stack:
        handles: dict[str, Any] = {}

        def opened(file: str):
            if file not in handles:
                handles[file] = stack.enter_context(_opened(file))
            return handles[file]

        def get(name: str) -> torch.Tensor | None:
            file = where.get(name)
            return None if file is None else opened(file).get_tensor(name)

        for file, names in files.items():
            f = opened(file)
            for name in names:
                if name in skip or (not name.startswith(MTP_PREFIXES) if mtp else skipped_prefix(name) is not None):
                    continue
                module = anchors.get(name)
                if module is None:
                    tensor = f.get_tensor(name) if take is None else take(_named(name, mtp), f.get_slice(name))
                    if tensor.dtype in FP8_DTYPES:
                        raise ValueError(f"{name} is float8 with no {name}_scale_inv"
                                         + ("" if quant else " and the checkpoint has no quantization_config"))
                    yield _named(name, mtp), tensor
                    continue
                if quant.method == "fp8":
                    weight = fp8_dequantize(name, f.get_tensor(name), get(f"{module}.{FP8_SCALE}"), quant.block)
                else:
                    packed = READERS[quant.method](module, get, quant)
                    weight = packed.group_quantized() if keep_quantized else None
                    if weight is None:
                        if keep_quantized:
                            dequantized.append(module)
                        weight = packed.dequantize()
                if take is not None:
                    weight = take(_named(f"{module}.weight", mtp), weight)
                yield _named(f"{module}.weight", mtp), weight
    if dequantized:
        log.info("%d %s projections dequantized at load: their groups are not runs of consecutive input "
                 "columns (act-order, desc_act) or do not split the row (%s%s)", len(dequantized), quant.kind,
                 ", ".join(dequantized[:3]), ", ..." if len(dequantized) > 3 else "")


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def generation_defaults(path: str, config: ModelConfig) -> GenerationDefaults:
    """From ``generation_config.json``; stop ids fall back to the config's eos ids."""
    gen = _read_json(os.path.join(path, "generation_config.json")) or {}
    eos = gen.get("eos_token_id")
    if eos is None:
        eos_ids = list(config.eos_token_ids)
    else:
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    return GenerationDefaults.read(eos_ids, gen.get)


def declared_pooling(path: str) -> str:
    """The pooling a sentence-transformers checkpoint declares: its ``modules.json`` names a
    Pooling module whose ``config.json`` sets ``pooling_mode_lasttoken`` (Qwen3-Embedding) ->
    "last"; anything else -> "mean"."""
    for module in _read_json(os.path.join(path, "modules.json")) or []:
        if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
            cfg = _read_json(os.path.join(path, str(module.get("path", "")), "config.json")) or {}
            if cfg.get("pooling_mode_lasttoken"):
                return "last"
    return "mean"


def load_hf_dir(path: str | os.PathLike) -> Checkpoint:
    """A ``Checkpoint`` for a Hugging Face directory; weights are read only when iterated.

    Raises ``UnsupportedModelError`` (from ``ModelConfig``) for an unknown ``model_type``. Without
    ``tokenizer.json`` the checkpoint has no tokenizer and the caller decides what to use.
    """
    path = os.fspath(path)
    cfg = _read_json(os.path.join(path, "config.json"))
    if cfg is None:
        raise FileNotFoundError(f"no config.json in {path}")
    config = ModelConfig.from_hf_dict(cfg)

    quant = read_quant_config(cfg, path)
    files = weight_files(path)
    skipped = Counter(p for names in files.values() for p in map(skipped_prefix, names) if p)
    for prefix, count in skipped.items():
        why = ("read with --vision only" if prefix in VISION_PREFIXES else
               "read with --spec mtp only" if prefix in MTP_PREFIXES else "not run by this engine yet")
        log.info("skipping %d tensors under %r (%s)", count, prefix, why)
    plan = None
    names = [n for group in files.values() for n in group]
    mtp_layers = mtp_layer_count(names)
    if mtp_layers and not config.mtp_layers:  # a config that does not count them (Qwen3-Next's)
        config.mtp_layers = mtp_layers
    if quant is not None:
        plan = plan_tensors({n for n in names if skipped_prefix(n) is None or n.startswith(MTP_PREFIXES)}, quant)
        held = "dequantized at load" if quant.method == "fp8" else "kept quantized where a linear method takes them"
        log.info("%s checkpoint: %d quantized projections, %s", quant.kind, len(plan.anchors), held)

    tokenizer, chat_template = None, None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from ..frontend.hf_tokenizer import HFTokenizer, chat_template_from_dir

        tokenizer = HFTokenizer.from_dir(path)
        chat_template = chat_template_from_dir(path)

    has_vision = config.vision is not None and any(n.startswith(VISION_PREFIXES) for n in names)
    image_processor = None
    if has_vision:
        from ..vision.processor import ImageProcessor

        image_processor = ImageProcessor.from_dir(path, config.vision)
    return Checkpoint(
        config=config,
        weights=lambda: iter_weights(files, quant, plan),
        sliced_weights=lambda take: iter_weights(files, quant, plan, take=take),
        quantized_weights=(lambda: iter_weights(files, quant, plan, keep_quantized=True))
        if quant is not None and quant.packed else None,
        tokenizer=tokenizer,
        chat_template=chat_template,
        generation=generation_defaults(path, config),
        source=path,
        skipped_prefixes=tuple(skipped),
        pooling=declared_pooling(path),
        mtp_weights=(lambda: iter_weights(files, quant, plan, mtp=True)) if mtp_layers else None,
        vision_weights=(lambda: vision_weights(files)) if has_vision else None,
        image_processor=image_processor,
    )
