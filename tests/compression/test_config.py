"""``compression_training`` validation: bad sections are errors that name the key (also
``AssertionError``s, as DeepSpeed asserts them), the root config validates the section, a JSON
path works, and init_compression refuses what it cannot do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shardspeed.compression import init_compression
from shardspeed.compression.config import CompressionConfigError, get_compression_config
from shardspeed.config import DeepSpeedConfig
from tests.compression import tiny

WQ_GROUP = {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["mlp"]}


def _wq(shared: dict[str, Any], groups: dict[str, Any] | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {"shared_parameters": {"enabled": True, **shared}}
    if groups is not None:
        section["different_groups"] = groups
    return {"weight_quantization": section}


BAD = [
    (_wq({}), r"weight_quantization.*different_groups is missing"),
    (_wq({}, {"g": {"params": {"start_bits": 8}}}), r"different_groups\.g\.params\.target_bits"),
    (
        _wq({}, {"g": {"params": {"start_bits": 4, "target_bits": 8}}}),
        r"start_bits=4 is below target_bits=8",
    ),
    (_wq({"quantization_type": "sym"}, {"g": WQ_GROUP}), r"shared_parameters\.quantization_type"),
    (_wq({"rounding": "up"}, {"g": WQ_GROUP}), r"shared_parameters\.rounding"),
    (_wq({"schedul_offset": 3}, {"g": WQ_GROUP}), r"did you mean 'schedule_offset'"),
    (
        {
            "sparse_pruning": {
                "shared_parameters": {"enabled": True, "method": "snip_momentum"},
                "different_groups": {"g": {"params": {"dense_ratio": 0.5}}},
            }
        },
        r"sparse_pruning\.shared_parameters\.method",
    ),
    (
        {
            "sparse_pruning": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"g": {"params": {"dense_ratio": 1.5}}},
            }
        },
        r"different_groups\.g\.params\.dense_ratio",
    ),
    (
        {
            "head_pruning": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"g": {"params": {"dense_ratio": 0.5}}},
            }
        },
        r"head_pruning\.shared_parameters: num_heads is required",
    ),
    (
        {
            "activation_quantization": {
                "shared_parameters": {"enabled": True},
                "different_groups": {"g": {"params": {"bits": 6}}},
            }
        },
        r"different_groups\.g\.params\.bits",
    ),
    (
        {
            "row_pruning": {
                "shared_parameters": {"enabled": True},
                "different_groups": {
                    "g": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["a", "b"],
                        "related_modules": [["c"]],
                    }
                },
            }
        },
        r"related_modules has 1 entries but modules has 2",
    ),
    (
        {"layer_reduction": {"enabled": True, "teacher_layer": [1]}},
        r"layer_reduction: module_name_prefix is required",
    ),
    (
        {
            "layer_reduction": {
                "enabled": True,
                "module_name_prefix": "h",
                "keep_number_layer": 2,
                "teacher_layer": [1],
            }
        },
        r"keep_number_layer=2 but teacher_layer names 1",
    ),
    ({"weight_quantisation": {}}, r"did you mean 'weight_quantization'"),
]


@pytest.mark.parametrize(("section", "message"), BAD)
def test_bad_sections_name_the_key(section: dict[str, Any], message: str) -> None:
    with pytest.raises(CompressionConfigError, match=message) as caught:
        get_compression_config({"compression_training": section})
    assert isinstance(caught.value, AssertionError) and isinstance(caught.value, ValueError)
    assert "compression_training" in str(caught.value)
    # the engine's config validates the same section
    with pytest.raises(ValueError, match=message):
        DeepSpeedConfig({"train_batch_size": 1, "compression_training": section})


def test_defaults_and_json_path(tmp_path: Path) -> None:
    config = get_compression_config({})
    assert config.enabled_techniques() == []
    assert config.weight_quantization.shared_parameters.schedule_offset == 0
    assert config.sparse_pruning.shared_parameters.schedule_offset == 1000  # DeepSpeed's
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"compression_training": _wq({}, {"g": WQ_GROUP})}))
    loaded = get_compression_config(str(path))
    assert loaded.enabled_techniques() == ["weight_quantization"]
    assert loaded.weight_quantization.different_groups["g"].params["quantization_period"] == 1
    with pytest.raises(ValueError, match="existing DeepSpeed JSON config"):
        get_compression_config(str(tmp_path / "missing.json"))


def test_init_compression_refusals() -> None:
    reduction = {
        "layer_reduction": {
            "enabled": True,
            "module_name_prefix": "transformer.h",
            "teacher_layer": [0],
        }
    }
    with pytest.raises(CompressionConfigError, match="no teacher_model"):
        init_compression(tiny.build("gpt2"), {"compression_training": reduction})
    bad_prefix = {"layer_reduction": {**reduction["layer_reduction"], "module_name_prefix": "h"}}
    with pytest.raises(CompressionConfigError, match="check module_name_prefix"):
        init_compression(
            tiny.build("gpt2"),
            {"compression_training": bad_prefix},
            teacher_model=tiny.build("gpt2"),
        )
    twice = _wq({}, {"a": WQ_GROUP, "b": WQ_GROUP})
    with pytest.raises(ValueError, match="already compressed by another group"):
        init_compression(tiny.build("gpt2"), {"compression_training": twice})
    on_embedding = {
        "activation_quantization": {
            "shared_parameters": {"enabled": True},
            "different_groups": {"g": {"params": {"bits": 8}, "modules": ["wte"]}},
        }
    }
    with pytest.raises(
        CompressionConfigError, match=r"names 'transformer\.wte' \(Embedding_Compress\)"
    ):
        init_compression(tiny.build("gpt2"), {"compression_training": on_embedding})
    heads = {
        "head_pruning": {
            "shared_parameters": {"enabled": True, "num_heads": 3},
            "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["attn.c_proj"]}},
        }
    }
    with pytest.raises(ValueError, match="num_heads=3 does not divide"):
        init_compression(tiny.build("gpt2"), {"compression_training": heads})
