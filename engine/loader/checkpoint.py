"""The result of reading a model from disk, whatever its format."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..config import ModelConfig
from ..frontend.tokenizer import Tokenizer


@dataclass
class GenerationDefaults:
    """Sampling defaults and stop ids from ``generation_config.json`` (or GGUF metadata)."""

    eos_token_ids: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def read(cls, eos_token_ids: list[int], lookup: Callable[[str], Any]) -> "GenerationDefaults":
        """``lookup(field)`` gives a sampling field's raw value from the source, or None."""

        def num(field: str, kind: type) -> Any:
            value = lookup(field)
            return None if value is None else kind(value)

        return cls(
            eos_token_ids=eos_token_ids,
            temperature=num("temperature", float),
            top_p=num("top_p", float),
            top_k=num("top_k", int),
            min_p=num("min_p", float),
            repetition_penalty=num("repetition_penalty", float),
        )


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]  # (HF name, tensor), read lazily
    tokenizer: Tokenizer | None
    chat_template: str | None
    generation: GenerationDefaults
    source: str  # path it was read from
    skipped_prefixes: tuple[str, ...] = ()  # weight groups recognised and not loaded (mtp., visual.)
    # how embeddings pool the final hidden states when a request names no pooling: "last" where
    # the checkpoint declares last-token pooling (Qwen3-Embedding's sentence-transformers files,
    # a GGUF's pooling_type), else "mean"
    pooling: str = "mean"
    # the same tensors with those of formats the linear methods keep quantized as ``GroupQuantized``
    # (a GGUF file's Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K / Q8_0 matrices, GPTQ / AWQ projections whose groups are
    # runs of consecutive columns); None when the checkpoint has none
    quantized_weights: Callable[[], Iterable[tuple[str, Any]]] | None = None
    # ``weights`` with each tensor passed through ``take(name, source)``, ``source`` a slice of the
    # file that reads only what ``take`` indexes (tensor parallelism: ``parallel.Sharder``); None
    # where the format reads whole tensors (``take`` then gets those)
    sliced_weights: Callable[[Callable[[str, Any], torch.Tensor]], Iterable[tuple[str, Any]]] | None = None
    # the MTP head's tensors (``mtp.*``, loaded by ``load_model(..., mtp=True)`` for ``--spec mtp``);
    # None when the checkpoint has none
    mtp_weights: Callable[[], Iterable[tuple[str, Any]]] | None = None
    # the vision tower's tensors (``model.visual.*``, loaded by ``load_model(..., vision=True)``
    # for ``--vision``) and the image processor's settings (``preprocessor_config.json``); None
    # when the checkpoint has none
    vision_weights: Callable[[], Iterable[tuple[str, Any]]] | None = None
    image_processor: Any = None
