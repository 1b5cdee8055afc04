"""The engine in a process of its own (the default): the same tokens as the engine on the
server's thread, the monitor's figures from the engine's snapshots, and a dead engine process is an
engine failure (/health 503, exit code 2); an engine that cannot be built stops the server at
start with the reason."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from support.server_process import ROOT, ServerProcess, free_port
from support.tiny import save_tiny_qwen3_5

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads child processes from /proc")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_qwen3_5(tmp_path_factory.mktemp("ckpt") / "tiny")


def serve(tiny: Path, tmp_path: Path, *flags: str) -> ServerProcess:
    return ServerProcess([sys.executable, "-m", "ninfer.server.cli", str(tiny), "--max-context", "512",
                          "--temperature", "0", *flags], tmp_path / f"server{len(flags)}.log", timeout=120)


def engine_children(pid: int) -> list[int]:
    """The engine processes ``pid`` has spawned (multiprocessing's, not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def completion(base: str, prompt: list[int], n: int) -> dict:
    r = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": n, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_engine_process_gives_the_tokens_of_the_engine_thread_and_its_figures(tiny, tmp_path):
    prompts = [[5, 6, 7, 8], list(range(20, 60)), [9] * 3]
    thread = serve(tiny, tmp_path, "--engine-thread")
    try:
        assert engine_children(thread.proc.pid) == []
        expected = [completion(thread.base_url, p, 24)["tokens"] for p in prompts]
    finally:
        thread.stop()
    server = serve(tiny, tmp_path)
    try:
        assert len(engine_children(server.proc.pid)) == 1
        results: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, completion(server.base_url, p, 24)
                                                                                ["tokens"]))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(3)] == expected  # greedy, together or one at a time
        # the request has ended when its answer arrives: the figures already count it
        metrics = httpx.get(server.base_url + "/metrics").text
        assert "ninfer_generation_tokens_total 72.0" in metrics
        stats = httpx.get(server.base_url + "/stats").json()
        assert stats["requests"]["running"] == 0  # what is still held is the checkpoints
        assert stats["memory"]["kv_pages_used"] == stats["cache"]["checkpoint_kv_pages"] > 0
        # one where each prompt ended, one where each answer did
        assert stats["cache"]["checkpoints"] == 6 and "ninfer_prefix_checkpoints 6.0" in metrics
        # a lane shows while its request runs
        streaming = threading.Thread(target=completion, args=(server.base_url, [3, 4], 400))
        streaming.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lanes = [s for s in httpx.get(server.base_url + "/slots").json() if s["is_processing"]]
            if lanes and lanes[0]["n_decoded"] > 0:
                break
            time.sleep(0.01)
        assert lanes and lanes[0]["n_prompt_tokens"] == 2 and lanes[0]["state"] == "decode"
        streaming.join()
    finally:
        assert server.stop() == 0 or server.proc.returncode == -signal.SIGTERM
    assert engine_children(server.proc.pid) == []


def test_the_checkpoint_gauge_comes_back_within_its_number_once_the_answers_are_in(tiny, tmp_path):
    """Two checkpoints at most: three answers in a row leave one beyond them (an answer's is
    evicted only after the step that follows it, or while the engine is idle), and /stats shows
    the table back within its size without any further request (the newest kept; while idle the
    engine may move one more to host memory, keeping half the table free for the next burst)."""
    server = serve(tiny, tmp_path, "--prefix-checkpoints", "2")
    try:
        for i in range(3):
            completion(server.base_url, [5 + i, 6, 7, 8 + i], 8)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            cache = httpx.get(server.base_url + "/stats").json()["cache"]
            if cache["checkpoints"] <= 2:
                break
            time.sleep(0.05)
        assert 1 <= cache["checkpoints"] <= 2
    finally:
        server.stop()


def test_a_server_stopped_while_it_streams_ends_without_an_engine_failure(tiny, tmp_path):
    """SIGTERM while requests stream: the gateway goes first and the engine, whose outputs have
    nowhere to go, stops stepping; neither the log nor the exit code calls that a failure."""
    server = serve(tiny, tmp_path)
    with contextlib.ExitStack() as streams:
        try:
            body = {"prompt": [5, 6], "n_predict": 4000, "ignore_eos": True, "stream": True}
            for _ in range(4):
                r = streams.enter_context(httpx.stream("POST", server.base_url + "/completion", json=body,
                                                       timeout=60))
                assert next(line for line in r.iter_lines() if line.startswith("data: "))
            time.sleep(0.5)
        finally:
            code = server.stop()
    assert code == 0 or code == -signal.SIGTERM
    log = server.log_path.read_text(errors="replace")
    assert "engine step failed" not in log and "Traceback" not in log, log[-2000:]


def test_a_dead_engine_process_is_an_engine_failure(tiny, tmp_path):
    server = serve(tiny, tmp_path)
    try:
        (child,) = engine_children(server.proc.pid)
        body = {"prompt": [5, 6], "n_predict": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/completion", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(child, signal.SIGKILL)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert "error" in rest[-1] and "engine" in rest[-1]["error"]["message"]
        assert server.proc.wait(30) == 2  # ninfer-serve's exit code for an engine failure
        assert "engine failure" in server.output()
    finally:
        server.stop()


def test_an_engine_that_cannot_be_built_stops_the_server_at_start_with_the_reason(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "config.json").read_text())  # weights that do not fit their config:
    config["intermediate_size"] = 64                             # found only when they are loaded
    (broken / "config.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "ninfer.server.cli", str(broken), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1].startswith("ninfer-serve: shape mismatch for 'model.layers.0.mlp.")
    assert "Traceback" not in done.stderr  # a checkpoint that does not fit is the user's to fix, not a crash


def test_a_weights_file_cut_short_stops_the_server_with_its_name(tiny, tmp_path):
    """An interrupted download: the server says which file cannot be read, no traceback."""
    broken = tmp_path / "cut"
    broken.mkdir()
    for f in tiny.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    done = subprocess.run([sys.executable, "-m", "ninfer.server.cli", str(broken), "--port", str(free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"ninfer-serve: {weights} is not a readable safetensors file")
    assert "Traceback" not in done.stderr


def test_a_tuned_config_that_is_not_of_its_form_stops_the_server_at_start(tiny, tmp_path):
    """``--tuned-config``: a file naming no launch setting is refused before the engine starts,
    naming the entry; a well-formed one serves."""
    bad = tmp_path / "tuned.json"
    bad.write_text(json.dumps({"gemv_tiles": {}}))
    done = subprocess.run([sys.executable, "-m", "ninfer.server.cli", str(tiny), "--port", str(free_port()),
                           "--tuned-config", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines()[-1] == f"ninfer-serve: {bad}: 'gemv_tiles' is not a launch setting"
    assert "Traceback" not in done.stderr
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"pdl": "off", "gemv_shape_tiles": {"1,64,64": None}}))
    server = serve(tiny, tmp_path, "--tuned-config", str(good))
    try:
        r = httpx.post(server.base_url + "/completion", json={"prompt": [5, 6], "n_predict": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 3
    finally:
        server.stop()


def test_cpu_threads_reach_the_engine_config_and_every_thread_of_its_process():
    """``--cpu-threads N`` is ``EngineConfig.cpu_threads``; building the engine sets torch's
    intra-op threads of its process, which a thread started later (the engine loop's) takes too.
    Run in a process of its own: the setting is the whole process's."""
    code = """
import threading, torch
from ninfer.server.bootstrap import apply_cpu_threads, engine_config
from ninfer.server.cli import build_parser
args = build_parser().parse_args(["--model", "m", "--cpu-threads", "1"])
config = engine_config(args, 512, "cpu", torch.float32)
assert config.cpu_threads == 1
assert engine_config(build_parser().parse_args(["--model", "m"]), 512, "cpu", torch.float32).cpu_threads == 0
torch.set_num_threads(2)
apply_cpu_threads(config)
seen = []
t = threading.Thread(target=lambda: seen.append((torch.get_num_threads(), float(torch.ones(4096).sum()))))
t.start(); t.join()
assert seen == [(1, 4096.0)], seen
try:
    engine_config(build_parser().parse_args(["--model", "m", "--cpu-threads", "-1"]), 512, "cpu", torch.float32)
except ValueError as exc:
    assert "cpu_threads must be >= 0" in str(exc), exc
else:
    raise AssertionError("--cpu-threads -1 was taken")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
