"""Token embedding and the output head (its own weight, or tied to the embedding)."""
from __future__ import annotations

import torch
from torch import nn

from .fused_linear import decode_linear


class LMHead(nn.Module):
    """Logits for hidden states: ``hidden @ weight.T`` in the weights' dtype, returned as fp32.

    With ``tied_to`` the head owns no parameter and reads the embedding's weight, so a tied model
    has one ``[vocab, hidden]`` tensor (under ``model.embed_tokens.weight``).
    """

    def __init__(self, hidden_size: int, vocab_size: int, tied_to: nn.Embedding | None = None) -> None:
        super().__init__()
        self.tied = tied_to is not None
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        else:
            if tuple(tied_to.weight.shape) != (vocab_size, hidden_size):
                raise ValueError(f"tied embedding has shape {tuple(tied_to.weight.shape)}")
            self._embedding = [tied_to]  # in a list: not registered as a submodule a second time

    @property
    def lm_weight(self) -> torch.Tensor:
        return self._embedding[0].weight if self.tied else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.lm_weight
        return decode_linear(hidden.to(w.dtype), w).float()
