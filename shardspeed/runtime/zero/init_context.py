"""``zero.Init``: partition a model while it is being built, so it never exists whole on a rank.

Inside the context, every ``nn.Module`` subclass's ``__init__`` is wrapped: when the outermost
``__init__`` of a module returns (a subclass calling ``super().__init__()`` does not count),
the parameters it registered itself are given rank 0's values and packed into a
:class:`~.flat_shard.FlatShard` of which this rank keeps its shard; the full buffer is freed.
A child module is complete before its parent, so memory peaks at about the shards plus the
largest single module. ``nn.Module.apply`` is wrapped too: a parent that initializes its
children's weights after building them (``self.apply(self._init_weights)``) sees them gathered,
and rank 0's result is what every rank keeps.

The unit of such a module is kept on the module until
:class:`~.sharded.ParamPartitionStrategy` takes the parameters over, one unit at a time;
:class:`~.partition_parameters.GatheredParameters` works on them before that (Hugging Face's
``from_pretrained`` loads weights that way).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.flat_shard import pack_flat_shards
from shardspeed.runtime.zero.gather_units import (
    GatherUnit,
    constructed_unit,
    set_constructed_unit,
)
from shardspeed.runtime.zero.partition_parameters import publish
from shardspeed.runtime.zero.records import ParamRecord, ParamState, index_record, record_of
from shardspeed.runtime.zero.zero_parameter import mark_partitioned

__all__ = ["Init"]

#: the innermost active Init (None outside any)
_ACTIVE: list[Init] = []
#: original ``__init__`` of every class wrapped while a context is active
_WRAPPED: dict[type, Callable[..., None]] = {}
#: modules whose outermost ``__init__`` is running, by id -> nesting depth
_BUILDING: dict[int, int] = {}
_ORIGINAL_APPLY = nn.Module.apply


def _all_module_classes() -> Iterator[type]:
    pending: list[type] = [nn.Module]
    seen: set[type] = set()
    while pending:
        cls = pending.pop()
        subclasses: list[type] = cls.__subclasses__()
        for sub in subclasses:
            if sub not in seen:
                seen.add(sub)
                pending.append(sub)
                yield sub


def _wrap(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or cls in _WRAPPED:
        return

    @functools.wraps(original)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        key = id(self)
        _BUILDING[key] = _BUILDING.get(key, 0) + 1
        try:
            original(self, *args, **kwargs)
        finally:
            depth = _BUILDING.pop(key) - 1
            if depth:
                _BUILDING[key] = depth
        if not depth and _ACTIVE:
            _ACTIVE[-1].partition_module(self)

    _WRAPPED[cls] = original
    cls.__init__ = __init__  # type: ignore[misc]


def _wrap_new_subclass(cls: type, **kwargs: Any) -> None:
    super(nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
    _wrap(cls)


def _apply_gathered(self: nn.Module, fn: Callable[[nn.Module], None]) -> nn.Module:
    """``nn.Module.apply`` with each partitioned module gathered around ``fn`` (rank 0's
    result kept)."""
    for child in self.children():
        child.apply(fn)
    units: list[GatherUnit] = []
    for param in self.parameters(recurse=False):
        record = record_of(param)
        if record is not None and record.unit is not None and record.unit not in units:
            units.append(record.unit)  # a tied parameter's unit lives on another module
    released = [unit for unit in units if not unit.gathered]
    for unit in units:
        unit.gather()
    fn(self)
    publish(units, 0)
    for unit in released:
        unit.release()
    return self


def _patch() -> None:
    for cls in list(_all_module_classes()):
        _wrap(cls)
    nn.Module.__init_subclass__ = classmethod(_wrap_new_subclass)  # type: ignore[assignment]
    nn.Module.apply = _apply_gathered  # type: ignore[method-assign,assignment]


def _unpatch() -> None:
    for cls, original in _WRAPPED.items():
        cls.__init__ = original  # type: ignore[misc]
    _WRAPPED.clear()
    if "__init_subclass__" in nn.Module.__dict__:
        del nn.Module.__init_subclass__
    nn.Module.apply = _ORIGINAL_APPLY  # type: ignore[method-assign,assignment]


def _config_dict(config_dict_or_path: Any, config: Any) -> dict[str, Any]:
    source = config_dict_or_path if config_dict_or_path is not None else config
    if source is None:
        return {}
    if isinstance(source, dict):
        return source
    if isinstance(source, str | Path):
        return dict(json.loads(Path(source).read_text()))
    raw = getattr(source, "raw", None)  # a DeepSpeedConfig
    return dict(raw) if isinstance(raw, dict) else {}


def _dtype_from(config: dict[str, Any]) -> torch.dtype | None:
    for section, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        if isinstance(config.get(section), dict) and config[section].get("enabled"):
            return dtype
    return None


class Init:
    """Build modules partitioned across the data-parallel ranks (DeepSpeed's ``zero.Init``).

    ``module``: partition an existing module now instead. ``data_parallel_group`` / ``mpu``:
    the group to partition over (default: every rank). ``dtype``: the parameters' dtype
    (default: fp16/bf16 if the config enables it, else unchanged). ``config_dict_or_path`` /
    ``config``: a DeepSpeed config (dict, path or DeepSpeedConfig) for that default.
    ``remote_device`` other than the accelerator (parameter offload) is refused until offload
    lands; ``pin_memory`` and ``mem_efficient_linear`` are accepted. ``zero_quantized_weights``
    / ``zero_quantized_nontrainable_weights`` (ZeRO++) are accepted: the construction-time
    gathers stay exact, and the engine's ``zero_optimization`` keys decide the training ones.
    ``enabled=False`` makes the context do nothing. Contexts nest.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
    ) -> None:
        del mem_efficient_linear, pin_memory, sequence_data_parallel_group
        self.enabled = enabled
        if not enabled:
            return
        # ZeRO++'s quantized weights: accepted and not needed here; the gathers made while
        # building stay exact (rank 0's initial values must reach every rank unchanged), and
        # the engine's zero_optimization section decides how training gathers and stores them
        del zero_quantized_weights, zero_quantized_nontrainable_weights
        if zero_param_parallel_group is not None or param_swapper is not None:
            raise NotImplementedError(
                "zero.Init(zero_param_parallel_group / param_swapper) (hpZ, NVMe offload) is "
                "not yet supported in shardspeed; leave them None"
            )
        self.device = torch.device(get_accelerator().current_device_name())
        if remote_device not in (None, "none", self.device.type, str(self.device)):
            raise NotImplementedError(
                f"zero.Init(remote_device={remote_device!r}): parameter offload is not yet "
                f"supported in shardspeed; leave remote_device unset to keep the partitions "
                f"on {self.device}"
            )
        settings = _config_dict(config_dict_or_path, config)
        self.dtype = dtype if dtype is not None else _dtype_from(settings)
        group = data_parallel_group
        if group is None and mpu is not None:
            group = mpu.get_data_parallel_group()
        self.comm = CommGroup.of(group)
        if module is not None:
            for sub in module.modules():
                self.partition_module(sub)

    def __enter__(self) -> Init:
        if self.enabled:
            if not _ACTIVE:
                _patch()
            _ACTIVE.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        _ACTIVE.pop()
        if not _ACTIVE:
            _unpatch()

    @torch.no_grad()
    def partition_module(self, module: nn.Module) -> None:
        """Partition the parameters ``module`` registered itself that are not partitioned."""
        fresh = [
            (name, param)
            for name, param in module.named_parameters(recurse=False)
            if record_of(param) is None
        ]
        if not fresh:
            return
        earlier = constructed_unit(module)
        if earlier is not None:
            # parameters registered after the module was built: one unit with the first ones
            earlier.gather()
            fresh = [(r.name, r.param) for r in earlier.records] + fresh
        for _, param in fresh:
            cast = self.dtype if self.dtype and param.is_floating_point() else param.dtype
            param.data = param.data.to(device=self.device, dtype=cast)
        params = [param for _, param in fresh]
        records = [ParamRecord(name, param) for name, param in fresh]
        flats = pack_flat_shards(params, self.comm)
        for flat in flats:
            self.comm.broadcast(flat.full)  # every rank starts from rank 0's values
            flat.keep_full_values()
        unit = GatherUnit(-1, type(module).__name__, module, records, flats=flats)
        set_constructed_unit(module, unit)
        for record in records:
            record.unit = unit
            record.state = ParamState.GATHERED
            index_record(record)
            mark_partitioned(record.param)
        unit.release()
