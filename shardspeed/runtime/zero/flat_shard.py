"""Parameters kept as this rank's shard of one flat buffer, whole only while gathered (ZeRO-3).

A :class:`FlatShard` lays its parameters out flat at given offsets, padded to a multiple of the
world size ``N`` (a gradient bucket's layout, so the bucket's reduce-scatter hands each rank the
gradient of exactly its shard). Rank ``r`` keeps elements ``[r*S/N, (r+1)*S/N)`` in
:attr:`~FlatShard.shard`, a tensor of its own. The full buffer :attr:`~FlatShard.full` exists
only while gathered: each parameter's ``.data`` is a view of it, so a released parameter keeps
its shape (its storage has zero bytes).

Releasing frees the full buffer's memory in one of two ways:

* **in place** (the hooks' release between a module's forward and its backward): the buffer's
  storage shrinks to zero bytes, so the views autograd saved of the parameters during forward
  stay valid: gathering again before backward regrows the same storage and all-gathers into
  it. Writes into the buffer do not bump the parameters' autograd version counters
  (``param.data`` was rebound), so a re-gather between forward and backward is not an in-place
  modification autograd refuses. (PyTorch FSDP2 frees its unsharded parameters the same way.)
* **to a fresh storage** (every other release: ``GatheredParameters``, state dicts,
  ``zero.Init``): the parameters move to a new zero-byte storage and the old one is left to
  whoever else holds it (freed at once if nobody does). A tensor the caller kept of a gathered
  value (``param.detach()``; ``.cpu()`` returns it unchanged on a CPU device) keeps its values,
  as DeepSpeed's release (``param.data = torch.empty(0)``) leaves them.

With one rank there is nothing to shard: the shard is the full buffer and it is never released,
unless parameter offload swaps it (below).

Under ``offload_param`` (:meth:`FlatShard.offload`) the shard lives elsewhere between uses, as
the :class:`~.residency.Residency` it is given says: in host memory (``cpu``; a device copy is
made for the all-gather) or in a file through a :class:`~.state_swap.SwapStore` (``nvme``: read
back before the gather, and out of memory again as soon as the gather is done, written only if
it changed). The collectives are the comm group's (:class:`~.comm_group.CommGroup`).

ZeRO++ (the comm group's :attr:`~.comm_group.CommGroup.zeropp`):

* **qwZ** (``quantized_weights``): a *lossy* gather (the hooks' gathers and prefetches, see
  :meth:`FlatShard.gather`) sends this rank's shard as one int8 payload and dequantizes every
  rank's part, its own included, so all ranks compute with the same weights; the full buffer
  then holds dequantized values (:attr:`FlatShard.lossy`) and a gather asking for exact values
  (``GatheredParameters``, state dicts, checkpoints, the post-step refresh) gathers it again.
  The shard itself stays exact.
* **hpZ** (``secondary``, a group of k consecutive ranks): a release in place (the hooks')
  keeps a *secondary* shard, this rank's 1/k part of the full buffer (Ψ/k elements per rank
  for a model of Ψ, on top of the Ψ/N primary shard), and the next gather while it is valid
  all-gathers those over the k ranks only: an exact copy of whatever the full buffer held
  (with qwZ the dequantized values, sent unquantized inside the node). It is dropped whenever
  the primary shard changes (:meth:`FlatShard.invalidate_secondary`: the optimizer step,
  :meth:`~FlatShard.set_shard`, :meth:`~FlatShard.keep_full_values`).
* ``quantized_nontrainable_weights``: frozen parameters' shards are stored as int8 payloads
  (:class:`~.quantized_shard.QuantizedFlatShard`, made by :func:`pack_flat_shards`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardspeed.runtime.comm.quantize import INT8, QuantSpec
from shardspeed.runtime.zero.comm_group import CommGroup
from shardspeed.runtime.zero.residency import ON_DEVICE, Residency


class FlatShard:
    """``params`` at ``offsets`` of a flat buffer of ``size`` elements (a multiple of the
    group's world size), kept as this rank's shard."""

    @torch.no_grad()
    def __init__(
        self,
        params: Sequence[nn.Parameter],
        offsets: Sequence[int],
        size: int,
        comm_group: CommGroup,
    ) -> None:
        assert size % comm_group.world_size == 0, "the flat size must be padded to the world"
        first = params[0]
        self.params = list(params)
        self.offsets = list(offsets)
        #: each parameter's shape (a parameter is briefly empty while its storage is replaced)
        self.shapes = [param.shape for param in params]
        self.comm = comm_group
        self.chunk_numel = size // comm_group.world_size
        #: the whole buffer; its storage has zero bytes while released
        self.full = torch.zeros(size, dtype=first.dtype, device=first.device)
        for param, view in zip(self.params, self._views(), strict=True):
            view.copy_(param.detach())
        self._bind_views()  # the old storages are freed here (unless someone holds them)
        self._nbytes = self.full.untyped_storage().nbytes()
        #: this rank's chunk, the only part kept between uses
        self.shard = self.full[self.chunk_slice].clone() if comm_group.partitioned else self.full
        self.gathered = True
        #: where the shard lives between uses (``offload_param``)
        self.residency: Residency = ON_DEVICE
        #: qwZ: the full buffer holds dequantized values (an exact gather must redo it)
        self.lossy = False
        #: hpZ: this rank's part of the full buffer within its secondary group (None: invalid)
        self.secondary: torch.Tensor | None = None
        #: hpZ: the secondary shard was cut from dequantized values
        self.secondary_lossy = False

    @torch.no_grad()
    def offload(self, residency: Residency) -> None:
        """Keep the shard where ``residency`` says between uses (once; later calls keep the
        first). With one rank the shard is the full buffer: it stays where the buffer is, and
        a swapped one goes out when released."""
        if self.residency is not ON_DEVICE:
            return
        if self._secondary_group() is not None:
            raise NotImplementedError(
                "zero_optimization.zero_hpz_partition_size (hpZ) with "
                "zero_optimization.offload_param is not supported in shardspeed; set "
                "zero_hpz_partition_size to 1 or remove offload_param"
            )
        self.residency = residency
        self.shard = residency.adopt(self.shard, movable=self.comm.partitioned)
        if not self.comm.partitioned and self.gathered:
            residency.pin(True)  # in use now: written out when released
            residency.changed()
        else:
            residency.evict(self.shard)

    @torch.no_grad()
    def set_shard(self, values: torch.Tensor) -> None:
        """Write this rank's shard (e.g. the optimizer's updated fp32 master, cast), wherever
        it lives."""
        self.invalidate_secondary()
        self.residency.fetch(self.shard)
        self._write_shard(values)
        self.residency.changed()
        if self.comm.partitioned or not self.gathered:
            self.residency.evict(self.shard)

    def shard_out(self) -> None:
        """The gather is done: the shard leaves memory again (parameter offload)."""
        if self.comm.partitioned:
            self.residency.evict(self.shard)

    def _source(self) -> torch.Tensor:
        """The shard on the full buffer's device (a copy when it lives in host memory)."""
        return self.residency.source(self.shard, self.full.device)

    @property
    def chunk_slice(self) -> slice:
        """Where this rank's shard sits in the flat layout."""
        return slice(self.chunk_numel * self.comm.rank, self.chunk_numel * (self.comm.rank + 1))

    def gather(self, lossy: bool = False) -> Any:
        """Regrow the full buffer and start all-gathering the shards into it; returns the
        collective's work handle (None if there is nothing to wait for).

        ``lossy``: the hooks' gathers, which qwZ may quantize and hpZ may serve from the
        secondary shards; otherwise (exact) a buffer holding dequantized values is gathered
        again."""
        if self.gathered:
            return None if lossy or not self.lossy else self.refresh()
        if self.residency.swapped and self.comm.partitioned:
            # start reading the shard back (the swapper's threads) and gather when waited for:
            # a prefetched unit's read overlaps the running module's compute
            reads = self.residency.start_fetch(self.shard)
            self.full.untyped_storage().resize_(self._nbytes)
            self.gathered = True
            return _ReadThenGather(self, reads, lossy)
        self.residency.fetch(self.shard)
        self.gathered = True
        if not self.comm.partitioned:  # the shard is the full buffer: swapped in, in use
            self.residency.pin(True)
            return None
        self.full.untyped_storage().resize_(self._nbytes)
        return self._all_gather(lossy, async_op=True)

    def _all_gather(self, lossy: bool, async_op: bool) -> Any:
        """All-gather the full buffer: from the secondary shards over the secondary group
        when they are valid (and exact, unless ``lossy``), else from the primary shards."""
        secondary = self._secondary_group()
        if secondary is not None and self.secondary is not None:
            if lossy or not self.secondary_lossy:
                self.lossy = self.secondary_lossy
                return secondary.all_gather(self.full, self.secondary, async_op=async_op)
        return self._gather_primary(lossy, async_op)

    def _gather_primary(self, lossy: bool, async_op: bool) -> Any:
        """All-gather the primary shards over the group (qwZ: int8 payloads when ``lossy``)."""
        spec = self._weight_spec(lossy)
        self.lossy = spec is not None
        return self.comm.all_gather(self.full, self._source(), async_op=async_op, spec=spec)

    def _weight_spec(self, lossy: bool) -> QuantSpec | None:
        """The format a gather sends the shards in (None: as they are)."""
        zeropp = self.comm.zeropp
        quantized = zeropp is not None and zeropp.quantized_weights
        # integer, bool or complex parameters travel as they are: int8 codes would change them
        return INT8 if lossy and quantized and self.full.is_floating_point() else None

    def _secondary_group(self) -> CommGroup | None:
        """hpZ's group of consecutive ranks (None: hpZ is off)."""
        zeropp = self.comm.zeropp
        return zeropp.secondary if zeropp is not None else None

    def invalidate_secondary(self) -> None:
        """The primary shard changed: the secondary shard (hpZ) no longer matches it."""
        self.secondary = None

    def _keep_secondary(self) -> None:
        """hpZ: keep this rank's part of the (gathered) full buffer within its secondary
        group, unless a valid one is kept already."""
        group = self._secondary_group()
        if group is None or self.secondary is not None:
            return
        piece = self.full.numel() // group.world_size
        self.secondary = self.full[piece * group.rank : piece * (group.rank + 1)].clone()
        self.secondary_lossy = self.lossy

    def refresh(self) -> Any:
        """All-gather the (updated) shards, exactly, into a full buffer that is gathered
        already (waited for here when the shard is swapped)."""
        if not self.gathered or not self.comm.partitioned:
            return None
        self.residency.fetch(self.shard)
        work = self._all_gather(lossy=False, async_op=True)
        if not self.residency.swapped:
            return work
        work.wait()
        self.shard_out()
        return None

    @torch.no_grad()
    def release(self, in_place: bool = False) -> None:
        """Free the full buffer's memory (with one rank only when the shard is swapped).

        ``in_place``: shrink the buffer's storage (the hooks, between a forward and its
        backward); otherwise move the parameters to a fresh storage first, leaving the current
        one to any tensor that still holds it (see the module docstring)."""
        if not self.gathered:
            return
        if self.comm.partitioned:
            if in_place:  # the hooks' release: the backward gathers the unit again soon
                self._keep_secondary()
            else:
                self._fresh_storage(keep_values=False)
            self.full.untyped_storage().resize_(0)
            self.gathered = False
        elif self.residency.swapped:
            if not in_place:  # the shard is the full buffer: its values go to the store
                self._fresh_storage(keep_values=True)
            self.residency.pin(False)
            self.residency.evict(self.shard)
            self.gathered = False

    def _views(self) -> list[torch.Tensor]:
        """Each parameter's view of the full buffer."""
        return [
            self.full[offset : offset + shape.numel()].view(shape)
            for shape, offset in zip(self.shapes, self.offsets, strict=True)
        ]

    def _bind_views(self, which: Sequence[bool] | None = None) -> None:
        """Make the parameters (those ``which`` marks, default all) views of the buffer."""
        for index, (param, view) in enumerate(zip(self.params, self._views(), strict=True)):
            if which is None or which[index]:
                param.data = view

    def _fresh_storage(self, keep_values: bool) -> None:
        """Point the full buffer and the parameters' views at a storage nobody else holds; the
        current one stays with whoever still references it (freed now if nobody does).
        Parameters that moved to another buffer since (``zero.Init``'s construction-time
        shards, taken over by the engine's) are left where they are."""
        current = self.full.untyped_storage().data_ptr()
        owned = [param.untyped_storage().data_ptr() == current for param in self.params]
        if keep_values:
            # the full buffer is the shard, which the store and the optimizer know by identity:
            # the same tensor object gets a copy of the storage
            copy = self.full.clone()
            self.full.set_(copy.untyped_storage(), 0, copy.shape, copy.stride())
        else:
            placeholder = self.full.new_empty(0)
            numel = self.full.numel()
            for param, mine in zip(self.params, owned, strict=True):
                if mine:  # let go of the current storage before allocating
                    param.data = placeholder
            self.full = placeholder
            # allocated here and shrunk by the caller: views need a storage of their size
            self.full = torch.empty(numel, dtype=placeholder.dtype, device=placeholder.device)
        self._bind_views(owned)

    def holds(self, param: torch.Tensor) -> bool:
        return any(p is param for p in self.params)

    def piece_of(self, param: torch.Tensor) -> torch.Tensor:
        """The part of this rank's shard that holds elements of ``param`` (1-D, maybe empty)."""
        return self.shard[self._piece_slice(param)]

    def _piece_slice(self, param: torch.Tensor) -> slice:
        """Where ``param``'s elements sit in this rank's chunk (empty if none do)."""
        index = next(i for i, p in enumerate(self.params) if p is param)
        start, stop = self.offsets[index], self.offsets[index] + param.numel()
        own = self.chunk_slice
        lo, hi = max(start, own.start), min(stop, own.stop)
        return slice(lo - own.start, hi - own.start) if lo < hi else slice(0, 0)

    @torch.no_grad()
    def keep_full_values(self) -> None:
        """Make the shard follow the (gathered) full buffer, after its values were written
        there, e.g. by ``load_state_dict``."""
        assert self.gathered, "only a gathered buffer holds full values"
        self.invalidate_secondary()
        if self.comm.partitioned:
            self.residency.fetch(self.shard)
            self._take_full()
        self.lossy = False
        if self.residency.swapped:
            self.residency.changed()
            self.shard_out()

    def _write_shard(self, values: torch.Tensor) -> None:
        """Store ``values`` (this rank's part of the flat layout) as the shard."""
        self.shard.copy_(values)

    def _take_full(self) -> None:
        """Store this rank's part of the full buffer as the shard."""
        self.shard.copy_(self.full[self.chunk_slice])


def pack_flat_shards(params: Sequence[nn.Parameter], comm_group: CommGroup) -> list[FlatShard]:
    """``params`` packed one after another in one flat buffer per dtype, each padded to a
    multiple of the world size. With ZeRO++'s ``quantized_nontrainable_weights`` (over more
    than one rank), frozen floating parameters (``requires_grad=False``) go to buffers of
    their own whose shards are stored quantized
    (:class:`~.quantized_shard.QuantizedFlatShard`)."""
    from shardspeed.runtime.zero.quantized_shard import QuantizedFlatShard

    zeropp = comm_group.zeropp
    split = zeropp is not None and zeropp.quantized_nontrainable_weights
    split = split and comm_group.partitioned
    by_kind: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
    for param in params:
        frozen = split and not param.requires_grad and param.is_floating_point()
        by_kind.setdefault((param.dtype, frozen), []).append(param)
    flats = []
    world = comm_group.world_size
    for (_, frozen), group in by_kind.items():
        offsets, total = [], 0
        for param in group:
            offsets.append(total)
            total += param.numel()
        kind = QuantizedFlatShard if frozen else FlatShard
        # frozen int8 shards: whole quantization blocks per rank, so a block covers the same
        # elements at any world size and a checkpoint reloaded elsewhere re-quantizes to the
        # same codes
        pad = world * INT8.block if frozen else world
        flats.append(kind(group, offsets, -(-total // pad) * pad, comm_group))
    return flats


class _ReadThenGather:
    """The work of gathering a swapped shard: its read is in flight; :meth:`wait` finishes it,
    then all-gathers (every rank waits for its units in the same order)."""

    def __init__(self, flat: FlatShard, reads: Sequence[Any], lossy: bool) -> None:
        self.flat, self.reads, self.lossy = flat, reads, lossy

    def wait(self) -> None:
        for read in self.reads:
            read.wait()
        self.flat._all_gather(self.lossy, async_op=False)
