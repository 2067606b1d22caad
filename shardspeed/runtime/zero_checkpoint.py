"""The checkpoint format of the plain engine: ZeRO stages 0-3, with Mixture-of-Experts models,
in DeepSpeed's directory layout.

``save_dir/tag/mp_rank_00_model_states.pt`` holds the module weights, the optimizer wrapper's
state when it is replicated (stage 0), the LR scheduler, the step counters, the client state and
the record of the save (:data:`~shardspeed.checkpoint.planner.PLAN_KEY`). Where the strategy
partitions the optimizer state (stages 1-3) every data-parallel rank writes its shard
(``zero_pp_rank_{r}_mp_rank_00_optim_states.pt``), and at stage 3 a per-rank model-states file
beside it (DeepSpeed's names, which tools read). A Mixture-of-Experts model's experts go to files
of their own (:mod:`~shardspeed.runtime.moe_checkpoint`). Optimizer state carries its layout, so
a job with another data-parallel size, bucket size or ZeRO stage resumes from it
(:mod:`~shardspeed.checkpoint.reshard`).

What each file holds, as the planner records it (:mod:`~shardspeed.checkpoint.planner`): the
model states every module tensor whole (the experts' left out), a stage 0 optimizer every
trained parameter whole; a rank's shard the ranges of each parameter's flattened elements in its
chunk of each bucket; an expert's files its parameters whole, or its row of a fused one.

With AutoTP (``tensor_parallel.autotp_size``) every tensor-parallel rank ``t`` has its own
``mp_rank_{t:02d}_*`` files, and a checkpoint loads at any tensor-parallel size
(:mod:`~shardspeed.runtime.checkpoint_tp`).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardspeed.checkpoint.files import (
    MODEL_STATES,
    model_states_path,
    tp_file_name,
    zero3_model_states_name,
)
from shardspeed.checkpoint.planner import (
    MODULE,
    OPTIMIZER,
    SavePlan,
    Shape,
    layout_pieces,
    whole_pieces,
)
from shardspeed.checkpoint.sources import UNIVERSAL_LAYOUT, read_model_states, saved_shards
from shardspeed.runtime import checkpoint_tp, moe_checkpoint
from shardspeed.runtime.checkpoint_format import PlannedFormat
from shardspeed.runtime.train_state import COUNTERS
from shardspeed.version import __version__

if TYPE_CHECKING:
    from torch import nn

    from shardspeed.runtime.checkpoint_reader import LoadOptions
    from shardspeed.runtime.engine import DeepSpeedEngine

#: what DeepSpeed's model files add (not the caller's client state)
_DEEPSPEED_KEYS = (
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
    "curriculum_scheduler_legacy",
    "sparse_tensor_module_names",
)


def param_shapes(module: nn.Module) -> dict[str, Shape]:
    """Every parameter's global shape, by each of its names (tied ones under all of them)."""
    return {n: tuple(p.shape) for n, p in module.named_parameters(remove_duplicate=False)}


class ZeroFormat(PlannedFormat["DeepSpeedEngine"]):
    """:class:`~shardspeed.runtime.checkpoint_format.PlannedFormat` of the plain engine (see
    the module docstring)."""

    reserved = frozenset(
        {
            "module",
            "optimizer",
            "lr_scheduler",
            "buffer_names",
            "dp_world_size",
            "zero_stage",
            "ds_config",
            "ds_version",
            *COUNTERS,
            UNIVERSAL_LAYOUT,  # the caller's universal_checkpoint_info comes back, as in DeepSpeed
            moe_checkpoint.MOE_INFO,
            *_DEEPSPEED_KEYS,
        }
    )

    # -- save ---------------------------------------------------------------------------------
    def plan_save(
        self,
        engine: DeepSpeedEngine,
        client_state: dict[str, Any],
        exclude_frozen_parameters: bool,
        commits: bool,
    ) -> SavePlan:
        """This rank's optimizer shard (stages 1-3), its expert files, its stage 3 model-states
        file and, on the committing rank, the model states, with what each holds."""
        plan = SavePlan({}, record_file=MODEL_STATES if commits else None)
        files, strategy = plan.files, engine.strategy
        shapes = param_shapes(engine.module)
        tp_rank, tp_size = checkpoint_tp.tp_rank_and_size(engine)
        tp = checkpoint_tp.tp_record(engine.module, tp_size) if tp_size > 1 else None
        plan.tensor_parallel = tp
        model_states = tp_file_name(MODEL_STATES, tp_rank)
        shard = None if engine.optimizer is None else strategy.checkpoint_shard_name()
        optimizer_state = engine.optimizer.state_dict() if engine.optimizer is not None else None
        dp_rank = None
        if shard is not None:
            assert optimizer_state is not None
            count = strategy.checkpoint_world_size()
            dp_rank = next(r for r in range(count) if strategy.checkpoint_shard_name(r) == shard)
            shard = tp_file_name(shard, tp_rank)
            files[shard] = {"optimizer_state_dict": optimizer_state, "dp_world_size": count}
            layout = optimizer_state["strategy"].get("layout", [])
            pieces = layout_pieces(layout, count, dp_rank, shapes)
            plan.hold(shard, OPTIMIZER, [p.of_part(tp_rank) for p in pieces] if tp else pieces)
        # every rank: gathering a partitioned module (stage 3) is a collective
        module_state = strategy.full_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        moe: dict[str, Any] = {}
        if tp is not None and moe_checkpoint.has_experts(engine.module):
            raise NotImplementedError(
                "saving a Mixture-of-Experts model trained with AutoTP "
                "(tensor_parallel.autotp_size > 1) is not yet supported in shardspeed"
            )
        if moe_checkpoint.has_experts(engine.module):  # experts go to files of their own
            module_state, expert_files, info = moe_checkpoint.split_module_state(
                engine, module_state
            )
            files.update(expert_files)
            plan.holdings += moe_checkpoint.expert_holdings(engine.module, expert_files)
            moe[moe_checkpoint.MOE_INFO] = info
        buffer_names = [name for name, _ in engine.module.named_buffers()]
        state = {
            **moe,
            "optimizer": None if shard is not None else optimizer_state,
            "lr_scheduler": engine.lr_scheduler.state_dict()
            if engine.lr_scheduler is not None
            else None,
            "buffer_names": buffer_names,
            "dp_world_size": strategy.checkpoint_world_size(),
            "mp_world_size": tp_size,
            "zero_stage": engine.zero_optimization_stage(),
            "ds_config": engine.config.raw,
            "ds_version": __version__,
            **engine.state.state_dict(),
            **engine.data_efficiency_state(),
            **client_state,
        }
        rank_shard = strategy.checkpoint_shard_name()
        if engine.zero_optimization_stage() == 3 and rank_shard is not None:
            # DeepSpeed's ZeRO-3 names a model-states file per rank; tools read rank 0's
            buffers = {name: module_state[name] for name in buffer_names if name in module_state}
            name = zero3_model_states_name(tp_file_name(rank_shard, tp_rank))
            files[name] = {"module": buffers, **state}
            plan.hold(name, MODULE, whole_pieces(buffers))
        # AutoTP: the first data-parallel rank of each tensor-parallel group writes its pieces
        writes = commits if tp is None else _first_data_parallel_rank(engine)
        if writes:
            files[model_states] = {"module": module_state, **state}
            plan.hold(model_states, MODULE, checkpoint_tp.module_pieces(module_state, tp, tp_rank))
            if shard is None and optimizer_state is not None:  # replicated: whole
                layout = optimizer_state["strategy"].get("layout", [])
                pieces = layout_pieces(layout, 1, 0, shapes)
                pieces = [p.of_part(tp_rank) for p in pieces] if tp else pieces
                plan.hold(model_states, OPTIMIZER, pieces)
        return plan

    # -- load ---------------------------------------------------------------------------------
    def states_path(self, folder: Path) -> Path:
        path = model_states_path(folder)
        if not path.is_file():
            present = sorted(p.name for p in folder.parent.iterdir() if p.is_dir())
            raise FileNotFoundError(
                f"checkpoint file {path} does not exist; check load_dir and tag (tags present: "
                f"{present})"
            )
        return path

    def read_states(self, folder: Path, path: Path, unsafe: bool) -> dict[str, Any]:
        # not memory-mapped: the client state handed back to the caller stays ordinary memory
        return read_model_states(folder, unsafe, mmap=False)

    def expected(
        self, engine: DeepSpeedEngine, module: bool, optimizer: bool
    ) -> Mapping[str, Mapping[str, Shape]]:
        model = engine.module
        experts = moe_checkpoint.expert_params(model) if moe_checkpoint.has_experts(model) else []
        local = {e.local_name for e in experts}  # the files name experts as ep_size=1 does
        by_global = {e.global_name: moe_checkpoint.expert_piece(e).global_shape for e in experts}
        out: dict[str, dict[str, Shape]] = {}

        def whole(name: str, tensor: torch.Tensor) -> Shape:  # an AutoTP piece: its whole
            layout = getattr(tensor, "tp_layout", None)
            return tuple(tensor.shape) if layout is None else tuple(layout.full_shape)

        if module:
            named = chain(
                model.named_parameters(remove_duplicate=False),
                model.named_buffers(remove_duplicate=False),
            )
            out[MODULE] = {n: whole(n, t) for n, t in named if n not in local} | by_global
        if optimizer:
            trained = model.named_parameters()  # tied: under its first name, as stepped
            out[OPTIMIZER] = {
                n: whole(n, p) for n, p in trained if p.requires_grad and n not in local
            } | by_global
        return out

    def read_module(
        self,
        engine: DeepSpeedEngine,
        folder: Path,
        state: dict[str, Any],
        unsafe: bool,
        options: LoadOptions,
    ) -> Any:
        if checkpoint_tp.involved(engine, state, str(folder / MODEL_STATES)):
            whole = checkpoint_tp.whole_module_state(folder, state, unsafe)
            return checkpoint_tp.local_module_state(engine, whole)
        # the experts this rank holds now, from their own files
        return moe_checkpoint.module_state_with_experts(engine, folder, state, unsafe)

    def apply_module(self, engine: DeepSpeedEngine, weights: Any, options: LoadOptions) -> None:
        engine.strategy.load_full_state_dict(weights, options.module_strict, options.custom_load_fn)

    def optimizer_state(
        self, engine: DeepSpeedEngine, folder: Path, state: dict[str, Any], unsafe: bool
    ) -> dict[str, Any] | None:
        """From whatever form the checkpoint holds it in (:mod:`~shardspeed.checkpoint
        .sources`), saved under any stage or world size."""
        if checkpoint_tp.involved(engine, state, str(folder / MODEL_STATES)):
            # whole pieces of this rank's parameters, re-partitioned by the strategy below
            shard = checkpoint_tp.optimizer_shard(engine, folder, state, unsafe)
            if shard is None:
                return None
            return engine.strategy.sharded_state(lambda _: shard, 1, {})
        shards = saved_shards(folder, state, unsafe)
        if shards is None:
            return None
        saved = engine.strategy.sharded_state(*shards, state["module"])
        if _in_expert_layout(engine, state):
            saved = moe_checkpoint.with_expert_slots(engine, saved)
        return saved

    def after_optimizer(
        self, engine: DeepSpeedEngine, folder: Path, state: dict[str, Any], unsafe: bool
    ) -> None:
        if _in_expert_layout(engine, state):
            moe_checkpoint.load_expert_optimizer(engine, folder, unsafe)


def _first_data_parallel_rank(engine: DeepSpeedEngine) -> bool:
    """Whether this rank is the first of the ranks holding the same parameters (data and
    sequence parallel): it writes its tensor-parallel rank's model states."""
    return engine.topology.local_rank("dp", "sp") == 0


def _in_expert_layout(engine: DeepSpeedEngine, state: dict[str, Any]) -> bool:
    """Whether the experts' optimizer state is in their own files (shardspeed's MoE saves)."""
    return bool(state.get(moe_checkpoint.MOE_INFO)) and moe_checkpoint.has_experts(engine.module)


#: the format the plain engine saves and loads through
ZERO_FORMAT = ZeroFormat()
