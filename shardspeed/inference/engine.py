"""``InferenceEngine``: a model prepared for inference, called like the model.

Construction, in order: resolve the tensor-parallel group; pick the weight source (the model in
memory, or a safetensors checkpoint read slice by slice); split the model by AutoTP's plan while
converting dtype and placing weights; quantize to int8 when ``dtype`` is int8; build the fused
decoder when ``replace_with_kernel_inject`` is set and the model is supported, its per-token
step captured in a CUDA graph with ``enable_cuda_graph``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.inference.autotp import apply_plan
from shardspeed.inference.config import DeepSpeedInferenceConfig
from shardspeed.inference.quantization import quantize_module
from shardspeed.inference.tp_group import TPGroup, resolve_tp_group
from shardspeed.inference.tp_plan import build_plan
from shardspeed.inference.weight_source import ModuleWeights, WeightSource, open_checkpoint
from shardspeed.utils.logging import logger

__all__ = ["InferenceEngine"]


class InferenceEngine(nn.Module):
    """Wraps ``model`` (as ``self.module``) after sharding, dtype conversion and injection."""

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        self._config = config
        if config.min_out_tokens > config.max_out_tokens:
            raise ValueError(
                f"min_out_tokens={config.min_out_tokens} exceeds max_out_tokens="
                f"{config.max_out_tokens}; raise max_out_tokens or lower min_out_tokens."
            )
        if config.training_mp_size != 1:
            raise ValueError(
                f"training_mp_size={config.training_mp_size}: Megatron-sharded training "
                "checkpoints are not supported; give a Hugging Face safetensors checkpoint."
            )
        _warn_not_implemented(config)
        self.tp: TPGroup = resolve_tp_group(config.tensor_parallel, config.mpu)
        self.compute_dtype = _compute_dtype(model, config.dtype)
        self.device = torch.device("cpu") if config.keep_module_on_host else _device()
        _check_cuda_graph(config, self.device, self.tp.size)
        _tie_weights(model)
        plan = build_plan(
            model,
            self.tp.size,
            self.tp.rank,
            config.tensor_parallel.tp_grain_size,
            config.injection_policy,
        )
        source = self._source(model)
        try:
            apply_plan(model, plan, self.tp, source, self.compute_dtype, self.device)
        finally:
            source.close()
        if config.dtype == torch.int8 and config.quant.enabled:
            quantize_module(model, config.quant)
        self.module = model.eval()
        self.fused: Any = None
        if config.replace_with_kernel_inject:
            self.fused = _build_fused(model, config, self.tp, self.compute_dtype)
        if config.enable_cuda_graph and self.fused is not None:
            self.fused.decode_mode = "cuda_graph"
        elif config.enable_cuda_graph:
            logger.warning(
                "enable_cuda_graph: only the fused decoding step is captured "
                "(replace_with_kernel_inject=True on a supported model); nothing is captured here"
            )
        self.model_profile_enabled = False
        self.use_cuda_events = True
        self._model_times: list[float] = []

    def _source(self, model: nn.Module) -> WeightSource:
        checkpoint = self._config.checkpoint or self._config.checkpoint_config.checkpoint_dir
        if checkpoint:
            base_dir = self._config.base_dir or self._config.checkpoint_config.base_dir or ""
            return open_checkpoint(checkpoint, base_dir, getattr(model, "base_model_prefix", ""))
        meta = [n for n, p in model.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(
                f"the model's parameters are on the meta device ({meta[0]}, ...) and no "
                "checkpoint is given; pass checkpoint=<safetensors directory, index or file>."
            )
        return ModuleWeights(model)

    @property
    def config(self) -> DeepSpeedInferenceConfig:
        return self._config

    @property
    def mp_world_size(self) -> int:
        """Tensor-parallel degree (DeepSpeed's name)."""
        return self.tp.size

    @property
    def dtype(self) -> torch.dtype:
        """The configured dtype (int8 when the weights are quantized)."""
        return self._config.dtype

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped model (timed when :meth:`profile_model_time` is on)."""
        if not self.model_profile_enabled:
            return self.module(*inputs, **kwargs)
        get_accelerator().synchronize()
        start = time.perf_counter()
        out = self.module(*inputs, **kwargs)
        get_accelerator().synchronize()
        self._model_times.append((time.perf_counter() - start) * 1000.0)
        return out

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """Hugging Face ``generate``; greedy decoding runs on the fused decoder when injected."""
        return self._generate(*inputs, **kwargs)

    def _generate(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.fused is not None and self.fused.accepts(*inputs, **kwargs):
            return self.fused.generate(*inputs, **kwargs)
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise TypeError(f"{type(self.module).__name__} has no generate()")
        return generate(*inputs, **kwargs)

    def compile(
        self,
        backend: str | Callable[..., Any] = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """``torch.compile`` the decoding: with fused decoding the per-token step, whose shapes
        never change (one compilation per batch size and cache, no recompiling as the sequence
        grows); without it the wrapped model's forward. Call before generating."""
        options = {"backend": backend, **(compile_kwargs or {})}
        if self.fused is None:
            self.module.forward = torch.compile(self.module.forward, **options)
            return
        if self.fused.decode_mode == "cuda_graph":
            raise ValueError(
                "compile(): enable_cuda_graph already captures the decoding step; use one of the "
                "two (set enable_cuda_graph=False to compile instead)"
            )
        options.setdefault("dynamic", False)
        self.fused.compiler = functools.partial(torch.compile, **options)
        self.fused.decode_mode = "compiled"

    def profile_model_time(self, use_cuda_events: bool = True) -> None:
        """Record the wall time of every forward from now on (see :meth:`model_times`)."""
        self.model_profile_enabled = True
        self.use_cuda_events = use_cuda_events

    def model_times(self) -> list[float]:
        """Forward times in milliseconds since the last call; the list is then cleared."""
        times, self._model_times = self._model_times, []
        return times


# settings the config accepts (DeepSpeed has them) that change nothing here yet
_NOT_IMPLEMENTED = (
    "use_triton",
    "triton_autotune",
    "save_mp_checkpoint_path",
    "set_empty_params",
)


def _warn_not_implemented(config: DeepSpeedInferenceConfig) -> None:
    for name in _NOT_IMPLEMENTED:
        if getattr(config, name):
            logger.warning(
                f"inference config {name}={getattr(config, name)!r} is not implemented yet; ignored"
            )
    if config.ep_size > 1 or (not isinstance(config.moe, bool) and config.moe.ep_size > 1):
        logger.warning("inference MoE (ep_size > 1) is not implemented yet; experts are not split")


def _check_cuda_graph(config: DeepSpeedInferenceConfig, device: torch.device, tp_size: int) -> None:
    """``enable_cuda_graph`` needs the model on a CUDA device (as in DeepSpeed) and, here, one
    tensor-parallel rank; refuse anything else before the model is touched."""
    if not config.enable_cuda_graph:
        return
    if device.type != "cuda":
        why = (
            " (keep_module_on_host=True keeps it on the host)" if config.keep_module_on_host else ""
        )
        raise ValueError(
            f"enable_cuda_graph=True captures the decoding step in a CUDA graph, but the model "
            f"runs on {device.type}{why}; CUDA graphs exist only on CUDA devices. Set "
            "enable_cuda_graph=False, or run on a CUDA device."
        )
    if tp_size > 1:
        raise ValueError(
            f"enable_cuda_graph=True with tensor_parallel.tp_size={tp_size} is not supported yet "
            "(the decoding step's all-reduces are not captured); set enable_cuda_graph=False or "
            "tp_size=1."
        )


def _tie_weights(model: nn.Module) -> None:
    """Re-tie a Hugging Face model's tied weights (``accelerate.init_empty_weights`` leaves the
    output head and the embedding as two meta tensors; a checkpoint holds only one of them)."""
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def _device() -> torch.device:
    return torch.device(get_accelerator().current_device_name())


def _compute_dtype(model: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The float dtype the model runs in: ``dtype``, or with int8 the model's own float dtype."""
    if dtype == torch.int8:
        floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
        return floats[0] if floats else torch.float32
    supported = get_accelerator().supported_dtypes()
    if dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise ValueError(
            f"dtype={str(dtype).removeprefix('torch.')} is not supported on "
            f"{get_accelerator().device_name()}; choose one of: {names}, or int8."
        )
    return dtype


def _build_fused(
    model: nn.Module, config: DeepSpeedInferenceConfig, tp: TPGroup, dtype: torch.dtype
) -> Any:
    from shardspeed.inference.fused.builder import build_fused_decoder

    return build_fused_decoder(model, config, tp, dtype)
