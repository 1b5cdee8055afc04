"""Check the launcher's memory plan on a real GPU: for a known shape (random weights) and some lane
counts, start ninfer-serve with the planned settings, keep every lane busy with a long prompt, and
compare the GPU memory the server took at its peak with what the plan said. Prints a table and
writes JSON; rows that held go into app/presets.json by hand, with the note it prints.

    python -m ninfer.bench.measure_presets --shape Qwen3.5-0.8B --lanes 1,4 --prompt-tokens 32768
    python -m ninfer.bench.measure_presets --shape Qwen3.5-27B --lanes 1 --cap-gib 16,24 --prompt-tokens 131072
    python -m ninfer.bench.measure_presets --shape Qwen3.5-27B --checkpoint-format gptq --cap-gib 16 \
        --prompt-tokens 131072 --serve-args "--kv-dtype 4bit"

``--cap-gib``: run the server held to that many GiB (``--gpu-memory-gib``, torch's per-process
memory fraction), which the launcher plans for (the CUDA context lies outside the cap, nothing
else shares it): a row holds where every prompt is served, torch refusing any allocation past
the cap. ``--memory``: each plan's command through ``bench.memory``
instead (the engine in-process, its memory by stage against the plan's parts, and where it runs
out, the live allocations by source).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from ..app.gpu_probe import plan_device, probe
from ..app.launch import child_env, parse_options, read_serve_args, resolve, serve_executable
from ..app.plan import GiB
from .shapes import random_checkpoint, random_gptq_checkpoint


class Peak(threading.Thread):
    def __init__(self, index: int) -> None:
        super().__init__(daemon=True)
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        self.base = self.used()
        self.peak = self.base
        self.done = False

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def run(self) -> None:
        while not self.done:
            self.peak = max(self.peak, self.used())
            time.sleep(0.05)


def one(model: Path, lanes: int, prompt_tokens: int, port: int, cap_gib: float | None = None,
        serve_args: list[str] = (), memory: bool = False) -> dict:
    extra = ([] if cap_gib is None else ["--gpu-memory-gib", f"{cap_gib:g}"]) + list(serve_args)
    # the launcher plans for the cap it passes on (``Device.held_to``)
    resolved = resolve(parse_options(["--concurrency", str(lanes), str(model), "--", "--port", str(port), *extra]))
    plan = resolved.plan
    if memory:  # the plan's command through ``bench.memory`` instead of a server: where its bytes go
        print(plan.describe(), flush=True)
        tokens = min(prompt_tokens, plan.settings.context - 64)
        report = [sys.executable, "-m", f"{__package__}.memory", "--prompt-tokens", str(tokens), "--",
                  *resolved.command[len(serve_executable()):]]
        rc = subprocess.run(report, env=child_env()).returncode
        return {"lanes": lanes, "cap_gib": cap_gib, "context": plan.settings.context, "plan_bytes": plan.total,
                "command": resolved.command, "fits": rc == 0, "memory_report": True}
    peak = Peak(plan.device.index)
    peak.start()
    server = subprocess.Popen(resolved.command, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    row = {"lanes": lanes, "cap_gib": cap_gib, "context": plan.settings.context, "prefill_chunk": plan.settings.prefill_chunk,
           "drafts": plan.settings.drafts, "kv_tokens": plan.settings.kv_tokens, "plan_bytes": plan.total,
           "free_before": plan.device.free, "command": resolved.command}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if httpx.get(resolved.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        row["started_s"] = round(time.monotonic() - (deadline - 300), 1)
        row["context"] = read_serve_args(list(serve_args)).max_context or plan.settings.context  # by hand, or planned
        tokens = min(prompt_tokens, row["context"] - 64)
        body = {"model": "m", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "hello " * (tokens - 32)}]}

        def ask(_: int) -> int:
            try:
                reply = httpx.post(resolved.base_url + "/v1/chat/completions", json=body, timeout=600)
            except httpx.HTTPError:  # the server is gone: its log says why
                return -1
            if reply.status_code != 200:
                return -reply.status_code
            return reply.json().get("usage", {}).get("prompt_tokens", -1)

        started = time.monotonic()
        with ThreadPoolExecutor(lanes) as pool:
            row["prompt_tokens"] = list(pool.map(ask, range(lanes)))
        row["requests_s"] = round(time.monotonic() - started, 1)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        peak.done = True
        peak.join()
    row["peak_bytes"] = peak.peak - peak.base
    served = all(t > 0 for t in row.get("prompt_tokens", [-1]))
    # held to a cap, torch refuses what would pass it (the CUDA context, outside it, is in the peak)
    row["fits"] = served and (plan.device.held or row["peak_bytes"] <= plan.total)
    row["log_tail"] = server.stdout.read()[-1500:] if not row["fits"] else ""
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="Qwen3.5-0.8B")
    p.add_argument("--lanes", default="1,4")
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--checkpoint", default="/tmp/ninfer-random-ckpt")
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--out", default="bench/results/presets.json")
    p.add_argument("--serve-args", default="", help="ninfer-serve flags over the plan's (one string)")
    p.add_argument("--checkpoint-format", choices=["bf16", "gptq"], default="bf16",
                   help="the random weights in bf16, or 4-bit as gptqmodel saves them (the 27B in 15 GB of disk)")
    p.add_argument("--cap-gib", default="", help="comma-separated GiB: plan and run held to each (default: the card)")
    p.add_argument("--memory", action="store_true",
                   help="run each plan's command through bench.memory (its memory by stage and, where it runs out, "
                        "by source) instead of serving it")
    args = p.parse_args()
    result = probe()
    print(result.summary(), flush=True)
    device = plan_device(result)
    from ..engine.frontend.qwen_tiktoken import load_qwen_tiktoken

    vocab = load_qwen_tiktoken("qwen3.6").vocab_size  # the tokenizer the server takes for a checkpoint without one
    if args.checkpoint_format == "gptq":
        model = random_gptq_checkpoint(args.shape, Path(args.checkpoint) / f"{args.shape}-gptq", vocab)
    else:
        model = random_checkpoint(args.shape, Path(args.checkpoint) / args.shape, vocab)
    rows = []
    caps = [float(x) for x in args.cap_gib.split(",") if x] or [None]
    for cap, lanes in ((c, n) for c in caps for n in (int(x) for x in args.lanes.split(","))):
        row = one(model, lanes, args.prompt_tokens, args.port, cap, args.serve_args.split(), args.memory)
        rows.append(row)
        if args.memory:
            continue
        print(f"{args.shape} {'' if cap is None else f'held to {cap:g} GiB, '}lanes {lanes}: context {row['context']:,} chunk {row['prefill_chunk']} drafts "
              f"{row['drafts']} | plan {row['plan_bytes'] / GiB:.1f} GiB, peak {row['peak_bytes'] / GiB:.1f} GiB, "
              f"prompts {row.get('prompt_tokens')} in {row.get('requests_s')} s -> {'held' if row['fits'] else 'NO'}",
              flush=True)
        print("  " + " ".join(row["command"]), flush=True)
        if row["log_tail"]:
            print(row["log_tail"], flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": device.name, "total": device.total, "shape": args.shape, "rows": rows},
                              indent=2))
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
