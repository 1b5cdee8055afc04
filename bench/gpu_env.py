"""The two ceilings every GPU number is read against: copy bandwidth and bf16 matmul rate."""
from __future__ import annotations

import torch


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def back_to_back_ms(fn, repeats: int, warm: int = 3) -> float:
    """GPU time per call of ``fn`` run ``repeats`` times back to back (one pair of events around
    them all, so launch gaps count but the host never waits between calls), after ``warm`` calls."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def graph_time_us(fn, calls: int, reps: int = 10) -> float:
    """GPU time of one call of ``fn(i)``: ``fn(0) .. fn(calls - 1)`` (each on its own copy of the
    data, so the reads come from HBM rather than L2) captured in a CUDA graph, so no Python launch
    time is counted; the median replay over ``reps``, divided by ``calls``."""
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return _time_ms(graph.replay, reps) * 1e3 / calls


def sweep_tiles(name: str, fn, default: dict, options: list[dict], nbytes: float, calls: int,
                top: int | None = None) -> list[str]:
    """A markdown table, fastest first, of ``fn(tiles, i)`` (a kernel launch on data copy ``i``)
    for the default tiles and each option: checked against the default's output on copy 0, timed
    with ``graph_time_us`` over ``calls`` copies, ``nbytes`` read per call. ``top``: rows shown
    (the default's row always)."""
    ref = fn(default, 0)
    rows = []
    for tiles in ([default] if default not in options else []) + options:
        try:
            out = fn(tiles, 0)
            ok = torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
            us = graph_time_us(lambda i: fn(tiles, i), calls)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a row, not a stop
            rows.append((float("inf"), f"| {tiles} | failed: {type(exc).__name__} | | |"))
            continue
        mark = " (default)" if tiles == default else ""
        rows.append((us, f"| {tiles}{mark} | {us:.1f} | {nbytes / us / 1e3:.0f} | {'ok' if ok else 'MISMATCH'} |"))
    rows.sort(key=lambda r: r[0])
    shown = [r for k, (_, r) in enumerate(rows) if top is None or k < top or "(default)" in r]
    return [f"\n{name}", "| tiles | us per call | GB/s | output |", "|---|---|---|---|"] + shown


def measure_ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16, well past L2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src))
    copy_gb_s = 2 * src.numel() * 2 / (copy_ms * 1e-3) / 1e9  # bytes read + written
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = _time_ms(lambda: a @ b)
    tflops = 2 * 8192**3 / (mm_ms * 1e-3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "copy_gb_s": copy_gb_s, "matmul_tflops": tflops}
