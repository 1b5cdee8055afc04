"""The engine core: admits requests, runs one model step at a time, publishes outputs.

``LLMEngine`` is synchronous and owned by exactly one thread (see ``loop.py``). One step:
schedule -> run the model on a flat batch -> sample -> postprocess (detokenize, stops, finish).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from .engine_config import EngineConfig
from .frontend.output import OutputProcessor
from .frontend.tokenizer import Tokenizer
from .models.base import CausalLM, ForwardBatch
from .outputs import RequestOutput
from .request import FinishReason, Request, Status
from .sampler import make_generator, sample


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = torch.device(config.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._processors: dict[str, OutputProcessor] = {}

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(request.prompt_ids) >= request.max_total_tokens:
            raise ValueError(
                f"prompt has {len(request.prompt_ids)} tokens, the context limit is {request.max_total_tokens}"
            )
        request.generator = make_generator(request.params, self.device)
        self._processors[request.request_id] = OutputProcessor(
            self.tokenizer, request.params.stop, request.prompt_ids
        )
        self.waiting.append(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == request_id:
                    queue.remove(req)
                    req.finish(FinishReason.ABORT)
                    return self._final_output(req, "")
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        self._admit()
        scheduled = self._schedule()
        if not scheduled:
            return []
        ids, lens, caches, positions = [], [], [], []
        for req, n in scheduled:
            new = req.all_ids[req.num_computed : req.num_computed + n]
            ids.extend(new)
            lens.append(n)
            caches.append(req.cache)
            positions.extend(range(req.num_computed, req.num_computed + n))
        batch = ForwardBatch(
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            seq_lens=lens,
            caches=caches,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device), batch)
            last_rows, sampling = [], []
            end = 0
            for (req, n), _ in zip(scheduled, lens):
                end += n
                req.num_computed += n
                if req.num_computed >= req.num_tokens:  # prompt done: this row yields a token
                    last_rows.append(end - 1)
                    sampling.append(req)
            logits = self.model.compute_logits(hidden[last_rows]) if last_rows else None
        tokens = (
            sample(logits, [r.params for r in sampling], [r.generator for r in sampling]) if sampling else []
        )
        return self._postprocess(sampling, tokens)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_concurrency:
            req = self.waiting.popleft()
            req.status = Status.PREFILL
            req.cache = self.model.new_cache()
            self.running.append(req)

    def _schedule(self) -> list[tuple[Request, int]]:
        """Every decode-ready sequence gets one token; the oldest prefill gets one chunk."""
        out: list[tuple[Request, int]] = [(r, 1) for r in self.running if r.status is Status.DECODE]
        for req in self.running:
            if req.status is Status.PREFILL:
                out.append((req, min(req.num_prompt_remaining, self.config.prefill_chunk)))
                break
        return out

    def _postprocess(self, reqs: list[Request], tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for req, token in zip(reqs, tokens):
            if req.status is Status.PREFILL:
                req.status = Status.DECODE
                req.prefill_done_time = now
                if req.params.max_tokens == 0:  # prompt only
                    outputs.append(self._finish(req, FinishReason.LENGTH, None, ""))
                    continue
            if req.first_token_time is None:
                req.first_token_time = now
            outputs.append(self._append_token(req, token))
        return outputs

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        params = req.params
        if (token in req.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            req.output_ids.append(token)
            return self._finish(req, FinishReason.STOP, token, self._processors[req.request_id].flush())
        req.output_ids.append(token)
        text, matched = self._processors[req.request_id].push(token)
        if matched is not None:
            return self._finish(req, FinishReason.STOP, matched, text)
        hit_max = params.max_tokens is not None and len(req.output_ids) >= params.max_tokens
        if hit_max or req.num_tokens >= req.max_total_tokens:
            return self._finish(req, FinishReason.LENGTH, None, text + self._processors[req.request_id].flush())
        return RequestOutput(req.request_id, text=text, token_ids=[token], completion_tokens=len(req.output_ids),
                             prompt_tokens=len(req.prompt_ids))

    def _finish(self, req: Request, reason: FinishReason, stop_reason, text: str) -> RequestOutput:
        self.running.remove(req)
        req.finish(reason, stop_reason)
        return self._final_output(req, text, [req.output_ids[-1]] if req.output_ids else [])

    def _final_output(self, req: Request, text: str, token_ids: list[int] | None = None) -> RequestOutput:
        self._processors.pop(req.request_id, None)
        start_run = req.arrival
        prefill_end = req.prefill_done_time
        return RequestOutput(
            req.request_id,
            text=text,
            token_ids=token_ids or [],
            finished=True,
            finish_reason=req.finish_reason.value,
            stop_reason=req.stop_reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            queue_time=None,
            prefill_time=None if prefill_end is None else prefill_end - start_run,
            decode_time=None if prefill_end is None else (req.finish_time or prefill_end) - prefill_end,
        )
