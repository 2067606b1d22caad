"""Loading configs: dicts (never mutated), JSON and HJSON files by content, errors naming the file."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardspeed.config import (
    DeepSpeedConfig,
    DeepSpeedConfigError,
    config_source_from_args,
    load_config_dict,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# every DeepSpeed config shipped anywhere under examples/
EXAMPLE_FILES = sorted(EXAMPLES.rglob("*.json")) + sorted(EXAMPLES.rglob("*.hjson"))


def test_examples_exist() -> None:
    assert len(EXAMPLE_FILES) >= 6
    assert any(p.suffix == ".hjson" for p in EXAMPLE_FILES)


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("world", [1, 2])
def test_every_example_loads(path: Path, world: int) -> None:
    raw = load_config_dict(path)
    params = [raw.get(section, {}).get("params", {}) for section in ("optimizer", "scheduler")]
    if any(v == "auto" for p in params for v in p.values()):
        # a config for the HF Trainer (examples/hf_*.py), which fills these in
        with pytest.raises(DeepSpeedConfigError, match="only the HuggingFace Trainer fills in"):
            DeepSpeedConfig(path, dp_world_size=world)
        return
    cfg = DeepSpeedConfig(path, dp_world_size=world)
    micro, gas = cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    assert cfg.train_batch_size == micro * gas * world
    assert DeepSpeedConfig(str(path), dp_world_size=world).raw == cfg.raw


def test_hjson_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.txt"  # the extension does not matter
    path.write_text(
        "# a comment\n{\n  // another\n  train_batch_size: 8\n  /* block */\n"
        "  zero_optimization: {\n    stage: 2\n  }\n}\n"
    )
    cfg = DeepSpeedConfig(path, dp_world_size=2)
    assert cfg.zero_optimization.stage == 2 and cfg.train_micro_batch_size_per_gpu == 4


def test_dict_is_not_mutated() -> None:
    user = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2, "cpu_offload": True, "reduce_bucket_size": "auto"},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    }
    snapshot = copy.deepcopy(user)
    cfg = DeepSpeedConfig(user, dp_world_size=1)
    assert user == snapshot
    assert cfg.raw == snapshot
    cfg.raw["train_batch_size"] = 99  # raw hands out a copy
    assert cfg.raw == snapshot


def test_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(DeepSpeedConfigError, match=r"nope\.json.*does not exist"):
        DeepSpeedConfig(missing)


def test_parse_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,,}\n}\n')
    with pytest.raises(DeepSpeedConfigError, match=r"bad\.json.*line 3"):
        DeepSpeedConfig(path)


def test_duplicate_keys_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(DeepSpeedConfigError, match="duplicate key 'train_batch_size'"):
        load_config_dict(path)


def test_top_level_must_be_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(DeepSpeedConfigError, match="JSON object"):
        load_config_dict(path)


def test_base64_config() -> None:
    text = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 4}).encode()).decode()
    assert load_config_dict(text) == {"train_batch_size": 4}


def test_wrong_type() -> None:
    with pytest.raises(DeepSpeedConfigError, match="must be a dict or a path"):
        load_config_dict(42)  # type: ignore[arg-type]


def test_config_from_args(ds_log: object) -> None:
    assert config_source_from_args(SimpleNamespace(deepspeed_config="a.json")) == "a.json"
    assert config_source_from_args(None, {"x": 1}) == {"x": 1}
    assert config_source_from_args(SimpleNamespace(deepscale_config="b.json")) == "b.json"
    with pytest.raises(DeepSpeedConfigError, match="both"):
        config_source_from_args(SimpleNamespace(deepspeed_config="a.json"), {"x": 1})
