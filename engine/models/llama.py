"""Llama-style dense decoder (Llama 2/3, SmolLM2) and Qwen3 dense, which adds per-head q/k norms.

Parameter names follow the Hugging Face checkpoints: ``model.embed_tokens``, ``model.layers.N.
{input_layernorm, self_attn.{q,k,v,o}_proj, [self_attn.{q,k}_norm], post_attention_layernorm,
mlp.{gate,up,down}_proj}``, ``model.norm``, ``lm_head`` (absent when tied to the embedding).
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.attention import Attention
from ..layers.embedding import Embedding, LMHead
from ..layers.mlp import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from .base import CausalLM, PreNormLayer, PreNormStack
from .weights import load_parameters


class DecoderLayer(PreNormLayer):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, qk_norm: str | None
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(
            layer_idx,
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            rotary,
            qk_norm=qk_norm,
            bias=config.attention_bias,
            eps=eps,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)

    def mixer(self) -> nn.Module:
        return self.self_attn


class DecoderStack(PreNormStack):
    """The ``model.`` part of the checkpoint: embedding, layers, final norm."""

    def __init__(self, config: ModelConfig, qk_norm: str | None) -> None:
        super().__init__()
        rotary = RotaryEmbedding.from_config(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rotary, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    qk_norm: str | None = None  # Qwen3 sets "plain"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if any(t != "full_attention" for t in config.layer_types):
            raise ValueError(
                f"{type(self).__name__} has only full-attention layers, got {config.layer_types}"
            )
        self.config = config
        self.model = DecoderStack(config, self.qk_norm)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tied_to=tied)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # a tied checkpoint may still carry a copy of the embedding as lm_head.weight
        tied = self.config.tie_word_embeddings
        load_parameters(self, weights, skip=lambda name: tied and name == "lm_head.weight")


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama with a plain RMSNorm over each head's q and k before RoPE."""

    qk_norm = "plain"
