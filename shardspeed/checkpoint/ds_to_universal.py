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
from typing import Any

import torch

from shardspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from shardspeed.runtime.zero.reshard import BucketLayout, Resharder, shard_from_replicated
from shardspeed.utils.zero_to_fp32 import MODEL_STATES, OPTIM_SHARD, load_file

LATEST_UNIVERSAL = "latest_universal"
_FP32 = "fp32"


def _source(folder: Path, model: dict[str, Any]) -> tuple[Any, int, list[BucketLayout]]:
    """(shard reader, shard count, saved layout) of a stage 0, 1 or 2 checkpoint."""
    if model.get("optimizer") is not None:  # stage 0: the state in the model file
        shard = shard_from_replicated(model["optimizer"])
        return (lambda _: shard), 1, shard["strategy"]["layout"]
    count = int(model["dp_world_size"])
    paths = [folder / OPTIM_SHARD.format(rank) for rank in range(count)]
    if not all(p.is_file() for p in paths):
        raise FileNotFoundError(f"{folder} lacks optimizer shards: {[str(p) for p in paths]}")
    layout = load_file(paths[0])["optimizer_state_dict"]["strategy"]["layout"]
    return (lambda rank: load_file(paths[rank])["optimizer_state_dict"]), count, layout


def convert(input_folder: str | Path, output_folder: str | Path) -> Path:
    """Write the universal form of the checkpoint tag folder ``input_folder``."""
    source, out = Path(input_folder), Path(output_folder)
    model = load_file(source / MODEL_STATES)
    if model.get("optimizer") is None and not model.get("zero_stage"):
        raise ValueError(f"{source} holds no optimizer state to convert")
    read, count, saved_layout = _source(source, model)
    names = [(b["group"], name, numel) for b in saved_layout for name, _, numel in b["params"]]
    # each parameter a bucket of a one-rank job: the re-partitioner hands back each one whole
    whole = [
        {"group": group, "size": numel, "state_index": i, "params": [[name, 0, numel]]}
        for i, (group, name, numel) in enumerate(names)
    ]
    state = Resharder(read, count, model["module"]).state_for(whole, 1, 0)
    shapes = {name: model["module"][name].shape for _, name, _ in names}
    for bucket, master in zip(whole, state["strategy"]["fp32_chunks"], strict=True):
        name = bucket["params"][0][0]
        folder = out / "zero" / name
        folder.mkdir(parents=True, exist_ok=True)
        values = {_FP32: master, **state["optimizer"]["state"].get(bucket["state_index"], {})}
        for key, value in values.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == bucket["size"]:
                value = value.view(shapes[name])
            torch.save({"param": value}, folder / f"{key}.pt")
    groups = [
        {k: v for k, v in g.items() if k != "params"} for g in state["optimizer"]["param_groups"]
    ]
    info = {
        "universal_checkpoint_version": 1,
        "param_groups": groups,
        "group_of": {name: group for group, name, _ in names},
        "loss_scaler": state["loss_scaler"],
        "source": {"zero_stage": model.get("zero_stage"), "dp_world_size": count},
    }
    torch.save({**model, "optimizer": None, UNIVERSAL_CHECKPOINT_INFO: info}, out / MODEL_STATES)
    (out.parent / LATEST_UNIVERSAL).write_text(out.name)
    return out


def universal_shard(folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    """A universal folder as the one shard of a one-rank job (what :class:`Resharder` reads)."""
    layout, chunks, states = [], [], {}
    for index, (name, group) in enumerate(info["group_of"].items()):
        files = sorted((folder / "zero" / name).glob("*.pt"))
        if not files:
            raise FileNotFoundError(f"{folder / 'zero' / name} holds no parameter files")
        values = {f.stem: load_file(f)["param"] for f in files}
        master = values.pop(_FP32).reshape(-1)
        layout.append(
            {
                "group": group,
                "size": master.numel(),
                "state_index": index,
                "params": [[name, 0, master.numel()]],
            }
        )
        chunks.append(master)
        states[index] = {
            k: v.reshape(-1) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in values.items()
        }
    return {
        "optimizer": {"state": states, "param_groups": info["param_groups"]},
        "loss_scaler": info["loss_scaler"],
        "strategy": {"layout": layout, "fp32_chunks": chunks, "dp_world_size": 1},
    }


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
