"""Token embedding and the output head (its own weight, or tied to the embedding).

Either may hold its weight quantized (``take_quantized``, ``linear.py``): the embedding then
dequantizes only the rows it looks up, and the head multiplies through a linear method.
"""
from __future__ import annotations

import torch
from torch import nn

from .fused_linear import decode_linear
from .linear import GroupQuantized, LinearMethod, check_shape, quantized_method


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be held quantized: a lookup dequantizes its rows, exactly
    as the format defines them, into the model's dtype. A head tied to it (``LMHead``) asks for
    the same weights as a linear method (``head_method``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.table: GroupQuantized | None = None
        self.head_method: LinearMethod | None = None  # set for a tied head when the table is quantized
        self.ties_head = False  # a tied LMHead reads this table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            return super().forward(ids)
        flat = ids.reshape(-1)
        return self.table.dequantize(rows=flat).to(self._dtype).view(*ids.shape, self.embedding_dim)

    def take_quantized(self, name: str, w: GroupQuantized) -> None:
        check_shape(name, w, self.weight.shape)
        if self.ties_head:
            self.head_method = quantized_method(w, self.weight.device)
        self.table = w
        self._dtype = self.weight.dtype
        del self.weight
        self.register_parameter("weight", None)


class LMHead(nn.Module):
    """Logits for hidden states: ``hidden @ weight.T`` in the weights' dtype, returned as fp32.

    With ``tied_to`` the head owns no parameter and reads the embedding's weight, so a tied model
    has one ``[vocab, hidden]`` tensor (under ``model.embed_tokens.weight``). A quantized weight
    (its own, or the embedding's) runs through its linear method.
    """

    def __init__(self, hidden_size: int, vocab_size: int, tied_to: nn.Embedding | None = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        self.method: LinearMethod | None = None
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        else:
            if tuple(tied_to.weight.shape) != (vocab_size, hidden_size):
                raise ValueError(f"tied embedding has shape {tuple(tied_to.weight.shape)}")
            self._embedding = [tied_to]  # in a list: not registered as a submodule a second time
            tied_to.ties_head = True

    @property
    def lm_weight(self) -> torch.Tensor:
        return self._embedding[0].weight if self.tied else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        method = getattr(self._embedding[0], "head_method", None) if self.tied else self.method
        if method is not None:
            return method(hidden).float()
        w = self.lm_weight
        return decode_linear(hidden.to(w.dtype), w).float()

    def take_quantized(self, name: str, w: GroupQuantized) -> None:
        check_shape(name, w, self.weight.shape)
        self.method = quantized_method(w, self.weight.device)
        del self.weight
        self.register_parameter("weight", None)
