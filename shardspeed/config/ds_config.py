"""``DeepSpeedConfig``: a validated DeepSpeed config with the batch triangle solved."""

from __future__ import annotations

import copy
import json
import os
from typing import TYPE_CHECKING, Any

import torch
from pydantic import PrivateAttr, ValidationError

from shardspeed.config.batch import solve_batch_triangle
from shardspeed.config.elastic_search import (
    MINIMUM_DEEPSPEED_VERSION,
    ElasticityConfigError,
    compute_elastic_config,
    ensure_immutable_elastic_config,
)
from shardspeed.config.errors import DeepSpeedConfigError, error_from_validation
from shardspeed.config.loader import ConfigSource, apply_dotted_keys, load_config_dict
from shardspeed.config.monitor import DeepSpeedMonitorConfig
from shardspeed.config.root import RootConfig
from shardspeed.config.zero import DeepSpeedZeroConfig
from shardspeed.utils.logging import logger

#: the top-level keys of the batch triangle
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

__all__ = ["DeepSpeedConfig", "resolve_dp_world_size"]


def resolve_dp_world_size(
    dp_world_size: int | None,
    mpu: Any = None,
    mesh_device: Any = None,
    sequence_parallel_size: int | None = None,
) -> int:
    """The data-parallel world size the batch triangle uses.

    In order: the explicit ``dp_world_size``; ``mpu.get_data_parallel_world_size()`` (or, for a
    sequence-parallel mpu without it, world size / ``mpu.get_sequence_parallel_world_size()``);
    the ``data_parallel`` dimension of ``mesh_device``; else the ``WORLD_SIZE`` environment
    variable (default 1) divided by ``sequence_parallel_size``.
    """
    if dp_world_size is not None:
        return int(dp_world_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return int(mpu.get_data_parallel_world_size())
        return _divide(world, int(mpu.get_sequence_parallel_world_size()), "sequence-parallel")
    if mesh_device is not None:
        return int(mesh_device["data_parallel"].size())
    if sequence_parallel_size:
        return _divide(world, sequence_parallel_size, "sequence_parallel_size")
    return world


def _divide(world: int, parts: int, name: str) -> int:
    if parts <= 0 or world % parts:
        raise DeepSpeedConfigError(
            f"the world size ({world}) is not divisible by {name} ({parts}); the data-parallel "
            "size must be a whole number."
        )
    return world // parts


class DeepSpeedConfig(RootConfig):
    """A DeepSpeed training config: every section validated, the batch sizes solved.

    ``config`` is a dict (never modified), or a path to a JSON or HJSON file (any extension).
    Each section is an attribute under its DeepSpeed JSON key (``cfg.zero_optimization.stage``,
    ``cfg.fp16.enabled``, ``cfg.optimizer.params``...). After construction
    ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
    are ints satisfying ``train = micro * gas * dp_world_size``. ``raw`` is a copy of the
    user's dict, with any dotted top-level key (``"zero_optimization.reduce_bucket_size"``) moved
    to the nested key it names (:func:`~shardspeed.config.loader.apply_dotted_keys`). Any problem
    raises :class:`DeepSpeedConfigError`.

    ``hidden_size`` optionally resolves ``"auto"`` bucket sizes the way the HF Trainer would.
    """

    if TYPE_CHECKING:
        # solved in __init__: never None on a constructed DeepSpeedConfig
        train_batch_size: int
        train_micro_batch_size_per_gpu: int
        gradient_accumulation_steps: int

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)
    _dp_world_size: int = PrivateAttr(default=1)

    def __init__(
        self,
        config: ConfigSource,
        mpu: Any = None,
        mesh_device: Any = None,
        *,
        dp_world_size: int | None = None,
        hidden_size: int | None = None,
    ) -> None:
        # a dotted top-level key (TRL's "zero_optimization.reduce_bucket_size") is that override
        raw = apply_dotted_keys(load_config_dict(config), RootConfig)
        context = {"hidden_size": hidden_size} if hidden_size else None
        try:
            self.__pydantic_validator__.validate_python(
                copy.deepcopy(raw), self_instance=self, context=context
            )
        except ValidationError as exc:
            raise error_from_validation(exc, RootConfig) from None
        self._raw = raw
        self._dp_world_size = resolve_dp_world_size(
            dp_world_size, mpu, mesh_device, self.sequence_parallel_size
        )
        batch = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        if self.elasticity.enabled:
            batch = self._elastic_batch_sizes(raw)
        self.set_batch_sizes(*batch)

    def _elastic_batch_sizes(self, raw: dict[str, Any]) -> tuple[int, int, int]:
        """``elasticity.enabled``: the batch sizes come from the elastic search for this
        data-parallel size (DeepSpeed's rule: top-level batch keys are an error unless
        ``ignore_non_elastic_batch_info``, then they are ignored)."""
        given = [k for k in BATCH_KEYS if raw.get(k) is not None]
        if given and not self.elasticity.ignore_non_elastic_batch_info:
            raise ElasticityConfigError(
                f"{given} are set, but elasticity.enabled computes the batch sizes itself; "
                "remove them, or set elasticity.ignore_non_elastic_batch_info: true to have "
                "them ignored"
            )
        ensure_immutable_elastic_config(raw["elasticity"])
        world = self._dp_world_size
        gpus = (
            world * self.elasticity.model_parallel_size if self.elasticity.version == 0.2 else world
        )
        total, _, micro = compute_elastic_config(raw, MINIMUM_DEEPSPEED_VERSION, world_size=gpus)
        return int(total), int(micro), int(total) // (int(micro) * world)

    def set_batch_sizes(
        self, train_batch_size: int | None, micro_batch: int | None, grad_accum: int | None
    ) -> tuple[int, int, int]:
        """Solve the batch triangle for new values (``None`` = derive) and store the result.

        Uses :attr:`dp_world_size`; raises :class:`DeepSpeedConfigError` when inconsistent
        (nothing is changed then). Returns ``(train_batch_size, micro_batch, grad_accum)``.
        """
        tb, mb, gas = solve_batch_triangle(
            train_batch_size, micro_batch, grad_accum, self._dp_world_size
        )
        # object.__setattr__ skips re-running every validator of the whole config per field
        object.__setattr__(self, "train_batch_size", tb)
        object.__setattr__(self, "train_micro_batch_size_per_gpu", mb)
        object.__setattr__(self, "gradient_accumulation_steps", gas)
        return tb, mb, gas

    def _configure_train_batch_size(self) -> None:
        """Solve the batch triangle again from the current three attributes (DeepSpeed's
        method: its tests set some to ``None`` and call this). Raises
        :class:`~shardspeed.config.batch.BatchSizeError`, an ``AssertionError`` as in DeepSpeed."""
        self.set_batch_sizes(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )

    # --- derived values -------------------------------------------------------------------

    @property
    def raw(self) -> dict[str, Any]:
        """A deep copy of the config exactly as the user gave it."""
        return copy.deepcopy(self._raw)

    def get(self, key: str, default: Any = None) -> Any:
        """The user's value of top-level ``key`` (a copy), as on DeepSpeed's ``engine.config``.

        DeepSpeed's engine keeps the config dict it was given as ``engine.config``; callers
        such as the HF Trainer read it with ``engine.config.get("zero_optimization", {})``.
        """
        return copy.deepcopy(self._raw.get(key, default))

    def __getitem__(self, key: str) -> Any:
        return copy.deepcopy(self._raw[key])

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    @property
    def dp_world_size(self) -> int:
        """The data-parallel world size the batch triangle was solved with."""
        return self._dp_world_size

    @property
    def world_size(self) -> int:
        """DeepSpeed's name for :attr:`dp_world_size`."""
        return self._dp_world_size

    @property
    def zero_config(self) -> DeepSpeedZeroConfig:
        """DeepSpeed's name for the ``zero_optimization`` section."""
        return self.zero_optimization

    @property
    def zero_enabled(self) -> bool:
        """True for ZeRO stages 1-3."""
        return self.zero_optimization.stage > 0

    @property
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage as a plain int."""
        return int(self.zero_optimization.stage)

    @property
    def fp16_enabled(self) -> bool:
        """``fp16.enabled``."""
        return self.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        """``bf16.enabled``."""
        return self.bf16.enabled

    @property
    def precision_dtype(self) -> torch.dtype:
        """The model's training dtype: fp16, bf16 or fp32."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def optimizer_name(self) -> str | None:
        """Optimizer type, lower-cased for DeepSpeed's own optimizers; None if not configured."""
        return self.optimizer.name if self.optimizer is not None else None

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        """Optimizer constructor params; None if no optimizer is configured."""
        return dict(self.optimizer.params) if self.optimizer is not None else None

    @property
    def scheduler_name(self) -> str | None:
        """Scheduler type; None if not configured."""
        return self.scheduler.type if self.scheduler is not None else None

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        """Scheduler constructor params; None if no scheduler is configured."""
        return dict(self.scheduler.params) if self.scheduler is not None else None

    @property
    def wall_clock_breakdown_enabled(self) -> bool:
        """``wall_clock_breakdown``, also on when the FLOPs profiler is (as in DeepSpeed)."""
        return self.wall_clock_breakdown or self.flops_profiler.enabled

    @property
    def monitor_config(self) -> DeepSpeedMonitorConfig:
        """The four monitor sections together, for ``MonitorMaster``."""
        return DeepSpeedMonitorConfig(
            tensorboard=self.tensorboard,
            wandb=self.wandb,
            comet=self.comet,
            csv_monitor=self.csv_monitor,
        )

    # --- display ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The resolved config (defaults filled in, batch solved) as JSON-compatible data."""
        data = self.model_dump(mode="json", by_alias=True)
        data["dp_world_size"] = self._dp_world_size
        return data

    def print(self, name: str = "DeepSpeedConfig") -> None:
        """Log the resolved config, one top-level key per line, then the user's JSON."""
        logger.info(f"{name}:")
        for key, value in sorted(self.to_dict().items()):
            logger.info(f"  {key} {'.' * max(1, 29 - len(key))} {json.dumps(value)}")
        logger.info(f"  json = {json.dumps(self._raw, sort_keys=True, indent=4)}")

    def __repr__(self) -> str:
        return f"DeepSpeedConfig({json.dumps(self.to_dict(), sort_keys=True, indent=2)})"

    __str__ = __repr__
