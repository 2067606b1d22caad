"""What a checkpoint file may hold, and a copy of it that training cannot change.

Every file shardspeed writes must load under the safe reader alone (:mod:`.reader`), so what is
saved is checked first (:func:`snapshot`): tensors in plain containers (dict, ``OrderedDict``,
list, tuple, set) of plain values (None, bool, int, float, complex, str, bytes, ``torch.Size``,
``torch.dtype``, ``torch.device``, ``argparse.Namespace``). Anything else is refused at save
time, named by where it sits, rather than written into a file that would not load.

An asynchronous save writes while training goes on: with ``copy``, :func:`snapshot` copies every
tensor to the CPU first. Tensors that share storage (tied weights, views of one flat buffer) still
share it in the copy, so the file written from the copy is byte for byte the file the live state
would give.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


class _Copier:
    """Copies tensors to the CPU, one new storage per storage copied."""

    def __init__(self) -> None:
        self._storages: dict[int, torch.UntypedStorage] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = int(storage._cdata)
        copied = self._storages.get(key)
        if copied is None:
            copied = self._storages[key] = (
                storage.cpu() if storage.device.type != "cpu" else storage.clone()
            )
        new = torch.empty(0, dtype=tensor.dtype).set_(
            copied, tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        if type(tensor) is nn.Parameter:
            return nn.Parameter(new, requires_grad=tensor.requires_grad)
        return new.requires_grad_(tensor.requires_grad) if tensor.is_floating_point() else new


def snapshot(obj: Any, copy: bool, where: str = "state") -> Any:
    """``obj`` checked to hold only what a checkpoint may hold (else ``TypeError`` naming the
    value's place, under the name ``where``); with ``copy``, with every tensor copied to the
    CPU (storage sharing kept), containers rebuilt; without, ``obj`` itself."""
    return _walk(obj, _Copier() if copy else None, where)


def _walk(obj: Any, copier: _Copier | None, where: str) -> Any:
    kind = type(obj)
    if kind in (torch.Tensor, nn.Parameter):
        return copier(obj) if copier is not None else obj
    if kind in _PLAIN:
        return obj
    if kind in (dict, OrderedDict):
        for key in obj:
            _walk(key, None, f"{where} key {key!r}")
        items = {k: _walk(v, copier, f"{where}[{k!r}]") for k, v in obj.items()}
        # a module state_dict's OrderedDict carries _metadata (torch.save writes it too)
        extra = _walk(vars(obj), copier, f"{where}.__dict__") if kind is OrderedDict else {}
        if copier is None:
            return obj
        new = kind(items)
        if extra:
            vars(new).update(extra)
        return new
    if kind in (list, tuple, set):
        values = [_walk(v, copier, f"{where}[{i}]") for i, v in enumerate(obj)]
        return kind(values) if copier is not None else obj
    if kind is argparse.Namespace:
        fields = {k: _walk(v, copier, f"{where}.{k}") for k, v in vars(obj).items()}
        return argparse.Namespace(**fields) if copier is not None else obj
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: checkpoints hold only tensors and "
        "plain data (dict, list, tuple, set, str, numbers, bool, None, torch.Size/dtype/device, "
        "argparse.Namespace), so that loading them runs no code; convert it (e.g. a number with "
        "float(), an object with vars() or its state_dict()) before saving"
    )
