"""The one place where ``"auto"`` config values are resolved.

The HuggingFace Trainer writes ``"auto"`` into DeepSpeed configs and fills the values in before
DeepSpeed sees them. shardspeed has no Trainer in front of it, so it resolves them itself:

* batch keys (``train_batch_size``, ``train_micro_batch_size_per_gpu``,
  ``gradient_accumulation_steps``): ``"auto"`` means "not given"; the batch triangle derives them
  from the others (and fails, as DeepSpeed does, when too few are left);
* ``gradient_clipping``, ``steps_per_print`` and the ZeRO bucket/threshold sizes
  (``reduce_bucket_size``, ``allgather_bucket_size``, ``stage3_prefetch_bucket_size``,
  ``stage3_param_persistence_threshold``, ...): ``"auto"`` means DeepSpeed's default. When a
  ``hidden_size`` hint is passed in the validation context, the three sizes the Trainer derives
  from it get the Trainer's values instead (``hidden**2``, ``0.9 * hidden**2``, ``10 * hidden``);
* any boolean field (``fp16.enabled``, ``bf16.enabled``, ``zero_optimization.overlap_comm``, ...):
  ``"auto"`` means the field's default;
* ``optimizer.params`` / ``scheduler.params``: ``"auto"`` is an error naming the key, since only
  the user knows the learning rate or the number of steps.

Everywhere else ``"auto"`` is validated like any other value (it is a real value of some fields,
e.g. ``pipeline.stages``), so a stray ``"auto"`` gives an ordinary "invalid value" error.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from shardspeed.config.errors import field_for_key

__all__ = ["AUTO", "HIDDEN_SIZE_RULES", "is_auto", "reject_auto", "resolve_auto"]

AUTO = "auto"

# Field name -> the value the HF Trainer derives from the model's hidden size.
HIDDEN_SIZE_RULES: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda hidden: hidden * hidden,
    "prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden),
    "param_persistence_threshold": lambda hidden: 10 * hidden,
}


def is_auto(value: Any) -> bool:
    """True for the string ``"auto"`` (any case)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def _is_bool_field(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_bool_field(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        return len(members) == 1 and _is_bool_field(members[0])
    return annotation is bool


def resolve_auto(
    model_cls: type[BaseModel],
    data: dict[str, Any],
    auto_defaults: frozenset[str],
    context: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Resolve the ``"auto"`` values of one section's input mapping, in place.

    ``auto_defaults`` names the fields of ``model_cls`` whose ``"auto"`` means the default;
    boolean fields are always included. A resolved key is removed (so the default applies) or,
    with a ``hidden_size`` in ``context`` and a rule in :data:`HIDDEN_SIZE_RULES`, replaced.
    """
    hidden = (context or {}).get("hidden_size")
    for key in [k for k, v in data.items() if is_auto(v)]:
        found = field_for_key(model_cls, key)
        if found is None:
            continue  # an unknown key; extra="forbid" reports it
        name, field = found
        if name in auto_defaults and hidden and name in HIDDEN_SIZE_RULES:
            data[key] = HIDDEN_SIZE_RULES[name](int(hidden))
        elif name in auto_defaults or _is_bool_field(field.annotation):
            del data[key]
    return data


def reject_auto(params: Mapping[str, Any], prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first ``"auto"`` value in ``params`` (searched recursively).

    ``prefix`` is prepended to nested keys (``"betas."``); the caller's error path supplies the
    section (``optimizer.params``).
    """
    for key, value in params.items():
        if is_auto(value):
            raise ValueError(
                f"'{prefix}{key}' is \"auto\", a placeholder only the HuggingFace Trainer fills "
                "in; give the actual value."
            )
        if isinstance(value, Mapping):
            reject_auto(value, f"{prefix}{key}.")
