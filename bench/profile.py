"""Where a decode step and a prefill spend GPU time: per-kernel totals from the torch profiler.

    python -m bench.profile --shape qwen3.5-27b [--batch 1] [--context 4096] [--prefill 16384] [--weights int4]
    python -m bench.profile --shape qwen3.5-0.8b --batch 8 --mixed 16 --mixed-tokens 128 [--set NAME=VALUE]
    python -m bench.profile --shape qwen3.5-9b --batch 8 --context 512 --verify 4

Builds the same random-weight engine as ``bench.decode``, then profiles a few eager decode steps
(the kernels a CUDA graph replays) and one prefill, printing the top kernels by GPU time with
their call counts and the share of the total. ``--mixed N``: one step that carries N new prompts
of ``--mixed-tokens`` each beside the decoding batch (after the same mix once to warm up), its
host time against its GPU time and the host's top operators. ``--verify K``: the same eager
steps with every row verifying K - 1 drafts (K tokens a row), each kernel beside its decode
figure, largest growth first.
"""
from __future__ import annotations

import argparse
import logging

import torch
from torch.profiler import ProfilerActivity, profile

from .decode import RejectedDrafter, _engine, _requests, _sync, start_on_gpu, use_drafter
from .shapes import shape_config


def _activities() -> list:
    return [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]


def _self_us(e) -> float:
    return e.self_device_time_total if torch.cuda.is_available() else e.self_cpu_time_total


def kernel_table(prof, steps: int, top: int) -> str:
    kind = torch.autograd.DeviceType.CUDA if torch.cuda.is_available() else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kind and _self_us(e) + e.self_cpu_time_total > 0]
    total = sum(_self_us(e) for e in events)
    events.sort(key=lambda e: _self_us(e), reverse=True)
    rows = [f"GPU total {total / 1e3 / steps:.3f} ms per run, {sum(e.count for e in events) / steps:.0f} kernels per run",
            "| us per run | share | calls per run | kernel |", "|---|---|---|---|"]
    for e in events[:top]:
        rows.append(f"| {_self_us(e) / steps:.1f} | {100 * _self_us(e) / total:.1f}% | "
                    f"{e.count / steps:.0f} | {e.key[:110]} |")
    return "\n".join(rows)


def _kernel_us(prof, steps: int) -> dict[str, tuple[float, float]]:
    """Per kernel name: GPU us and calls per run."""
    kind = torch.autograd.DeviceType.CUDA if torch.cuda.is_available() else torch.autograd.DeviceType.CPU
    return {e.key: (_self_us(e) / steps, e.count / steps) for e in prof.key_averages()
            if e.device_type == kind and _self_us(e) > 0}


def growth_table(decode: dict[str, tuple[float, float]], verify: dict[str, tuple[float, float]], top: int) -> str:
    """Each kernel's us per step in the decode and the verify step, the largest growth first."""
    names = sorted(set(decode) | set(verify), key=lambda k: verify.get(k, (0, 0))[0] - decode.get(k, (0, 0))[0],
                   reverse=True)
    total_d, total_v = (sum(us for us, _ in t.values()) for t in (decode, verify))
    rows = [f"GPU per step: decode {total_d / 1e3:.3f} ms, verify {total_v / 1e3:.3f} ms "
            f"({total_v / max(total_d, 1e-9):.2f}x)",
            "| decode us (calls) | verify us (calls) | growth us | kernel |", "|---|---|---|---|"]
    for k in names[:top]:
        (du, dc), (vu, vc) = decode.get(k, (0.0, 0.0)), verify.get(k, (0.0, 0.0))
        rows.append(f"| {du:.1f} ({dc:.0f}) | {vu:.1f} ({vc:.0f}) | {vu - du:+.1f} | {k[:100]} |")
    return "\n".join(rows)


def host_profile(engine, steps: int, top: int) -> None:
    """Python time of whole engine steps (CUDA-graph replays), by function."""
    import cProfile
    import pstats

    _sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    _sync()
    prof.disable()
    print(f"\n## host side of {steps} decode steps (cProfile, by own time)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def profiled_steps(engine, steps: int):
    """``steps`` engine steps under torch.profiler, after two warm ones."""
    for _ in range(2):
        engine.step()
    _sync()
    with profile(activities=_activities()) as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    return prof


def mixed_step(engine, cfg, rows: int, tokens: int, top: int) -> None:
    """One engine step carrying ``rows`` whole prompts of ``tokens`` beside the running batch:
    the host's time in it (wall time of ``engine.step()`` with the profiler's CPU events, and
    the sum of their own times) against the GPU's (the sum of its kernels)."""
    import cProfile
    import pstats
    import time

    runner, ran = engine.runner, []
    in_pieces = runner._in_pieces

    def noted(step) -> bool:  # whether each step ran through the captured pieces
        ran.append(in_pieces(step))
        return ran[-1]

    runner._in_pieces = noted
    overlap, engine.overlap = engine.overlap, False  # no decode step launched ahead: the next step takes the prompts
    engine.step()  # (the one launched ahead already, if any)
    walls, prof, host = [], None, None
    # round 0 warms the mix up (compiles, allocator); 1 runs under torch.profiler, 2 under
    # cProfile, 3-5 unobserved: the step's wall time as a user's step takes it
    for k in range(6):
        reqs = _requests(rows, tokens, 1, cfg.vocab_size, f"m{k}-", engine.config.max_context)
        for i, r in enumerate(reqs):
            r.prompt_ids[0] = (k * rows + i) % cfg.vocab_size  # no prefix alike
            engine.add_request(r)
        _sync()
        ran.clear()
        if k == 1:
            with profile(activities=sorted({ProfilerActivity.CPU, *_activities()}, key=str)) as prof:
                t0 = time.perf_counter()
                engine.step()
                host_s = time.perf_counter() - t0
                _sync()
            pieces = bool(ran and ran[-1])
        elif k == 2:
            host = cProfile.Profile()
            host.enable()
            engine.step()
            _sync()
            host.disable()
        else:
            t0 = time.perf_counter()
            engine.step()
            _sync()
            if k >= 3:
                walls.append(time.perf_counter() - t0)
        if any(r.num_computed < tokens for r in reqs):  # every prompt computed in that one step
            raise SystemExit(f"{rows} prompts of {tokens} did not fit one step: "
                             f"{[r.num_computed for r in reqs]} tokens computed")
        while any(not r.is_finished for r in reqs):
            engine.step()
    engine.overlap = overlap
    runner._in_pieces = in_pieces
    graphs = runner.mixed_graphs
    buckets = sorted(t for _, t in graphs.captured) if graphs is not None else []
    # the profiler's own buffer requests are no operator's time
    events = [e for e in prof.key_averages() if e.key != "Activity Buffer Request"]
    cpu_us = sum(e.self_cpu_time_total for e in events)
    gpu_us = sum(_self_us(e) for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    wall_ms = 1e3 * sorted(walls)[len(walls) // 2]
    print(f"\n## one step of {rows} prompts of {tokens} tokens beside the decoding batch, "
          f"{'in CUDA-graph pieces' if pieces else 'eager'} (pieces captured for {buckets or 'no'} tokens)")
    print(f"engine.step() {host_s * 1e3:.1f} ms on the host under the profiler, {wall_ms:.1f} ms unobserved "
          f"(median of {len(walls)}, to the GPU's end); operators' own CPU time {cpu_us / 1e3:.1f} ms; "
          f"GPU kernels {gpu_us / 1e3:.1f} ms; CPU / GPU {cpu_us / max(gpu_us, 1):.2f}x; "
          f"wall / GPU {wall_ms * 1e3 / max(gpu_us, 1):.2f}x")
    rows_ = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total,
                   reverse=True)
    print("| CPU us (own) | calls | operator |\n|---|---|---|")
    for e in rows_[:top]:
        print(f"| {e.self_cpu_time_total:.0f} | {e.count} | {e.key[:100]} |")
    print(kernel_table(prof, 1, top), flush=True)
    print("\n### the same step's host side (cProfile, by own time)")
    pstats.Stats(host).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile")
    p.add_argument("--shape", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--prefill", type=int, default=0)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--host", action="store_true", help="also profile the host side of graph-replayed steps")
    p.add_argument("--mixed", type=int, default=0, help="profile one step of this many new prompts beside the batch")
    p.add_argument("--mixed-tokens", type=int, default=128, help="tokens of each --mixed prompt")
    p.add_argument("--verify", type=int, default=0, metavar="K",
                   help="also profile eager steps whose rows each verify K - 1 drafts, beside the decode step")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change a kernel launch setting first, e.g. mixed_graph_tokens=512")
    p.add_argument("--weights", choices=["bf16", "int8", "int4"], default="bf16",
                   help="int8 / int4: the projections held quantized, as bench.decode --weights")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the engine's word on its graphs
    if torch.cuda.is_available():
        start_on_gpu(p, args.set)
    elif args.set:
        p.error("--set changes GPU launch settings: needs a CUDA GPU")
    cfg = shape_config(args.shape)
    mixed = args.mixed * args.mixed_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = _engine(cfg, args.batch + args.mixed, args.context, 64, max(args.prefill, 16, mixed), device,
                     prefill_chunk=max(args.prefill, 2048, mixed + args.batch),
                     bits={"int4": 4, "int8": 8}.get(args.weights), verify=args.verify)
    reqs = _requests(args.batch, args.context, 256 * max(args.verify, 1), cfg.vocab_size, "d",
                     engine.config.max_context)
    for r in reqs:
        engine.add_request(r)
    while any(not r.output_ids for r in reqs):
        engine.step()
    graphs, engine.runner.graphs = engine.runner.graphs, None  # eager: the kernels the graph holds
    prof = profiled_steps(engine, args.steps)
    print(f"## {args.shape} ({args.weights}) decode batch {args.batch}, context {args.context} (eager step)")
    print(kernel_table(prof, args.steps, args.top), flush=True)
    if args.verify > 1:
        verify_graphs, engine.runner.verify_graphs = engine.runner.verify_graphs, None
        use_drafter(engine, RejectedDrafter(args.verify - 1))
        vprof = profiled_steps(engine, args.steps)
        use_drafter(engine, None)
        engine.runner.verify_graphs = verify_graphs
        print(f"\n## the same batch verifying: rows of {args.verify} tokens (eager step)")
        print(growth_table(_kernel_us(prof, args.steps), _kernel_us(vprof, args.steps), args.top), flush=True)
    engine.runner.graphs = graphs
    if args.host:
        host_profile(engine, 50, args.top)
    if args.mixed:
        mixed_step(engine, cfg, args.mixed, args.mixed_tokens, args.top)
    for r in reqs:
        engine.abort(r.request_id)
    if args.prefill:
        warm, req = (_requests(1, args.prefill, 1, cfg.vocab_size, tag, engine.config.max_context)[0]
                     for tag in ("w", "p"))
        engine.add_request(warm)
        while engine.has_work:
            engine.step()
        _sync()
        with profile(activities=_activities()) as prof:
            engine.add_request(req)
            while engine.has_work:
                engine.step()
            _sync()
        print(f"\n## {args.shape} prefill {args.prefill}")
        print(kernel_table(prof, 1, args.top), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
