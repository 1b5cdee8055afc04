"""The embedded SmolLM2 as engine tests take it: ``(model, tokenizer)`` on the CPU in fp32."""
from __future__ import annotations

import pytest
import torch


def embedded_parts():
    """The embedded model and its tokenizer; the test is skipped where the model file is missing."""
    from ninfer.engine.loader import load_model
    from ninfer.engine.loader.embedded import EmbeddedModelMissing, embedded_model_path
    from ninfer.engine.loader.gguf_loader import load_gguf

    try:
        ckpt = load_gguf(embedded_model_path())
    except EmbeddedModelMissing as exc:
        pytest.skip(str(exc))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer
