"""Checkpoints of Mixture-of-Experts models, in DeepSpeed's expert layout, re-partitioned on load.

The module weights in ``mp_rank_00_model_states.pt`` leave the experts out; each expert's
weights go to ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` (``L``: the MoE layer's index
in module order, ``E``: the global expert index), keyed by the parameter names an ``ep_size=1``
model has (``...deepspeed_experts.<E>...``), as DeepSpeed writes them. Beside each, shardspeed
writes ``layer_<L>_expert_<E>_mp_rank_00_optim_states.pt``: every parameter of the expert whole,
its fp32 master and its optimizer state. The first rank of each expert-data-parallel group
writes the files of the experts its group holds.

Nothing in these files depends on the saving job's expert-parallel or data-parallel size, so a
job with another ``ep_size`` or world size loads them: each rank reads the files of the experts
it now holds and cuts its own piece. The rest of the optimizer state (the dense parameters) is
saved and re-partitioned as for any model (:mod:`shardspeed.runtime.checkpointer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardspeed.checkpoint.files import EXPERT_MODEL_STATES, EXPERT_OPTIM_STATES
from shardspeed.checkpoint.reader import load_file
from shardspeed.moe.experts import Experts
from shardspeed.moe.utils import is_moe_param
from shardspeed.utils import groups

if TYPE_CHECKING:
    from shardspeed.runtime.engine import DeepSpeedEngine

#: the model-states key saying the experts are in their own files, and how many there are
MOE_INFO = "moe_experts"
_MARKER = "deepspeed_experts."


@dataclass(frozen=True)
class ExpertParam:
    """One parameter of one local expert, and where a checkpoint keeps it."""

    local_name: str
    param: nn.Parameter
    layer: int
    expert: int
    #: its name in an ``ep_size=1`` model (the key in the expert's files)
    global_name: str
    #: whether this rank writes its expert's files (first of its expert-data-parallel group)
    writes: bool


def expert_params(module: nn.Module) -> list[ExpertParam]:
    """Every expert parameter of ``module``'s MoE layers, in module order. Raises for expert
    parameters outside DeepSpeed's ``Experts`` container, whose layout has no files."""
    found: list[ExpertParam] = []
    layer = 0
    for prefix, experts in module.named_modules():
        if not isinstance(experts, Experts):
            continue
        params = list(experts.parameters())
        name = params[0].group_name if params else groups.expert_group_name(1)  # type: ignore[attr-defined]
        ep_rank = groups._get_expert_parallel_rank(name)
        writes = groups._get_expert_data_parallel_rank(name) == 0 if _has_groups(name) else True
        local_count = experts.num_local_experts
        for index, expert in enumerate(experts.deepspeed_experts):
            global_index = ep_rank * local_count + index
            for pname, param in expert.named_parameters():
                local = f"{prefix}.{_MARKER}{index}.{pname}"
                found.append(
                    ExpertParam(
                        local,
                        param,
                        layer,
                        global_index,
                        f"{prefix}.{_MARKER}{global_index}.{pname}",
                        writes,
                    )
                )
        layer += 1
    covered = {id(e.param) for e in found}
    stray = [n for n, p in module.named_parameters() if is_moe_param(p) and id(p) not in covered]
    if stray:
        raise NotImplementedError(
            f"expert parameters outside a deepspeed_experts container ({stray[:3]}) have no "
            "checkpoint layout in shardspeed yet; save the module weights with "
            "save_16bit_model instead"
        )
    return found


def _has_groups(name: str) -> bool:
    return name in groups._get_expert_parallel_group_dict()


def has_experts(module: nn.Module) -> bool:
    return any(isinstance(m, Experts) for m in module.modules())


# -- save -------------------------------------------------------------------------------------
def split_module_state(
    engine: DeepSpeedEngine, module_state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the module state without experts, this rank's expert files). Collective over the
    expert-data-parallel groups when the optimizer state is partitioned (every rank calls it)."""
    experts = expert_params(engine.module)
    local = {e.local_name for e in experts}
    dense = {k: v for k, v in module_state.items() if k not in local}
    files: dict[str, Any] = {}
    for e in experts:
        if e.writes and e.local_name in module_state:
            name = EXPERT_MODEL_STATES.format(e.layer, e.expert)
            files.setdefault(name, {})[e.global_name] = module_state[e.local_name]
    if engine.optimizer is not None:
        for e, saved in zip(experts, _whole_states(engine, experts), strict=True):
            if e.writes and saved is not None:
                name = EXPERT_OPTIM_STATES.format(e.layer, e.expert)
                files.setdefault(name, {})[e.global_name] = saved
    return dense, files


def _whole_states(engine: DeepSpeedEngine, experts: list[ExpertParam]) -> list[Any]:
    """Each expert parameter's fp32 master and optimizer state, whole (None: not trained)."""
    from shardspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    strategy = engine.strategy
    out: list[Any] = []
    with strategy.optimizer_state_resident():
        for e in experts:
            fragment = strategy.param_fragment(e.param)
            if fragment is None:
                out.append(None)
                continue
            assert strategy.optimizer is not None
            keys = sorted(strategy.optimizer.state.get(fragment.state_key, {}))
            out.append(
                {
                    "fp32": safe_get_full_fp32_param(e.param),
                    "group": strategy.registry[e.param].opt_group,
                    "state": {k: safe_get_full_optimizer_state(e.param, k) for k in keys},
                }
            )
    return out


def info(engine: DeepSpeedEngine) -> dict[str, Any]:
    """What the model-states file records about the experts."""
    experts = expert_params(engine.module)
    layers = sorted({e.layer for e in experts})
    return {
        "layers": len(layers),
        "ep_sizes": sorted(
            {groups._get_expert_parallel_world_size(e.param.group_name) for e in experts}  # type: ignore[attr-defined]
        ),
    }


# -- load -------------------------------------------------------------------------------------
class _Files:
    """The expert files of a tag, each read once when first needed."""

    def __init__(self, folder: Path, allow_unsafe_pickle: bool) -> None:
        self.folder = folder
        self.unsafe = allow_unsafe_pickle
        self._read: dict[str, Any] = {}

    def get(self, name: str, key: str) -> Any:
        if name not in self._read:
            path = self.folder / name
            if not path.is_file():
                raise FileNotFoundError(
                    f"expert checkpoint file {path} does not exist: this model has more experts "
                    "(or other MoE layers) than the checkpoint's; load a checkpoint of the same "
                    "model, or pass load_module_only / load_optimizer_states=False as fits"
                )
            self._read[name] = load_file(path, allow_unsafe_pickle=self.unsafe)
        content = self._read[name]
        if key not in content:
            raise KeyError(f"{self.folder / name} holds no {key!r} (it has {sorted(content)[:4]})")
        return content[key]


def module_state_with_experts(
    engine: DeepSpeedEngine, folder: Path, state: dict[str, Any], allow_unsafe_pickle: bool
) -> dict[str, Any]:
    """The checkpoint's module state with this rank's experts added from their files (under
    this model's local names), for a checkpoint in the expert layout; else as saved."""
    if not state.get(MOE_INFO) or not has_experts(engine.module):
        return state.get("module", state)
    files = _Files(folder, allow_unsafe_pickle)
    module = dict(state["module"])
    for e in expert_params(engine.module):
        module[e.local_name] = files.get(
            EXPERT_MODEL_STATES.format(e.layer, e.expert), e.global_name
        )
    return module


def with_expert_slots(engine: DeepSpeedEngine, saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (the dense optimizer state, re-partitioned) with every parameter group
    listing all of this run's stepped tensors, so torch accepts it; the experts' state is
    filled in after (:func:`load_expert_optimizer`)."""
    assert engine.strategy.optimizer is not None
    groups_now = engine.strategy.optimizer.param_groups
    numbered, index = [], 0
    for group in groups_now:
        numbered.append(list(range(index, index + len(group["params"]))))
        index += len(group["params"])
    optimizer = saved["optimizer"]
    return {
        **saved,
        "optimizer": {
            **optimizer,
            "param_groups": [
                {**group, "params": indices}
                for group, indices in zip(optimizer["param_groups"], numbered, strict=True)
            ],
        },
    }


@torch.no_grad()
def load_expert_optimizer(engine: DeepSpeedEngine, folder: Path, allow_unsafe_pickle: bool) -> None:
    """Set each local expert's fp32 master and optimizer state from its files (this rank's
    piece of each whole tensor)."""
    strategy = engine.strategy
    optimizer = strategy.optimizer
    assert optimizer is not None
    files = _Files(folder, allow_unsafe_pickle)
    with strategy.optimizer_state_resident():
        for e in expert_params(engine.module):
            fragment = strategy.param_fragment(e.param)
            if fragment is None:
                continue
            saved = files.get(EXPERT_OPTIM_STATES.format(e.layer, e.expert), e.global_name)
            state = optimizer.state[fragment.state_key]
            for key, value in saved["state"].items():
                if torch.is_tensor(value) and value.numel() == e.param.numel():
                    if key not in state:
                        state[key] = torch.zeros_like(fragment.state_key, dtype=value.dtype)
                    piece = value.reshape(-1)[fragment.param_slice]
                    state[key].view(-1)[fragment.state_slice].copy_(piece)
                else:  # a per-tensor scalar ("step"): the same for every parameter
                    state[key] = value.clone() if torch.is_tensor(value) else value
            full = saved["fp32"]
            fragment.master.copy_(full.reshape(-1)[fragment.param_slice])
            e.param.data.copy_(full.view(e.param.shape).to(e.param.dtype))
