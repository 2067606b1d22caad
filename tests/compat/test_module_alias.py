"""The alias finder: ``alias.X`` is the module ``target.X``; the deepspeed front forwards."""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import shardspeed
import shardspeed.runtime.engine
from shardspeed.compat import deepspeed_shim
from shardspeed.compat.module_alias import AliasFinder, install_alias, uninstall_alias

ALIAS = "ss_alias_under_test"
COMPAT_DIR = Path(__file__).resolve().parents[2] / "compat" / "deepspeed"


@pytest.fixture
def alias() -> Iterator[AliasFinder]:
    sys.modules[ALIAS] = shardspeed
    finder = install_alias(ALIAS, "shardspeed")
    yield finder
    uninstall_alias(ALIAS)


def test_submodules_are_the_same_objects(alias: AliasFinder) -> None:
    engine = importlib.import_module(f"{ALIAS}.runtime.engine")
    assert engine is shardspeed.runtime.engine
    assert engine.DeepSpeedEngine is shardspeed.runtime.engine.DeepSpeedEngine
    assert sys.modules[f"{ALIAS}.runtime"] is sys.modules["shardspeed.runtime"]
    # the shared module keeps its own spec and name
    assert engine.__spec__ is not None and engine.__spec__.name == "shardspeed.runtime.engine"
    assert engine.__name__ == "shardspeed.runtime.engine"
    assert importlib.reload(engine) is engine


def test_missing_submodule_names_both(alias: AliasFinder) -> None:
    with pytest.raises(ModuleNotFoundError, match="shardspeed.no_such_module") as info:
        importlib.import_module(f"{ALIAS}.no_such_module")
    assert info.value.name == f"{ALIAS}.no_such_module"


def test_install_is_idempotent_and_refuses_a_second_target(alias: AliasFinder) -> None:
    assert install_alias(ALIAS, "shardspeed") is alias
    assert sum(isinstance(f, AliasFinder) and f.alias == ALIAS for f in sys.meta_path) == 1
    with pytest.raises(ImportError, match="already an alias"):
        install_alias(ALIAS, "torch")


def test_uninstall_removes_finder_and_modules(alias: AliasFinder) -> None:
    importlib.import_module(f"{ALIAS}.comm")
    uninstall_alias(ALIAS)
    assert alias not in sys.meta_path
    assert not [n for n in sys.modules if n.startswith(ALIAS)]
    assert sys.modules["shardspeed.comm"] is not None


def test_compat_version_is_pep440_and_passes_hf_checks() -> None:
    version = Version(deepspeed_shim.compat_version())
    assert version.local == f"shardspeed.{shardspeed.__version__}"
    assert version in SpecifierSet(">=0.9.3")
    assert Version(deepspeed_shim.compat_version()).public == deepspeed_shim.DEEPSPEED_API_VERSION


def test_distribution_version_matches_the_shim() -> None:
    text = (COMPAT_DIR / "pyproject.toml").read_text(encoding="utf-8")
    assert f'version = "{deepspeed_shim.compat_version()}"' in text
    assert f'"shardspeed=={shardspeed.__version__}"' in text
    assert "REPLACES a deepspeed install" in text


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_front_forwards_and_logs_once() -> None:
    front = types.ModuleType("deepspeed")
    front.__file__ = "front.py"
    namespace = front.__dict__
    sys.modules["deepspeed"] = front
    log = logging.getLogger("shardspeed.compat")
    records, level = _Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    try:
        deepspeed_shim.attach(namespace)
        assert namespace["__version__"] == deepspeed_shim.compat_version()
        assert namespace["__version_major__"] == 0 and namespace[deepspeed_shim.SHIM_MARKER]
        forward = namespace["__getattr__"]
        assert forward("DeepSpeedEngine") is shardspeed.runtime.engine.DeepSpeedEngine
        zero = forward("zero")  # a subpackage DeepSpeed's __init__ imports eagerly
        assert zero is importlib.import_module("shardspeed.zero")
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            forward("nope")
        assert "initialize" in dir(front) and front.comm is shardspeed.comm
    finally:
        uninstall_alias("deepspeed")
        log.removeHandler(records)
        log.setLevel(level)
    assert len(records.messages) == 1
    assert "shardspeed compatibility package" in records.messages[0]


def test_which_deepspeed_without_any(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.setattr(deepspeed_shim.importlib.util, "find_spec", lambda name: None)
    assert deepspeed_shim.which_deepspeed()["answer"] == "none"


def test_which_deepspeed_tells_shim_from_real(monkeypatch: pytest.MonkeyPatch) -> None:
    shim = importlib.machinery.ModuleSpec(
        "deepspeed", None, origin=str(COMPAT_DIR / "deepspeed" / "__init__.py")
    )
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.setattr(deepspeed_shim.importlib.util, "find_spec", lambda name: shim)
    assert deepspeed_shim.which_deepspeed()["answer"] == "shardspeed-compat"
    real = importlib.machinery.ModuleSpec(
        "deepspeed", None, origin=__file__.replace("test_module_alias", "nothing")
    )
    monkeypatch.setattr(deepspeed_shim.importlib.util, "find_spec", lambda name: real)
    assert deepspeed_shim.which_deepspeed()["answer"] == "deepspeed"
