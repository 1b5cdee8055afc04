"""Embeddings: each input one prompt-only engine request (``SamplingParams.pooling``), run side by
side; the pooled states normalized, cut to ``dimensions`` and encoded as each dialect answers."""
from __future__ import annotations

import base64
import uuid
from typing import Any, AsyncIterator

import torch

from ...engine.outputs import RequestOutput
from ...engine.sampling_params import SamplingParams
from ..answer import Job
from ..errors import APIError, invalid
from ..llamacpp.protocol import prompt_list
from ..llamacpp.serving import prompt_ids
from ..openai_common import check_model
from ..state import ServerState
from .protocol import EmbeddingRequest, Input, LlamaEmbeddingRequest


class PreparedEmbeddings:
    """The inputs of one request, tokenized and checked, as engine jobs pooling with ``pooling``."""

    def __init__(self, state: ServerState, given: Input, param: str, pooling: str) -> None:
        try:
            prompts, batch = prompt_list(given)
        except ValueError as exc:
            raise invalid(param, str(exc).replace("prompt", param)) from exc
        if not prompts:
            raise invalid(param, f"'{param}' must not be empty")
        self.ids = [prompt_ids(state, parts, f"{param}[{i}]" if batch else param, framed=True)
                    for i, parts in enumerate(prompts)]
        self.params = SamplingParams(temperature=0.0, max_tokens=0, pooling=pooling)
        self.id = "embd-" + uuid.uuid4().hex

    def jobs(self) -> list[Job]:
        return [Job(ids, self.params, f"{self.id}-{i}", None, final) for i, ids in enumerate(self.ids)]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.ids))


async def final(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    if last is None or last.embedding is None:
        raise APIError(500, "the engine returned no embedding", None, "internal_error")
    return last


def vectors(out: RequestOutput, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """``[rows, width]`` float32: the pooled states, their first ``dimensions``, each normalized."""
    rows = torch.tensor(out.embedding, dtype=torch.float32)
    if dimensions is not None:
        rows = rows[:, :dimensions]
    return torch.nn.functional.normalize(rows, dim=-1) if normalize else rows


# ---------------------------------------------------------------------------- OpenAI
def prepare_openai(req: EmbeddingRequest, state: ServerState) -> PreparedEmbeddings:
    width = state.engine.loop.model_config.hidden_size
    if req.dimensions is not None and req.dimensions > width:
        raise invalid("dimensions", f"dimensions must be at most the model's {width}, got {req.dimensions}")
    return PreparedEmbeddings(state, req.input, "input", state.pooling)


def openai_body(req: EmbeddingRequest, state: ServerState, prep: PreparedEmbeddings,
                finals: list[RequestOutput]) -> dict[str, Any]:
    data = []
    for i, out in enumerate(finals):
        vec = vectors(out, True, req.dimensions)[0]
        encoded: Any = vec.tolist() if req.encoding_format != "base64" else \
            base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = prep.prompt_tokens
    return {"object": "list", "data": data, "model": check_model(state, req.model),
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


# ---------------------------------------------------------------------------- llama.cpp
def prepare_llama(req: LlamaEmbeddingRequest, state: ServerState) -> tuple[PreparedEmbeddings, bool]:
    check_model(state, req.model)
    pooling = req.pooling or state.pooling
    normalize = req.normalized(pooling)
    return PreparedEmbeddings(state, req.text, req.param, pooling), normalize


def llama_body(finals: list[RequestOutput], normalize: bool) -> list[dict[str, Any]]:
    """llama.cpp's answer: per input its ``index`` and ``embedding``, a list of vectors (one per
    prompt token with pooling ``none``, else one)."""
    return [{"index": i, "embedding": vectors(out, normalize).tolist()} for i, out in enumerate(finals)]
