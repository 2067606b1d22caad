"""``data_efficiency`` and the legacy ``curriculum_learning`` section.

``data_efficiency`` has two parts: ``data_sampling.curriculum_learning`` (feed easy samples
first: a sampler keeps samples whose metric is at most a scheduled difficulty) and
``data_routing.random_ltd`` (random layerwise token dropping: chosen layers see a scheduled
number of tokens). The legacy ``curriculum_learning`` section is the older seqlen curriculum:
the engine passes the scheduled length to the model's forward as ``curriculum_seqlen``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from shardspeed.config.base import DeepSpeedConfigModel

__all__ = [
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "CurriculumScheduleConfig",
    "DataEfficiencyConfig",
    "DataRoutingConfig",
    "DataSamplingConfig",
    "LayerTokenLRScheduleConfig",
    "LegacyCurriculumConfig",
    "RandomLTDConfig",
    "RandomLTDScheduleConfig",
    "RandomLTDScheduleParams",
]

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]

#: the ``schedule_config`` keys each schedule type needs
_REQUIRED_SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


class CurriculumScheduleConfig(DeepSpeedConfigModel):
    """``schedule_config`` of a curriculum: which keys matter depends on ``schedule_type``."""

    total_curriculum_step: int | None = Field(default=None, gt=0)
    """Steps from ``min_difficulty`` to ``max_difficulty`` (fixed_linear, fixed_root)."""
    difficulty_step: int | None = Field(default=None, gt=0)
    """Every difficulty is a multiple of this (fixed_linear, fixed_root)."""
    root_degree: float | None = Field(default=None, gt=0)
    """2: square root, 3: cube root, 1: linear (fixed_root)."""
    difficulty: list[int] | None = None
    """The difficulties in order (fixed_discrete)."""
    max_step: list[int] | None = None
    """The last step of each difficulty but the last (fixed_discrete; one entry fewer)."""


class _Curriculum(DeepSpeedConfigModel):
    """The schedule fields both curricula share, checked together."""

    min_difficulty: int | None = None
    """First difficulty (a sequence length for seqlen, a metric value or a percentile)."""
    max_difficulty: int | None = None
    """Last difficulty."""
    schedule_type: ScheduleType | None = None
    """How difficulty grows with the step."""
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)

    def _check_schedule(self) -> None:
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if getattr(self, key) is None:
                raise ValueError(f"curriculum learning requires '{key}'")
        assert self.min_difficulty is not None and self.max_difficulty is not None
        if self.min_difficulty > self.max_difficulty:
            raise ValueError(
                f"min_difficulty ({self.min_difficulty}) is above max_difficulty "
                f"({self.max_difficulty}); swap them"
            )
        assert self.schedule_type is not None
        sched = self.schedule_config
        for key in _REQUIRED_SCHEDULE_KEYS[self.schedule_type]:
            if getattr(sched, key) is None:
                raise ValueError(
                    f"schedule_type '{self.schedule_type}' requires 'schedule_config.{key}'"
                )
        if self.schedule_type == "fixed_discrete":
            assert sched.difficulty is not None and sched.max_step is not None
            if not sched.difficulty or len(sched.difficulty) != len(sched.max_step) + 1:
                raise ValueError(
                    "schedule_config.difficulty must have exactly one more entry than "
                    f"schedule_config.max_step (got {len(sched.difficulty)} and "
                    f"{len(sched.max_step)}): the last difficulty holds for every later step"
                )

    def scheduler_config(self) -> dict[str, Any]:
        """The dict :class:`CurriculumScheduler` takes (DeepSpeed's keys)."""
        return {
            "min_difficulty": self.min_difficulty,
            "max_difficulty": self.max_difficulty,
            "schedule_type": self.schedule_type,
            "schedule_config": self.schedule_config.model_dump(exclude_none=True),
        }


class CurriculumMetricConfig(_Curriculum):
    """One entry of ``curriculum_metrics``: the data analyzer's index files and a schedule."""

    index_to_sample_path: str | None = None
    """Index file: row ``i`` holds the samples of the ``i``-th metric value (or percentile)."""
    index_to_metric_path: str | None = None
    """Index file: row ``i`` holds the ``i``-th metric value (``difficulty_type`` value)."""
    difficulty_type: Literal["value", "percentile"] = "value"
    """Whether difficulties are metric values or percentiles of the sorted samples."""
    clustering_type: Literal["schedule_based", "single_cluster"] = "schedule_based"
    """``single_cluster``: the metric does not filter (every sample is in)."""

    @model_validator(mode="after")
    def _complete(self) -> CurriculumMetricConfig:
        self._check_schedule()
        if self.clustering_type == "schedule_based":
            needed = ["index_to_sample_path"]
            if self.difficulty_type == "value":
                needed.append("index_to_metric_path")
            for key in needed:
                if getattr(self, key) is None:
                    raise ValueError(
                        f"'{key}' is required (the data analyzer's output) with "
                        f"clustering_type 'schedule_based' and difficulty_type "
                        f"'{self.difficulty_type}'"
                    )
        return self


class CurriculumLearningConfig(DeepSpeedConfigModel):
    """``data_efficiency.data_sampling.curriculum_learning``."""

    enabled: bool = False
    data_cluster_path: str | None = None
    """Folder where the sampler writes the sample clusters of each difficulty."""
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)
    """Metric name -> its index files and schedule."""

    @model_validator(mode="after")
    def _metrics_when_enabled(self) -> CurriculumLearningConfig:
        if self.enabled and not self.curriculum_metrics:
            raise ValueError("curriculum learning is enabled: 'curriculum_metrics' must be given")
        if self.enabled and self.data_cluster_path is None:
            raise ValueError("curriculum learning is enabled: 'data_cluster_path' must be given")
        return self


class DataSamplingConfig(DeepSpeedConfigModel):
    """``data_efficiency.data_sampling``."""

    enabled: bool = False
    num_epochs: int = Field(default=1000, gt=0)
    """Epochs the curriculum sampler may draw (its length is epochs x dataset size)."""
    num_workers: int = Field(default=0, ge=0)
    """DataLoader workers of the curriculum loader."""
    pin_memory: bool = False
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig)
    dynamic_batching: dict[str, Any] | None = None
    """Accepted; shardspeed does not do dynamic batching (see the README)."""


class RandomLTDScheduleParams(DeepSpeedConfigModel):
    """``random_ltd_schedule.schedule_config``."""

    require_steps: int = Field(gt=0)
    """Steps from ``min_value`` to ``max_value``."""
    seq_per_step: int = Field(gt=0)
    """Kept lengths are multiples of this."""


class RandomLTDScheduleConfig(DeepSpeedConfigModel):
    """``random_ltd_schedule``: how many tokens the chosen layers keep, by step."""

    min_value: int = Field(gt=0)
    """Tokens kept at step 0."""
    max_value: int = Field(gt=0)
    """Tokens kept from ``require_steps`` on (the full sequence length)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    schedule_config: RandomLTDScheduleParams

    @model_validator(mode="after")
    def _ordered(self) -> RandomLTDScheduleConfig:
        if self.min_value > self.max_value:
            raise ValueError(
                f"min_value ({self.min_value}) is above max_value ({self.max_value}); swap them"
            )
        return self


class LayerTokenLRScheduleConfig(DeepSpeedConfigModel):
    """``layer_token_lr_schedule``: accepted; enabling it is refused, as in DeepSpeed."""

    enabled: bool = False
    total_layer_tokens: int | None = None
    warmup_type: str | None = None
    warmup_layer_tokens: int | None = None


class RandomLTDConfig(DeepSpeedConfigModel):
    """``data_efficiency.data_routing.random_ltd``."""

    enabled: bool = False
    total_layer_num: int | None = Field(default=None, gt=0)
    """Layers of the model (for the consumed layer-token count)."""
    random_ltd_layer_num: int | None = Field(default=None, ge=0)
    """How many layers drop tokens; equals ``len(random_ltd_layer_id)``."""
    random_ltd_layer_id: list[int] | None = None
    """Which converted layers drop tokens (their order among the converted layers)."""
    model_mask_name: str | None = None
    """Keyword of the attention mask in the layers' forward (None: no mask)."""
    model_type: Literal["decoder", "encoder"] = "decoder"
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    micro_batch_size: int | None = None
    """Filled in by the engine."""
    global_batch_size: int | None = None
    """Filled in by the engine."""
    random_ltd_schedule: RandomLTDScheduleConfig | None = None
    layer_token_lr_schedule: LayerTokenLRScheduleConfig = Field(
        default_factory=LayerTokenLRScheduleConfig
    )

    @model_validator(mode="after")
    def _complete(self) -> RandomLTDConfig:
        if not self.enabled:
            return self
        for key in ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id"):
            if getattr(self, key) is None:
                raise ValueError(f"random_ltd is enabled: '{key}' must be given")
        if self.random_ltd_schedule is None:
            raise ValueError("random_ltd is enabled: 'random_ltd_schedule' must be given")
        assert self.random_ltd_layer_id is not None
        if self.random_ltd_layer_num != len(self.random_ltd_layer_id):
            raise ValueError(
                f"random_ltd_layer_num ({self.random_ltd_layer_num}) must equal the length of "
                f"random_ltd_layer_id {self.random_ltd_layer_id}"
            )
        assert self.total_layer_num is not None
        bad = [i for i in self.random_ltd_layer_id if not 0 <= i < self.total_layer_num]
        if bad:
            raise ValueError(
                f"random_ltd_layer_id {bad} outside [0, total_layer_num={self.total_layer_num})"
            )
        return self


class DataRoutingConfig(DeepSpeedConfigModel):
    """``data_efficiency.data_routing``."""

    enabled: bool = False
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)


class DataEfficiencyConfig(DeepSpeedConfigModel):
    """``data_efficiency``: curriculum data sampling and random-LTD data routing."""

    json_key: ClassVar[str] = "data_efficiency"

    enabled: bool = False
    seed: int = 1234
    """Seed of the curriculum sampler's draws."""
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)

    @property
    def curriculum_enabled(self) -> bool:
        """Whether the curriculum sampler is on (every enclosing ``enabled`` too)."""
        sampling = self.data_sampling
        return self.enabled and sampling.enabled and sampling.curriculum_learning.enabled

    @property
    def random_ltd_enabled(self) -> bool:
        """Whether random-LTD is on (every enclosing ``enabled`` too)."""
        routing = self.data_routing
        return self.enabled and routing.enabled and routing.random_ltd.enabled


class LegacyCurriculumConfig(_Curriculum):
    """The legacy top-level ``curriculum_learning`` section (seqlen curriculum)."""

    json_key: ClassVar[str] = "curriculum_learning"

    enabled: bool = False
    curriculum_type: Literal["seqlen"] = "seqlen"
    """What the difficulty is: the sequence length passed as ``curriculum_seqlen``."""

    @model_validator(mode="after")
    def _complete(self) -> LegacyCurriculumConfig:
        if self.enabled:
            self._check_schedule()
        return self
