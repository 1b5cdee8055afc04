"""What the memory plan needs to know about a model: its shapes and parameter counts.

Read from a checkpoint's ``config.json``, a GGUF file's metadata, or a config dict; never from the
weights, and never from the file name. Parameter counts are computed from the shapes (the same
layers ``engine/models`` builds), split into matrices that quantise and the rest that stays 16-bit.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..engine.config import ModelConfig

QWEN_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@dataclass(frozen=True)
class ParamCounts:
    matrices: int  # projection / expert / MLP weights: what 4- or 8-bit quantisation packs
    embeddings: int  # token embedding and lm_head (kept 16-bit in quantised checkpoints)
    other: int  # norms, conv kernels, gates, A_log, dt_bias: small, kept 16-bit

    @property
    def total(self) -> int:
        return self.matrices + self.embeddings + self.other


@dataclass(frozen=True)
class ModelShape:
    name: str  # what the user sees: the folder or file name, or the embedded model's id
    config: ModelConfig
    params: ParamCounts  # the main model, as loaded
    mtp_params: ParamCounts  # the MTP head (loaded only for speculative decoding)
    mtp_layers: int
    quant_bits: int | None = None  # 4 / 8 when the checkpoint itself is quantised
    gguf: bool = False
    quant_method: str | None = None  # its quantization_config's quant_method ("gptq", "awq", "fp8")
    quant_symmetric: bool = False  # 4-bit GPTQ stored symmetric (``sym``, its default): no zero points to hold
    # the vision tower (``model.visual.*``, loaded only with --vision): its parameters, and the
    # activations its largest image (``max_pixels``) holds at once, in elements
    vision_params: int = 0
    vision_activations: int = 0

    @property
    def dense(self) -> bool:
        """A checkpoint of dense weights (bf16 / fp16 / fp32 safetensors): what ``--weights
        int8|int4`` quantizes at load."""
        return self.quant_bits is None and not self.gguf

    @property
    def n_attention(self) -> int:
        return sum(t == "full_attention" for t in self.config.layer_types)

    @property
    def n_gdn(self) -> int:
        return sum(t == "linear_attention" for t in self.config.layer_types)

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    @property
    def signature(self) -> str:
        """Shape key for the presets table: family, width, depth, experts (not the file name)."""
        c = self.config
        return f"{c.family}/h{c.hidden_size}/l{c.num_hidden_layers}/e{c.num_experts}/v{c.vocab_size}"


# ---------------------------------------------------------------------------------- counting
def _attention_params(c: ModelConfig, gated: bool) -> tuple[int, int]:
    h, d = c.hidden_size, c.head_dim
    q_out = c.num_attention_heads * d * (2 if gated else 1)
    kv_out = c.num_key_value_heads * d
    mats = h * q_out + 2 * h * kv_out + c.num_attention_heads * d * h
    bias = (q_out + 2 * kv_out) if c.attention_bias else 0
    norms = 2 * d if c.family in ("qwen3", *QWEN_FAMILIES) else 0  # q_norm, k_norm
    return mats, bias + norms


def _gdn_params(c: ModelConfig) -> tuple[int, int]:
    h = c.hidden_size
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    hv = c.linear_num_value_heads
    mats = h * conv_dim + h * value_dim + 2 * h * hv + value_dim * h  # qkv, z, b, a, out
    other = conv_dim * c.linear_conv_kernel_dim + 2 * hv + c.linear_value_head_dim  # conv, A_log, dt_bias, norm
    return mats, other


def _mlp_params(c: ModelConfig, moe: bool) -> tuple[int, int]:
    h = c.hidden_size
    if not moe:
        return 3 * h * c.intermediate_size, (3 * c.intermediate_size if c.mlp_bias else 0)
    mats = c.num_experts * 3 * h * c.moe_intermediate_size + c.num_experts * h  # experts + router
    if c.shared_expert_intermediate_size:
        mats += 3 * h * c.shared_expert_intermediate_size
        return mats, h  # shared_expert_gate [1, H]
    return mats, 0


def count_params(c: ModelConfig, gated_attention: bool) -> ParamCounts:
    mats = other = 0
    for i, kind in enumerate(c.layer_types):
        m, o = _gdn_params(c) if kind == "linear_attention" else _attention_params(c, gated_attention)
        mm, mo = _mlp_params(c, c.is_moe_layer(i))
        mats, other = mats + m + mm, other + o + mo + 2 * c.hidden_size  # two layer norms
    emb = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return ParamCounts(mats, emb, other + c.hidden_size)  # + final norm


def count_mtp_params(c: ModelConfig, layers: int, gated_attention: bool) -> ParamCounts:
    """fc [H, 2H], two pre-fc norms, ``layers`` full-attention decoder layers, a norm; shares embeddings."""
    if layers <= 0:
        return ParamCounts(0, 0, 0)
    h = c.hidden_size
    am, ao = _attention_params(c, gated_attention)
    mm, mo = _mlp_params(c, c.is_moe)
    return ParamCounts(2 * h * h + layers * (am + mm), 0, 3 * h + layers * (ao + mo + 2 * h))


DEFAULT_MAX_PIXELS = 16 << 20  # Qwen3.5's preprocessor_config.json: size.longest_edge


def count_vision(cfg: dict[str, Any], max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """``(parameters, activation elements)`` of a checkpoint's vision tower (``vision_config``;
    ``engine/vision/encoder.py``): patch embedding, learned positions, ``depth`` blocks (two
    LayerNorms, qkv and output projections, a two-layer MLP), the merger; the activations of an
    image of ``max_pixels``: per patch the residual stream, its norm, q/k/v, the attention output
    and the MLP's inner width twice (its input and its activation). (0, 0) without one."""
    v = cfg.get("vision_config")
    if not isinstance(v, dict) or "hidden_size" not in v:
        return 0, 0
    d, inner, depth = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["depth"])
    p, t, c = int(v["patch_size"]), int(v.get("temporal_patch_size", 2)), int(v.get("in_channels", 3))
    merged = d * int(v.get("spatial_merge_size", 2)) ** 2
    out = int(v["out_hidden_size"])
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    params = (c * t * p * p * d + d) + int(v["num_position_embeddings"]) * d + depth * block \
        + 2 * d + (merged * merged + merged) + (merged * out + out)
    patches = max_pixels // (p * p)
    return params, patches * (6 * d + 2 * inner)


# ---------------------------------------------------------------------------------- reading
def shape_from_dict(cfg: dict[str, Any], name: str = "model", gguf: bool = False,
                    max_pixels: int = DEFAULT_MAX_PIXELS) -> ModelShape:
    config = ModelConfig.from_hf_dict(cfg)
    text = cfg.get("text_config") or cfg
    qwen = config.family in QWEN_FAMILIES
    gated = bool(text.get("attn_output_gate", qwen))
    mtp = int(text.get("mtp_num_hidden_layers", cfg.get("mtp_num_hidden_layers", 0)) or 0)
    vision = count_vision(cfg, max_pixels)
    quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
    bits = quant.get("bits") or quant.get("w_bit")
    method = str(quant.get("quant_method", "")).lower() or None
    if bits is None and method in ("fp8", "mxfp8"):
        bits = 8
    return ModelShape(
        name=name, config=config, params=count_params(config, gated),
        mtp_params=count_mtp_params(config, mtp, gated), mtp_layers=mtp,
        quant_bits=int(bits) if bits else None, gguf=gguf,
        quant_method=method,
        quant_symmetric=method == "gptq" and bits == 4 and bool(quant.get("sym", True)),
        vision_params=vision[0], vision_activations=vision[1],
    )


def shape_from_gguf(path: Path, name: str | None = None) -> ModelShape:
    """Shapes from GGUF metadata; the parameter count is the sum of the tensors' element counts."""
    meta, tensors = read_gguf_header(path)
    arch = meta.get("general.architecture", "llama")
    if arch in ("qwen35", "qwen35moe"):
        from ..engine.loader import gguf_qwen35  # torch and gguf: only for these files


        shape = shape_from_dict(gguf_qwen35.hf_config_dict(meta, tensors), name or path.stem, gguf=True)
        mtp = int(meta.get(f"{arch}.nextn_predict_layers", 0))
        total = sum(math.prod(dims) for n, dims in tensors.items()
                    if not n.startswith(tuple(f"blk.{shape.config.num_hidden_layers + i}." for i in range(mtp))))
        emb = shape.params.embeddings
        return ModelShape(shape.name, shape.config, ParamCounts(total - emb, emb, 0), shape.mtp_params, 0, gguf=True)

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    cfg = {
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"][1]),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    shape = shape_from_dict(cfg, name or path.stem, gguf=True)
    total = sum(math.prod(dims) for n, dims in tensors.items() if n != "rope_freqs.weight")
    emb = shape.params.embeddings
    # the loader dequantises GGUF weights: in memory they take the compute dtype, whatever the file
    return ModelShape(shape.name, shape.config, ParamCounts(total - emb, emb, 0), shape.mtp_params, 0, gguf=True)


# GGUF value types -> struct format (8: string, 9: array)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_header(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """Scalar metadata (arrays give their length) and each tensor's dims, from the file's header,
    without reading the vocabulary into objects (the ``gguf`` package's reader does: seconds)."""
    with open(path, "rb") as f:
        def unpack(fmt: str) -> Any:
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string() -> str:
            return f.read(unpack("Q")).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind in _GGUF_SCALARS:
                return unpack(_GGUF_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                item, count = unpack("I"), unpack("Q")
                if item in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize("<" + _GGUF_SCALARS[item]), 1)
                elif item == 8:
                    for _ in range(count):
                        f.seek(unpack("Q"), 1)
                else:
                    for _ in range(count):
                        value(item)
                return count
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = unpack("I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = unpack("Q"), unpack("Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            k = string()
            meta[k] = value(unpack("I"))
        tensors: dict[str, tuple[int, ...]] = {}
        for _ in range(n_tensors):
            name = string()
            dims = tuple(unpack("Q") for _ in range(unpack("I")))
            f.seek(4 + 8, 1)  # type, offset
            tensors[name] = dims
    return meta, tensors


def embedded_module():
    """``engine/loader/embedded.py`` loaded on its own: importing it as ``ninfer.engine.loader.embedded``
    would run the loader package, which imports torch (seconds, and memory the tray does not need)."""
    import importlib.util
    import sys

    name = "ninfer_embedded_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / "engine" / "loader" / "embedded.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def load_shape(model: str | Path | None) -> ModelShape:
    """``None``: the embedded default model; a directory with ``config.json``; a ``.gguf`` file."""
    path = None if model is None else Path(model).expanduser()
    cfg = path / "config.json" if path is not None and path.is_dir() else path
    stamp = cfg.stat().st_mtime if cfg is not None and cfg.exists() else None
    return _load_shape(str(path) if path is not None else None, stamp)


@lru_cache(maxsize=16)
def _load_shape(model: str | None, _mtime: float | None) -> ModelShape:
    if model is None:
        embedded = embedded_module()
        return shape_from_gguf(embedded.embedded_model_path(), embedded.EMBEDDED_MODEL_ID)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return shape_from_gguf(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: neither a .gguf file nor a folder with config.json")
    pre = path / "preprocessor_config.json"
    size = json.loads(pre.read_text(encoding="utf-8")).get("size") or {} if pre.is_file() else {}
    return shape_from_dict(json.loads(cfg_path.read_text(encoding="utf-8")), path.resolve().name,
                           max_pixels=int(size.get("longest_edge") or DEFAULT_MAX_PIXELS))
