"""DeepSpeed's legacy AutoTP calls (`runtime/tensor_parallel/legacy.py`): `set_autotp_mode`,
`tp_model_init` as a record of its arguments, and how `merge_tp_settings` reconciles that record
with the config and an mpu."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import shardspeed
from shardspeed.runtime.tensor_parallel import legacy
from shardspeed.runtime.tensor_parallel.legacy import (
    MODEL_ATTRIBUTE,
    TPInitRecord,
    clear_tp_model_init,
    is_autotp_training_mode,
    merge_tp_settings,
    recorded_tp_model_init,
    set_autotp_mode,
    tp_model_init,
)
from shardspeed.runtime.zero.comm_group import CommGroup


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    clear_tp_model_init()
    yield
    clear_tp_model_init()


class _Group:
    """Stands in for a ProcessGroup: only its size is read."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _MPU:
    """A Megatron-style mpu reporting a tensor-parallel size."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def get_model_parallel_world_size(self) -> int:
        return self.tp


# --- the entry points --------------------------------------------------------------------------


def test_set_autotp_mode_switches_between_training_and_inference() -> None:
    assert not is_autotp_training_mode()
    set_autotp_mode(training=True)
    assert is_autotp_training_mode()
    assert legacy.get_auto_tp_mode() is legacy.AUTOTP_MODE.TRAINING
    set_autotp_mode()
    assert not is_autotp_training_mode()


def test_the_legacy_names_resolve_where_deepspeed_users_look() -> None:
    import shardspeed.module_inject as module_inject
    import shardspeed.module_inject.layers as layers

    assert shardspeed.tp_model_init is tp_model_init
    assert shardspeed.set_autotp_mode is set_autotp_mode
    assert module_inject.set_autotp_mode is set_autotp_mode
    assert layers.is_autotp_training_mode is is_autotp_training_mode


def test_tp_model_init_records_and_returns_the_model_unchanged() -> None:
    model = nn.Linear(4, 6)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    group = _Group(2)
    returned = tp_model_init(model, tp_size=2, dtype=torch.bfloat16, tp_group=group)
    assert returned is model
    assert model.weight.shape == (6, 4)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name])
    expected = TPInitRecord(tp_size=2, dtype=torch.bfloat16, tp_group=group)
    assert recorded_tp_model_init() == expected
    assert getattr(model, MODEL_ATTRIBUTE) == expected
    assert is_autotp_training_mode()  # as DeepSpeed's tp_model_init does


def test_tp_model_init_refuses_bad_arguments_and_a_conflicting_second_call() -> None:
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        tp_model_init(nn.Linear(2, 2), tp_size=0, dtype=torch.float16)
    with pytest.raises(TypeError, match="torch.dtype"):
        tp_model_init(nn.Linear(2, 2), tp_size=2, dtype="bf16")  # type: ignore[arg-type]
    tp_model_init(nn.Linear(2, 2), tp_size=2, dtype=torch.float16)
    tp_model_init(nn.Linear(2, 2), tp_size=2, dtype=torch.float16)  # the same again is fine
    with pytest.raises(ValueError, match="tp_size=4.*after tp_size=2"):
        tp_model_init(nn.Linear(2, 2), tp_size=4, dtype=torch.float16)
    with pytest.raises(ValueError, match="different tp_group"):
        tp_model_init(nn.Linear(2, 2), tp_size=2, dtype=torch.float16, tp_group=_Group(2))


# --- merge_tp_settings -------------------------------------------------------------------------


def test_no_tensor_parallel_source_means_no_autotp_training() -> None:
    assert merge_tp_settings(0, None, None, None) is None
    assert merge_tp_settings(0, torch.bfloat16, None, _MPU(2)) is None  # an mpu alone: no AutoTP


def test_training_mode_without_any_size_is_an_error() -> None:
    set_autotp_mode(training=True)
    with pytest.raises(ValueError, match="set tensor_parallel.autotp_size"):
        merge_tp_settings(0, None, None, None)
    assert merge_tp_settings(2, None, None, None) == TPInitRecord(tp_size=2, dtype=None)


def test_the_config_alone_gives_the_settings() -> None:
    assert merge_tp_settings(4, torch.bfloat16, None, None) == TPInitRecord(4, torch.bfloat16)


def test_the_record_fills_what_the_config_leaves_out() -> None:
    group = _Group(2)
    record = TPInitRecord(tp_size=2, dtype=torch.bfloat16, tp_group=group)
    assert merge_tp_settings(0, None, record, None) == record
    assert merge_tp_settings(2, torch.bfloat16, record, None) == record
    # an fp32 config (no dtype) takes tp_model_init's
    assert merge_tp_settings(2, None, TPInitRecord(2, torch.float16), _MPU(2)) == TPInitRecord(
        2, torch.float16
    )


def test_a_size_conflict_names_both_values() -> None:
    with pytest.raises(
        ValueError, match=r"autotp_size: the config says 2, tp_model_init said tp_size=1"
    ):
        merge_tp_settings(2, None, TPInitRecord(1, torch.float16), None)


def test_a_dtype_conflict_names_both_dtypes() -> None:
    with pytest.raises(ValueError, match=r"Conflicting dtype.*torch.bfloat16.*torch.float16"):
        merge_tp_settings(0, torch.bfloat16, TPInitRecord(1, torch.float16), None)


def test_a_tp_group_and_an_mpu_are_two_group_sources() -> None:
    record = TPInitRecord(1, torch.float16, tp_group=_Group(1))
    with pytest.raises(ValueError, match="pass only one of them"):
        merge_tp_settings(0, None, record, _MPU(1))


def test_the_group_size_must_be_the_tensor_parallel_size() -> None:
    with pytest.raises(ValueError, match="tp_group has 4 ranks but the tensor-parallel size is 2"):
        merge_tp_settings(0, None, TPInitRecord(2, torch.float16, tp_group=_Group(4)), None)
    comm_group = CommGroup(group=None, rank=0, world_size=2)
    merged = merge_tp_settings(2, None, TPInitRecord(2, torch.float16, tp_group=comm_group), None)
    assert merged is not None and merged.tp_group is comm_group


def test_the_mpu_size_must_be_the_tensor_parallel_size() -> None:
    with pytest.raises(
        ValueError, match="mpu's tensor-parallel world size is 1 but the tensor-parallel size is 2"
    ):
        merge_tp_settings(2, None, None, _MPU(1))
    with pytest.raises(ValueError, match="world size is 4"):
        merge_tp_settings(0, None, TPInitRecord(2, torch.float16), _MPU(4))
    assert merge_tp_settings(2, None, None, _MPU(2)) == TPInitRecord(2, None)


def test_tp_model_init_then_merge_end_to_end() -> None:
    model = tp_model_init(nn.Linear(2, 2), tp_size=2, dtype=torch.bfloat16)
    record = getattr(model, MODEL_ATTRIBUTE)
    assert merge_tp_settings(0, torch.bfloat16, record, _MPU(2)) == TPInitRecord(2, torch.bfloat16)
    with pytest.raises(ValueError, match="Conflicting dtype"):
        merge_tp_settings(0, torch.float16, recorded_tp_model_init(), None)
