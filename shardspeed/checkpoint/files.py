"""Where a checkpoint's parts lie on disk: DeepSpeed's file and folder names, and finding a tag.

``save_dir/<tag>/`` holds the model-states file (:data:`MODEL_STATES`) and, where the optimizer
state is partitioned, one optimizer shard per data-parallel rank (:data:`OPTIM_SHARD`), at stage 3
with a model-states file per rank beside it (:data:`ZERO3_MODEL_STATES`, DeepSpeed's names, which
the helpers of DeepSpeed's ``zero_to_fp32`` find: :func:`get_model_state_file`);
``save_dir/latest`` names the newest tag and ``save_dir/latest_universal`` the newest universal
one. A save writes a tag into :func:`staging_folder` and renames it into place when complete
(:mod:`.commit`). Standard library only: this module is part of the standalone
``zero_to_fp32.py``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

#: the model-states file of a tag: module weights, counters, client state (and stage 0's
#: optimizer state)
MODEL_STATES = "mp_rank_00_model_states.pt"
#: one data-parallel rank's optimizer shard (stages 1/2), by rank
OPTIM_SHARD = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
#: DeepSpeed's ZeRO-3 writes a model-states file per data-parallel rank, by rank, and no
#: :data:`MODEL_STATES` (their module tensors are empty: the weights are in the optimizer shards).
#: shardspeed's stage 3 writes them too, beside its :data:`MODEL_STATES` (counters, config and
#: client state, the module's buffers only), for the tools that read DeepSpeed's names
ZERO3_MODEL_STATES = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
#: one expert's weights (Mixture of Experts), by MoE layer and global expert index: DeepSpeed's
#: name; the module weights in :data:`MODEL_STATES` leave the experts out
EXPERT_MODEL_STATES = "layer_{}_expert_{}_mp_rank_00_model_states.pt"
#: the same expert's fp32 weights and optimizer state, each parameter whole (shardspeed's)
EXPERT_OPTIM_STATES = "layer_{}_expert_{}_mp_rank_00_optim_states.pt"
#: the file beside the tags naming the newest one
LATEST_FILE = "latest"
#: the file beside a checkpoint naming the newest universal tag
LATEST_UNIVERSAL = "latest_universal"
#: a universal parameter folder's file of fp32 weights (the others are named by state key)
UNIVERSAL_MASTER = "fp32"
#: the model-states key a universal checkpoint (:mod:`.ds_to_universal`) adds
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"


def tp_file_name(template: str, mp_rank: int) -> str:
    """``template`` (one of the ``*_mp_rank_00_*`` names, formatted or not) for
    tensor-parallel rank ``mp_rank`` (DeepSpeed's ``mp_rank_{mp_rank:02d}``)."""
    return template.replace("mp_rank_00", f"mp_rank_{mp_rank:02d}")


def zero3_model_states_name(optimizer_shard: str) -> str:
    """The :data:`ZERO3_MODEL_STATES` name of the data-parallel rank whose optimizer shard is
    named ``optimizer_shard`` (:data:`OPTIM_SHARD`)."""
    pattern = re.escape(OPTIM_SHARD).replace(re.escape("{}"), r"(\d+)")
    pattern = pattern.replace("mp_rank_00", r"mp_rank_(\d\d)")
    rank = re.fullmatch(pattern, optimizer_shard)
    if rank is None:
        raise ValueError(f"{optimizer_shard!r} is not a ZeRO optimizer shard name")
    return tp_file_name(ZERO3_MODEL_STATES.format(rank.group(1)), int(rank.group(2)))


def _natural_key(name: str) -> list[int | str]:
    """Sort key putting ``rank_2`` before ``rank_10`` (digit runs compare as numbers)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """The files of tag folder ``checkpoint_dir`` matching ``glob_pattern``, in natural order
    (DeepSpeed's ``zero_to_fp32`` helper); FileNotFoundError when there are none."""
    found = sorted((str(p) for p in Path(checkpoint_dir).glob(glob_pattern)), key=_natural_key)
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every optimizer-states file of tag folder ``checkpoint_dir``, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every model-states file of tag folder ``checkpoint_dir``, in natural order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir: str | os.PathLike[str], zero_stage: int) -> str:
    """The model-states file of tag folder ``checkpoint_dir`` saved at ZeRO stage
    ``zero_stage``, as DeepSpeed names it: :data:`MODEL_STATES` for stages 0-2, rank 0's
    :data:`ZERO3_MODEL_STATES` for stage 3 (or :data:`MODEL_STATES` in a stage 3 tag written
    before shardspeed wrote the per-rank files). FileNotFoundError when it is missing."""
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    path = folder / MODEL_STATES
    if int(zero_stage) == 3:
        zero3 = folder / ZERO3_MODEL_STATES.format(0)
        path = zero3 if zero3.is_file() or not path.is_file() else path
    if not path.is_file():
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return str(path)


def shard_paths(folder: Path, count: int, mp_rank: int = 0) -> list[Path]:
    """The optimizer shard of each of ``count`` ranks (of tensor-parallel rank ``mp_rank``):
    ``zero_pp_rank_*``, or DeepSpeed's ``bf16_zero_pp_rank_*`` (its name for the same files
    when bf16 is on)."""
    plain = [folder / tp_file_name(OPTIM_SHARD.format(r), mp_rank) for r in range(count)]
    bf16 = [p.with_name("bf16_" + p.name) for p in plain]
    return bf16 if not plain[0].is_file() and bf16[0].is_file() else plain


def model_states_path(folder: Path) -> Path:
    """The model-states file of tag ``folder``: :data:`MODEL_STATES`, or where only DeepSpeed's
    ZeRO-3 wrote one, its rank 0's (:data:`ZERO3_MODEL_STATES`); :data:`MODEL_STATES` when
    neither exists (for the caller's message)."""
    path = folder / MODEL_STATES
    zero3 = folder / ZERO3_MODEL_STATES.format(0)
    return zero3 if not path.is_file() and zero3.is_file() else path


def is_deepspeed_zero3(folder: Path) -> bool:
    """Whether tag ``folder`` was written by DeepSpeed's ZeRO-3 (its model-states files are
    :data:`ZERO3_MODEL_STATES`, one per rank; every other writer's is :data:`MODEL_STATES`)."""
    return model_states_path(folder).name != MODEL_STATES


def staging_folder(save_dir: str | os.PathLike[str], tag: str) -> Path:
    """Where a save writes tag ``tag`` until it is complete (hidden; renamed to the tag)."""
    return Path(save_dir) / f".{tag}.saving"


def replaced_folder(save_dir: str | os.PathLike[str], tag: str) -> Path:
    """Where a save of tag ``tag`` moves the tag's previous folder for the instant it takes to
    rename the new one into place (then removes it)."""
    return Path(save_dir) / f".{tag}.replaced"


def existing_tag(save_dir: str | os.PathLike[str], tag: str) -> Path:
    """The folder of tag ``tag``: ``save_dir/tag``, or the previous version of the tag if a save
    that replaced it was killed between moving it aside and renaming the new one into place."""
    folder = Path(save_dir) / tag
    previous = replaced_folder(save_dir, tag)
    if not folder.exists() and previous.is_dir():
        logging.getLogger("shardspeed.checkpoint").warning(
            "%s is missing: a save of it was interrupted while replacing it; loading the "
            "previous version of the tag from %s",
            folder,
            previous,
        )
        return previous
    return folder


def tag_folder(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """The folder of checkpoint ``tag`` in ``checkpoint_dir`` (``tag=None``: the one ``latest``
    names), which must hold a model-states file (:func:`model_states_path`)."""
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / LATEST_FILE
        if not latest.is_file():
            raise FileNotFoundError(
                f"no 'latest' file in {root}: pass tag= (one of the sub-directories, e.g. "
                "global_step14), or point checkpoint_dir at the directory save_checkpoint wrote"
            )
        tag = latest.read_text().strip()
    folder = existing_tag(root, str(tag))
    if not model_states_path(folder).is_file():
        raise FileNotFoundError(f"{folder / MODEL_STATES} does not exist: not a checkpoint tag")
    return folder


def resolve_tag(load_dir: str, tag: str | None, universal: bool = False) -> str | None:
    """The tag to load: the one given, else the one named in ``latest`` (None if absent), or
    with ``universal`` (``checkpoint.load_universal``) in ``latest_universal`` (which must
    exist, as DeepSpeed requires)."""
    if tag is not None:
        return str(tag)
    if universal:
        latest = Path(load_dir) / LATEST_UNIVERSAL
        if not latest.is_file():
            raise ValueError(
                f"checkpoint.load_universal is set but {latest} does not exist: convert the "
                "checkpoint with python -m shardspeed.checkpoint.ds_to_universal, or pass tag="
            )
        return latest.read_text().strip()
    latest = Path(load_dir) / LATEST_FILE
    return latest.read_text().strip() if latest.is_file() else None
