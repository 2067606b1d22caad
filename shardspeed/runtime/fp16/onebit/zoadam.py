"""0/1 Adam (https://arxiv.org/abs/2202.06009): the variance is updated, from all-reduced
gradients, only at steps whose spacing doubles every ``var_update_scaler`` updates; in between,
gradients are averaged with error-compensated 1-bit compression. After ``var_freeze_step`` the
variance is frozen and ranks take local steps, synchronising (1-bit) their accumulated update
every ``local_step_interval`` steps, an interval that doubles every ``local_step_scaler`` steps
up to ``local_step_clipper``.

Checkpoints between synchronisations: the ranks' parameters then differ, and the engine saves
only rank 0's. :meth:`ZeroOneAdam.state_dict` therefore also gathers, from every rank, each
parameter that has moved away from its last synchronised value (``anchor``), and
:meth:`ZeroOneAdam.load_state_dict` puts this rank's own back (a parameter that has not moved
takes the anchor), so a resume from any step is bit-exact. Cost: nothing at a synchronisation
step or before the freeze; between synchronisations every rank's moved parameters, in the
optimizer's dtype (fp32 masters), i.e. up to ``world_size`` extra copies of the model in the
checkpoint and, during the save, in every rank's memory (gathered like the error buffers).
The resume needs the same world size (refused otherwise, as for the error buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardspeed import comm
from shardspeed.runtime.fp16.onebit.adam import adam_denom
from shardspeed.runtime.fp16.onebit.base import STATE_KEY, OnebitOptimizer, check_positive_int

_COUNTERS = (
    "step_count",
    "var_updates",
    "var_interval",
    "var_counter",
    "local_step_interval",
    "local_step_counter",
    "freeze_key",
)


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam. While every step updates the variance (the first ``var_update_scaler``
    steps), it equals ``torch.optim.AdamW`` step for step. Between synchronisations ranks hold
    different parameters (the algorithm's local steps); each synchronisation makes them equal
    again exactly (every rank adds the same average to the same last synchronised value).
    ``comm_backend_name`` and ``cuda_aware`` are accepted; all run the same torch collectives."""

    rank_local_keys = ("worker_error", "server_error", "exp_avg", "lrs")

    def __init__(
        self,
        params: Iterable[Any],
        deepspeed: Any = None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        owner = type(self).__name__
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
        )
        super().__init__(
            params,
            defaults,
            deepspeed=deepspeed,
            amsgrad=amsgrad,
            cuda_aware=cuda_aware,
            comm_backend_name=comm_backend_name,
            eps_inside_sqrt=eps_inside_sqrt,
        )
        self.var_freeze_step = check_positive_int(owner, "var_freeze_step", var_freeze_step, 0)
        self.var_update_scaler = check_positive_int(owner, "var_update_scaler", var_update_scaler)
        self.local_step_scaler = check_positive_int(owner, "local_step_scaler", local_step_scaler)
        self.local_step_clipper = check_positive_int(
            owner, "local_step_clipper", local_step_clipper
        )
        self.step_count = 0
        self.var_updates = 0
        self.var_interval = 1
        self.var_counter = 0
        self.local_step_interval = 1
        self.local_step_counter = 0
        #: DeepSpeed's flag: True once the variance is frozen and local steps begin
        self.freeze_key = False
        # this rank's parameter values from the last load_state_dict, until the next step
        self._restored: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def needs_gradient_allreduce(self) -> bool:
        # the next step updates the variance: it needs the exactly averaged gradient
        return not self.freeze_key and (self.step_count + 1) % self.var_interval == 0

    def extra_state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _COUNTERS}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        for name in _COUNTERS:
            setattr(self, name, state[name])

    def _moved_params(self) -> dict[int, torch.Tensor]:
        """This rank's parameters that differ from their last synchronised value, by position."""
        moved = {}
        for index, param in enumerate(self._ordered_params()):
            anchor = self.state[param].get("anchor") if param in self.state else None
            if anchor is not None and not torch.equal(param, anchor):
                moved[index] = param.detach().clone()
        return moved

    def state_dict(self) -> dict[str, Any]:
        """:meth:`OnebitOptimizer.state_dict` plus every rank's moved parameters (local steps
        since the last synchronisation) under ``"local_params"``. Every rank must call it."""
        saved = super().state_dict()
        local = self._moved_params()
        ranks = [local]
        if self.size > 1:
            ranks = [{} for _ in range(self.size)]
            comm.all_gather_object(ranks, local, group=self.backend.group)
        saved["param_groups"][0][STATE_KEY]["local_params"] = ranks
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`OnebitOptimizer.load_state_dict`, then this rank's own parameter values
        written into the parameters it steps (the engine loaded rank 0's weights before; it
        calls :meth:`restore_local_params` again after anything else it loads)."""
        groups = state_dict["param_groups"]
        blob = groups[0].get(STATE_KEY) if groups else None
        super().load_state_dict(state_dict)
        self._restored = []
        if blob is None or "local_params" not in blob:
            return  # an older checkpoint: exact only if saved at a synchronisation step
        mine = blob["local_params"][self.backend.rank]
        for index, param in enumerate(self._ordered_params()):
            anchor = self.state[param].get("anchor") if param in self.state else None
            value = mine.get(index, anchor)
            if value is not None:
                self._restored.append((param, value.to(param.device, param.dtype)))
        self.restore_local_params()

    @torch.no_grad()
    def restore_local_params(self) -> bool:
        for param, value in self._restored:
            param.copy_(value)
        return bool(self._restored)

    def _denom(self, v: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        beta2 = group["betas"][1]
        bc2 = (1.0 - beta2 ** max(self.var_updates, 1)) if group["bias_correction"] else 1.0
        return adam_denom(v, bc2, group["eps"], self.eps_mode == 0)

    def _bc1(self, group: dict[str, Any]) -> float:
        beta1 = group["betas"][0]
        return (1.0 - beta1**self.step_count) if group["bias_correction"] else 1.0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update from the parameters' ``.grad`` (all-reduced by the engine exactly when
        :attr:`needs_gradient_allreduce` said so before the backward)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._restored = []  # the parameters have been restored: free the copies
        self.step_count += 1
        frozen = self.freeze_key
        var_step = not frozen and self.step_count % self.var_interval == 0
        if var_step:
            self.var_updates += 1
        sync = frozen and self.step_count % self.local_step_interval == 0
        numel = 0
        # each parameter runs up to its exchange; all exchanges go in one batch (4 collectives)
        pending: list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]] = []
        for group, param in self.params_with_grads():
            exchanged = self._update_param(group, param, frozen, var_step, sync)
            if exchanged is not None:
                pending.append((group, param, exchanged))
            numel += param.numel()
        self.exchange(pending)
        for group, param, exchanged in pending:
            self._finish_param(group, param, frozen, exchanged)
        if not frozen:
            if var_step:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
            if self.step_count > self.var_freeze_step:
                self.freeze_key = True
                # the errors now compensate another quantity (accumulated updates)
                for state in self.state.values():
                    for key in ("worker_error", "server_error"):
                        if key in state:
                            state[key].zero_()
                self.announce_freeze(numel)
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(
                    self.local_step_clipper, self.local_step_interval * 2
                )
        return loss

    def _update_param(
        self, group: dict[str, Any], param: torch.Tensor, frozen: bool, var_step: bool, sync: bool
    ) -> torch.Tensor | None:
        """Update ``param`` up to its 1-bit exchange; the tensor to exchange (then finished by
        :meth:`_finish_param`), or None when this step has none for it (done)."""
        grad = param.grad
        assert grad is not None
        state = self.state[param]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
            state["lrs"] = 0.0
        state["step"] = self.step_count
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if var_step or frozen:
            if var_step:
                v.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            m.lerp_(grad, 1.0 - beta1)
        else:  # a local gradient: average it at one bit per element
            return grad.float().clone()
        if frozen and "anchor" not in state:
            state["anchor"] = param.detach().clone()  # the last value every rank agrees on
        denom = self._step_param(group, param)
        if not frozen:
            return None
        state["lrs"] += float(group["lr"])
        if not sync:
            return None
        # the local steps' total, in momentum units, averaged at one bit per element
        return (param - state["anchor"]).mul_(denom)

    def _step_param(self, group: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
        """Move ``param`` by its momentum over the denominator (returned)."""
        state = self.state[param]
        lr = float(group["lr"])
        denom = self._denom(state["exp_avg_sq"], group)
        if group["weight_decay"] != 0.0:
            param.mul_(1.0 - lr * group["weight_decay"])
        param.addcdiv_(state["exp_avg"], denom, value=-lr / self._bc1(group))
        return denom

    def _finish_param(
        self, group: dict[str, Any], param: torch.Tensor, frozen: bool, exchanged: torch.Tensor
    ) -> None:
        """The rest of :meth:`_update_param` once ``exchanged`` has been averaged."""
        state = self.state[param]
        m = state["exp_avg"]
        if not frozen:  # the averaged gradient enters the momentum, then the step
            m.lerp_(exchanged.to(m.dtype), 1.0 - group["betas"][0])
            self._step_param(group, param)
            return
        denom = self._denom(state["exp_avg_sq"], group)
        m.copy_(exchanged).mul_(-self._bc1(group) / state["lrs"])
        param.copy_(state["anchor"] + exchanged / denom)
        state["anchor"].copy_(param)
        state["lrs"] = 0.0
