"""The precision policy: every dtype decision of a training run, as frozen data.

Three modes come out of the config (spec §5):

* **fp32** — everything in fp32; no master copies, no loss scaling.
* **native fp16 / bf16** (``fp16`` / ``bf16`` sections) — the model is cast to the low dtype, the
  optimizer steps fp32 master copies; fp16 also needs loss scaling.
* **torch_autocast** — parameters stay fp32 (so no master copies), forward runs under
  ``torch.autocast``; an fp16 autocast dtype needs a GradScaler-like loss scaler, bf16 does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.runtime.precision.dtypes import LOW_PRECISION_DTYPES, parse_dtype

DEFAULT_LOWER_PRECISION_SAFE_MODULES: tuple[str, ...] = (
    "torch.nn.Linear",
    "torch.nn.Conv1d",
    "torch.nn.Conv2d",
    "torch.nn.Conv3d",
)

# torch.autocast would pick a per-device default for ``dtype=None`` (fp16 on CUDA, bf16 on CPU);
# the policy must know the dtype up front to decide on loss scaling, so it fixes bf16, the safe one.
DEFAULT_AUTOCAST_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each kind of tensor uses, and which precision machinery the engine must run.

    Attributes:
        param_dtype: dtype of the model's parameters and of its forward/backward compute.
        master_dtype: dtype the optimizer steps in (fp32 under mixed precision).
        grad_dtype: dtype of the gradients autograd leaves in ``param.grad``.
        uses_master_weights: whether the optimizer steps separate master copies.
        needs_loss_scaling: whether the loss must be scaled (fp16 compute only).
        comm_dtype: dtype for gradient collectives; ``None`` means "use ``grad_dtype``".
        autocast_dtype: the ``torch.autocast`` dtype in torch_autocast mode, else ``None``.
        lower_precision_safe_modules: qualified class names whose parameters may be communicated
            in ``autocast_dtype`` (torch_autocast mode only).
        fp16_auto_cast: the ``fp16.auto_cast`` flag: cast floating inputs to fp16 in forward.
        immediate_grad_update: the ``bf16.immediate_grad_update`` flag.
    """

    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    uses_master_weights: bool = False
    needs_loss_scaling: bool = False
    comm_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None
    lower_precision_safe_modules: tuple[str, ...] = DEFAULT_LOWER_PRECISION_SAFE_MODULES
    fp16_auto_cast: bool = False
    immediate_grad_update: bool = False

    @property
    def fp16_enabled(self) -> bool:
        """Native fp16 training (the ``fp16`` section)."""
        return self.param_dtype == torch.float16

    @property
    def bf16_enabled(self) -> bool:
        """Native bf16 training (the ``bf16`` section)."""
        return self.param_dtype == torch.bfloat16

    @property
    def autocast_enabled(self) -> bool:
        """torch_autocast mode."""
        return self.autocast_dtype is not None

    @property
    def mixed_precision(self) -> bool:
        """Any low-precision compute, native or autocast."""
        return self.param_dtype in LOW_PRECISION_DTYPES or self.autocast_enabled

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype most forward ops run in."""
        return self.autocast_dtype or self.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradient collectives use: ``comm_dtype`` if set, else ``grad_dtype``."""
        return self.comm_dtype or self.grad_dtype

    @classmethod
    def from_sections(
        cls,
        fp16: Any = None,
        bf16: Any = None,
        torch_autocast: Any = None,
        communication_data_type: str | torch.dtype | None = None,
    ) -> PrecisionPolicy:
        """Build the policy from the ``fp16``, ``bf16`` and ``torch_autocast`` config sections.

        Sections are duck-typed (any object with DeepSpeed's attribute names); ``None`` or a
        missing ``enabled`` attribute means the section is off.
        """
        fp16_on = _enabled(fp16)
        bf16_on = _enabled(bf16)
        autocast_on = _enabled(torch_autocast)
        if fp16_on and bf16_on:
            raise ValueError(
                "fp16.enabled and bf16.enabled are both true; enable at most one of them"
            )
        if autocast_on and (fp16_on or bf16_on):
            native = "fp16" if fp16_on else "bf16"
            raise ValueError(
                f"torch_autocast.enabled and {native}.enabled are both true; torch_autocast keeps "
                f"fp32 parameters, so set {native}.enabled=false or torch_autocast.enabled=false"
            )
        comm_dtype = (
            None
            if communication_data_type is None
            else parse_dtype(communication_data_type, "communication_data_type")
        )
        if fp16_on:
            return cls(
                param_dtype=torch.float16,
                grad_dtype=torch.float16,
                uses_master_weights=True,
                needs_loss_scaling=True,
                comm_dtype=comm_dtype,
                fp16_auto_cast=bool(getattr(fp16, "auto_cast", False)),
            )
        if bf16_on:
            return cls(
                param_dtype=torch.bfloat16,
                grad_dtype=torch.bfloat16,
                uses_master_weights=True,
                comm_dtype=comm_dtype,
                immediate_grad_update=bool(getattr(bf16, "immediate_grad_update", False)),
            )
        if autocast_on:
            return cls._autocast(torch_autocast, comm_dtype)
        return cls(comm_dtype=comm_dtype)

    @classmethod
    def _autocast(cls, section: Any, comm_dtype: torch.dtype | None) -> PrecisionPolicy:
        raw_dtype = getattr(section, "dtype", None)
        dtype = (
            DEFAULT_AUTOCAST_DTYPE
            if raw_dtype is None
            else parse_dtype(raw_dtype, "torch_autocast.dtype")
        )
        if dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(
                f"torch_autocast.dtype={raw_dtype!r} is not a lower precision; use bfloat16 or float16"
            )
        modules = getattr(section, "lower_precision_safe_modules", None)
        return cls(
            needs_loss_scaling=dtype == torch.float16,
            comm_dtype=comm_dtype,
            autocast_dtype=dtype,
            lower_precision_safe_modules=(
                DEFAULT_LOWER_PRECISION_SAFE_MODULES if modules is None else tuple(modules)
            ),
        )


def _enabled(section: Any) -> bool:
    return section is not None and bool(getattr(section, "enabled", False))
