"""Names DeepSpeed's own tests and clients reach, at DeepSpeed's paths, behaving as DeepSpeed's:
the ZeRO package's exports, ``deepspeed.runtime.engine`` as an attribute after the top-level
import, and the user errors DeepSpeed reports with ``assert`` (caught as ``AssertionError``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import shardspeed
from shardspeed.runtime.engine_checks import NoSyncError, checkpoint_dir
from tests.runtime.parity import MLP


def test_runtime_engine_is_an_attribute_after_import_shardspeed() -> None:
    # a fresh interpreter: nothing has imported the engine module yet
    code = (
        "import sys, shardspeed; engine = shardspeed.runtime.engine; "
        "assert engine is sys.modules['shardspeed.runtime.engine']; "
        "assert engine.DeepSpeedEngine is shardspeed.DeepSpeedEngine; "
        "assert shardspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3; "
        "assert shardspeed.runtime.DeepSpeedOptimizer.__name__ == 'DeepSpeedOptimizer'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        shardspeed.runtime.no_such_module  # noqa: B018 - the attribute access is the test


def test_zero_package_exports() -> None:
    from shardspeed.runtime.zero import (
        GatheredParameters,
        Init,
        MiCS_Init,
        TiledLinear,
        TiledLinearReturnBias,
        ZeroParamStatus,
        ZeroParamType,
        register_external_parameter,
    )

    # DeepSpeed's values, and the very objects of the short paths
    assert {s.name: s.value for s in ZeroParamStatus} == {
        "AVAILABLE": 1,
        "NOT_AVAILABLE": 2,
        "INFLIGHT": 3,
    }
    assert {t.name: t.value for t in ZeroParamType} == {"NORMAL": 1, "PARTITIONED": 2, "REMOTE": 3}
    assert ZeroParamStatus is shardspeed.zero.ZeroParamStatus
    assert GatheredParameters is shardspeed.zero.GatheredParameters
    assert Init is shardspeed.zero.Init and MiCS_Init is shardspeed.zero.MiCS_Init
    assert register_external_parameter is shardspeed.zero.register_external_parameter
    assert issubclass(TiledLinearReturnBias, TiledLinear)
    with pytest.raises(ImportError, match="NoSuchName"):
        from shardspeed.runtime.zero import NoSuchName  # noqa: F401


def test_initialize_without_a_model_is_an_assertion_error() -> None:
    # DeepSpeed: assert model is not None; shardspeed's errors are also Value/TypeErrors
    with pytest.raises(AssertionError, match="requires a model") as missing:
        shardspeed.initialize(config={"train_batch_size": 1})
    assert isinstance(missing.value, ValueError)
    with pytest.raises(AssertionError, match="model=model") as positional:
        shardspeed.initialize(MLP())
    assert isinstance(positional.value, TypeError)


def test_no_sync_error_is_both_kinds() -> None:
    assert issubclass(NoSyncError, RuntimeError) and issubclass(NoSyncError, AssertionError)


@pytest.mark.parametrize("value", [None, ""])
def test_empty_checkpoint_dir_is_refused(value: str | None) -> None:
    with pytest.raises(ValueError, match=r"save_dir must name the checkpoint folder.*\"\.\""):
        checkpoint_dir(value, "save_dir", "save_checkpoint")
    assert checkpoint_dir("ckpt", "save_dir", "save_checkpoint") == "ckpt"
