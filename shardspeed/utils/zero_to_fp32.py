"""Consolidate a ZeRO checkpoint into one fp32 ``state_dict`` (DeepSpeed's ``zero_to_fp32``).

A stage 1/2 checkpoint keeps the fp32 master weights split across one optimizer shard per
data-parallel rank, each with its bucket layout (which parameter, by name, sits at which offset
of which flat bucket). Putting a parameter back together is reading its range of the flat bucket
from the shards that hold it. A stage 0 checkpoint holds the masters whole. Frozen parameters
and buffers come from the model-states file as saved. Checkpoints written by DeepSpeed's ZeRO
1/2 read the same way (one flat bucket per parameter group, :func:`deepspeed_layout`), also
without DeepSpeed installed: objects of its classes in the files load as :class:`Foreign`.

This file needs only torch (and safetensors for ``safe_serialization``): ``save_checkpoint``
copies it into the checkpoint directory, so a checkpoint can be consolidated where shardspeed is
not installed::

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [--tag TAG] [--max_shard_size 5GB]
        [--safe_serialization] [--exclude_frozen_parameters]

It needs CPU memory for the whole fp32 model (the shards are memory-mapped, so not for them);
with ``lazy_mode=True`` each tensor is built only when ``.contiguous()`` asks for it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import zipfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


class LazyTensor:
    """A consolidated tensor not built yet: ``.contiguous()`` builds it (on CPU)."""

    def __init__(self, build: Callable[[], torch.Tensor], shape: torch.Size) -> None:
        self._build = build
        self.shape = shape

    def contiguous(self) -> torch.Tensor:
        return self._build()

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)})"


def _tag_folder(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise FileNotFoundError(
                f"no 'latest' file in {root}: pass tag= (one of the sub-directories, e.g. "
                "global_step14), or point checkpoint_dir at the directory save_checkpoint wrote"
            )
        tag = latest.read_text().strip()
    folder = root / str(tag)
    if not (folder / MODEL_STATES).is_file():
        raise FileNotFoundError(f"{folder / MODEL_STATES} does not exist: not a checkpoint tag")
    return folder


class Foreign:
    """Stands in for a class of a package that is not installed (DeepSpeed's loss scaler, enums
    and named tuples in its checkpoints): keeps the constructor arguments and pickled state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state


class _Unpickler(pickle.Unpickler):
    """Unpickles objects of DeepSpeed's classes as :class:`Foreign` when DeepSpeed is absent."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            if module.split(".")[0] != "deepspeed":
                raise
            return _FOREIGN.setdefault(f"{module}.{name}", type(name, (Foreign,), {}))


_FOREIGN: dict[str, type] = {}
_PICKLE = type(pickle)("shardspeed_foreign_pickle")
_PICKLE.__dict__.update(Unpickler=_Unpickler, load=pickle.load, loads=pickle.loads)


def load_file(path: str | os.PathLike[str], mmap: bool = True) -> Any:
    """``torch.load`` onto the CPU, memory-mapped where the file allows it (the zip format
    ``torch.save`` writes by default; not ``checkpoint_serialization: false`` files). Files
    written by DeepSpeed load without DeepSpeed installed (its objects become :class:`Foreign`)."""
    return torch.load(
        path,
        map_location="cpu",
        weights_only=False,
        mmap=mmap and zipfile.is_zipfile(path),
        pickle_module=_PICKLE,
    )


def shard_paths(folder: Path, count: int) -> list[Path]:
    """The optimizer shard of each of ``count`` ranks: ``zero_pp_rank_*``, or DeepSpeed's
    ``bf16_zero_pp_rank_*`` (its name for the same files when bf16 is on)."""
    plain = [folder / OPTIM_SHARD.format(rank) for rank in range(count)]
    bf16 = [p.with_name("bf16_" + p.name) for p in plain]
    return bf16 if not plain[0].is_file() and bf16[0].is_file() else plain


def deepspeed_partitions(saved: dict[str, Any]) -> list[torch.Tensor]:
    """The fp32 partitions of a DeepSpeed ZeRO 1/2 shard's ``optimizer_state_dict``."""
    if "single_partition_of_fp32_groups" not in saved:
        raise ValueError(
            "this shard was written by a DeepSpeed optimizer whose format shardspeed does not "
            "read yet (its bf16 optimizer, used with ZeRO 0/1); DeepSpeed's ZeRO 1/2 "
            "checkpoints load. Pass load_optimizer_states=False to take the module weights"
        )
    return list(saved["single_partition_of_fp32_groups"])


def chunk_ranges(first: int, last: int, chunk: int) -> Iterator[tuple[int, slice]]:
    """Elements ``[first, last)`` of a flat bucket split into equal ``chunk``-sized parts, one
    per rank: ``(rank, slice of that rank's chunk)`` for each part the range touches."""
    while first < last:
        owner = first // chunk
        end = min(last, (owner + 1) * chunk)
        yield owner, slice(first - owner * chunk, end - owner * chunk)
        first = end


def deepspeed_layout(
    param_shapes: list[dict[str, Any]], partitions: list[int], count: int
) -> list[dict[str, Any]]:
    """The bucket layout (see :mod:`shardspeed.runtime.zero.reshard`) of a DeepSpeed ZeRO 1/2
    checkpoint: each parameter group is one flat bucket of its parameters in ``param_shapes``
    order, padded at the end, split into ``count`` partitions of ``partitions[g]`` elements."""
    layout = []
    for group, shapes in enumerate(param_shapes):
        params, offset = [], 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            params.append([name, offset, numel])
            offset += numel
        size = partitions[group] * count
        layout.append({"group": group, "size": size, "state_index": group, "params": params})
    return layout


def _stage12_masters(
    folder: Path,
    count: int,
    module: dict[str, torch.Tensor],
    param_shapes: list[dict[str, Any]] | None = None,
) -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    """Builders of each trainable parameter's flat fp32 master from the ``count`` shards
    (shardspeed's, or DeepSpeed's when its ``param_shapes`` are given)."""
    paths = shard_paths(folder, count)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"ZeRO optimizer shards missing: {missing[:4]} (copy the tag whole)"
        )
    saved = [load_file(p)["optimizer_state_dict"] for p in paths]
    if param_shapes is not None:  # written by DeepSpeed: one flat partition per group
        chunks = [deepspeed_partitions(s) for s in saved]
        layout = deepspeed_layout(param_shapes, [c.numel() for c in chunks[0]], count)
    else:
        layout = saved[0]["strategy"].get("layout")
        if layout is None:
            raise ValueError(f"the shards in {folder} carry no bucket layout (an older shardspeed)")
        chunks = [s["strategy"]["fp32_chunks"] for s in saved]

    def builder(bucket: int, offset: int, numel: int) -> Callable[[], torch.Tensor]:
        def build() -> torch.Tensor:
            size = layout[bucket]["size"] // count
            ranges = chunk_ranges(offset, offset + numel, size)
            pieces = [chunks[owner][bucket][part] for owner, part in ranges]
            return torch.cat(pieces).float()  # a new tensor, never a view of a shard

        return build

    # a bucket without masters in the shards trained its fp32 weights in place: the module
    # state holds them
    return {
        name: (
            partial(_flat_copy, module[name])
            if chunks[0][index] is None
            else builder(index, offset, numel),
            numel,
        )
        for index, bucket in enumerate(layout)
        for name, offset, numel in bucket["params"]
    }


def _flat_copy(master: torch.Tensor) -> torch.Tensor:
    return master.float().reshape(-1).clone()


def _shaped(build: Callable[[], torch.Tensor], shape: torch.Size) -> torch.Tensor:
    return build().view(shape)


def _stage0_masters(model: dict[str, Any]) -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    if model.get("optimizer") is None:  # saved without an optimizer: the weights as they are
        return {}
    strategy = model["optimizer"]["strategy"]
    masters, names = strategy.get("fp32_masters"), strategy.get("master_names")
    if names is None:
        raise ValueError("this stage 0 checkpoint names no masters (an older shardspeed)")
    if masters is None:  # fp32 training: the module's weights are the masters
        masters = [model["module"][name] for name in names]
    return {
        name: (partial(_flat_copy, master), master.numel())
        for name, master in zip(names, masters, strict=True)
    }


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The checkpoint's weights as one ``state_dict``: trainable parameters as their fp32
    masters, frozen parameters and buffers as saved. ``tag=None`` reads ``latest``."""
    folder = _tag_folder(checkpoint_dir, tag)
    model = load_file(folder / MODEL_STATES)
    stage = model.get("zero_stage", 0)
    if "param_shapes" in model:  # DeepSpeed's ZeRO 1/2
        count = int(model["dp_world_size"])
        masters = _stage12_masters(folder, count, model["module"], model["param_shapes"])
    elif stage in (1, 2):
        masters = _stage12_masters(folder, int(model["dp_world_size"]), model["module"])
    elif stage == 0:
        masters = _stage0_masters(model)
    else:
        raise ValueError(f"cannot consolidate a ZeRO stage {stage} checkpoint")
    buffers = set(model.get("buffer_names", ()))
    owner: dict[tuple[int, int, tuple[int, ...]], str] = {}  # tied weights share one master
    result: dict[str, Any] = {}
    for name, value in model["module"].items():
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        source = name if name in masters else owner.get(key)
        if source is not None:
            owner.setdefault(key, source)
            build, numel = masters[source]
            if numel != value.numel():
                raise ValueError(
                    f"{name}: {numel} master elements for a {tuple(value.shape)} tensor"
                )
            shaped = partial(_shaped, build, value.shape)
            result[name] = LazyTensor(shaped, value.shape) if lazy_mode else shaped()
        elif name in buffers or not exclude_frozen_parameters:
            frozen = value.detach()
            result[name] = LazyTensor(frozen.clone, value.shape) if lazy_mode else frozen.clone()
    return result


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> nn.Module:
    """Move ``model`` to CPU and load the consolidated fp32 weights into it (re-create the
    engine afterwards: the model is no longer the one the engine trains)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", size.upper())
    if match is None:
        raise ValueError(f"max_shard_size {size!r}: give bytes or a size like '5GB', '500MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the consolidated state_dict to ``output_dir`` (``pytorch_model.bin``, or
    ``model.safetensors``), split into numbered files plus an index (Hugging Face's naming)
    when it exceeds ``max_shard_size``; returns the files written."""
    save: Callable[[dict[str, torch.Tensor], Path], None]
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError as error:
            raise ImportError(
                "safe_serialization=True needs safetensors: pip install safetensors"
            ) from error
        save, stem, ext = (lambda sd, p: save_file(sd, str(p))), "model", "safetensors"
    else:
        save, stem, ext = (lambda sd, p: torch.save(sd, p)), "pytorch_model", "bin"
    limit = _parse_size(max_shard_size)
    state = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode=True
    )
    groups: list[list[str]] = [[]]
    size = 0
    for name, lazy in state.items():
        nbytes = lazy.shape.numel() * 4
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = (
        [f"{stem}.{ext}"]
        if len(groups) == 1
        else [f"{stem}-{i + 1:05d}-of-{len(groups):05d}.{ext}" for i in range(len(groups))]
    )
    written, weight_map = [], {}
    for file_name, group in zip(names, groups, strict=True):
        # every name is built into its own memory (tied weights too, as safetensors wants)
        tensors = {name: state[name].contiguous() for name in group}
        weight_map.update(dict.fromkeys(group, file_name))
        save(tensors, out / file_name)
        written.append(out / file_name)
    if len(groups) > 1:
        index = out / f"{stem}.{ext}.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        written.append(index)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "checkpoint_dir", help="the directory save_checkpoint wrote (holds 'latest')"
    )
    parser.add_argument("output_dir", help="where to write the consolidated weights")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: read 'latest')")
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    for path in convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        args.max_shard_size,
        args.safe_serialization,
        args.tag,
        args.exclude_frozen_parameters,
    ):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
