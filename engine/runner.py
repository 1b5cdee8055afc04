"""The Runner: turns a step's plan into one model forward and the sampled tokens.

It owns the physical side of a step (input tensors, the forward, logits, sampling). The engine
decides what runs; the runner decides how. Every step is one forward over the shared pools,
described by one flat ``StepMeta`` (``step.py``): decode rows and prompt chunks of several
requests together. A step of decode rows only is replayed from a CUDA graph when one was captured
for its batch size; every other step runs eagerly, batched all the same.

A step is *launched* (``launch``) and its tokens *read* later (``Launched.read``): the tokens stay
on the device until then, so the next decode step can be launched from them (``launch_next``)
while the host is still busy with this one's. A step launched ahead with rows under a grammar
runs its forward at once but draws its tokens only when ``sample`` is called: by then the host
has read the step before, moved the matchers on by its tokens and can fill the masks, while the
device is still running the forward.
"""
from __future__ import annotations

import torch

from . import launch
from .cache.manager import CacheManager
from .models.base import CausalLM, VerifyRows
from .request import Request
from .outputs import TokenLogprob
from .sampler import Sampler, StepLogprobs
from .step import build_step, index_on


class Launched:
    """A step on its way: the requests that reach their next token, and those tokens (and the
    log-probabilities of the rows that ask for them), still on the device (copied towards pinned
    host memory behind an event on CUDA). ``pending``: the logits (and the graph's argmax) of a
    step whose tokens are not drawn yet (``ModelRunner.sample``)."""

    def __init__(self, plan: list[tuple[Request, int]], ready: list[Request], decode: bool,
                 widths: list[int] | None = None) -> None:
        self.plan = plan
        self.ready = ready
        # per ready request, its tokens in ``tokens``: 1, or 1 + k where it verifies a draft of k
        # (``drafts``: those k, as they were run); None: one each
        self.widths = widths
        self.drafts = None if widths is None else [r.draft[: w - 1] for r, w in zip(ready, widths)]
        # where each (first) sampled token goes in its sequence
        self.slots = [r.num_computed - (w - 1) for r, w in zip(ready, widths or [1] * len(ready))]
        self.tokens: torch.Tensor | None = None
        self.decode = decode  # a batched decode step (the only kind a next step can follow on the device)
        self.in_place = False  # the tokens are where a captured graph reads its next input ids
        self.logprobs: StepLogprobs | None = None
        self.pending: tuple[torch.Tensor, torch.Tensor | None] | None = None
        # with ``ModelRunner.keep_hidden`` (the MTP head's input): the step's final hidden states and
        # its rows ``(request, first position, tokens, first flat row)``
        self.hidden: torch.Tensor | None = None
        self.rows: list[tuple[Request, int, int, int]] = []
        # a verify step's sampled rows: each request's generator state before the draw, and the
        # width of the logits drawn over (``Sampler.replay``)
        self.gen_states: dict[int, torch.Tensor] = {}
        self.vocab = 0
        self.verify = None  # the step's VerifyRows (models/base.py), where rows verify drafts in a hybrid model
        self._host = None
        self._host_logprobs = None
        self._event = None

    def drawn(self, tokens: torch.Tensor, host: torch.Tensor | None = None, in_place: bool = False,
              logprobs: StepLogprobs | None = None, host_logprobs: torch.Tensor | None = None) -> None:
        """The step's tokens (and log-probability table) are on their way: copied towards ``host``
        (pinned) behind an event on CUDA."""
        self.tokens, self.in_place, self.logprobs, self.pending = tokens, in_place, logprobs, None
        if host is not None:
            self._host = host[: tokens.shape[0]]
            self._host.copy_(tokens, non_blocking=True)
            if logprobs is not None:
                rows, width = logprobs.table.shape
                self._host_logprobs = host_logprobs[: rows * width].view(rows, width)
                self._host_logprobs.copy_(logprobs.table, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def still_wanted(self) -> list[bool]:
        """Per ready request: whether its sampled token is still its next one (not when it has
        finished since the launch, or a forced token has taken that place)."""
        return [not r.is_finished and r.num_tokens == slot for r, slot in zip(self.ready, self.slots)]

    def read(self) -> list[int]:
        """The sampled tokens (a verifying row's ``1 + k`` in a run), waiting for this step only
        (not for steps launched after it)."""
        if self.pending is not None:
            raise RuntimeError("a step's tokens are read before they are drawn (ModelRunner.sample)")
        if self.tokens is None:
            return []
        if self._event is None:
            return self.tokens.tolist()
        self._event.synchronize()
        return self._host.tolist()

    def read_logprobs(self, tokens: list[int]) -> list[TokenLogprob | None]:
        """Per ready request, its token's log-probabilities, or None where it did not ask
        (``tokens``: what ``read`` returned, after which they are on the host)."""
        if self.logprobs is None:
            return [None] * len(tokens)
        table = self.logprobs.table if self._host_logprobs is None else self._host_logprobs
        return self.logprobs.unpack(table.tolist(), tokens)


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, caches: CacheManager,
                 vocab: int | None = None, max_rows: int = 8) -> None:
        self.model = model
        self.device = device
        self.caches = caches
        # ids the sampler may pick: the first ``vocab`` logits (a checkpoint's LM head may have
        # rows past its tokenizer's last id; None = every row)
        self.vocab = vocab
        self.threads: StepThreads | None = None  # the CPU's threads per step (StepThreads.configure)
        self.sampler = Sampler(device, max_rows)
        self.graphs = None  # CudaGraphDecoder, when captured
        self.verify_graphs = None  # CudaGraphVerifier (steps of decode and verify rows), when captured
        self.mixed_graphs = None  # MixedGraphs (steps with prompt rows, in pieces), when captured
        # the Gated DeltaNet states after each verified position (``VerifyRows``): one pair of
        # buffers for every verify step, eager or captured, grown as a step needs
        self._verify_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        # every step eager, its final hidden states kept on its ``Launched`` (``--spec mtp``)
        self.keep_hidden = False
        self._pinned: list[torch.Tensor] = []  # two token read-back buffers, used in turn
        self._pinned_logprobs: list[torch.Tensor] = []  # and two for log-probability tables
        self._turn = 0
        self.counters = None  # the engine's EngineCounters: images run through the vision tower are counted there
        # under tensor parallelism, rank 0's ``tp_steps.Leader``: each step's description goes to
        # the other ranks before its forward
        self.leader = None

    def enable_cuda_graphs(self, max_batch: int, max_context: int, verify_width: int = 0) -> None:
        """Capture decode steps, and with ``verify_width`` > 1 (and the launch setting
        ``verify_in_graph``) steps of decode and verify rows of up to that many positions each.
        (Steps with prompt rows take graphs in pieces, captured before the caches:
        ``cuda_graph_mixed.capture_pieces``.)"""
        from .cuda_graphs import CudaGraphDecoder

        self.graphs = CudaGraphDecoder(self.model, self.caches, max_batch, max_context, self.device, self.vocab)
        self.graphs.capture()
        if verify_width > 1 and launch.current().verify_in_graph:
            from .cuda_graph_verify import CudaGraphVerifier

            self.verify_graphs = CudaGraphVerifier(self.model, self.caches, self.graphs.buckets, verify_width,
                                                   max_context, self.device, self.vocab,
                                                   self.verify_buffers(max_batch * verify_width))
            self.verify_graphs.capture(self.graphs.pool)

    def verify_buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verify buffers (``VerifyRows``), of at least ``rows`` positions; None without
        recurrent layers."""
        states = self.caches.states
        if states is None:
            return None
        if self._verify_buffers is None or self._verify_buffers[0].shape[1] < rows:
            self._verify_buffers = VerifyRows.allocate(states, rows)
        return self._verify_buffers

    def execute(self, plan: list[tuple[Request, int]]) -> tuple[list[Request], list[int]]:
        """Run ``n`` new tokens for each ``(request, n)``; advance ``num_computed``; return the
        requests that reached their next token and the tokens sampled for them."""
        step = self.launch(plan)
        return step.ready, step.read()

    def launch(self, plan: list[tuple[Request, int]]) -> Launched:
        """``execute`` without reading the tokens back."""
        with torch.inference_mode():
            reqs = [r for r, _ in plan]
            if all(n == 1 for _, n in plan) and all(r.decode_ready for r in reqs) and not self.keep_hidden:
                return self._launch_decode(plan, reqs, None)
            if self.verify_graphs is not None and not self.keep_hidden and self.verify_graphs.fits(plan):
                return self._launch_verify(plan, reqs)
            return self._launch_step(plan)

    def launch_next(self, prev: Launched, reqs: list[Request]) -> Launched:
        """The decode step after ``prev`` (a batched decode step) for ``reqs``, all of them in
        ``prev.ready``: each one's input is the token ``prev`` sampled for it, taken on the device,
        before the host has read it. The caller has reserved cache room for one more token. When
        a row has a grammar its tokens are drawn later (``sample``), after ``prev``'s have been
        read and taken by the matchers."""
        if prev.pending is not None:
            raise RuntimeError("a step is launched after one whose tokens are not drawn yet")
        rows = [i for i, r in enumerate(prev.ready) if any(r is q for q in reqs)]
        whole = len(rows) == len(prev.ready)
        ids = prev.tokens if whole else prev.tokens[index_on(rows, self.device)]  # (no wait for the device)
        with torch.inference_mode():
            return self._launch_decode([(r, 1) for r in reqs], reqs, ids, follow=whole and prev.in_place,
                                       defer=any(r.grammar is not None for r in reqs))

    def _launch_decode(self, plan, reqs: list[Request], ids: torch.Tensor | None, follow: bool = False,
                       defer: bool = False) -> Launched:
        logits, greedy = self._decode(reqs, ids, follow)
        for r in reqs:
            r.num_computed += 1
        return self._launched(plan, reqs, logits, decode=True, greedy=greedy, defer=defer)

    def _launch_verify(self, plan, reqs: list[Request]) -> Launched:
        """A step of decode and verify rows only, replayed from a captured graph
        (``cuda_graph_verify.py``); the states of a row without a draft go into its slot at once."""
        logits, verify = self.verify_graphs.run(plan)
        for r, n in plan:
            r.num_computed += n
            if n == 1 and verify is not None:
                verify.commit(self.caches.states, r, r.cache.slot, 0)
        launched = self._launched(plan, reqs, logits, decode=False, widths=[n for _, n in plan])
        launched.verify = verify
        return launched

    def _launched(self, plan, ready: list[Request], logits: torch.Tensor | None, decode: bool,
                  greedy: torch.Tensor | None = None, defer: bool = False,
                  widths: list[int] | None = None) -> Launched:
        launched = Launched(plan, ready, decode, widths)
        if ready:
            launched.pending = (logits, greedy)
            if not defer:
                self.sample(launched)
        return launched

    def sample(self, launched: Launched) -> None:
        """Draw the tokens of a launched step (its logits still on the device) and start their way
        to the host; nothing when they are drawn already."""
        if launched.pending is None:
            return
        (logits, greedy), ready = launched.pending, launched.ready
        rows = ready if launched.widths is None else [r for r, w in zip(ready, launched.widths) for _ in range(w)]
        if launched.widths is not None:  # a sampled verify row draws 1 + k times; the engine keeps what it uses
            launched.vocab = logits.shape[-1]
            launched.gen_states = {id(r): r.generator.get_state() for r, w in zip(ready, launched.widths)
                                   if w > 1 and r.generator is not None}
        # in inference mode throughout: a deferred draw (rows under a grammar) comes from outside
        # ``launch``, and the read-back buffers were made inside it
        with torch.inference_mode():
            tokens = self.sampler.sample(logits, rows, greedy)
            logprobs = self.sampler.logprobs(logits, rows, tokens)
            host = self._readback(len(rows))
            host_logprobs = None if logprobs is None or host is None else self._readback_logprobs(logprobs.table.numel())
            launched.drawn(tokens, host, in_place=greedy is not None and tokens is greedy, logprobs=logprobs,
                           host_logprobs=host_logprobs)

    def _readback(self, n: int) -> torch.Tensor | None:
        """A pinned buffer for ``n`` tokens; two alternate, so a step's read-back never overwrites
        the one of the step before it that may still be on its way."""
        if self.device.type != "cuda":
            return None
        if not self._pinned or self._pinned[0].numel() < n:
            size = max(n, 64)
            self._pinned = [torch.empty(size, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._turn ^= 1
        return self._pinned[self._turn]

    def _readback_logprobs(self, n: int) -> torch.Tensor:
        """A pinned fp32 buffer of ``n`` values for a log-probability table, alternating as
        ``_readback``'s do (taken only by steps with rows that ask for them)."""
        if not self._pinned_logprobs or self._pinned_logprobs[0].numel() < n:
            size = max(n, 4096)
            self._pinned_logprobs = [torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        return self._pinned_logprobs[self._turn]

    def _decode(self, reqs: list[Request], ids: torch.Tensor | None,
                follow: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of one decode token per request, and their argmax where a captured graph took
        it; ``follow``: ``ids`` are already the graph's input ids (``CudaGraphDecoder.run``)."""
        if self.graphs is not None and self.graphs.fits(reqs):
            return self.graphs.run(reqs, ids, follow)
        step = build_step([(r, 1) for r in reqs], self.caches, self.device, ids)
        return sampled_logits(self.model, self._forward(step, ...), self.vocab), None

    def _forward(self, step, sample_index) -> torch.Tensor:
        """The model's forward over ``step`` (the other ranks told first, under tensor parallelism,
        with the rows whose logits are taken after it: flat indices, ``...`` for every row, None
        for none)."""
        if self.leader is not None:
            self.leader.send(step.input_ids, step.batch, sample_index)
        if self.threads is not None:
            self.threads.take(step.input_ids.shape[0])
        return self.model(step.input_ids, step.batch)

    def _launch_step(self, plan: list[tuple[Request, int]]) -> Launched:
        """Any step, eager: one forward over every row, the logits of the rows that reach their
        next token only (of every position of a row that verifies a draft); embedding requests' hidden rows to their ``Pooled`` (an embedding
        request never decodes, so it is never in a decode step)."""
        self._encode_images(plan)
        step = build_step(plan, self.caches, self.device)
        verify = step.batch.step.verify
        if verify is not None:
            verify.conv, verify.recurrent = self.verify_buffers(verify.positions)
        if self._in_pieces(step):
            hidden = self.mixed_graphs.run(step.input_ids, step.batch)
        else:
            hidden = self._forward(step, step.sample_index if step.sampled else None)
        at, rows = 0, []
        for req, n in step.plan:
            rows.append((req, req.num_computed, n, at))
            if req.pooled is not None:  # an embedding request keeps its rows' final hidden states
                req.pooled.add(hidden[at : at + n], req.num_computed)
            at += n
            req.num_computed += n
            if req.media is not None:  # an image wholly computed needs its embeddings no more
                for im in req.media.images:
                    if im.end <= req.num_computed:
                        im.embeds = None
        logits = sampled_logits(self.model, hidden[step.sample_index], self.vocab) if step.sampled else None
        launched = self._launched(plan, step.sampled, logits, decode=False, widths=step.widths)
        launched.verify = step.batch.step.verify
        if self.keep_hidden:
            launched.hidden, launched.rows = hidden, rows
        return launched

    def _in_pieces(self, step) -> bool:
        """Whether a step runs through the captured pieces (``cuda_graph_mixed.py``): not where
        its final hidden states outlive it (an embedding request's; the MTP head reads them
        before the next step) or other ranks follow its forward."""
        return (self.mixed_graphs is not None and self.leader is None
                and all(r.pooled is None for r, _ in step.plan)
                and self.mixed_graphs.fits(step.batch, step.input_ids.shape[0]))

    def _encode_images(self, plan: list[tuple[Request, int]]) -> None:
        """Run the vision tower over each image whose tokens this step computes and that has no
        embeddings yet (an image split over chunks is encoded once, with its first chunk)."""
        for req, n in plan:
            if req.media is None:
                continue
            for im in req.media.overlapping(req.num_computed, req.num_computed + n):
                if im.embeds is None:
                    tower = self.model.vision_tower
                    if tower is None:
                        raise RuntimeError("a request with images, and the model has no vision tower (--vision)")
                    im.embeds = tower.encode(im.image)
                    req.media.encoded += 1
                    if self.counters is not None:
                        self.counters.images_encoded += 1


def sampled_logits(model: CausalLM, hidden: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """The logits ``[n, vocab]`` tokens are chosen from: the LM head's first ``vocab`` columns, a
    view (no copy), so no sampling path, the greedy argmax in a captured graph included, can
    pick an id the tokenizer cannot decode."""
    logits = model.compute_logits(hidden)
    return logits if vocab is None or logits.shape[-1] <= vocab else logits[:, :vocab]


class StepThreads:
    """torch's intra-op threads per CPU step: ``one_token`` for a step of one token, every
    thread the process has for the others (``EngineConfig.cpu_threads_one_token``), switched only
    when the kind of step changes."""

    def __init__(self, one_token: int) -> None:
        self.full = torch.get_num_threads()
        self.one_token = one_token
        self.current = self.full

    @classmethod
    def configure(cls, device: torch.device, one_token: int) -> "StepThreads | None":
        """None where every step keeps the process's threads (off the CPU, or not fewer)."""
        if device.type != "cpu" or not 0 < one_token < torch.get_num_threads():
            return None
        return cls(one_token)

    def take(self, tokens: int) -> None:
        want = self.one_token if tokens == 1 else self.full
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
