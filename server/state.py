"""What the gateway needs from the loaded model and engine, built once at startup."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..engine.async_engine import AsyncEngine
from ..engine.frontend.chat_template import ChatTemplate
from ..engine.frontend.tokenizer import Tokenizer
from ..engine.loader.checkpoint import GenerationDefaults
from .workers import PrepareWorkers


@dataclass
class SamplingDefaults:
    """Server-level defaults: flags override generation_config.json, requests override both."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


@dataclass
class ThinkingDefaults:
    """Server flags for reasoning: None leaves the choice to the chat template's default."""

    enable_thinking: bool | None = None  # --no-thinking -> False
    preserve_thinking: bool | None = None  # --preserve-thinking -> True
    budget: int | None = None  # --default-thinking-budget, for requests that start thinking
    loop: str | None = None  # --reasoning-loop: stop | conclude reasoning that repeats itself (None: let it run)

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"--default-thinking-budget must be >= 1, got {self.budget}")
        if self.loop not in (None, "stop", "conclude"):
            raise ValueError(f"--reasoning-loop must be 'stop' or 'conclude', got {self.loop!r}")


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
    aliases: tuple[str, ...] = ()  # names accepted besides model_id (--served-model-name)
    # --strict-model-names: a request naming a model outside public_names is refused (a router in
    # front of several servers); by default any name is served by the one model
    strict_model_names: bool = False
    thinking: ThinkingDefaults = field(default_factory=ThinkingDefaults)
    default_max_tokens: int | None = None  # output tokens when a request names none (None: to the context)
    max_request_bytes: int = 32 << 20  # raw request bodies beyond this get 413 before parsing
    # browser origins allowed to call the API (--cors): "*" any, "localhost" any page served from
    # this machine (http or https, localhost, 127.0.0.1 or [::1], any port), the default
    cors_origins: tuple[str, ...] = ("localhost",)
    keepalive_s: float = 5.0  # an SSE comment after this long without an event
    responses: Any = None  # ResponseStore (server/openai_responses/store.py)
    reasoning_seal: Any = None  # ReasoningSeal (server/openai_responses/sealing.py): encrypted_content
    strict_tools: bool = False  # --strict-tools: refuse hosted Responses tools instead of leaving them out
    media: Any = None  # MediaSettings (server/media.py) with --vision: images in requests; None: refused
    pooling: str = "mean"  # embeddings' pooling when a request names none (the checkpoint's, Checkpoint.pooling)
    observability: Any = None  # Observability hub (server/observability), set by bootstrap
    workers: PrepareWorkers = field(default_factory=PrepareWorkers)  # body parsing, templates, tokenizing
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def public_names(self) -> tuple[str, ...]:
        """Every model name requests may use, ``model_id`` first (as ``/v1/models`` lists them)."""
        return (self.model_id, *(a for a in self.aliases if a != self.model_id))


def state_of(request) -> ServerState:
    """The ``ServerState`` of the app serving ``request``."""
    return request.app.state.ninfer
