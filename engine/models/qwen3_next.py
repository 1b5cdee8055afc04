"""Qwen3-Next (``qwen3_next``): the Qwen3.5 hybrid decoder with fused GDN projections.

Checked against transformers' ``qwen3_next``: the decoder norms (input, post-attention, final,
q/k) are zero-centred like Qwen3.5, the GDN output norm is the plain gated one, attention is the
same gated attention with plain partial RoPE. What differs is the GDN input projections, fused as
``in_proj_qkvz`` / ``in_proj_ba`` per key head, and the MLP placement: sparse MoE on layers where
``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``, dense otherwise
(``ModelConfig.is_moe_layer``), and ``norm_topk_prob`` is read from the config.
"""
from __future__ import annotations

from ..config import ModelConfig
from ..layers.gated_delta_net import Qwen3NextGatedDeltaNet
from .qwen3_5 import Qwen3_5ForCausalLM


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    gdn_class = Qwen3NextGatedDeltaNet

    def norm_topk_prob(self, config: ModelConfig) -> bool:
        return config.norm_topk_prob  # Qwen3-Next honours the config flag


__all__ = ["Qwen3NextForCausalLM"]
