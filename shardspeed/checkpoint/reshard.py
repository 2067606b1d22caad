"""Re-partitioning ZeRO optimizer checkpoints for another data-parallel size, bucket layout or
stage (0, 1 or 2).

Every rank of a stage 1/2 job saves its chunk of each bucket (fp32 masters, per-element optimizer
state) together with the bucket layout (:mod:`.layout`): which parameter, by name, sits at which
offset of which bucket, and the bucket's padded size. That is enough to find any element of any
parameter in the saved shards, so a job with ``N'`` ranks or other bucket sizes can build each
rank's new chunks directly: for every parameter piece of its new chunk, copy the matching range
of the old flat bucket, which spans one or more old ranks' chunks. Shards are opened
memory-mapped (:func:`~shardspeed.checkpoint.reader.load_file`), so a rank reads the ranges it
needs, not every shard whole.

Stage 0 fits the same scheme as a one-rank job whose every parameter is a bucket of its own
(:func:`~shardspeed.checkpoint.layout.replicated_layout`), and a stage 0 run gathers shards
through that one-rank layout and reshapes the result (:func:`replicated_from_shard`). Every saved
form (stage 0's whole state, universal folders, DeepSpeed's own shards) is turned into shards of
this form by :mod:`.sources`.

Per-element optimizer state is every 1-D tensor of a bucket's state with the chunk's length
(Adam's ``exp_avg``/``exp_avg_sq``, Adagrad's sum, ...); anything else (``step``) is the same for
every bucket of a parameter group and is taken from the group's first saved bucket. Padding
elements of a new chunk start at zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.checkpoint.layout import BucketLayout, check_layout_version, chunk_ranges


@dataclass(frozen=True)
class _Source:
    """Where a parameter lives in the saved layout."""

    bucket: int
    offset: int


class Resharder:
    """Builds this rank's optimizer-wrapper state for ``layout`` from shards saved by ``count``
    ranks; ``load_shard(r)`` returns rank ``r``'s saved optimizer-wrapper state, and
    ``module_state`` is the checkpoint's module state_dict."""

    def __init__(
        self,
        load_shard: Callable[[int], dict[str, Any]],
        count: int,
        module_state: dict[str, torch.Tensor],
        reference: int = 0,
    ) -> None:
        self._load = load_shard
        self._loaded: dict[int, dict[str, Any]] = {}
        #: the shard read for what every shard holds alike (layout, groups, loss scale): the
        #: caller's own where it exists, so a rank loading its own layout reads only its shard
        #: (node-local storage keeps no other)
        self.reference = self.shard(reference)
        #: the saved module weights, for masters a shard leaves out (fp32: the weights are them)
        self.module_state = module_state
        old_layout = self.reference["strategy"].get("layout")
        if old_layout is None:
            raise ValueError(
                "the checkpoint's ZeRO shards carry no bucket layout (saved by an older "
                "shardspeed), so they can only be loaded with the data-parallel size and "
                f"zero_optimization settings they were saved with ({count} ranks)"
            )
        self.old_layout: list[BucketLayout] = old_layout
        self.old_world = count
        self.sources = {
            name: _Source(index, offset)
            for index, bucket in enumerate(self.old_layout)
            for name, offset, _ in bucket["params"]
        }

    def shard(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s saved state, read on first use (a layout version newer than this
        shardspeed reads is refused)."""
        if rank not in self._loaded:
            shard = self._load(rank)
            check_layout_version(shard["strategy"], f"the optimizer shard of rank {rank}")
            self._loaded[rank] = shard
        return self._loaded[rank]

    def state_for(
        self,
        layout: list[BucketLayout],
        world: int,
        rank: int,
        current_groups: Sequence[dict[str, Any]] = (),
    ) -> dict[str, Any]:
        """This rank's optimizer-wrapper state (``ZeroOptimizer.state_dict()`` form) under
        ``layout`` split across ``world`` ranks. Saved group settings win; a setting only
        ``current_groups`` (this run's optimizer) has is kept, so state saved by another
        optimizer class (torch's AdamW for shardspeed's, say) still steps."""
        self._check_params(layout)
        saved_optimizer = self.reference["optimizer"]
        # groups holding only parameters saved elsewhere (experts) are absent from the layout
        expected = len(current_groups) or 1 + max((b["group"] for b in layout), default=-1)
        if len(saved_optimizer["param_groups"]) != expected:
            raise ValueError(
                f"the checkpoint's optimizer has {len(saved_optimizer['param_groups'])} parameter "
                "groups and this run's a different number; build the optimizer with the same "
                "groups to load its state"
            )
        masters, states = [], {}
        for bucket in layout:
            chunk = bucket["size"] // world
            masters.append(self._chunk(bucket, chunk, rank, self._master_pieces, torch.float32))
            first = self._first_state(bucket["group"])
            if first is None:  # the optimizer had not stepped: no state to carry
                continue
            state = dict(self._scalars(bucket["group"]))
            for key in self._element_keys(bucket["group"]) or ():
                pieces = self._state_pieces(key)
                state[key] = self._chunk(bucket, chunk, rank, pieces, first[key].dtype)
            states[bucket["state_index"]] = state
        current = list(current_groups) or [{}] * len(saved_optimizer["param_groups"])
        groups = [
            {
                **{k: v for k, v in now.items() if k != "params"},
                **saved,
                "params": [b["state_index"] for b in layout if b["group"] == index],
            }
            for index, (saved, now) in enumerate(
                zip(saved_optimizer["param_groups"], current, strict=True)
            )
        ]
        strategy = dict(self.reference["strategy"])
        strategy.update(
            dp_world_size=world,
            chunk_numel=[b["size"] // world for b in layout],
            layout=layout,
            fp32_chunks=masters,
        )
        return {
            "optimizer": {"state": states, "param_groups": groups},
            "loss_scaler": self.reference["loss_scaler"],
            "strategy": strategy,
        }

    # -- reading the old shards -----------------------------------------------------------
    def _check_params(self, layout: list[BucketLayout]) -> None:
        names = {name for bucket in layout for name, _, _ in bucket["params"]}
        missing = sorted(names - set(self.sources))
        extra = sorted(set(self.sources) - names)
        if missing or extra:
            raise ValueError(
                "the checkpoint's ZeRO shards hold other trainable parameters than this model: "
                f"missing from the checkpoint {missing[:5]}, not in this model {extra[:5]}; "
                "load with load_optimizer_states=False to take the module weights only"
            )

    def _pieces(
        self, name: str, start: int, stop: int, read: Callable[[int, int], torch.Tensor]
    ) -> Iterator[torch.Tensor]:
        """Elements ``[start, stop)`` of parameter ``name``, in pieces, from the old chunks
        ``read(rank, bucket)`` (the range may span several ranks' chunks)."""
        source = self.sources[name]
        size = self.old_layout[source.bucket]["size"] // self.old_world
        # the range in the old flat bucket, over the old ranks' chunks
        for owner, part in chunk_ranges(source.offset + start, source.offset + stop, size):
            yield read(owner, source.bucket)[part]

    def _master_pieces(self, name: str, start: int, stop: int) -> Iterator[torch.Tensor]:
        bucket = self.sources[name].bucket
        if self.reference["strategy"]["fp32_chunks"][bucket] is None:
            # the saving run stepped its fp32 parameters themselves: the module weights
            yield self.module_state[name].reshape(-1)[start:stop]
        else:
            yield from self._pieces(
                name, start, stop, lambda r, b: self.shard(r)["strategy"]["fp32_chunks"][b]
            )

    def _state_pieces(self, key: str) -> Callable[[str, int, int], Iterator[torch.Tensor]]:
        def read(rank: int, bucket: int) -> torch.Tensor:
            index = self.old_layout[bucket]["state_index"]
            return self.shard(rank)["optimizer"]["state"][index][key]

        return lambda name, start, stop: self._pieces(name, start, stop, read)

    def _first_state(self, group: int) -> dict[str, Any] | None:
        """The saved state of ``group``'s first bucket on rank 0 (None if it never stepped)."""
        for bucket in self.old_layout:
            if bucket["group"] == group:
                return self.reference["optimizer"]["state"].get(bucket["state_index"])
        return None

    def _element_keys(self, group: int) -> list[str] | None:
        state = self._first_state(group)
        if state is None:
            return None
        bucket = next(b for b in self.old_layout if b["group"] == group)
        chunk = bucket["size"] // self.old_world
        return [
            k
            for k, v in state.items()
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == chunk
        ]

    def _scalars(self, group: int) -> dict[str, Any]:
        state = self._first_state(group) or {}
        keys = set(self._element_keys(group) or [])
        return {
            k: v.clone() if torch.is_tensor(v) else v for k, v in state.items() if k not in keys
        }

    @staticmethod
    def _chunk(
        bucket: BucketLayout,
        chunk: int,
        rank: int,
        pieces: Callable[[str, int, int], Iterator[torch.Tensor]],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """This rank's new chunk of ``bucket``: each parameter's overlap with it, filled from
        ``pieces(name, start, stop)``; padding stays zero."""
        lo, hi = chunk * rank, chunk * (rank + 1)
        out = torch.zeros(chunk, dtype=dtype)
        for name, offset, numel in bucket["params"]:
            start, stop = max(offset, lo), min(offset + numel, hi)
            position = start - lo
            for piece in pieces(name, start - offset, stop - offset) if start < stop else ():
                out[position : position + piece.numel()] = piece
                position += piece.numel()
        return out


def replicated_from_shard(
    state: dict[str, Any],
    layout: list[BucketLayout],
    shapes: dict[int, torch.Size],
    param_indices: list[list[int]],
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Turn :meth:`Resharder.state_for` output for a one-rank replicated ``layout`` into torch
    optimizer state for the tensors of ``shapes`` (by state index) and groups holding
    ``param_indices``; also returns the masters in layout order, shaped."""
    optimizer = state["optimizer"]
    per_index = {}
    for index, values in optimizer["state"].items():
        shape = shapes[index]
        per_index[index] = {
            k: v.view(shape)
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == shape.numel()
            else v
            for k, v in values.items()
        }
    groups = [
        {**group, "params": indices}
        for group, indices in zip(optimizer["param_groups"], param_indices, strict=True)
    ]
    masters = [
        chunk.view(shapes[bucket["state_index"]])
        for bucket, chunk in zip(layout, state["strategy"]["fp32_chunks"], strict=True)
    ]
    return {"state": per_index, "param_groups": groups}, masters
