"""Knowledge distillation from a teacher, as DeepSpeed's XTC / ZeroQuant examples train their
compressed students (``DeepSpeedExamples/compression``: ``--distill_method one_stage``).

Those examples add, to the task loss, a soft cross-entropy between the student's and the
teacher's temperature-scaled logits and an MSE between hidden states of mapped layers (student
layer ``i`` against teacher layer ``teacher_layer[i]``, the embeddings against each other).
Here the logit term is the KL divergence ``KL(softmax(t / T) || softmax(s / T)) * T^2``: it
differs from the soft cross-entropy by the teacher's entropy, a constant for the student, so the
gradients are the same up to the ``T^2`` scale that keeps them comparable across temperatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from shardspeed.compression.config import get_compression_config

__all__ = ["Distiller", "hidden_state_loss", "logit_distillation_loss"]


def logit_distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Mean over positions of ``KL(teacher || student)`` at ``temperature``, times ``T^2``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    classes = student_logits.shape[-1]
    student = F.log_softmax(student_logits.reshape(-1, classes) / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().reshape(-1, classes) / temperature, dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    return kl * temperature**2


def hidden_state_loss(
    student_hidden: Sequence[torch.Tensor],
    teacher_hidden: Sequence[torch.Tensor],
    layer_map: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """Sum of the MSEs between ``student_hidden[s]`` and ``teacher_hidden[t]`` for each
    ``(s, t)`` of ``layer_map`` (indices into Hugging Face's ``hidden_states`` tuples: 0 is the
    embeddings, ``i + 1`` the output of layer ``i``)."""
    total = student_hidden[0].new_zeros(())
    for s, t in layer_map:
        total = total + F.mse_loss(student_hidden[s], teacher_hidden[t].detach())
    return total


class Distiller:
    """The student's training loss with distillation from ``teacher`` (kept in eval mode, no
    gradients): ``task_weight * task + logit_weight * KL + hidden_weight * MSE``."""

    def __init__(
        self,
        teacher: nn.Module,
        temperature: float = 1.0,
        task_weight: float = 1.0,
        logit_weight: float = 1.0,
        hidden_weight: float = 0.0,
        layer_map: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature = temperature
        self.task_weight, self.logit_weight, self.hidden_weight = (
            task_weight,
            logit_weight,
            hidden_weight,
        )
        self.layer_map = list(layer_map)

    @classmethod
    def from_config(cls, teacher: nn.Module, deepspeed_config: Any, **kwargs: Any) -> Distiller:
        """A distiller whose hidden-state map follows ``layer_reduction.teacher_layer``
        (student layer ``i`` <- teacher layer ``teacher_layer[i]``, embeddings <- embeddings)."""
        reduction = get_compression_config(deepspeed_config).layer_reduction
        layer_map = [(0, 0)] + [(s + 1, t + 1) for s, t in enumerate(reduction.teacher_layer)]
        kwargs.setdefault("layer_map", layer_map if reduction.enabled else [])
        return cls(teacher, **kwargs)

    def teacher_outputs(self, *args: Any, **kwargs: Any) -> Any:
        """The teacher's outputs for the student's inputs (hidden states included)."""
        with torch.no_grad():
            return self.teacher(*args, output_hidden_states=True, **kwargs)

    def loss(
        self, student_outputs: Any, teacher_outputs: Any, task_loss: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The combined loss from Hugging Face-style outputs (``logits``, ``hidden_states``)."""
        total = self.logit_weight * logit_distillation_loss(
            student_outputs.logits, teacher_outputs.logits, self.temperature
        )
        if self.hidden_weight and self.layer_map:
            total = total + self.hidden_weight * hidden_state_loss(
                student_outputs.hidden_states, teacher_outputs.hidden_states, self.layer_map
            )
        if task_loss is not None:
            total = total + self.task_weight * task_loss
        return total
