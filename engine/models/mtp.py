"""The multi-token prediction (MTP) head of Qwen3.5 / Qwen3.6 and Qwen3-Next checkpoints
(``mtp.*``), run by ``--spec mtp`` (``engine/spec.py``) to draft tokens.

At position ``i`` the head takes the main model's final hidden state there ``h_i`` (after the
stack's final norm) and the embedding of the token that follows, ``x_{i+1}``; each is RMS-normed
on its own (``pre_fc_norm_hidden``, ``pre_fc_norm_embedding``, zero-centred like every norm of the
decoder), the two are joined ``[embedding | hidden]`` and projected back to the hidden size
(``fc``, 2H -> H), then one full decoder layer (gated attention at position ``i``, with its own
K/V in the pool as an extra attention layer after the stack, and the dense or MoE MLP of the main
model's kind) and a final norm (``norm``) give a hidden state whose logits, through the main
model's LM head, predict ``x_{i+2}``. The embedding and the LM head are the main model's. For a
draft of k tokens the head runs once over the positions the main model has just computed, then
k - 1 more times, one position each, on its own output and its last drafted token.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding


class MTPHead(nn.Module):
    """``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.N``
    (``HybridDecoderLayer`` of full attention, layer index ``num_hidden_layers + N``) and
    ``mtp.norm``."""

    def __init__(self, config: ModelConfig, layer_class, gdn_class, norm_topk_prob: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.first_layer = config.num_hidden_layers
        full = config.with_mtp()  # the MTP layers as full-attention layers after the stack
        rotary = RotaryEmbedding.from_config(config)
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, zero_centered=True)
        self.layers = nn.ModuleList(layer_class(full, self.first_layer + j, rotary, gdn_class, norm_topk_prob)
                                    for j in range(config.mtp_layers))
        self.norm = RMSNorm(hidden, eps, zero_centered=True)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, batch, layer: int = 0) -> torch.Tensor:
        """``embedded`` ``[N, H]``: the embeddings of the tokens that follow each position;
        ``hidden`` ``[N, H]``: the final hidden states there (the main model's, or this head's own
        for a further draft) -> this head's hidden states ``[N, H]`` (after ``norm``)."""
        joined = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1)
        out, residual = self.layers[layer % len(self.layers)](self.fc(joined), None, batch)
        return self.norm(out, residual)[0]
