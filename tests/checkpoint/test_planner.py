"""The checkpoint planner: what each file holds, as pieces of global tensors, recorded at save
and checked by the one reader before anything loads.

The resume tests of every path assert that the one reader ran and checked a record (ZeRO 0-3:
``load_and_continue`` in test_reshard.py; pipeline: tests/runtime/pipe; MoE and AutoEP:
tests/moe). Here: the record's arithmetic without processes, and a saved record edited so it
disagrees with the model or with itself, refused naming the tensor.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist

from shardspeed.checkpoint.files import MODEL_STATES
from shardspeed.checkpoint.planner import (
    MODULE,
    OPTIMIZER,
    PLAN_KEY,
    CheckpointPlanError,
    FilePieces,
    TensorPiece,
    layout_pieces,
    plan_load,
    read_record,
    save_record,
)
from tests.checkpoint.plan_spy import (
    captured_plans,
    check_plan,
    edit_record,
    shift_flat_piece,
    transpose_recorded,
)
from tests.checkpoint.test_reshard import _build, _full_state, _train

SHAPES = {"a": (5,), "b": (2, 2), "c": (7,)}
# two buckets of 9 elements split over 3 ranks (chunks of 3): a and b share the first
LAYOUT = [
    {"group": 0, "size": 9, "state_index": 0, "params": [["a", 0, 5], ["b", 5, 4]]},
    {"group": 0, "size": 9, "state_index": 1, "params": [["c", 0, 7]]},
]


def _shards(world: int = 3) -> list[FilePieces]:
    return [
        FilePieces(f"shard{r}", OPTIMIZER, tuple(layout_pieces(LAYOUT, world, r, SHAPES)))
        for r in range(world)
    ]


def _plan(
    holdings: list[FilePieces], expected: dict[str, dict[str, tuple[int, ...]]] | None = None
):
    record = save_record([holdings])  # through the plain-data form the files keep
    held = read_record({PLAN_KEY: record}, "model")
    return plan_load("tag", MODEL_STATES, held, expected or {OPTIMIZER: dict(SHAPES)})


def test_flat_shard_pieces_tile_their_tensors():
    shards = _shards()
    # rank 1's chunk [3, 6) of bucket 0: a's last two elements and b's first; of bucket 1: c[3:6]
    assert shards[1].pieces == (
        TensorPiece("a", (5,), (3,), (2,), flat=True),
        TensorPiece("b", (2, 2), (0,), (1,), flat=True),
        TensorPiece("c", (7,), (3,), (3,), flat=True),
    )
    plan = _plan(shards)
    assert plan.recorded
    assert plan.sources[(OPTIMIZER, "b")] == ("shard1", "shard2")
    # a piece covering a whole tensor is recorded whole, in its shape
    whole = layout_pieces(LAYOUT, 1, 0, SHAPES)
    assert [p.flat for p in whole] == [False] * 3 and whole[1].local_shape == (2, 2)


def test_overlap_gap_and_out_of_range_name_the_tensor():
    shards = _shards()
    gap = [shards[0], shards[2]]  # rank 1's shard left out of the record
    with pytest.raises(
        CheckpointPlanError, match=r"tensor 'a' has a gap: flattened elements \[3, 5\)"
    ):
        _plan(gap)
    c_moved = TensorPiece("c", (7,), (2,), (3,), flat=True)  # was [3, 6)
    moved = FilePieces("shard1", OPTIMIZER, (*shards[1].pieces[:2], c_moved))
    with pytest.raises(
        CheckpointPlanError, match="tensor 'c' is recorded twice over: shard0 holds"
    ) as error:
        _plan([shards[0], moved, shards[2]])
    assert "shard1 holds flattened elements [2, 5)" in str(error.value)
    beyond = FilePieces("shard9", OPTIMIZER, (TensorPiece("c", (7,), (5,), (3,), flat=True),))
    with pytest.raises(
        CheckpointPlanError, match="tensor 'c' of global shape \\[7\\] is recorded in shard9"
    ):
        _plan([*shards, beyond])


def test_a_shape_other_than_the_models_is_refused_naming_file_shapes_and_fix():
    with pytest.raises(CheckpointPlanError) as error:
        _plan(_shards(), {OPTIMIZER: {**SHAPES, "b": (4, 1)}})
    message = str(error.value)
    assert "tensor 'b' is saved in tag/shard" in message
    assert "global shape [2, 2]" in message and "shape [4, 1]" in message
    assert "Load a checkpoint saved from this model" in message
    # two files disagreeing with each other
    other = FilePieces("model", MODULE, (TensorPiece.whole("b", (4,)),))
    with pytest.raises(CheckpointPlanError, match=re.escape("'b' is recorded with global shape")):
        _plan([*_shards(), other])


def test_expert_rows_and_copies():
    """One expert's row of a fused [experts, ...] tensor per file tiles it; a missing row is a
    gap. Each pipeline stage's files are one copy: two copies split differently are fine."""
    rows = [
        FilePieces(f"expert{e}", MODULE, (TensorPiece("w", (3, 2, 4), (e, 0, 0), (1, 2, 4)),))
        for e in range(3)
    ]
    assert _plan(rows, {MODULE: {"w": (3, 2, 4)}}).sources[(MODULE, "w")] == (
        "expert0",
        "expert1",
        "expert2",
    )
    with pytest.raises(CheckpointPlanError, match="tensor 'w' has a gap: its pieces cover 16 of"):
        _plan(rows[:2], {MODULE: {"w": (3, 2, 4)}})
    tied = [
        FilePieces("stage0", OPTIMIZER, (TensorPiece.whole("t", (4,)),), copy=0),
        FilePieces("s1r0", OPTIMIZER, (TensorPiece("t", (4,), (0,), (1,), flat=True),), copy=1),
        FilePieces("s1r1", OPTIMIZER, (TensorPiece("t", (4,), (1,), (3,), flat=True),), copy=1),
    ]
    assert _plan(tied, {OPTIMIZER: {"t": (4,)}}).recorded


def test_a_checkpoint_without_record_is_unchecked_and_newer_records_refused():
    plan = plan_load("tag", MODEL_STATES, read_record({}, "model"), {OPTIMIZER: {"a": (5,)}})
    assert not plan.recorded and plan.sources == {}
    with pytest.raises(CheckpointPlanError, match="record of version 3"):
        read_record({PLAN_KEY: {"version": 3, "files": []}}, "model")


# -- saved records, edited ---------------------------------------------------------------------
def record_refusals(folder: str) -> None:
    """A ZeRO-2 checkpoint of 2 ranks whose record is edited on disk: a tensor recorded in
    another (same-size) shape, a shard's piece moved or shortened; each load is refused on
    every rank naming the tensor, before anything is loaded. Without the record (as written
    before it) the checkpoint loads, unchecked."""
    base, rank = Path(folder), dist.get_rank()
    engine, task, gas = _build(2, 3000, seed=0)
    _train(engine, task, range(1), gas)
    engine.save_checkpoint(folder, tag="t")
    saved = _full_state(engine)
    path = base / "t" / MODEL_STATES
    pristine = path.read_bytes()
    qkv = "blocks.0.attn.qkv.weight"
    rows, cols = engine.module.get_parameter(qkv).shape
    edits = {
        "transposed": (
            transpose_recorded(qkv),
            rf"tensor '{qkv}' is saved in \S+ with global shape \[{cols}, {rows}\] .*this "
            rf"model's '{qkv}' has shape \[{rows}, {cols}\]",
        ),
        "moved": (
            shift_flat_piece("zero_pp_rank_1_mp_rank_00_optim_states.pt", -1),
            "recorded twice over",
        ),
        "shortened": (
            shift_flat_piece("zero_pp_rank_1_mp_rank_00_optim_states.pt", 0, 1),
            "has a gap",
        ),
    }
    for edit, match in edits.values():
        if rank == 0:
            changed = edit_record(path, edit)
        dist.barrier()
        with pytest.raises(CheckpointPlanError, match=match) as error:
            engine.load_checkpoint(folder, tag="t")
        if rank == 0:
            assert f"'{changed}'" in str(error.value), (changed, error.value)
            path.write_bytes(pristine)
        dist.barrier()
    if rank == 0:
        edit_record(path, None)
    dist.barrier()
    fresh, _, _ = _build(2, 3000, seed=1)
    with captured_plans() as plans:
        fresh.load_checkpoint(folder, tag="t")
    check_plan(plans[0], recorded=False)
    for key, value in _full_state(fresh).items():
        assert value.equal(saved[key]), key
    fresh.destroy()
    engine.destroy()


@pytest.mark.timeout(180)
def test_an_edited_record_is_refused_naming_the_tensor(dist_pool, tmp_path):
    dist_pool(2).run(record_refusals, str(tmp_path))
