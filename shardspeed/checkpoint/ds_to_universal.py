"""Convert a checkpoint to the universal format: one folder of files per parameter.

    python -m shardspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step100 \\
        --output_folder ckpt/global_step100_universal

The output holds ``zero/<parameter name>/fp32.pt`` (the full fp32 master), one file per
optimizer state of the parameter (``exp_avg.pt``, ``exp_avg_sq.pt``, ``step.pt``, ...), each a
``{"param": tensor}`` dict in the parameter's shape, and the model-states file with
:data:`~shardspeed.checkpoint.sources.UNIVERSAL_LAYOUT` added (parameter groups, which group
each parameter is in, the loss scaler); the ``zero/`` folder is what marks the output as
universal, as in DeepSpeed's layout (a ``universal_checkpoint_info`` entry of the source's
client state is kept as it was). ``latest_universal`` beside the output folder names it, and
``"checkpoint": {"load_universal": true}`` makes ``load_checkpoint`` read that tag. Nothing in it
depends on the data-parallel size, bucket size or ZeRO stage of either job.

The converter reads its input through the safe reader (no pickled code runs;
``--allow_unsafe_pickle`` for a trusted legacy input) after checking it against its manifest, and
writes its output like a save: into a staging folder, each file durably, a manifest last, then
renamed into place (:mod:`shardspeed.checkpoint.commit`). It runs in the calling process
alone (no collective), so one rank may call it while the others wait for it.

From Python, ``main(args)`` takes DeepSpeed's argument namespace (``input_folder``,
``output_folder``, ``num_extract_workers``, ...; the ones shardspeed has no use for are
ignored) or a list of command-line arguments.

shardspeed's own checkpoints already load under another world size or stage (each rank
re-partitions the shards): the universal form is for tools that want each parameter whole.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardspeed.checkpoint import durable
from shardspeed.checkpoint.commit import clear_staging, commit, open_staging
from shardspeed.checkpoint.file_writer import save_file
from shardspeed.checkpoint.files import LATEST_UNIVERSAL, MODEL_STATES, UNIVERSAL_MASTER
from shardspeed.checkpoint.layout import param_bucket
from shardspeed.checkpoint.manifest import FileRecord, check_tag
from shardspeed.checkpoint.planner import PLAN_KEY
from shardspeed.checkpoint.reshard import Resharder, replicated_from_shard
from shardspeed.checkpoint.sources import UNIVERSAL_LAYOUT, read_model_states, saved_shards


def convert(
    input_folder: str | Path, output_folder: str | Path, allow_unsafe_pickle: bool = False
) -> Path:
    """Write the universal form of the checkpoint tag folder ``input_folder`` (shardspeed's,
    of any stage, or DeepSpeed's ZeRO 1/2/3)."""
    source, out = Path(input_folder), Path(output_folder)
    check_tag(source)
    model = read_model_states(source, allow_unsafe_pickle)
    shards = saved_shards(source, model, allow_unsafe_pickle)
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
    clear_staging(str(out.parent), out.name)
    staging = open_staging(str(out.parent), out.name)
    records: list[FileRecord] = []
    for bucket, master in zip(whole, masters, strict=True):
        name = bucket["params"][0][0]
        (staging / "zero" / name).mkdir(parents=True, exist_ok=True)
        values = {UNIVERSAL_MASTER: master, **optimizer["state"].get(bucket["state_index"], {})}
        for key, value in values.items():
            records.append(save_file({"param": value}, staging, f"zero/{name}/{key}.pt"))
    info = {
        "universal_checkpoint_version": 1,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]
        ],
        "group_of": {name: group for group, name, _ in names},
        "loss_scaler": state["loss_scaler"],
        "source": {"zero_stage": model.get("zero_stage"), "dp_world_size": shards[1]},
    }
    # the source's record lists its shards, which the universal folder does not have
    universal = {k: v for k, v in model.items() if k != PLAN_KEY}
    universal_model = {**universal, "optimizer": None, UNIVERSAL_LAYOUT: info}
    records.append(save_file(universal_model, staging, MODEL_STATES))
    commit(str(out.parent), out.name, records, save_latest=False)
    durable.write_text(out.parent / LATEST_UNIVERSAL, out.name)
    return out


def main(args: argparse.Namespace | Sequence[str] | None = None) -> None:
    """Convert as the command line says: ``args`` is DeepSpeed's argument namespace (any
    object with ``input_folder`` and ``output_folder`` attributes) or a list of command-line
    arguments (None: ``sys.argv``)."""
    if args is None or isinstance(args, (list, tuple)):
        options = _parser().parse_args(None if args is None else list(args))
    else:
        options = _from_namespace(args)
    out = convert(options.input_folder, options.output_folder, options.allow_unsafe_pickle)
    print(f"wrote {out}")


def _from_namespace(args: Any) -> argparse.Namespace:
    missing = [key for key in ("input_folder", "output_folder") if getattr(args, key, None) is None]
    if missing:
        raise ValueError(
            f"ds_to_universal.main(args): args has no {' or '.join(missing)}; give it "
            "input_folder (a checkpoint tag folder) and output_folder (where to write)"
        )
    return argparse.Namespace(
        input_folder=args.input_folder,
        output_folder=args.output_folder,
        allow_unsafe_pickle=bool(getattr(args, "allow_unsafe_pickle", False)),
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--input_folder", required=True, help="a checkpoint tag folder")
    parser.add_argument("--output_folder", required=True, help="where to write the universal form")
    # DeepSpeed's parallelism knobs for its converter; one process does it here
    parser.add_argument("--num_extract_workers", type=int, default=1, help="accepted, unused")
    parser.add_argument("--num_merge_workers", type=int, default=1, help="accepted, unused")
    parser.add_argument("--keep_temp_folder", action="store_true", help="accepted, unused")
    parser.add_argument("--no_strict", dest="strict", action="store_false", help="accepted, unused")
    parser.add_argument("--inject_missing_state", action="store_true", help="accepted, unused")
    parser.add_argument(
        "--allow_unsafe_pickle",
        action="store_true",
        help="read the input with full pickle (only for a trusted legacy checkpoint)",
    )
    return parser


if __name__ == "__main__":
    main()
