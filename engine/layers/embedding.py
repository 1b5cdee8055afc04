"""Token embedding and the output head (its own weight, or tied to the embedding).

A quantized embedding table (``take_quantized``, ``linear.py``) stays quantized and a lookup
dequantizes only its rows. A quantized head weight is held by the method ``linear.head_method``
picks: on the CPU the weight in fp16 for fbgemm's fp16 GEMM (``linear.Fp16CpuMethod``), whose
logits come out in fp32 as the dequantized weight's do (sampling reads them as they are; the CPU
int4 product rounds its outputs to bf16, a step of 0.125 at a logit of 25, which turned the
embedded model's greedy answer to the README's question from "The capital ..." into "L'Étoile ..."
on a 0.08 margin); a table tied to the head stays quantized for the lookups, the head holding its
own fp16 copy (SmolLM2's Q8_0 table: 30 MiB quantized and 54 MiB in fp16 against 108 MiB dense in
fp32, and 1.8 ms a token for the head against 9.5 ms). Where no method holds it (a torch without
fbgemm, a head split over tensor-parallel ranks) the weight is dequantized at load, a tied table
with it. On the GPU an untied head stays quantized (``linear.TritonGroupMethod``): the 27B's head
is 2.5 GB in bf16, 1.3 GB in 8 bits.

``--embedding-host`` keeps a dense table in pinned host memory (``Embedding.hold_on_host``, before
the weights are loaded into it): a GPU lookup reads its rows there in place
(``embedding_triton.py``), which frees the table's bytes on the card (the 27B's: 2.5 GB) for a
few KiB over the bus a token.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import parallel
from .fused_linear import decode_linear
from .linear import GroupQuantized, LinearMethod, check_shape, head_method


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be held quantized: a lookup dequantizes its rows, exactly
    as the format defines them, into the model's dtype. A table a head is tied to stays
    quantized where the head holds its own copy (``LMHead.take_tied``), and is dequantized at load
    where it does not."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.table: GroupQuantized | None = None
        self._tied_head: list[LMHead] = []  # a head that reads this table (in a list: not a submodule)
        self.on_host = False  # the table in pinned host memory, read in place by GPU lookups

    def hold_on_host(self) -> None:
        """Keep the dense table in pinned host memory (call before the weights are loaded: they
        are copied straight there). Refused for a table an LM head reads: the head needs it on
        the device each step."""
        if self._tied_head:
            raise ValueError("the LM head is tied to the token embedding and reads its table on the device every "
                             "step: a model with tied embeddings runs without --embedding-host")
        if self.table is not None:
            raise ValueError("a quantized embedding table stays where it is loaded")
        host = torch.empty(self.weight.shape, dtype=self.weight.dtype, pin_memory=torch.cuda.is_available())
        self.weight = nn.Parameter(host, requires_grad=False)
        self.on_host = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.on_host and ids.device.type != "cpu":
            from .embedding_triton import host_embedding_triton

            return host_embedding_triton(self.weight, ids)
        if self.table is None:
            return super().forward(ids)
        rows = self.table.dequantize(rows=ids.reshape(-1))
        return rows.to(self._dtype).view(*ids.shape, self.embedding_dim)

    def take_quantized(self, name: str, w: GroupQuantized, device: torch.device | None = None) -> None:
        check_shape(name, w, self.weight.shape)
        device = self.weight.device if device is None else device
        if self._tied_head and not self._tied_head[0].take_tied(w, self.weight.dtype, device):
            _copy_dense(self, w, device)
            return
        self.table = w
        self._dtype = self.weight.dtype
        del self.weight
        self.register_parameter("weight", None)


class LMHead(nn.Module):
    """Logits for hidden states: ``hidden @ weight.T`` in the weights' dtype, returned as fp32.

    With ``tied_to`` the head owns no parameter and reads the embedding's weight, so a tied model
    has one ``[vocab, hidden]`` tensor (under ``model.embed_tokens.weight``). A quantized weight is
    held by a method (``method``, see above), or dequantized at load where none holds it. Under tensor parallelism (``parallel.py``) each rank holds
    ``vocab_shard`` rows (its own weight: rows ``rank * shard ..``, the last rank's padded; tied:
    those rows of the embedding) and the ranks' logits are gathered, so every rank returns all of them
    (a quantized weight is then dequantized at load).
    """

    method: LinearMethod | None

    def __init__(self, hidden_size: int, vocab_size: int, tied_to: nn.Embedding | None = None) -> None:
        super().__init__()
        self.method = None
        self.tied = tied_to is not None
        self.vocab_size = vocab_size
        tp = parallel.current()
        self.rows = parallel.vocab_shard(vocab_size, tp.world_size)
        self.first = tp.rank * self.rows
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        else:
            if tuple(tied_to.weight.shape) != (vocab_size, hidden_size):
                raise ValueError(f"tied embedding has shape {tuple(tied_to.weight.shape)}")
            self._embedding = [tied_to]  # in a list: not registered as a submodule a second time
            tied_to._tied_head = [self]

    @property
    def lm_weight(self) -> torch.Tensor:
        if not self.tied:
            return self.weight
        table = self._embedding[0].weight
        return table if self.rows == self.vocab_size else table[self.first : self.first + self.rows]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.method is not None:
            return self.method(hidden.to(self._dtype)).float()
        w = self.lm_weight
        logits = decode_linear(hidden.to(w.dtype), w).float()
        if self.rows == self.vocab_size:
            return logits
        if logits.shape[-1] < self.rows:  # the last rank's rows of a tied table: padded
            logits = torch.nn.functional.pad(logits, (0, self.rows - logits.shape[-1]))
        return parallel.current().gather_last(logits, self.vocab_size)

    @property
    def quantized(self) -> bool:
        return self.method is not None

    def take_quantized(self, name: str, w: GroupQuantized, device: torch.device | None = None) -> None:
        check_shape(name, w, self.weight.shape)
        device = self.weight.device if device is None else device
        method = head_method(w, device)
        if method is None:
            _copy_dense(self, w, device)
            return
        self.method, self._dtype = method, self.weight.dtype
        del self.weight
        self.register_parameter("weight", None)

    def take_tied(self, w: GroupQuantized, dtype: torch.dtype, device: torch.device) -> bool:
        """Hold the quantized table ``w`` the head is tied to (the embedding's, in ``dtype``
        until then) in a method of its own on ``device``; False where none holds it (see above) or
        this rank holds only some of its rows."""
        if self.rows != self.vocab_size:
            return False
        method = head_method(w, device)
        if method is None:
            return False
        self.method, self._dtype = method, dtype
        return True


def _copy_dense(module: nn.Module, w: GroupQuantized, device: torch.device) -> None:
    """``module.weight`` = ``w`` dequantized (given storage on ``device`` if it has none yet)."""
    from ..models.weights import materialize

    weight = module.weight
    if weight.is_meta:
        weight = materialize(module, weight, device)
    with torch.no_grad():
        weight.copy_(w.dequantize())
