"""Tiny random Qwen3.5 (dense / MoE) models written as llama.cpp's converter would write them:
``qwen35`` / ``qwen35moe`` GGUF files, for the GGUF loader tests.

``to_gguf_tensors`` applies the converter's transforms to the HF state dict (written from its
description, independently of the loader that undoes them): norms ``+1`` (not the GDN's),
``A_log -> -exp(A_log)``, ``dt_bias -> ssm_dt.bias``, the conv weight squeezed (older converters
squeezed every tensor: the loader takes the shared expert's gate either way), value heads from
grouped to tiled order, MoE experts split into ``ffn_gate_exps`` / ``ffn_up_exps``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from support.gguf_files import write_gguf
from support.k_quants import K_QUANTS, encode
from support.tiny import train_tokenizer

LIN, FULL = "linear_attention", "full_attention"
TEXT = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
    max_position_embeddings=512, eos_token_id=2, full_attention_interval=2,
    layer_types=[LIN, FULL, LIN, FULL],  # what full_attention_interval 2 gives, as llama.cpp reads it
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
# the matrices the quantized variants quantize (llama.cpp keeps norms, conv, ssm_a / dt, routers in F32)
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_out", "ssm_beta",
               "ssm_alpha", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
               "output", "token_embd")


EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")  # the MoE experts' 3-D tensors


def tiny_model(moe: bool = False, seed: int = 0, vocab: int = 400, **text: Any):
    """``text``: config entries over ``TEXT`` (and the dense model's ``intermediate_size`` 96)."""
    torch.manual_seed(seed)
    if moe:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(vocab_size=vocab,
                                                                                       **{**TEXT, **MOE, **text}))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
            vocab_size=vocab, **{**TEXT, "intermediate_size": 96, **text}))
    with torch.no_grad():  # the zero-centred norms start at 0 and A_log / dt_bias at set values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _tile(t: torch.Tensor, dim: int, num_k: int, num_v: int, head_dim: int) -> torch.Tensor:
    """Value heads from HF's grouped order ``[k][r]`` to llama.cpp's tiled ``[r][k]`` along ``dim``."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k, num_v // num_k, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def to_gguf_tensors(model, fuse_experts: bool = False) -> dict[str, torch.Tensor]:
    cfg = model.config
    arch = gguf.MODEL_ARCH.QWEN35MOE if getattr(cfg, "num_experts", 0) else gguf.MODEL_ARCH.QWEN35
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    kd, vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied model has no output tensor
        t = t.detach().float().clone()
        if ".linear_attn." in name and nk != nv:
            if "in_proj_qkv" in name:
                t = torch.cat([t[:2 * nk * kd], _tile(t[2 * nk * kd:], 0, nk, nv, vd)])
            elif "in_proj_z" in name:
                t = _tile(t, 0, nk, nv, vd)
            elif "in_proj_b" in name or "in_proj_a" in name or name.endswith(("A_log", "dt_bias")):
                t = _tile(t, 0, nk, nv, 1)
            elif "conv1d" in name:
                t = torch.cat([t[:2 * nk * kd], _tile(t[2 * nk * kd:], 0, nk, nv, vd)])
            elif "out_proj" in name:
                t = _tile(t, 1, nk, nv, vd)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        parts = [(name, t)]
        if name.endswith("mlp.experts.gate_up_proj") and fuse_experts:  # --fuse-gate-up-exps
            parts = [(name + ".weight", t)]
        elif name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            base = name.removesuffix(".gate_up_proj")
            parts = [(base + ".gate_proj.weight", t[:, :half]), (base + ".up_proj.weight", t[:, half:])]
        elif name.endswith("mlp.experts.down_proj"):
            parts = [(name + ".weight", t)]
        for hf, w in parts:
            gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            assert gname is not None, hf
            out[gname] = (w.squeeze() if "conv1d" in hf else w).contiguous()
    return out


def metadata(model, tokenizer=None) -> dict[str, Any]:
    cfg = model.config
    moe = bool(getattr(cfg, "num_experts", 0))
    a = "qwen35moe" if moe else "qwen35"
    rope = cfg.rope_parameters
    meta: dict[str, Any] = {
        f"{a}.block_count": cfg.num_hidden_layers, f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size, f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads, f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim, f"{a}.rope.freq_base": float(rope["rope_theta"]),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.rope.dimension_count": int(cfg.head_dim * rope.get("partial_rotary_factor", 0.25)),
        f"{a}.rope.dimension_sections": [11, 11, 10, 0],
        f"{a}.ssm.conv_kernel": cfg.linear_conv_kernel_dim, f"{a}.ssm.state_size": cfg.linear_key_head_dim,
        f"{a}.ssm.group_count": cfg.linear_num_key_heads, f"{a}.ssm.time_step_rank": cfg.linear_num_value_heads,
        f"{a}.ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
        f"{a}.full_attention_interval": 2,
    }
    if moe:
        meta.update({f"{a}.expert_count": cfg.num_experts, f"{a}.expert_used_count": cfg.num_experts_per_tok,
                     f"{a}.expert_feed_forward_length": cfg.moe_intermediate_size,
                     f"{a}.expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size})
    else:
        meta[f"{a}.feed_forward_length"] = cfg.intermediate_size
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        types = [3 if t in special else 1 for t in tokens]
        # the converter pads the vocabulary to the embedding's rows with unused [PADn] tokens
        pad = range(len(tokens), cfg.vocab_size)
        tokens, types = tokens + [f"[PAD{i}]" for i in pad], types + [5] * len(pad)
        merges = [" ".join(m) for m in _merges(tokenizer)]
        meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
                     "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
                     "tokenizer.ggml.token_type": types,
                     "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": False})
    return meta


def _merges(tokenizer) -> list[tuple[str, str]]:
    import json

    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def write_qwen35_gguf(path: Path, model, qtype: Q | None = None, tokenizer=None,
                      drop: tuple[str, ...] = (), extra: dict[str, Any] | None = None,
                      extra_tensors: dict[str, np.ndarray] | None = None, fuse_experts: bool = False,
                      mix: Callable[[str, int | None, int], Q | None] | None = None,
                      experts_qtype: Q | None = None) -> Path:
    """The GGUF file of ``model``: F32 tensors, or F16 / ``qtype`` projections where their rows
    split into whole blocks; ``drop``: tensors left out; ``extra``: metadata over the derived
    (None: left out); ``extra_tensors``: more F32 tensors, written last. ``mix``: each projection's
    type from its kind (``attn_v``), layer (None: a global tensor) and columns instead of
    ``qtype`` (None: F32; K-quants encoded by ``support.k_quants``). ``experts_qtype``: the MoE
    experts' 3-D tensors in that type (F32 otherwise, as ``qtype`` leaves them)."""
    cfg = model.config
    arch = "qwen35moe" if getattr(cfg, "num_experts", 0) else "qwen35"
    meta = {**metadata(model, tokenizer), **(extra or {})}
    tensors = []
    for name, t in to_gguf_tensors(model, fuse_experts).items():
        if name in drop:
            continue
        array = t.numpy()
        kind = name.rpartition(".")[0].rpartition(".")[2] if name.startswith("blk.") else name.rpartition(".")[0]
        if experts_qtype is not None and kind in EXPERTS:
            flat = array.reshape(-1, array.shape[-1])
            blocks = encode(flat, experts_qtype) if experts_qtype in K_QUANTS else quantize(flat, experts_qtype)
            tensors.append((name, blocks.reshape(*array.shape[:-1], -1), experts_qtype))
        elif mix is not None and kind in PROJECTIONS and array.ndim == 2:
            layer = int(name.split(".")[1]) if name.startswith("blk.") else None
            chosen = mix(kind, layer, array.shape[1])
            if chosen in K_QUANTS:
                tensors.append((name, encode(array, chosen), chosen))
            elif chosen is not None:
                tensors.append((name, quantize(array, chosen), chosen))
            else:
                tensors.append((name, array, None))
        elif qtype is not None and kind in PROJECTIONS and array.ndim == 2 and array.shape[1] % 32 == 0:
            if qtype == Q.F16:
                tensors.append((name, array.astype(np.float16), None))
            else:
                tensors.append((name, quantize(array, qtype), qtype))
        else:
            tensors.append((name, array, None))
    tensors += [(name, array.astype(np.float32), None) for name, array in (extra_tensors or {}).items()]
    return write_gguf(path, tensors, {k: v for k, v in meta.items() if v is not None}, arch)
