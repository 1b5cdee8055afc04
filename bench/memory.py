"""Where a server's GPU memory goes: the engine built in-process from ninfer-serve's own
arguments, torch's allocated and reserved bytes after each stage (the CUDA graphs' private pools
apart from the rest), then one prompt of ``--prompt-tokens`` through it; where it runs out of
memory, the live allocations grouped by the source line that made them, each pool apart; after
the build, the same, and what made the CUDA graphs' pools grow (their segments by the allocation
that asked).

    python -m bench.memory --prompt-tokens 16384 -- MODEL --max-context 262144 --max-concurrency 1 \\
        --prefill-chunk 4096 --kv-capacity 262144 --gpu-memory-gib 16 ...

The arguments after ``--`` are the server's (``ninfer-serve``), so a launcher plan's command
(``Plan.server_args``) can be checked as it would run: what its parts come to against the plan's.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

GiB, MiB = 1 << 30, 1 << 20
OWN = "ninfer"  # frames from this package name an allocation's source


def _pool(segment: dict) -> str:
    """A snapshot segment's pool: "default", or a CUDA graph's private pool by its id."""
    pool_id = tuple(segment.get("segment_pool_id") or (0, 0))
    return "default" if pool_id == (0, 0) else f"graphs {pool_id}"


def by_source(snapshot: dict, top: int = 20) -> list[tuple[str, str, int]]:
    """``torch.cuda.memory._snapshot()``'s live blocks as ``(pool, source, bytes)``, largest
    first: ``pool`` "default" or the private pool's id (a CUDA graph's), ``source`` the package's
    own frames of the allocation's stack (innermost first)."""
    sizes: collections.Counter = collections.Counter()
    for seg in snapshot.get("segments", []):
        pool = _pool(seg)
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            sizes[(pool, _source(block.get("frames")))] += block["size"]
    return [(pool, source, n) for (pool, source), n in sizes.most_common(top)]


def _source(frames: list[dict] | None, keep: int = 4) -> str:
    """The package's own frames of an allocation's stack, innermost first: the ``keep`` innermost
    and the ``keep`` outermost (what made it, and which stage of the build or step asked)."""
    own = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in frames or [] if OWN in f["filename"]]
    if len(own) > 2 * keep:
        own = own[:keep] + ["..."] + own[-keep:]
    return " <- ".join(own) or "(outside the package)"


def segment_growth(snapshot: dict, top: int = 20) -> list[tuple[str, str, int, int]]:
    """Why the CUDA graphs' private pools hold what they hold: the segments each grew by (the
    allocator's ``segment_alloc`` events at a graphs pool's segment addresses), summed by the
    source of the allocation that asked for them, as ``(pool, source, segments, bytes)``, largest
    first. A pool's blocks are mostly free between replays (its graphs' intermediates), so the
    live blocks alone do not say what made it large."""
    where = {seg["address"]: _pool(seg) for seg in snapshot.get("segments", []) if _pool(seg) != "default"}
    grown: dict[tuple[str, str], list[int]] = {}
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if event.get("action") == "segment_alloc" and event.get("addr") in where:
                row = grown.setdefault((where[event["addr"]], _source(event.get("frames"))), [0, 0])
                row[0] += 1
                row[1] += event["size"]
    ranked = sorted(grown.items(), key=lambda kv: -kv[1][1])[:top]
    return [(pool, source, n, size) for (pool, source), (n, size) in ranked]


def pools(snapshot: dict) -> dict[str, tuple[int, int]]:
    """Reserved and allocated bytes by pool ("default", or a CUDA graph's private pool)."""
    out: dict[str, list[int]] = {}
    for seg in snapshot.get("segments", []):
        row = out.setdefault(_pool(seg), [0, 0])
        row[0] += seg["total_size"]
        row[1] += seg["allocated_size"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def _stage(tag: str) -> None:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    print(f"[{tag}] allocated {torch.cuda.memory_allocated() / GiB:.2f} GiB, reserved "
          f"{torch.cuda.memory_reserved() / GiB:.2f} GiB (peak allocated {torch.cuda.max_memory_allocated() / GiB:.2f}), "
          f"device in use {(total - free) / GiB:.2f} GiB", flush=True)
    for pool, (reserved, allocated) in sorted(pools(torch.cuda.memory._snapshot()).items()):
        print(f"    {pool}: reserved {reserved / MiB:.0f} MiB, allocated {allocated / MiB:.0f} MiB", flush=True)


def _live(snapshot: dict, top: int) -> None:
    for pool, source, n in by_source(snapshot, top):
        print(f"  {n / MiB:9.1f} MiB  {pool:18s} live, from {source}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, serve = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--top", type=int, default=20, help="allocation sources listed where memory runs out")
    args = p.parse_args(ours)
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (it reads torch's CUDA allocator)")
    if not serve:
        p.error("give the server's arguments after --")
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams
    from ninfer.server import bootstrap
    from ninfer.server.cli import build_parser

    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    served = build_parser().parse_args(serve)
    ckpt, tokenizer, config = bootstrap._resolve(served)
    _stage("before the engine")
    engine = bootstrap._engine(ckpt, tokenizer, config, served.tuned_config)
    _stage("engine built")
    built = torch.cuda.memory._snapshot()
    _live(built, args.top)
    for pool, source, n, size in segment_growth(built, args.top):
        print(f"  {size / MiB:9.1f} MiB in {n:3d} segment(s)  {pool:18s} grown by {source}", flush=True)
    ids = torch.randint(0, min(tokenizer.vocab_size, 32000), (args.prompt_tokens,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    req = Request("memory", ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                  max_total_tokens=config.max_context)
    engine.add_request(req)
    steps, start = 0, time.perf_counter()
    try:
        while not req.is_finished:
            engine.step()
            steps += 1
            if steps in (1, 2) or steps % 16 == 0:
                _stage(f"step {steps}, {req.num_computed:,} tokens computed")
    except torch.OutOfMemoryError as e:
        print(f"out of memory at step {steps + 1}: {str(e).splitlines()[0][:240]}", flush=True)
        _stage("out of memory")
        _live(torch.cuda.memory._snapshot(), args.top)
        return 1
    _stage(f"the prompt and {len(req.output_ids)} tokens out in {steps} steps, {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
