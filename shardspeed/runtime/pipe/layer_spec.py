"""Lazy layers: a :class:`LayerSpec` names a module class and its arguments, so each pipeline
stage builds only the layers it holds; a :class:`TiedLayerSpec` is a layer whose weight is
shared by every layer with the same ``key``, also across stages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from shardspeed.utils.logging import logger


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built on the stage that holds it."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not isinstance(typename, type):
            raise TypeError(
                f"LayerSpec needs a class (e.g. torch.nn.Linear), got {typename!r}; pass a "
                "module instance or a callable to PipelineModule directly instead"
            )
        if not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """Instantiate the layer."""
        if log:
            logger.info(f"building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose ``tied_weight_attr`` (one name or a list) is shared by all layers of the
    same ``key``: one module per stage, kept identical across stages (its gradients are summed
    over the stages that hold it). ``forward_fn(module, inputs)`` replaces the module's own
    forward where given (e.g. an embedding reused as the output projection)."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )
