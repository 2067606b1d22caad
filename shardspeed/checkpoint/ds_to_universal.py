"""Convert a checkpoint to the universal format: one folder of files per parameter.

    python -m shardspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step100 \\
        --output_folder ckpt/global_step100_universal

The output holds ``zero/<parameter name>/fp32.pt`` (the full fp32 master), one file per
optimizer state of the parameter (``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``, ...), each a
``{"param": tensor}`` dict in the parameter's shape, and the model-states file with
:data:`~shardspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO` added (parameter groups, which group
each parameter is in, the loss scaler). ``latest_universal`` beside the output folder names it, and
``"checkpoint": {"load_universal": true}`` makes ``load_checkpoint`` read that tag. Nothing in it
depends on the data-parallel size, bucket size or ZeRO stage of either job.

shardspeed's own checkpoints already load under another world size or stage (each rank
re-partitions the shards): the universal form is for tools that want each parameter whole.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from shardspeed.checkpoint.files import (
    LATEST_UNIVERSAL,
    MODEL_STATES,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_MASTER,
)
from shardspeed.checkpoint.layout import param_bucket
from shardspeed.checkpoint.reader import load_file
from shardspeed.checkpoint.reshard import Resharder, replicated_from_shard
from shardspeed.checkpoint.sources import saved_shards


def convert(input_folder: str | Path, output_folder: str | Path) -> Path:
    """Write the universal form of the checkpoint tag folder ``input_folder`` (shardspeed's,
    of any stage, or DeepSpeed's ZeRO 1/2)."""
    source, out = Path(input_folder), Path(output_folder)
    model = load_file(source / MODEL_STATES)
    shards = saved_shards(source, model)
    if shards is None:
        raise ValueError(f"{source} holds no optimizer state to convert")
    resharder = Resharder(*shards, model["module"])
    names = [(b["group"], n, numel) for b in resharder.old_layout for n, _, numel in b["params"]]
    # each parameter a bucket of a one-rank job: the re-partitioner hands back each one whole
    whole = [param_bucket(group, i, name, numel) for i, (group, name, numel) in enumerate(names)]
    state = resharder.state_for(whole, 1, 0)
    shapes = {i: model["module"][name].shape for i, (_, name, _) in enumerate(names)}
    groups = [
        [b["state_index"] for b in whole if b["group"] == g]
        for g in range(len(state["optimizer"]["param_groups"]))
    ]
    optimizer, masters = replicated_from_shard(state, whole, shapes, groups)
    for bucket, master in zip(whole, masters, strict=True):
        folder = out / "zero" / bucket["params"][0][0]
        folder.mkdir(parents=True, exist_ok=True)
        values = {UNIVERSAL_MASTER: master, **optimizer["state"].get(bucket["state_index"], {})}
        for key, value in values.items():
            torch.save({"param": value}, folder / f"{key}.pt")
    info = {
        "universal_checkpoint_version": 1,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]
        ],
        "group_of": {name: group for group, name, _ in names},
        "loss_scaler": state["loss_scaler"],
        "source": {"zero_stage": model.get("zero_stage"), "dp_world_size": shards[1]},
    }
    torch.save({**model, "optimizer": None, UNIVERSAL_CHECKPOINT_INFO: info}, out / MODEL_STATES)
    (out.parent / LATEST_UNIVERSAL).write_text(out.name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--input_folder", required=True, help="a checkpoint tag folder")
    parser.add_argument("--output_folder", required=True, help="where to write the universal form")
    # DeepSpeed's parallelism knobs for its converter; one process does it here
    parser.add_argument("--num_extract_workers", type=int, default=1, help="accepted, unused")
    parser.add_argument("--num_merge_workers", type=int, default=1, help="accepted, unused")
    args = parser.parse_args(argv)
    print(f"wrote {convert(args.input_folder, args.output_folder)}")


if __name__ == "__main__":
    main()
