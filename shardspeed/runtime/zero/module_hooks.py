"""ZeRO-3's per-module hooks, kept as handles that can be taken off and put back.

Every gather unit's module carries four hooks, in DeepSpeed's two lists
(``DeepSpeedZeRoOffload.forward_hooks`` and ``backward_hooks``: TRL removes them around
``generate()`` once it has gathered the whole model, and puts them back with
``_register_deepspeed_module``):

* forward: a pre-hook that gathers the unit and the units it uses, and a hook that releases them
  (or keeps them for reuse);
* backward: a hook that arms the gather before the module's backward (on its outputs), and a
  pre-hook that arms the release after it (on its inputs, for a unit whose own parameters get no
  gradient to say when its backward is over).

One more pre-hook per module, the guard, is in neither list and stays: while the unit's gather
hook is off, a forward of the module with its unit (or a unit it uses) released raises an error
instead of computing on the released, empty parameters (they keep their shapes; their storage
has zero bytes). Installing a unit's hooks again first removes the ones it has, so hooks are
never doubled, however often they are put back.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any, Protocol

from torch import nn
from torch.utils.hooks import RemovableHandle

from shardspeed.runtime.zero.gather_units import GatherUnit


class ModuleHook:
    """One installed hook; :meth:`remove` takes it off (as ``RemovableHandle.remove`` does,
    which it wraps) and it remembers that it was taken off."""

    def __init__(self, handle: RemovableHandle) -> None:
        self._handle = handle
        self.removed = False

    @property
    def id(self) -> int:
        return self._handle.id

    def remove(self) -> None:
        self._handle.remove()
        self.removed = True

    def __enter__(self) -> ModuleHook:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class UnitCallbacks(Protocol):
    """What the hooks delegate to (:class:`~.param_sharding.ParamSharding`)."""

    def pre_forward(self, unit: GatherUnit, module: nn.Module, args: Any) -> None: ...

    def post_forward(self, unit: GatherUnit, module: nn.Module, args: Any, output: Any) -> None: ...

    def arm_post_backward(self, unit: GatherUnit, module: nn.Module, args: Any) -> None: ...

    def arm_pre_backward(
        self, unit: GatherUnit, module: nn.Module, args: Any, output: Any
    ) -> None: ...

    def check_gathered(self, unit: GatherUnit) -> None: ...


class ModuleHooks:
    """The hooks of a ZeRO-3 model's gather units (see the module docstring)."""

    def __init__(self, callbacks: UnitCallbacks) -> None:
        self.callbacks = callbacks
        #: per unit: gather and release (DeepSpeed's ``forward_hooks``)
        self.forward_hooks: list[ModuleHook] = []
        #: per unit: the two that arm its backward's gather and release (``backward_hooks``)
        self.backward_hooks: list[ModuleHook] = []
        #: each unit's four hooks by unit index, the gather pre-hook first
        self._of_unit: dict[int, list[ModuleHook]] = {}
        self._guards: dict[int, RemovableHandle] = {}

    def install(self, units: Iterable[GatherUnit]) -> None:
        """Install ``units``' hooks, replacing any they have."""
        calls = self.callbacks
        for unit in units:
            for old in self._of_unit.pop(unit.index, []):
                old.remove()
            module = unit.module
            if unit.index not in self._guards:  # before the gather hook, which it stands for
                self._guards[unit.index] = module.register_forward_pre_hook(
                    partial(self._guard, unit)
                )
            # in the order they run: gather, arm the release after backward; arm the gather
            # before backward, release
            gather = module.register_forward_pre_hook(partial(calls.pre_forward, unit))
            arm_post = module.register_forward_pre_hook(partial(calls.arm_post_backward, unit))
            arm_pre = module.register_forward_hook(partial(calls.arm_pre_backward, unit))
            release = module.register_forward_hook(partial(calls.post_forward, unit))
            hooks = [ModuleHook(h) for h in (gather, release, arm_post, arm_pre)]
            self._of_unit[unit.index] = hooks
            self.forward_hooks = [h for h in self.forward_hooks if not h.removed] + hooks[:2]
            self.backward_hooks = [h for h in self.backward_hooks if not h.removed] + hooks[2:]

    def live(self, unit: GatherUnit) -> bool:
        """Whether ``unit``'s gather hook is installed."""
        hooks = self._of_unit.get(unit.index)
        return hooks is not None and not hooks[0].removed

    def _guard(self, unit: GatherUnit, module: nn.Module, args: Any) -> None:
        del module, args
        if not self.live(unit):
            self.callbacks.check_gathered(unit)

    def remove_all(self) -> None:
        """Remove every hook, the guards too (the strategy is being destroyed)."""
        for hooks in self._of_unit.values():
            for hook in hooks:
                hook.remove()
        for guard in self._guards.values():
            guard.remove()
        self._of_unit.clear()
        self._guards.clear()
        self.forward_hooks = []
        self.backward_hooks = []
