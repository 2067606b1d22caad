"""Saving and loading engine state in DeepSpeed's directory layout.

``save_dir/tag/mp_rank_00_model_states.pt`` holds the module weights, the optimizer wrapper's
state (loss scaler, fp32 masters, torch optimizer state), the LR scheduler, the step counters and
the client state; ``save_dir/latest`` names the newest tag. Where the ZeRO strategy partitions the
optimizer state (stages 1 and 2) every data-parallel rank also writes its own shard, named by the
strategy (``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``), and the model file holds no optimizer
state. Optimizer state carries its layout (parameter names and where each sits), so a job with
another data-parallel size, bucket size or ZeRO stage (0, 1 or 2) resumes from it: each rank
rebuilds its own partition (:mod:`~shardspeed.checkpoint.reshard`). ``zero_to_fp32.py`` is
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
from shardspeed.checkpoint.files import (
    MODEL_STATES,
    existing_tag,
    model_states_path,
    resolve_tag,
    zero3_model_states_name,
)
from shardspeed.checkpoint.manifest import check_tag
from shardspeed.checkpoint.snapshot import snapshot
from shardspeed.checkpoint.sources import UNIVERSAL_LAYOUT, read_model_states, saved_shards
from shardspeed.runtime import moe_checkpoint
from shardspeed.runtime.checkpoint_writer import PendingSave, start_save
from shardspeed.runtime.rank_agreement import agree_on
from shardspeed.runtime.train_state import COUNTERS
from shardspeed.utils.logging import log_dist
from shardspeed.version import __version__

if TYPE_CHECKING:
    from shardspeed.config import DeepSpeedConfig
    from shardspeed.runtime.engine import DeepSpeedEngine

#: (engine, client_state, exclude_frozen_parameters, commits) -> this rank's files
RankFiles = Callable[[Any, dict[str, Any], bool, bool], dict[str, Any]]

_DEEPSPEED_KEYS = (
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
)


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
    rank_files: RankFiles | None = None,
) -> bool:
    """Save a tag of ``engine``'s state; ``rank_files`` gives each rank's files (default: the
    model states and ZeRO shards of :func:`_rank_files`; the pipeline engine writes its own
    layout through the same staging, commit and agreement)."""
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
    failure, files = None, {}
    try:
        files = (rank_files or _rank_files)(
            engine, client_state, exclude_frozen_parameters, commits
        )
        # background: copied out first, so training can go on changing the live tensors
        files = snapshot(files, copy=config.decoupled, where="checkpoint")
        if commits:
            clear_staging(save_dir, tag)  # what a killed save of this tag left behind
    except Exception as error:  # a rank that stops alone leaves the others in a collective
        failure = error
    agree_on(failure, f"save checkpoint {Path(save_dir) / tag}", engine.device)
    pending = PendingSave(save_dir, tag, save_latest, commits, engine.device)
    start_save(pending, files, config.checkpoint_serialization, background=config.decoupled)
    if config.decoupled:
        engine.pending_checkpoint = pending
        log_dist(f"writing checkpoint {Path(save_dir) / tag} in the background", ranks=[0])
    else:
        pending.finish()
    return True


def wait(engine: DeepSpeedEngine) -> None:
    """Finish the background save in flight, if any (every rank; raises on every rank if it
    failed anywhere)."""
    pending, engine.pending_checkpoint = engine.pending_checkpoint, None
    if pending is not None:
        pending.finish()


def _rank_files(
    engine: DeepSpeedEngine,
    client_state: dict[str, Any],
    exclude_frozen_parameters: bool,
    commits: bool,
) -> dict[str, Any]:
    """This rank's files (name -> state): its optimizer shard (stages 1/2) and, on the
    committing rank, the model states."""
    files: dict[str, Any] = {}
    shard = _optimizer_shard_name(engine)
    optimizer_state = engine.optimizer.state_dict() if engine.optimizer is not None else None
    if shard is not None:
        files[shard] = {
            "optimizer_state_dict": optimizer_state,
            "dp_world_size": engine.strategy.checkpoint_world_size(),
        }
    # every rank: gathering a partitioned module (stage 3) is a collective
    module_state = engine.strategy.full_state_dict(
        exclude_frozen_parameters=exclude_frozen_parameters
    )
    moe: dict[str, Any] = {}
    if moe_checkpoint.has_experts(engine.module):  # experts go to files of their own
        module_state, expert_files, info = moe_checkpoint.split_module_state(engine, module_state)
        files.update(expert_files)
        moe[moe_checkpoint.MOE_INFO] = info
    buffer_names = [name for name, _ in engine.module.named_buffers()]
    state = {
        **moe,
        "optimizer": None if shard is not None else optimizer_state,
        "lr_scheduler": engine.lr_scheduler.state_dict()
        if engine.lr_scheduler is not None
        else None,
        "buffer_names": buffer_names,
        "dp_world_size": engine.strategy.checkpoint_world_size(),
        "zero_stage": engine.zero_optimization_stage(),
        "ds_config": engine.config.raw,
        "ds_version": __version__,
        **engine.state.state_dict(),
        **client_state,
    }
    rank_shard = engine.strategy.checkpoint_shard_name()
    if engine.zero_optimization_stage() == 3 and rank_shard is not None:
        # DeepSpeed's ZeRO-3 names a model-states file per rank; tools read rank 0's (Lightning)
        buffers = {name: module_state[name] for name in buffer_names if name in module_state}
        files[zero3_model_states_name(rank_shard)] = {"module": buffers, **state}
    if commits:
        files[MODEL_STATES] = {"module": module_state, **state}
    return files


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


def _optimizer_shard_name(engine: DeepSpeedEngine) -> str | None:
    """This rank's optimizer shard file name, or None when the optimizer state is replicated."""
    return None if engine.optimizer is None else engine.strategy.checkpoint_shard_name()


def _optimizer_state(
    engine: DeepSpeedEngine, folder: Path, state: dict[str, Any], allow_unsafe_pickle: bool
) -> dict[str, Any] | None:
    """This rank's optimizer state for this run's stage, data-parallel size and buckets, from
    whatever form the checkpoint holds it in (:mod:`~shardspeed.checkpoint.sources`),
    saved under any stage or world size. None if the saving engine had no optimizer."""
    assert engine.optimizer is not None
    shards = saved_shards(folder, state, allow_unsafe_pickle)
    if shards is None:
        return None
    return engine.strategy.sharded_state(*shards, state["module"])


def load(
    engine: DeepSpeedEngine,
    load_dir: str,
    tag: str | None,
    *,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    custom_load_fn: Any,
    allow_unsafe_pickle: bool | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    wait(engine)  # a background save of this very tag must be committed before it is read
    config = engine.config.checkpoint
    unsafe = config.allow_unsafe_pickle if allow_unsafe_pickle is None else allow_unsafe_pickle
    tag = resolve_tag(load_dir, tag, config.load_universal)
    if tag is None:
        log_dist(f"no 'latest' file in {load_dir} and no tag given: nothing loaded", ranks=[0])
        return None, None
    folder = existing_tag(load_dir, tag)
    path = model_states_path(folder)
    failure, state = None, {}
    try:
        if not path.is_file():
            present = sorted(p.name for p in Path(load_dir).iterdir() if p.is_dir())
            raise FileNotFoundError(
                f"checkpoint file {path} does not exist; check load_dir and tag (tags present: "
                f"{present})"
            )
        check_tag(folder, config.verify_checksums)
        # not memory-mapped: the client state handed back to the caller stays ordinary memory
        state = read_model_states(folder, unsafe, mmap=False)
    except Exception as error:  # every rank must learn of it before any collective
        failure = error
    agree_on(failure, f"load checkpoint {folder}", engine.device)
    module_state = state.get("module", state)
    experts = bool(state.get(moe_checkpoint.MOE_INFO)) and moe_checkpoint.has_experts(engine.module)
    failure = None
    try:  # the experts this rank holds now, from their own files
        module_state = moe_checkpoint.module_state_with_experts(engine, folder, state, unsafe)
    except Exception as error:  # every rank must learn of it before any collective
        failure = error
    agree_on(failure, f"load the expert weights of {folder}", engine.device)
    engine.strategy.load_full_state_dict(module_state, load_module_strict, custom_load_fn)
    saved, failure = None, None
    if load_optimizer_states and engine.optimizer is not None:
        try:
            saved = _optimizer_state(engine, folder, state, unsafe)
        except Exception as error:  # every rank must learn of it before any collective
            failure = error
        agree_on(failure, f"load the optimizer state of {folder}", engine.device)
    if saved is not None:
        assert engine.optimizer is not None
        if experts:
            saved = moe_checkpoint.with_expert_slots(engine, saved)
        engine.optimizer.load_state_dict(saved)
        if experts:
            try:
                moe_checkpoint.load_expert_optimizer(engine, folder, unsafe)
            except Exception as error:  # every rank must learn of it before any collective
                failure = error
            agree_on(failure, f"load the expert optimizer state of {folder}", engine.device)
    if engine.optimizer is not None and (
        saved is None or not engine.config.zero_optimization.load_from_fp32_weights
    ):
        # no optimizer state loaded, or zero_optimization.load_from_fp32_weights=false: the
        # master weights follow the (possibly 16-bit) module weights just loaded
        engine.strategy.load_state_dict({})
    if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.state.load_state_dict(state)
    reserved = {
        "module",
        "optimizer",
        "lr_scheduler",
        "buffer_names",
        "dp_world_size",
        "zero_stage",
        "ds_config",
        "ds_version",
        *COUNTERS,
        UNIVERSAL_LAYOUT,  # the caller's own universal_checkpoint_info comes back, as in DeepSpeed
        moe_checkpoint.MOE_INFO,
        # what DeepSpeed's model files add
        *_DEEPSPEED_KEYS,
    }
    client_state = {k: v for k, v in state.items() if k not in reserved}
    return str(path), client_state


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
    if engine.global_rank == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().cpu() for k, v in weights.items()}
        save_file(weights, Path(save_dir), save_filename)
    if comm.get_world_size() > 1:
        comm.barrier()
    return True
