"""The search space: which values of which config keys the autotuner tries.

Each tuned key follows one rule, read from the user's config:

* absent or ``"auto"``: the autotuner's default values (ZeRO stage 0-3; micro-batch sizes from
  ``min/max_train_micro_batch_size_per_gpu``; offload (NVMe too when ``offload_optimizer.nvme_path`` is
  set) and bucket sizes when ``fast`` is off);
* a list (``"zero_optimization": {"stage": [0, 2]}``): exactly those values;
* a plain value: held fixed.

The micro-batch size is always tuned unless given as a plain value. With ``train_batch_size``
fixed, micro-batch sizes are the divisors of the per-rank batch and the gradient accumulation
follows (``train_batch_size = micro * accumulation * data-parallel ranks``); without it,
accumulation stays at the user's value (1 when absent). ``num_tuning_micro_batch_sizes`` values
are kept, spread geometrically from the smallest to the largest.

The parallel layout is tuned only when the user asks: ``tensor_parallel.autotp_size`` and/or
``sequence_parallel_size`` set to ``"auto"`` (every divisor of the world) or a list (those
values, each a divisor of the world). A layout ``(tp, sp)`` needs ``tp * sp`` to divide the world;
the data-parallel size is ``world / (tp * sp)`` and the batch triangle of that layout uses it, so
each layout has its own micro-batch / accumulation pairs. Layouts with both ``tp`` and ``sp``
above 1 are not generated: the engine refuses sequence parallelism with AutoTP.

Pipeline parallelism is an axis when ``autotuning.pipeline_stages`` is ``"auto"`` (every divisor
of the world) or a list of stage counts (a plain count is a one-value list). The stage count lives
in the user's code (``PipelineModule(num_stages=...)``), so the script must take it from its
command line: ``arg_mappings`` maps ``autotuning.pipeline_stages`` to a value flag (e.g.
``"--pipeline_stages"``), and the experiment config also sets ``pipeline.stages``, which the engine
checks against the module. A layout ``(tp, sp, pp)`` needs ``tp * sp * pp`` to divide the world,
and ``pp`` above 1 only with ``tp = sp = 1``: the pipeline engine refuses sequence parallelism in
stages and has no AutoTP inside stages. The data-parallel size is ``world / (tp * sp * pp)``. ZeRO
stages 2 and 3 are not generated when the stage count is tuned, at any count: the engine refuses
them for every ``PipelineModule``, one stage included (as DeepSpeed does), and the script builds
one for each count.

Activation checkpointing is an axis when ``autotuning.activation_checkpointing`` is ``"auto"``
(off and on) or a list of booleans; the script gets the value through ``arg_mappings`` (the key
``autotuning.activation_checkpointing``, e.g. mapped to a Trainer's ``--gradient_checkpointing``):
a plain flag is given only when on, a flag ending in ``=`` is given as ``flag=true|false``.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AutotuningSpaceError",
    "Point",
    "SearchSpace",
    "apply_arg_mappings",
    "build_space",
    "checkpointing_choices",
    "pipeline_choices",
    "config_path_in_args",
    "experiment_config",
    "get_dotted",
    "is_auto",
    "layouts",
    "replace_config_path",
]

DEFAULT_STAGES = (0, 1, 2, 3)
DEFAULT_OFFLOADS = ("none", "cpu")
#: what ``offload_optimizer.device`` may be in a trial
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DEFAULT_BUCKETS = (50_000_000, 500_000_000)
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")
TP_KEY = "tensor_parallel.autotp_size"
SP_KEY = "sequence_parallel_size"
CKPT_KEY = "autotuning.activation_checkpointing"
PP_KEY = "autotuning.pipeline_stages"
#: the ZeRO stages the pipeline engine accepts (2 and 3 partition the gradients it accumulates)
PIPELINE_STAGES_OK = (0, 1)
_BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


class AutotuningSpaceError(ValueError, AssertionError):
    """The user's config or arguments do not describe a space the autotuner can search (an
    AssertionError too, as DeepSpeed asserts on the same mistakes)."""


def is_auto(value: Any) -> bool:
    """True for the string ``"auto"`` (any case)."""
    return isinstance(value, str) and value.strip().lower() == "auto"


@dataclass(frozen=True)
class Point:
    """One configuration of the tuned keys."""

    stage: int
    micro_batch: int
    grad_accum: int
    offload: str = "none"
    bucket: int | None = None
    #: tensor- and sequence-parallel sizes (None: the layout is not tuned, the config's stays)
    tp: int | None = None
    sp: int | None = None
    #: activation checkpointing on/off (None: not tuned)
    ckpt: bool | None = None
    #: pipeline stages (None: not tuned, the script's own)
    pp: int | None = None

    @property
    def tp_size(self) -> int:
        """The tensor-parallel size (1 when the layout is not tuned)."""
        return self.tp or 1

    @property
    def sp_size(self) -> int:
        """The sequence-parallel size (1 when the layout is not tuned)."""
        return self.sp or 1

    @property
    def pp_size(self) -> int:
        """The pipeline stage count (1 when it is not tuned)."""
        return self.pp or 1

    @property
    def name(self) -> str:
        """The experiment's name, e.g. ``z2_mbs4_gas2``, ``z3_tp2_sp1_mbs4_gas1``,
        ``z1_pp2_mbs2_gas4`` or ``z3_mbs8_gas1_offcpu_b5e+07_ckpt``."""
        layout = f"_tp{self.tp_size}_sp{self.sp_size}" if self.tp or self.sp else ""
        if self.pp is not None:
            layout += f"_pp{self.pp}"
        name = f"z{self.stage}{layout}_mbs{self.micro_batch}_gas{self.grad_accum}"
        if self.offload != "none":
            name += f"_off{self.offload}"
        if self.bucket is not None:
            name += f"_b{self.bucket:.0e}"
        if self.ckpt is not None:
            name += "_ckpt" if self.ckpt else "_nockpt"
        return name

    def values(self) -> dict[str, Any]:
        """The dotted config keys this point sets."""
        out: dict[str, Any] = {
            "zero_optimization.stage": self.stage,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
        }
        if self.offload != "none":
            out["zero_optimization.offload_optimizer.device"] = self.offload
        if self.bucket is not None:
            key = "stage3_prefetch_bucket_size" if self.stage == 3 else "reduce_bucket_size"
            out[f"zero_optimization.{key}"] = self.bucket
        if self.tp or self.sp:
            out[TP_KEY] = self.tp_size
            out[SP_KEY] = self.sp_size
        if self.ckpt is not None:
            out[CKPT_KEY] = self.ckpt
        if self.pp is not None:
            out[PP_KEY] = self.pp
            out["pipeline.stages"] = self.pp  # the engine checks the module against it
        return out


@dataclass
class SearchSpace:
    """Every point to consider (before memory pruning), in a stable order."""

    points: list[Point]
    train_batch_size: int | None
    dp_world: int

    def __len__(self) -> int:
        return len(self.points)


def get_dotted(config: dict[str, Any], key: str, default: Any = None) -> Any:
    """``config["a"]["b"]`` for ``"a.b"`` (a dotted top-level key wins), else ``default``."""
    if key in config:
        return config[key]
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    """Set ``"a.b"`` in nested dicts (creating them), removing any dotted top-level spelling."""
    config.pop(key, None)
    parts = key.split(".")
    node = config
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _choices(config: dict[str, Any], key: str, default: tuple[Any, ...]) -> list[Any]:
    value = get_dotted(config, key)
    if value is None or is_auto(value):
        return list(default)
    if isinstance(value, list):
        if not value:
            raise AutotuningSpaceError(f"{key} is an empty list; give the values to try")
        return list(value)
    return [value]


def _spread(values: list[int], count: int) -> list[int]:
    """``count`` of the sorted ``values``, geometrically spread, first and last included."""
    if len(values) <= count:
        return values
    if count == 1:
        return [values[-1]]
    lo, hi = math.log(values[0]), math.log(values[-1])
    picked = []
    for i in range(count):
        target = lo + (hi - lo) * i / (count - 1)
        best = min(values, key=lambda v: abs(math.log(v) - target))
        if best not in picked:
            picked.append(best)
    return sorted(picked)


def _batch_pairs(
    config: dict[str, Any], at: Any, dp_world: int
) -> tuple[list[tuple[int, int]], int | None]:
    """(micro-batch, accumulation) pairs, and the fixed global batch if any."""
    tbs = config.get("train_batch_size")
    tbs = None if tbs is None or is_auto(tbs) else int(tbs)
    micro = get_dotted(config, "train_micro_batch_size_per_gpu")
    gas = config.get("gradient_accumulation_steps")
    lo, hi = at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu
    if at.max_train_batch_size and tbs is None:
        hi = min(hi, max(at.max_train_batch_size * at.mp_size // dp_world, 1))
    if tbs is not None:
        if tbs % dp_world:
            raise AutotuningSpaceError(
                f"train_batch_size={tbs} is not divisible by the {dp_world} data-parallel "
                "ranks; pick a multiple of the rank count"
            )
        per_rank = tbs // dp_world
        sizes = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        if isinstance(micro, int | list) and not is_auto(micro):
            given = micro if isinstance(micro, list) else [micro]
            sizes = [m for m in given if per_rank % m == 0]
            if not sizes:
                raise AutotuningSpaceError(
                    f"no train_micro_batch_size_per_gpu in {given} divides the per-rank batch "
                    f"{per_rank} (train_batch_size={tbs} over {dp_world} ranks)"
                )
            return [(m, per_rank // m) for m in sizes], tbs
        sizes = _spread([m for m in sizes if lo <= m <= hi], at.num_tuning_micro_batch_sizes)
        if not sizes:
            raise AutotuningSpaceError(
                f"no micro-batch size in [{lo}, {hi}] (min/max_train_micro_batch_size_per_gpu) "
                f"divides the per-rank batch {per_rank}; widen the bounds"
            )
        return [(m, per_rank // m) for m in sizes], tbs
    accum = 1 if gas is None or is_auto(gas) else int(gas)
    if isinstance(micro, list):
        return [(int(m), accum) for m in micro], None
    if micro is not None and not is_auto(micro):
        return [(int(micro), accum)], None
    powers = [2**k for k in range(0, 31) if lo <= 2**k <= hi]
    return [(m, accum) for m in _spread(powers, at.num_tuning_micro_batch_sizes)], None


def _layout_sizes(config: dict[str, Any], key: str, world: int) -> tuple[list[int], bool]:
    """The sizes to try for ``key`` and whether it is tuned (``"auto"`` or a list)."""
    value = get_dotted(config, key)
    if is_auto(value):
        return [d for d in range(1, world + 1) if world % d == 0], True
    if isinstance(value, list):
        bad = [v for v in value if not isinstance(v, int) or v < 1 or world % v]
        if not value or bad:
            raise AutotuningSpaceError(
                f"{key} values {bad or value} do not divide the {world} ranks; list divisors of "
                f'the world size (or "auto" for all of them)'
            )
        return sorted(set(value)), True
    return [int(value) if value else 1], False


def layouts(config: dict[str, Any], world: int) -> list[tuple[int | None, int | None]]:
    """The ``(tp, sp)`` layouts to try (``[(None, None)]`` when neither size is tuned)."""
    tps, tp_tuned = _layout_sizes(config, TP_KEY, world)
    sps, sp_tuned = _layout_sizes(config, SP_KEY, world)
    if not (tp_tuned or sp_tuned):
        return [(None, None)]
    # the engine refuses sequence parallelism with AutoTP: such layouts would only fail
    out = [(t, s) for t in tps for s in sps if world % (t * s) == 0 and min(t, s) == 1]
    if not out:
        raise AutotuningSpaceError(
            f"no layout of {TP_KEY} in {tps} and {SP_KEY} in {sps} fits {world} ranks (their "
            "product must divide the world, and one of them must be 1)"
        )
    return list(out)


def checkpointing_choices(at: Any) -> list[bool | None]:
    """The activation checkpointing values to try (``[None]``: not an axis)."""
    value = getattr(at, "activation_checkpointing", None)
    if value is None or isinstance(value, bool):
        return [value]
    choices: list[bool | None] = [False, True] if is_auto(value) else [bool(v) for v in value]
    if not choices:
        raise AutotuningSpaceError(f'{CKPT_KEY} is an empty list; give [false, true] or "auto"')
    if CKPT_KEY not in (at.arg_mappings or {}):
        raise AutotuningSpaceError(
            f"{CKPT_KEY} is tuned but autotuning.arg_mappings does not map it to the script; add "
            f'"arg_mappings": {{"{CKPT_KEY}": "--gradient_checkpointing"}} (a flag given only '
            'when on; end it with "=" for flag=true|false)'
        )
    return list(dict.fromkeys(choices))


def pipeline_choices(at: Any, world: int) -> list[int | None]:
    """The pipeline stage counts to try (``[None]``: not an axis)."""
    value = getattr(at, "pipeline_stages", None)
    if value is None:
        return [None]
    if is_auto(value):
        choices = [d for d in range(1, world + 1) if world % d == 0]
    else:
        given = value if isinstance(value, list) else [value]
        bad = [v for v in given if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        bad += [v for v in given if v not in bad and world % v]
        if not given or bad:
            raise AutotuningSpaceError(
                f"{PP_KEY} values {bad or given} do not divide the {world} ranks; list stage "
                'counts that divide the world size (or "auto" for all of them)'
            )
        choices = sorted(set(given))
    if PP_KEY not in (at.arg_mappings or {}):
        raise AutotuningSpaceError(
            f"{PP_KEY} is tuned but autotuning.arg_mappings does not map it to the script, whose "
            f'PipelineModule(num_stages=...) sets it; add "arg_mappings": {{"{PP_KEY}": '
            '"--pipeline_stages"} (a value flag; end it with "=" for flag=N) and build the '
            "PipelineModule with that many stages"
        )
    return list(choices)


def _full_layouts(
    config: dict[str, Any], at: Any, world: int
) -> list[tuple[int | None, int | None, int | None]]:
    """The ``(tp, sp, pp)`` layouts: :func:`layouts` times the stage counts, where the product
    divides the world and a pipeline (``pp > 1``) has neither tensor nor sequence parallelism."""
    pps = pipeline_choices(at, world)
    out = [
        (tp, sp, pp)
        for tp, sp in layouts(config, world)
        for pp in pps
        if world % ((tp or 1) * (sp or 1) * (pp or 1)) == 0
        and ((pp or 1) == 1 or (tp or 1) * (sp or 1) == 1)
    ]
    if not out:
        raise AutotuningSpaceError(
            f"no layout of {PP_KEY} in {pps} with the tensor/sequence-parallel sizes fits {world} "
            "ranks (pp x tp x sp must divide the world, and pipeline stages above 1 need tp and "
            "sp of 1: the pipeline engine takes neither)"
        )
    return out


def build_space(config: dict[str, Any], at: Any, world_size: int) -> SearchSpace:
    """The points to consider for the user's ``config`` (``at``: its autotuning section)."""
    dp_world = max(world_size // at.mp_size, 1)
    stages = [int(s) for s in _choices(config, "zero_optimization.stage", DEFAULT_STAGES)]
    bad = [s for s in stages if s not in DEFAULT_STAGES]
    if bad:
        raise AutotuningSpaceError(f"zero_optimization.stage values {bad} are not ZeRO stages 0-3")
    slow = not at.fast
    nvme_path = get_dotted(config, "zero_optimization.offload_optimizer.nvme_path")
    # NVMe joins the slow space where the config says where to swap (no path, no NVMe trial)
    slow_offloads = (*DEFAULT_OFFLOADS, "nvme") if nvme_path else DEFAULT_OFFLOADS
    offloads = _choices(
        config, "zero_optimization.offload_optimizer.device", slow_offloads if slow else ("none",)
    )
    unknown = [o for o in offloads if o not in OFFLOAD_DEVICES]
    if unknown:
        raise AutotuningSpaceError(
            f"zero_optimization.offload_optimizer.device values {unknown} are not offload "
            f"devices; use {', '.join(OFFLOAD_DEVICES)}"
        )
    if "nvme" in offloads and not nvme_path:
        raise AutotuningSpaceError(
            "zero_optimization.offload_optimizer.device lists nvme but no nvme_path is set; "
            "set zero_optimization.offload_optimizer.nvme_path to a folder on the NVMe drive"
        )
    buckets = _choices(
        config, "zero_optimization.reduce_bucket_size", DEFAULT_BUCKETS if slow else (None,)
    )
    ckpts = checkpointing_choices(at)
    full = _full_layouts(config, at, dp_world)
    if any(pp is not None for _, _, pp in full):
        # the script builds a PipelineModule at every count, and the engine takes ZeRO 0/1 only
        stages = [s for s in stages if s in PIPELINE_STAGES_OK]
        if not stages:
            raise AutotuningSpaceError(
                f"{PP_KEY} is tuned but zero_optimization.stage lists only stages the pipeline "
                "engine refuses (2, 3); list 0 and/or 1, or leave the stage out"
            )
    points: list[Point] = []
    tbs: int | None = None
    errors: list[AutotuningSpaceError] = []
    for tp, sp, pp in full:
        try:  # each layout has its own data-parallel size, so its own batch triangle
            pairs, tbs = _batch_pairs(config, at, dp_world // ((tp or 1) * (sp or 1) * (pp or 1)))
        except AutotuningSpaceError as exc:
            errors.append(exc)
            continue
        for stage, (micro, accum), offload, bucket, ckpt in itertools.product(
            stages, pairs, offloads, buckets, ckpts
        ):
            if stage == 0:  # ZeRO-0 has neither an offloaded optimizer nor reduce buckets
                offload, bucket = "none", None
            point = Point(
                stage, micro, accum, str(offload), int(bucket) if bucket else None, tp, sp, ckpt, pp
            )
            if point not in points:
                points.append(point)
    if not points:
        raise errors[0]
    return SearchSpace(points=points, train_batch_size=tbs, dp_world=dp_world)


def experiment_config(
    user_config: dict[str, Any], point: Point, autotuning: dict[str, Any] | None
) -> dict[str, Any]:
    """The user's config with ``point``'s values and the given ``autotuning`` section."""
    config = copy.deepcopy(user_config)
    if autotuning is None:
        config.pop("autotuning", None)
    else:
        config["autotuning"] = copy.deepcopy(autotuning)
    for key, value in point.values().items():
        set_dotted(config, key, value)
    if "train_batch_size" in config and is_auto(config["train_batch_size"]):
        del config["train_batch_size"]
    for key in (
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.reduce_bucket_size",
    ):
        if isinstance(get_dotted(config, key), list) or is_auto(get_dotted(config, key)):
            set_dotted(config, key, "none" if key.endswith("device") else 500_000_000)
    return config


def config_path_in_args(user_args: list[str]) -> str | None:
    """The config file named by ``--deepspeed_config``/``--deepspeed`` (either spelling with
    ``=``) in the script's arguments."""
    for i, arg in enumerate(user_args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(user_args) and user_args[i + 1].endswith(".json"):
                return user_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


def replace_config_path(user_args: list[str], path: str) -> list[str]:
    """``user_args`` with the config file argument pointing at ``path``."""
    out = list(user_args)
    for i, arg in enumerate(out):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(out) and out[i + 1].endswith(".json"):
                out[i + 1] = path
                return out
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={path}"
                return out
    raise AutotuningSpaceError(
        "the training script's arguments name no config file; pass --deepspeed_config cfg.json "
        "(or --deepspeed cfg.json) after the script"
    )


def _without_flag(args: list[str], flag: str) -> list[str]:
    """``args`` without ``flag`` (alone, with ``=value``, or followed by a boolean word)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = i + 1 < len(args) and args[i + 1].lower() in _BOOL_WORDS
            continue
        if not arg.startswith(flag + "="):
            out.append(arg)
    return out


def apply_arg_mappings(
    user_args: list[str], mappings: dict[str, Any] | None, config: dict[str, Any]
) -> list[str]:
    """Set each mapped script argument (``{"train_micro_batch_size_per_gpu":
    "--per_device_train_batch_size"}``) to the config's value, replacing or appending it.

    A flag ending in ``=`` is given as ``flag=value``. A boolean value (activation
    checkpointing) given to a plain flag is the flag alone when on and nothing when off; any
    spelling of the flag already in the arguments is removed first."""
    out = list(user_args)
    for key, mapped in (mappings or {}).items():
        value = get_dotted(config, key)
        if value is None:
            raise AutotuningSpaceError(
                f"autotuning.arg_mappings maps {key!r}, which the experiment config does not set; "
                "map only tuned keys (train_micro_batch_size_per_gpu, "
                f"gradient_accumulation_steps, {CKPT_KEY}, ...)"
            )
        equals = str(mapped).endswith("=")
        flag = str(mapped).rstrip("=")
        if isinstance(value, bool):
            out = _without_flag(out, flag)
            if equals:
                out.append(f"{flag}={str(value).lower()}")
            elif value:
                out.append(flag)
            continue
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = str(value)
                break
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={value}"
                break
        else:
            out += [f"{flag}={value}"] if equals else [flag, str(value)]
    return out
