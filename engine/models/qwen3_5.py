"""Qwen3.5 / Qwen3.6 hybrid decoders, dense (``qwen3_5``) and mixture-of-experts (``qwen3_5_moe``).

``config.layer_types`` mixes Gated DeltaNet layers (``linear_attn``) with gated full-attention
layers (``self_attn``: ``q_proj`` emits [q | gate] per head, zero-centred q/k norms, partial neox
RoPE). Every RMSNorm of the decoder is zero-centred (``1 + w``); the GDN output norm is the plain
gated one inside that layer. The MLP is dense or a sparse MoE per ``config.is_moe_layer``.

Positions: the checkpoints' interleaved M-RoPE gives all three sections (t, h, w) the same
position for text tokens, which is exactly plain RoPE on the rotated dims; a step that holds image
tokens (``--vision``, ``vision/``) passes each token's three positions (``ForwardBatch.mrope``) and
the rotation takes each frequency's position from its section (``layers/rotary.py``).

Names follow the checkpoints after the loader's prefix normalisation (``model.language_model.X``
-> ``model.X``); per-expert tensors are fused on load. Qwen3-Next reuses this decoder with its
fused GDN projections (``qwen3_next.py``).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.embedding import Embedding, LMHead
from ..layers.gated_delta_net import GatedDeltaNet
from ..layers.mlp import GatedMLP
from ..layers.moe import SparseMoeBlock, fuse_expert_weights
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .base import CausalLM, PreNormLayer, PreNormStack
from .mtp import MTPHead
from .weights import load_parameters

LAYER_TYPES = ("linear_attention", "full_attention")


class HybridDecoderLayer(PreNormLayer):
    """Pre-norm block: ``h += mixer(norm(h)); h += mlp(norm(h))``, mixer = GDN or attention.
    Each residual add is fused with the norm that follows it; in MoE layers the post-attention
    one also with the router and the routing (``SparseMoeBlock.forward_residual``)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        gdn_class: type[GatedDeltaNet],
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.is_linear = config.layer_types[layer_idx] == "linear_attention"
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        if self.is_linear:
            self.linear_attn = gdn_class(
                layer_idx,
                hidden,
                config.linear_num_key_heads,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                config.linear_conv_kernel_dim,
                eps,
            )
        else:
            self.self_attn = Attention(
                layer_idx,
                hidden,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                rotary,
                qk_norm="zero_centered",
                gated=True,
                bias=config.attention_bias,
                eps=eps,
            )
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(
                hidden,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                config.shared_expert_intermediate_size,
                norm_topk_prob,
            )
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, bias=config.mlp_bias)

    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn


class HybridDecoderStack(PreNormStack):
    """The ``model.`` part of the checkpoint: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig, gdn_class: type[GatedDeltaNet], norm_topk_prob: bool) -> None:
        super().__init__()
        rotary = RotaryEmbedding.from_config(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, rotary, gdn_class, norm_topk_prob)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, zero_centered=True)


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 dense or MoE text model (the MoE layers come from the config)."""

    gdn_class: type[GatedDeltaNet] = GatedDeltaNet

    def norm_topk_prob(self, config: ModelConfig) -> bool:
        """Qwen3.5-MoE always renormalises the top-k router weights, whatever the config says."""
        return True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"{type(self).__name__}: unsupported layer types {unknown}")
        if config.is_hybrid and (config.linear_num_key_heads <= 0 or config.linear_num_value_heads <= 0):
            raise ValueError(f"{type(self).__name__}: linear_num_key_heads / linear_num_value_heads not set")
        self.config = config
        self.model = HybridDecoderStack(config, self.gdn_class, self.norm_topk_prob(config))
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tied_to=tied)
        # the MTP head (``mtp.*``), built when the config counts its layers (``load_model`` keeps
        # them only for ``--spec mtp``)
        self.mtp = MTPHead(config, HybridDecoderLayer, self.gdn_class, self.norm_topk_prob(config)) \
            if config.mtp_layers else None

    def mtp_forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch, layer: int = 0) -> torch.Tensor:
        """The MTP head's hidden states ``[N, H]`` for the tokens ``input_ids`` that follow
        positions whose final hidden states are ``hidden`` (``models/mtp.py``)."""
        return self.mtp(self.model.embed_tokens(input_ids), hidden, batch, layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.config.is_moe:
            weights = fuse_expert_weights(weights, self.config.num_experts)
        # a tied checkpoint may still carry a copy of the embedding as lm_head.weight
        tied = self.config.tie_word_embeddings
        load_parameters(self, weights, skip=lambda name: tied and name == "lm_head.weight")


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE (``qwen3_5_moe``): the same decoder; every layer's MLP is a sparse MoE block."""

    def __init__(self, config: ModelConfig) -> None:
        if not config.is_moe:
            raise ValueError("qwen3_5_moe config has no num_experts")
        super().__init__(config)
