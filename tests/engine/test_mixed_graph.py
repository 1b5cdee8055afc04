"""Steps with prompt rows through captured pieces (``cuda_graph_mixed.py``) on a CPU: each piece
is a recording of the operations its capture ran, replayed over the same tensors
(``support/recorded_graph.py``), so the pieces see only what a CUDA graph would: the token ids
copied into the static input, the cores' results copied into their static outputs, nothing the
host decided during the capture. Greedy outputs equal those of eager steps for the dense
hybrid and the Llama families, prompts beside decode rows and prompts padded to their bucket;
steps longer than the largest bucket stay eager beside them. (A MoE block's CPU form reads its
experts' token counts on the host, which no graph can hold; on a GPU its kernels take the
capture: ``tests/gpu/test_mixed_graph_gpu.py``.)"""
from __future__ import annotations

import gc

import logging

import pytest
import torch

from ninfer.engine.cuda_graph_mixed import PROMPT, ROWS, MixedGraphs, _flat
from ninfer.engine.graph_buckets import kept_per_token
from ninfer.engine.loader import load_checkpoint, load_model
from support.mtp_weights import add_mtp_weights
from support.overlap import drive
from support.recorded_graph import RecordedGraph
from support.tiny import save_tiny_llama, save_tiny_qwen3_5

FAMILIES = {"qwen3_5": save_tiny_qwen3_5, "llama": save_tiny_llama}


@pytest.fixture(scope="module", params=list(FAMILIES))
def parts(request, tmp_path_factory):
    ckpt = load_checkpoint(FAMILIES[request.param](tmp_path_factory.mktemp("ckpt") / "ckpt"))
    return load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer


def install(max_tokens: int, runs: list, kinds=(PROMPT,)):
    """``prepare`` for ``drive``: the engine's steps of ``kinds`` through pieces captured for
    buckets up to ``max_tokens``; ``runs`` gets each such step's kind and token count."""

    def prepare(engine):
        runner = engine.runner
        with torch.inference_mode():
            mixed = MixedGraphs(runner.model, runner.device, max_tokens, graph=RecordedGraph, kinds=kinds)
            mixed.capture()
        assert sorted(mixed.captured) == sorted((k, b) for k in kinds for b in (16, 32, 48, 64) if b <= max_tokens)
        run = mixed.run

        def counted(input_ids, batch):
            runs.append((mixed.kind(batch), input_ids.shape[0]))
            return run(input_ids, batch)

        mixed.run = counted
        runner.mixed_graphs = mixed

    return prepare


# prompts of 6, 15, 24, 33 and 42 tokens (``support.overlap.prompt``), 32-token chunks: the
# first steps hold several prompts, later ones a prompt's tail beside decode rows
SPECS = {0: {"max_tokens": 24}, 1: {"max_tokens": 10}, 2: {"max_tokens": 16}, 3: {"max_tokens": 8},
         4: {"max_tokens": 12}}
ARRIVALS = {3: (0, 2), 4: (1, 5)}  # prompts that come while others decode


def test_steps_with_prompt_rows_from_the_pieces_give_the_eager_tokens(parts):
    eager, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS))
    runs: list[int] = []
    pieces, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS), prepare=install(64, runs))
    assert pieces == eager
    assert len(runs) >= 3 and any(n % 16 for _, n in runs)  # several steps, padded ones among them


def test_steps_past_the_largest_bucket_stay_eager_beside_those_in_pieces(parts):
    eager, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS))
    runs: list[int] = []
    pieces, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS), prepare=install(16, runs))
    assert pieces == eager
    assert runs and max(n for _, n in runs) <= 16  # the longer steps (a 32-token chunk, several prompts) ran eagerly


def test_mtp_steps_in_pieces_give_the_tokens_without_drafts(tmp_path_factory):
    """With the MTP head every step runs from the pieces that hold it (prompt rows, and the rows
    that verify the head's drafts, whose final hidden states the head reads after the step)."""
    path = add_mtp_weights(save_tiny_qwen3_5(tmp_path_factory.mktemp("mtp") / "ckpt"))
    ckpt = load_checkpoint(path)
    parts = load_model(ckpt, "cpu", torch.float32, mtp=True), ckpt.tokenizer
    plain, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS))
    runs: list = []
    engines: list = []
    fast, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS), spec="mtp", draft_tokens=3, engine_out=engines,
                    prepare=install(64, runs, kinds=(PROMPT, ROWS)))
    assert fast == plain
    assert engines[0].counters.spec_rounds > 0
    assert {kind for kind, _ in runs} == {PROMPT, ROWS}


def test_steps_with_the_gdn_cores_inside_the_pieces_give_the_eager_tokens(tmp_path_factory, monkeypatch):
    """Kinds ONE and FEW on a CPU, through the torch reference of ``graph_rows`` (which no CPU
    bucket takes unless asked): the Gated DeltaNet cores run inside the recorded pieces over
    every token of the bucket, their rows read from ``GraphRows`` (loaded before each replay),
    the rows of no tokens and the decode rows past the real ones on the padding slot. The
    greedy tokens are those of the eager steps; steps of one prompt row and of several take them."""
    from ninfer.engine.cuda_graph_mixed import FEW, ONE
    from ninfer.engine.layers.backends import TorchLinearAttention

    ckpt = load_checkpoint(save_tiny_qwen3_5(tmp_path_factory.mktemp("rows") / "ckpt"))
    parts = load_model(ckpt, "cpu", torch.float32), ckpt.tokenizer
    eager, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS))
    monkeypatch.setattr(TorchLinearAttention, "rows_in_graph", True)
    runs: list = []
    base = install(64, runs)

    def prepare(engine):
        base(engine)
        mixed = engine.runner.mixed_graphs
        with torch.inference_mode():
            mixed.capture_rows(engine.caches, engine.config.max_concurrency, 32, 3)
        assert sorted(mixed.captured) == sorted((k, t) for k in (PROMPT, ONE, FEW) for t in (16, 32, 48, 64)
                                                if k == PROMPT or t <= 32)
        run = mixed.run
        mixed.run = lambda ids, batch: runs.append(mixed._key(batch, ids.shape[0])[0]) or run(ids, batch)

    graphed, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS), prepare=prepare)
    assert graphed == eager
    assert runs.count(ONE) >= 3 and FEW in runs


def test_a_forward_that_reads_the_device_on_the_host_is_not_captured(parts, caplog):
    """A piece that takes a value to the host would replay it frozen: the capture refuses it,
    and the steps it would have taken stay eager."""
    model, _ = parts
    norm = model.model.norm
    forward = norm.forward

    def reading(x, residual=None):
        float(x.abs().max())  # a host read, as a stray ``.item()`` in a layer would be
        return forward(x, residual)

    norm.forward = reading
    try:
        with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="ninfer.engine"):
            mixed = MixedGraphs(model, torch.device("cpu"), 32, graph=RecordedGraph)
            mixed.capture()
    finally:
        del norm.forward
    assert mixed.captured == {}
    assert "stay eager" in caplog.text


def test_no_graph_is_freed_by_the_collector_while_a_bucket_captures(parts, monkeypatch):
    """A graph destroyed while a stream captures invalidates that capture (an engine made before
    this one, its graphs in reference cycles, freed by the garbage collector mid-capture left a
    bucket's steps eager): the collector stays off while a bucket captures and frees such
    garbage before the next, and every bucket is captured."""
    model, _ = parts
    freed: list[bool] = []  # whether a capture was under way when the old graph was freed
    capturing = []

    class OldGraph:  # an earlier engine's graph, reachable only through a cycle
        def __init__(self) -> None:
            self.cycle = self

        def __del__(self) -> None:
            freed.append(bool(capturing))

    class Watched(RecordedGraph):
        def capture_begin(self, pool=None) -> None:
            capturing.append(self)
            OldGraph()  # garbage the collector would free at its next run
            super().capture_begin(pool)

        def capture_end(self) -> None:
            super().capture_end()
            capturing.remove(self)

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # the collector runs at almost every allocation it is allowed to
    try:
        with torch.inference_mode():
            mixed = MixedGraphs(model, torch.device("cpu"), 32, graph=Watched)
            mixed.capture()
        gc.collect()
    finally:
        gc.set_threshold(*threshold)
    assert sorted(t for _, t in mixed.captured) == [16, 32]
    assert freed and not any(freed)


def test_the_buckets_keep_nothing_of_their_own_and_share_the_cores_inputs_and_outputs(parts):
    """A bucket keeps nothing of its own between steps: its final hidden states go to one shared
    output, and the cores' static inputs and outputs are one set per kind of core (attention,
    Gated DeltaNet), all sized for the largest bucket: the kept bytes are the shared set of 64
    tokens, however many buckets there are."""
    model, _ = parts
    with torch.inference_mode():
        mixed = MixedGraphs(model, torch.device("cpu"), 64, graph=RecordedGraph)
        mixed.capture()
    assert sorted(t for _, t in mixed.captured) == [16, 32, 48, 64]
    elt = next(model.parameters()).element_size()
    assert mixed.per_token == 0
    assert {x.shape[0] for x in mixed.shared.values()} == {64}
    assert mixed.held_bytes() == pytest.approx(mixed.shared_per_token * 64, rel=1e-6)
    assert mixed.shared_per_token > model.config.hidden_size * elt  # (the final hidden states among them)
    assert len({b.hidden.data_ptr() for b in mixed.captured.values()}) == 1
    shared = {x.untyped_storage().data_ptr() for x in mixed.shared.values()}
    for t in (16, 64):
        cores = mixed.captured[PROMPT, t].cores
        assert len(cores) == model.config.num_hidden_layers
        for kind in (True, False):  # every core of a kind: the same output, inputs on the shared storages
            same = [c for c in cores if c.attention is kind]
            assert len({c.out.data_ptr() for c in same}) <= 1
            assert all(x.untyped_storage().data_ptr() in shared for c in same for x in _flat(c.inputs))


def test_a_memory_budget_leaves_the_larger_buckets_out_and_their_steps_eager(parts):
    """A budget that holds the buckets up to 32 tokens with the largest one's work while it is
    captured (the pieces of 48 and 64 would pass it):
    only those are captured, within it, and the steps past them run eagerly with the same tokens."""
    model, tok = parts
    with torch.inference_mode():
        whole = MixedGraphs(model, torch.device("cpu"), 64, graph=RecordedGraph)
    top = whole.shared_per_token + whole.work_per_token  # a token of the largest: shared tensors, its capture's work
    budget = int(whole.per_token * (16 + 32) + top * 32) + 1
    with torch.inference_mode():
        mixed = MixedGraphs(model, torch.device("cpu"), 64, graph=RecordedGraph, budget=budget)
        mixed.capture()
    assert sorted(t for _, t in mixed.captured) == [16, 32]
    assert mixed.held_bytes() <= budget < whole.per_token * (16 + 32 + 48) + top * 48

    eager, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS))
    runs: list = []

    def prepare(engine):
        run = mixed.run

        def counted(input_ids, batch):
            runs.append(input_ids.shape[0])
            return run(input_ids, batch)

        mixed.run = counted
        engine.runner.mixed_graphs = mixed

    pieces, _ = drive(parts, False, SPECS, arrivals=dict(ARRIVALS), prepare=prepare)
    assert pieces == eager and runs and max(runs) <= 32


def test_the_plan_counts_what_the_probe_measures(parts):
    """The launcher's plan reckons the pieces' memory from the shapes (``kept_per_token``): the
    same bytes a token as the probe measures on the model."""
    model, _ = parts
    with torch.inference_mode():
        mixed = MixedGraphs(model, torch.device("cpu"), 16, graph=RecordedGraph)
    elt = next(model.parameters()).element_size()
    assert kept_per_token(model.config, elt) == (mixed.per_token, mixed.shared_per_token)


def test_graph_rows_hold_each_steps_rows_on_the_device():
    """``GraphRows`` (kinds ONE and FEW, CUDA): before each replay the step's decode rows' slots
    (-1 past them, where the fused decode kernel does nothing), the prompt rows' bounds in the
    flat run (after the decode rows), slots and chunk table are written into the tensors the
    graph reads. With one row the table is the same for every step; with several, rows of no
    tokens on the padding slot follow the step's own, and chunks past row 0's end its chunks."""
    from types import SimpleNamespace

    from ninfer.engine.cuda_graph_mixed import GraphRows
    from ninfer.engine.models.base import chunk_offsets, chunk_pairs

    def step(slots: list[int], decode: int, lengths: list[int]):
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        prompt = SimpleNamespace(cu_seqlens_long=torch.tensor(cu), cu_seqlens_host=torch.tensor(cu),
                                 slots_host=slots[decode:], chunks=torch.tensor(chunk_pairs(cu)).view(-1, 2),
                                 chunk_offsets=torch.tensor(chunk_offsets(cu)))
        return SimpleNamespace(num_decode=decode, slot_ids=torch.tensor(slots), prompt=prompt)

    one = GraphRows(max_tokens=200, max_decode=4, max_rows=1, pad_slot=9, device=torch.device("cpu"))
    view = one.view(64)
    assert view.decode_slots.shape == (4,) and view.chunks.tolist() == [[0, 0]]
    assert one.view(2).decode_slots.shape == (2,) and one.view(200).chunks[:, 1].tolist() == [0, 1, 2, 3]
    assert one.prompt_slots.tolist() == [9]  # the padding slot until a step's rows come
    one.load(step([5, 3, 7], 2, [40]))
    assert view.decode_slots.tolist() == [5, 3, -1, -1]
    assert one.cu_seqlens.tolist() == [2, 42] and one.prompt_slots.tolist() == [7]
    one.load(step([6], 0, [17]))
    assert view.decode_slots.tolist() == [-1, -1, -1, -1]
    assert one.cu_seqlens.tolist() == [0, 17] and one.prompt_slots.tolist() == [6]
    assert one.chunks[:, 1].tolist() == [0, 1, 2, 3]

    few = GraphRows(max_tokens=256, max_decode=4, max_rows=4, pad_slot=9, device=torch.device("cpu"))
    view = few.view(256)
    assert view.chunks.shape == (4 + 4, 2) and view.cu_seqlens.shape == (5,)
    few.load(step([5, 3, 7, 8], 1, [100, 30, 2]))
    assert view.decode_slots.tolist() == [5, -1, -1, -1]
    assert few.cu_seqlens.tolist() == [1, 101, 131, 133, 133] and few.prompt_slots.tolist() == [3, 7, 8, 9]
    # rows 0 (two chunks), 1 and 2, then chunks past row 0's end (256 tokens: chunk 4 on)
    assert view.chunks.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [0, 4], [0, 4], [0, 4], [0, 4]]
    assert few.chunk_offsets.tolist() == [0, 2, 3, 4, 4]
    few.load(step([6, 2], 0, [10, 5]))
    assert few.cu_seqlens.tolist() == [0, 10, 15, 15, 15] and few.prompt_slots.tolist() == [6, 2, 9, 9]
    assert view.chunks.tolist()[:3] == [[0, 0], [1, 0], [0, 4]] and few.chunk_offsets.tolist() == [0, 1, 2, 2, 2]


def test_steps_take_the_gdn_core_buckets_only_where_their_rows_fit():
    """Which captured bucket a step with prompt rows replays: one prompt row -> kind ONE, two to
    ``gdn_graph_rows`` -> FEW, each only while its decode rows fit the bucket's decode kernel and
    no row verifies a draft; more prompt rows, or a bucket not captured for the kind, -> the
    pieces with the cores eager (PROMPT)."""
    from types import SimpleNamespace

    from ninfer.engine.cuda_graph_mixed import FEW, ONE, GraphRows

    graphs = MixedGraphs.__new__(MixedGraphs)
    graphs.buckets = [16, 32, 64]
    graphs.captured = {(k, t): None for k in (PROMPT, ONE, FEW) for t in (16, 32)} | {(PROMPT, 64): None}
    cpu = torch.device("cpu")
    graphs.rows = {ONE: GraphRows(32, 4, 1, 0, cpu), FEW: GraphRows(32, 4, 3, 0, cpu)}

    def key(prompt_rows: int, decode: int, n: int, verify=None):
        prompt = SimpleNamespace(slots_host=list(range(prompt_rows))) if prompt_rows else None
        return graphs._key(SimpleNamespace(step=SimpleNamespace(prompt=prompt, num_decode=decode, verify=verify)), n)

    assert key(1, 0, 10) == (ONE, 16) and key(1, 4, 20) == (ONE, 32)
    assert key(2, 3, 30) == (FEW, 32) and key(3, 0, 16) == (FEW, 16)
    assert key(4, 0, 16) == (PROMPT, 16)  # more prompt rows than FEW holds
    assert key(1, 5, 30) == (PROMPT, 32)  # more decode rows than the bucket's decode kernel
    assert key(1, 0, 40) == (PROMPT, 64)  # past the kinds' largest bucket
    assert key(1, 0, 10, verify=object()) == (PROMPT, 16)
    assert key(0, 8, 8) is None  # decode rows only: the decode graphs' step, not the pieces'


def test_the_gdn_core_buckets_are_captured_within_the_room_the_caches_leave():
    """``graph_buckets.rows_buckets_within``: the kinds ONE and FEW keep nothing of their own
    (their outputs are kind PROMPT's shared ones) and run the largest bucket's Gated DeltaNet
    core in the graphs' pool; the largest buckets go until that fits the room the caches and a
    step's work leave."""
    from ninfer.bench.shapes import shape_config
    from ninfer.engine.graph_buckets import BUCKETS, gdn_core_bytes, rows_buckets_within

    cfg = shape_config("qwen3.5-9b")
    every = [b for b in BUCKETS if b <= 2048]
    need = gdn_core_bytes(cfg, 2048, 16, 2)
    assert 100 << 20 < need < 1 << 30  # the 9B's: a few hundred MiB for the core of 2,048 tokens
    assert rows_buckets_within(every, cfg, 16, 2, None) == every
    assert rows_buckets_within(every, cfg, 16, 2, need) == every
    fewer = rows_buckets_within(every, cfg, 16, 2, need // 2)
    assert fewer == every[: len(fewer)] and 0 < len(fewer) < len(every)
    assert rows_buckets_within(every, cfg, 16, 2, 0) == []
    # one prompt row's core takes less than sixteen rows'; counted in the kernels' own chunks
    from ninfer.engine import graph_buckets
    from ninfer.engine.models.base import GDN_CHUNK

    assert graph_buckets.GDN_CHUNK == GDN_CHUNK
    assert gdn_core_bytes(cfg, 512, 1, 2) < gdn_core_bytes(cfg, 512, 16, 2)
