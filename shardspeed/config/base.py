"""``DeepSpeedConfigModel``: the base class of every config section model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator
from typing_extensions import Self

from shardspeed.config.auto import resolve_auto
from shardspeed.config.deprecation import DeprecatedKey, apply_deprecations
from shardspeed.config.errors import error_from_validation, split_path

__all__ = ["DeepSpeedConfigModel"]


class DeepSpeedConfigModel(BaseModel):
    """Base of every config section: strict keys, aliases, deprecations and ``"auto"``.

    * unknown keys are rejected (``extra="forbid"``) and reported with the closest valid key;
    * a field can be given by its name or its alias (``stage3_prefetch_bucket_size``);
    * assignments are validated too;
    * invalid input raises :class:`~shardspeed.config.errors.DeepSpeedConfigError` (a
      ``ValueError``) whose message carries the full dotted path of the key.

    Subclasses set ``json_key`` (their path in a DeepSpeed config, used in messages when built on
    their own), ``deprecated_keys`` and ``auto_defaults`` (see :mod:`shardspeed.config.auto`).
    """

    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=False,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )

    json_key: ClassVar[str] = ""
    deprecated_keys: ClassVar[tuple[DeprecatedKey, ...]] = ()
    auto_defaults: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise error_from_validation(exc, type(self), split_path(self.json_key)) from None

    # Mark the wrapper as pydantic's own __init__: otherwise pydantic calls it for every nested
    # section, which would turn nested errors into pre-formatted strings and drop the
    # validation context (the "auto" hints).
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise error_from_validation(exc, type(self), split_path(self.json_key)) from None

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any] | None,
        path: str | None = None,
        *,
        context: dict[str, Any] | None = None,
    ) -> Self:
        """Validate ``data`` (not modified); errors name keys under ``path`` (default ``json_key``)."""
        try:
            return cls.model_validate(dict(data or {}), context=context)
        except ValidationError as exc:
            prefix = split_path(cls.json_key if path is None else path)
            raise error_from_validation(exc, cls, prefix) from None

    @model_validator(mode="before")
    @classmethod
    def _prepare_section_input(cls, data: Any, info: ValidationInfo) -> Any:
        # Runs on the raw mapping of this section (and, on assignment, on the current field
        # values): resolve "auto" first so a deprecated key set to "auto" is simply dropped.
        if not isinstance(data, Mapping):
            return data
        prepared = resolve_auto(cls, dict(data), cls.auto_defaults, info.context)
        return apply_deprecations(prepared, cls.deprecated_keys, cls.json_key)

    def to_dict(self) -> dict[str, Any]:
        """The resolved section as JSON-compatible data (dtypes and enums as their names)."""
        return self.model_dump(mode="json")
