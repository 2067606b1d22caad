"""DeepSpeed's engine getters and batch-size setters, answered from the config, the optimizer
and the step counters (``engine.train_batch_size()``, ``engine.get_lr()``,
``engine.zero_optimization_stage()``...): a mixin of
:class:`~shardspeed.runtime.engine.DeepSpeedEngine`, which holds the parts named below."""

from __future__ import annotations

from typing import Any

from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.engine_parts import NoOptimizer
from shardspeed.runtime.train_state import TrainState
from shardspeed.runtime.zero.optimizer import ZeroOptimizer

__all__ = ["EngineQueries"]


class EngineQueries:
    """Read-only questions about the run, and the two batch-size setters."""

    _config: DeepSpeedConfig
    _optim: ZeroOptimizer | NoOptimizer
    state: TrainState
    dp_world_size: int

    # -- batch sizes ----------------------------------------------------------------------------
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def get_batch_info(self) -> tuple[int, int, int]:
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (micro-batch is kept)."""
        per_step = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if train_batch_size % per_step != 0:
            raise ValueError(
                f"train_batch_size={train_batch_size} must be a multiple of "
                f"train_micro_batch_size_per_gpu * data-parallel size = {per_step}"
            )
        self._config.set_batch_sizes(train_batch_size, None, train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch; the global batch follows (accumulation steps are kept)."""
        gas = self.gradient_accumulation_steps()
        self._config.set_batch_sizes(
            micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas
        )

    # -- the optimizer and the counters ---------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self._optim.param_groups]

    def get_mom(self) -> list[Any]:
        return [g.get("betas", g.get("momentum")) for g in self._optim.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self._optim.global_grad_norm

    def was_step_applied(self) -> bool:
        return self.state.step_applied

    @property
    def loss_scale(self) -> float:
        return self._optim.loss_scale

    # -- the config -----------------------------------------------------------------------------
    @property
    def config(self) -> DeepSpeedConfig:
        return self._config

    def zero_optimization_stage(self) -> int:
        return int(self._config.zero_optimization.stage)

    @property
    def gradient_average(self) -> bool:
        """Whether data-parallel gradients are averaged (``gradient_allreduce_op: "mean"``)."""
        return self._config.gradient_allreduce_op == "mean"

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``zero_optimization.stage3_gather_16bit_weights_on_model_save``: whether a ZeRO-3
        model's whole weights may be assembled for saving (Accelerate asks before it does)."""
        return bool(self._config.zero_optimization.gather_16bit_weights_on_model_save)

    def fp16_enabled(self) -> bool:
        return bool(self._config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self._config.bf16.enabled)

    def pld_enabled(self) -> bool:
        return bool(self._config.progressive_layer_drop.enabled)

    def pld_theta(self) -> float:
        return float(self._config.progressive_layer_drop.theta)

    def pld_gamma(self) -> float:
        return float(self._config.progressive_layer_drop.gamma)
