"""Tensor parallelism's split of a checkpoint (``engine/parallel.py``): each rank reads only its
part of every split tensor from the safetensors file, the same part a whole tensor gives, and the
ranks' parts make up the whole; the config each rank builds its layers from."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from ninfer.engine import parallel
from ninfer.engine.loader import load_checkpoint
from ninfer.engine.loader.hf_loader import normalise_name
from support.tiny import save_tiny_qwen3_5, save_tiny_qwen3_next


class Recorded:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, sl) -> None:
        self.sl, self.read = sl, 0

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        out = self.sl[index]
        self.read += out.numel()
        return out


@pytest.fixture(scope="module", params=["moe", "next"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / request.param
    return save_tiny_qwen3_5(path, moe=True) if request.param == "moe" else save_tiny_qwen3_next(path)


def test_each_rank_reads_only_its_part_and_the_parts_make_the_whole(checkpoint):
    config = load_checkpoint(checkpoint).config
    shards = [parallel.Sharder(config, r, 2) for r in range(2)]
    split = 0
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        for saved in f.keys():
            name, whole = normalise_name(saved), f.get_tensor(saved)
            rule = shards[0].rule(name)
            parts = []
            for shard in shards:
                sl = Recorded(f.get_slice(saved))
                part = shard(name, sl)
                assert torch.equal(part, shard(name, whole.clone())), name
                parts.append(part)
                if rule not in (None, "rank0", "kv"):
                    assert sl.read * 2 <= whole.numel() + whole.shape[-1], name  # (vocab: the last rank pads)
            if rule is None:
                assert all(torch.equal(p, whole) for p in parts), name
            elif rule in ("rows", "cols"):
                split += 1
                assert torch.equal(torch.cat(parts, dim=0 if rule == "rows" else -1), whole), name
    assert split > 10


def test_the_gdn_conv_input_splits_per_q_k_v_group(checkpoint):
    config = load_checkpoint(checkpoint).config
    key = config.linear_num_key_heads * config.linear_key_head_dim
    value = config.linear_num_value_heads * config.linear_value_head_dim
    whole = torch.arange(2 * key + value).float()[:, None]
    parts = [parallel.Sharder(config, r, 2)("model.layers.0.linear_attn.conv1d.weight", whole) for r in range(2)]
    q, k, v = whole.split([key, key, value])
    assert torch.equal(parts[1], torch.cat([q[key // 2 :], k[key // 2 :], v[value // 2 :]]))


def test_the_shard_config_and_what_does_not_split():
    from ninfer.engine.config import ModelConfig

    config = ModelConfig(family="qwen3_5", model_type="qwen3_5", vocab_size=397, hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         intermediate_size=96, layer_types=["linear_attention", "full_attention"],
                         linear_num_key_heads=4, linear_num_value_heads=8)
    one = parallel.shard_config(config, 4)
    assert (one.num_attention_heads, one.num_key_value_heads, one.linear_num_key_heads,
            one.linear_num_value_heads, one.intermediate_size, one.vocab_size) == (2, 1, 1, 2, 24, 397)
    parallel.check_shardable(config, 4)
    with pytest.raises(ValueError, match="MLP intermediate size"):
        parallel.check_shardable(ModelConfig(**{**config.__dict__, "intermediate_size": 90}), 4)
    with pytest.raises(ValueError, match="KV heads"):
        parallel.check_shardable(ModelConfig(**{**config.__dict__, "num_attention_heads": 12,
                                                "num_key_value_heads": 3}), 4)
    # rank 3 of 4 holds vocabulary rows 300 .. 396, padded to 100
    head = parallel.Sharder(config, 3, 4)("lm_head.weight", torch.ones(397, 64))
    assert head.shape == (100, 64) and head[:97].eq(1).all() and head[97:].eq(0).all()
