"""The data analyzer's index files against a direct computation, and the curriculum sampler:
only samples within the current difficulty, per data-parallel rank slices, exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from shardspeed.config.data_efficiency import DataEfficiencyConfig
from shardspeed.runtime.data_pipeline.data_sampling.data_analyzer import (
    DataAnalyzer,
    seqlen_metric,
    vocab_count_metric,
    vocab_rarity_metric,
)
from shardspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from shardspeed.runtime.data_pipeline.data_sampling.indexed_dataset import (
    MMapIndexedDataset,
    write_indexed_dataset,
)

PAD, VOCAB, SEQ, COUNT = 0, 32, 16, 60


class Tokens(Dataset):
    """Padded token rows of lengths 1..SEQ (deterministic)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(1, SEQ + 1, (COUNT,), generator=gen)
        self.rows = torch.randint(1, VOCAB, (COUNT, SEQ), generator=gen)
        for i, n in enumerate(self.lengths.tolist()):
            self.rows[i, n:] = PAD

    def __len__(self) -> int:
        return COUNT

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i]


def _analyze(tmp_path: Path, workers: int = 1) -> Tokens:
    data = Tokens()
    for worker in range(workers):
        analyzer = DataAnalyzer(
            data,
            num_workers=workers,
            worker_id=worker,
            batch_size=7,
            metric_names=["seqlen", "vocab"],
            metric_functions=[seqlen_metric(PAD), vocab_count_metric(VOCAB)],
            metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
            save_path=str(tmp_path),
        )
        analyzer.run_map()
    analyzer.run_reduce()
    return data


def test_indexed_dataset_round_trips(tmp_path: Path) -> None:
    rows = [np.array([3, 1, 2]), np.array([], dtype=np.int64), np.array([7])]
    write_indexed_dataset(tmp_path / "x", rows, np.int64)
    read = MMapIndexedDataset(tmp_path / "x")
    assert len(read) == 3 and [list(read[i]) for i in range(3)] == [[3, 1, 2], [], [7]]
    assert read.dtype == np.int64 and list(read[-1]) == [7]


@pytest.mark.parametrize("workers", [1, 3])
def test_analyzer_index_equals_a_direct_computation(tmp_path: Path, workers: int) -> None:
    data = _analyze(tmp_path, workers)
    lengths = data.lengths.numpy()
    folder = tmp_path / "seqlen"
    values = MMapIndexedDataset(folder / "seqlen_index_to_metric")
    samples = MMapIndexedDataset(folder / "seqlen_index_to_sample")
    assert [int(values[i][0]) for i in range(len(values))] == sorted(set(lengths.tolist()))
    for i in range(len(values)):
        assert sorted(samples[i].tolist()) == np.flatnonzero(lengths == values[i][0]).tolist()
    assert list(MMapIndexedDataset(folder / "seqlen_sample_to_metric")[0]) == lengths.tolist()
    merged = MMapIndexedDataset(folder / "seqlen_index_to_sample_percentile_merged")
    in_order = np.concatenate([merged[i] for i in range(len(merged))])
    assert sorted(in_order.tolist()) == list(range(COUNT))
    assert np.all(np.diff(lengths[in_order]) >= 0)  # rows go up in metric
    counts = np.bincount(data.rows.reshape(-1).numpy(), minlength=VOCAB)
    assert list(MMapIndexedDataset(tmp_path / "vocab" / "vocab_metric_value")[0]) == counts.tolist()


def test_vocab_rarity_is_minus_log_frequency() -> None:
    counts = np.array([1, 3, 6])
    rarity = vocab_rarity_metric(counts)(torch.tensor([[0, 2], [1, 1]]))
    logp = np.log(counts / counts.sum())
    assert rarity.tolist() == [round(-(logp[0] + logp[2]) * 100), round(-2 * logp[1] * 100)]


def _config(tmp_path: Path, kind: str = "value", **schedule: Any) -> DataEfficiencyConfig:
    folder = tmp_path / "seqlen"
    metric = {
        "index_to_sample_path": str(folder / "seqlen_index_to_sample"),
        "index_to_metric_path": str(folder / "seqlen_index_to_metric"),
        "difficulty_type": kind,
        "min_difficulty": 4 if kind == "value" else 10,
        "max_difficulty": SEQ if kind == "value" else 100,
        "schedule_type": "fixed_linear",
        "schedule_config": schedule or {"total_curriculum_step": 6, "difficulty_step": 2},
    }
    if kind == "percentile":
        metric["index_to_sample_path"] = str(folder / "seqlen_index_to_sample_percentile_merged")
    return DataEfficiencyConfig.from_dict(
        {
            "enabled": True,
            "seed": 7,
            "data_sampling": {
                "enabled": True,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": str(tmp_path / "clusters"),
                    "curriculum_metrics": {"seqlen": metric},
                },
            },
        }
    )


def _sampler(config: DataEfficiencyConfig, rank: int = 0, world: int = 1) -> DeepSpeedDataSampler:
    return DeepSpeedDataSampler(config, COUNT, 2, rank, world, gradient_accumulation_steps=2)


def test_sampler_yields_only_samples_within_the_difficulty(tmp_path: Path) -> None:
    lengths = _analyze(tmp_path).lengths
    sampler = _sampler(_config(tmp_path))
    scheduler_steps = []
    for n, batch in zip(range(40), sampler, strict=False):
        difficulty = sampler.current_difficulties["seqlen"]
        assert len(batch) == 2 and all(int(lengths[i]) <= difficulty for i in batch), n
        scheduler_steps.append(difficulty)
    # a global batch is 2 micro-batches: the difficulty moves every second one, by the formula
    expected = [min(max(int((s / 6) * 12 + 4) // 2 * 2, 4), 16) for s in range(1, 21)]
    assert scheduler_steps == [d for d in expected for _ in range(2)]
    assert scheduler_steps[0] == 6 and scheduler_steps[-1] == SEQ


def test_sampler_percentile(tmp_path: Path) -> None:
    lengths = _analyze(tmp_path).lengths
    sampler = _sampler(
        _config(tmp_path, "percentile", total_curriculum_step=10, difficulty_step=10)
    )
    order = np.argsort(lengths.numpy(), kind="stable")
    seen = []
    for _, batch in zip(range(20), sampler, strict=False):
        pct = sampler.current_difficulties["seqlen"]
        seen.append(pct)
        assert set(batch) <= set(order[: COUNT * pct // 100].tolist()), pct
    assert seen[0] == 10 and seen[-1] == 100  # percentiles 10, 10, 20, ... 100


def test_ranks_take_disjoint_slices_of_the_same_batch(tmp_path: Path) -> None:
    _analyze(tmp_path)
    config = _config(tmp_path)
    ranks = [_sampler(config, r, 2) for r in range(2)]
    for _, (a, b) in zip(range(10), zip(*ranks, strict=False), strict=False):
        assert len(a) == len(b) == 2 and not set(a) & set(b)


def test_sampler_resumes_exactly(tmp_path: Path) -> None:
    _analyze(tmp_path)
    config = _config(tmp_path)
    first = _sampler(config)
    it = iter(first)
    for _ in range(5):  # stop mid global batch
        next(it)
    saved = first.state_dict()
    rest = [next(it) for _ in range(12)]
    resumed = _sampler(config)
    resumed.load_state_dict(saved)
    assert [b for _, b in zip(range(12), resumed, strict=False)] == rest
    assert resumed.current_difficulties == first.current_difficulties
