"""Column- and row-parallel linears and a vocabulary-parallel embedding for training, cut from
whole modules.

A column-parallel linear keeps this rank's rows of the weight (output features) and of the
bias; its input is used whole by every rank, its output is this rank's features (or, with
``gather_output``, all of them). A row-parallel linear keeps this rank's columns of the weight
(input features); each rank's product is a partial sum, added over the group, and the bias
(kept whole on every rank) is added once after the sum. The usual pair, column then row, costs
one all-reduce forward (after the row linear) and one backward (into the column linear's input).
A vocabulary-parallel embedding keeps this rank's rows of the table, looks up the tokens it
holds (zeros for the others) and adds the rows over the group.

The modules adopt the whole module's own ``nn.Parameter`` objects, their data replaced by this
rank's piece: an optimizer or parameter list made before the split still names them. Split
parameters are marked ``tensor_model_parallel = True`` (Megatron's mark, which the gradient norm
reads: each rank's piece counts; unmarked parameters, such as a row-parallel bias, count on
tensor-parallel rank 0 only) and carry their :class:`SplitLayout` as ``tp_layout`` (what
gathering them whole, for a 16-bit save or a checkpoint at another size, reads). By default a
split is near-equal multiples of ``grain`` (the first ranks take the rest), so widths need not
divide by the group's size; a layout may also give each rank explicit ranges (attention heads,
packed sub-parameters) and give several ranks the same range (key/value heads shared by more
ranks than there are heads): their gradients are then summed over those ranks
(``replicas``) and the piece counts once, on the first of them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from shardspeed.comm.group_caches import register_group_cache
from shardspeed.runtime.tensor_parallel.collectives import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    split_to_tensor_parallel,
)
from shardspeed.runtime.tensor_parallel.partition import Slice, SplitLayout, split_range
from shardspeed.runtime.zero.comm_group import CommGroup

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "even_layout",
    "PieceSource",
    "SHARED_COPIES",
    "SharedCopies",
    "own_piece",
    "sum_gradient_over",
    "split_widths",
    "tp_layout_of",
]


def split_widths(total: int, group: CommGroup, grain: int = 1) -> tuple[int, ...]:
    """Every rank's share of ``total`` features, in rank order."""
    if total < group.world_size:
        raise ValueError(
            f"{total} features cannot be split over {group.world_size} tensor-parallel ranks "
            "(each needs at least one); use a smaller tensor-parallel size"
        )
    ranges = [split_range(total, group.world_size, r, grain) for r in range(group.world_size)]
    return tuple(stop - start for start, stop in ranges)


def even_layout(shape: Sequence[int], dim: int, group: CommGroup, grain: int = 1) -> SplitLayout:
    """``shape`` split along ``dim`` in near-equal contiguous pieces (multiples of ``grain``)."""
    widths = split_widths(shape[dim], group, grain)
    starts = [sum(widths[:r]) for r in range(len(widths))]
    pieces = tuple(Slice(dim, ((s, s + w),)) for s, w in zip(starts, widths, strict=True))
    return SplitLayout(tuple(shape), pieces)


def sum_gradient_over(param: nn.Parameter, replicas: CommGroup | None) -> None:
    """Sum ``param``'s gradient over ``replicas`` (ranks holding the same piece, each of whose
    gradient has only its own heads' share) as autograd produces it."""
    if replicas is None or not replicas.partitioned:
        return

    def _sum(grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        replicas.all_reduce(out)
        return out

    param.register_hook(_sum)


#: ``(whole tensor, layout, rank) -> this rank's piece``: where a split takes its piece from
#: (default: this rank's own whole tensor; AutoTP passes one that receives rank 0's)
PieceSource = Callable[[torch.Tensor, SplitLayout, int], torch.Tensor]


def own_piece(whole: torch.Tensor, layout: SplitLayout, rank: int) -> torch.Tensor:
    """This rank's piece of its own whole tensor (a copy)."""
    return layout.take(whole, rank).contiguous().clone()


def _adopt(
    param: torch.Tensor, layout: SplitLayout, rank: int, source: PieceSource = own_piece
) -> nn.Parameter:
    """``param`` (whole, or already split by this layout: a tied weight) as this rank's piece."""
    if not isinstance(param, nn.Parameter):
        raise TypeError(f"AutoTP splits parameters; got a {type(param).__name__}")
    if getattr(param, "tp_layout", None) == layout:
        return param
    with torch.no_grad():
        param.data = source(param.data, layout, rank)
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.tp_layout = layout  # type: ignore[attr-defined]
    replicas = next(s for s in layout.replica_sets() if rank in s)
    param.tp_duplicate = replicas[0] != rank  # type: ignore[attr-defined]
    return param


def tp_layout_of(param: torch.Tensor) -> SplitLayout | None:
    """The split AutoTP made of ``param`` (None: held whole)."""
    layout = getattr(param, "tp_layout", None)
    return layout if isinstance(layout, SplitLayout) else None


def _transposed(layout: SplitLayout) -> SplitLayout:
    shape = tuple(reversed(layout.full_shape))
    return SplitLayout(shape, tuple(p.on_dim(1 - p.dim) for p in layout.pieces))


def _bias_layout(layout: SplitLayout) -> SplitLayout:
    return SplitLayout((layout.full_shape[0],), tuple(p.on_dim(0) for p in layout.pieces))


def _contiguous(layout: SplitLayout) -> bool:
    """Each rank one range, in rank order, together the whole dimension."""
    end = 0
    for piece in layout.pieces:
        if len(piece.pieces) != 1 or piece.pieces[0][0] != end:
            return False
        end = piece.pieces[0][1]
    return end == layout.full_shape[layout.dim]


class SharedCopies:
    """Column-parallel linears fed the same input (q, k and v; gate and up) share one copy of
    it into the tensor-parallel region, so autograd adds their input gradients before the one
    all-reduce instead of all-reducing each (3 + 2 per layer to 1 + 1).

    Sharing is on only inside a model's forward (``begin`` / ``end``, hooks on the root module
    that AutoTP installs): the copies are dropped when it returns, so none outlives its step
    (a copy is a view that keeps its input alive). Outside it (activation-checkpoint
    recomputation, a layer called on its own) every linear makes its own copy: the same
    gradients, one all-reduce each."""

    def __init__(self) -> None:
        self.active = False
        #: id(input) -> (the input, weakly; its copy; the group)
        self.entries: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, CommGroup]] = {}

    def begin(self) -> None:
        self.entries.clear()
        self.active = True

    def end(self) -> None:
        self.entries.clear()
        self.active = False

    def copy(self, x: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """``x`` entering ``group``'s region: the copy made for it earlier in this forward."""
        if not self.active or not x.requires_grad or not group.partitioned:
            return copy_to_tensor_parallel(x, group)
        entry = self.entries.get(id(x))
        if entry is not None and entry[0]() is x and entry[2] == group:
            return entry[1]
        copied = copy_to_tensor_parallel(x, group)
        self.entries[id(x)] = (weakref.ref(x), copied, group)
        return copied


#: the process's shared copies (one forward runs at a time); a forward that raised leaves its
#: entries (and their groups) behind until the next, or until the groups are destroyed
SHARED_COPIES = SharedCopies()
register_group_cache(SHARED_COPIES.end)


class _OverlappedColumnLinear(torch.autograd.Function):
    """``x W^T + b`` whose backward starts the all-reduce of the input gradient, computes the
    weight gradient while it runs, then waits (``tensor_parallel.tp_overlap_comm``)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: CommGroup,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        # (under autocast the saved tensors and the gradient may differ in dtype)
        grad_x = (grad @ weight.to(grad.dtype)).to(x.dtype).contiguous()
        work = ctx.group.all_reduce(grad_x, async_op=True)
        rows = grad.reshape(-1, grad.shape[-1])
        grad_w = (rows.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        grad_b = rows.sum(0) if ctx.has_bias else None
        work.wait()
        return grad_x, grad_w, grad_b, None


class _SplitLinear(nn.Module):
    """A linear whose weight is split along ``split_dim`` (0: output rows, 1: input columns)
    over ``group``; this rank keeps its piece."""

    split_dim: ClassVar[int]

    def __init__(
        self,
        linear: nn.Module,
        group: CommGroup,
        layout: SplitLayout | None,
        grain: int,
        replicas: CommGroup | None,
        source: PieceSource = own_piece,
    ) -> None:
        super().__init__()
        self.group = group
        weight = linear.weight
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2:
            raise TypeError(f"{type(linear).__name__} has no 2-d weight parameter to split")
        # Hugging Face's Conv1D keeps its weight (in, out): split and stored that way, so its
        # state-dict shapes stay the model's own
        self.transposed = type(linear).__name__ == "Conv1D" and hasattr(linear, "nf")
        existing = tp_layout_of(weight)  # a tied weight another module split already
        shape = existing.full_shape if existing is not None else tuple(weight.shape)
        out, inp = shape[::-1] if self.transposed else shape
        self.in_features, self.out_features = int(inp), int(out)
        whole = (self.out_features, self.in_features)
        if layout is None:
            layout = even_layout(whole, self.split_dim, group, grain)
        if layout.full_shape != whole or layout.dim != self.split_dim:
            raise ValueError(
                f"a split of shape {layout.full_shape} along dim {layout.dim} does not fit a "
                f"linear of weight shape {whole} split along dim {self.split_dim}"
            )
        if len(layout.pieces) != group.world_size:
            raise ValueError(
                f"a split into {len(layout.pieces)} pieces for {group.world_size} ranks"
            )
        #: the split in ``nn.Linear``'s (out, in) layout; the stored weight's is ``tp_layout``
        self.layout = layout
        self.widths = tuple(piece.size for piece in layout.pieces)
        stored = _transposed(layout) if self.transposed else layout
        self.weight = _adopt(weight, stored, group.rank, source)
        sum_gradient_over(self.weight, replicas)
        self.bias: nn.Parameter | None = None

    def _linear_weight(self) -> torch.Tensor:
        return self.weight.t() if self.transposed else self.weight

    def _piece_repr(self) -> str:
        return f"this rank: {self.widths[self.group.rank]} of {self.group.world_size} pieces"


class ColumnParallelLinear(_SplitLinear):
    """``y = x W_r^T + b_r`` for this rank's output features ``r`` (see the module docs)."""

    split_dim = 0

    def __init__(
        self,
        linear: nn.Module,
        group: CommGroup,
        *,
        gather_output: bool = False,
        grain: int = 1,
        layout: SplitLayout | None = None,
        replicas: CommGroup | None = None,
        overlap_comm: bool = False,
        source: PieceSource = own_piece,
    ) -> None:
        super().__init__(linear, group, layout, grain, replicas, source)
        #: all-reduce the input gradient while computing the weight gradient (one all-reduce
        #: per linear) instead of one shared all-reduce per input (``tp_overlap_comm``)
        self.overlap_comm = overlap_comm
        if gather_output and not _contiguous(self.layout):
            raise ValueError(
                "gather_output needs each rank to hold one contiguous range of the output "
                "features in rank order; this split gives some ranks several ranges or the same one"
            )
        self.gather_output = gather_output
        if isinstance(linear.bias, torch.Tensor):
            self.bias = _adopt(linear.bias, _bias_layout(self.layout), group.rank, source)
            sum_gradient_over(self.bias, replicas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap_comm and self.group.partitioned and torch.is_grad_enabled():
            y: torch.Tensor = _OverlappedColumnLinear.apply(
                x, self._linear_weight(), self.bias, self.group
            )
        else:
            y = nn.functional.linear(
                SHARED_COPIES.copy(x, self.group), self._linear_weight(), self.bias
            )
        if self.gather_output:
            y = gather_from_tensor_parallel(y, self.group, self.widths)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self._piece_repr()}), gather_output={self.gather_output}"
        )


class RowParallelLinear(_SplitLinear):
    """``y = sum_r x_r W_r^T + b`` over the ranks' input features ``r`` (see the module docs).

    ``input_is_parallel``: the input is already this rank's features (a column-parallel
    linear's output); otherwise the whole input is given and this rank takes its piece."""

    split_dim = 1

    def __init__(
        self,
        linear: nn.Module,
        group: CommGroup,
        *,
        input_is_parallel: bool = True,
        grain: int = 1,
        layout: SplitLayout | None = None,
        source: PieceSource = own_piece,
    ) -> None:
        super().__init__(linear, group, layout, grain, None, source)
        if not input_is_parallel and not _contiguous(self.layout):
            raise ValueError(
                "a row-parallel linear taking the whole input needs contiguous input ranges "
                "in rank order"
            )
        self.input_is_parallel = input_is_parallel
        bias = linear.bias
        if isinstance(bias, nn.Parameter):
            bias.tensor_model_parallel = False  # type: ignore[attr-defined]
            self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_tensor_parallel(x, self.group, self.widths)
        y = reduce_from_tensor_parallel(nn.functional.linear(x, self._linear_weight()), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self._piece_repr()}), "
            f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows (tokens) over ``group``: each rank looks up the tokens
    in its range, zeros for the others, and the rows are added over the group (one all-reduce
    forward; each rank's gradient is its rows')."""

    def __init__(
        self,
        embedding: nn.Embedding,
        group: CommGroup,
        grain: int = 1,
        source: PieceSource = own_piece,
    ) -> None:
        super().__init__()
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError(
                "a vocabulary-parallel embedding does not support max_norm or sparse=True; "
                "keep this embedding replicated (a partition_config spec with "
                "partition_type 'skip')"
            )
        self.group = group
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.layout = even_layout(tuple(embedding.weight.shape), 0, group, grain)
        self.weight = _adopt(embedding.weight, self.layout, group.rank, source)
        ((self.start, self.stop),) = self.layout.pieces[group.rank].pieces
        pad = embedding.padding_idx
        self.padding_idx = (
            pad - self.start if pad is not None and self.start <= pad < self.stop else None
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = nn.functional.embedding(local, self.weight, self.padding_idx)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(rows, self.group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (this rank: rows "
            f"{self.start}..{self.stop} of {self.group.world_size} pieces)"
        )
