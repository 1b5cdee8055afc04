"""Model configuration, normalised from a Hugging Face ``config.json`` (or GGUF metadata).

One dataclass describes every supported family; family-specific fields keep neutral defaults
when a family does not use them. Unknown ``model_type`` values fail here, at startup.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type -> family implemented in engine/models
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    family: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # hybrid (Gated DeltaNet) layers
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "linear_attention"
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # multimodal (``Qwen3_5ForConditionalGeneration``): the interleaved M-RoPE sections (t, h, w),
    # the vision tower's config (``vision_config``) and the placeholder token ids
    mrope_section: list[int] | None = None
    vision: dict[str, Any] | None = field(default=None, repr=False)
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # multi-token prediction layers after the stack (Qwen3.5 ``mtp_num_hidden_layers``, Qwen3-Next
    # ``num_nextn_predict_layers``): ``mtp.*`` weights, run by ``--spec mtp`` (``models/mtp.py``)
    mtp_layers: int = 0
    # special tokens known from the config
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )

    @property
    def is_hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def with_mtp(self) -> "ModelConfig":
        """This config with the MTP layers counted as full-attention layers after the stack
        (indices ``num_hidden_layers ..``): what the KV pool holds when they run."""
        from dataclasses import replace

        return replace(self, num_hidden_layers=self.num_hidden_layers + self.mtp_layers,
                       layer_types=self.layer_types + ["full_attention"] * self.mtp_layers, mtp_layers=0)

    def is_moe_layer(self, i: int) -> bool:
        if not self.is_moe or i in self.mlp_only_layers:
            return False
        return (i + 1) % max(self.decoder_sparse_step, 1) == 0

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "<missing>")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; supported: "
                + ", ".join(sorted({"llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next"}))
            )
        family = SUPPORTED_MODEL_TYPES[model_type]
        top = cfg
        text = dict(cfg.get("text_config") or cfg)  # multimodal saves nest the LM config
        for key in ("bos_token_id", "eos_token_id"):
            if key not in text and key in top:
                text[key] = top[key]
        if "text_config" in top and "tie_word_embeddings" in top:
            # a multimodal save ties (or not) by its top-level flag, whatever text_config says
            text["tie_word_embeddings"] = top["tie_word_embeddings"]

        def get(key: str, default: Any = None) -> Any:
            value = text.get(key)
            return default if value is None else value

        n_layers = int(text["num_hidden_layers"])
        n_heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        layer_types = list(get("layer_types", []))
        if not layer_types and family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
            interval = int(get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
        rope_params = get("rope_parameters") or get("rope_scaling") or {}
        rope_theta = float(get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        partial = float(get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)))
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        eos = get("eos_token_id", [])
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        return cls(
            family=family,
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(get("num_key_value_heads", n_heads)),
            head_dim=int(get("head_dim", hidden // n_heads)),
            intermediate_size=int(get("intermediate_size", 0)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=dict(rope_params) if rope_type not in ("default", None) else None,
            partial_rotary_factor=partial,
            max_position_embeddings=int(get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            layer_types=layer_types,
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(get("linear_value_head_dim", 128)),
            linear_num_key_heads=int(get("linear_num_key_heads", 0)),
            linear_num_value_heads=int(get("linear_num_value_heads", 0)),
            num_experts=int(get("num_experts", 0)),
            num_experts_per_tok=int(get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            decoder_sparse_step=int(get("decoder_sparse_step", 1)),
            mlp_only_layers=list(get("mlp_only_layers", [])),
            mrope_section=list(rope_params["mrope_section"]) if rope_params.get("mrope_section") else
            ([11, 11, 10] if family in ("qwen3_5", "qwen3_5_moe") else None),
            vision=dict(top["vision_config"]) if isinstance(top.get("vision_config"), dict) else None,
            image_token_id=top.get("image_token_id"),
            vision_start_token_id=top.get("vision_start_token_id"),
            vision_end_token_id=top.get("vision_end_token_id"),
            mtp_layers=int(get("mtp_num_hidden_layers", get("num_nextn_predict_layers", 0))),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
        )
