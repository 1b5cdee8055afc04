"""The prompt rows' chunk tables a step carries for the Gated DeltaNet kernels: the (row, chunk)
pairs and each row's first pair."""
from __future__ import annotations

import pytest
import torch

from ninfer.engine.models.base import GDN_CHUNK, chunk_offsets, chunk_pairs


@pytest.mark.parametrize("bounds", [[0, 1], [0, 64, 65], [0, 300, 301, 303, 1100], [0, 63, 127, 128, 256]])
def test_each_rows_first_chunk_is_where_its_pairs_begin(bounds):
    pairs = torch.tensor(chunk_pairs(bounds)).view(-1, 2)
    offsets = chunk_offsets(bounds)
    assert len(offsets) == len(bounds) and offsets[-1] == pairs.shape[0]
    for row in range(len(bounds) - 1):
        mine = pairs[offsets[row]:offsets[row + 1]]
        assert mine[:, 0].eq(row).all() and mine[:, 1].tolist() == list(range(mine.shape[0]))
        assert mine.shape[0] * GDN_CHUNK >= bounds[row + 1] - bounds[row] > (mine.shape[0] - 1) * GDN_CHUNK
