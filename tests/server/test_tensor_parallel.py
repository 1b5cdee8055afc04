"""Tensor parallelism on the CPU (``--tp 2``, gloo): a real ``ninfer-serve`` whose two ranks each
hold half of every layer gives the greedy tokens of the single-process engine, with the same
log-probabilities (to 1e-5), for tiny Qwen3.5 dense, MoE and Qwen3-Next checkpoints, requests
running together (prompt chunks beside decode rows, a prefix checkpoint continued); a rank killed
mid-stream ends the server with exit code 2, which the supervisor reloads."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from ninfer.app.supervisor import State, Supervisor, SupervisorConfig
from ninfer.server.app import create_app
from ninfer.server.bootstrap import build_state
from ninfer.server.cli import build_parser
from support.server_process import ServerProcess, free_port
from support.tiny import save_tiny_qwen3_5, save_tiny_qwen3_next
from support.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="ranks are processes of their own")

# small weights over transformers' initialisation: logits spread enough that parity means something
NOISE = 0.05
CHECKPOINTS = {
    "dense": lambda path: save_tiny_qwen3_5(path, noise=NOISE),
    "moe": lambda path: save_tiny_qwen3_5(path, moe=True, noise=NOISE),
    "next": lambda path: save_tiny_qwen3_next(path, noise=NOISE),
}
FLAGS = ["--max-context", "512", "--temperature", "0", "--cpu-threads", "1", "--prefill-chunk", "32"]
PROMPTS = [[5, 6, 7, 8], list(range(20, 60)), [9] * 3, [5, 6, 7, 8, 40, 41]]  # the last continues the first


def served_command(path: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "ninfer.server.cli", str(path), *FLAGS, *flags]


def answer(post, prompt: list[int]) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """Greedy tokens and, per token, the five best ids with their log-probabilities."""
    r = post("/completion", json={"prompt": prompt, "n_predict": 10, "ignore_eos": True, "n_probs": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["tokens"], [[(t["id"], t["logprob"]) for t in p["top_logprobs"]]
                            for p in body["completion_probabilities"]]


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return CHECKPOINTS[request.param](tmp_path_factory.mktemp("ckpt") / request.param)


def test_two_ranks_give_the_single_process_tokens_and_logprobs(checkpoint, tmp_path):
    state, loop = build_state(build_parser().parse_args([str(checkpoint), *FLAGS, "--engine-thread"]))
    loop.start()
    try:
        with TestClient(create_app(state)) as client:
            expected = [answer(client.post, p) for p in PROMPTS]
    finally:
        loop.stop()
    server = ServerProcess(served_command(checkpoint, "--tp", "2"), tmp_path / "tp.log", timeout=120)
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            first = answer(http.post, PROMPTS[0])
            got: dict[int, tuple] = {}
            threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, answer(http.post, PROMPTS[i])))
                       for i in range(1, len(PROMPTS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stats = http.get("/stats").json()
        assert stats["cache"]["hits"]["gpu"] >= 1  # the last prompt went on from the first one's checkpoint
    finally:
        assert server.stop() in (0, -signal.SIGTERM)
    for (tokens, probs), (want_tokens, want_probs) in zip([first, *(got[i] for i in sorted(got))], expected):
        assert tokens == want_tokens
        for row, want in zip(probs, want_probs):
            assert [i for i, _ in row] == [i for i, _ in want]
            assert [v for _, v in row] == pytest.approx([v for _, v in want], abs=1e-5)


def test_what_tensor_parallelism_does_not_run_is_refused_at_start(tmp_path):
    path = save_tiny_qwen3_5(tmp_path / "tiny")
    for flags, words in ((["--spec", "ngram"], "--spec off"), (["--host-cache-mib", "64"], "--host-cache-mib 0"),
                         (["--engine-thread"], "--engine-thread"), (["--tp", "4"], "key heads (2) do not split into 4 equal parts")):
        with pytest.raises(ValueError, match=re.escape(words)):
            tp = [] if "--tp" in flags else ["--tp", "2"]
            build_state(build_parser().parse_args([str(path), *tp, *flags]))


def test_a_quantized_gguf_is_split_only_dequantized(tmp_path):
    from support.qwen35_gguf import Q, tiny_model, write_qwen35_gguf
    from support.tiny import train_tokenizer

    path = write_qwen35_gguf(tmp_path / "q8.gguf", tiny_model(), qtype=Q.Q8_0, tokenizer=train_tokenizer())
    with pytest.raises(ValueError, match="--weights dense"):
        build_state(build_parser().parse_args([str(path), "--tp", "2"]))


def rank_pid(log: Path, rank: int, after: int = 0) -> int | None:
    found = re.findall(rf"tensor-parallel rank {rank} of \d+ \(pid (\d+)\)", log.read_text(errors="replace"))
    return int(found[-1]) if len(found) > after else None


def test_a_killed_rank_ends_the_server_with_code_2_and_the_supervisor_brings_it_back(tmp_path):
    path = save_tiny_qwen3_5(tmp_path / "tiny", noise=NOISE)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    sup = Supervisor(SupervisorConfig(command=[*served_command(path, "--tp", "2"), "--port", str(port)],
                                      health_url=base + "/health", log_dir=tmp_path / "logs",
                                      pid_file=tmp_path / "ninfer-serve.pid", env={**os.environ},
                                      backoff_initial_s=0.3, poll_s=0.05))
    log = tmp_path / "logs" / "server.log"
    sup.start()
    try:
        assert sup.wait_ready(120)
        rank1 = rank_pid(log, 1)
        body = {"prompt": [5, 6], "n_predict": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/completion", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(rank1, signal.SIGKILL)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert "error" in rest[-1] and rest[-1]["error"]["code"] == "engine_failed"
        wait_until(lambda: len(sup.starts) == 2 and sup.status.state == State.READY, timeout=120)
        assert sup.status.last_exit == 2
        text = log.read_text(errors="replace")
        assert "code 2 (engine failure); reloading now" in text and "engine failure" in text
        assert rank_pid(log, 1, after=1) not in (None, rank1)  # a new group, both ranks started again
        r = httpx.post(base + "/completion", json={"prompt": [5, 6], "n_predict": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and len(r.json()["tokens"]) == 4
    finally:
        sup.stop()
    wait_until(lambda: not alive(rank_pid(log, 1, after=1)), timeout=10, what="rank 1 to end with the server")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
