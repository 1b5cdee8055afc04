"""What a graph-replayed decode step costs around its graph: the graph alone, then with the input
copy, the token read-back, and the whole engine step.

    python -m bench.step_overhead --shape qwen3.5-35b-a3b [--batch 1] [--context 4096] [--set ...]

Builds the same random-weight engine as ``bench.decode``, brings a batch to decoding, then times
each row as GPU time per step over back-to-back repeats (CUDA events): the host queues work far
ahead of the GPU in every row, so a row's excess over the one above is what its extra operations
cost the GPU stream, launch gaps included.
"""
from __future__ import annotations

import argparse
import time

import torch

from .decode import _engine, _requests, _sync, start_on_gpu
from .gpu_env import back_to_back_ms
from .shapes import SHAPES, shape_config


def measure(engine, reqs, repeats: int) -> list[tuple[str, float]]:
    graphs = engine.runner.graphs
    for r in reqs:  # room for the token the replays write, as the scheduler would reserve
        if not engine.caches.reserve(r.cache, r.num_computed + 1):
            raise SystemExit("no cache room for the timed replays")
    b = graphs.bucket(len(reqs))
    pinned = torch.empty(len(reqs), dtype=torch.long, pin_memory=True)
    ids = graphs.input_ids[: len(reqs)].clone()

    def read_back(greedy) -> None:
        pinned.copy_(greedy, non_blocking=True)
        torch.cuda.Event().record()

    def step_follow() -> None:
        _, greedy = graphs.run(reqs, follow=True)
        read_back(greedy)

    def step_separate_argmax() -> None:
        logits, _ = graphs.run(reqs, follow=True)
        read_back(torch.argmax(logits, dim=-1))

    rows = [("graph replay alone", lambda: graphs.replay(b)),
            ("+ input copy without token ids (a greedy step that follows)", lambda: graphs.run(reqs, follow=True)),
            ("+ input copy with token ids", lambda: graphs.run(reqs)),
            ("+ token ids copied on the device", lambda: graphs.run(reqs, ids)),
            ("follow + read-back to pinned memory + event", step_follow),
            ("follow + a second argmax + read-back + event", step_separate_argmax)]
    out = [(name, back_to_back_ms(fn, repeats)) for name, fn in rows]
    _sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        engine.step()
    _sync()
    out.append(("whole engine step (scheduling, overlap, detokenizing)", (time.perf_counter() - t0) / repeats * 1e3))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="change a kernel launch setting")
    args = p.parse_args(argv)
    start_on_gpu(p, args.set)
    cfg = shape_config(args.shape)
    engine = _engine(cfg, args.batch, args.context, 2 * args.repeats + 64, 16)
    if engine.runner.graphs is None:
        p.error("the engine captured no CUDA graphs")
    reqs = _requests(args.batch, args.context, 2 * args.repeats + args.batch + 64, cfg.vocab_size, "o",
                     engine.config.max_context)
    for r in reqs:
        engine.add_request(r)
    while any(len(r.output_ids) < 3 for r in reqs):
        engine.step()
    rows = measure(engine, reqs, args.repeats)
    base = rows[0][1]
    print(f"## {args.shape} decode batch {args.batch}, context {args.context}: GPU ms per step")
    print("| what runs per step | ms | over the graph alone |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} | {1e3 * (ms - base):+.1f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
