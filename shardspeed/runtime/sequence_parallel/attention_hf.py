"""DeepSpeed's ``UlyssesSPAttentionHF``: sequence-parallel attention for Hugging Face models.

Every rank of the sequence-parallel group runs the whole model on its contiguous slice of the
sequence; only attention needs the other slices. Registered in Transformers' attention
interface as ``"ulysses"``, the wrapper receives this rank's ``[batch, heads, slice, head_dim]``
query, key and value, trades the sequence for heads with an all-to-all (each rank then holds
the whole sequence for ``heads / sp`` heads), runs the core attention (``sdpa`` or ``eager``)
with the whole sequence's ``position_ids``, and trades back.

When the heads do not split over ``sp`` (see :mod:`.heads_layout`), the all-to-all spans
``u`` consecutive ranks and exact ring attention (:mod:`.ring`) joins the ``r = sp / u``
blocks, so any ``sp`` works.

Masks: like DeepSpeed, the model's (slice-sized) ``attention_mask`` is dropped and causality
comes from the positions: ``sdpa`` uses its causal flag; ``eager`` gets an additive mask built
from the gathered ``position_ids``, which also keeps packed documents (positions restarting)
apart. Packed sequences with ``sdpa`` are refused, as DeepSpeed does (a dense mask of the
whole sequence is what sequence parallelism exists to avoid), and so are they in ring mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from shardspeed import comm
from shardspeed.runtime.sequence_parallel import parallel_state_sp
from shardspeed.runtime.sequence_parallel.heads_layout import HeadsLayout, plan_heads_layout
from shardspeed.runtime.sequence_parallel.ring import RingGroup, ring_attention
from shardspeed.sequence.layer import sequence_all_to_all
from shardspeed.utils.logging import log_dist

__all__ = ["SequenceParallelInputError", "UlyssesSPAttentionHF", "eager_core_attention"]

#: the name the wrapper is registered under in Transformers' AttentionInterface
ATTN_IMPLEMENTATION = "ulysses"
SUPPORTED_CORES = ("sdpa", "eager")

_logged_layouts: set[HeadsLayout] = set()


class SequenceParallelInputError(ValueError, AssertionError):
    """Attention inputs that sequence parallelism cannot take (DeepSpeed asserts)."""


def _eager_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Transformers' eager attention, for modules whose modeling file has none."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def eager_core_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *args: Any,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """The ``eager`` core: the ``eager_attention_forward`` of the module's own modeling file
    (Transformers keeps no global eager entry), else the standard one."""
    core = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    result: tuple[Tensor, Tensor | None] = (core or _eager_attention)(
        module, query, key, value, attention_mask, *args, **kwargs
    )
    return result


def _positions_2d(position_ids: Tensor) -> Tensor:
    return position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids


def _document_ids(positions: Tensor) -> Tensor:
    """Per token, the index of its document in its row: a new one starts wherever the
    position does not go up by exactly one (DeepSpeed's rule for packed sequences)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    return starts.long().cumsum(dim=-1)


def _document_causal_mask(positions: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive ``[rows, 1, L, L]`` mask: a token sees the earlier tokens of its document."""
    docs = _document_ids(positions)
    length = positions.shape[-1]
    earlier = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    allowed = (docs.unsqueeze(-1) == docs.unsqueeze(-2)) & earlier
    mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min).unsqueeze(1)


class UlyssesSPAttentionHF(nn.Module):
    """Sequence-parallel attention around a Transformers core attention function.

    DeepSpeed's arguments: ``attn`` (the core, e.g. ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` or
    :func:`eager_core_attention`), the micro ``batch_size``, the model's head counts and
    ``attn_head_size``, ``num_hidden_layers``, the sequence-parallel ``process_group``, and the
    sequence lengths when they are fixed. ``disable_in_eval`` runs the core on the local slice
    when the module is in eval mode.
    """

    def __init__(
        self,
        attn: Callable[..., Any],
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        if not seq_length_is_variable and local_seq_length is None:
            raise ValueError(
                "local_seq_length is required when seq_length_is_variable=False; pass it or set "
                "seq_length_is_variable=True"
            )
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        #: "sdpa" or "eager" (set by register_with_transformers; inferred from ``attn`` here)
        self.core_attn_implementation: str | None = (
            "eager" if attn is eager_core_attention else None
        )

        self.layout = plan_heads_layout(attn_head_count, kv_head_count, self.world_size)
        self.local_q_head_count = self.layout.local_q_heads
        self.local_kv_head_count = self.layout.local_kv_heads
        self.kv_replication_factor = self.layout.kv_replication
        self.ulysses_group, self.ring = self._subgroups(process_group)
        if self.layout not in _logged_layouts:
            _logged_layouts.add(self.layout)
            log_dist(self.layout.describe(), ranks=[0])
        # position_ids are the same tensor for every layer of one forward: gather them once.
        # The tensor itself is kept (not its id, which a new tensor could reuse on one rank
        # and not another, and that rank would skip the gather its peers wait in).
        self._positions_source: tuple[Tensor, int] | None = None
        self._positions: tuple[Tensor, bool] | None = None

    def _subgroups(self, process_group: Any) -> tuple[Any, RingGroup | None]:
        """(Ulysses all-to-all group, ring) for this layout."""
        layout = self.layout
        if layout.ring == 1:
            return process_group, None
        if layout.ulysses == 1:
            return None, RingGroup(process_group)
        topology = parallel_state_sp.parallel_topology
        mine = sorted(comm.get_all_ranks_from_group(process_group))
        if topology is None or topology.ranks("sp") != mine:
            raise ValueError(
                f"{layout.q_heads} query / {layout.kv_heads} key-value heads over "
                f"{layout.sp} ranks need a Ulysses x ring split, whose subgroups come from the "
                "sequence-parallel topology: call parallel_state_sp."
                "initialize_sequence_parallel(sp) and pass its get_sequence_parallel_group() "
                "as process_group"
            )
        ulysses, ring = topology.sequence_subgroups(layout.ulysses)
        return ulysses, RingGroup(ring)

    # ------------------------------------------------------------------ inputs
    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        want_q = (self.attn_head_count, self.attn_head_size)
        want_kv = (self.global_kv_head_count, self.attn_head_size)
        bad = query.dim() != 4 or key.shape != value.shape or key.dim() != 4
        if (
            bad
            or (query.shape[1], query.shape[3]) != want_q
            or (key.shape[1], key.shape[3]) != want_kv
        ):
            raise SequenceParallelInputError(
                f"[{comm.get_rank()}]: query/key/value must be [batch, heads, seq, head_dim] "
                f"with {want_q[0]} query and {want_kv[0]} key/value heads of size {want_q[1]}; "
                f"got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)}"
            )
        if query.shape[2] != key.shape[2]:
            raise SequenceParallelInputError(
                f"query ({query.shape[2]}) and key ({key.shape[2]}) slices differ in length: "
                "sequence parallelism does not take a key/value cache"
            )
        if not self.seq_length_is_variable and query.shape[2] != self.local_seq_length:
            raise SequenceParallelInputError(
                f"[{comm.get_rank()}]: this rank's sequence slice has {query.shape[2]} tokens, "
                f"expected local_seq_length={self.local_seq_length} (seq_length_is_variable="
                "False); pass seq_length_is_variable=True for batches of varying length"
            )

    def _full_positions(self, position_ids: Tensor) -> tuple[Tensor, bool]:
        """The whole sequence's ``position_ids`` and whether it holds packed documents."""
        source = self._positions_source
        same = (
            source is not None and source[0] is position_ids and source[1] == position_ids._version
        )
        if not same or self._positions is None:
            local = _positions_2d(position_ids).contiguous()
            shards = [torch.empty_like(local) for _ in range(self.world_size)]
            comm.all_gather(shards, local, group=self.process_group)
            full = torch.cat(shards, dim=-1)
            packed = bool((_document_ids(full)[:, -1] > 1).any())
            self._positions_source = (position_ids, position_ids._version)
            self._positions = (full, packed)
        return self._positions

    def _check_packed_supported(self) -> None:
        """Packed documents are kept apart only by the eager core's mask (Ulysses mode)."""
        if self.layout.ring == 1 and self.core_attn_implementation == "eager":
            return
        if self.layout.ring > 1:
            where = "ring attention"
        else:
            where = f"the {self.core_attn_implementation or 'given'} core"
        raise RuntimeError(
            f"packed sequences (position_ids restarting inside a row) are not supported with "
            f"{where}: it would need a dense document mask of the whole sequence. Use the eager "
            "core with a head count sequence_parallel_size divides, or unpacked rows"
        )

    def _core(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        positions: Tensor | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[Tensor, Tensor | None]:
        """The core attention on whole (sub)sequences; eager gets its causal mask here."""
        mask = None
        if (
            self.core_attn_implementation == "eager"
            and positions is not None
            and getattr(module, "is_causal", True)
        ):
            mask = _document_causal_mask(_positions_2d(positions), query.dtype)
        result: tuple[Tensor, Tensor | None] = self.attn(
            module, query, key, value, mask, *args, **kwargs
        )
        return result

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of this rank's sequence slice (HF layout ``[batch, heads, slice,
        head_dim]``) over the whole sequence; returns ``([batch, slice, heads * head_dim],
        attention weights or None)``."""
        if self.disable_in_eval and not module.training:
            return self._core(module, query, key, value, kwargs.get("position_ids"), args, kwargs)
        if kwargs.get("position_ids") is None:
            raise SequenceParallelInputError(
                "Ulysses sequence parallelism needs position_ids in every forward call: each "
                "rank holds a slice of the sequence, and causal masking is rebuilt from the "
                "gathered positions (use torch.arange(seq_len) per sample, restarting at each "
                "document for packed sequences; UlyssesSPDataLoaderAdapter keeps them global)"
            )
        self._check_inputs(query, key, value)
        batch, _, local_len, _ = query.shape
        if self.seq_length_is_variable:
            self.local_seq_length = local_len
            self.global_seq_length = local_len * self.world_size
        full_positions, packed = self._full_positions(kwargs["position_ids"])
        # a model may pass is_causal per call (sdpa honours it); the module's flag otherwise
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
        layout = self.layout
        if packed and causal:
            self._check_packed_supported()

        if layout.kv_replication > 1:
            key = key.repeat_interleave(layout.kv_replication, dim=1)
            value = value.repeat_interleave(layout.kv_replication, dim=1)
        if layout.ulysses > 1:
            # [b, h, s, d] -> [b, h / u, s * u, d]: heads scattered, sequence gathered
            query, key, value = (
                sequence_all_to_all(t, 1, 2, self.ulysses_group) for t in (query, key, value)
            )
        block = local_len * layout.ulysses
        start = (self.ring.index if self.ring is not None else 0) * block
        positions = full_positions[:, start : start + block]

        weights: Tensor | None = None
        if self.ring is not None:
            context = self._ring(module, query, key, value, causal, kwargs).transpose(1, 2)
        else:
            kwargs["position_ids"] = positions
            groups = query.shape[1] // key.shape[1]
            saved = getattr(module, "num_key_value_groups", None)
            # the core repeats key/value heads by this ratio, which replication changed
            if saved is not None:
                module.num_key_value_groups = groups  # type: ignore[assignment]
            try:
                context, weights = self._core(module, query, key, value, positions, args, kwargs)
            finally:
                if saved is not None:
                    module.num_key_value_groups = saved
        # context: [b, s * u, h / u, d] -> [b, s, h, d]: sequence scattered, heads gathered
        if layout.ulysses > 1:
            context = sequence_all_to_all(context, 1, 2, self.ulysses_group)
        return context.reshape(batch, local_len, -1), weights

    def _ring(
        self,
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        causal: bool,
        kwargs: dict[str, Any],
    ) -> Tensor:
        assert self.ring is not None
        dropout = kwargs.get("dropout", 0.0) if module.training else 0.0
        unsupported = {
            "dropout": dropout,
            "softcap": kwargs.get("softcap"),
            "sliding_window": kwargs.get("sliding_window"),
        }
        active = [f"{name}={value!r}" for name, value in unsupported.items() if value]
        if active:
            raise ValueError(
                f"ring attention (used because {self.layout.q_heads} query / "
                f"{self.layout.kv_heads} key-value heads do not split over sp={self.world_size}) "
                f"does not support {', '.join(active)}; set attention_dropout=0 / disable them, "
                "or choose a sequence_parallel_size that divides the heads"
            )
        scale = kwargs.get("scaling")
        if scale is None:
            scale = getattr(module, "scaling", query.shape[-1] ** -0.5)
        return ring_attention(query, key, value, self.ring, causal=causal, scale=float(scale))

    # ------------------------------------------------------------------ registration
    @staticmethod
    def register_with_transformers(
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
    ) -> Any:
        """Register the ``"ulysses"`` attention implementation with Transformers and return the
        ``mpu`` (:mod:`.parallel_state_sp`); ``None`` when ``sequence_parallel_size`` is 1.

        ``model_name_or_path``: a model (its config's ``_attn_implementation`` becomes
        ``"ulysses"``) or a name/path for ``AutoConfig.from_pretrained`` (then load the model
        with ``attn_implementation="ulysses"``). ``core_attn_implementation``: ``"sdpa"`` or
        ``"eager"``. ``seq_length``: the global length when ``seq_length_is_variable`` is False.
        """
        if sequence_parallel_size == 1:
            return None
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "Either `seq_length_is_variable` needs to be `True` or `seq_length` needs to be "
                "set to the fixed global sequence length"
            )
        if core_attn_implementation not in SUPPORTED_CORES:
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r} is not supported by "
                f"shardspeed's Ulysses sequence parallelism; choose one of {list(SUPPORTED_CORES)}"
            )
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        if hasattr(model_name_or_path, "config"):
            hf_config = model_name_or_path.config
        else:
            hf_config = AutoConfig.from_pretrained(model_name_or_path)
        arch = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = int(arch.num_attention_heads)
        kv_heads = int(getattr(arch, "num_key_value_heads", None) or heads)
        head_dim = getattr(arch, "head_dim", None) or arch.hidden_size // heads
        if not seq_length_is_variable and seq_length is not None:
            if seq_length % sequence_parallel_size:
                raise ValueError(
                    f"seq_length={seq_length} is not divisible by sequence_parallel_size="
                    f"{sequence_parallel_size}; pad the sequences to a multiple of it"
                )
        plan_heads_layout(heads, kv_heads, sequence_parallel_size)  # head counts checked early

        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        mpu = parallel_state_sp
        core: Callable[..., Any] = (
            ALL_ATTENTION_FUNCTIONS["sdpa"]
            if core_attn_implementation == "sdpa"
            else eager_core_attention
        )
        fixed = not seq_length_is_variable and seq_length is not None
        uattn = UlyssesSPAttentionHF(
            attn=core,
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=int(head_dim),
            kv_head_count=kv_heads,
            num_hidden_layers=int(getattr(arch, "num_hidden_layers", 0)),
            process_group=mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=seq_length // sequence_parallel_size if fixed else None,  # type: ignore[operator]
            global_seq_length=seq_length if fixed else None,
            disable_in_eval=disable_in_eval,
        )
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(
            module: nn.Module,
            query: Tensor,
            key: Tensor,
            value: Tensor,
            attention_mask: Tensor | None,
            *args: Any,
            **kwargs: Any,
        ) -> tuple[Tensor, Tensor | None]:
            # the model built its mask for the slice; causality comes from the positions
            return uattn(module, query, key, value, None, *args, **kwargs)

        ulysses_attention.ulysses = uattn  # type: ignore[attr-defined]
        # the global registry, as DeepSpeed does: every model naming "ulysses" reaches it
        AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention)
        if hasattr(model_name_or_path, "config"):
            model_name_or_path.config._attn_implementation = ATTN_IMPLEMENTATION
        return mpu
