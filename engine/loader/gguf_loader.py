"""Read a GGUF file: metadata -> ``ModelConfig``, tensors -> HF-named fp32 tensors.

Architectures: ``llama`` (here) and Qwen3.5's ``qwen35`` / ``qwen35moe`` (``gguf_qwen35.py``, which
undoes llama.cpp's converter for those).

Tensors are dequantised one at a time when ``Checkpoint.weights()`` is iterated (``gguf.quants``
handles F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants and the IQ types). GGUF stores dims
in reverse order, and llama.cpp's converter reorders the rows of ``attn_q`` / ``attn_k`` within
each head from HF's rotate-half layout to interleaved pairs; both are undone here, so the model
sees exactly what a Hugging Face checkpoint would give it.

``Checkpoint.quantized_weights()`` gives the same tensors with the Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and Q8_0 matrices
kept quantized (``gguf_quant.py``) where the CPU's int4 matmul takes their shape, for the layers'
linear methods (``layers/linear.py``); the others are dequantised as above.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import dequantize

from ..config import ModelConfig, UnsupportedModelError
from ..layers.linear import GroupQuantized, cpu_method_fits
from .checkpoint import Checkpoint, GenerationDefaults
from . import gguf_qwen35
from .gguf_quant import KEPT_QUANTIZED, group_quantized

SUPPORTED_ARCHITECTURES = ("llama", *gguf_qwen35.ARCHITECTURES)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 frequency factors, folded into the config

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCKS_PER_ROW = 256
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _Reader(GGUFReader):
    """``GGUFReader`` parsing through a plain ndarray view of its memmap.

    Slicing an ``np.memmap`` costs a Python-level ``__array_finalize__`` per slice, and the reader
    slices once per vocabulary string; the plain view shares the same mapped pages and opens a
    50k-token file in about half the time.
    """

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """A ``GGUFReader`` for ``path`` (memory-mapped; tensors are read when touched)."""
    return _Reader(os.fspath(path))


def field_value(field: ReaderField) -> Any:
    """A metadata field as a Python value (str, int, float, bool, or a list of them)."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        if len(field.types) > 2:
            raise ValueError(f"GGUF field {field.name!r}: nested arrays are not supported")
        return [v for i in field.data for v in field.parts[i].tolist()]
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama GGUF tensor, or None when it has none."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rotary(w: torch.Tensor | GroupQuantized, n_heads: int) -> torch.Tensor | GroupQuantized:
    """Rows of a q/k projection (weight or bias) from llama.cpp's interleaved-pair order back to HF's.

    Within each head, GGUF row ``2*i + j`` holds HF row ``j * head_dim/2 + i`` (``i`` the rotary
    pair, ``j`` its half).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of even size")
    half = rows // n_heads // 2
    # HF row r takes GGUF row order[r]; index_select is far faster than a strided copy here
    order = torch.arange(rows).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)
    return w.select_rows(order) if isinstance(w, GroupQuantized) else w.index_select(0, order)


def tensor_to_torch(tensor: ReaderTensor) -> torch.Tensor:
    """Dequantise one GGUF tensor to fp32 in HF dim order."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    data = tensor.data
    if qtype == GGMLQuantizationType.F32:
        array = np.array(data, dtype=np.float32)  # copy: the mapping is read-only
    elif qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        bits = torch.from_numpy(np.array(data).view(np.int16))
        half = torch.float16 if qtype == GGMLQuantizationType.F16 else torch.bfloat16
        array = bits.view(half).float().numpy()
    else:
        # Blocks are independent of the matrix shape: regroup the bytes into rows of up to 256
        # blocks, so gguf's per-row-group Python overhead is paid a few times, not once per row.
        try:
            block_bytes = GGML_QUANT_SIZES[qtype][1]
            per_row = math.gcd(data.size // block_bytes, _BLOCKS_PER_ROW)
            array = dequantize(data.reshape(-1, per_row * block_bytes), qtype)
        except (KeyError, NotImplementedError) as e:
            raise UnsupportedModelError(
                f"tensor {tensor.name!r} has GGML type {qtype.name}, which cannot be dequantised"
            ) from e
    return torch.from_numpy(array.reshape(shape))


def kept_quantized(tensor: ReaderTensor) -> GroupQuantized | None:
    """``tensor`` as a ``GroupQuantized`` matrix when its format is kept quantized and the CPU
    int4 matmul takes its shape, else None (it is dequantised); the MoE experts' 3-D tensors as
    their rows whatever their shape (``loader.placed_quantized`` decides where they are held)."""
    if GGMLQuantizationType(tensor.tensor_type) not in KEPT_QUANTIZED or len(tensor.shape) not in (2, 3):
        return None
    weight = group_quantized(tensor)
    return weight if len(tensor.shape) == 3 or cpu_method_fits(weight) else None


def iter_weights(reader: GGUFReader, config: ModelConfig,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
    """``(HF name, fp32 tensor)`` for every model tensor, dequantised one at a time; with
    ``keep_quantized`` the matrices ``kept_quantized`` takes come as ``GroupQuantized``."""
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue  # rope_freqs: already in the config
        weight = kept_quantized(tensor) if keep_quantized else None
        if weight is None:
            weight = tensor_to_torch(tensor)
        if ".self_attn.q_proj." in name:
            weight = unpermute_rotary(weight, config.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            weight = unpermute_rotary(weight, config.num_key_value_heads)
        yield name, weight


def _llama3_rope_scaling(freq_factors: np.ndarray, head_dim: int, base: float) -> dict[str, Any] | None:
    """Llama 3.1 ``rope_scaling`` whose per-frequency divisors reproduce ``rope_freqs``.

    The file stores only the divisors. ``factor`` is solved from the lowest frequency under the
    published Llama 3 band parameters, and every divisor is then checked against the model's
    own formula; anything else is refused rather than run with wrong positions.
    """
    from ..layers.rotary import rope_inv_freq

    factors = np.asarray(freq_factors, dtype=np.float64)
    if np.allclose(factors, 1.0):
        return None
    low, high, old_context = 1.0, 4.0, 8192
    rotary_dim = 2 * len(factors)
    plain = rope_inv_freq(rotary_dim, base, None).double().numpy()
    # lowest frequency: divisor f = factor (fully scaled) or 1 / ((1 - s) / factor + s) (ramp)
    smooth = (old_context * plain[-1] / (2 * math.pi) - low) / (high - low)
    f = float(factors[-1])
    if smooth <= 0:  # in the fully scaled band
        factor = f
    elif smooth < 1 and 1 / f > smooth:  # on the ramp
        factor = (1 - smooth) / (1 / f - smooth)
    else:  # in the unscaled band, yet scaled: not Llama 3's bands
        factor = 0.0
    scaling = {
        "rope_type": "llama3",
        "factor": round(factor, 4),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": old_context,
    }
    ok = rotary_dim <= head_dim and factor > 1
    if ok:
        scaled = rope_inv_freq(rotary_dim, base, scaling).double().numpy()
        ok = np.allclose(plain / scaled, factors, rtol=1e-3)
    if not ok:
        raise UnsupportedModelError("GGUF rope_freqs do not match Llama 3 rope scaling; not supported")
    return scaling


def hf_config_dict(meta: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict[str, Any]:
    """An HF ``config.json``-style dict for a llama or Qwen3.5 GGUF."""
    arch = meta.get("general.architecture", "<missing>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; GGUF loading supports: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    if arch in gguf_qwen35.ARCHITECTURES:
        return gguf_qwen35.hf_config_dict(meta, tensors)

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    vocab = int(tensors["token_embd.weight"].shape[1])
    declared_vocab = key("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or vocab)
    if int(declared_vocab) != vocab:
        raise ValueError(f"GGUF vocab size {declared_vocab} does not match token_embd rows {vocab}")
    base = float(key("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": base,
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    rotary_dim = int(key("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        cfg["partial_rotary_factor"] = rotary_dim / head_dim
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {scaling_type!r} is not supported (linear is)")
    if ROPE_FREQS in tensors:
        llama3 = _llama3_rope_scaling(tensor_to_torch(tensors[ROPE_FREQS]).numpy(), head_dim, base)
        if llama3 is not None:
            cfg["rope_scaling"] = llama3
    for field in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{field}" in meta:
            cfg[field] = int(meta[f"tokenizer.ggml.{field}"])
    return cfg


def _check_tensors(tensors: dict[str, ReaderTensor], n_layers: int) -> None:
    """Fail at load time, not mid-way through the weights, on tensors this loader cannot place."""
    unknown = [n for n in tensors if n != ROPE_FREQS and hf_name(n) is None]
    beyond = [n for n in tensors if (m := _BLOCK_RE.fullmatch(n)) and int(m.group(1)) >= n_layers]
    if unknown or beyond:
        shown = ", ".join((unknown + beyond)[:6])
        raise UnsupportedModelError(f"GGUF has tensors a dense llama model does not use: {shown}")


def generation_defaults(meta: dict[str, Any]) -> GenerationDefaults:
    """Stop ids (eos, plus end-of-turn / end-of-message ids) and any recommended sampling values."""
    eos: list[int] = []
    for name in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(name)
        if value is not None and int(value) not in eos:
            eos.append(int(value))

    keys = {"temperature": "temp", "repetition_penalty": "penalty_repeat"}  # GGUF's names where they differ
    return GenerationDefaults.read(eos, lambda field: meta.get(f"general.sampling.{keys.get(field, field)}"))


def load_gguf(path: str | os.PathLike) -> Checkpoint:
    """A ``Checkpoint`` for a llama or Qwen3.5 GGUF file; tensors are dequantised only when iterated.

    Raises ``UnsupportedModelError`` (a ``ValueError``) for another architecture, tensors the model
    does not use, or a tokenizer kind that cannot be rebuilt; ``ValueError`` for missing tensors.
    """
    path = os.fspath(path)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = ModelConfig.from_hf_dict(hf_config_dict(meta, tensors))
    if meta["general.architecture"] in gguf_qwen35.ARCHITECTURES:
        gguf_qwen35.check_tensors(tensors, config)

        def weights(keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
            def load(tensor: ReaderTensor) -> torch.Tensor | GroupQuantized:
                kept = kept_quantized(tensor) if keep_quantized else None
                return tensor_to_torch(tensor) if kept is None else kept

            return gguf_qwen35.iter_weights(reader.tensors, config, load, tensor_to_torch)
    else:
        _check_tensors(tensors, config.num_hidden_layers)

        def weights(keep_quantized: bool) -> Iterator[tuple[str, torch.Tensor | GroupQuantized]]:
            return iter_weights(reader, config, keep_quantized)

    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        from .gguf_tokenizer import build_tokenizer

        tokenizer = build_tokenizer(meta)
    template = meta.get("tokenizer.chat_template")
    # llama.cpp's pooling_type: 1 mean, 3 last (0 none and 2 cls pool nothing a decoder keeps: mean)
    pooling = "last" if meta.get(f"{meta.get('general.architecture')}.pooling_type") == 3 else "mean"
    return Checkpoint(
        config=config,
        weights=lambda: weights(False),
        quantized_weights=lambda: weights(True),
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        generation=generation_defaults(meta),
        source=path,
        pooling=pooling,
    )
