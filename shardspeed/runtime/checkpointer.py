"""The one checkpoint writer: a tag of engine state in DeepSpeed's directory layout, written whole
or not at all, with the record of what every file holds.

What each rank writes is its format's :class:`~shardspeed.checkpoint.planner.SavePlan` (the
files and the pieces of global tensors each holds): ZeRO 0-3 and Mixture-of-Experts models
(:mod:`~shardspeed.runtime.zero_checkpoint`) and pipelines (:mod:`~shardspeed.runtime.pipe
.checkpoint`) state theirs; this module writes them all the same way. The ranks' holdings are
gathered into one record (:func:`~shardspeed.checkpoint.planner.save_record`) that the plan's
record file (the model-states file) carries under
:data:`~shardspeed.checkpoint.planner.PLAN_KEY`; the one reader
(:mod:`~shardspeed.runtime.checkpoint_reader`) checks it before loading. ``zero_to_fp32.py`` is
written beside the checkpoint to consolidate it without shardspeed.

Safety: what is saved must be plain data (:func:`~shardspeed.checkpoint.snapshot.snapshot`), and
every file is read back without running pickled code (:mod:`~shardspeed.checkpoint.reader`). A tag
is written whole or not at all (:mod:`~shardspeed.runtime.checkpoint_writer`: staging folder,
durable files, a manifest, then ``latest``), so a crash at any point leaves the previous tag
loadable and named in ``latest``; loading checks the tag against its manifest first. With
``checkpoint.writer.decoupled`` the files are written by a background thread while training
goes on; ``engine.wait_for_checkpoint()`` or the next save joins it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardspeed import comm
from shardspeed.checkpoint.commit import clear_staging
from shardspeed.checkpoint.file_writer import save_file
from shardspeed.checkpoint.planner import PLAN_KEY, SavePlan, save_record
from shardspeed.checkpoint.snapshot import snapshot
from shardspeed.runtime import moe_checkpoint
from shardspeed.runtime.checkpoint_writer import PendingSave, start_save
from shardspeed.runtime.rank_agreement import agree_on
from shardspeed.utils.logging import log_dist

if TYPE_CHECKING:
    from shardspeed.config import DeepSpeedConfig
    from shardspeed.runtime.engine import DeepSpeedEngine

#: (engine, client_state, exclude_frozen_parameters, commits) -> this rank's save plan
SavePlanner = Callable[[Any, dict[str, Any], bool, bool], SavePlan]


class TagMismatchError(ValueError, AssertionError):
    """``checkpoint.tag_validation: "Fail"`` and the ranks gave different tags (DeepSpeed
    asserts)."""


def check_config(config: DeepSpeedConfig) -> None:
    """Refuse, at initialize, checkpoint settings whose behaviour shardspeed does not have."""
    if config.nebula.enabled:
        raise NotImplementedError(
            "nebula.enabled=true (the Azure Nebula checkpoint service) is not yet supported in "
            "shardspeed; remove the nebula section to save with save_checkpoint's own files"
        )
    writer = config.checkpoint.writer
    if writer is not None and writer.type == "MOCK":
        raise NotImplementedError(
            'checkpoint.writer.type="MOCK" (write nothing) is not yet supported in shardspeed; '
            "use PYTHON or FAST, or leave the writer out"
        )
    if writer is not None:
        mode = "in a background thread (decoupled)" if writer.decoupled else "synchronously"
        log_dist(
            f"checkpoint.writer {writer.type}: shardspeed writes every file with torch.save "
            f"{mode}, each rank its own shard; the writer's buffer settings do not apply",
            ranks=[0],
        )


def save(
    engine: DeepSpeedEngine,
    save_dir: str,
    tag: str | None,
    client_state: dict[str, Any],
    save_latest: bool,
    exclude_frozen_parameters: bool,
    planner: SavePlanner,
) -> bool:
    """Save a tag of ``engine``'s state: each rank's files as ``planner`` plans them (its
    format's :meth:`~shardspeed.runtime.checkpoint_format.PlannedFormat.plan_save`), with the
    record of every rank's holdings in the plan's record file."""
    wait(engine)  # a save in flight is committed (or fails) before the next one starts
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if "/" in tag or tag in ("", ".", "..") or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name")
    _validate_tag(engine, tag)
    config = engine.config.checkpoint
    # use_node_local_storage: each node's first rank writes the shared files to its own disk
    commits = (
        comm.get_local_rank() == 0 if config.use_node_local_storage else engine.global_rank == 0
    )
    failure, files, plan = None, {}, SavePlan({})
    try:
        plan = planner(engine, client_state, exclude_frozen_parameters, commits)
        # background: copied out first, so training can go on changing the live tensors
        files = snapshot(plan.files, copy=config.decoupled, where="checkpoint")
        if commits:
            clear_staging(save_dir, tag)  # what a killed save of this tag left behind
    except Exception as error:  # a rank that stops alone leaves the others in a collective
        failure = error
    agree_on(failure, f"save checkpoint {Path(save_dir) / tag}", engine.device)
    _add_record(plan, files)
    pending = PendingSave(save_dir, tag, save_latest, commits, engine.device)
    start_save(pending, files, config.checkpoint_serialization, background=config.decoupled)
    if config.decoupled:
        engine.pending_checkpoint = pending
        log_dist(f"writing checkpoint {Path(save_dir) / tag} in the background", ranks=[0])
    else:
        pending.finish()
    return True


def _add_record(plan: SavePlan, files: dict[str, Any]) -> None:
    """Put the record of every rank's holdings into this rank's record file, if it writes one
    (every rank calls it: the holdings are gathered)."""
    holdings = [plan.holdings]
    if comm.get_world_size() > 1:
        holdings = [[] for _ in range(comm.get_world_size())]
        comm.all_gather_object(holdings, plan.holdings)
    if plan.record_file is not None and plan.record_file in files:
        record = save_record(holdings, plan.tensor_parallel)
        files[plan.record_file] = {**files[plan.record_file], PLAN_KEY: record}


def wait(engine: DeepSpeedEngine) -> None:
    """Finish the background save in flight, if any (every rank; raises on every rank if it
    failed anywhere)."""
    pending, engine.pending_checkpoint = engine.pending_checkpoint, None
    if pending is not None:
        pending.finish()


def _validate_tag(engine: DeepSpeedEngine, tag: str) -> None:
    """``checkpoint.tag_validation``: every rank must save under the same tag (a rank-specific
    tag splits the checkpoint into folders no job can load). Warn or fail, as configured."""
    config = engine.config.checkpoint
    if not config.tag_validation_enabled or comm.get_world_size() == 1:
        return
    digest = hashlib.sha1(tag.encode()).digest()
    local = torch.tensor(list(digest), dtype=torch.float32, device=engine.device)
    low, high = local.clone(), local.clone()
    comm.all_reduce(low, op=comm.ReduceOp.MIN)
    comm.all_reduce(high, op=comm.ReduceOp.MAX)
    if torch.equal(low, high):
        return
    message = (
        f"[rank {comm.get_rank()}] the checkpoint tag {tag!r} differs between ranks (is not "
        "consistent across all ranks); every rank must pass the same tag to save_checkpoint "
        "(leave rank-specific parts out of it)"
    )
    if config.tag_validation_fail:
        raise TagMismatchError(message)
    log_dist(message, ranks=[-1], level=logging.WARNING)


def save_module_weights(
    engine: DeepSpeedEngine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool
) -> bool:
    # every rank: gathering a partitioned module (stage 3) is a collective
    weights = engine.strategy.weights_for_save(
        exclude_frozen_parameters, engine.zero_gather_16bit_weights_on_model_save()
    )
    if weights is None:
        return False
    if moe_checkpoint.has_experts(engine.module):  # every expert, from the peers holding it
        weights = moe_checkpoint.whole_model_weights(engine.module, weights)
    weights = engine.whole_tensor_parallel(weights)  # AutoTP pieces joined (a collective)
    if engine.global_rank == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().cpu() for k, v in weights.items()}
        save_file(weights, Path(save_dir), save_filename)
    if comm.get_world_size() > 1:
        comm.barrier()
    return True
