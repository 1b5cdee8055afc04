"""The decode benchmark's harness runs end to end (on the CPU, on a tiny hybrid shape), so GPU
time is never spent finding a bug in the bench itself."""
from __future__ import annotations

import re

from bench.decode import bench_ours, bytes_per_step, table
from ninfer.engine.config import ModelConfig

TINY = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "full_attention_interval": 4,
}


def test_bench_harness_on_cpu():
    cfg = ModelConfig.from_hf_dict(TINY)
    out = bench_ours(cfg, [1, 3], context=40, prefills=[24, 48], steps=5, device="cpu")
    for b in (1, 3):
        d = out["decode"][b]
        assert d["tok_s"] > 0 and d["ms_per_step"] > 0 and d["graph_ms"] is None
        assert d["bytes_per_step"] == bytes_per_step(cfg, b, 40)
    assert set(out["prefill"]) == {24, 48} and all(p["tok_s"] > 0 for p in out["prefill"].values())


def test_bench_harness_times_every_request_of_a_large_batch():
    """``--batches 1,16,64``: the first of 64 requests decodes while the other 63 are prefilled,
    one prompt a step; each still decodes through every timed step (a request that had
    finished left the graph timing a request without a cache, and the step time one of fewer)."""
    cfg = ModelConfig.from_hf_dict(TINY)
    out = bench_ours(cfg, [1, 64], context=24, prefills=[16], steps=3, device="cpu")
    assert set(out["decode"]) == {1, 64} and all(d["tok_s"] > 0 for d in out["decode"].values())


def test_verify_rows_are_timed_beside_the_decode_step_and_shown_in_the_table():
    """``--verify 4``: every timed step checks a row of 4 tokens per request (3 drafts the random
    weights reject, so one token a row is kept), and the table puts its time beside decode's."""
    cfg = ModelConfig.from_hf_dict(TINY)
    out = bench_ours(cfg, [1, 3], context=24, prefills=[], steps=4, device="cpu", verify=4)
    for b in (1, 3):
        v = out["decode"][b]["verify"]
        assert v["rows"] == 4 and v["ms_per_step"] > 0
        assert v["vs_decode"] == v["ms_per_step"] / out["decode"][b]["ms_per_step"]
        assert v["drafts_per_row"] == 3  # a full row checked in every round
        assert 1.0 <= v["tokens_per_row"] < 1.5  # the model's own token kept
        assert v["graph_steps"] == 0  # on a CPU every verify step runs eagerly
    text = table({"tiny": {"ninfer": out}}, {"gpu": "cpu", "copy_gb_s": 10.0, "matmul_tflops": 1.0})
    row = next(line for line in text.splitlines() if "verify b=3" in line)
    assert f"{out['decode'][3]['verify']['vs_decode']:.2f}x the decode step" in row and "a step, eager" in row
    assert f"{2.8 / out['decode'][3]['verify']['vs_decode']:.2f}x decode" in row


def test_bytes_per_step_grows_with_batch_and_context():
    cfg = ModelConfig.from_hf_dict(TINY)
    assert bytes_per_step(cfg, 8, 40) > bytes_per_step(cfg, 1, 40)
    assert bytes_per_step(cfg, 1, 4000) > bytes_per_step(cfg, 1, 40)


def test_peer_harness_on_cpu_reads_both_decode_figures_and_the_table_shows_them():
    from bench.decode import bench_hf, table

    cfg = ModelConfig.from_hf_dict(TINY)
    hf = bench_hf(cfg, [1, 2], context=24, prefills=[16], steps=3, device="cpu")
    for b in (1, 2):
        d = hf["decode"][b]
        assert d["tok_s"] > 0 and d["generate_tok_s"] > 0 and d["generate_ms_per_step"] > 0
    assert hf["prefill"][16]["tok_s"] > 0
    ours = bench_ours(cfg, [1], context=24, prefills=[16], steps=3, device="cpu")
    text = table({"tiny": {"ninfer": ours, "hf": hf}}, {"gpu": "cpu", "copy_gb_s": 10.0, "matmul_tflops": 1.0})
    row = next(line for line in text.splitlines() if "decode b=1" in line)
    loop, gen = hf["decode"][1]["tok_s"], hf["decode"][1]["generate_tok_s"]
    assert f"{loop:.1f}; {gen:.1f} tok/s" in row
    assert f"{ours['decode'][1]['tok_s'] / gen:.1f}x" in row
    floor_ms = ours["decode"][1]["bytes_per_step"] / 10e9 * 1e3  # one decimal: 84.6% is not 85%
    assert row.endswith(f"| {100 * floor_ms / ours['decode'][1]['ms_per_step']:.1f}% |")


def test_set_changes_launch_settings_and_rejects_what_is_not_there():
    """``bench.decode --set``: a launch setting, or one entry of a table setting, changed to a
    literal of its type; a wrong name, literal, type or value is a clear error, and nothing is
    half-changed."""
    import re

    import pytest

    from bench.decode import main
    from ninfer.engine import launch

    changes, made = launch.changes_from_specs(["attention_max_splits=16", "attention_shape_tiles={}", "pdl='off'"])
    assert changes == {"attention_max_splits": 16, "attention_shape_tiles": {}, "pdl": "off"}
    assert made == ["attention_max_splits=16", "attention_shape_tiles={}", "pdl='off'"]
    before = launch.current()
    for spec, why in [("attention_max_splits", "expected NAME=VALUE"),
                      ("attention_max_split=1", "attention_max_split is not a launch setting"),
                      ("attention_max_splits=lots", "is not a Python literal"),
                      ("attention_max_splits=1.5", "attention_max_splits holds int, not float"),
                      ("attention_max_splits[1]=2", "attention_max_splits holds int, not a table"),
                      ("pdl='sometimes'", "pdl='sometimes': expected one of off, first, late"),
                      ("norm_gemv_shape_tiles[(1, 1, 1)]=3", "holds dict values, not int")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            launch.changes_from_specs(["attention_max_splits=8", spec])
    assert launch.current() is before  # nothing put in force

    with launch.using(launch.load("NVIDIA H200")):
        table = launch.current().norm_gemv_shape_tiles
        changes, made = launch.changes_from_specs(['norm_gemv_shape_tiles[(1, 8192, 2048)]='
                                                   '{"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 1}',
                                                   'norm_gemv_shape_tiles[(1, 9216, 2048)]={"BLOCK_N": 2}'])
    assert changes["norm_gemv_shape_tiles"] == {**table, (1, 8192, 2048): {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 1},
                                                (1, 9216, 2048): {"BLOCK_N": 2}}
    assert made[0].startswith("norm_gemv_shape_tiles[(1, 8192, 2048)]=")
    with pytest.raises(SystemExit) as e:  # the command line refuses it before touching the GPU
        main(["--shape", "qwen3.5-0.8b", "--set", "attention_max_splits=x"])
    assert e.value.code == 2


def test_prefill_beside_decoders_reads_the_prompt_rate_and_their_gaps_with_and_without_it():
    """``--beside 3``: each prompt is prefilled again while three requests decode; the decoders
    go on decoding through every prompt (none runs out of tokens or context), and the table
    shows the prompt's rate and their gap p99 with and without it."""
    cfg = ModelConfig.from_hf_dict(TINY)
    out = bench_ours(cfg, [1], context=24, prefills=[40], steps=4, device="cpu", prefill_chunk=16, beside=3)
    b = out["prefill"][40]["beside"]
    assert b["decoders"] == 3 and b["prefill_tok_s"] > 0
    assert 0 < b["gap_p99_alone_ms"] and 0 < b["gap_p99_beside_ms"]
    assert b["gap_ratio"] == b["gap_p99_beside_ms"] / b["gap_p99_alone_ms"]
    shown = table({"tiny": {"ninfer": out}}, {"gpu": "cpu", "copy_gb_s": 10.0, "matmul_tflops": 1.0})
    assert "prefill 40 beside 3 decoding" in shown and f"({b['gap_ratio']:.1f}x)" in shown


def test_vision_bench_on_cpu_times_ninfer_and_the_peer_and_the_table_shows_both(tmp_path, capsys):
    """``bench.vision --shape tiny``: a 256 x 256 PNG (Qwen3.5's smallest pixel budget: 64
    tokens) through the processing, the tower and a served request, encoded once in it and not
    at all when its embeddings are given; the peer on the same grid; four rows, both sides."""
    import json

    from bench.vision import main

    out = tmp_path / "vision.json"
    assert main(["--shape", "tiny", "--megapixels", "0.0625", "--reps", "1", "--text", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    ours, hf = res["ninfer"]["0.0625"], res["hf"]["0.0625"]
    assert ours["pixels"] == "256x256" and ours["patches"] == 256 and ours["image_tokens"] == 64
    assert ours["prompt_tokens"] == hf["prompt_tokens"] == 8 + 2 + 64  # the text, the vision start / end, the image
    for side in (ours, hf):
        assert all(side[k] > 0 for k in ("preprocess_ms", "encode_ms", "prefill_tok_s", "prefill_tok_s_embeds_given"))
    final = capsys.readouterr().out.split("\n\n")[-1]
    rows = [line for line in final.splitlines() if line.startswith("| tiny | 0.0625 MP (256x256, 64 tokens) |")]
    assert [r.split(" | ")[2] for r in rows] == [
        "preprocess (PNG decode + patches)", "encode (vision tower)", "prefill of 74 tokens, encode in it",
        "prefill, the image's embeddings given"]
    encode = f"{ours['encode_ms']:.1f} ms | {hf['encode_ms']:.1f} ms | {hf['encode_ms'] / ours['encode_ms']:.2f}x |"
    assert encode in rows[1]
    assert rows[2].endswith(f"| {ours['prefill_tok_s'] / hf['prefill_tok_s']:.2f}x |")


def test_int4_moe_floor_counts_the_held_experts_a_step_reads():
    """``--weights int4`` on a MoE shape: the experts are held in 4 bits too, and a step's floor
    counts the share of them its routing reads (2 of 16 at one token, 6 at three)."""
    from bench.decode import _engine, streamed_weight_bytes
    from ninfer.engine.layers.moe import QuantizedExperts

    moe = dict(TINY, model_type="qwen3_5_moe_text", num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=32, intermediate_size=32)
    cfg = ModelConfig.from_hf_dict(moe)
    out = bench_ours(cfg, [1, 3], context=24, prefills=[], steps=3, device="cpu", bits=4)
    model = _engine(cfg, 3, 24, 3, 0, "cpu", bits=4).model
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_held, QuantizedExperts) and isinstance(experts.down_held, QuantizedExperts)
    held = sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, type(experts))
               for t in m.buffers())
    one, three = streamed_weight_bytes(model, 1), streamed_weight_bytes(model, 3)
    assert three - one == held * 4 // 16  # four more experts of 16 read
    assert out["decode"][1]["bytes_per_step"] < out["decode"][3]["bytes_per_step"]


def test_int4_floor_counts_a_fused_projection_once(monkeypatch):
    """The projections fused after quantizing (one method, the parts views of its tensors, as
    the GPU holds them) stream the bytes they did apart: the floor of a 4-bit step is not
    doubled by the views. (The GPU's method built on the CPU: only its tensors are looked at.)"""
    import torch

    from bench.decode import quantize_, randomize_, streamed_weight_bytes
    from ninfer.engine.layers import linear
    from ninfer.engine.layers.fused_linear import fuse_model_projections
    from ninfer.engine.models.registry import build_model

    monkeypatch.setattr(linear, "quantized_method", lambda w, device: linear.TritonGroupMethod.from_groups(w, device))
    cfg = ModelConfig.from_hf_dict(dict(TINY, hidden_size=256, intermediate_size=512))
    model = build_model(cfg, dtype=torch.float32, device="cpu")
    randomize_(model)
    quantize_(model, 4)
    apart = streamed_weight_bytes(model)
    assert fuse_model_projections(model) > 0
    assert streamed_weight_bytes(model) == apart


def test_the_memory_report_groups_live_blocks_by_pool_and_source():
    """``bench.memory``'s reading of torch's allocator snapshot: reserved and allocated bytes per
    pool (a CUDA graph's private pool apart from the default one), and the live blocks summed by
    the package's own frames of the stack that made them, largest first; freed blocks left out."""
    from bench.memory import by_source, pools

    def frame(file, line, name):
        return {"filename": f"/x/ninfer/engine/{file}", "line": line, "name": name}

    linear = [frame("linear.py", 276, "forward"), {"filename": "/usr/lib/torch/nn.py", "line": 1, "name": "call"},
              frame("mlp.py", 30, "_rows")]
    kv = [frame("kv_pool.py", 64, "__init__")]
    snapshot = {"segments": [
        {"segment_pool_id": (0, 0), "total_size": 300, "allocated_size": 250, "blocks": [
            {"state": "active_allocated", "size": 200, "frames": kv},
            {"state": "active_allocated", "size": 50, "frames": linear},
            {"state": "inactive", "size": 50, "frames": linear}]},
        {"segment_pool_id": (0, 1), "total_size": 120, "allocated_size": 70, "blocks": [
            {"state": "active_allocated", "size": 40, "frames": linear},
            {"state": "active_allocated", "size": 30, "frames": linear},
            {"state": "active_pending_free", "size": 50, "frames": kv}]},
    ]}
    assert pools(snapshot) == {"default": (300, 250), "graphs (0, 1)": (120, 70)}
    assert by_source(snapshot) == [
        ("default", "kv_pool.py:64:__init__", 200),
        ("graphs (0, 1)", "linear.py:276:forward <- mlp.py:30:_rows", 70),
        ("default", "linear.py:276:forward <- mlp.py:30:_rows", 50),
    ]
    assert by_source(snapshot, top=1) == [("default", "kv_pool.py:64:__init__", 200)]


def test_the_memory_report_says_what_grew_the_graphs_pools():
    """A CUDA graphs' pool is mostly free blocks between replays: ``bench.memory`` reads the
    allocator's segment allocations at that pool's addresses, summed by the source that asked."""
    from bench.memory import segment_growth

    mlp = [{"filename": "/x/ninfer/engine/layers/mlp.py", "line": 30, "name": "_rows"}]
    deq = [{"filename": "/x/ninfer/engine/layers/linear.py", "line": 90, "name": "dequantize"}]
    snapshot = {
        "segments": [{"segment_pool_id": (0, 0), "address": 1000, "total_size": 64},
                     {"segment_pool_id": (0, 1), "address": 2000, "total_size": 96},
                     {"segment_pool_id": (0, 1), "address": 3000, "total_size": 32},
                     {"segment_pool_id": (0, 1), "address": 4000, "total_size": 32}],
        "device_traces": [[
            {"action": "segment_alloc", "addr": 1000, "size": 64, "frames": mlp},  # the default pool's
            {"action": "segment_alloc", "addr": 2000, "size": 96, "frames": deq},
            {"action": "alloc", "addr": 2000, "size": 96, "frames": deq},
            {"action": "segment_alloc", "addr": 3000, "size": 32, "frames": mlp},
            {"action": "segment_alloc", "addr": 4000, "size": 32, "frames": mlp},
            {"action": "segment_alloc", "addr": 5000, "size": 16, "frames": mlp},  # since given back
        ]],
    }
    assert segment_growth(snapshot) == [("graphs (0, 1)", "linear.py:90:dequantize", 1, 96),
                                        ("graphs (0, 1)", "mlp.py:30:_rows", 2, 64)]
    deep = [{"filename": f"/x/ninfer/engine/f{i}.py", "line": i, "name": "g"} for i in range(10)]
    snapshot["device_traces"][0][1]["frames"] = deep  # the build's stage shows past the innermost frames
    assert segment_growth(snapshot)[0][1] == ("f0.py:0:g <- f1.py:1:g <- f2.py:2:g <- f3.py:3:g <- ... <- "
                                              "f6.py:6:g <- f7.py:7:g <- f8.py:8:g <- f9.py:9:g")


def test_the_profile_puts_each_kernels_verify_time_beside_its_decode_time(monkeypatch, capsys):
    """``bench.profile --verify 4``: the eager decode step's kernels, then the same batch's
    verify step (rows of 4 tokens) with each operator's time beside its decode figure: the
    rows' kernels run more tokens, so the verify step's total is the larger."""
    import bench.profile as prof

    monkeypatch.setattr(prof, "shape_config", lambda name: ModelConfig.from_hf_dict(TINY))
    assert prof.main(["--shape", "tiny", "--batch", "2", "--context", "24", "--steps", "2", "--verify", "4",
                      "--top", "50"]) == 0
    out = capsys.readouterr().out
    verify = out[out.index("rows of 4 tokens"):]
    d_ms, v_ms = (float(x) for x in re.search(r"decode ([\d.]+) ms, verify ([\d.]+) ms", verify).groups())
    assert 0 < d_ms < v_ms
    # the attention and Gated DeltaNet operators are listed with a time in both steps
    lines = [ln for ln in verify.splitlines() if ln.startswith("| ") and "(" in ln and "calls" not in ln]
    assert len(lines) >= 10 and all(re.match(r"\| [\d.]+ \(\d+\) \| [\d.]+ \(\d+\) \| [+-][\d.]+ \|", ln)
                                    for ln in lines)
