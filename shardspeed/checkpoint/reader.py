"""Reading a checkpoint file: :func:`load_file`, the one function every checkpoint read in
shardspeed goes through (the engine's ``load_checkpoint``, re-partitioning, ``zero_to_fp32``,
``ds_to_universal``).

Files written by DeepSpeed hold objects of its classes (its loss scaler, enums, named tuples);
they load without DeepSpeed installed, as :class:`Foreign`. Needs only torch: this module is part
of the standalone ``zero_to_fp32.py``.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any

import torch


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
