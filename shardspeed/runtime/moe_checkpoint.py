"""Checkpoints of Mixture-of-Experts models, in DeepSpeed's expert layout, re-partitioned on load.

The module weights in ``mp_rank_00_model_states.pt`` leave the experts out; each expert's
weights go to ``layer_<L>_expert_<E>_mp_rank_00_model_states.pt`` (``L``: the MoE layer's index
in module order, ``E``: the global expert index), keyed by the parameter names an ``ep_size=1``
model has (``...deepspeed_experts.<E>...``), as DeepSpeed writes them. Beside each, shardspeed
writes ``layer_<L>_expert_<E>_mp_rank_00_optim_states.pt``: every parameter of the expert whole,
its fp32 master and its optimizer state. The first rank of each expert-data-parallel group
writes the files of the experts its group holds.

AutoEP's layers keep a rank's experts fused in one tensor per weight (``[local experts, ...]``,
row ``i`` is global expert ``first_expert + i``); each expert's row goes to the same files, under
the fused parameter's name.

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

from shardspeed import comm
from shardspeed.checkpoint.files import EXPERT_MODEL_STATES, EXPERT_OPTIM_STATES
from shardspeed.checkpoint.planner import MODULE, OPTIMIZER, FilePieces, TensorPiece
from shardspeed.checkpoint.reader import load_file
from shardspeed.moe.autoep.experts import LocalExperts
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
    """One parameter of one local expert (or, ``row`` set, one expert's row of a fused
    parameter), and where a checkpoint keeps it."""

    local_name: str
    param: nn.Parameter
    layer: int
    expert: int
    #: its name in an ``ep_size=1`` model (the key in the expert's files)
    global_name: str
    #: whether this rank writes its expert's files (first of its expert-data-parallel group)
    writes: bool
    #: the expert's row of a fused ``[local experts, ...]`` parameter (None: the whole tensor)
    row: int | None = None


def _placement(params: list[nn.Parameter]) -> tuple[int, bool]:
    """(this rank's expert-parallel rank, whether it writes) for an expert module's params."""
    name = params[0].group_name if params else groups.expert_group_name(1)  # type: ignore[attr-defined]
    if name not in groups._get_expert_parallel_group_dict():
        return 0, True
    ep_rank = groups._get_expert_parallel_rank(name)
    return ep_rank, groups._get_expert_data_parallel_rank(name) == 0


def expert_params(module: nn.Module) -> list[ExpertParam]:
    """Every expert parameter of ``module``'s MoE layers (DeepSpeed's ``Experts``, AutoEP's
    ``LocalExperts``), in module order. Raises for expert parameters in neither."""
    found: list[ExpertParam] = []
    layer = 0
    for prefix, experts in module.named_modules():
        if isinstance(experts, Experts):
            ep_rank, writes = _placement(list(experts.parameters()))
            local_count = experts.num_local_experts
            for index, expert in enumerate(experts.deepspeed_experts):
                global_index = ep_rank * local_count + index
                for pname, param in expert.named_parameters():
                    local = f"{prefix}.{_MARKER}{index}.{pname}"
                    key = f"{prefix}.{_MARKER}{global_index}.{pname}"
                    found.append(ExpertParam(local, param, layer, global_index, key, writes))
        elif isinstance(experts, LocalExperts):
            _, writes = _placement(list(experts.parameters()))
            for pname, param in experts.named_parameters():
                name = f"{prefix}.{pname}"
                for row in range(experts.num_experts):
                    index = experts.first_expert + row
                    found.append(ExpertParam(name, param, layer, index, name, writes, row))
        else:
            continue
        layer += 1
    covered = {id(e.param) for e in found}
    stray = [n for n, p in module.named_parameters() if is_moe_param(p) and id(p) not in covered]
    if stray:
        raise NotImplementedError(
            f"expert parameters outside an MoE layer's experts ({stray[:3]}) have no "
            "checkpoint layout in shardspeed yet; save the module weights with "
            "save_16bit_model instead"
        )
    return found


def _has_groups(name: str) -> bool:
    return name in groups._get_expert_parallel_group_dict()


def has_experts(module: nn.Module) -> bool:
    """Whether ``module`` has expert parameters (checkpoints then use the expert files)."""
    return any(is_moe_param(p) for p in module.parameters())


def expert_piece(e: ExpertParam) -> TensorPiece:
    """What an expert's files hold of the tensor ``e.global_name`` names in an ``ep_size=1``
    model: all of an expert's own parameter, or one expert's row of a fused ``[experts, ...]``
    parameter (the files keep the row without its leading dimension, as DeepSpeed's)."""
    shape = tuple(e.param.shape)
    if e.row is None:
        return TensorPiece.whole(e.global_name, shape)
    name = e.param.group_name  # type: ignore[attr-defined]
    ep_size = groups._get_expert_parallel_world_size(name) if _has_groups(name) else 1
    rest = shape[1:]
    return TensorPiece(
        e.global_name, (shape[0] * ep_size, *rest), (e.expert,) + (0,) * len(rest), (1, *rest)
    )


def expert_holdings(module: nn.Module, files: dict[str, Any]) -> list[FilePieces]:
    """What each of this rank's expert ``files`` (name -> content) holds, for the planner."""
    held: dict[tuple[str, str], list[TensorPiece]] = {}
    for e in expert_params(module):
        for family, template in ((MODULE, EXPERT_MODEL_STATES), (OPTIMIZER, EXPERT_OPTIM_STATES)):
            name = template.format(e.layer, e.expert)
            if e.global_name in files.get(name, ()):
                held.setdefault((name, family), []).append(expert_piece(e))
    return [FilePieces(name, family, tuple(p)) for (name, family), p in held.items()]


def _cut(value: Any, row: int | None) -> Any:
    """``value`` or its ``row`` (a fused expert parameter's), a copy standing on its own."""
    if row is None or not torch.is_tensor(value):
        return value
    return value[row].clone()


# -- save -------------------------------------------------------------------------------------
def split_module_state(
    engine: DeepSpeedEngine, module_state: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the module state without experts, this rank's expert files, what the model-states file
    records about the experts). Collective over the expert-data-parallel groups when the
    optimizer state is partitioned (every rank calls it)."""
    experts = expert_params(engine.module)
    local = {e.local_name for e in experts}
    dense = {k: v for k, v in module_state.items() if k not in local}
    files: dict[str, Any] = {}
    for e in experts:
        if e.writes and e.local_name in module_state:
            name = EXPERT_MODEL_STATES.format(e.layer, e.expert)
            files.setdefault(name, {})[e.global_name] = _cut(module_state[e.local_name], e.row)
    if engine.optimizer is not None:
        for e, saved in zip(experts, _whole_states(engine, experts), strict=True):
            if e.writes and saved is not None:
                name = EXPERT_OPTIM_STATES.format(e.layer, e.expert)
                files.setdefault(name, {})[e.global_name] = {
                    "fp32": _cut(saved["fp32"], e.row),
                    "group": saved["group"],
                    "state": {
                        k: _cut(v, e.row) if torch.is_tensor(v) and v.dim() > 0 else v
                        for k, v in saved["state"].items()
                    },
                }
    return dense, files, _info(experts)


def _whole_states(engine: DeepSpeedEngine, experts: list[ExpertParam]) -> list[Any]:
    """Each expert parameter's fp32 master and optimizer state, whole (None: not trained)."""
    from shardspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    strategy = engine.strategy
    out: list[Any] = []
    done: dict[int, Any] = {}  # a fused parameter's rows share one assembly (a collective)
    with strategy.optimizer_state_resident():
        for e in experts:
            fragment = strategy.param_fragment(e.param)
            if fragment is None or id(e.param) in done:
                out.append(None if fragment is None else done[id(e.param)])
                continue
            assert strategy.optimizer is not None
            keys = sorted(strategy.optimizer.state.get(fragment.state_key, {}))
            done[id(e.param)] = {
                "fp32": safe_get_full_fp32_param(e.param),
                "group": strategy.registry[e.param].opt_group,
                "state": {k: safe_get_full_optimizer_state(e.param, k) for k in keys},
            }
            out.append(done[id(e.param)])
    return out


def _info(experts: list[ExpertParam]) -> dict[str, Any]:
    """What the model-states file records about the experts."""
    layers = sorted({e.layer for e in experts})
    return {
        "layers": len(layers),
        "ep_sizes": sorted(
            {groups._get_expert_parallel_world_size(e.param.group_name) for e in experts}  # type: ignore[attr-defined]
        ),
    }


def whole_model_weights(module: nn.Module, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (this rank's module state) as the ``ep_size=1`` model has it: every expert
    of every layer under its global name, gathered from the expert-parallel peers (every rank
    calls it; for ``save_16bit_model``)."""
    experts = expert_params(module)
    if not experts:
        return weights
    mine: dict[str, tuple[int, Any]] = {}
    for e in experts:
        if e.local_name in weights:
            value = _cut(weights[e.local_name], e.row)
            key = e.global_name if e.row is None else f"{e.global_name}#{e.expert}"
            mine[key] = (e.expert, value.detach().cpu())
    names = {e.param.group_name for e in experts}  # type: ignore[attr-defined]
    gathered = dict(mine)
    for name in sorted(names):
        if groups._get_expert_parallel_world_size(name) == 1:
            continue
        peers: list[Any] = [None] * groups._get_expert_parallel_world_size(name)
        comm.all_gather_object(peers, mine, group=groups._get_expert_parallel_group(name))
        for part in peers:
            gathered.update(part)
    local = {e.local_name for e in experts}
    whole = {k: v for k, v in weights.items() if k not in local}
    rows: dict[str, list[tuple[int, Any]]] = {}
    for key, (expert, value) in gathered.items():
        if "#" in key:  # a fused parameter's row: stacked in expert order below
            rows.setdefault(key.split("#", 1)[0], []).append((expert, value))
        else:
            whole[key] = value
    for name, parts in rows.items():
        whole[name] = torch.stack([value for _, value in sorted(parts, key=lambda p: p[0])])
    return whole


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


def in_expert_layout(folder: Path, state: dict[str, Any]) -> bool:
    """Whether tag ``folder`` keeps its experts in files of their own: shardspeed's records it,
    DeepSpeed's MoE checkpoints are recognised by their expert files."""
    return bool(state.get(MOE_INFO)) or any(folder.glob(EXPERT_MODEL_STATES.format("*", "*")))


def module_state_with_experts(
    engine: DeepSpeedEngine, folder: Path, state: dict[str, Any], allow_unsafe_pickle: bool
) -> dict[str, Any]:
    """The checkpoint's module state with this rank's experts added from their files (under
    this model's local names), for a checkpoint in the expert layout; else as saved."""
    if not in_expert_layout(folder, state) or not has_experts(engine.module):
        return state.get("module", state)
    files = _Files(folder, allow_unsafe_pickle)
    module = dict(state["module"])
    for local_name, parts in _by_param(expert_params(engine.module)).items():
        values = [
            files.get(EXPERT_MODEL_STATES.format(e.layer, e.expert), e.global_name) for e in parts
        ]
        module[local_name] = values[0] if parts[0].row is None else torch.stack(values)
    return module


def _by_param(experts: list[ExpertParam]) -> dict[str, list[ExpertParam]]:
    """The entries of each parameter (one, or one per row of a fused parameter), by name."""
    found: dict[str, list[ExpertParam]] = {}
    for e in experts:
        found.setdefault(e.local_name, []).append(e)
    return found


def _joined(saved: list[dict[str, Any]], fused: bool) -> dict[str, Any]:
    """One parameter's saved state from its rows' (as saved, when not fused)."""
    if not fused:
        return saved[0]
    state: dict[str, Any] = {}
    for key, value in saved[0]["state"].items():
        rows = torch.is_tensor(value) and value.dim() > 0
        state[key] = torch.stack([s["state"][key] for s in saved]) if rows else value
    return {"fp32": torch.stack([s["fp32"] for s in saved]), "state": state}


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
    from shardspeed.utils import safe_set_full_fp32_param

    strategy = engine.strategy
    optimizer = strategy.optimizer
    assert optimizer is not None
    files = _Files(folder, allow_unsafe_pickle)
    with strategy.optimizer_state_resident():
        for parts in _by_param(expert_params(engine.module)).values():
            e = parts[0]
            fragment = strategy.param_fragment(e.param)
            if fragment is None:
                continue
            rows = [
                files.get(EXPERT_OPTIM_STATES.format(p.layer, p.expert), p.global_name)
                for p in parts
            ]
            saved = _joined(rows, e.row is not None)
            state = optimizer.state[fragment.state_key]
            for key, value in saved["state"].items():
                if torch.is_tensor(value) and value.numel() == e.param.numel():
                    if key not in state:
                        state[key] = torch.zeros_like(fragment.state_key, dtype=value.dtype)
                    piece = value.reshape(-1)[fragment.param_slice]
                    state[key].view(-1)[fragment.state_slice].copy_(piece)
                else:  # a per-tensor scalar ("step"): the same for every parameter
                    state[key] = value.clone() if torch.is_tensor(value) else value
            # the master's piece and the model's own copy (ZeRO-3: this rank's shard piece)
            safe_set_full_fp32_param(e.param, saved["fp32"].view(e.param.shape))
