"""Where AutoTP reads full weights from, one slice at a time.

:class:`ModuleWeights` serves the tensors of a model that is already in memory.
:class:`SafetensorsWeights` serves a checkpoint of one or more ``.safetensors`` files through
memory maps, reading only the requested slice of each tensor, so a rank never holds more of
the model than its own shard plus the one tensor being sliced. :func:`open_checkpoint` turns the
``checkpoint`` config value (a directory, an index, a file, a DeepSpeed JSON load policy or its
path) into the list of files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shardspeed.runtime.tensor_parallel.partition import Slice

__all__ = [
    "ModuleWeights",
    "SafetensorsWeights",
    "WeightSource",
    "checkpoint_files",
    "open_checkpoint",
]


class WeightSource(Protocol):
    """Full tensors by parameter name; ``read`` returns only ``piece`` of one when given."""

    def read(self, name: str, piece: Slice | None, shape: torch.Size) -> torch.Tensor: ...

    def close(self) -> None: ...


class ModuleWeights:
    """The parameters and buffers of a model in memory."""

    def __init__(self, model: nn.Module) -> None:
        self._tensors = dict(model.state_dict(keep_vars=True))

    def read(self, name: str, piece: Slice | None, shape: torch.Size) -> torch.Tensor:
        full = self._tensors[name].detach()
        return full if piece is None else piece.take(full)

    def close(self) -> None:
        self._tensors.clear()


class SafetensorsWeights:
    """Tensors of safetensors files, read slice by slice from memory maps.

    One file is mapped at a time: moving to a tensor in another file unmaps the previous one, so
    the pages read from the checkpoint never exceed one shard (plus this rank's slices)."""

    def __init__(self, files: Iterable[Path], prefix: str = "") -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self._where: dict[str, Path] = {}
        self._prefix = prefix
        self._open: tuple[Path, Any] | None = None
        for path in files:
            if not path.is_file():
                raise ValueError(
                    f"checkpoint file {path} does not exist; check checkpoint/base_dir"
                )
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[key] = path

    def _handle(self, key: str) -> Any:
        path = self._where[key]
        if self._open is None or self._open[0] != path:
            self.close()
            handle = self._safe_open(str(path), framework="pt")
            self._open = (path, handle.__enter__())
        return self._open[1]

    def close(self) -> None:
        """Unmap the open file (reading again reopens it)."""
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None

    def _key(self, name: str) -> str:
        prefix = self._prefix + "." if self._prefix else ""
        candidates = [name]
        if prefix and name.startswith(prefix):
            candidates.append(name[len(prefix) :])
        elif prefix:
            candidates.append(prefix + name)
        for key in candidates:
            if key in self._where:
                return key
        raise ValueError(
            f"the checkpoint has no tensor for the model's {name!r}: its shards do not match "
            "this model (check that the model config is the one the checkpoint was saved from "
            "and that every shard file is listed)."
        )

    def read(self, name: str, piece: Slice | None, shape: torch.Size) -> torch.Tensor:
        key = self._key(name)
        tensor_slice = self._handle(key).get_slice(key)
        stored = tuple(tensor_slice.get_shape())
        if stored != tuple(shape):
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {list(stored)} but the model expects "
                f"{list(shape)}: the checkpoint shards do not match this model's config."
            )
        if piece is None:
            return tensor_slice[:]  # type: ignore[no-any-return]
        parts = []
        for start, stop in piece.pieces:
            index = [slice(None)] * len(stored)
            index[piece.dim] = slice(start, stop)
            parts.append(tensor_slice[tuple(index)])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=piece.dim)


def checkpoint_files(checkpoint: str | dict[str, Any], base_dir: str = "") -> list[Path]:
    """The safetensors files a ``checkpoint`` config value names."""
    if isinstance(checkpoint, dict):
        return _files_of_policy(checkpoint, Path(base_dir or "."))
    path = (
        Path(base_dir) / checkpoint
        if base_dir and not os.path.isabs(checkpoint)
        else Path(checkpoint)
    )
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            return _files_of_policy(json.loads(index.read_text()), path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"checkpoint directory {path} holds no .safetensors files")
        return files
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"checkpoint {path} does not exist")
        return _files_of_policy(
            json.loads(path.read_text()), Path(base_dir) if base_dir else path.parent
        )
    return [path]


def _files_of_policy(policy: dict[str, Any], root: Path) -> list[Path]:
    if "weight_map" in policy:  # a Hugging Face safetensors index
        names: list[str] = sorted(set(policy["weight_map"].values()))
    elif "checkpoints" in policy:  # DeepSpeed's load policy {"type", "checkpoints", "version"}
        listed = policy["checkpoints"]
        names = list(listed.values() if isinstance(listed, dict) else listed)
        names = [n for group in names for n in (group if isinstance(group, list) else [group])]
    else:
        raise ValueError(
            "checkpoint JSON must be a safetensors index (with 'weight_map') or a load policy "
            f"(with 'checkpoints'); got keys {sorted(policy)}"
        )
    files = [root / name for name in names]
    others = [f.name for f in files if f.suffix != ".safetensors"]
    if others:
        raise ValueError(
            f"checkpoint files {others} are not safetensors; AutoTP reads safetensors shard by "
            "shard (convert with safetensors.torch.save_file or save_pretrained)."
        )
    return files


def open_checkpoint(
    checkpoint: str | dict[str, Any], base_dir: str, prefix: str
) -> SafetensorsWeights:
    """A :class:`SafetensorsWeights` over the files ``checkpoint`` names."""
    return SafetensorsWeights(checkpoint_files(checkpoint, base_dir), prefix)
