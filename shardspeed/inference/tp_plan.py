"""AutoTP's sharding rules: which of a model's modules split how, decided from its structure.

:func:`build_plan` walks a model (real or on the meta device) and returns a :class:`ShardPlan`:
for each linear it keeps, the rows (column-parallel) or input columns (row-parallel, followed by
an all-reduce) this rank holds; the vocabulary range of the embedding and the output head; and
the attributes of attention modules that count heads, set to this rank's counts.

Blocks are recognised by the names of their children, which cover the Hugging Face families
(Llama, Mistral, Qwen2/3, OPT: ``q_proj``/``k_proj``/``v_proj`` + ``o_proj``/``out_proj``;
GPT-2: a fused ``c_attn`` + ``c_proj``; Falcon: a fused ``query_key_value`` + ``dense`` in any of
its three layouts; MLPs ``gate_proj``/``up_proj`` + ``down_proj``, ``c_fc`` + ``c_proj``,
``fc1`` + ``fc2``, ``dense_h_to_4h`` + ``dense_4h_to_h``). A model with other names takes an
``injection_policy``: ``{block class: (names of its row-parallel linears)}``; every other linear
in such a block is column-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from shardspeed.runtime.tensor_parallel.partition import HeadLayout, Slice, split_range

__all__ = ["LinearRule", "ShardPlan", "build_plan", "is_linear", "linear_shape", "weight_of"]

_ATTENTION = (("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "k_proj", "v_proj", "out_proj"))
_FUSED_ATTENTION = ("c_attn", "c_proj")
_FALCON_ATTENTION = ("query_key_value", "dense")
_MLP = (
    (("gate_proj", "up_proj"), "down_proj"),
    (("c_fc",), "c_proj"),
    (("fc1",), "fc2"),
    (("dense_h_to_4h",), "dense_4h_to_h"),
)
# attributes of attention modules that hold head counts, and what each becomes on a rank
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_key_value_groups")


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or Hugging Face's transposed ``Conv1D``."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def weight_of(module: nn.Module) -> torch.Tensor:
    """``module.weight``, checked to be a tensor."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return weight


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a linear or Conv1D."""
    out, inp = weight_of(module).shape
    return (inp, out) if _is_conv1d(module) else (out, inp)


@dataclass(frozen=True)
class LinearRule:
    """How one linear is split: ``column`` keeps output rows, ``row`` keeps input columns."""

    kind: Literal["column", "row"]
    piece: Slice
    """Along dim 0 (rows) for column, dim 1 (input columns) for row, in ``nn.Linear`` layout."""
    transposed: bool = False
    """The checkpoint stores this weight as (in, out) (Hugging Face ``Conv1D``)."""


@dataclass
class ShardPlan:
    """Everything AutoTP changes on one rank."""

    linears: dict[str, LinearRule] = field(default_factory=dict)
    vocab: dict[str, tuple[int, int]] = field(default_factory=dict)
    """``{embedding or head module name: (first row, stop row)}`` of this rank."""
    head_name: str | None = None
    """The output head's module name (its vocabulary split all-gathers logits)."""
    head_sizes: tuple[int, ...] = ()
    """Vocabulary rows of the head on each rank, in rank order."""
    attrs: list[tuple[str, str, int]] = field(default_factory=list)
    """``(module name, attribute, value)`` to set once the weights are split."""


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def _heads(model: nn.Module, tp_size: int, rank: int) -> HeadLayout | None:
    config = _text_config(model)
    q_heads = getattr(config, "num_attention_heads", None)
    if not q_heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    if hasattr(config, "new_decoder_architecture"):  # Falcon
        kv_heads = _falcon_kv_heads(config, q_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    return HeadLayout(q_heads, kv_heads, head_dim, tp_size, rank)


def _falcon_kv_heads(config: Any, q_heads: int) -> int:
    """Key/value heads of a Falcon config, refusing the variant AutoTP cannot split."""
    if getattr(config, "alibi", False):
        raise ValueError(
            "AutoTP does not split Falcon with alibi=True (its position bias is built for all "
            "heads at once, outside the attention modules); use a rotary Falcon (alibi=False) "
            "or tensor_parallel.tp_size=1."
        )
    if config.new_decoder_architecture:
        return int(config.num_kv_heads)
    return 1 if config.multi_query else q_heads


def build_plan(
    model: nn.Module,
    tp_size: int,
    rank: int,
    grain: int = 64,
    injection_policy: dict[Any, Any] | None = None,
) -> ShardPlan:
    """The sharding of ``model`` for rank ``rank`` of ``tp_size``; errors say what does not fit."""
    plan = ShardPlan()
    if tp_size == 1:  # nothing to split; Conv1D still becomes nn.Linear (one layout downstream)
        for name, module in model.named_modules():
            if _is_conv1d(module):
                out = linear_shape(module)[0]
                plan.linears[name] = _rule("column", Slice(0, ((0, out),)), module)
        return plan
    layout = _heads(model, tp_size, rank)
    policy_blocks: list[str] = []  # the policy decides everything inside these
    for name, module in model.named_modules():
        if any(name.startswith(block + ".") for block in policy_blocks):
            continue
        if injection_policy and type(module) in injection_policy:
            _plan_policy_block(
                plan, name, module, injection_policy[type(module)], tp_size, rank, grain
            )
            policy_blocks.append(name)
            continue
        children = dict(module.named_children())
        if layout is not None:
            _plan_attention(plan, name, module, children, layout)
        _plan_mlp(plan, name, children, tp_size, rank, grain)
    if not plan.linears:
        raise ValueError(
            f"AutoTP found no attention or MLP block it knows in {type(model).__name__}; pass "
            "injection_policy={BlockClass: ('name of the attention output linear', "
            "'name of the MLP output linear')} to init_inference."
        )
    _plan_vocab(plan, model, tp_size, rank)
    return plan


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _plan_attention(
    plan: ShardPlan,
    name: str,
    module: nn.Module,
    children: dict[str, nn.Module],
    layout: HeadLayout,
) -> None:
    for q, k, v, o in _ATTENTION:
        if all(n in children and is_linear(children[n]) for n in (q, k, v, o)):
            for part, piece in (
                (q, layout.q_slice(0)),
                (k, layout.kv_slice(0)),
                (v, layout.kv_slice(0)),
            ):
                plan.linears[_join(name, part)] = _rule("column", piece, children[part])
            plan.linears[_join(name, o)] = _rule("row", layout.q_slice(1), children[o])
            break
    else:
        if _plan_falcon_attention(plan, name, module, children, layout):
            return
        qkv, out = _FUSED_ATTENTION
        if not (qkv in children and out in children and hasattr(module, "split_size")):
            return
        plan.linears[_join(name, qkv)] = _rule("column", layout.fused_qkv_slice(0), children[qkv])
        plan.linears[_join(name, out)] = _rule("row", layout.q_slice(1), children[out])
        local = layout.local_q_heads * layout.head_dim
        plan.attrs += [(name, "split_size", local), (name, "embed_dim", local)]
    counts = {
        "num_heads": layout.local_q_heads,
        "num_attention_heads": layout.local_q_heads,
        "num_key_value_heads": layout.local_kv_heads,
        "num_key_value_groups": layout.local_q_heads // layout.local_kv_heads,
    }
    plan.attrs += [(name, attr, counts[attr]) for attr in _HEAD_ATTRS if hasattr(module, attr)]


def _plan_falcon_attention(
    plan: ShardPlan,
    name: str,
    module: nn.Module,
    children: dict[str, nn.Module],
    layout: HeadLayout,
) -> bool:
    """Falcon's fused ``query_key_value``: rows laid out per its variant (see its
    ``_split_heads``); ``dense`` row-parallel. False when ``module`` is not Falcon attention."""
    qkv, out = _FALCON_ATTENTION
    if not (qkv in children and out in children and hasattr(module, "new_decoder_architecture")):
        return False
    if module.new_decoder_architecture:  # [q_1 .. q_g | k | v] per key/value group
        piece = layout.grouped_qkv_slice(0)
    elif module.multi_query:  # [all q | one k | one v]
        piece = layout.fused_qkv_slice(0)
    else:  # [q_h | k_h | v_h] head by head
        piece = layout.interleaved_qkv_slice(0)
    plan.linears[_join(name, qkv)] = _rule("column", piece, children[qkv])
    plan.linears[_join(name, out)] = _rule("row", layout.q_slice(1), children[out])
    local = layout.local_q_heads * layout.head_dim
    plan.attrs += [
        (name, "num_heads", layout.local_q_heads),
        (name, "num_kv_heads", layout.local_kv_heads),
        (name, "hidden_size", local),
        (name, "split_size", local),
    ]
    return True


def _plan_mlp(
    plan: ShardPlan, name: str, children: dict[str, nn.Module], tp_size: int, rank: int, grain: int
) -> None:
    for ups, down in _MLP:
        names = (*ups, down)
        if not all(n in children and is_linear(children[n]) for n in names):
            continue
        if _join(name, down) in plan.linears:  # GPT-2's attention c_proj, already planned
            continue
        width = linear_shape(children[ups[0]])[0]
        start, stop = split_range(width, tp_size, rank, grain)
        for up in ups:
            plan.linears[_join(name, up)] = _rule(
                "column", Slice(0, ((start, stop),)), children[up]
            )
        plan.linears[_join(name, down)] = _rule("row", Slice(1, ((start, stop),)), children[down])
        return


def _plan_policy_block(
    plan: ShardPlan,
    name: str,
    block: nn.Module,
    row_names: Any,
    tp_size: int,
    rank: int,
    grain: int,
) -> None:
    rows = (row_names,) if isinstance(row_names, str) else tuple(row_names)
    for sub, module in block.named_modules():
        if not sub or not is_linear(module):
            continue
        out, inp = linear_shape(module)
        if any(sub == r or sub.endswith("." + r) for r in rows):
            start, stop = split_range(inp, tp_size, rank, grain)
            plan.linears[_join(name, sub)] = _rule("row", Slice(1, ((start, stop),)), module)
        else:
            start, stop = split_range(out, tp_size, rank, grain)
            plan.linears[_join(name, sub)] = _rule("column", Slice(0, ((start, stop),)), module)


def _plan_vocab(plan: ShardPlan, model: nn.Module, tp_size: int, rank: int) -> None:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    names = {id(m): n for n, m in model.named_modules()}
    # uneven vocabularies (GPT-2's 50257) split too: the first ranks get one row more
    if isinstance(embed, nn.Embedding):
        plan.vocab[names[id(embed)]] = split_range(embed.num_embeddings, tp_size, rank)
    if isinstance(head, nn.Linear):
        plan.vocab[names[id(head)]] = split_range(head.out_features, tp_size, rank)
        plan.head_name = names[id(head)]
        plan.head_sizes = tuple(
            stop - start
            for start, stop in (split_range(head.out_features, tp_size, r) for r in range(tp_size))
        )


def _rule(kind: Literal["column", "row"], piece: Slice, module: nn.Module) -> LinearRule:
    return LinearRule(kind, piece, transposed=_is_conv1d(module))
