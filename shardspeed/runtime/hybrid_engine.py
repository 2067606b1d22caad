"""DeepSpeed's ``deepspeed.runtime.hybrid_engine``: one model trained with ZeRO and generating
with the inference forward, for RLHF (an actor that produces rollouts and then learns from them).

:class:`DeepSpeedHybridEngine` is the training engine plus :meth:`~DeepSpeedHybridEngine.generate`;
:func:`shardspeed.initialize` returns it when ``hybrid_engine.enabled`` is set. It composes the two
sides without a branch in either: the training strategy is asked only for what any client can
ask (``zero.GatheredParameters`` over the model's parameters: one all-gather per gather unit,
all of them in flight together, nothing at stages 0-2), and the inference side gets an ordinary
model to decode, the :func:`~.hybrid_shadow.generation_view` of the gathered weights.

One ``generate`` call:

1. with ``pin_parameters`` (the default) gathers every parameter at once, once for the call
   (DeepSpeed's ``gather_all_layers``); without it the ZeRO-3 module hooks gather each module
   as its forward runs (layer by layer, for every token: the model need never be whole, at the
   cost of gathers per token, as in DeepSpeed);
2. builds the generation view: hook-free, eval mode, PEFT LoRA adapters fused into plain
   linears (the trained weights are never written, so training mode sees them unfused);
3. decodes with shardspeed's fused decoder (one QKV and one gate/up matmul, a static KV cache)
   for greedy decoding of the families it supports (Llama, Mistral, Qwen2/3, GPT-2), else with
   the Hugging Face model's own ``generate`` on the view (sampling, beams, other families);
4. releases the gathered parameters; the trained model's mode was never changed.

Config (``hybrid_engine``): ``max_out_tokens`` bounds prompt plus new tokens (the fused KV
cache's length; a longer request is a ValueError); ``release_inference_cache`` frees that cache
after every call instead of keeping it for the next one; ``pin_parameters`` as above;
``inference_tp_size`` > 1 splits generation over groups of that many consecutive ranks
(:mod:`~.hybrid_tp`: each group all-gathers its ranks' prompts, left-padding unequal lengths
under an attention mask, decodes them with the view split by AutoTP, and each rank keeps its own
rows); it needs ``pin_parameters`` (unpinned generation runs through the hooks, whole) and a
greedy call on a fused family, else the call runs the whole-model path (one warning);
``tp_gather_partition_size`` has no effect (the whole model is gathered once, then split);
``enable_cuda_graph`` is not used (a warning says so).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from shardspeed.accelerator import get_accelerator
from shardspeed.config.hybrid_engine import HybridEngineConfig
from shardspeed.inference.tp_group import TPGroup
from shardspeed.runtime.engine import DeepSpeedEngine
from shardspeed.runtime.engine_parts import EngineParts
from shardspeed.runtime.hybrid_shadow import (
    count_lora_layers,
    generation_view,
    lora_replacement,
    unwrap_peft,
)
from shardspeed.runtime.hybrid_tp import (
    TP_KWARGS,
    check_inference_tp_size,
    gather_group_batch,
    make_inference_tp_group,
    split_view,
)
from shardspeed.runtime.zero.partition_parameters import GatheredParameters
from shardspeed.utils.logging import log_dist, warning_once

__all__ = ["DeepSpeedHybridEngine"]

#: model types shardspeed's fused decoder builds blocks for
_FUSED_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})


class DeepSpeedHybridEngine(DeepSpeedEngine):
    """The training engine with :meth:`generate` (see the module docstring)."""

    def __init__(self, parts: EngineParts) -> None:
        super().__init__(parts)
        #: the ``hybrid_engine`` section (``initialize`` refused what is not built)
        self.hybrid_config: HybridEngineConfig = parts.config.hybrid_engine
        #: DeepSpeed's attribute: gather the whole model once per ``generate`` call
        self.gather_all_layers = bool(self.hybrid_config.pin_parameters)
        #: the fused decoder's KV cache, kept between calls unless ``release_inference_cache``
        self._kv_cache: Any = None
        self._generate_latency = 0.0
        self._gather_latency = 0.0
        self._training_latency = 0.0
        self._t_start: float | None = None
        self._iters = 0
        #: whether the last ``generate`` ran the fused decoder (else Hugging Face's generate)
        self.last_generate_fused = False
        #: this rank's inference tensor-parallel group (None: ``inference_tp_size`` 1), made
        #: here because every rank constructs the engine, in the same order
        tp_size = int(self.hybrid_config.inference_tp_size)
        self.inference_tp: TPGroup | None = (
            make_inference_tp_group(tp_size) if tp_size > 1 else None
        )
        if self.inference_tp is not None and not self.gather_all_layers:
            log_dist(
                f"hybrid_engine.inference_tp_size={tp_size} with pin_parameters=false: "
                "generation runs through the ZeRO-3 hooks on the whole model (as in DeepSpeed, "
                "tensor-parallel generation needs pin_parameters=true)",
                ranks=[0],
            )
        #: whether the last ``generate`` split the model over the inference TP group
        self.last_generate_tp = False
        #: the last tensor-parallel view (kept for inspection until the next ``generate``)
        self.last_tp_view: nn.Module | None = None

    # -- modes --------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> DeepSpeedHybridEngine:
        """Training mode for the wrapped model (``mode=False``: eval mode)."""
        if mode and self._t_start is None:
            self._t_start = time.time()
        super().train(mode)
        return self

    def eval(self) -> DeepSpeedHybridEngine:
        """Eval mode for the wrapped model (forward passes skip dropout; ``generate`` works in
        either mode and leaves the mode as it found it)."""
        if self._t_start is not None:
            self._training_latency += time.time() - self._t_start
            self._t_start = None
        super().eval()
        return self

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """Generate with the wrapped (Hugging Face) model's ``generate`` arguments; returns what
        it returns (the prompt followed by the new tokens, for the fused greedy loop)."""
        self._check_length(inputs, kwargs)
        started = time.time()
        if not self.gather_all_layers:
            # the ZeRO-3 hooks gather module by module as the forwards run
            self.last_generate_fused = False
            return self._generate_through_hooks(*inputs, **kwargs)
        self._warn_if_large()
        with GatheredParameters(list(self.module.parameters())):
            self._gather_latency = time.time() - started
            view = generation_view(self.module, lora_replacement)
            if self.inference_tp is not None:
                output = self._generate_tp(view, self.inference_tp, inputs, kwargs)
            else:
                output = self._generate_on(view, inputs, kwargs)
        self._generate_latency = time.time() - started - self._gather_latency
        self._iters += 1
        return output

    def _generate_on(self, view: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Decode on the generation view: fused where supported, else Hugging Face's loop."""
        model = unwrap_peft(view)
        decoder = self._fused_decoder(model, inputs, kwargs)
        self.last_generate_fused = decoder is not None
        if decoder is None:
            kwargs.setdefault("synced_gpus", False)  # the view runs no collective per step
            generate: Any = view.generate  # a Hugging Face model's (or PEFT wrapper's)
            return generate(*inputs, **kwargs)
        return self._run_fused(decoder, inputs, kwargs)

    def _run_fused(self, decoder: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``decoder.generate`` with the kept KV cache."""
        decoder._cache = self._kv_cache
        try:
            return decoder.generate(*inputs, **kwargs)
        finally:
            self._kv_cache = None if self.hybrid_config.release_inference_cache else decoder._cache
            decoder._cache = None

    def _generate_tp(
        self, view: nn.Module, tp: TPGroup, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Decode the group's prompts with ``view`` split over ``tp``; this rank's rows back.
        A call some rank of the group cannot run this way runs the whole-model path on every
        rank of the group (they decide together from the gathered metadata)."""
        from shardspeed.inference.config import DeepSpeedInferenceConfig
        from shardspeed.inference.fused.builder import build_fused_decoder

        model = unwrap_peft(view)
        ids = inputs[0] if inputs else kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        ok = (
            len(inputs) <= 1
            and isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and (mask is None or (isinstance(mask, torch.Tensor) and mask.shape == ids.shape))
            and set(kwargs) <= TP_KWARGS
            and model_type in _FUSED_FAMILIES
            and _greedy_call(model, kwargs)
        )
        defaults = getattr(model, "generation_config", None)
        pad = kwargs.get("pad_token_id", getattr(defaults, "pad_token_id", None))
        if not ok or not isinstance(ids, torch.Tensor):
            # a stand-in of the same device, so the group's metadata gather still matches
            ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
            mask = None
        batch = gather_group_batch(
            tp,
            ids,
            mask,
            ok,
            int(pad) if isinstance(pad, int) else 0,
        )
        decoder = None
        if batch is not None:
            split_view(model, tp)
            dtype = next(model.parameters()).dtype
            config = DeepSpeedInferenceConfig(max_tokens=self.hybrid_config.max_out_tokens)
            decoder = build_fused_decoder(model, config, tp, dtype)
        if batch is None or decoder is None:
            warning_once(
                "hybrid engine: a generate call that is not greedy decoding of a Llama, "
                "Mistral, Qwen2/3 or GPT-2 model with the fused decoder's arguments runs on the "
                "whole gathered model on each rank (inference_tp_size is not used for it)"
            )
            self.last_generate_tp = False
            if batch is not None:  # the view was split: decode on a whole one
                view = generation_view(self.module, lora_replacement)
            return self._generate_on(view, inputs, kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
        rest.pop("synced_gpus", None)
        if batch.mask is not None:
            rest["attention_mask"] = batch.mask
        self.last_generate_fused = self.last_generate_tp = True
        self.last_tp_view = model
        return batch.own(self._run_fused(decoder, (batch.ids,), rest))

    def _fused_decoder(
        self, model: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The fused decoder over ``model`` (the view), or None where the call or the model
        family is not one it runs exactly."""
        from shardspeed.inference.config import DeepSpeedInferenceConfig
        from shardspeed.inference.fused.builder import build_fused_decoder
        from shardspeed.inference.fused.decoder import FusedCausalLM
        from shardspeed.inference.tp_group import TPGroup

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in _FUSED_FAMILIES:
            warning_once(
                f"hybrid engine: model_type {model_type!r} has no fused decoder; generating "
                "with the Hugging Face model's own generate on the gathered weights"
            )
            return None
        if not _greedy_call(model, kwargs):
            return None
        dtype = next(model.parameters()).dtype
        config = DeepSpeedInferenceConfig(max_tokens=self.hybrid_config.max_out_tokens)
        decoder = build_fused_decoder(model, config, TPGroup(None, 0, 1), dtype)
        if decoder is None or not decoder.accepts(*inputs, **kwargs):
            return None
        assert isinstance(decoder, FusedCausalLM)
        return decoder

    def _generate_through_hooks(self, *inputs: Any, **kwargs: Any) -> Any:
        """``pin_parameters`` false: the training model generates, its ZeRO-3 hooks gathering
        and releasing each module per forward; its mode is restored afterwards."""
        was_training = self.module.training
        self.module.eval()
        try:
            return self.module.generate(*inputs, **kwargs)
        finally:
            self.module.train(was_training)

    def _check_length(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = inputs[0] if inputs else kwargs.get("input_ids")
        new = kwargs.get("max_new_tokens")
        if not isinstance(ids, torch.Tensor) or new is None:
            return
        limit = self.hybrid_config.max_out_tokens
        if ids.shape[-1] + int(new) > limit:
            raise ValueError(
                f"generate: {ids.shape[-1]} prompt + {new} new tokens exceed "
                f"hybrid_engine.max_out_tokens={limit}; raise max_out_tokens in the config or "
                "ask for fewer tokens"
            )

    def _warn_if_large(self) -> None:
        """Say once when the whole model is larger than the free device memory."""
        if self._iters:
            return
        total = sum(p.numel() * p.element_size() for p in self.module.parameters())
        try:
            free = int(get_accelerator().available_memory())
        except (NotImplementedError, RuntimeError):
            return
        if free and total > free:
            warning_once(
                f"hybrid engine: the gathered model takes {total / 2**30:.2f} GiB, more than the "
                f"{free / 2**30:.2f} GiB free; set hybrid_engine.pin_parameters=false to gather "
                "layer by layer while generating (slower)"
            )

    # -- LoRA (DeepSpeed-Chat's names) ----------------------------------------------------------
    def fuse_lora_weight(self) -> None:
        """Nothing to do: every ``generate`` fuses the LoRA adapters into its own view of the
        weights (:mod:`~.hybrid_shadow`); the trained weights stay unfused."""

    def unfuse_lora_weight(self) -> None:
        """Nothing to do (see :meth:`fuse_lora_weight`)."""

    @property
    def lora_layers(self) -> int:
        """How many PEFT LoRA layers ``generate`` fuses."""
        return count_lora_layers(self.module)

    # -- statistics (DeepSpeed logs these at its eval()) -----------------------------------------
    @property
    def generate_latency(self) -> float:
        """Seconds the last ``generate`` spent decoding (after the gather)."""
        return self._generate_latency

    @property
    def gather_latency(self) -> float:
        """Seconds the last ``generate`` spent gathering the parameters."""
        return self._gather_latency

    def release_kv_cache(self) -> None:
        """Free the kept KV cache now (``release_inference_cache`` does it after every call)."""
        self._kv_cache = None


def check_hybrid_config(config: HybridEngineConfig, world_size: int = 1, mpu: Any = None) -> None:
    """Refuse what does not fit the world or is not built; say what is ignored."""
    check_inference_tp_size(int(config.inference_tp_size), world_size, mpu)
    if config.enable_cuda_graph:
        log_dist(
            "hybrid_engine.enable_cuda_graph is not used by shardspeed's hybrid engine (the "
            "fused decoder's weights change every step); generating without CUDA graphs",
            ranks=[0],
        )


def _greedy_call(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the call decodes greedily with one beam (the model's generation config fills in
    what the call leaves out)."""
    defaults = getattr(model, "generation_config", None)
    sample = kwargs.get("do_sample", getattr(defaults, "do_sample", False))
    beams = kwargs.get("num_beams", getattr(defaults, "num_beams", 1))
    return not sample and beams in (None, 1)
