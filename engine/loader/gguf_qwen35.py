"""Qwen3.5 / Qwen3.6 GGUF files (llama.cpp architectures ``qwen35`` and ``qwen35moe``) read back
into the Hugging Face names and layout ``models/qwen3_5.py`` loads.

llama.cpp's ``convert_hf_to_gguf.py`` (its Qwen3-Next converter, which Qwen3.5's extends) changes
these tensors on the way in; each is undone here:

- every decoder RMSNorm weight (``attn_norm``, ``post_attention_norm``, ``attn_q_norm`` /
  ``attn_k_norm``, ``output_norm``) is stored with the zero-centred norm's ``+1`` folded in; the GDN
  output norm (``ssm_norm``) is not;
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``;
- the depthwise conv weight ``[C, 1, K]`` is squeezed to ``[C, K]`` (older converters squeezed
  every tensor, so the shared expert's gate ``[1, H]`` may come as ``[H]``);
- with ``--fuse-gate-up-exps`` the experts' gate and up come as one ``ffn_gate_up_exps``
  ``[E, 2I, H]``, gate rows first, which is already the model's ``experts.gate_up_proj``;
- where the GDN has fewer key heads than value heads, the value heads are reordered from grouped
  by key head (HF: ``[k0v0, k0v1, k1v0, k1v1]``) to tiled (``[k0v0, k1v0, k0v1, k1v1]``): the V
  rows of ``in_proj_qkv`` and of the conv weight, the rows of ``in_proj_z`` / ``in_proj_b`` /
  ``in_proj_a``, ``A_log``, ``dt_bias`` and the input columns of ``out_proj``;
- the MoE experts are stacked per layer (``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]``,
  ``ffn_down_exps`` ``[E, H, I]``), joined here into the model's ``experts.gate_up_proj``;
- the MTP block, when kept, is appended as blocks ``n_layers ..`` (``nextn_predict_layers``):
  skipped, as the HF loader skips ``mtp.*``.

The gated attention's ``q_proj`` ([q | gate] per head) and the q / k rows are stored as HF has
them (no rotary reordering for this architecture). The layer pattern comes from
``full_attention_interval`` (llama.cpp's: every interval-th layer is full attention).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import torch
from gguf.gguf_reader import ReaderTensor

from ..config import ModelConfig, UnsupportedModelError
from ..layers.linear import GroupQuantized

ARCHITECTURES = ("qwen35", "qwen35moe")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# names whose HF form is not "<module>.<weight|bias>"
_SPECIAL = {
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
_EXPERT_HALVES = ("ffn_gate_exps.weight", "ffn_up_exps.weight")  # joined into experts.gate_up_proj
_SHIFTED_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


def block_hf_name(rest: str) -> str | None:
    """The HF name (after ``model.layers.N.``) of a block tensor ``blk.N.<rest>``, or None."""
    if rest in _SPECIAL:
        return _SPECIAL[rest]
    base, _, kind = rest.rpartition(".")
    if kind in ("weight", "bias") and base in _BLOCK_NAMES:
        return f"{_BLOCK_NAMES[base]}.{kind}"
    return None


def hf_config_dict(meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """An HF ``config.json``-style dict for a ``qwen35`` / ``qwen35moe`` GGUF; ``tensors`` maps
    names to ``ReaderTensor`` or to their GGUF-order dims, and a metadata array may be given as
    its length (``app/model_info.py`` reads the header alone)."""
    arch = meta["general.architecture"]
    missing_keys: list[str] = []

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        value = meta.get(f"{arch}.{name}")
        if value is None and required:
            missing_keys.append(f"{arch}.{name}")
        return default if value is None else value

    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    blocks = key("block_count", required=True)
    for name in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size"):
        key(name, required=True)
    moe = arch == "qwen35moe"
    if moe:
        for name in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
            key(name, required=True)
    else:
        key("feed_forward_length", required=True)
    if missing_keys:
        raise ValueError(f"GGUF {arch} file lacks metadata: {', '.join(missing_keys)}")
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    for name in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        if isinstance(meta.get(f"{arch}.{name}"), list):
            raise UnsupportedModelError(f"GGUF {arch}.{name} varies per layer; not supported")

    hidden, heads = int(hidden), int(heads)
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError("GGUF attention.value_length differs from key_length; not supported")
    n_layers = int(blocks) - int(key("nextn_predict_layers", 0))
    v_heads = int(key("ssm.time_step_rank"))
    inner = int(key("ssm.inner_size"))
    if inner % v_heads:
        raise ValueError(f"GGUF ssm.inner_size {inner} does not split into {v_heads} value heads")
    embd = tensors["token_embd.weight"]
    vocab = int((embd.shape if isinstance(embd, ReaderTensor) else embd)[1])
    tokens = meta.get("tokenizer.ggml.tokens", [])
    declared = key("vocab_size", (tokens if isinstance(tokens, int) else len(tokens)) or vocab)
    if int(declared) != vocab:
        raise ValueError(f"GGUF vocab size {declared} does not match token_embd rows {vocab}")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported for {arch}")
    interval = int(key("full_attention_interval", 4))
    cfg: dict[str, Any] = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length", 0)),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000000.0)),
        "partial_rotary_factor": int(key("rope.dimension_count", head_dim // 4)) / head_dim,
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in tensors),
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(n_layers)],
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": inner // v_heads,
    }
    if moe:
        cfg.update(
            num_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
        )
    for field in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{field}" in meta:
            cfg[field] = int(meta[f"tokenizer.ggml.{field}"])
    return cfg


def _expected(config: ModelConfig, i: int) -> list[str]:
    """The GGUF tensors block ``i`` must have."""
    names = ["attn_norm.weight", "post_attention_norm.weight"]
    if config.layer_types[i] == "linear_attention":
        names += ["attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight",
                  "ssm_out.weight", "ssm_conv1d.weight", "ssm_norm.weight", "ssm_a", "ssm_dt.bias"]
    else:
        names += ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                  "attn_q_norm.weight", "attn_k_norm.weight"]
    if config.is_moe_layer(i):
        names += ["ffn_gate_inp.weight", "ffn_down_exps.weight"]
        if config.shared_expert_intermediate_size:
            names += ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
                      "ffn_gate_inp_shexp.weight"]
    else:
        names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    return [f"blk.{i}.{n}" for n in names]


def check_tensors(tensors: dict[str, ReaderTensor], config: ModelConfig) -> None:
    """Missing tensors and tensors this model cannot place fail at load, each named."""
    missing = [n for i in range(config.num_hidden_layers) for n in _expected(config, i) if n not in tensors]
    for n in ("token_embd.weight", "output_norm.weight"):
        if n not in tensors:
            missing.append(n)
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i) and f"blk.{i}.ffn_gate_up_exps.weight" not in tensors:
            missing += [f"blk.{i}.{n}" for n in _EXPERT_HALVES if f"blk.{i}.{n}" not in tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"GGUF {config.model_type} file is missing tensors: {shown}")
    unknown = []
    for name in tensors:
        m = _BLOCK_RE.fullmatch(name)
        if m is None:
            if name not in _GLOBAL_NAMES:
                unknown.append(name)
        elif int(m.group(1)) < config.num_hidden_layers and block_hf_name(m.group(2)) is None \
                and m.group(2) not in _EXPERT_HALVES:
            unknown.append(name)
    if unknown:
        raise UnsupportedModelError(f"GGUF has tensors a {config.model_type} model does not use: "
                                    + ", ".join(unknown[:6]))


def untile_order(n: int, num_k: int, num_v: int, head_dim: int) -> torch.Tensor:
    """Index ``order`` with ``tiled[order] == grouped`` for ``n = num_v * head_dim`` entries:
    HF's value head ``k * r + j`` (``r = num_v / num_k``) is llama.cpp's ``j * num_k + k``."""
    r = num_v // num_k
    assert n == num_v * head_dim
    return torch.arange(n).reshape(r, num_k, head_dim).transpose(0, 1).reshape(-1)


def _select_cols(w: torch.Tensor | GroupQuantized, order: torch.Tensor,
                 head_dim: int) -> torch.Tensor | GroupQuantized:
    if not isinstance(w, GroupQuantized):
        return w.index_select(1, order)
    if head_dim % w.group:  # the permutation cuts through groups: dense
        return w.dequantize().index_select(1, order)
    groups = order.reshape(-1, w.group)[:, 0] // w.group
    return GroupQuantized(w.q.index_select(1, order), w.scale.index_select(1, groups),
                          None if w.offset is None else w.offset.index_select(1, groups), w.group, w.bits, w.kind)


def _select_rows(w: torch.Tensor | GroupQuantized, order: torch.Tensor) -> torch.Tensor | GroupQuantized:
    return w.select_rows(order) if isinstance(w, GroupQuantized) else w.index_select(0, order)


def iter_weights(tensors: list[ReaderTensor], config: ModelConfig,
                 load: Callable[[ReaderTensor], torch.Tensor | GroupQuantized],
                 dense: Callable[[ReaderTensor], torch.Tensor]) -> Iterator[tuple[str, Any]]:
    """``(HF name, tensor)`` for every model tensor, in file order (an expert pair once both
    halves have come); ``load`` reads a matrix (kept quantized or not), ``dense`` any tensor."""
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    reorder = num_k != num_v
    v_rows = untile_order(num_v * v_dim, num_k, num_v, v_dim) if reorder else None
    head_rows = untile_order(num_v, num_k, num_v, 1) if reorder else None
    halves: dict[int, dict[str, torch.Tensor]] = {}
    for tensor in tensors:
        name = tensor.name
        if name in _GLOBAL_NAMES:
            weight = load(tensor) if name != "output_norm.weight" else dense(tensor) - 1
            yield _GLOBAL_NAMES[name], weight
            continue
        m = _BLOCK_RE.fullmatch(name)
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= config.num_hidden_layers:
            continue  # the MTP block
        prefix = f"model.layers.{layer}."
        if rest in _EXPERT_HALVES:
            pair = halves.setdefault(layer, {})
            pair[rest] = load(tensor)
            if len(pair) == 2:
                del halves[layer]
                yield prefix + "mlp.experts.gate_up_proj", join_expert_halves(
                    *(pair[h] for h in _EXPERT_HALVES), config.num_experts)
            continue
        hf = block_hf_name(rest)
        base = rest.rpartition(".")[0] if "." in rest else rest
        if base in _SHIFTED_NORMS:
            w = dense(tensor) - 1
        elif base == "ssm_a":
            w = torch.log(-dense(tensor))
        elif base in ("ssm_dt", "ssm_norm"):
            w = dense(tensor)
        elif base in ("ffn_down_exps", "ffn_gate_up_exps"):
            w = load(tensor)  # kept quantized: the experts' E * N rows
        elif base == "ssm_conv1d":
            w = dense(tensor)
            if reorder:
                qk = 2 * num_k * k_dim
                w = torch.cat([w[:qk], w[qk:].index_select(0, v_rows)])
            w = w.unsqueeze(1)
        elif base == "ffn_gate_inp_shexp":
            w = dense(tensor).reshape(1, -1)
        elif base == "ssm_out":
            w = load(tensor)
            if reorder:
                w = _select_cols(w, v_rows, v_dim)
        else:
            w = load(tensor) if tensor.shape.size == 2 else dense(tensor)
        if reorder and base in ("ssm_a", "ssm_dt", "ssm_beta", "ssm_alpha"):
            w = _select_rows(w, head_rows)
        elif reorder and base == "attn_gate":
            w = _select_rows(w, v_rows)
        elif reorder and base == "attn_qkv":
            qk = 2 * num_k * k_dim
            w = _select_rows(w, torch.cat([torch.arange(qk), qk + v_rows]))
        yield prefix + hf, w
    if halves:
        raise ValueError("GGUF MoE layers with only one of ffn_gate_exps / ffn_up_exps: "
                         + ", ".join(str(i) for i in sorted(halves)))


def join_expert_halves(gate: torch.Tensor | GroupQuantized, up: torch.Tensor | GroupQuantized,
                       experts: int) -> torch.Tensor | GroupQuantized:
    """``ffn_gate_exps`` and ``ffn_up_exps`` (``[E, I, H]``, or kept quantized as their ``E * I``
    rows) as the model's ``experts.gate_up_proj``: each expert's gate rows, then its up rows.
    Halves held alike join quantized (rows ``[E * 2I, H]``); otherwise both come dense."""
    if isinstance(gate, GroupQuantized) and isinstance(up, GroupQuantized) and \
            (gate.bits, gate.group, gate.offset is None) == (up.bits, up.group, up.offset is None):
        def per_expert(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([a.view(experts, -1, a.shape[-1]), b.view(experts, -1, b.shape[-1])],
                             dim=1).view(-1, a.shape[-1])

        kind = gate.kind if gate.kind == up.kind else f"{gate.kind}+{up.kind}"
        return GroupQuantized(per_expert(gate.q, up.q), per_expert(gate.scale, up.scale),
                              None if gate.offset is None else per_expert(gate.offset, up.offset),
                              gate.group, gate.bits, kind)
    halves = [w.dequantize() if isinstance(w, GroupQuantized) else w for w in (gate, up)]
    return torch.cat([w.reshape(experts, -1, w.shape[-1]) for w in halves], dim=1)
