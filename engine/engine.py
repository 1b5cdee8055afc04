"""The engine core: admits requests, runs one model step at a time, publishes outputs.

``LLMEngine`` is synchronous and owned by exactly one thread (see ``loop.py``). One step:
schedule (``scheduler.py``) -> run and sample (``runner.py``) -> postprocess (detokenize, stops,
finish) -> publish ``RequestOutput`` objects.
"""
from __future__ import annotations

import bisect
import logging
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from . import launch, thinking
from .cache.manager import CacheManager
from .cuda_graph_mixed import capture_pieces
from .engine_config import EngineConfig
from .frontend.output import OutputProcessor
from .frontend.tokenizer import Tokenizer
from .grammar import GrammarError, Grammars
from .memory import (check_step_room, checkpoints_ahead, free_memory_bytes, moving_slots, plan_kv_pages,
                     prefix_checkpoints, workspace_bytes)
from .models.base import CausalLM
from .outputs import RequestOutput, TokenLogprob
from .outputs import merge as merge_outputs
from .pace import StepPace
from .pooling import Pooled
from .request import FinishReason, Request, Status
from .runner import Launched, ModelRunner, StepThreads
from .sampler import make_generator, uses_history
from .scheduler import Scheduler
from .spec import Drafter, MTPDrafter, accepted, speculates
from .stats import EngineCounters

log = logging.getLogger("ninfer.engine")


class LLMEngine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        config.check_for_model(model.config)
        self.device = torch.device(config.device)
        # ids both the tokenizer decodes and the model embeds: prompts must stay below it, and
        # sampling never leaves it (a checkpoint's vocab_size may pad past its tokenizer's ids)
        self.token_limit = min(tokenizer.vocab_size, model.config.vocab_size)
        mtp = config.spec == "mtp"
        # with the MTP head its layers are attention layers after the stack, K/V in the same pages
        shape = model.config.with_mtp() if mtp else model.config
        # (MTP: no whole-step graphs, for the final hidden states the head takes; its steps take
        # the graphs in pieces, ``cuda_graph_mixed.py``)
        captured = config.cuda_graphs and self.device.type == "cuda" and config.tensor_parallel == 1
        graphs = captured and not mtp
        # steps with prompt rows (with MTP every step) in pieces, captured before the caches are
        # sized: the KV cache is planned around the memory they keep
        pieces = capture_pieces(model, self.device, config, every_step=mtp) if captured else None
        checkpoints = prefix_checkpoints(shape, config)
        num_pages = plan_kv_pages(shape, config, checkpoints)
        # captured decode graphs keep one page and one slot for their padding rows
        self.caches = CacheManager(shape, num_pages + graphs, config.page_size,
                                   config.max_concurrency + graphs, config.dtype, self.device,
                                   config.host_cache_mib << 20, checkpoints, moving_slots(config, checkpoints),
                                   config.kv_storage_dtype, config.state_storage_dtype,
                                   ahead_slots=checkpoints_ahead(config, checkpoints))
        # speculative decoding (``spec.py``): n-gram or MTP drafts verified in the step that runs them
        self.runner = ModelRunner(model, self.device, self.caches, self.token_limit, config.max_concurrency)
        self.runner.threads = StepThreads.configure(self.device, config.cpu_threads_one_token)
        if config.tensor_parallel > 1:  # rank 0 of tensor parallelism: the other ranks follow its steps
            from .tp_steps import Leader

            self.runner.leader = Leader(self.caches)
        self.drafter = Drafter(config.draft_tokens, config.ngram_min, config.ngram_max) \
            if config.spec == "ngram" else None
        if mtp:
            self.drafter = MTPDrafter(config.draft_tokens, model, self.caches, self.device, self.token_limit)
            self.runner.keep_hidden = True
        self.pace = StepPace(config.decode_gap, self.PACE_FLOOR, config.step_tokens) if config.decode_gap else None
        self.scheduler = Scheduler(config, self.caches, self.drafter, self.pace)
        if graphs:
            self.runner.enable_cuda_graphs(config.max_concurrency, config.max_context,
                                           config.draft_tokens + 1 if config.spec == "ngram" else 0)
        settings = launch.current()
        if settings.gdn_graph_tokens and graphs and pieces is not None and pieces.captured:  # (the decode graphs
            # reserved their padding slot)
            room = free_memory_bytes(self.device, config.gpu_memory_gib) - workspace_bytes(shape, config)
            pieces.capture_rows(self.caches, config.max_concurrency, settings.gdn_graph_tokens, settings.gdn_graph_rows,
                                budget=max(room, 0))
        self.runner.mixed_graphs = pieces if pieces is not None and pieces.captured else None
        self._processors: dict[str, OutputProcessor] = {}
        self.overlap = (self.device.type == "cuda") if config.overlap is None else config.overlap
        self._ahead: Launched | None = None  # a decode step launched before its inputs were read back
        self.counters = self._new_counters()  # read lock-free by /metrics and /stats
        self.grammars: Grammars | None = None  # made for the first request with a grammar
        self._compiling: list[tuple[Request, Future]] = []  # requests whose grammar is being compiled
        self.last_step = time.monotonic()  # when the last step ended (``idle_work`` waits for quiet)
        self._stepped: tuple[int, int] | None = None  # the step read in this call: decode rows, prompt tokens
        self._step_end = 0.0  # perf_counter at the end of the last step (the pace's clock)
        if self.device.type == "cuda":
            check_step_room(shape, config)
            self.warm_up()

    PACE_FLOOR = 128  # prompt tokens a step beside decode rows carries at least (pace.py)
    PACE_FOLLOWS_S = 0.002  # a step that starts within this of the last one's end follows it

    # the warm-up's rounds of prompt lengths, each added one step after the one before: prompt
    # rows alone, several at once, beside decode rows, one-token rows, token counts that are and
    # are not multiples of 16 (Triton specializes integer arguments on that, and on == 1), block
    # tables one page wide and sixteen, sixteen rows at once
    WARM_UP_ROUNDS = ((37, 64, 20), (1, 45), (16, 32), (5, 6), (8, 8), (250, 6), (2,) * 16)
    # host memory is pinned while the engine is idle (the driver holds every CUDA call of the
    # process while it pins: about 40 ms for a 64 MiB slab on an H200), and only once the engine
    # has been idle this long: a conversation's next turn, an agent's next call or the next burst
    # of a load comes within seconds of the last answer, and would otherwise wait for a slab
    IDLE_PIN_AFTER_S = 5.0

    def warm_up(self) -> None:
        """Run the kinds of step serving brings before the first request does (``WARM_UP_ROUNDS``).
        Triton compiles (and fla-core autotunes) each kernel variant on its first call, seconds
        each; here they come at start, not inside a user's time to first token. Leaves the pools
        as it found them."""
        from .sampling_params import SamplingParams

        limit = min(self.config.max_context - 4, self.config.prefill_chunk)
        count = 0
        for lengths in self.WARM_UP_ROUNDS:
            for n in lengths:
                n = max(1, min(n, limit))
                self.add_request(Request(f"warm-up-{count}", [count % self.token_limit] * n,
                                         SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                                         max_total_tokens=min(n + 4, self.config.max_context)))
                count += 1
            self.step()
        while self.has_work:
            self.step()
        if self.caches.prefix is not None:
            self.caches.prefix.clear()  # the warm-up's prompts are nobody's conversation
            self.caches.prefix.hits_gpu = self.caches.prefix.hits_host = 0
        self.scheduler.stats = type(self.scheduler.stats)()
        self.counters = self._new_counters()  # the warm-up is not the server's work
        if self.pace is not None:
            self.pace.reset()  # its steps compiled kernels
        while self.caches.grow_host():  # the host memory kept ahead of need, pinned before any request
            pass

    def close(self) -> None:
        """End what the engine holds outside its process: the other tensor-parallel ranks."""
        if self.runner.leader is not None:
            self.runner.leader.stop()
            self.runner.leader = None

    def _new_counters(self) -> EngineCounters:
        counters = EngineCounters()
        counters.spec_enabled = self.drafter is not None
        self.runner.counters = counters  # the runner counts the images it encodes there
        return counters

    def idle_work(self) -> bool:
        """Work for the time without steps (the loop calls it before it waits for a request,
        again while it returns True, which it does when it has done some): the checkpoints the
        last finished requests left beyond the table's size evicted; then a few more, until the
        table has room for a burst of new prompts' checkpoints (``CacheManager.trim``); or, once
        the engine has had no work for ``IDLE_PIN_AFTER_S``, a slab of host memory pinned ahead
        of need, where copies to host have taken some of what was kept ahead."""
        if self.caches.trim():  # what the last step's finished requests left beyond the table's size
            return True
        if self.caches.trim(ahead=True):  # room for the next burst's checkpoints, a few at a time
            return True
        if time.monotonic() - self.last_step < self.IDLE_PIN_AFTER_S:
            return False
        return self.caches.grow_host()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt must contain at least one token")
        if len(request.prompt_ids) >= request.max_total_tokens:
            raise ValueError(
                f"prompt has {len(request.prompt_ids)} tokens, the context limit is {request.max_total_tokens}"
            )
        ids, limit = request.prompt_ids, self.token_limit
        if min(ids) < 0 or max(ids) >= limit:  # builtins: a long prompt costs the engine thread little
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < limit)
            raise ValueError(f"prompt token at {bad} is out of range [0, {limit})")
        bias = request.params.logit_bias
        if bias and max(bias) >= limit:
            raise ValueError(f"logit_bias token id {max(bias)} is out of range [0, {limit})")
        if request.media is not None and self.model.vision_tower is None:
            raise ValueError("the request has images and the model runs without its vision tower (--vision)")
        if request.media is not None and request.media.length != len(ids):
            raise ValueError(f"the request's image positions cover {request.media.length} tokens of a "
                             f"{len(ids)}-token prompt")
        if request.request_id in self._processors:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        marks = request.checkpoints
        if marks is not None and any(not 0 < m <= len(ids) for m in marks):
            bad = next(m for m in marks if not 0 < m <= len(ids))
            raise ValueError(f"checkpoint position {bad} is outside the prompt's {len(ids)} tokens")
        if request.params.pooling is not None:  # embeddings: pooled from every prompt token
            request.pooled = Pooled(request.params.pooling)
        if self.caches.prefix is None or request.pooled is not None:
            request.checkpoints, request.checkpoint_answer = [], False  # no chunk is cut for one
        else:  # a prompt resent longer goes on from its end
            request.checkpoints = sorted(set(marks)) if marks is not None else [len(ids)]
            if request.forks and len(ids) > 1 and len(ids) - 1 not in request.checkpoints:
                bisect.insort(request.checkpoints, len(ids) - 1)  # where the other choices go on from
        request.generator = make_generator(request.params, self.device)
        self._processors[request.request_id] = OutputProcessor(
            self.tokenizer, request.params.stop, request.prompt_ids
        )
        if request.params.grammar is not None:  # scheduled once its grammar is compiled
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.token_limit)
            self._compiling.append((request, self.grammars.compile(request.params.grammar)))
            return
        self.scheduler.add(request)

    def _compiled(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar is compiled (a grammar that failed ends its
        request); when nothing else is there to run, wait a moment for one."""
        if not self._compiling:
            return []
        if not (self.scheduler.waiting or self.scheduler.running or self._ahead):
            wait([f for _, f in self._compiling], timeout=0.005, return_when=FIRST_COMPLETED)
        outputs, pending = [], []
        for req, future in self._compiling:
            if req.is_finished:  # aborted while it compiled
                continue
            if not future.done():
                pending.append((req, future))
                continue
            try:
                compiled = future.result()
            except GrammarError as exc:
                req.error_code = "invalid_grammar"
                outputs.append(self._finish(req, FinishReason.ERROR, None, "", error=str(exc)))
                continue
            stops = set(req.eos_ids) | set(req.params.stop_token_ids)
            if req.params.ignore_eos:
                stops = set(req.params.stop_token_ids)
            req.grammar = self.grammars.matcher(compiled, stops, active=req.params.thinking is None)
            self.scheduler.add(req)
        self._compiling = pending
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        for req in self.scheduler.running + self.scheduler.waiting + [r for r, _ in self._compiling]:
            if req.request_id == request_id:
                return self._finish(req, FinishReason.ABORT, None, "")
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._ahead or self._compiling)

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter() if self.pace is not None else 0.0
        try:
            return self._step()
        finally:
            if self.pace is not None:
                self._paced(start)
            self.last_step = time.monotonic()

    def _paced(self, start: float) -> None:
        """Show the pace the step read in this call (``_stepped``) and the gap its decoding
        requests saw: from the end of the step before it where this one followed at once (the
        host's work between them included), else from ``start``."""
        end = time.perf_counter()
        if self._stepped is not None:
            since = self._step_end if start - self._step_end < self.PACE_FOLLOWS_S else start
            self.pace.observe(*self._stepped, end - since)
        self._stepped, self._step_end = None, end

    def _step(self) -> list[RequestOutput]:
        outputs = [self._expire(r) for r in self.scheduler.expired()] + self._compiled()
        if self._ahead is not None:  # launched last step: its plan is this step's
            launched, self._ahead = self._ahead, None
            if self.pace is not None:
                self._stepped = (len(launched.plan), 0)
            # rows under a grammar: drawn now, the matchers having taken the last step's tokens,
            # while the device may still be running this step's forward
            self.runner.sample(launched)
        else:
            plan = self.scheduler.schedule()
            self.counters.scheduled(self.scheduler.admitted, plan)
            self.counters.spec_fallback_steps += self.scheduler.undrafted
            for r in self.scheduler.admitted:
                r.admitted_time = time.monotonic()
            outputs += [RequestOutput(r.request_id, admitted=True, prompt_tokens=len(r.prompt_ids),
                                      cached_tokens=r.cached_tokens, queue_time=r.admitted_time - r.arrival)
                        for r in self.scheduler.admitted]
            if not plan:
                return outputs
            if self.pace is not None:
                prompt = [n for r, n in plan if r.status is Status.PREFILL]
                self._stepped = (len(plan) - len(prompt), sum(prompt))
            launched = self.runner.launch(plan)
            self._checkpoint(plan)
        self._ahead = self._launch_ahead(launched)
        # checkpoints that finished requests left beyond the table's size go now, while the
        # device runs the step: their copies to host cost no step any wait (a device that runs
        # steps as they are launched, a CPU, leaves them to be taken when wanted or when idle)
        # a decode step (no prompt arriving) frees one more place of the table ahead of the next
        # burst, as the idle engine does a few at a time: a burst that follows a busy one finds
        # room for its prompts' checkpoints instead of moving others to host memory in its steps
        if self.overlap and not self.caches.trim() and launched.decode:
            self.caches.trim(ahead=True, most=1)
        tokens = launched.read()
        logprobs = launched.read_logprobs(tokens)
        outputs += self._progress(launched.plan, launched.ready)
        if launched.widths is not None:  # rows that verify drafts: their tokens and drafts together
            outputs += self._postprocess_runs(launched, tokens, logprobs)
        else:
            # a step launched ahead may carry requests that have finished since, or whose next
            # token was already known (forced tokens): what it sampled for them is dropped
            ready = [(r, t, lp) for r, t, lp, wanted in zip(launched.ready, tokens, logprobs,
                                                            launched.still_wanted()) if wanted]
            outputs += self._postprocess([r for r, _, _ in ready], [t for _, t, _ in ready],
                                         [lp for _, _, lp in ready])
        if launched.hidden is not None:  # the MTP head catches up on the kept positions and drafts
            self.drafter.after_step(launched.rows, launched.hidden)
            launched.hidden = None
        return outputs

    def _checkpoint(self, plan: list[tuple[Request, int]]) -> None:
        """Keep a prefix checkpoint for each request whose computed tokens just reached one of its
        ``checkpoints`` or a progress anchor (the copies are queued behind the step that computed
        them). A request keeps only its newest anchor: each one, and its prompt's checkpoints, make
        the one before it useless."""
        every = self.config.progress_anchor
        for req, n in plan:
            at = req.num_computed
            if req.draft and len(req.draft) + 1 == n:  # verifying a draft: where it ends is known after the read
                continue
            if at in req.checkpoints:
                kept = self.caches.checkpoint(req.cache, req.key_ids[:at])
                if kept is not None:
                    self.caches.drop(req.anchor)
                    req.anchor = None
            elif every and at % every == 0 and at < len(req.prompt_ids) and self.caches.prefix is not None:
                kept = self.caches.checkpoint(req.cache, req.key_ids[:at])
                if kept is not None:
                    kept.anchor = True
                    self.caches.drop(req.anchor)
                    req.anchor = kept

    def _launch_ahead(self, launched: Launched) -> Launched | None:
        """Launch the decode step that follows ``launched`` before its tokens are read, so the GPU
        goes on while the host reads, detokenizes and publishes. Only when the next step would be
        exactly that: a batched decode step of the same running requests, nobody waiting to be
        admitted, no sampling that needs the token history, no thinking budget about to force its
        close tokens, no request that may speculate (its draft is made from the token being read),
        and cache room for one more token. With rows under a grammar only the forward goes now: the
        next mask needs the tokens being read, so the step's tokens are drawn at the start of the
        next ``step`` (``ModelRunner.sample``)."""
        reqs = [r for r, wanted in zip(launched.ready, launched.still_wanted()) if wanted]
        if not (self.overlap and launched.decode and reqs) or self.scheduler.waiting:
            return None
        if self.drafter is not None and any(speculates(r) for r in reqs):
            return None  # its next step may verify a draft, which needs this step's tokens on the host
        if len(self.scheduler.running) != len(reqs) or \
                any(uses_history(r.params) or thinking.may_force_next(r) for r in reqs):
            return None
        if all(r.params.max_tokens is not None and len(r.output_ids) + 1 >= r.params.max_tokens for r in reqs):
            return None  # every one of them ends with the token being read
        if not all(r.num_computed + 1 <= r.max_total_tokens and self.caches.reserve(r.cache, r.num_computed + 1)
                   for r in reqs):
            return None
        self.counters.scheduled([], [(r, 1) for r in reqs])
        return self.runner.launch_next(launched, reqs)

    def _progress(self, plan: list[tuple[Request, int]], ready: list[Request]) -> list[RequestOutput]:
        """One output per prompt chunk that committed without finishing the prompt (first pass
        only: a request rebuilt by replay has reported its prompt already)."""
        done = {id(r) for r in ready}
        return [RequestOutput(r.request_id, prompt_tokens=len(r.prompt_ids), prompt_processed=r.num_computed)
                for r, _ in plan
                if id(r) not in done and r.first_token_time is None and r.num_computed <= len(r.prompt_ids)]

    def _postprocess(self, reqs: list[Request], tokens: list[int],
                     logprobs: list[TokenLogprob | None]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for req, token, logprob in zip(reqs, tokens, logprobs):
            if req.status is Status.PREFILL:
                req.status = Status.DECODE
                if req.prefill_done_time is None:
                    req.prefill_done_time = now
                if req.params.max_tokens == 0:  # prompt only
                    outputs.append(self._finish(req, FinishReason.LENGTH, None, ""))
                    continue
            if req.first_token_time is None:
                req.first_token_time = now
            try:
                outputs.append(self._append_token(req, token, logprob))
            except Exception as exc:  # noqa: BLE001 - this request's own text handling: it alone ends
                outputs.append(self._fail(req, exc))
        return outputs

    def _postprocess_runs(self, launched: Launched, tokens: list[int],
                          logprobs: list[TokenLogprob | None]) -> list[RequestOutput]:
        """``_postprocess`` for a step with rows that verify drafts (never launched ahead):
        each such row's tokens go to ``_verify``, the others as one token each."""
        outputs, at = [], 0
        for req, width, draft in zip(launched.ready, launched.widths, launched.drafts):
            run, lps = tokens[at : at + width], logprobs[at : at + width]
            at += width
            if width == 1:
                outputs += self._postprocess([req], run, lps)
                continue
            try:
                outputs.append(self._verify(req, run, draft, lps, launched.verify,
                                            launched.gen_states.get(id(req)), launched.vocab))
            except Exception as exc:  # noqa: BLE001 - as in _postprocess: this request alone ends
                outputs.append(self._fail(req, exc))
        return outputs

    def _verify(self, req: Request, targets: list[int], draft: list[int],
                logprobs: list[TokenLogprob | None], states=None, gen_state: torch.Tensor | None = None,
                vocab: int = 0) -> RequestOutput:
        """Commit what a verified draft gives: the drafts the model's own tokens (``targets``, one
        per position run) confirm, then the model's token after them, one at a time through
        ``_append_token`` (so stop tokens and strings, ``max_tokens``, the context limit and the
        thinking budget end or change the run exactly where one-token steps would); the KV of the
        positions past what is kept is dropped by setting ``num_computed`` back, and in a hybrid
        model the Gated DeltaNet states after the last position kept (``states``, the step's
        ``VerifyRows``) go back in the request's slot (``_settle_states``: before any checkpoint
        of the request is taken, at the latest when this returns). A sampled request's generator
        (``gen_state``: before the row's draws) is left as if only the tokens committed had been
        drawn, one each (``Sampler.replay``): its stream goes on as in one-token steps."""
        start = req.num_computed - len(draft) - 1  # where the row began: its last sampled token
        if states is not None:
            req.verify_states = (states, start)
        drawn = [0]
        try:
            return self._commit_round(req, start, targets, draft, logprobs, drawn)
        finally:
            self._settle_states(req)
            if gen_state is not None and not req.is_finished:
                self.runner.sampler.replay(req, gen_state, drawn[0], vocab)

    def _settle_states(self, req: Request) -> None:
        """Put the recurrent states of ``req``'s last verify row at its ``num_computed`` in its slot."""
        pending, req.verify_states = req.verify_states, None
        if pending is None or req.is_finished or req.cache is None or req.cache.slot is None:
            return  # (a finished request settled before its checkpoint, if it kept one)
        states, start = pending
        states.commit(self.caches.states, req, req.cache.slot, req.num_computed - start - 1)

    def _commit_round(self, req: Request, start: int, targets: list[int], draft: list[int],
                      logprobs: list[TokenLogprob | None], drawn: list[int]) -> RequestOutput:
        """``_verify``'s commit of the tokens a round gives (``drawn[0]``: how many of the row's
        sampled tokens were committed)."""
        kept = accepted(targets, draft)
        req.draft = []
        req.spec_drafted += len(draft)
        req.spec_accepted += kept
        if self.drafter is not None:
            self.drafter.adapt(req, len(draft), kept)
        c = self.counters
        c.spec_rounds += 1
        c.spec_draft_tokens += len(draft)
        c.spec_accepted_tokens += kept
        if kept:
            by = list(c.spec_accepted_by_position) + [0] * (kept - len(c.spec_accepted_by_position))
            c.spec_accepted_by_position = tuple(n + (i < kept) for i, n in enumerate(by))
        out = None
        for i in range(kept + 1):
            # computed: what precedes the token committed now (a request that finishes with it
            # keeps a checkpoint of no more than that)
            req.num_computed = start + 1 + i
            drawn[0] = i + 1
            before = len(req.output_ids)
            more = self._append_token(req, targets[i], logprobs[i])
            out = more if out is None else merge_outputs(out, more)
            if req.is_finished:
                return out
            if len(req.output_ids) - before > 1:  # forced tokens follow it: the drafts after it are moot
                req.num_computed += i < kept  # this token was a draft, its KV computed
                return out
        return out

    def _fail(self, req: Request, exc: Exception) -> RequestOutput:
        """End one request whose output handling (detokenizing, stop strings, thinking budget)
        raised; the engine and every other request go on. The log names the request and where it
        failed, never the exception's message (it may quote the request's text)."""
        log.error("request %s failed in postprocessing (%s):\n%s", req.request_id, type(exc).__name__,
                  "".join(traceback.format_tb(exc.__traceback__)).rstrip())
        req.error_code = "internal_error"
        return self._finish(req, FinishReason.ERROR, None, "",
                            error=f"the server failed to process this request's output ({type(exc).__name__})")

    def _append_token(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        params = req.params
        processor = self._processors[req.request_id]
        first, text, pending = len(req.output_ids), "", [token]
        # one per committed token when the request asks: the sampled token's, then forced ones'
        logprobs = None if params.logprobs is None else [logprob or TokenLogprob(token, 0.0)]
        sampled = True
        while pending:  # the sampled token, then any that the thinking budget forces after it
            token = pending.pop(0)
            req.output_ids.append(token)
            if logprobs is not None and len(logprobs) < len(req.output_ids) - first:
                logprobs.append(TokenLogprob(token, 0.0))
            self.counters.committed(req)
            pending += thinking.account(req, token)
            if req.grammar is not None:
                if req.grammar.active:
                    if sampled:  # what the budget forces after the close (its blank lines) is the close's
                        req.grammar.accept(token)
                elif req.thinking is not None and not req.thinking.open:
                    req.grammar.active = True  # the grammar holds from the first token drawn after the close
            sampled = False
            out = None
            if (token in req.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
                out = self._finish(req, FinishReason.STOP, token, text + processor.flush())
            else:
                piece, matched = processor.push(token)
                text += piece
                hit_max = params.max_tokens is not None and len(req.output_ids) >= params.max_tokens
                if matched is not None:
                    out = self._finish(req, FinishReason.STOP, matched, text)
                elif thinking.stops(req):  # its reasoning repeated itself (--reasoning-loop stop)
                    out = self._finish(req, FinishReason.STOP, None, text + processor.flush())
                elif hit_max or req.num_tokens >= req.max_total_tokens:
                    out = self._finish(req, FinishReason.LENGTH, None, text + processor.flush())
            if out is not None:
                out.token_ids = req.output_ids[first:]
                out.logprobs = logprobs
                return out
        return RequestOutput(req.request_id, text=text, token_ids=req.output_ids[first:], logprobs=logprobs,
                             prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                             reasoning_tokens=thinking.reasoning_tokens(req))

    def _expire(self, req: Request) -> RequestOutput:
        req.error_code = "request_queue_timeout"
        return self._finish(req, FinishReason.ERROR, None, "",
                            error=f"request was not admitted within {self.config.pending_timeout_s:g} s")

    def _finish(self, req: Request, reason: FinishReason, stop_reason, text: str,
                error: str | None = None) -> RequestOutput:
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and req.cache is not None:
            self._settle_states(req)  # a verify row's: the checkpoint below copies the slot
            if req.checkpoint_answer and req.output_ids and req.num_computed > len(req.prompt_ids):
                # where the answer ends (all but its last token computed, or all when a step
                # launched ahead ran it): queued behind every step that wrote this sequence
                self.caches.checkpoint(req.cache, req.key_ids[: req.num_computed], last=True)
            self.caches.drop(req.anchor)  # its prompt is done: nobody resumes from part of it
            req.anchor = None
        self.scheduler.remove(req)
        self.runner.sampler.release(req)
        req.finish(reason, stop_reason)
        self._processors.pop(req.request_id, None)
        self.counters.finished(req)
        prefill_end = req.prefill_done_time
        token_ids = [req.output_ids[-1]] if req.output_ids and reason is not FinishReason.ABORT else []
        done = req.pooled is not None and reason is FinishReason.LENGTH and req.num_computed >= len(req.prompt_ids)
        return RequestOutput(
            req.request_id,
            text=text,
            token_ids=token_ids,
            finished=True,
            finish_reason=reason.value,
            stop_reason=req.stop_reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            reuse=req.reuse,
            completion_tokens=len(req.output_ids),
            reasoning_tokens=thinking.reasoning_tokens(req),
            reasoning_loop=thinking.looped(req),
            embedding=req.pooled.result() if done else None,
            error=error,
            error_code=req.error_code,
            prefill_time=None if prefill_end is None else prefill_end - (req.admitted_time or req.arrival),
            decode_time=None if prefill_end is None else (req.finish_time or prefill_end) - prefill_end,
            draft_tokens=req.spec_drafted,
            draft_accepted=req.spec_accepted,
        )
