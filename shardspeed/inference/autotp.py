"""Apply a :class:`~shardspeed.inference.tp_plan.ShardPlan`: replace modules with their shards.

Weights come from a :class:`~shardspeed.inference.weight_source.WeightSource` one tensor slice at
a time, are converted to the target dtype and device as they arrive, and replace the model's
own; a full weight is dropped as soon as its module is replaced. With a checkpoint source the
model may be built on the meta device (``accelerate.init_empty_weights()``): nothing of it is
ever materialised except this rank's shards. Tied weights (GPT-2's ``lm_head`` and ``wte``)
stay tied: a tensor is read once per slice and shared.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from shardspeed.inference.parallel_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from shardspeed.inference.tp_group import TPGroup
from shardspeed.inference.tp_plan import LinearRule, ShardPlan, weight_of
from shardspeed.inference.weight_source import WeightSource
from shardspeed.runtime.tensor_parallel.partition import Slice

__all__ = ["apply_plan"]


class _Loader:
    """Reads, converts and caches tensors by (original tensor, slice) so ties stay ties."""

    def __init__(
        self,
        model: nn.Module,
        source: WeightSource,
        dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        self.source, self.dtype, self.device = source, dtype, device
        self.names: dict[int, list[str]] = defaultdict(list)
        # the model's own tensors, kept referenced while loading so their ids stay unique
        self.originals: list[torch.Tensor] = []
        for name, tensor in [
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        ]:
            self.names[id(tensor)].append(name)
            self.originals.append(tensor)
        self._cache: dict[tuple[int, Slice | None], torch.Tensor] = {}

    def is_original(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.names

    def read(self, original: torch.Tensor, piece: Slice | None) -> torch.Tensor:
        key = (id(original), piece)
        if key not in self._cache:
            tensor = self._read_any(original, piece)
            if tensor.is_floating_point() and self.dtype is not None:
                tensor = tensor.to(self.dtype)
            tensor = tensor.to(self.device)
            if piece is not None and tensor.untyped_storage().nbytes() > tensor.nbytes:
                tensor = tensor.clone()  # a view would keep the full weight alive
            self._cache[key] = tensor
        return self._cache[key]

    def param(self, original: torch.Tensor, piece: Slice | None) -> nn.Parameter:
        tensor = self.read(original, piece)
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor.detach(), requires_grad=False)
            self._cache[(id(original), piece)] = tensor
        return tensor

    def _read_any(self, original: torch.Tensor, piece: Slice | None) -> torch.Tensor:
        error: Exception | None = None
        for name in self.names[id(original)]:
            try:
                return self.source.read(name, piece, original.shape)
            except (KeyError, ValueError) as exc:
                error = error or exc
        assert error is not None, "tensor with no name"
        raise error


def apply_plan(
    model: nn.Module,
    plan: ShardPlan,
    tp: TPGroup,
    source: WeightSource,
    dtype: torch.dtype | None,
    device: torch.device,
) -> None:
    """Replace ``model``'s planned modules with their shards and load every other tensor."""
    loader = _Loader(model, source, dtype, device)
    for name, (start, stop) in plan.vocab.items():
        module = model.get_submodule(name)
        weight = loader.param(weight_of(module), Slice(0, ((start, stop),)))
        if name == plan.head_name:
            _replace(
                model,
                name,
                VocabParallelHead(
                    _linear(weight, _bias(loader, module, None)), tp, plan.head_sizes
                ),
            )
        else:
            table = nn.Embedding(stop - start, weight.shape[1], device="meta")
            table.weight = weight
            _replace(model, name, VocabParallelEmbedding(table, start, stop, tp))
    for name, rule in plan.linears.items():
        _replace(model, name, _shard_linear(loader, model.get_submodule(name), rule, tp))
    _load_rest(model, loader)
    for name, attr, value in plan.attrs:
        setattr(model.get_submodule(name), attr, value)


def _shard_linear(loader: _Loader, module: nn.Module, rule: LinearRule, tp: TPGroup) -> nn.Module:
    stored = rule.piece.on_dim(1 - rule.piece.dim) if rule.transposed else rule.piece
    weight = loader.read(weight_of(module), stored)
    if rule.transposed:
        weight = weight.t().contiguous()
    weight = nn.Parameter(weight, requires_grad=False)
    if rule.kind == "column":
        return _linear(weight, _bias(loader, module, rule.piece.on_dim(0)))
    return RowParallelLinear(_linear(weight, None), _bias(loader, module, None), tp)


def _bias(loader: _Loader, module: nn.Module, piece: Slice | None) -> nn.Parameter | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else loader.param(bias, piece)


def _linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = weight
    if bias is not None:
        linear.bias = bias
    return linear


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, new)


def _load_rest(model: nn.Module, loader: _Loader) -> None:
    """Every tensor not made by a replacement: loaded (converted, moved) in place."""
    for module_name, module in model.named_modules():
        for leaf, param in list(module._parameters.items()):
            if param is None or not loader.is_original(param):
                continue
            module._parameters[leaf] = loader.param(param, None)
        for leaf, buffer in list(module._buffers.items()):
            if buffer is None or not loader.is_original(buffer):
                continue
            persistent = leaf not in module._non_persistent_buffers_set
            if not persistent:
                if buffer.is_meta:
                    raise ValueError(
                        f"buffer {module_name}.{leaf} is on the meta device and no checkpoint "
                        "holds it; build the model with accelerate.init_empty_weights() (which "
                        "keeps buffers real) rather than on torch.device('meta')."
                    )
                module._buffers[leaf] = buffer.to(loader.device)
                continue
            module._buffers[leaf] = loader.read(buffer, None)
