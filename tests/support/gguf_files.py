"""Small GGUF files written with the ``gguf`` package, for the loader tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

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
