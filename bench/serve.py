"""Load through the HTTP server, next to the engine alone at the same batch, in one run.

    python -m bench.serve [--shape qwen3.5-9b | --model PATH] [--streams 1,4,16,64]
                          [--prompt-tokens 200] [--prompt-tokens-max N] [--output-tokens 256]
                          [--rate R] [--turns K] [--turn-tokens N] [--concurrency C]
                          [--temperature T] [--preset documents] [--cache-ab] [--repeat N]
                          [--direct-steps 32] [--json FILE] [-- NINFER-SERVE FLAGS ...]

Starts ``ninfer-serve`` on a free port with the flags after ``--`` (``--max-concurrency`` the
largest stream count unless given): the embedded model by default, ``--model`` a checkpoint, or
``--shape`` a checkpoint of random bf16 weights at that real shape, written once by transformers
with the vocabulary sized to the tokenizer the server gives it. For each stream count it warms the
server up, then sends that many sessions through ``/completion`` (``ignore_eos``, streamed: each
chunk names its tokens), all at once or starting at ``--rate`` per second (Poisson); a session of
``--turns`` K sends the conversation again with the answer and a new user turn appended (the
table then also shows the returning turns' time to first token and the share of their prompts
that came from prefix checkpoints; ``-- --no-prefix-cache`` is the run without them);
``--concurrency C`` keeps at most C requests in flight, the sessions taking turns, and
``--prompt-tokens-max`` spreads the first prompts' lengths up to it; ``--shared-tokens N`` begins
every first prompt with the same N tokens (sessions sent together with one long system prompt). ``--preset documents`` is
a document chat load: 12 conversations over documents of 8-28K tokens, 4 turns each, 3 requests
at a time. ``--cache-ab`` runs the load twice, on a server with the flags given and on one with
``--no-prefix-cache`` added, and prints both and their ratio. ``--repeat N`` runs each load N
times on its server (each round with prompts of its own, the warm-up before the first only, so
later rounds meet the checkpoints earlier ones left, as a server that has been up a while does)
and reports each figure's median over the rounds. Then,
with the server stopped, it builds the same model with the same engine settings in this process
and times decode steps at the same batch, so the table reads the HTTP total against what the
engine alone gives. It prints the table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from ninfer.engine.loader.embedded import EMBEDDED_MODEL_ID

from .serve_load import Load, measure
from .shapes import SHAPES, random_checkpoint, random_gptq_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``ninfer-serve`` as a child process in its own session, stopped by its own pid."""

    def __init__(self, argv: list[str], timeout_s: float) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = [sys.executable, "-m", "ninfer.server.cli", *argv, "--port", str(port)]
        self.log = tempfile.NamedTemporaryFile(prefix="ninfer-bench-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ninfer-serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ninfer-serve not healthy after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """Stop the server and wait until every process of its group is gone: its engine process
        holds the GPU's memory until it exits, and the next server or the engine-direct run needs it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        start, killed = time.monotonic(), False
        while _group_alive(self.proc.pid) and time.monotonic() - start < 40:
            if not killed and time.monotonic() - start > 30:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                killed = True
            time.sleep(0.1)
        self.log.close()


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies, which hold no memory, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, ppid, pgrp
            return True
    return False


def serve_argv(model: str | None, extra: list[str], streams: list[int]) -> list[str]:
    """The server's command line: the model, the flags given, and the lanes the largest stream
    count needs (the server takes 1..64) unless the flags set them."""
    argv = ([model] if model else []) + list(extra)
    if not any(a == "--max-concurrency" or a.startswith("--max-concurrency=") for a in extra):
        argv += ["--max-concurrency", str(min(max(streams), 64))]
    return argv


def direct_engine(argv: list[str]):
    """The engine ``ninfer-serve argv`` builds (same checkpoint, tokenizer, device, dtype, engine
    and launch settings), for this thread to step."""
    from ninfer.server import bootstrap
    from ninfer.server.cli import build_parser

    return bootstrap.build_engine(build_parser().parse_args(argv))


def engine_direct(argv: list[str], prompts: dict[int, list[list[int]]], steps: int, temperature: float) -> dict:
    """Per stream count: decode tok/s of the engine alone with the run's prompts given for it
    decoding (at most ``--max-concurrency``), ``steps`` steps timed after two warm ones."""
    from ninfer.engine.request import Request
    from ninfer.engine.sampling_params import SamplingParams

    from .decode import decode_step_s

    engine, out = direct_engine(argv), {}

    def timed(streams: int, ids: list[list[int]]) -> dict:
        batch = min(len(ids), engine.config.max_concurrency)
        # the first request decodes while the later ones are prefilled, a step per chunk of theirs
        out_tokens = steps + 8 + sum(-(-len(p) // engine.config.step_tokens) + 1 for p in ids[:batch])
        reqs = [Request(f"direct-{streams}-{i}", p, SamplingParams(temperature=temperature, max_tokens=out_tokens,
                                                                     ignore_eos=True, seed=i),
                        max_total_tokens=engine.config.max_context) for i, p in enumerate(ids[:batch])]
        dt = decode_step_s(engine, reqs, steps)
        for r in reqs:
            engine.abort(r.request_id)
        return {"batch": batch, "ms_per_step": dt * 1e3, "tok_s": batch / dt}

    # stepped on a thread of its own, as the server's engine loop steps it (on the CPU, torch's
    # intra-op threads ran several times slower under the main thread when the cores were busy)
    with ThreadPoolExecutor(1, thread_name_prefix="engine-direct") as thread:
        for streams, ids in prompts.items():
            out[streams] = thread.submit(timed, streams, ids).result()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _fmt(x: float | None, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:,.{digits}f}{unit}"


def table(runs: list[dict]) -> str:
    turns = any(r.get("return_ttft_p50_s") is not None for r in runs)
    extra = (" returning turns' TTFT p50 (prompt share cached) |", "---|") if turns else ("", "")
    rows = ["| streams | total tok/s | per-stream tok/s | TTFT p50 | TTFT p99 | ITL p99 | engine-direct decode tok/s "
            "| ratio |" + extra[0], "|---|---|---|---|---|---|---|---|" + extra[1]]
    for r in runs:
        d = r.get("engine_direct")
        direct = f"{d['tok_s']:,.1f} (b={d['batch']})" if d else "-"
        ratio = f"{r['total_tok_s'] / d['tok_s']:.2f}" if d else "-"
        failed = f" ({r['failed']} of {r['requests']} failed)" if r["failed"] else ""
        rows.append(f"| {r['streams']}{failed} | {r['total_tok_s']:,.1f} | {_fmt(r['per_stream_tok_s'], digits=1)} | "
                    f"{_fmt(r['ttft_p50_s'], ' s')} | {_fmt(r['ttft_p99_s'], ' s')} | "
                    f"{_fmt(r['itl_p99_s'], ' ms', 1e3, 1)} | {direct} | {ratio} |" +
                    (f" {_fmt(r['return_ttft_p50_s'], ' s', digits=3)} ({_fmt(r['return_cached_share'], '%', 100, 0)}) |"
                     if turns else ""))
    return "\n".join(rows)


def _git() -> dict:
    def git(*cmd: str) -> str | None:
        try:
            done = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_changes": None if status is None else bool(status)}


def device_name(argv: list[str]) -> str:
    from ninfer.server import bootstrap
    from ninfer.server.cli import build_parser

    device = bootstrap.resolve_device(build_parser().parse_args(argv).device)
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def model_for(args: argparse.Namespace) -> str | None:
    """The checkpoint to serve: ``--model``, a random one at ``--shape`` (the vocabulary of the
    Qwen tokenizer the server takes for a checkpoint without its own), or None (the embedded one)."""
    if args.shape is None:
        return args.model
    from ninfer.engine.frontend.qwen_tiktoken import load_qwen_tiktoken

    vocab = load_qwen_tiktoken("qwen3.6").vocab_size
    gptq = args.checkpoint_format == "gptq"
    path = Path(args.checkpoint_dir) / f"{args.shape}-vocab{vocab}{'-gptq' if gptq else ''}"
    print(f"random {args.checkpoint_format} checkpoint at the {args.shape} shape (vocabulary {vocab}): {path}",
          flush=True)
    return str((random_gptq_checkpoint if gptq else random_checkpoint)(args.shape, path, vocab))


# named loads: each sets the load's arguments the command line leaves unset
PRESETS = {
    # seed 003's document chat: 12 conversations over documents of 8-28K tokens, 4 turns each (a
    # 64-token question after each 128-token answer), 3 requests at a time, so each conversation
    # comes back after the 11 others have had a turn
    "documents": {"streams": "12", "prompt_tokens": 8192, "prompt_tokens_max": 28672, "turns": 4,
                  "turn_tokens": 64, "output_tokens": 128, "concurrency": 3},
}
DEFAULTS = {"streams": "1,4,16,64", "prompt_tokens": 200, "prompt_tokens_max": 0, "output_tokens": 256, "turns": 1,
            "turn_tokens": 32, "concurrency": 0}


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This bench's arguments (each checked, or the parser's error) and the flags for the server."""
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0],
                                epilog="flags after -- go to ninfer-serve")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--shape", choices=sorted(SHAPES), help="serve random weights at this real shape")
    which.add_argument("--model", help="checkpoint directory or .gguf file (default: the embedded model)")
    p.add_argument("--checkpoint-dir", default=str(Path(tempfile.gettempdir()) / "ninfer-bench-checkpoints"),
                   help="where --shape checkpoints are written and found again")
    p.add_argument("--checkpoint-format", choices=["bf16", "gptq"], default="bf16",
                   help="--shape's random weights in bf16, or 4-bit as gptqmodel saves them (a quarter of the disk)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named load (its arguments, unless given)")
    p.add_argument("--streams", help="sessions, one run each (comma-separated; default 1,4,16,64)")
    p.add_argument("--prompt-tokens", type=int, help="tokens of each session's first prompt (default 200)")
    p.add_argument("--prompt-tokens-max", type=int, help="first prompts spread evenly up to this many tokens")
    p.add_argument("--output-tokens", type=int, help="tokens of each answer (default 256)")
    p.add_argument("--rate", type=float, default=0.0, help="sessions started per second, Poisson (0: all at once)")
    p.add_argument("--turns", type=int, help="requests per session, each with the conversation so far (default 1)")
    p.add_argument("--turn-tokens", type=int, help="tokens of each new user turn after the first (default 32)")
    p.add_argument("--concurrency", type=int, help="requests in flight at most (default: every session's)")
    p.add_argument("--shared-tokens", type=int, default=0,
                   help="every session's first prompt begins with the same this many tokens (a system prompt)")
    p.add_argument("--cache-ab", action="store_true",
                   help="run the load with the prefix cache and again with --no-prefix-cache, side by side")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of each load on one server (each with prompts of its own); each figure the median")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, HTTP and engine alike")
    p.add_argument("--warmup-tokens", type=int, default=4, help="output tokens of the warm-up round (0: none)")
    p.add_argument("--direct-steps", type=int, default=32, help="decode steps timed for the engine-direct figure")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the server and for each chunk")
    p.add_argument("--json", default=None)
    args = p.parse_args(own)
    for name, value in {**DEFAULTS, **PRESETS.get(args.preset, {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.cache_ab and any(a == "--no-prefix-cache" for a in extra):
        p.error("--cache-ab runs the load without the prefix cache itself: leave --no-prefix-cache out")
    try:
        args.stream_counts = [int(x) for x in args.streams.split(",") if x.strip()]
        if not args.stream_counts or len(set(args.stream_counts)) != len(args.stream_counts):
            raise ValueError(f"--streams {args.streams!r}: give each stream count once")
        args.loads = [Load(n, args.prompt_tokens, args.output_tokens, args.turns, args.turn_tokens, args.rate,
                           args.temperature, args.timeout, args.concurrency, args.prompt_tokens_max,
                           args.shared_tokens)
                      for n in args.stream_counts]
        if args.direct_steps < 1 or args.warmup_tokens < 0 or args.repeat < 1:
            raise ValueError("--direct-steps and --repeat must be >= 1, --warmup-tokens >= 0")
    except ValueError as exc:
        p.error(str(exc))
    return args, extra


def serve_runs(argv_server: list[str], args: argparse.Namespace, label: str, device: str) -> tuple[list[dict], Server]:
    """Every load of ``args`` through one server started with ``argv_server``."""
    runs = []
    server = Server(argv_server, args.timeout)
    try:
        print(f"{label} on {device}: ninfer-serve {' '.join(argv_server)}; prompts {args.prompt_tokens}"
              f"{f'-{args.prompt_tokens_max}' if args.prompt_tokens_max else ''} tokens, {args.output_tokens} out, "
              f"{f'{args.rate:g}/s' if args.rate else 'all at once'}, {args.turns} turn(s)"
              f"{f', {args.concurrency} at a time' if args.concurrency else ''}", flush=True)
        for load in args.loads:
            rounds = []
            for i in range(args.repeat):  # each round's prompts its own: no round hits another's checkpoints
                rounds.append(asyncio.run(measure(server.base_url, load, f"s{load.streams}" + (f"-r{i}" if i else ""),
                                                  args.warmup_tokens if i == 0 else 0)))
                print(table(rounds[-1:]).splitlines()[-1], flush=True)
                if rounds[-1]["cache_after"]:
                    print("  after it: " + ", ".join(f"{k.removeprefix('ninfer_')} {v:g}"
                                                     for k, v in rounds[-1]["cache_after"].items()), flush=True)
            runs.append(median_run(rounds))
    finally:
        server.stop()
    return runs, server


MEDIAN_KEYS = ("wall_s", "total_tok_s", "per_stream_tok_s", "ttft_p50_s", "ttft_p99_s", "ttft_max_s", "itl_p50_s",
               "itl_p99_s", "return_ttft_p50_s", "return_ttft_mean_s", "return_cached_share")


def median_run(rounds: list[dict]) -> dict:
    """One load's rounds as one run: each figure the median over the rounds (the rounds kept)."""
    if len(rounds) == 1:
        return rounds[0]
    run = {**rounds[-1], "rounds": rounds, "prompts": rounds[0]["prompts"]}
    for k in ("requests", "failed", "output_tokens"):
        run[k] = sum(r[k] for r in rounds)
    run["errors"] = sorted({e for r in rounds for e in r["errors"]})
    for k in MEDIAN_KEYS:
        xs = [r[k] for r in rounds if r.get(k) is not None]
        run[k] = statistics.median(xs) if xs else None
    for r in rounds:
        r.pop("prompts", None)
    return run


def ab_table(on: list[dict], off: list[dict]) -> str:
    """The prefix cache's runs against those without it: each figure as on / off and their ratio."""
    def cell(a: float | None, b: float | None, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
        if a is None or b is None:
            return "-"
        return f"{_fmt(a, unit, scale, digits)} / {_fmt(b, unit, scale, digits)} ({a / b:.2f}x)" if b else "-"

    rows = ["| streams | total tok/s, cache on / off | wall | TTFT p99 | ITL p99 | returning turns' TTFT mean |",
            "|---|---|---|---|---|---|"]
    for a, b in zip(on, off):
        rows.append(f"| {a['streams']} | {cell(a['total_tok_s'], b['total_tok_s'], digits=1)} | "
                    f"{cell(a['wall_s'], b['wall_s'], ' s')} | "
                    f"{cell(a['ttft_p99_s'], b['ttft_p99_s'], ' s', digits=3)} | "
                    f"{cell(a['itl_p99_s'], b['itl_p99_s'], ' ms', 1e3, 1)} | "
                    f"{cell(a.get('return_ttft_mean_s'), b.get('return_ttft_mean_s'), ' s', digits=3)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse(given)
    model = model_for(args)
    argv_server = serve_argv(model, extra, args.stream_counts)
    device = device_name(argv_server)
    label = model or f"{EMBEDDED_MODEL_ID} (embedded)"
    runs, server = serve_runs(argv_server, args, label, device)
    logs = [server.log.name]
    off = None
    if args.cache_ab:
        off, off_server = serve_runs(argv_server + ["--no-prefix-cache"], args, label, device)
        logs.append(off_server.log.name)
    # the engine alone at the batch the load keeps in flight
    prompts = {r["streams"]: r.pop("prompts")[: args.concurrency or None] for r in runs}
    for r in off or []:
        r.pop("prompts")
    direct = engine_direct(argv_server, prompts, args.direct_steps, args.temperature)
    for r in runs + (off or []):
        r["engine_direct"] = direct[r["streams"]]
        r["ratio"] = r["total_tok_s"] / r["engine_direct"]["tok_s"]
    if off is None:
        print("\n" + table(runs), flush=True)
    else:
        print("\n### prefix cache on (the server's default)\n" + table(runs), flush=True)
        print("\n### --no-prefix-cache\n" + table(off), flush=True)
        print("\n### on against off\n" + ab_table(runs, off), flush=True)
    if args.json:
        report = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "model": label, "device": device,
                  "torch": torch.__version__, "git": _git(), "command": ["python", "-m", "bench.serve", *given],
                  "server_command": server.command, "args": {k: v for k, v in vars(args).items() if k != "loads"},
                  "runs": runs}
        if off is not None:
            report["runs_without_prefix_cache"] = off
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    failed = [r for r in runs + (off or []) if r["failed"]]
    if failed:
        print(f"failed requests: {sorted({e for r in failed for e in r['errors']})}; server logs: {logs}")
        return 1
    for log in logs:
        Path(log).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
