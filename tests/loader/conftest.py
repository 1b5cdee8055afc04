"""Helpers for the GGUF loader tests: writing small GGUF files, and the embedded SmolLM2 file."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import pytest

from ninfer.engine.loader.checkpoint import Checkpoint
from ninfer.engine.loader.embedded import EmbeddedModelMissing, embedded_model_path
from ninfer.engine.loader.gguf_loader import load_gguf, open_gguf
from support.gguf_files import TensorSpec, write_gguf


@pytest.fixture(scope="session")
def gguf_file() -> Callable[..., Path]:
    """``write_gguf`` itself, for module-scoped fixtures that pick their own path."""
    return write_gguf


@pytest.fixture
def gguf_writer(tmp_path: Path) -> Callable[..., Path]:
    counter = iter(range(1000))

    def make(tensors: list[TensorSpec], meta: dict[str, Any] | None = None, arch: str = "llama") -> Path:
        return write_gguf(tmp_path / f"t{next(counter)}.gguf", tensors, meta, arch)

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    try:
        return embedded_model_path()
    except EmbeddedModelMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_path: Path) -> gguf.GGUFReader:
    return open_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Checkpoint:
    return load_gguf(smollm2_path)
