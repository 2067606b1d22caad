"""DeepSpeed's ``UlyssesSPFwdLossBwdWithLogits``: forward, loss and backward of a batch over
the ranks of a sequence-parallel group, for training loops that do not use
:class:`~.dataloader_adapter.UlyssesSPDataLoaderAdapter`.

Every rank brings its own batch (sequence lengths may differ); the group gathers them and
processes them one after the other, each rank on its slice of the sequence: forward, the loss
of its slice (tiled when the logits are large), the group's loss as the mean over the tokens
that count, and backward. Gradients accumulate over the ``sp`` batches, and the engine's
boundary is set after the last, so one optimizer step follows.

The group's loss: ``sum_r n_r * loss_r / sum_r n_r``, ``n_r`` the labels other than ``-100``
in rank ``r``'s slice of the pre-shifted labels (counted exactly; DeepSpeed counts unshifted
labels minus one). The per-rank losses are gathered by
:func:`~shardspeed.runtime.sequence_parallel.loss.all_gather_differentiable`, whose
backward sums the gradients of all ranks (``torch.distributed.nn.functional.all_gather``'s,
which DeepSpeed's tutorial uses): every rank's parameter gradients add up to ``sp`` times the
whole sequence's gradient, so the engine's mean over the sequence-parallel ranks gives it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from shardspeed import comm
from shardspeed.runtime.sequence_parallel.loss import all_gather_differentiable
from shardspeed.runtime.sequence_parallel.tiled_compute import TiledFusedLogitsLoss

__all__ = ["UlyssesSPFwdLossBwdWithLogits"]

IGNORE_INDEX = -100
#: "auto" cuts the logits into tiles of about this many fp32 bytes (DeepSpeed's 1 GiB)
AUTO_TILE_BYTES = 2**30


class UlyssesSPFwdLossBwdWithLogits:
    """``sp_fwd_loss_bwd(batch)`` for ``model`` (an engine, or a module: then ``backward``
    is ``loss.backward()``); ``model_unwrapped`` is the Hugging Face model (its
    ``loss_function`` and ``config.vocab_size``); ``num_loss_logit_shards``: tiles of the loss
    over the logits, ``"auto"`` for about 1 GiB of fp32 logits each. The sequence-parallel
    group is the job's (``shardspeed.utils.groups``)."""

    def __init__(
        self,
        model: Any,
        model_unwrapped: Any,
        device: torch.device | str | None,
        num_loss_logit_shards: int | str = "auto",
        **kwargs: Any,
    ) -> None:
        from shardspeed.utils import groups

        if num_loss_logit_shards != "auto" and (
            isinstance(num_loss_logit_shards, bool)
            or not isinstance(num_loss_logit_shards, int)
            or num_loss_logit_shards < 1
        ):
            raise ValueError(
                f'num_loss_logit_shards must be "auto" or an int >= 1, got {num_loss_logit_shards!r}'
            )
        self.model = model
        self.model_unwrapped = model_unwrapped
        self.device = device
        self.num_loss_logit_shards = num_loss_logit_shards
        self.kwargs = kwargs
        self.sp_group = groups._get_sequence_parallel_group()
        self.sp_world_size = groups._get_sequence_parallel_world_size()
        self.sp_rank = groups._get_sequence_parallel_rank()
        self.logits: Tensor | None = None
        self.loss: Tensor | None = None

    def sp_fwd_loss_bwd(self, batch: dict[str, Tensor]) -> float:
        """Train on the group's batches (forward, loss, backward of each); return the mean of
        their losses."""
        shapes = {k: tuple(batch[k].shape) for k in ("input_ids", "position_ids", "labels")}
        if len(set(shapes.values())) != 1:
            raise ValueError(
                f"input_ids, position_ids and labels must have one shape, got {shapes}: "
                "Ulysses sequence parallelism cannot continue with this batch"
            )
        batches = self._gather(batch)
        self._set_boundary(False)
        losses: list[float] = []
        for step, whole in enumerate(batches):
            seqlen = whole["input_ids"].shape[1]
            if seqlen % self.sp_world_size:
                raise ValueError(
                    f"sub_step_id={step}: batch's seqlen={seqlen} isn't divisible by "
                    f"sp-size={self.sp_world_size}"
                )
            chunk = seqlen // self.sp_world_size
            labels = whole.pop("labels")
            shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
            counts = [
                int((shifted[:, r * chunk : (r + 1) * chunk] != IGNORE_INDEX).sum())
                for r in range(self.sp_world_size)
            ]
            start = self.sp_rank * chunk
            part = {k: v[:, start : start + chunk].to(self.device) for k, v in whole.items()}
            shift_labels = shifted[:, start : start + chunk].contiguous().to(self.device)
            self.forward(part)
            loss = self.compute_loss(labels=None, shift_labels=shift_labels)
            self.logits = None  # the logits may be huge: free them before backward
            per_rank = all_gather_differentiable(loss, self.sp_group)
            total = sum(counts)
            weights = torch.tensor(counts, dtype=per_rank.dtype, device=per_rank.device)
            # a batch with nothing to count gives 0 (every rank's loss is 0 then)
            self.loss = (per_rank * weights).sum() / max(total, 1)
            self.backward()
            losses.append(float(self.loss.detach()))
        self._set_boundary(True)
        return sum(losses) / len(losses) if losses else float("nan")

    def _gather(self, batch: dict[str, Tensor]) -> list[dict[str, Tensor]]:
        """Every rank's batch (tensors ``[batch, seqlen]``; lengths may differ by rank)."""
        length = torch.tensor([batch["input_ids"].shape[1]], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(length) for _ in range(self.sp_world_size)]
        comm.all_gather(lengths, length, group=self.sp_group)
        sizes = [int(n) for n in lengths]
        longest = max(sizes)
        out: list[dict[str, Tensor]] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            value = value.to(self.device)
            # padded to the longest and cut back after: not every backend gathers uneven sizes
            padded = value.new_zeros((value.shape[0], longest, *value.shape[2:]))
            padded[:, : value.shape[1]] = value
            received = [torch.empty_like(padded) for _ in sizes]
            with torch.no_grad():
                comm.all_gather(received, padded, group=self.sp_group)
            for rank, (tensor, size) in enumerate(zip(received, sizes, strict=True)):
                out[rank][key] = tensor[:, :size]
        return out

    def forward(self, batch: dict[str, Tensor]) -> Any:
        """The model's forward on this rank's slice (no labels: the loss is computed here)."""
        outputs = self.model(**batch, use_cache=False)
        self.logits = outputs.logits
        return outputs

    def compute_loss(self, labels: Tensor | None, shift_labels: Tensor) -> Tensor:
        """The mean loss of this rank's slice over its counted tokens (0, differentiably, when
        none counts: cross-entropy would be NaN)."""
        del labels
        logits = self.logits
        assert logits is not None, "forward() comes first"
        if bool((shift_labels == IGNORE_INDEX).all()):
            self.loss = (logits.sum() * 0.0).float()
            return self.loss
        shards = self._loss_shards(logits)
        if shards > 1:
            # the logits exist already: tiling bounds the loss's own float32 copies of them
            self.loss = TiledFusedLogitsLoss.apply(
                self._tile_loss, None, logits, shift_labels, None, shards, None, "mean"
            )
        else:
            self.loss = self._loss(logits, shift_labels)
        return self.loss

    def _loss_shards(self, logits: Tensor) -> int:
        if self.num_loss_logit_shards == "auto":
            return max(1, math.ceil(logits.numel() * 4 / AUTO_TILE_BYTES))
        return int(self.num_loss_logit_shards)

    def _loss(self, logits: Tensor, shift_labels: Tensor) -> Tensor:
        return self.model_unwrapped.loss_function(  # type: ignore[no-any-return]
            logits=logits,
            labels=None,
            vocab_size=self.model_unwrapped.config.vocab_size,
            shift_labels=shift_labels,
        )

    def _tile_loss(self, _unused: Any, logits: Tensor, shift_labels: Tensor) -> Tensor:
        return self._loss(logits.unsqueeze(0), shift_labels.unsqueeze(0))

    def backward(self) -> None:
        """The engine's backward of the group's loss (``loss.backward()`` for a module)."""
        assert self.loss is not None
        backward = getattr(self.model, "backward", None)
        if callable(backward):
            backward(self.loss)
        else:
            self.loss.backward()

    def _set_boundary(self, is_boundary: bool) -> None:
        setter = getattr(self.model, "set_gradient_accumulation_boundary", None)
        if callable(setter):
            setter(is_boundary)
