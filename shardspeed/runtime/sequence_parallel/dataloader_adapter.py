"""DeepSpeed's ``UlyssesSPDataLoaderAdapter``: a data loader's batches cut along the sequence
for the ranks of a sequence-parallel group.

Every rank of the group reads its own batch from its own loader; the adapter gathers the
group's ``sp`` batches and then serves them one after the other, each rank getting its slice
of the sequence of the same batch. So ``sp`` iterations of the adapter process the batches
that ``sp`` data-parallel ranks would have processed in one, and ``len()`` is ``sp`` times the
loader's. Before cutting, ``labels`` become ``shift_labels`` (label ``i + 1`` at position
``i``, ``-100`` at the end: the loss of a slice needs the next token, which may live on the
next rank), ``labels`` is removed (so that Hugging Face models compute no loss of their own),
and ``position_ids`` are made when missing, so that every slice holds its global positions.
A sequence that does not divide by ``sp`` is padded up (``pad_to_sp_multiple=True``, the
default) or refused, as in DeepSpeed. Cut batches wait on the CPU (a queue of ``sp`` batches of
a very long sequence is large).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from shardspeed import comm

__all__ = ["UlyssesSPDataLoaderAdapter"]

IGNORE_INDEX = -100
#: cumulative sequence lengths of packed samples over the flattened batch (kept whole)
GLOBAL_CU_SEQLENS_KEYS = frozenset(
    {"cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k"}
)
#: which of them position_ids are derived from, first found first
CU_SEQLENS_FOR_POSITIONS = (
    "cu_seq_lens_q",
    "cu_seqlens_q",
    "cu_seqlens",
    "cu_seq_lens_k",
    "cu_seqlens_k",
)
MAX_SEQLEN_KEYS = ("max_seqlen", "max_seqlen_q", "max_seqlen_k", "max_length_q", "max_length_k")
MULTIMODAL_KEYS = frozenset(
    {
        "images",
        "videos",
        "pixel_values",
        "pixel_values_videos",
        "image_grid_thw",
        "video_grid_thw",
        "image_sizes",
    }
)
MULTIMODAL_PREFIXES = ("pixel_", "image_", "video_", "vision_")


class UlyssesSPDataLoaderAdapter:
    """Wrap ``dl`` (batches: dicts with ``input_ids`` and ``labels`` of shape ``[batch,
    seqlen]``, other entries optional) for rank ``sp_rank`` of ``sp_group``
    (``sp_world_size`` ranks). Tensors of shape ``[batch, seqlen, ...]`` are cut along the
    sequence; other tensors and non-tensor entries are passed whole."""

    def __init__(
        self,
        dl: Iterable[Any],
        sp_rank: int,
        sp_group: Any,
        sp_world_size: int,
        device: torch.device | str | None,
        pad_to_sp_multiple: bool = True,
        pad_token_id: int = 0,
    ) -> None:
        if isinstance(sp_world_size, bool) or not isinstance(sp_world_size, int):
            raise TypeError(f"sp_world_size must be an int, got {sp_world_size!r}")
        if sp_world_size < 1 or not 0 <= sp_rank < sp_world_size:
            raise ValueError(
                f"sp_rank={sp_rank} must be in [0, sp_world_size={sp_world_size}) and "
                "sp_world_size >= 1"
            )
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.pad_to_sp_multiple = pad_to_sp_multiple
        self.pad_token_id = pad_token_id
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    # -- one round: every rank's batch, gathered and cut ---------------------------------
    def refill(self) -> None:
        """Read the next batch, gather the group's batches and queue this rank's slices."""
        try:
            batch = next(self.iter)
        except StopIteration:
            # the next epoch starts from a fresh iterator, as DeepSpeed's does
            self.iter = iter(self.dl)
            raise
        _check_batch(batch)
        batch = dict(batch)
        _ensure_position_ids(batch)
        gathered: list[dict[str, Any]] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            values: list[Any]
            if isinstance(value, Tensor):
                values = self._gather_tensor(value.to(self.device))
            else:
                values = [None] * self.sp_world_size
                comm.all_gather_object(values, value, group=self.sp_group)
            for rank, one in enumerate(values):
                gathered[rank][key] = one
        del batch
        for rank_batch in gathered:
            self.micro_batches.append(self._slice(rank_batch))

    def _gather_tensor(self, tensor: Tensor) -> list[Tensor]:
        shapes: list[Any] = [None] * self.sp_world_size
        comm.all_gather_object(shapes, tuple(tensor.shape), group=self.sp_group)
        received = [torch.empty(s, dtype=tensor.dtype, device=tensor.device) for s in shapes]
        with torch.no_grad():
            comm.all_gather(received, tensor.contiguous(), group=self.sp_group)
        return received

    def _slice(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's slice of one batch of the group (``labels`` made ``shift_labels``)."""
        rows, seq = batch["input_ids"].shape[:2]
        along = {k for k, v in batch.items() if _is_sequence(k, v, rows, seq)}
        if seq % self.sp_world_size:
            if not self.pad_to_sp_multiple:
                raise ValueError(
                    f"batch's seqlen={seq} isn't divisible by sp-size={self.sp_world_size}: "
                    "pad the batches to a multiple of it or pass pad_to_sp_multiple=True"
                )
            padded = math.ceil(seq / self.sp_world_size) * self.sp_world_size
            _adjust_cu_seqlens(batch, rows, seq, padded)
            for key in along:
                batch[key] = self._pad(key, batch[key], padded)
            seq = padded
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[
            :, 1:
        ].contiguous()
        along.add("shift_labels")
        along.discard("labels")
        chunk = seq // self.sp_world_size
        start = chunk * self.sp_rank
        for key, value in batch.items():
            if not isinstance(value, Tensor):
                continue
            if key in along:
                value = value[:, start : start + chunk]
            batch[key] = value.cpu()
        return batch

    def _pad(self, key: str, tensor: Tensor, length: int) -> Tensor:
        """``tensor`` padded along the sequence to ``length``: positions continue counting,
        ``seq_idx`` repeats its last document, labels get ``-100``, ``input_ids`` the pad
        token, anything else zeros."""
        extra = length - tensor.shape[1]
        if key == "position_ids":
            steps = torch.arange(1, extra + 1, dtype=tensor.dtype, device=tensor.device)
            return torch.cat((tensor, tensor[:, -1:] + steps), dim=1)
        if key == "seq_idx":
            return torch.cat((tensor, tensor[:, -1:].expand(-1, extra, *tensor.shape[2:])), dim=1)
        fill = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX}.get(key, 0)
        if key == "input_ids":
            fill = self.pad_token_id
        padded = tensor.new_full((tensor.shape[0], length, *tensor.shape[2:]), fill)
        padded[:, : tensor.shape[1]] = tensor
        return padded


def _is_multimodal(key: str) -> bool:
    return key in MULTIMODAL_KEYS or key.startswith(MULTIMODAL_PREFIXES)


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, dict) or not isinstance(batch.get("input_ids"), Tensor):
        raise ValueError(
            "Ulysses SP dataloader batches must be dicts holding an input_ids tensor, got "
            f"{type(batch).__name__}"
        )
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seqlen], got {tuple(input_ids.shape)}")
    multimodal = sorted(k for k, v in batch.items() if v is not None and _is_multimodal(k))
    if multimodal:
        raise ValueError(
            "Ulysses SP shards text tokens only; these multimodal inputs have no sequence "
            f"sharding: {multimodal}"
        )
    labels = batch.get("labels")
    if not isinstance(labels, Tensor):
        raise ValueError("Ulysses SP dataloader batches must hold a labels tensor")
    if labels.shape[:2] != input_ids.shape:
        raise ValueError(
            f"labels must match input_ids' [batch, seqlen] {tuple(input_ids.shape)}, got "
            f"{tuple(labels.shape)}"
        )


def _is_sequence(key: str, value: Any, rows: int, seq: int) -> bool:
    return (
        isinstance(value, Tensor)
        and key not in GLOBAL_CU_SEQLENS_KEYS
        and value.dim() >= 2
        and tuple(value.shape[:2]) == (rows, seq)
    )


def _ensure_position_ids(batch: dict[str, Any]) -> None:
    """Add ``position_ids`` of the whole sequence: from ``seq_idx`` (document ids) or
    cumulative sequence lengths of packed samples when given, else ``0 .. seqlen - 1``."""
    input_ids = batch["input_ids"]
    rows, seq = input_ids.shape
    if "position_ids" in batch:
        positions = batch["position_ids"]
        if not isinstance(positions, Tensor) or tuple(positions.shape) != (rows, seq):
            shape = tuple(positions.shape) if isinstance(positions, Tensor) else positions
            raise ValueError(
                f"position_ids must be [batch, seqlen]={(rows, seq)} like input_ids, got {shape}"
            )
        return
    seq_idx = batch.get("seq_idx")
    if isinstance(seq_idx, Tensor):
        if seq_idx.shape != input_ids.shape:
            raise ValueError(
                f"seq_idx must be shaped like input_ids {tuple(input_ids.shape)}, got "
                f"{tuple(seq_idx.shape)}"
            )
        batch["position_ids"] = _positions_from_seq_idx(seq_idx)
        return
    for key in CU_SEQLENS_FOR_POSITIONS:
        if isinstance(batch.get(key), Tensor):
            batch["position_ids"] = _positions_from_cu_seqlens(batch[key], rows, seq)
            return
    batch["position_ids"] = (
        torch.arange(seq, dtype=torch.long, device=input_ids.device).expand(rows, seq).clone()
    )


def _positions_from_seq_idx(seq_idx: Tensor) -> Tensor:
    """Positions counting from 0 at each change of document id along a row."""
    index = torch.arange(seq_idx.shape[1], device=seq_idx.device).expand_as(seq_idx)
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def _positions_from_cu_seqlens(cu_seqlens: Tensor, rows: int, seq: int) -> Tensor:
    """Positions counting from 0 at each packed sample's start (``cu_seqlens`` over the
    flattened batch, holding every row boundary)."""
    cu = cu_seqlens.to(dtype=torch.long)
    total = rows * seq
    if (
        cu.dim() != 1
        or cu.numel() < rows + 1
        or int(cu[0]) != 0
        or int(cu[-1]) != total
        or bool((cu[1:] <= cu[:-1]).any())
    ):
        raise ValueError(
            "cu_seqlens used to make position_ids must rise strictly from 0 to batch * seqlen "
            f"= {total}, got {cu.tolist()}"
        )
    boundaries = torch.arange(0, total + 1, seq, device=cu.device)
    if not bool(torch.isin(boundaries, cu).all()):
        raise ValueError("cu_seqlens must hold every row boundary to make position_ids")
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])
    return (torch.arange(total, device=cu.device) - starts).reshape(rows, seq)


def _adjust_cu_seqlens(batch: dict[str, Any], rows: int, old: int, new: int) -> None:
    """Rows grew from ``old`` to ``new`` tokens: move the flattened boundaries (the padding
    joins each row's last sample) and update the longest-sample entries."""
    adjusted: list[Tensor] = []
    for key in sorted(GLOBAL_CU_SEQLENS_KEYS):
        cu = batch.get(key)
        if not isinstance(cu, Tensor):
            continue
        if cu.dim() != 1 or int(cu[-1]) != rows * old:
            raise ValueError(f"{key} must be 1-D and end at batch * seqlen = {rows * old}")
        batch[key] = torch.div(cu, old, rounding_mode="floor") * new + torch.remainder(cu, old)
        adjusted.append(batch[key])
    if not adjusted:
        return
    longest = max(int((cu[1:] - cu[:-1]).max()) for cu in adjusted)
    for key in MAX_SEQLEN_KEYS:
        value = batch.get(key)
        if isinstance(value, Tensor):
            batch[key] = value.new_tensor(longest)
        elif value is not None:
            batch[key] = longest
