"""AutoTP partition specifications: which parameters split how (DeepSpeed's ``autotp_config``).

A :class:`TPLayerSpec` names parameters by regular expression (``re.match`` against a parameter's
qualified name, e.g. ``model.layers.0.self_attn.q_proj.weight``) and says how their layer is
split over the tensor-parallel ranks: column-parallel (output features), row-parallel (input
features) or not at all. Its optional ``shape`` describes packed weights (a fused QKV or
gate/up projection) whose sub-parameters are split one by one. :class:`AutoTPConfig` is an
ordered list of specs (first match wins) read from the JSON ``tensor_parallel.partition_config``;
:func:`resolve_autotp_config` combines it with the presets of :mod:`.presets`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from shardspeed.config.errors import DeepSpeedConfigError, unknown_key_message
from shardspeed.utils.logging import warning_once

if TYPE_CHECKING:
    from shardspeed.runtime.tensor_parallel.presets import AutoTPPresets, resolve_autotp_config

__all__ = [
    "AutoTPConfig",
    "AutoTPPresets",
    "PartitionType",
    "TPLayerSpec",
    "merge_autotp_configs",
    "resolve_autotp_config",
]

# one entry of a shape: a length (-1: inferred) or, at the partition dim only, sub-param sizes
ShapeDim = int | tuple[int, ...]
Shape = tuple[ShapeDim, ...]

_CONFIG_PATH = "tensor_parallel.partition_config"


class PartitionType(str, Enum):
    """How a matched layer is split: by output features, by input features, or not at all."""

    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"

    @classmethod
    def _missing_(cls, value: object) -> PartitionType:
        # reached when no member has exactly this value: accept any spelling of the case
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower():
                    return member
        allowed = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"partition_type {value!r} is not one of {allowed} (any case)")


def _normalise_shape(shape: Any) -> Any:
    """Lists (as JSON gives them) to tuples, at every depth, so validation sees one form."""
    if isinstance(shape, list | tuple):
        return tuple(_normalise_shape(item) for item in shape)
    return shape


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class TPLayerSpec:
    """One partition rule: the parameters it matches and how their layer is split.

    ``shape`` views the weight before it is split: ``(n, -1)`` packs ``n`` equal sub-parameters
    along the partition dim, ``((q, k, v), -1)`` packs sub-parameters of those sizes (one level
    of nesting, at ``partition_dim`` only); ``-1`` means "whatever is left". ``partition_dim``
    defaults to 0 for column and 1 for row specs (the dims of a 2-D ``[out, in]`` weight).
    ``model_types`` limits the spec to those Hugging Face ``model_type`` values (any case).
    ``gather_output`` makes a column-parallel layer hand every rank the whole output;
    ``grad_allreduce`` marks a parameter left whole whose gradient is summed over the TP ranks.
    """

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Shape | None = None
    partition_dim: int | None = None
    model_types: list[str] | None = None
    gather_output: bool = False
    grad_allreduce: bool = False

    def __post_init__(self) -> None:
        self.patterns = _string_list("patterns", self.patterns, example=r"[r'.*\.q_proj\.weight$']")
        if not self.patterns:
            raise ValueError(
                "TPLayerSpec.patterns is empty: give at least one regular expression matched "
                r"against parameter names, e.g. ['.*\\.o_proj\\.weight$']"
            )
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(
                    f"TPLayerSpec pattern {pattern!r} is not a valid regular expression: {exc}"
                ) from exc
        if not isinstance(self.partition_type, PartitionType):
            if not isinstance(self.partition_type, str):
                raise TypeError(
                    f"TPLayerSpec.partition_type must be 'column', 'row' or 'skip', got {self.partition_type!r}"
                )
            self.partition_type = PartitionType(self.partition_type)
        if self.partition_dim is not None and (
            not _is_int(self.partition_dim) or self.partition_dim < 0
        ):
            raise ValueError(
                f"TPLayerSpec {self.patterns}: partition_dim must be a non-negative integer, got "
                f"{self.partition_dim!r}; leave it out for the default (0 column, 1 row)"
            )
        if self.model_types is not None:
            self.model_types = _string_list("model_types", self.model_types, example="['llama']")
        for flag in ("gather_output", "grad_allreduce"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(
                    f"TPLayerSpec {self.patterns}: {flag} must be true or false, got {getattr(self, flag)!r}"
                )
        if self.shape is not None:
            self.shape = _normalise_shape(self.shape)
            self._validate_shape()

    def _validate_shape(self) -> None:
        """DeepSpeed's rules: ints > 0 or -1, and one non-empty tuple of sizes at partition_dim."""
        shape, dim, where = self.shape, self.get_partition_dim(), f"TPLayerSpec {self.patterns}"
        if not isinstance(shape, tuple) or not shape:
            raise ValueError(f"{where}: shape must be a list such as [2, -1], got {shape!r}")
        if dim >= len(shape):
            raise ValueError(
                f"{where}: partition_dim {dim} is out of range for shape {list(shape)} of length "
                f"{len(shape)}; give a shape with an entry at index {dim} or a smaller partition_dim"
            )
        for index, entry in enumerate(shape):
            if isinstance(entry, tuple):
                if index != dim:
                    raise ValueError(
                        f"{where}: shape {shape}: a nested list of sub-parameter sizes is allowed only "
                        f"at partition_dim={dim}, found one at index {index}; move it or set "
                        f"partition_dim={index}"
                    )
                if not entry:
                    raise ValueError(
                        f"{where}: shape {shape}: the list of sub-parameter sizes is empty"
                    )
                if any(isinstance(size, tuple) for size in entry):
                    raise ValueError(
                        f"{where}: shape {shape}: only one level of nesting is supported"
                    )
                if not all(_is_int(size) and size > 0 for size in entry):
                    raise ValueError(
                        f"{where}: shape {shape}: sub-parameter sizes must be positive integers, got {list(entry)}"
                    )
            elif not _is_int(entry) or entry == 0 or entry < -1:
                raise ValueError(
                    f"{where}: shape {shape}: entry {entry!r} at index {index} must be a positive "
                    "integer, -1 (inferred), or a list of sizes at partition_dim"
                )

    def get_partition_dim(self) -> int:
        """The dim split over the ranks: ``partition_dim``, else 0 for column and 1 otherwise."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type is PartitionType.COLUMN else 1

    def matches(self, name: str, model_type: str | None = None) -> bool:
        """Whether this spec applies to parameter ``name`` of a model of ``model_type``."""
        if self.model_types:
            if model_type is None:
                return False
            if str(model_type).lower() not in {kind.lower() for kind in self.model_types}:
                return False
        return any(re.match(pattern, name) for pattern in self.patterns)

    def sub_param_sizes(self, length: int) -> tuple[int, ...]:
        """Sizes of the packed sub-parameters along the partition dim of a weight ``length`` long
        there: ``(length,)`` without a shape, ``n`` equal parts for ``(n, -1)``, the listed sizes
        for ``((q, k, v), -1)``. Each sub-parameter is split over the ranks on its own."""
        if not _is_int(length) or length <= 0:
            raise ValueError(
                f"TPLayerSpec {self.patterns}: length must be a positive integer, got {length!r}"
            )
        if self.partition_type is PartitionType.SKIP:
            return (length,)
        split_dim = 0 if self.partition_type is PartitionType.COLUMN else 1
        shape = self.shape
        if self.get_partition_dim() != split_dim or (shape is not None and len(shape) != 2):
            raise ValueError(
                f"TPLayerSpec {self.patterns}: shape {None if shape is None else list(shape)} with "
                f"partition_dim {self.get_partition_dim()} is not a view training can split; training "
                "supports sub-parameters along the split dimension only: a 2-D shape whose "
                f"partition_dim is {split_dim} for a {self.partition_type.value} spec"
            )
        entry: ShapeDim = -1 if shape is None else shape[split_dim]
        if isinstance(entry, tuple):
            if sum(entry) != length:
                raise ValueError(
                    f"TPLayerSpec {self.patterns}: sub-parameter sizes {list(entry)} add up to "
                    f"{sum(entry)}, but the weight is {length} long along dim {split_dim}; fix the sizes"
                )
            return entry
        if entry == -1:
            return (length,)
        if length % entry:
            raise ValueError(
                f"TPLayerSpec {self.patterns}: a weight {length} long along dim {split_dim} cannot "
                f"hold {entry} equal sub-parameters; fix shape[{split_dim}]"
            )
        return (length // entry,) * entry

    def to_dict(self) -> dict[str, Any]:
        """The JSON form :meth:`AutoTPConfig.from_dict` reads back."""
        out: dict[str, Any] = {
            "patterns": list(self.patterns),
            "partition_type": self.partition_type.value,
        }
        if self.shape is not None:
            out["shape"] = [
                list(entry) if isinstance(entry, tuple) else entry for entry in self.shape
            ]
        if self.partition_dim is not None:
            out["partition_dim"] = self.partition_dim
        if self.model_types is not None:
            out["model_types"] = list(self.model_types)
        out["gather_output"] = self.gather_output
        out["grad_allreduce"] = self.grad_allreduce
        return out


def _string_list(key: str, value: Any, example: str) -> list[str]:
    """``value`` as a list of strings; a bare string is refused (it would match per character)."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise TypeError(
            f"TPLayerSpec.{key} must be a list of strings, e.g. {example}; got {value!r}"
        )
    if not all(isinstance(item, str) for item in value):
        raise TypeError(f"TPLayerSpec.{key} must hold only strings, got {list(value)!r}")
    return list(value)


_SPEC_KEYS = (
    "patterns",
    "partition_type",
    "shape",
    "partition_dim",
    "model_types",
    "gather_output",
    "grad_allreduce",
)
_CONFIG_KEYS = (
    "tp_size",
    "layer_specs",
    "embedding_partition_dim",
    "lm_head_patterns",
    "use_default_specs",
    "strict_mode",
)


@dataclass
class AutoTPConfig:
    """An ordered list of partition rules and the settings around them.

    ``layer_specs`` are tried in order and the first match wins. ``use_default_specs`` (the
    default) puts them on top of the model's preset; ``strict_mode`` asks the plan builder to
    refuse a model with linear layers no spec matches.
    """

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: list[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.tp_size) or self.tp_size < 0:
            raise ValueError(
                f"AutoTPConfig.tp_size must be a non-negative integer, got {self.tp_size!r}"
            )
        if not all(isinstance(spec, TPLayerSpec) for spec in self.layer_specs):
            raise TypeError(
                "AutoTPConfig.layer_specs must hold TPLayerSpec objects; use from_dict for JSON"
            )
        if self.embedding_partition_dim not in (0, 1) or not _is_int(self.embedding_partition_dim):
            raise ValueError(
                f"embedding_partition_dim must be 0 (vocabulary) or 1 (hidden), got {self.embedding_partition_dim!r}"
            )
        if isinstance(self.lm_head_patterns, str):
            raise TypeError(f"lm_head_patterns must be a list, e.g. [{self.lm_head_patterns!r}]")
        for flag in ("use_default_specs", "strict_mode"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(
                    f"AutoTPConfig.{flag} must be true or false, got {getattr(self, flag)!r}"
                )

    def find_matching_spec(
        self, param_name: str, model_type: str | None = None
    ) -> TPLayerSpec | None:
        """The first spec that matches ``param_name`` (a warning, once, when several do)."""
        matches = [spec for spec in self.layer_specs if spec.matches(param_name, model_type)]
        if not matches:
            return None
        if len(matches) > 1:
            warning_once(
                f"AutoTP: parameter {param_name} matches {len(matches)} layer_specs "
                f"({[spec.patterns for spec in matches]}); the first one is used"
            )
        return matches[0]

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> AutoTPConfig:
        """Build from the JSON ``tensor_parallel.partition_config`` form; unknown keys are errors."""
        if not isinstance(config, Mapping):
            raise DeepSpeedConfigError(
                f"{_CONFIG_PATH} must be an object, got {type(config).__name__}"
            )
        for key in config:
            if key not in _CONFIG_KEYS:
                raise DeepSpeedConfigError(
                    unknown_key_message(f"{_CONFIG_PATH}.{key}", str(key), _CONFIG_KEYS)
                )
        raw_specs = config.get("layer_specs", [])
        if not isinstance(raw_specs, list | tuple):
            raise DeepSpeedConfigError(
                f"{_CONFIG_PATH}.layer_specs must be a list of objects, got {raw_specs!r}"
            )
        specs = [_spec_from_dict(index, raw) for index, raw in enumerate(raw_specs)]
        options = {
            key: config[key] for key in _CONFIG_KEYS if key in config and key != "layer_specs"
        }
        try:
            return cls(layer_specs=specs, **options)
        except (TypeError, ValueError) as exc:
            raise DeepSpeedConfigError(f"{_CONFIG_PATH}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``from_dict(to_dict())`` gives an equal config."""
        return {
            "tp_size": self.tp_size,
            "layer_specs": [spec.to_dict() for spec in self.layer_specs],
            "embedding_partition_dim": self.embedding_partition_dim,
            "lm_head_patterns": list(self.lm_head_patterns),
            "use_default_specs": self.use_default_specs,
            "strict_mode": self.strict_mode,
        }


def _spec_from_dict(index: int, raw: Any) -> TPLayerSpec:
    """One ``layer_specs`` entry, with errors that name its place in the config."""
    where = f"{_CONFIG_PATH}.layer_specs[{index}]"
    if not isinstance(raw, Mapping):
        raise DeepSpeedConfigError(f"{where} must be an object with 'patterns', got {raw!r}")
    for key in raw:
        if key not in _SPEC_KEYS:
            raise DeepSpeedConfigError(unknown_key_message(f"{where}.{key}", str(key), _SPEC_KEYS))
    if not raw.get("patterns"):
        raise DeepSpeedConfigError(
            f"{where} has no 'patterns': give a list of regular expressions matched against "
            r"parameter names, e.g. [\".*\\.o_proj\\.weight$\"]"
        )
    try:
        return TPLayerSpec(**{key: raw[key] for key in _SPEC_KEYS if key in raw})
    except (TypeError, ValueError) as exc:
        raise DeepSpeedConfigError(f"{where}: {exc}") from exc


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """``override`` on top of ``base``: its specs are tried first, its settings win."""
    return AutoTPConfig(
        tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
        layer_specs=[*override.layer_specs, *base.layer_specs],
        embedding_partition_dim=override.embedding_partition_dim,
        lm_head_patterns=list(override.lm_head_patterns or base.lm_head_patterns),
        use_default_specs=override.use_default_specs,
        strict_mode=override.strict_mode,
    )


def __getattr__(name: str) -> Any:
    # the presets build on the classes above, so they live in their own module; their names
    # are offered here too, resolved on first use, so this module holds the whole interface
    if name in ("AutoTPPresets", "resolve_autotp_config"):
        from shardspeed.runtime.tensor_parallel import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
