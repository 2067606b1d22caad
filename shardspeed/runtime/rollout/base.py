"""The rollout interface: what a trainer hands its rollout engine and gets back."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

__all__ = ["RolloutBatch", "RolloutEngine", "RolloutRequest", "SamplingConfig"]


@dataclass
class SamplingConfig:
    """How to sample each step: ``temperature`` <= 0 is greedy decoding; ``top_k`` -1 is off;
    every prompt is answered ``n_samples_per_prompt`` times (rows repeated in place).
    ``continuous_batch_size`` (DeepSpeed's experimental continuous batching) is not built."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: ask for at least 1 token")
        if self.n_samples_per_prompt < 1:
            raise ValueError(
                f"n_samples_per_prompt={self.n_samples_per_prompt}: it must be at least 1"
            )


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


@dataclass
class RolloutRequest:
    """Prompts, left-padded (real tokens at the right edge), and their attention mask."""

    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise ValueError(
                f"prompt_ids must be 2-D (batch, prompt length); got {_shape(self.prompt_ids)}"
            )
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise ValueError(
                f"prompt_attention_mask has shape {_shape(self.prompt_attention_mask)}, "
                f"prompt_ids {_shape(self.prompt_ids)}; they must match"
            )


@dataclass
class RolloutBatch:
    """Prompt and response in one tensor per row (responses padded on the right), its attention
    mask, and where each row's response starts."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D; got {_shape(self.input_ids)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"attention_mask has shape {_shape(self.attention_mask)}, input_ids "
                f"{_shape(self.input_ids)}; they must match"
            )
        rows = self.input_ids.shape[0]
        if _shape(self.response_start_idx) != (rows,):
            raise ValueError(
                f"response_start_idx must have one entry per row ({rows}); got "
                f"{_shape(self.response_start_idx)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(ABC):
    """A generator of rollouts for the trained model (the "student")."""

    name: str = "base"

    @abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Answer every prompt of ``request`` as ``sampling`` says."""

    @abstractmethod
    def sync_weights_from_student(self, step: int) -> None:
        """Make the rollout backend use the student's current weights (a backend that reads
        them live does nothing)."""

    def shutdown(self) -> None:
        """Free the backend's resources (nothing by default)."""
        return None
