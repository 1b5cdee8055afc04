"""A scripted model for tests: emits a chosen text through the real tokenizer and the real engine.

Small random or real models will not write tool-call markup or long reasoning on cue; this one
does. The script is picked by a keyword found in the prompt (the one occurring last wins), and the
model's logits put all mass on the script's next token, then on eos once the script is spent. If
the engine forces a ``</think>`` that the script did not have there (a thinking budget), the
script continues after its own ``</think>``.
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ninfer.engine.config import ModelConfig
from ninfer.engine.engine import LLMEngine
from ninfer.engine.engine_config import EngineConfig
from ninfer.engine.frontend.chat_template import ChatTemplate, builtin_template
from ninfer.engine.frontend.qwen_tiktoken import load_qwen_tiktoken
from ninfer.engine.frontend.tokenizer import Tokenizer
from ninfer.engine.loader.checkpoint import Checkpoint, GenerationDefaults
from ninfer.engine.loop import EngineLoop
from ninfer.engine.models.base import CausalLM, ForwardBatch
from ninfer.server.cli import build_parser


class ScriptedLM(CausalLM):
    def __init__(self, tokenizer: Tokenizer, scripts: dict[str, str], default: str, eos_id: int,
                 vocab_size: int) -> None:
        super().__init__()
        self.config = ModelConfig(family="llama", model_type="scripted", vocab_size=vocab_size, hidden_size=1,
                                  num_hidden_layers=0, num_attention_heads=1, num_key_value_heads=1, head_dim=1,
                                  intermediate_size=1, max_position_embeddings=1 << 20)
        self.tokenizer = tokenizer
        self.scripts = {k: tokenizer.encode(v) for k, v in scripts.items()}
        self.default = tokenizer.encode(default)
        self.eos_id = eos_id
        # cache -> [prompt length, script ids, index shift, prompt text], for as long as the sequence's cache lives
        self._chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # a </think> the engine forced in (thinking budget) resumes the script after its own </think>
        self.close_id = tokenizer.token_to_id("</think>")
        self.step_delay = 0.0  # seconds each forward takes, to hold requests open in tests

    def _choose(self, prompt_text: str) -> list[int]:
        best, where = self.default, -1
        for key, ids in self.scripts.items():
            pos = prompt_text.rfind(key)
            if pos > where:
                best, where = ids, pos
        return best

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.step_delay:
            time.sleep(self.step_delay)
        rows = []
        for (start, end), cache in zip(batch.slices, batch.caches):
            first, text = int(batch.positions[start]), self.tokenizer.decode(input_ids[start:end].tolist())
            if cache not in self._chosen:  # the prompt, or what a prefix checkpoint left of it (the
                # script's key is then in the last turn); a chunk cut where a checkpoint is taken
                # is followed by the rest of the prompt, which starts where it ended
                self._chosen[cache] = [int(batch.positions[end - 1]) + 1, self._choose(text), 0, text]
            elif first == self._chosen[cache][0] and end - start > 1:
                text = self._chosen[cache][3] + text
                self._chosen[cache] = [int(batch.positions[end - 1]) + 1, self._choose(text), 0, text]
            chosen = self._chosen[cache]
            prompt_len, script = chosen[0], chosen[1]
            for pos, token in zip(batch.positions[start:end].tolist(), input_ids[start:end].tolist()):
                at = pos - prompt_len + chosen[2]  # script index of the token fed at ``pos``
                if token == self.close_id and pos >= prompt_len and not (0 <= at < len(script) and
                                                                         script[at] == token):
                    if self.close_id in script:  # forced: continue after the script's own close
                        chosen[2] = script.index(self.close_id) - (pos - prompt_len)
                i = pos + 1 - prompt_len + chosen[2]  # index of the token this row predicts
                rows.append(script[i] if 0 <= i < len(script) else self.eos_id)
        batch.advance_caches()
        return torch.tensor(rows, dtype=torch.float32).unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((hidden.shape[0], self.config.vocab_size), -1e4)
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].long()] = 1e4
        return logits


def scripted_state(scripts: dict[str, str], default: str = "Hello! How can I help?", *cli_args: str,
                   prefix_cache: bool = False):
    """``(ServerState, EngineLoop)`` serving a ScriptedLM with the Qwen3.5 tokenizer and template.
    The script is chosen from the prompt's text, so a request that goes on from a prefix
    checkpoint (only the rest of its prompt runs) must carry its key in the new turn:
    ``prefix_cache`` is off unless asked for."""
    from ninfer.server.bootstrap import assemble_state, engine_config

    tok = load_qwen_tiktoken("qwen3.6")
    eos = tok.token_to_id("<|im_end|>")
    model = ScriptedLM(tok, scripts, default, eos, vocab_size=248320)
    args = build_parser().parse_args(["--model-id", "scripted", "--prefill-chunk", "65536",
                                      "--kv-capacity", "65536", *([] if prefix_cache else ["--no-prefix-cache"]),
                                      *cli_args])
    ckpt = Checkpoint(config=model.config, weights=lambda: [], tokenizer=tok,
                      chat_template=builtin_template("qwen3_5"),
                      generation=GenerationDefaults(eos_token_ids=[eos]), source="scripted")
    template = ChatTemplate(ckpt.chat_template, eos_token="<|im_end|>")
    config: EngineConfig = engine_config(args, args.max_context or 32768, "cpu", torch.float32)
    return assemble_state(args, ckpt, EngineLoop(LLMEngine(model, tok, config)), tok, template, config)


def record_prompts(state) -> list[str]:
    """The prompt texts the state's ScriptedLM is asked to answer, appended as they come."""
    prompts: list[str] = []
    model = state.engine.loop.engine.model
    choose = model._choose

    def recording(prompt_text: str):
        prompts.append(prompt_text)
        return choose(prompt_text)

    model._choose = recording
    return prompts


@contextmanager
def scripted_servers(default: str, prepare: Callable | None = None) -> Iterator[Callable]:
    """``start(*cli_args) -> (LiveServer, ServerState)``: live servers of a ScriptedLM answering
    ``default``, each stopped on exit; ``prepare(state)`` runs before its engine starts."""
    from ninfer.server.app import create_app

    from .live_server import LiveServer

    started = []

    def start(*cli_args: str):
        state, loop = scripted_state({}, default, *cli_args)
        if prepare is not None:
            prepare(state)
        loop.start()
        server = LiveServer(create_app(state)).__enter__()
        started.append((server, loop))
        return server, state

    try:
        yield start
    finally:
        for server, loop in started:
            server.__exit__(None, None, None)
            loop.stop()
