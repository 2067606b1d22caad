"""FLOP formulas for the torch functionals the profiler intercepts, and the patching itself.

Conventions (the same as DeepSpeed's profiler, so numbers compare across the two):

- a matmul of ``(m, k) @ (k, n)`` is ``m*n*k`` MACs and ``2*m*n*k`` FLOPs; batched matmuls
  multiply by the batch; ``F.linear`` counts its matmul only (the bias add is not counted);
- a convolution is ``2 * MACs`` plus one FLOP per output element for the bias;
- ``scaled_dot_product_attention`` counts the ``Q K^T`` and ``A V`` matmuls (a causal mask does
  not halve the count);
- normalizations cost 4 FLOPs per element, 5 with an affine transform; activations, softmax and
  pooling 1 FLOP per (input) element; embedding lookups 0;
- tensor arithmetic written with operators (``x + y``) is not counted: it is memory-bound and
  small next to the matmuls.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FlopSink", "patched_functionals"]

FlopFn = Callable[..., tuple[int, int]]
FlopSink = Callable[[int, int], None]
"""Receives ``(flops, macs)`` for each counted call."""


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name)


# -- matmuls -----------------------------------------------------------------------------------
def _linear(
    input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[int, int]:
    macs = input.numel() * weight.shape[0]
    return 2 * macs, macs


def _matmul(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
        return 0, 0
    if b.dim() == 1:  # matrix-vector: one MAC per element of a
        macs = a.numel()
    elif a.dim() == 1:
        macs = b.numel()
    else:
        out_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        macs = math.prod(out_shape) * a.shape[-2] * a.shape[-1] * b.shape[-1]
    return 2 * macs, macs


def _addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[int, int]:
    flops, macs = _matmul(a, b)
    return flops + math.prod(a.shape[:-1]) * b.shape[-1], macs


def _einsum(equation: str, *operands: Any, **kwargs: Any) -> tuple[int, int]:
    if len(operands) == 1 and isinstance(operands[0], list | tuple):
        operands = tuple(operands[0])
    if len(operands) != 2:
        return 0, 0
    # One MAC per point of the joint index space of a two-operand contraction.
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for spec, operand in zip(inputs, operands, strict=False):
        for letter, size in zip(spec, operand.shape, strict=False):
            sizes[letter] = size
    macs = math.prod(sizes.values())
    return 2 * macs, macs


# -- convolutions ------------------------------------------------------------------------------
def _conv(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, stride: Any = 1,
          padding: Any = 0, dilation: Any = 1, groups: int = 1) -> tuple[int, int]:  # fmt: skip
    with torch.no_grad():
        out_spatial = _conv_out_spatial(input, weight, stride, padding, dilation)
    batch = input.shape[0] if input.dim() == weight.dim() else 1
    out_channels, in_per_group = weight.shape[0], weight.shape[1]
    kernel = math.prod(weight.shape[2:])
    out_elems = batch * out_channels * math.prod(out_spatial)
    macs = out_elems * in_per_group * kernel
    return 2 * macs + (out_elems if bias is not None else 0), macs


def _conv_out_spatial(input: torch.Tensor, weight: torch.Tensor, stride: Any, padding: Any,
                      dilation: Any) -> list[int]:  # fmt: skip
    dims = weight.dim() - 2
    spatial = list(input.shape[-dims:])
    if isinstance(padding, str):
        return spatial if padding == "same" else _valid(spatial, weight, stride, dilation)
    st, pad, dil = (_tuple(v, dims) for v in (stride, padding, dilation))
    kernel = weight.shape[2:]
    return [
        (s + 2 * p - d * (k - 1) - 1) // t + 1
        for s, p, d, k, t in zip(spatial, pad, dil, kernel, st, strict=True)
    ]


def _valid(spatial: list[int], weight: torch.Tensor, stride: Any, dilation: Any) -> list[int]:
    dims = len(spatial)
    st, dil = _tuple(stride, dims), _tuple(dilation, dims)
    kernel = weight.shape[2:]
    return [
        (s - d * (k - 1) - 1) // t + 1 for s, d, k, t in zip(spatial, dil, kernel, st, strict=True)
    ]


def _tuple(value: Any, dims: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list | tuple) else (int(value),) * dims


def _conv_transpose(input: torch.Tensor, weight: torch.Tensor, bias: Any = None, *args: Any,
                    **kwargs: Any) -> tuple[int, int]:  # fmt: skip
    # Each input element is multiplied into a whole kernel of every output channel of its group.
    out_per_group = weight.shape[1]  # weight is (in_channels, out_channels / groups, *kernel)
    macs = input.numel() * out_per_group * math.prod(weight.shape[2:])
    return 2 * macs, macs


# -- attention ---------------------------------------------------------------------------------
def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
          **kwargs: Any) -> tuple[int, int]:  # fmt: skip
    seq_k = key.shape[-2]
    macs = query.numel() * seq_k  # Q K^T
    macs += math.prod(query.shape[:-1]) * seq_k * value.shape[-1]  # A V
    return 2 * macs, macs


# -- element-wise families ---------------------------------------------------------------------
def _per_element(input: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    return _numel(input), 0


def _zero(*args: Any, **kwargs: Any) -> tuple[int, int]:
    return 0, 0


def _norm(weight_index: int) -> FlopFn:
    def count(input: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
        weight = _arg(args, kwargs, weight_index - 1, "weight")
        return input.numel() * (5 if weight is not None else 4), 0

    return count


# Every (owner, attribute) the profiler wraps, with its formula. Methods on torch.Tensor are
# listed as well as the functions because model code uses both spellings.
_TABLE: list[tuple[Any, str, FlopFn]] = [
    (F, "linear", _linear),
    (torch, "matmul", _matmul),
    (torch.Tensor, "matmul", _matmul),
    (torch.Tensor, "__matmul__", _matmul),
    (torch, "mm", _matmul),
    (torch.Tensor, "mm", _matmul),
    (torch, "bmm", _matmul),
    (torch.Tensor, "bmm", _matmul),
    (torch, "addmm", _addmm),
    (torch.Tensor, "addmm", _addmm),
    (torch, "baddbmm", _addmm),
    (torch.Tensor, "baddbmm", _addmm),
    (torch, "einsum", _einsum),
    (F, "conv1d", _conv),
    (F, "conv2d", _conv),
    (F, "conv3d", _conv),
    (F, "conv_transpose1d", _conv_transpose),
    (F, "conv_transpose2d", _conv_transpose),
    (F, "conv_transpose3d", _conv_transpose),
    (F, "scaled_dot_product_attention", _sdpa),
    (F, "layer_norm", _norm(3)),
    (F, "group_norm", _norm(3)),
    (F, "batch_norm", _norm(4)),
    (F, "instance_norm", _norm(4)),
    (F, "embedding", _zero),
    (F, "softmax", _per_element),
    (F, "log_softmax", _per_element),
    (torch, "softmax", _per_element),
    (torch.Tensor, "softmax", _per_element),
]
for _name in ("relu", "relu6", "elu", "leaky_relu", "gelu", "silu", "mish", "prelu", "sigmoid",
              "tanh", "hardswish", "hardsigmoid", "softplus", "glu", "logsigmoid"):  # fmt: skip
    if hasattr(F, _name):
        _TABLE.append((F, _name, _per_element))
for _name in ("max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
              "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
              "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"):  # fmt: skip
    _TABLE.append((F, _name, _per_element))
for _name in ("tanh", "sigmoid", "relu"):
    _TABLE.append((torch, _name, _per_element))
    _TABLE.append((torch.Tensor, _name, _per_element))
if hasattr(F, "rms_norm"):
    _TABLE.append((F, "rms_norm", _norm(3)))

_local = threading.local()
_patch_lock = threading.Lock()
_patched = False


def _wrap(original: Callable[..., Any], formula: FlopFn, sink_ref: list[FlopSink]) -> Any:
    @wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        # Count only the outermost intercepted call: F.softmax calling Tensor.softmax is one op.
        if getattr(_local, "depth", 0) == 0:
            try:
                flops, macs = formula(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a formula must never break the model's forward
                flops, macs = 0, 0
            sink_ref[0](int(flops), int(macs))
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _local.depth -= 1

    return counted


@contextmanager
def patched_functionals(sink: FlopSink) -> Iterator[None]:
    """Within the block, every intercepted torch call reports its ``(flops, macs)`` to ``sink``."""
    global _patched
    with _patch_lock:
        if _patched:
            raise RuntimeError(
                "a FlopsProfiler is already profiling in this process; call stop_profile() on it "
                "before starting another"
            )
        _patched = True
    sink_ref = [sink]
    saved: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, formula in _TABLE:
            # None marks an inherited attribute (Tensor.matmul lives on TensorBase): restoring
            # then means deleting our shadowing entry, not writing a copy into the subclass.
            saved.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, _wrap(getattr(owner, name), formula, sink_ref))
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _patched = False
