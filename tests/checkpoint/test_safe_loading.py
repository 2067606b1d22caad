"""Loading a checkpoint never runs code the checkpoint names.

Each of a checkpoint's kinds of file (the model states, an optimizer shard, a file of the
universal form) is given a real pickle payload: an object whose ``__reduce__`` would create a
marker file when unpickled. ``load_checkpoint``, the ``zero_to_fp32`` functions, ``ds_to_universal``
and the standalone ``zero_to_fp32.py`` all refuse it: the marker is never created and the error
names the file and the refused global. With the explicit opt-in the same file loads (and the
payload runs: it is real). DeepSpeed's own files load through the allowlist, as plain data, and
what shardspeed writes is checked to be plain data when it is saved.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardspeed.checkpoint.consolidate import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
from shardspeed.checkpoint.ds_to_universal import convert
from shardspeed.checkpoint.manifest import MANIFEST, file_crc32
from shardspeed.checkpoint.reader import RefusedPickleError, load_file
from shardspeed.checkpoint.standalone import SCRIPT_NAME
from tests.checkpoint.test_standalone import run_isolated
from tests.runtime.parity import make_task
from tests.runtime.zero.ranks import _engine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SHARD = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
UNIVERSAL_FILE = "zero/wte.weight/exp_avg.pt"
#: the variants of the checkpoint: (its folder, the tag, the file carrying the payload)
VARIANTS = {
    "model": ("t", "mp_rank_00_model_states.pt"),
    "shard": ("t", SHARD),
    "universal": ("t_universal", UNIVERSAL_FILE),
}
#: the saving and the loading jobs' ZeRO settings: the same layout, so a rank reads only its shard
ZERO = {"reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0}
#: how the error names the global the payload calls (builtins.open, pickled as io.open)
REFUSED = re.compile(r"global \S*open\b")


class Payload:
    """Creates ``marker`` when unpickled by a loader that runs what a file names."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def _plant(tag_folder: Path, name: str, marker: Path) -> None:
    """Add a payload to ``tag_folder/name`` and update the tag's manifest to match (whoever can
    change a checkpoint's files can change its manifest)."""
    path = tag_folder / name
    obj = torch.load(path, weights_only=True)
    obj["payload"] = Payload(str(marker))
    torch.save(obj, path)
    manifest = json.loads((tag_folder / MANIFEST).read_text())
    for record in manifest["files"]:
        if record["name"] == name:
            record.update(size=path.stat().st_size, crc32=file_crc32(path))
    (tag_folder / MANIFEST).write_text(json.dumps(manifest))


def save_one(folder: str, stage: int = 2) -> None:
    torch.manual_seed(0)
    task = make_task("gpt", rows=8)
    engine = _engine(task.build(), stage, zero=ZERO)
    x, y = task.data
    engine.backward(engine(x[:2], y[:2]))
    engine.step()
    engine.save_checkpoint(folder, tag="t")
    # what shardspeed writes must be plain data: anything else is refused at save time (on the
    # rank writing the model states; the other stops with it). Stage 3 writes DeepSpeed's
    # per-rank model-states files too: every rank refuses its own
    expected = (
        (TypeError, r"checkpoint\['\w*mp_rank_00_model_states.pt'\]\['obj'\] is a tests\.")
        if dist.get_rank() == 0 or stage == 3
        else (RuntimeError, "another rank failed to save")
    )
    with pytest.raises(expected[0], match=expected[1]):
        engine.save_checkpoint(folder, tag="bad", client_state={"obj": Payload("unused")})
    assert not (Path(folder) / "bad").exists() and (Path(folder) / "latest").read_text() == "t"
    engine.destroy()


def load_refused(base: str) -> None:
    rank, root = dist.get_rank(), Path(base)
    for variant, (tag, name) in VARIANTS.items():
        universal = {"checkpoint": {"load_universal": True}} if variant == "universal" else {}
        engine = _engine(make_task("gpt", rows=8).build(), 2, zero=ZERO, **universal)
        refused_here = variant != "shard" or rank == 1  # a rank reads only its own shard
        expected = RefusedPickleError if refused_here else RuntimeError
        with pytest.raises(expected) as error:
            engine.load_checkpoint(str(root / variant), tag=None if universal else tag)
        if refused_here:
            assert str(root / variant / tag / name) in str(error.value), error.value
            assert REFUSED.search(str(error.value)), error.value
            assert "allow_unsafe_pickle=True" in str(error.value)
        else:
            assert "another rank failed" in str(error.value)
        engine.destroy()
        dist.barrier()
        assert not (root / f"{variant}.marker").exists(), variant


def load_trusted(base: str) -> None:
    """The explicit opt-in loads the file, and so runs its payload."""
    engine = _engine(make_task("gpt", rows=8).build(), 2, zero=ZERO)
    engine.load_checkpoint(str(Path(base) / "model"), tag="t", allow_unsafe_pickle=True)
    assert engine.global_steps == 1
    engine.destroy()


@pytest.mark.timeout(300)
def test_a_pickle_payload_is_refused_everywhere(dist_pool, tmp_path):
    source = tmp_path / "source"
    dist_pool(2).run(save_one, str(source))
    convert(source / "t", source / "t_universal")
    for variant, (tag, name) in VARIANTS.items():
        shutil.copytree(source, tmp_path / variant)
        _plant(tmp_path / variant / tag, name, tmp_path / f"{variant}.marker")
    markers = [tmp_path / f"{v}.marker" for v in VARIANTS]

    dist_pool(2).run(load_refused, str(tmp_path))

    for variant in ("model", "shard"):
        path = str(tmp_path / variant / "t" / VARIANTS[variant][1])
        calls = [
            lambda d: get_fp32_state_dict_from_zero_checkpoint(d, tag="t"),
            lambda d: get_fp32_state_dict_from_zero_checkpoint(d, tag="t", lazy_mode=True),
            lambda d: convert_zero_checkpoint_to_fp32_state_dict(d, tmp_path / "out", tag="t"),
            lambda d: load_state_dict_from_zero_checkpoint(torch.nn.Linear(1, 1), d, tag="t"),
            lambda d: convert(Path(d) / "t", Path(d) / "t_converted"),
        ]
        for call in calls:
            with pytest.raises(RefusedPickleError, match=re.escape(path)) as error:
                call(tmp_path / variant)
            assert REFUSED.search(str(error.value))
        # the standalone script beside the checkpoint, with neither shardspeed nor DeepSpeed
        script = tmp_path / variant / SCRIPT_NAME
        run = run_isolated(script, tmp_path / variant, tmp_path / "out", "--tag", "t", cwd=tmp_path)
        assert run.returncode != 0 and "RefusedPickleError" in run.stderr, run.stderr
        assert path in run.stderr and REFUSED.search(run.stderr), run.stderr
    assert not any(marker.exists() for marker in markers)

    # opted in, the same files load: the payload was real
    dist_pool(2).run(load_trusted, str(tmp_path))
    assert (tmp_path / "model.marker").exists()
    get_fp32_state_dict_from_zero_checkpoint(tmp_path / "shard", tag="t", allow_unsafe_pickle=True)
    assert (tmp_path / "shard.marker").exists()


def test_deepspeed_types_load_as_plain_data():
    """DeepSpeed's loss scaler, ZeroStageEnum and fragment_address come out as dicts and ints."""
    shard = load_file(
        FIXTURES / "deepspeed_zero2" / "ds" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    state = shard["optimizer_state_dict"]
    assert state["loss_scaler"] == {"cur_scale": 1.0, "dynamic": False}
    assert type(state["zero_stage"]) is int and state["zero_stage"] == 2
    mapping = state["param_slice_mappings"][0]["wte.weight"]
    assert mapping == {"numel": 2048, "start": 0}


def test_namespace_loads_and_other_globals_are_named(tmp_path):
    args = argparse.Namespace(lr=0.1, layers=[1, 2])
    torch.save({"args": args, "w": torch.ones(2)}, tmp_path / "ok.pt")
    assert load_file(tmp_path / "ok.pt")["args"] == args
    torch.save({"when": __import__("datetime").date(2024, 1, 1)}, tmp_path / "date.pt")
    with pytest.raises(RefusedPickleError, match=r"global datetime\.date") as error:
        load_file(tmp_path / "date.pt")
    assert str(tmp_path / "date.pt") in str(error.value)
    # the legacy (non-zip) format is read the same way
    torch.save(
        {"p": Payload(str(tmp_path / "m"))},
        tmp_path / "old.pt",
        _use_new_zipfile_serialization=False,
    )
    with pytest.raises(RefusedPickleError, match=REFUSED.pattern):
        load_file(tmp_path / "old.pt")
    assert not (tmp_path / "m").exists()
