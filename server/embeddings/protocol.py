"""Pydantic models of the embeddings requests, OpenAI's and llama.cpp's.

An input is read as llama.cpp reads a prompt (``llamacpp.protocol.prompt_list``): a string, or
token ids (strings may be mixed in), is one input; a list of strings or of lists is several.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..errors import invalid, unsupported

Input = Union[str, list[Union[int, str, list[Union[int, str]]]]]


class EmbeddingRequest(BaseModel):
    """OpenAI's ``/v1/embeddings``: every vector normalized to length 1, as OpenAI's are."""

    model_config = ConfigDict(extra="forbid")

    input: Input
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"  # base64: little-endian float32 bytes; null: float
    dimensions: int | None = Field(default=None, ge=1)  # the first N dimensions, normalized again
    user: str | None = None  # accepted for OpenAI clients; identifies nobody here


class LlamaEmbeddingRequest(BaseModel):
    """llama.cpp's ``/embedding`` and ``/embeddings``: ``content`` (or ``input``), the pooling
    (``none``: one vector per prompt token), normalized or not."""

    model_config = ConfigDict(extra="forbid")

    content: Input | None = None
    input: Input | None = None
    model: str | None = None
    pooling: Literal["none", "mean", "last"] | None = None  # default: the model's
    normalize: bool | None = None  # default: pooled vectors normalized, per-token ones not
    embd_normalize: int | None = None  # llama.cpp's spelling: -1 none, 2 euclidean
    encoding_format: Literal["float"] = "float"

    @property
    def text(self) -> Any:
        if (self.content is None) == (self.input is None):
            raise invalid("content", "give the text to embed in exactly one of content and input")
        return self.content if self.content is not None else self.input

    @property
    def param(self) -> str:
        return "content" if self.content is not None else "input"

    def normalized(self, pooling: str) -> bool:
        if self.embd_normalize is not None:
            if self.embd_normalize not in (-1, 2):
                raise unsupported("embd_normalize", "-1 (none) and 2 (euclidean) are the norms served")
            if self.normalize is not None and self.normalize != (self.embd_normalize == 2):
                raise invalid("embd_normalize", "embd_normalize contradicts normalize")
            return self.embd_normalize == 2
        return self.normalize if self.normalize is not None else pooling != "none"
