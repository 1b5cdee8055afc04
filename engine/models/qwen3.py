"""Qwen3 dense models: the Llama decoder with per-head q/k RMSNorm (see ``llama.py``)."""
from __future__ import annotations

from .llama import Qwen3ForCausalLM

__all__ = ["Qwen3ForCausalLM"]
