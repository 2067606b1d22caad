"""Rollouts from the trained model itself, through the hybrid engine's ``generate``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.runtime.rollout.base import (
    RolloutBatch,
    RolloutEngine,
    RolloutRequest,
    SamplingConfig,
)

__all__ = ["HybridEngineRollout", "HybridEngineRolloutConfig", "pad_after_eos"]


@dataclass
class HybridEngineRolloutConfig:
    """DeepSpeed's options; shardspeed builds none of them (each raises when set):
    ``use_graph_capture`` (CUDA-graph decoding), ``enable_profiling`` (per-forward timings),
    ``use_shared_prefill`` (one prompt forward shared by the samples of a prompt)."""

    use_graph_capture: bool = False
    enable_profiling: bool = False
    use_shared_prefill: bool = False


class HybridEngineRollout(RolloutEngine):
    """Generates with ``engine``: a hybrid engine's ``generate`` (the parameters gathered once
    per call), or for any other engine its model's own ``generate``. ``tokenizer`` gives the
    padding and end-of-sequence ids."""

    name = "hybrid_engine"

    def __init__(
        self, engine: Any, tokenizer: Any, cfg: HybridEngineRolloutConfig | None = None
    ) -> None:
        cfg = cfg or HybridEngineRolloutConfig()
        for key in ("use_graph_capture", "enable_profiling", "use_shared_prefill"):
            if getattr(cfg, key):
                raise NotImplementedError(
                    f"HybridEngineRolloutConfig.{key}=True is not built in shardspeed; leave "
                    "it False"
                )
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg

    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.tokenizer, "eos_token_id", None)
        if pad is None:
            raise ValueError("the tokenizer must define pad_token_id or eos_token_id")
        return int(pad)

    @torch.no_grad()
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        if sampling.continuous_batch_size is not None:
            raise NotImplementedError(
                "SamplingConfig.continuous_batch_size (continuous batching) is not built in "
                "shardspeed; leave it None"
            )
        repeats = sampling.n_samples_per_prompt
        prompt_ids = request.prompt_ids.repeat_interleave(repeats, dim=0)
        prompt_mask = request.prompt_attention_mask.repeat_interleave(repeats, dim=0)
        pad = self._pad_id()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        kwargs: dict[str, Any] = {
            "attention_mask": prompt_mask,
            "max_new_tokens": sampling.max_new_tokens,
            "pad_token_id": pad,
            # every rank generates the same number of tokens (a ZeRO-3 model that gathers
            # per forward must not stop early on one rank); the first EOS ends a response below
            "eos_token_id": None,
        }
        if sampling.temperature > 0:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p)
            kwargs["top_k"] = sampling.top_k if sampling.top_k > 0 else None
        else:
            kwargs["do_sample"] = False
        generate = getattr(self.engine, "generate", None) or self.engine.module.generate
        output = generate(prompt_ids, **kwargs)
        start = prompt_ids.shape[1]
        output, response_mask = pad_after_eos(output, start, eos, pad)
        mask = torch.cat([prompt_mask.to(response_mask.dtype), response_mask], dim=1)
        starts = torch.full((output.shape[0],), start, dtype=torch.long, device=output.device)
        return RolloutBatch(input_ids=output, attention_mask=mask, response_start_idx=starts)

    def sync_weights_from_student(self, step: int) -> None:
        """Nothing to do: every ``generate`` reads the engine's current weights."""
        del step


def pad_after_eos(
    output: torch.Tensor, start: int, eos: int | list[int] | None, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``output`` with every response token after the first EOS set to ``pad`` (the EOS is
    kept), and the responses' attention mask (1 up to and including that EOS)."""
    response = output[:, start:]
    if eos is None or response.shape[1] == 0:
        return output, torch.ones_like(response)
    eos_ids = torch.as_tensor(eos, device=response.device, dtype=response.dtype).flatten()
    is_eos = torch.isin(response, eos_ids).long()
    after = (torch.cumsum(is_eos, dim=1) - is_eos) > 0  # an EOS came before this position
    output = output.clone()
    output[:, start:] = response.masked_fill(after, pad)
    return output, (~after).long()
