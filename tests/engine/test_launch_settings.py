"""Kernel launch settings: the defaults, a GPU's own measured file over them, a user's file over
both, and clear errors for a file that is not of that form."""
from __future__ import annotations

import json

import pytest

from ninfer.engine import launch
from ninfer.engine.layers.fused_linear import gemv_tiles
from ninfer.engine.layers.pdl import pdl_options


def test_a_gpu_gets_its_own_measured_file_and_others_the_defaults():
    h200 = launch.load("NVIDIA H200")
    assert launch.file_for("NVIDIA H200").name == "nvidia-h200.json"
    assert launch.file_for("NVIDIA H200 NVL").name == "nvidia-h200.json"  # the longest name it starts with
    assert launch.file_for("NVIDIA GeForce RTX 5060 Ti") is None and launch.file_for(None) is None
    assert h200.gemv_shape_tiles[(1, 248320, 5120)] == {"BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 8}
    assert h200.prefill_attention_tiles[256]["BLOCK_M"] == 128
    other = launch.load("NVIDIA GeForce RTX 5060 Ti")
    assert other == launch.LaunchSettings() and other.gemv_shape_tiles == {}
    assert other.prefill_attention_tiles[256]["num_stages"] == 1  # fits a consumer card's shared memory


def test_kernels_follow_the_settings_in_force():
    with launch.using(launch.load("NVIDIA H200")):
        assert gemv_tiles(1, 12352, 2048) == {"BLOCK_N": 1, "BLOCK_K": 256, "num_warps": 1}  # measured there
        with launch.using(gemv_max_rows=0):
            assert gemv_tiles(1, 12352, 2048) is None  # every projection through cuBLAS
        assert gemv_tiles(1, 12352, 2048) is not None  # put back
    with launch.using(launch.load(None)):
        assert gemv_tiles(1, 12352, 2048) is None  # wide and not measured here: cuBLAS
        assert gemv_tiles(1, 2000, 4096) == launch.LaunchSettings().gemv_row_tiles[0][1]  # the rule: tall K


def test_pdl_follows_the_setting():
    import torch

    x = torch.zeros(1)
    for mode in ("off", "first", "late"):
        with launch.using(pdl=mode):
            assert pdl_options(x) == {"PDL": 0}  # never on a CPU tensor
            assert launch.current().pdl_mode == {"off": 0, "first": 1, "late": 2}[mode]
    with pytest.raises(ValueError, match="pdl='1': expected one of off, first, late"):
        launch.LaunchSettings(pdl="1")


def test_a_user_file_goes_over_the_gpus_own_entry_by_entry(tmp_path):
    extra = tmp_path / "mine.json"
    extra.write_text(json.dumps({"about": {"pdl": "timed on my card"}, "pdl": "off",
                                 "gemv_shape_tiles": {"1,5120,6144": None, "2,4096,4096": {"BLOCK_N": 4}},
                                 "moe_norm_route_tiles": [[8, {"ROWS": 4, "TOKENS": 1, "num_warps": 2}]]}))
    s = launch.load("NVIDIA H200", extra)
    h200 = launch.load("NVIDIA H200")
    assert s.pdl == "off" and s.gemv_shape_tiles[(1, 5120, 6144)] is None
    assert s.gemv_shape_tiles[(2, 4096, 4096)] == {"BLOCK_N": 4}
    assert s.gemv_shape_tiles[(1, 248320, 5120)] == h200.gemv_shape_tiles[(1, 248320, 5120)]  # kept
    assert s.moe_norm_route_tiles == ((8, {"ROWS": 4, "TOKENS": 1, "num_warps": 2}),)


@pytest.mark.parametrize("data, why", [
    ({"gemv_tiles": {}}, "'gemv_tiles' is not a launch setting"),
    ({"gemv_shape_tiles": {"1,x,2": {}}}, "gemv_shape_tiles key '1,x,2' is not an int or ints joined by commas"),
    ({"gemv_shape_tiles": [1, 2]}, "gemv_shape_tiles must be a table"),
    ({"moe_norm_route_tiles": {"1": {}}}, "moe_norm_route_tiles must be a list of [bound, tiles] pairs"),
    ({"attention_max_splits": "32"}, "attention_max_splits holds int, got str"),
    ({"pdl": "sometimes"}, "pdl='sometimes': expected one of off, first, late"),
])
def test_a_bad_file_is_refused_naming_the_entry(tmp_path, data, why):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=pytest.importorskip("re").escape(why)):
        launch.load(None, bad)


def test_a_file_that_is_not_there_or_not_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tuned config .*missing.json: No such file"):
        launch.load(None, tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        launch.load(None, tmp_path / "x.json")
