"""Reading a checkpoint file: :func:`load_file`, the one function every checkpoint read in
shardspeed goes through (the engine's ``load_checkpoint``, re-partitioning, ``zero_to_fp32`` and
the standalone script, ``ds_to_universal``).

A checkpoint is untrusted input (downloaded from a hub, found on a shared disk): reading it must
not run code it names. Files are read with ``torch.load(weights_only=True)``, which builds only
tensors and plain containers, plus the data-only types of DeepSpeed's files
(:data:`~.allowlist.ALLOWED_GLOBALS`, loaded as plain data). A file naming any other global is
refused with :class:`RefusedPickleError`. A trusted legacy file that needs more loads with
``allow_unsafe_pickle=True`` (``load_checkpoint(..., allow_unsafe_pickle=True)``, the config key
``checkpoint.allow_unsafe_pickle``, or ``--allow_unsafe_pickle`` of ``zero_to_fp32``); that is
logged as a warning. Needs only torch: this module is part of the standalone ``zero_to_fp32.py``.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from typing import Any

import torch

from shardspeed.checkpoint.allowlist import ALLOWED_GLOBALS, STAND_INS, plain

#: how to opt in, for error messages
UNSAFE_OPT_IN = (
    "if you trust this file (it can run any code while loading), load it with "
    "allow_unsafe_pickle=True: engine.load_checkpoint(..., allow_unsafe_pickle=True), the config "
    'key "checkpoint": {"allow_unsafe_pickle": true}, or zero_to_fp32 --allow_unsafe_pickle'
)


class RefusedPickleError(ValueError):
    """A checkpoint file names a global (a class or function its unpickling would call) that is
    neither a tensor type nor on the allowlist: it is not loaded."""

    def __init__(self, path: str, global_name: str, detail: str) -> None:
        self.path, self.global_name = path, global_name
        super().__init__(
            f"refused to load checkpoint file {path}: it names the global {global_name}, which "
            "is not a tensor or one of the data-only types checkpoints may hold, so loading it "
            f"could run code of the file's choosing ({detail}). {UNSAFE_OPT_IN}"
        )


class _TrustingUnpickler(pickle.Unpickler):
    """Full pickle, for opted-in trusted files; DeepSpeed's types still become stand-ins (so a
    file loads without DeepSpeed installed)."""

    def find_class(self, module: str, name: str) -> Any:
        stand_in = STAND_INS.get(f"{module}.{name}")
        return stand_in if stand_in is not None else super().find_class(module, name)


_TRUSTING = type(pickle)("shardspeed_trusting_pickle")
_TRUSTING.__dict__.update(Unpickler=_TrustingUnpickler, load=pickle.load, loads=pickle.loads)
_GLOBAL_IN_MESSAGE = re.compile(
    r"GLOBAL (\S+) was not an allowed global|unrecognized function (.+)"
)


def _refused_global(path: str | os.PathLike[str], message: str) -> str:
    """The global torch's weights-only unpickler refused, from its message, or else from a scan
    of the file (without running it)."""
    match = _GLOBAL_IN_MESSAGE.search(message)
    if match is not None:
        name = (match.group(1) or match.group(2)).strip()
        return name if "." in name else f"builtins.{name}"  # torch drops "builtins."
    if zipfile.is_zipfile(path):
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        if unsafe:
            return ", ".join(unsafe)
    return "(not a plain global: an unsupported pickle instruction)"


def load_file(
    path: str | os.PathLike[str], mmap: bool = True, allow_unsafe_pickle: bool = False
) -> Any:
    """The object saved in checkpoint file ``path``, on the CPU: tensors (memory-mapped where
    the file allows it: the zip format ``torch.save`` writes by default, not
    ``checkpoint_serialization: false`` files) in plain containers. Raises
    :class:`RefusedPickleError` for a file that names any other global (unless
    ``allow_unsafe_pickle``), ``ValueError`` naming the file if it cannot be read."""
    zip_format = zipfile.is_zipfile(path)
    try:
        if allow_unsafe_pickle:
            logging.getLogger("shardspeed.checkpoint").warning(
                "loading %s with full pickle (allow_unsafe_pickle=True)", path
            )
            loaded = torch.load(
                path,
                map_location="cpu",
                weights_only=False,
                mmap=mmap and zip_format,
                pickle_module=_TRUSTING,
            )
        else:
            with torch.serialization.safe_globals(ALLOWED_GLOBALS):
                try:
                    loaded = torch.load(
                        path, map_location="cpu", weights_only=True, mmap=mmap and zip_format
                    )
                except pickle.UnpicklingError as error:
                    if "Weights only load failed" not in str(error):
                        raise
                    refused = _refused_global(path, str(error))
                    raise RefusedPickleError(str(path), refused, "weights_only=True") from None
    except RefusedPickleError:
        raise
    except FileNotFoundError:
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError, ValueError) as error:
        raise ValueError(
            f"cannot read checkpoint file {path} ({type(error).__name__}: {error}); it is "
            "truncated or corrupted: load another tag, or copy the file again"
        ) from error
    return plain(loaded)
