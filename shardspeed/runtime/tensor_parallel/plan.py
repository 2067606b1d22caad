"""Which modules of a model AutoTP training splits, and how: a :class:`TrainingPlan`.

The plan comes from the first source that applies, in DeepSpeed's documented order:

1. ``tensor_parallel.partition_config`` / ``preset_model`` (an :class:`AutoTPConfig` of regex
   layer specs, matched against parameter names such as ``model.layers.0.mlp.up_proj.weight``);
2. the model's own Hugging Face plan (``model.tp_plan``, from ``_tp_plan`` and
   ``config.base_model_tp_plan``): ``colwise``, ``rowwise``, ``colwise_gather_output`` /
   ``colwise_rep``, ``rowwise_rep``, ``packed_colwise``, ``embedding_rowwise``,
   ``replicated_with_grad_allreduce`` and ``replicate``;
3. AutoTP's structural rules (:func:`shardspeed.inference.tp_plan.build_plan`, shared with
   inference).

Whatever the source decides (column, row, vocabulary-parallel, or replicated with summed
gradients), the ranges each rank keeps are computed here once, for every rank: attention
projections split by whole heads (:class:`HeadLayout`; with fewer key/value heads than ranks,
each key/value head is kept by the ranks whose query heads use it), packed sub-parameters
(``shape`` in a layer spec, ``packed_colwise``) split one by one, everything else in near-equal
multiples of ``tp_grain_size``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import nn

from shardspeed.inference.tp_plan import build_plan, is_linear, linear_shape
from shardspeed.runtime.tensor_parallel.partition import HeadLayout, Slice, SplitLayout, split_range

__all__ = ["ModuleSplit", "TrainingPlan", "build_training_plan", "hf_tp_plan"]

Kind = Literal["column", "row", "vocab", "grad_sum"]

#: Hugging Face tensor-parallel styles -> (kind, gather_output, input_is_parallel, packed parts)
_HF_STYLES: dict[str, tuple[Kind | None, bool, bool, int]] = {
    "colwise": ("column", False, True, 1),
    "colwise_gather_output": ("column", True, True, 1),
    "colwise_rep": ("column", True, True, 1),
    "rowwise": ("row", False, True, 1),
    "rowwise_rep": ("row", False, False, 1),
    "rowwise_split_input": ("row", False, False, 1),
    "packed_colwise": ("column", False, True, 2),
    "embedding_rowwise": ("vocab", False, True, 1),
    "replicated_with_grad_allreduce": ("grad_sum", False, True, 1),
    "replicate": (None, False, True, 1),
}


@dataclass(frozen=True)
class ModuleSplit:
    """How one module is split: ``layout`` is its weight's (every rank's ranges)."""

    kind: Kind
    layout: SplitLayout | None = None
    gather_output: bool = False
    input_is_parallel: bool = True


@dataclass
class TrainingPlan:
    """Every module AutoTP training changes, by name, and the head counts to set."""

    splits: dict[str, ModuleSplit] = field(default_factory=dict)
    attrs: list[tuple[str, str, int]] = field(default_factory=list)
    source: str = ""
    replicated: list[str] = field(default_factory=list)
    """Linears no rule splits (kept whole on every rank)."""
    head_counts: dict[str, int] = field(default_factory=dict)
    """This rank's ``num_attention_heads`` / ``num_key_value_heads`` (split attention only)."""
    local_configs: list[str] = field(default_factory=list)
    """Attention modules that read head counts from their ``config``: each gets its own copy
    with this rank's counts (the model's config keeps the whole model's, for saving)."""


@dataclass(frozen=True)
class _Heads:
    q: int
    kv: int
    dim: int

    def layout(self, tp: int, rank: int) -> HeadLayout:
        return HeadLayout(self.q, self.kv, self.dim, tp, rank)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def _heads_of(model: nn.Module) -> _Heads | None:
    config = _text_config(model)
    q = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not q or not hidden:
        return None
    kv = getattr(config, "num_key_value_heads", None) or q
    return _Heads(int(q), int(kv), int(getattr(config, "head_dim", None) or hidden // q))


def _is_attention(module: nn.Module | None) -> bool:
    return module is not None and any(
        hasattr(module, a) for a in ("head_dim", "num_key_value_groups", "num_heads")
    )


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face tensor-parallel plan with full module names (``*`` for layer
    numbers); empty when it has none."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    plan = {}
    for name, module in model.named_modules():
        own = getattr(module, "_tp_plan", None) or {}
        config_plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if module is getattr(model, "base_model", None) and config_plan:
            own = {**config_plan, **own}
        plan.update({f"{name}.{k}" if name else k: v for k, v in own.items()})
    return plan


def _generic(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp`` (how Hugging Face plans name layers)."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", name)


def _check_shared_whole(name: str, pieces: tuple[Slice, ...]) -> None:
    """Ranks hold the same piece or pieces with no row in common: a packed projection whose
    key/value part several ranks share while its query part is split is refused."""
    for i, first in enumerate(pieces):
        rows = {r for a, b in first.pieces for r in range(a, b)}
        for other in pieces[i + 1 :]:
            if other == first:
                continue
            if any(a < b and rows & set(range(a, b)) for a, b in other.pieces):
                raise ValueError(
                    f"{name}: a packed projection whose key/value heads would be shared by "
                    "several tensor-parallel ranks while its query heads are split (more ranks "
                    "than key/value heads); choose an autotp_size no larger than the key/value "
                    "heads, or use the model's Hugging Face tp_plan (leave out preset_model / "
                    "partition_config)"
                )


class _Planner:
    def __init__(self, model: nn.Module, tp: int, grain: int) -> None:
        self.model, self.tp, self.grain = model, tp, grain
        self.heads = _heads_of(model)
        self.modules = dict(model.named_modules())
        self.plan = TrainingPlan()
        self.attention: set[str] = set()

    def parent(self, name: str) -> nn.Module | None:
        return self.modules.get(name.rsplit(".", 1)[0] if "." in name else "")

    # ------------------------------------------------------------------ ranges
    def _part_ranges(self, name: str, size: int, in_attention: bool) -> list[tuple[int, int]]:
        """Each rank's range of one (sub-)parameter of ``size`` rows/columns."""
        heads = self.heads
        if in_attention and heads is not None:
            q_width, kv_width = heads.q * heads.dim, heads.kv * heads.dim
            if size in (q_width, kv_width):
                out = []
                for r in range(self.tp):
                    layout = heads.layout(self.tp, r)
                    piece = layout.q_slice(0) if size == q_width else layout.kv_slice(0)
                    out.append(piece.pieces[0])
                return out
        if size < self.tp:
            raise ValueError(
                f"{name}: {size} features cannot be split over tensor_parallel.autotp_size="
                f"{self.tp} ranks; choose a smaller autotp_size or keep {name} replicated "
                "(partition_config layer spec with partition_type 'skip')"
            )
        return [split_range(size, self.tp, r, self.grain) for r in range(self.tp)]

    def linear_layout(self, name: str, kind: Kind, parts: list[int] | None) -> SplitLayout:
        module = self.modules[name]
        out, inp = linear_shape(module)
        dim = 0 if kind == "column" else 1
        length = (out, inp)[dim]
        sizes = parts or [length]
        if sum(sizes) != length:
            raise ValueError(
                f"{name}: packed sub-parameters of sizes {sizes} do not add up to its "
                f"{length} {'output' if dim == 0 else 'input'} features"
            )
        in_attention = _is_attention(self.parent(name))
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.tp)]
        offset = 0
        for size in sizes:
            for r, (a, b) in enumerate(self._part_ranges(name, size, in_attention)):
                per_rank[r].append((offset + a, offset + b))
            offset += size
        pieces = tuple(Slice(dim, tuple(ranges)) for ranges in per_rank)
        _check_shared_whole(name, pieces)
        return SplitLayout((out, inp), pieces)

    def _fused_attention_parts(self, name: str, spec: Any, length: int) -> list[int]:
        """The packed sub-parameters of a spec's weight. "Three equal parts" of a fused q/k/v
        projection of a grouped-query model are in fact (q, kv, kv) wide: DeepSpeed's phi3
        preset says ``shape=(3, -1)``, which cuts keys and values in the wrong places when
        there are fewer key/value heads than query heads."""
        heads = self.heads
        shape = spec.shape
        if heads is not None and heads.q != heads.kv and shape is not None:
            q_width, kv_width = heads.q * heads.dim, heads.kv * heads.dim
            three = shape[spec.get_partition_dim()] == 3
            if three and length == q_width + 2 * kv_width and _is_attention(self.parent(name)):
                return [q_width, kv_width, kv_width]
        return list(spec.sub_param_sizes(length))

    def add(
        self,
        name: str,
        kind: Kind | None,
        gather: bool = False,
        whole_in: bool = False,
        parts: list[int] | None = None,
    ) -> None:
        if kind is None:
            return
        if kind in ("column", "row"):
            if not is_linear(self.modules[name]):
                raise ValueError(
                    f"{name} ({type(self.modules[name]).__name__}) is planned "
                    f"{kind}-parallel but is not a linear layer"
                )
            layout = self.linear_layout(name, kind, parts)
            self.plan.splits[name] = ModuleSplit(kind, layout, gather, not whole_in)
            if kind == "column" and not gather and _is_attention(self.parent(name)):
                self.attention.add(name.rsplit(".", 1)[0])  # it sees this rank's heads only
        elif kind == "vocab":
            if not isinstance(self.modules[name], nn.Embedding):
                raise ValueError(f"{name} is planned vocabulary-parallel but is not an embedding")
            self.plan.splits[name] = ModuleSplit("vocab")
        else:
            self.plan.splits[name] = ModuleSplit("grad_sum")

    # ------------------------------------------------------------------ sources
    def from_specs(self, specs: Any, model_type: str | None) -> None:
        from shardspeed.runtime.tensor_parallel.specs import PartitionType

        unmatched = []
        for name, module in self.modules.items():
            if not name:
                continue
            spec = specs.find_matching_spec(f"{name}.weight", model_type) or (
                specs.find_matching_spec(name, model_type)
            )
            if spec is None:
                if is_linear(module):
                    unmatched.append(name)
                continue
            kind = PartitionType(spec.partition_type)
            if kind is PartitionType.SKIP:
                self.add(name, "grad_sum" if spec.grad_allreduce else None)
                continue
            if not is_linear(module):
                continue
            kind_name: Kind = "column" if kind is PartitionType.COLUMN else "row"
            out, inp = linear_shape(module)
            length = out if kind_name == "column" else inp
            parts = self._fused_attention_parts(name, spec, length)
            self.add(name, kind_name, spec.gather_output, parts=parts)
        if unmatched and specs.strict_mode:
            raise ValueError(
                f"partition_config.strict_mode: no layer spec matches the linears {unmatched}; "
                "add patterns for them (partition_type 'skip' keeps one replicated)"
            )
        self.plan.replicated = unmatched
        self.plan.source = "partition_config"

    def from_hf_plan(self, hf_plan: dict[str, str]) -> None:
        for name, module in self.modules.items():
            if not name:
                continue
            style = hf_plan.get(_generic(name), hf_plan.get(name))
            if style is None:
                if is_linear(module):
                    self.plan.replicated.append(name)
                continue
            if style not in _HF_STYLES:
                raise ValueError(
                    f"{name}: the model's Hugging Face tp_plan asks for {style!r}, which AutoTP "
                    f"training does not build (it builds {sorted(_HF_STYLES)}); give "
                    "tensor_parallel.partition_config layer specs for this model instead"
                )
            kind, gather, whole_in_is_parallel, packed = _HF_STYLES[style]
            parts = None
            if packed > 1 and kind is not None:
                length = linear_shape(module)[0]
                if length % packed:
                    raise ValueError(f"{name}: {length} features are not {packed} equal parts")
                parts = [length // packed] * packed
            self.add(name, kind, gather, not whole_in_is_parallel, parts)
        self.plan.source = "tp_plan"

    def from_structure(self) -> None:
        linears = [n for n, m in self.modules.items() if n and is_linear(m)]
        try:
            plans = [build_plan(self.model, self.tp, r, self.grain) for r in range(self.tp)]
        except ValueError as error:
            if "found no attention or MLP block" not in str(error):
                raise
            raise ValueError(
                f"AutoTP training: no rule splits {type(self.model).__name__}: it has no Hugging "
                f"Face tp_plan and no attention or MLP block AutoTP knows; its linear layers "
                f"are {linears[:12]}{' ...' if len(linears) > 12 else ''}. Give "
                "tensor_parallel.partition_config layer_specs (regex patterns on parameter "
                "names, partition_type 'column' / 'row')"
            ) from None
        mine = plans[0]
        for name, rule in mine.linears.items():
            module = self.modules[name]
            out, inp = linear_shape(module)
            pieces = tuple(
                Slice(0 if rule.kind == "column" else 1, p.linears[name].piece.pieces)
                for p in plans
            )
            layout = SplitLayout((out, inp), pieces)
            self.plan.splits[name] = ModuleSplit(rule.kind, layout)
        self.plan.attrs = list(mine.attrs)  # the same head counts on every rank
        for name in mine.vocab:
            if isinstance(self.modules[name], nn.Embedding):
                self.plan.splits[name] = ModuleSplit("vocab")
            elif name == mine.head_name:
                self.add(name, "column", gather=True)
        self.plan.replicated = [
            n for n, m in self.modules.items() if n and is_linear(m) and n not in self.plan.splits
        ]
        self.plan.source = "heuristics"

    # ------------------------------------------------------------------ heads
    def set_head_counts(self) -> None:
        if self.heads is None:
            return
        counts: dict[str, int] = {}
        if self.attention:
            rank_layout = self.heads.layout(self.tp, 0)
            q, kv = rank_layout.local_q_heads, rank_layout.local_kv_heads
            counts = {
                "num_heads": q,
                "num_attention_heads": q,
                "num_key_value_heads": kv,
                "num_key_value_groups": q // kv,
            }
            self.plan.head_counts = {
                "num_attention_heads": q,
                "num_key_value_heads": kv,
            }
        for name in sorted(self.attention):
            module = self.modules[name]
            for attr, value in counts.items():
                if isinstance(getattr(module, attr, None), int):
                    self.plan.attrs.append((name, attr, value))
            config = getattr(module, "config", None)
            if config is not None and isinstance(getattr(config, "num_attention_heads", None), int):
                self.plan.local_configs.append(name)


def build_training_plan(
    model: nn.Module,
    tp_size: int,
    *,
    grain: int = 1,
    specs: Any = None,
) -> TrainingPlan:
    """The split of ``model`` over ``tp_size`` ranks (``specs``: an ``AutoTPConfig`` from the
    ``partition_config`` / ``preset_model``, else the model's Hugging Face plan, else the
    structural rules). Errors name the layers that do not fit."""
    planner = _Planner(model, tp_size, grain)
    model_type = getattr(_text_config(model), "model_type", None)
    hf_plan = hf_tp_plan(model)
    if specs is not None:
        planner.from_specs(specs, model_type)
    elif hf_plan:
        planner.from_hf_plan(hf_plan)
    else:
        planner.from_structure()
    plan = planner.plan
    if not any(s.kind in ("column", "row") for s in plan.splits.values()):
        raise ValueError(
            f"AutoTP training found nothing to split in {type(model).__name__} (plan source: "
            f"{plan.source}); its linear layers {plan.replicated[:8]} match no rule: give "
            "tensor_parallel.partition_config layer specs naming them (or a preset_model)"
        )
    planner.set_head_counts()
    return plan
