"""What the gateway needs from the loaded model and engine, built once at startup."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.async_engine import AsyncEngine
from ..engine.frontend.chat_template import ChatTemplate
from ..engine.frontend.tokenizer import Tokenizer
from ..engine.loader.checkpoint import GenerationDefaults


@dataclass
class SamplingDefaults:
    """Server-level defaults: flags override generation_config.json, requests override both."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    template: ChatTemplate
    model_id: str
    max_context: int
    sampling: SamplingDefaults
    generation: GenerationDefaults
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
