"""``LocalExperts``: this rank's slice of a fused Transformers 5 experts module.

The slice keeps the fused layout (``gate_up_proj`` ``[local, 2 * ffn, hidden]``, gate rows first;
``down_proj`` ``[local, hidden, ffn]``) under the original parameter names, marked as expert
parameters of the ``ep_size_<n>`` groups so the ZeRO strategy reduces their gradients over the
expert-data-parallel group only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here (it has no CPU backward in
    torch 2.13, and CUDA wants recent GPUs); probed once per device type and dtype."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return False
    try:
        x = torch.ones(8, 16, device=device_type, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
        offs = torch.tensor([3, 8], dtype=torch.int32, device=device_type)
        grouped_mm(x, w, offs=offs).sum().backward()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class LocalExperts(nn.Module):
    """Experts ``first .. first + num_local - 1`` of a fused experts module."""

    def __init__(
        self,
        gate_up: Tensor,
        down: Tensor,
        act_fn: Callable[[Tensor], Tensor],
        *,
        first: int,
        group_name: str,
        w1_name: str = "gate_up_proj",
        w2_name: str = "down_proj",
        use_grouped_mm: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = gate_up.shape[0]
        self.first_expert = first
        self.w1_name, self.w2_name = w1_name, w2_name
        self.act_fn = act_fn
        self.use_grouped_mm = use_grouped_mm
        for name, weight in ((w1_name, gate_up), (w2_name, down)):
            param = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
            param.allreduce = False  # type: ignore[attr-defined]
            param.group_name = group_name  # type: ignore[attr-defined]
            self.register_parameter(name, param)

    @property
    def gate_up(self) -> Tensor:
        return getattr(self, self.w1_name)

    @property
    def down(self) -> Tensor:
        return getattr(self, self.w2_name)

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:
        """``rows`` sorted by local expert, ``counts[e]`` of them for expert ``e``."""
        if self.use_grouped_mm and rows.shape[0] > 0 and self._grouped_ok(rows):
            return self._grouped(rows, counts)
        outputs = []
        # every expert runs, also on no rows: its weights stay in the graph (zero gradient)
        for e, chunk in enumerate(rows.split(counts)):
            gate, up = F.linear(chunk, self.gate_up[e]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down[e]))
        return torch.cat(outputs)

    def _grouped_ok(self, rows: Tensor) -> bool:
        aligned = all(s * rows.element_size() % 16 == 0 for s in self.down.shape[1:])
        return aligned and grouped_mm_works(rows.device.type, rows.dtype)

    def _grouped(self, rows: Tensor, counts: list[int]) -> Tensor:
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(rows, self.gate_up.transpose(1, 2), offs=offs).chunk(2, -1)
        return torch._grouped_mm(self.act_fn(gate) * up, self.down.transpose(1, 2), offs=offs)
