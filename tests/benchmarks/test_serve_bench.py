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


@pytest.mark.slow
def test_cache_ab_runs_the_load_with_and_without_the_prefix_cache(tmp_path, capsys, monkeypatch):
    """``--cache-ab``: the same sessions on a server with the prefix cache and on one without,
    both tables and their ratios; ``--concurrency`` keeps that many requests in flight (the
    sessions take turns) and ``--prompt-tokens-max`` spreads the first prompts' lengths."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "ab.json"
    argv = ["--streams", "3", "--prompt-tokens", "16", "--prompt-tokens-max", "40", "--output-tokens", "6",
            "--turns", "2", "--turn-tokens", "4", "--concurrency", "2", "--shared-tokens", "20", "--cache-ab",
            "--warmup-tokens", "0",
            "--direct-steps", "2", "--json", str(out), "--", "--max-context", "512"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    (on,), (off,) = report["runs"], report["runs_without_prefix_cache"]
    for run in (on, off):
        assert run["failed"] == 0 and run["requests"] == 6
        firsts = sorted((d["session"], d["prompt_tokens"]) for d in run["requests_detail"] if d["turn"] == 0)
        assert firsts == [(0, 20 + 16), (1, 20 + 28), (2, 20 + 40)]  # the shared system part first
        spans = sorted((d["sent_s"], d["done_s"]) for d in run["requests_detail"])
        for sent, _ in spans:  # never more than two in flight
            assert sum(s <= sent < d for s, d in spans) <= 2
        assert run["engine_direct"]["batch"] == 2
    returning = [d["cached_tokens"] for d in on["requests_detail"] if d["turn"] == 1]
    assert sorted(returning) == [20 + 16 + 5, 20 + 28 + 5, 20 + 40 + 5]  # prompt + answer but its last token
    assert all(d["cached_tokens"] == 0 for d in off["requests_detail"])
    assert "--no-prefix-cache" not in report["server_command"]
    ab = text[text.index("### on against off"):].splitlines()
    (row,) = [line for line in ab if line.startswith("| 3 |")]
    ratio = on["total_tok_s"] / off["total_tok_s"]
    assert f"({ratio:.2f}x)" in row.split("|")[2]
    assert f"({on['wall_s'] / off['wall_s']:.2f}x)" in row.split("|")[3]
    assert "### --no-prefix-cache" in text


@pytest.mark.parametrize("argv, why", [
    (["--streams", "0"], "streams must be >= 1"),
    (["--streams", "two"], "invalid literal"),
    (["--streams", "4,4"], "give each stream count once"),
    (["--output-tokens", "1"], "output_tokens must be >= 2"),
    (["--rate", "-1"], "rate and temperature must be >= 0"),
    (["--direct-steps", "0"], "--direct-steps and --repeat must be >= 1"),
    (["--repeat", "0"], "--direct-steps and --repeat must be >= 1"),
    (["--shape", "qwen3.5-9b", "--model", "x"], "not allowed with argument"),
    (["--concurrency", "-1"], "concurrency and shared_tokens must be >= 0"),
    (["--shared-tokens", "-1"], "concurrency and shared_tokens must be >= 0"),
    (["--prompt-tokens", "100", "--prompt-tokens-max", "50"], "must be >= prompt_tokens"),
    (["--cache-ab", "--", "--no-prefix-cache"], "leave --no-prefix-cache out"),
    (["--preset", "chat"], "invalid choice"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, why, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_the_documents_preset_is_the_document_chat_load_unless_told_otherwise():
    from bench.serve import parse

    args, _ = parse(["--preset", "documents"])
    (load,) = args.loads
    assert (load.streams, load.turns, load.concurrency) == (12, 4, 3)
    assert [load.first_prompt_tokens(i) for i in (0, 11)] == [8192, 28672]
    assert all(8192 <= load.first_prompt_tokens(i) <= 28672 for i in range(12))
    args, _ = parse(["--preset", "documents", "--turns", "2"])
    assert args.loads[0].turns == 2 and args.loads[0].concurrency == 3
    args, _ = parse([])
    assert [ld.streams for ld in args.loads] == [1, 4, 16, 64] and args.loads[0].concurrency == 0


def test_repeated_rounds_report_each_figure_as_its_median_over_the_rounds():
    from bench.serve import median_run, table

    def rnd(tok_s, ttft_p99, itl_p99, failed=0):
        return {"streams": 16, "requests": 16, "failed": failed, "errors": ["boom"] if failed else [],
                "output_tokens": 4096, "wall_s": 4096 / tok_s, "total_tok_s": tok_s, "per_stream_tok_s": tok_s / 16,
                "ttft_p50_s": ttft_p99 / 2, "ttft_p99_s": ttft_p99, "ttft_max_s": ttft_p99, "itl_p50_s": 0.005,
                "itl_p99_s": itl_p99, "return_ttft_p50_s": None, "return_ttft_mean_s": None,
                "return_cached_share": None, "prompts": [[1, 2]], "requests_detail": []}

    # one slow outlier round in each figure, each in a different round: the medians ignore all three
    run = median_run([rnd(1000.0, 0.2, 0.010), rnd(400.0, 0.21, 0.011), rnd(1010.0, 0.9, 0.012),
                      rnd(990.0, 0.19, 0.050, failed=1)])
    assert run["total_tok_s"] == pytest.approx(995.0)
    assert run["ttft_p99_s"] == pytest.approx(0.205) and run["itl_p99_s"] == pytest.approx(0.0115)
    assert (run["requests"], run["failed"], run["errors"]) == (64, 1, ["boom"])
    assert len(run["rounds"]) == 4 and "prompts" in run and all("prompts" not in r for r in run["rounds"])
    assert "| 16 (1 of 64 failed) | 995.0 |" in table([run])
