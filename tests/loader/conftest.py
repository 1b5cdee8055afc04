"""Helpers for the GGUF loader tests: writing small GGUF files, and the embedded SmolLM2 file."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest

from ninfer.engine.loader.checkpoint import Checkpoint
from ninfer.engine.loader.embedded import EmbeddedModelMissing, embedded_model_path
from ninfer.engine.loader.gguf_loader import load_gguf, open_gguf

# (name, array, GGML type or None for the array's own float type)
TensorSpec = tuple[str, np.ndarray, "gguf.GGMLQuantizationType | None"]


def write_gguf(path: Path, tensors: list[TensorSpec], meta: dict[str, Any] | None = None,
               arch: str = "llama") -> Path:
    """A GGUF file with ``tensors`` (quantised ones given as their uint8 blocks) and ``meta`` keys."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, value in (meta or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            raise TypeError(f"{key}: {type(value)}")
    for name, array, qtype in tensors:
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
