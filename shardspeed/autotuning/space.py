"""The search space: which values of which config keys the autotuner tries.

Each tuned key follows one rule, read from the user's config:

* absent or ``"auto"``: the autotuner's default values (ZeRO stage 0-3; micro-batch sizes from
  ``min/max_train_micro_batch_size_per_gpu``; offload and bucket sizes when ``fast`` is off);
* a list (``"zero_optimization": {"stage": [0, 2]}``): exactly those values;
* a plain value: held fixed.

The micro-batch size is always tuned unless given as a plain value. With ``train_batch_size``
fixed, micro-batch sizes are the divisors of the per-rank batch and the gradient accumulation
follows (``train_batch_size = micro * accumulation * data-parallel ranks``); without it,
accumulation stays at the user's value (1 when absent). ``num_tuning_micro_batch_sizes`` values
are kept, spread geometrically from the smallest to the largest.
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
    "config_path_in_args",
    "experiment_config",
    "get_dotted",
    "is_auto",
    "replace_config_path",
]

DEFAULT_STAGES = (0, 1, 2, 3)
DEFAULT_OFFLOADS = ("none", "cpu")
DEFAULT_BUCKETS = (50_000_000, 500_000_000)
CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")


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

    @property
    def name(self) -> str:
        """The experiment's name, e.g. ``z2_mbs4_gas2`` or ``z3_mbs8_gas1_offcpu_b5e+07``."""
        name = f"z{self.stage}_mbs{self.micro_batch}_gas{self.grad_accum}"
        if self.offload != "none":
            name += f"_off{self.offload}"
        if self.bucket is not None:
            name += f"_b{self.bucket:.0e}"
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


def build_space(config: dict[str, Any], at: Any, world_size: int) -> SearchSpace:
    """The points to consider for the user's ``config`` (``at``: its autotuning section)."""
    dp_world = max(world_size // at.mp_size, 1)
    pairs, tbs = _batch_pairs(config, at, dp_world)
    stages = [int(s) for s in _choices(config, "zero_optimization.stage", DEFAULT_STAGES)]
    bad = [s for s in stages if s not in DEFAULT_STAGES]
    if bad:
        raise AutotuningSpaceError(f"zero_optimization.stage values {bad} are not ZeRO stages 0-3")
    slow = not at.fast
    offloads = _choices(
        config,
        "zero_optimization.offload_optimizer.device",
        DEFAULT_OFFLOADS if slow else ("none",),
    )
    buckets = _choices(
        config, "zero_optimization.reduce_bucket_size", DEFAULT_BUCKETS if slow else (None,)
    )
    points: list[Point] = []
    for stage, (micro, accum), offload, bucket in itertools.product(
        stages, pairs, offloads, buckets
    ):
        if stage == 0:  # ZeRO-0 has neither an offloaded optimizer nor reduce buckets
            offload, bucket = "none", None
        point = Point(stage, micro, accum, str(offload), int(bucket) if bucket else None)
        if point not in points:
            points.append(point)
    return SearchSpace(points=points, train_batch_size=tbs, dp_world=dp_world)


def experiment_config(
    user_config: dict[str, Any], point: Point, autotuning: dict[str, Any] | None
) -> dict[str, Any]:
    """The user's config with ``point``'s values and the given ``autotuning`` section."""
    config = copy.deepcopy(user_config)
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
    if autotuning is None:
        config.pop("autotuning", None)
    else:
        config["autotuning"] = autotuning
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


def apply_arg_mappings(
    user_args: list[str], mappings: dict[str, Any] | None, config: dict[str, Any]
) -> list[str]:
    """Set each mapped script argument (``{"train_micro_batch_size_per_gpu":
    "--per_device_train_batch_size"}``) to the config's value, replacing or appending it."""
    out = list(user_args)
    for key, flag in (mappings or {}).items():
        value = get_dotted(config, key)
        if value is None:
            raise AutotuningSpaceError(
                f"autotuning.arg_mappings maps {key!r}, which the experiment config does not set; "
                "map only tuned keys (train_micro_batch_size_per_gpu, "
                "gradient_accumulation_steps, ...)"
            )
        for i, arg in enumerate(out):
            if arg == flag and i + 1 < len(out):
                out[i + 1] = str(value)
                break
            if arg.startswith(flag + "="):
                out[i] = f"{flag}={value}"
                break
        else:
            out += [str(flag), str(value)]
    return out
