"""Decode and prefill throughput against the hardware limit, with HF transformers as the peer.

    python -m bench.decode --shape qwen3.5-27b [--shape ...] [--batches 1,8,32] [--context 4096]
                           [--prefill 512,16384] [--steps 32] [--beside 8] [--no-hf] [--json FILE]
                           [--set attention_max_splits=32 ...] [--weights bf16|int8|int4]
                           [--verify 4]

Random bf16 weights at the real shape are made directly on the GPU (no checkpoint); ``--weights
int4`` / ``int8`` then holds them as the server's ``--weights`` does. The run first
measures the card's copy bandwidth and bf16 matmul rate, then for each shape: decode tok/s at each
batch size with ``--context`` tokens already in the cache, prefill tok/s for each prompt length,
the bytes one decode step must stream (weights + GDN state + KV) and the percentage of the
bandwidth floor reached; with ``--verify K``, at each batch size the step in which every request
checks a draft (a row of ``K`` tokens against its cached context: its last token and ``K - 1``
drafts that random weights reject, so every step verifies a full row), its time beside the plain
decode step's, and the tok/s a speculative round would give at the published acceptance; with
``--beside N``, each prompt again while N requests decode beside it
(its prefill tok/s, and the decoders' gap between tokens with and without it); then the same work
through HF transformers (+ fla-core). It prints a
table and writes JSON. ``--set`` changes a kernel launch setting (``engine/launch.py``), or one
entry of a table setting (``NAME[KEY]=VALUE``), to a Python literal of the same type before
anything is built, so one GPU call can time a step with and without a launch choice; the changes
are printed and kept in the JSON.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import time

import numpy as np
import torch

from ninfer.engine import launch
from ninfer.engine.request import Request, Status
from ninfer.engine.spec import Drafter

from .gpu_env import back_to_back_ms, measure_ceilings
from .shapes import SHAPES, shape_config

DTYPE = torch.bfloat16


class NullTokenizer:
    """Token ids only: the bench measures the engine, not text; every id of the model's
    vocabulary decodes (to one character: text that never completes would make the detokenizer
    hold every token and decode the whole answer again at each one)."""

    bos_token = eos_token = None
    bos_token_id = eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text):
        return []

    def decode(self, ids):
        return "x" * len(ids)  # a character a token: the detokenizer emits each at once, as with real text

    def token_to_id(self, token):
        return None


class RejectedDrafter(Drafter):
    """Drafts of as many copies of token 0 as a request may take: a model of random weights
    almost never agrees, so each step verifies a full row and commits one token."""

    def __init__(self, draft_tokens: int) -> None:
        super().__init__(draft_tokens, 1, 1)

    def propose(self, req: Request) -> list[int]:
        return [0] * self.room(req) if self.eligible(req) else []  # full rows: no adapting to the misses


# Accepted tokens per round that Qwen3.6-27B's MTP head is published at, by drafts per round
PUBLISHED_ACCEPTANCE = {1: 1.9, 2: 2.4, 3: 2.8}


def randomize_(model: torch.nn.Module) -> None:
    """Small random weights everywhere (a fresh ``build_model`` holds uninitialised memory)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(0.0, 2.0, generator=gen)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def bytes_per_step(cfg, batch: int, context: int, weight_bytes: float | None = None) -> float:
    """Fewest bytes one decode step streams: weights read once (active experts only, per token
    for MoE; ``weight_bytes`` where the model holds them otherwise than bf16), GDN state read +
    written and KV read for every sequence."""
    elt = 2
    h, v = cfg.hidden_size, cfg.vocab_size
    attn = sum(t == "full_attention" for t in cfg.layer_types)
    gdn = cfg.num_hidden_layers - attn
    q_out = cfg.num_attention_heads * cfg.head_dim
    attn_params = h * (2 * q_out) + 2 * h * cfg.num_key_value_heads * cfg.head_dim + q_out * h
    kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    vd = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    gdn_params = h * (2 * kd + vd) + h * vd + 2 * h * cfg.linear_num_value_heads + vd * h + (2 * kd + vd) * 4
    if cfg.is_moe:
        per_expert = 3 * h * cfg.moe_intermediate_size
        experts = min(cfg.num_experts, batch * cfg.num_experts_per_tok)
        mlp = experts * per_expert + 3 * h * cfg.shared_expert_intermediate_size + h * cfg.num_experts
    else:
        mlp = 3 * h * cfg.intermediate_size
    weights = (attn * attn_params + gdn * gdn_params + cfg.num_hidden_layers * mlp + v * h) * elt
    if weight_bytes is not None:
        weights = weight_bytes
    state = batch * gdn * 2 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    kv = batch * context * attn * 2 * cfg.num_key_value_heads * cfg.head_dim * elt
    return weights + state + kv


BESIDE_REPS = 8  # prompts timed one after another beside the decoders
PREFILL_REPS, PREFILL_REPS_UP_TO = 3, 16384  # prompts up to this long are timed this many times (the median)


def quantize_(model: torch.nn.Module, bits: int) -> None:
    """Every projection (``Linear``) and the MoE experts held ``bits``-bit and the LM head 8-bit,
    as ``--weights int4`` loads them on the GPU (``loader.quantized_at_load``)."""
    from ninfer.engine.layers.embedding import LMHead
    from ninfer.engine.layers.linear import Linear, method_fits, quantize_rtn
    from ninfer.engine.layers.moe import FusedExperts, QuantizedExperts

    for name, mod in model.named_modules():
        if isinstance(mod, FusedExperts):  # both matrices, over each one's E * N rows
            for attr in mod.QUANTIZED:
                dense = getattr(mod, attr)
                q = quantize_rtn(dense.detach().reshape(-1, dense.shape[-1]), bits)
                if q is None or not QuantizedExperts.fits(q, mod.num_experts, dense.device):
                    break
                mod.take_quantized(f"{name}.{attr}", q)
            continue
        head = isinstance(mod, LMHead) and not mod.tied
        if (isinstance(mod, Linear) or head) and mod.weight is not None:
            q = quantize_rtn(mod.weight.detach(), 8 if head else bits)
            if q is not None and method_fits(q, mod.weight.device):
                mod.take_quantized(name + ".weight", q)
    torch.cuda.empty_cache()


def streamed_weight_bytes(model: torch.nn.Module, batch: int = 1) -> int:
    """Bytes of the weights a decode step of ``batch`` tokens reads: every parameter and held
    buffer but the token embedding (a step reads its rows only) and the state caches (each
    storage once: fused projections' parts are views), the MoE
    experts' (dense or held) as the share ``min(E, batch * k) / E`` of them a step's routing reads."""
    from ninfer.engine.layers.moe import FusedExperts

    cfg = getattr(model, "config", None)
    tied = getattr(cfg, "tie_word_embeddings", False)
    skip = set() if tied else {id(t) for n, m in model.named_modules() if n.endswith("embed_tokens")
                               for t in m.parameters()}
    experts = {id(t) for m in model.modules() if isinstance(m, FusedExperts)
               for t in list(m.parameters()) + list(m.buffers())}
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in skip}
    # a fused projection's parts are views of its tensors (``fused_linear.fuse_linears``,
    # ``linear.fuse_methods``): each storage counts once, whole
    size, expert = {}, set()
    for i, t in tensors.items():
        s = t.untyped_storage()
        size[s.data_ptr()] = s.nbytes()
        if i in experts:
            expert.add(s.data_ptr())
    held = sum(size[p] for p in expert)
    other = sum(size.values()) - held
    share = min(cfg.num_experts, batch * cfg.num_experts_per_tok) / cfg.num_experts if held else 0.0
    return other + int(held * share)


def _engine(cfg, max_batch: int, context: int, steps: int, prefill_max: int, device: str = "cuda",
            prefill_chunk: int | None = None, beside: int = 0, bits: int | None = None, verify: int = 0,
            decode_gap: float = 0.0):
    from ninfer.engine.engine import LLMEngine
    from ninfer.engine.engine_config import EngineConfig
    from ninfer.engine.models.registry import build_model

    from ninfer.engine.layers.fused_linear import fuse_model_projections

    dtype = DTYPE if device == "cuda" else torch.float32
    model = build_model(cfg, dtype=dtype, device=device)
    randomize_(model)
    if bits is not None:
        quantize_(model, bits)
    fuse_model_projections(model)
    out = (steps + max_batch) * max(verify, 1)  # a request also decodes while the later ones are prefilled
    chunk = prefill_chunk or max(prefill_max, 2048)
    if beside:  # decoders go on through the steps of every prompt prefilled beside them
        out += _beside_tokens(steps, prefill_max, chunk)
    max_ctx = max(context + out + 96, prefill_max + 16)
    ecfg = EngineConfig(max_context=max_ctx, max_concurrency=max_batch + (beside > 0), prefill_chunk=chunk,
                        kv_capacity=max_batch * (context + out + 32) + max_ctx, page_size=16,
                        host_cache_mib=0, device=device, dtype=dtype, decode_gap=decode_gap,
                        **({"spec": "ngram", "draft_tokens": verify - 1} if verify > 1 else {}))
    engine = LLMEngine(model, NullTokenizer(cfg.vocab_size), ecfg)
    use_drafter(engine, None)  # plain decode steps unless a verify run draws
    return engine


def use_drafter(engine, drafter: Drafter | None) -> None:
    """Let ``engine`` (built with a ``spec`` setting when ``drafter`` is given) draft with
    ``drafter``, or not at all."""
    engine.drafter = engine.scheduler.drafter = drafter


def _requests(n: int, prompt_len: int, max_tokens: int, vocab: int, tag: str, limit: int):
    """``n`` greedy requests of random prompts. Decoding ones need ``max_tokens`` >= the steps
    timed plus ``n``: the first decodes while the later ones are prefilled, one prompt a step."""
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(1)
    return [Request(f"{tag}{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    max_total_tokens=limit) for i in range(n)]


def _graph_ms(engine, reqs) -> float | None:
    """GPU time of one captured decode step alone (no scheduling, sampling or host work; the
    greedy argmax is in it where the graph takes it, the launch setting ``greedy_in_graph``)."""
    graphs = engine.runner.graphs
    if graphs is None or not graphs.fits(reqs):
        return None
    for r in reqs:  # room for the token the replay writes, as the scheduler would reserve
        if not engine.caches.reserve(r.cache, r.num_computed + 1):
            return None
    graphs.run(reqs)
    b = graphs.bucket(len(reqs))
    return back_to_back_ms(lambda: graphs.replay(b), 20, warm=0)


def decode_step_s(engine, reqs, steps: int, drafter: Drafter | None = None) -> float:
    """Seconds per ``engine.step()`` while every request of ``reqs`` decodes: they are added and
    prefilled (if they are not running yet), two steps warm up, then ``steps`` steps are timed
    (the requests are left running). With ``drafter``, the warm-up and timed steps draft with it."""
    for r in reqs:
        if r.num_computed == 0 and not r.output_ids:
            engine.add_request(r)
    while any(not r.output_ids for r in reqs):
        engine.step()
    use_drafter(engine, drafter)
    try:
        for _ in range(2):
            engine.step()
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        dt = (time.perf_counter() - t0) / steps
    finally:
        use_drafter(engine, None)
    stopped = [r.request_id for r in reqs if r.status is not Status.DECODE]
    if stopped:  # a step of fewer sequences than asked for would be timed as one of b
        raise RuntimeError(f"{len(stopped)} of {len(reqs)} requests stopped decoding during the timed steps")
    return dt


def _beside_tokens(steps: int, prompt_len: int, chunk: int) -> int:
    """Tokens a decoder of ``prefill_beside`` makes: warm-up and timed steps, then the steps of
    each prompt (its chunks, as small as the engine's pace may cut them, and its first token)."""
    from ninfer.engine.engine import LLMEngine

    return steps + 4 + (BESIDE_REPS + 1) * (-(-prompt_len // min(chunk, LLMEngine.PACE_FLOOR)) + 2)


def prefill_beside(engine, cfg, prompt_len: int, beside: int, context: int, steps: int,
                   reps: int = BESIDE_REPS) -> dict:
    """A ``prompt_len`` prompt prefilled ``reps`` times, one after another, while ``beside``
    requests of ``context`` tokens decode: the prompt's tok/s (median), and the decoders' gap
    between tokens (one engine step each) over ``steps`` steps without a prompt and over the
    steps that carried one."""
    tokens = _beside_tokens(steps, prompt_len, engine.config.prefill_chunk)
    decoders = _requests(beside, context, tokens, cfg.vocab_size, f"b{prompt_len}-", engine.config.max_context)
    decode_step_s(engine, decoders, 2)  # prefilled and decoding
    alone = _step_times(engine, steps)
    beside_gaps, rates = [], []
    for k in range(reps + 1):  # the first one warms the mix up
        (req,) = _requests(1, prompt_len, 1, cfg.vocab_size, f"p{prompt_len}-{k}-", engine.config.max_context)
        req.prompt_ids[0] = k  # no two prompts alike
        _sync()
        t0 = time.perf_counter()
        engine.add_request(req)
        gaps = []
        while not req.is_finished:
            gaps += _step_times(engine, 1)
        dt = time.perf_counter() - t0
        if k:
            beside_gaps += gaps
            rates.append(prompt_len / dt)
    for r in decoders:
        engine.abort(r.request_id)
    p99 = lambda xs: float(np.percentile(xs, 99)) * 1e3  # noqa: E731
    return {"decoders": beside, "prefill_tok_s": float(np.median(rates)), "gap_p99_alone_ms": p99(alone),
            "gap_p99_beside_ms": p99(beside_gaps), "gap_ratio": p99(beside_gaps) / p99(alone)}


def _step_times(engine, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        _sync()
        out.append(time.perf_counter() - t0)
    return out


def bench_ours(name: str, batches: list[int], context: int, prefills: list[int], steps: int,
               device: str = "cuda", prefill_chunk: int | None = None, beside: int = 0, bits: int | None = None,
               verify: int = 0, decode_gap: float = 0.0) -> dict:
    cfg = shape_config(name) if isinstance(name, str) else name
    engine = _engine(cfg, max(max(batches), beside), context, steps, max(prefills or [0]), device, prefill_chunk,
                     beside, bits, verify, decode_gap)
    weight_gb = None if bits is None else streamed_weight_bytes(engine.model, 1 << 20) / 1e9  # every expert
    out: dict = {"decode": {}, "prefill": {}, "weight_gb": weight_gb}
    for b in batches:
        reqs = _requests(b, context, (steps + b + 64) * max(verify, 1), cfg.vocab_size, f"d{b}-",
                         engine.config.max_context)
        dt = decode_step_s(engine, reqs, steps)
        graph_ms = _graph_ms(engine, reqs)
        out["decode"][b] = {"ms_per_step": dt * 1e3, "tok_s": b / dt, "graph_ms": graph_ms,
                            "bytes_per_step": bytes_per_step(
                                cfg, b, context, None if bits is None else streamed_weight_bytes(engine.model, b))}
        if verify > 1:
            made, c = sum(len(r.output_ids) for r in reqs), engine.counters
            rounds, drafts = c.spec_rounds, c.spec_draft_tokens
            graphs = engine.runner.verify_graphs
            replays = graphs.replays if graphs is not None else 0
            vt = decode_step_s(engine, reqs, steps, RejectedDrafter(verify - 1))
            rounds = c.spec_rounds - rounds
            out["decode"][b]["verify"] = {
                "rows": verify, "ms_per_step": vt * 1e3, "vs_decode": vt / dt,
                # steps replayed from a captured verify graph (of the timed and warm-up ones)
                "graph_steps": (graphs.replays - replays) if graphs is not None else 0,
                "tokens_per_row": (sum(len(r.output_ids) for r in reqs) - made) / max(rounds, 1),
                "drafts_per_row": (c.spec_draft_tokens - drafts) / max(rounds, 1)}
        for r in reqs:
            engine.abort(r.request_id)
    for n in prefills:
        times = []
        for k in range(1 + (PREFILL_REPS if n <= PREFILL_REPS_UP_TO else 1)):  # the first warms up, untimed
            (r,) = _requests(1, n, 1, cfg.vocab_size, f"p{n}-{k}-", engine.config.max_context)
            r.prompt_ids[0] = k  # no two prompts alike
            _sync()
            t0 = time.perf_counter()
            engine.add_request(r)
            while engine.has_work:
                engine.step()
            _sync()
            times.append(time.perf_counter() - t0)
        dt = float(np.median(times[1:]))
        out["prefill"][n] = {"s": dt, "tok_s": n / dt, "runs_s": times[1:]}
        if beside:
            out["prefill"][n]["beside"] = prefill_beside(engine, cfg, n, beside, context, steps)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _hf_model(cfg, device: str):
    import transformers

    moe = cfg.is_moe
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    conf = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(**{
        k: v for k, v in dict(cfg.raw).items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = cls(conf)
    model = model.to(DTYPE if device == "cuda" else torch.float32).to_empty(device=device).eval()
    randomize_(model)
    return model


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _hf_decode(model, ids: torch.Tensor, steps: int) -> dict:
    """Two readings of the peer's decode: its forward called in a loop with its own cache (the
    model alone), and ``generate()`` as a user calls it (the per-token time of a run that makes
    ``steps + 1`` tokens, less the run that makes one, so the prompt's prefill cancels out)."""
    res = model(ids, use_cache=True, logits_to_keep=1)
    pkv, tok = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
    for i in range(steps + 2):
        if i == 2:
            _sync()
            t0 = time.perf_counter()
        res = model(tok, past_key_values=pkv, use_cache=True)
        pkv, tok = res.past_key_values, res.logits[:, -1].argmax(-1, keepdim=True)
    _sync()
    loop = (time.perf_counter() - t0) / steps
    del pkv, res

    def generate(n: int) -> None:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)

    generate(2)  # warm-up
    one = _timed(lambda: generate(1))
    many = _timed(lambda: generate(steps + 1))
    gen = max(many - one, 1e-9) / steps
    b = ids.shape[0]
    return {"ms_per_step": loop * 1e3, "tok_s": b / loop, "generate_ms_per_step": gen * 1e3, "generate_tok_s": b / gen}


def bench_hf(name, batches: list[int], context: int, prefills: list[int], steps: int,
             device: str = "cuda") -> dict:
    import transformers

    cfg = shape_config(name) if isinstance(name, str) else name
    model = _hf_model(cfg, device)
    out: dict = {"decode": {}, "prefill": {}, "transformers": transformers.__version__}
    with torch.inference_mode():
        for b in batches:
            try:
                ids = torch.randint(0, cfg.vocab_size, (b, context), device=device)
                out["decode"][b] = _hf_decode(model, ids, steps)
            except torch.OutOfMemoryError:
                out["decode"][b] = {"error": "out of memory"}
            _empty_cache()
        for n in prefills:
            try:
                ids = torch.randint(0, cfg.vocab_size, (1, n), device=device)
                dt = [_timed(lambda: model(ids, use_cache=True, logits_to_keep=1)) for _ in range(2)][-1]
                out["prefill"][n] = {"s": dt, "tok_s": n / dt}
            except torch.OutOfMemoryError:
                out["prefill"][n] = {"error": "out of memory"}
            _empty_cache()
    del model
    gc.collect()
    _empty_cache()
    return out


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(results: dict, ceilings: dict) -> str:
    bw = ceilings["copy_gb_s"] * 1e9
    rows = [f"GPU: {ceilings['gpu']}; copy {ceilings['copy_gb_s']:.0f} GB/s; bf16 matmul {ceilings['matmul_tflops']:.0f} "
            f"TFLOP/s; programmatic dependent launch {launch.current().pdl} (launch setting pdl)",
            "| shape | work | ninfer | HF transformers (forward loop; generate) | ninfer / HF (loop; generate) "
            "| bytes/step | floor ms | % of floor |",
            "|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        ours, hf = res["ninfer"], res.get("hf", {})
        for b, d in ours["decode"].items():
            h = hf.get("decode", {}).get(b, {})
            floor_ms = d["bytes_per_step"] / bw * 1e3
            ratio = f"{d['tok_s'] / h['tok_s']:.1f}x; {d['tok_s'] / h['generate_tok_s']:.1f}x" if "tok_s" in h else "-"
            hf_txt = f"{h['tok_s']:.1f}; {h['generate_tok_s']:.1f} tok/s" if "tok_s" in h else h.get("error", "-")
            graph = f", graph {d['graph_ms']:.2f} ms" if d.get("graph_ms") else ""
            rows.append(f"| {name} | decode b={b} | {d['tok_s']:.1f} tok/s ({d['ms_per_step']:.2f} ms{graph}) | {hf_txt} | "
                        f"{ratio} | {d['bytes_per_step'] / 1e9:.2f} GB | {floor_ms:.2f} | {100 * floor_ms / d['ms_per_step']:.1f}% |")
            if "verify" in d:
                v = d["verify"]
                drafts = v["rows"] - 1
                gain = (f"; at {PUBLISHED_ACCEPTANCE[drafts]} accepted a round "
                        f"{PUBLISHED_ACCEPTANCE[drafts] / v['vs_decode']:.2f}x decode") if drafts in PUBLISHED_ACCEPTANCE else ""
                graphed = ", graph" if v.get("graph_steps") else ", eager"
                rows.append(f"| {name} | verify b={b}, rows of {v['rows']} | {v['ms_per_step']:.2f} ms a step{graphed}, "
                            f"{v['vs_decode']:.2f}x the decode step ({v['tokens_per_row']:.2f} tokens a row kept{gain}) "
                            f"| | | | | |")
        for n, p in ours["prefill"].items():
            h = hf.get("prefill", {}).get(n, {})
            hf_txt = f"{h['tok_s']:.0f} tok/s" if "tok_s" in h else h.get("error", "-")
            ratio = f"{p['tok_s'] / h['tok_s']:.1f}x" if "tok_s" in h else "-"
            rows.append(f"| {name} | prefill {n} | {p['tok_s']:.0f} tok/s | {hf_txt} | {ratio} | | | |")
            if "beside" in p:
                b = p["beside"]
                rows.append(f"| {name} | prefill {n} beside {b['decoders']} decoding | {b['prefill_tok_s']:.0f} tok/s; "
                            f"their gap p99 {b['gap_p99_beside_ms']:.2f} ms, alone {b['gap_p99_alone_ms']:.2f} ms "
                            f"({b['gap_ratio']:.1f}x) | | | | | |")
    return "\n".join(rows)


def start_on_gpu(parser: argparse.ArgumentParser, specs: list[str]) -> None:
    """Put the GPU's launch settings with the ``--set`` changes in force and print the changes,
    or stop with the parser's error (a bad spec, no CUDA GPU) before anything is built."""
    try:
        changes, lines = launch.changes_from_specs(specs)
    except ValueError as e:
        parser.error(str(e))
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    launch.use(launch.current().changed(**changes))
    if lines:
        print("settings: " + ", ".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", required=True, choices=sorted(SHAPES))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill", default="512,16384")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per step (default: each prompt in one step; the server's default is 2048)")
    p.add_argument("--beside", type=int, default=0,
                   help="also time each prompt while this many requests decode beside it")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--hf-batches", default="1,8", help="batch sizes for the transformers peer")
    p.add_argument("--hf-prefill", default=None, help="prompt lengths for the peer (default: --prefill)")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="also time steps whose rows check K - 1 drafts (rows of K tokens) at each batch size")
    p.add_argument("--decode-gap", type=float, default=0.0, metavar="X",
                   help="the engine's decode_gap (a step with prompt rows beside decoding ones within X decode "
                        "steps' time; 0, the default: the token budget alone)")
    p.add_argument("--json", default=None)
    p.add_argument("--gemv", choices=["auto", "off"], default="auto",
                   help="off: every decode projection through cuBLAS (launch setting gemv_max_rows=0)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a kernel launch setting first, e.g. attention_max_splits=32")
    p.add_argument("--weights", choices=["bf16", "int8", "int4"], default="bf16",
                   help="int8 / int4: every projection quantized, the LM head in int8, as the server's --weights "
                        "holds them on the GPU (the floor counts the bytes the model holds)")
    args = p.parse_args(argv)
    start_on_gpu(p, args.set)
    if args.gemv == "off":
        launch.use(launch.current().changed(gemv_max_rows=0))
    batches = [int(x) for x in args.batches.split(",")]
    prefills = [int(x) for x in args.prefill.split(",") if x]
    ceilings = measure_ceilings()
    results = {}
    for name in args.shape:
        results[name] = {"ninfer": bench_ours(name, batches, args.context, prefills, args.steps,
                                                 prefill_chunk=args.prefill_chunk, beside=args.beside,
                                                 bits={"int4": 4, "int8": 8}.get(args.weights),
                                                 verify=args.verify, decode_gap=args.decode_gap)}
        print(table({name: results[name]}, ceilings), flush=True)  # ours first, in case the peer stalls
        if not args.no_hf:
            hf_batches = [int(x) for x in args.hf_batches.split(",")]
            hf_prefills = prefills if args.hf_prefill is None else [int(x) for x in args.hf_prefill.split(",") if x]
            results[name]["hf"] = bench_hf(name, hf_batches, args.context, hf_prefills, min(args.steps, 8))
        print(table({name: results[name]}, ceilings), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "torch": torch.__version__,
              "pdl": launch.current().pdl, "ceilings": ceilings, "args": vars(args), "results": results}
    print("\n" + table(results, ceilings))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
