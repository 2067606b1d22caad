"""fp32 master copies of low-precision model parameters, one per parameter.

Native fp16/bf16 training keeps the model in the low dtype for compute and lets the optimizer step
fp32 masters: gradients go model -> master (cast, unscaled), the optimizer updates the masters, and
the new values go master -> model. ZeRO stage 0 uses this as is; later stages partition it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from shardspeed.runtime.precision.overflow import unscale_
from shardspeed.runtime.precision.policy import PrecisionPolicy


class MasterWeights:
    """Pairs each model parameter with the tensor the optimizer steps.

    With ``enabled=False`` (fp32 policies) the masters *are* the model parameters: gradient copy
    only unscales in place, copy-back and optimizer rebinding do nothing.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        enabled: bool = True,
        master_dtype: torch.dtype = torch.float32,
        devices: Sequence[torch.device] | None = None,
    ) -> None:
        # A tied parameter listed twice must get one master, or the two copies would drift apart;
        # tensors hash by identity, so this keeps the first occurrence of each.
        self.model_params: list[Tensor] = list(dict.fromkeys(params))
        self.enabled = enabled
        if enabled:
            where = devices or [p.device for p in self.model_params]
            # Plain leaves that autograd never touches: only the optimizer writes them. With
            # ``devices`` given, a parameter already in the master dtype on its master's device
            # is its own master (no copy).
            self.master_params: list[Tensor] = [
                p
                if devices is not None and p.dtype == master_dtype and p.device == device
                else p.detach().to(device, master_dtype, copy=True).requires_grad_(False)
                for p, device in zip(self.model_params, where, strict=True)
            ]
        else:
            self.master_params = self.model_params

    @classmethod
    def from_policy(cls, params: Iterable[Tensor], policy: PrecisionPolicy) -> MasterWeights:
        """Masters in ``policy.master_dtype`` if the policy uses them, else an identity."""
        return cls(params, enabled=policy.uses_master_weights, master_dtype=policy.master_dtype)

    def __len__(self) -> int:
        return len(self.model_params)

    @property
    def is_identity(self) -> bool:
        """True when the masters are the model parameters themselves."""
        return not self.enabled

    def master_grads(self) -> list[Tensor]:
        """The masters' gradients that exist (what overflow checks and norms look at)."""
        return [m.grad for m in self.master_params if m.grad is not None]

    @torch.no_grad()
    def copy_grads_to_master(self, inv_scale: float | Tensor = 1.0) -> None:
        """Set ``master.grad = float(model.grad) * inv_scale`` for every pair.

        A model parameter without a gradient leaves its master's ``.grad`` as ``None`` so the
        optimizer skips it. Master gradient buffers are reused across steps when present.
        """
        if not self.enabled:
            unscale_([p.grad for p in self.model_params if p.grad is not None], inv_scale)
            return
        dst: list[Tensor] = []
        src: list[Tensor] = []
        for model, master in zip(self.model_params, self.master_params, strict=True):
            if model.grad is None:
                master.grad = None
                continue
            if master.grad is None or master.grad.shape != master.shape:
                master.grad = torch.empty_like(master)
            dst.append(master.grad)
            src.append(model.grad)
        if dst:
            torch._foreach_copy_(dst, src)
            unscale_(dst, inv_scale)

    @torch.no_grad()
    def copy_master_to_model(self) -> None:
        """Cast the masters' values back into the model parameters, in place."""
        if self.enabled and self.model_params:
            pairs = [
                (model, master)
                for model, master in zip(self.model_params, self.master_params, strict=True)
                if model is not master
            ]
            if pairs:
                models, masters = zip(*pairs, strict=True)
                torch._foreach_copy_(list(models), list(masters))

    def rebind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` step the masters instead of the model parameters it was built on.

        Every ``param_group["params"]`` entry is swapped for its master and frozen parameters
        (``requires_grad=False``) are dropped; group hyperparameters are kept. The optimizer must not have state yet (it would be keyed by the old tensors).
        """
        if not self.enabled:
            return
        if len(optimizer.state) > 0:
            raise ValueError(
                f"{type(optimizer).__name__} already has state for {len(optimizer.state)} "
                "parameter(s); master weights must be bound before the first optimizer step, "
                "so pass an optimizer that has not stepped yet"
            )
        master_of = {id(p): m for p, m in zip(self.model_params, self.master_params, strict=True)}
        for index, group in enumerate(optimizer.param_groups):
            rebound = []
            for param in group["params"]:
                if id(param) not in master_of and not param.requires_grad:
                    continue  # a frozen parameter: nothing to step (as DeepSpeed skips it)
                if id(param) not in master_of:
                    raise ValueError(
                        f"optimizer param_groups[{index}] holds a tensor of shape "
                        f"{tuple(param.shape)} that is not one of the model parameters given to "
                        "MasterWeights; build the optimizer on the model's parameters"
                    )
                rebound.append(master_of[id(param)])
            group["params"] = rebound

    def state_dict(self) -> dict[str, Any]:
        """The master values (empty for an identity: the model's state dict holds them)."""
        return {"master_params": list(self.master_params) if self.enabled else []}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy saved master values in (then call :meth:`copy_master_to_model`)."""
        saved = state_dict["master_params"]
        if not self.enabled:
            return
        if len(saved) != len(self.master_params):
            raise ValueError(
                f"checkpoint holds {len(saved)} master parameters, the model has "
                f"{len(self.master_params)}; load a checkpoint of the same model"
            )
        for master, value in zip(self.master_params, saved, strict=True):
            master.copy_(value)
