"""``bench.serve`` end to end on the CPU: a real ``ninfer-serve`` with the embedded model, streams
through HTTP, then the engine alone at the same batch, so GPU time is never spent finding a bug in
the bench itself."""
from __future__ import annotations

import json

import pytest

from bench.serve import main
from bench.shapes import random_checkpoint

HEADER = ("| streams | total tok/s | per-stream tok/s | TTFT p50 | TTFT p99 | ITL p99 | engine-direct decode tok/s "
          "| ratio |")
TINY_QWEN = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "full_attention_interval": 4, "max_position_embeddings": 1024,
}


def _rows(text: str) -> dict[str, list[str]]:
    """The final table's rows by stream count, as lists of cells."""
    table = text[text.rindex(HEADER):].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in table
                                              if row.startswith("|"))}


@pytest.mark.slow
def test_sessions_through_http_next_to_the_engine_alone(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the server's threads, as this process has (conftest)
    out = tmp_path / "serve.json"
    argv = ["--streams", "1,2", "--prompt-tokens", "16", "--output-tokens", "8", "--turns", "2", "--turn-tokens", "4",
            "--rate", "50", "--direct-steps", "4", "--json", str(out), "--", "--max-context", "512"]
    assert main(argv) == 0
    rows = _rows(capsys.readouterr().out)
    report = json.loads(out.read_text())
    assert report["command"] == ["python", "-m", "bench.serve", *argv]
    assert report["device"].startswith("CPU, ") and report["torch"] and "commit" in report["git"]
    assert "--max-context" in report["server_command"] and "--max-concurrency" in report["server_command"]
    assert [r["streams"] for r in report["runs"]] == [1, 2] and set(rows) == {"1", "2"}
    for run in report["runs"]:
        n = run["streams"]
        assert run["requests"] == 2 * n and run["failed"] == 0 and run["errors"] == []
        assert run["output_tokens"] == 2 * n * 8  # ignore_eos: every answer is n_predict tokens
        assert run["total_tok_s"] > 0 and run["per_stream_tok_s"] > 0 and run["itl_p99_s"] > 0
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] <= run["ttft_max_s"]
        direct = run["engine_direct"]
        assert direct["batch"] == n and direct["tok_s"] > 0
        assert run["ratio"] == pytest.approx(run["total_tok_s"] / direct["tok_s"])
        # the second turn sends the conversation: first prompt + its answer + a new user turn
        assert sorted((d["turn"], d["prompt_tokens"], d["output_tokens"]) for d in run["requests_detail"]) == \
            [(0, 16, 8)] * n + [(1, 16 + 8 + 4, 8)] * n
        firsts = {d["session"]: d for d in run["requests_detail"] if d["turn"] == 0}
        seconds = {d["session"]: d for d in run["requests_detail"] if d["turn"] == 1}
        assert all(seconds[s]["sent_s"] >= firsts[s]["done_s"] for s in firsts)
        # and goes on from where the first answer ended: 16 + 8 of its 28 tokens, but the answer's
        # last token (sampled, never run)
        assert [d["cached_tokens"] for d in seconds.values()] == [23] * n
        assert run["return_cached_share"] == pytest.approx(23 / 28)
        cells = rows[str(n)]
        assert cells[7] == f"{run['return_ttft_p50_s']:,.3f} s (82%)"
        assert cells[0] == f"{run['total_tok_s']:,.1f}" and cells[5] == f"{direct['tok_s']:,.1f} (b={n})"
        assert cells[3] == f"{run['ttft_p99_s']:,.2f} s" and cells[6] == f"{run['ratio']:.2f}"
    sent = sorted(d["sent_s"] for d in report["runs"][1]["requests_detail"] if d["turn"] == 0)
    assert sent[1] > sent[0]  # at a rate, the second session starts after the first


@pytest.mark.slow
def test_a_random_checkpoint_sized_to_the_tokenizer_serves_through_the_bench(tmp_path, capsys, monkeypatch):
    """What ``--shape`` serves on a GPU, at a tiny shape: a transformers checkpoint whose vocabulary
    is the Qwen tokenizer's, so every sampled id decodes; written once, then found again."""
    from ninfer.engine.frontend.qwen_tiktoken import load_qwen_tiktoken

    vocab = load_qwen_tiktoken("qwen3.6").vocab_size
    path = random_checkpoint(TINY_QWEN, tmp_path / "tiny", vocab)
    assert json.loads((path / "config.json").read_text())["vocab_size"] == vocab
    written = (path / "model.safetensors").stat().st_mtime_ns
    assert random_checkpoint(TINY_QWEN, tmp_path / "tiny", vocab) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == written
    assert not (tmp_path / "tiny.partial").exists()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["--model", str(path), "--streams", "2", "--prompt-tokens", "12", "--output-tokens", "6",
                 "--temperature", "1", "--warmup-tokens", "0", "--direct-steps", "2"]) == 0
    cells = _rows(capsys.readouterr().out)["2"]
    assert float(cells[0]) > 0 and cells[5].endswith("(b=2)")


@pytest.mark.parametrize("argv, why", [
    (["--streams", "0"], "streams must be >= 1"),
    (["--streams", "two"], "invalid literal"),
    (["--streams", "4,4"], "give each stream count once"),
    (["--output-tokens", "1"], "output_tokens must be >= 2"),
    (["--rate", "-1"], "rate and temperature must be >= 0"),
    (["--direct-steps", "0"], "--direct-steps must be >= 1"),
    (["--shape", "qwen3.5-9b", "--model", "x"], "not allowed with argument"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err
