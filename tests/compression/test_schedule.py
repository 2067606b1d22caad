"""The engine steps the compression schedule: each technique turns on at the forward of
optimizer step ``schedule_offset`` (DeepSpeed's order: the scheduler counts after each applied
step, and a check at construction turns on offset 0), the weight bits follow the MoQ schedule,
and a model not prepared by ``init_compression`` is refused. Cases after DeepSpeed's
``tests/unit/compression/test_compression.py``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from shardspeed.compression import init_compression, redundancy_clean
from shardspeed.compression.config import CompressionConfigError
from shardspeed.compression.layers import LinearLayer_Compress
from tests.compression import tiny

OFFSETS = {
    "weight_quantization": 1,
    "sparse_pruning": 2,
    "head_pruning": 3,
    "activation_quantization": 4,
    "row_pruning": 5,
}
STEPS = 18


def _compression() -> dict[str, Any]:
    def shared(name: str, **extra: Any) -> dict[str, Any]:
        return {"enabled": True, "schedule_offset": OFFSETS[name], **extra}

    return {
        "weight_quantization": {
            "shared_parameters": shared("weight_quantization", quantize_groups=4),
            "different_groups": {
                "wq": {
                    "params": {"start_bits": 12, "target_bits": 8, "quantization_period": 2},
                    "modules": ["h.0.attn.c_attn"],
                }
            },
        },
        "sparse_pruning": {
            "shared_parameters": shared("sparse_pruning", method="topk"),
            "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["c_attn"]}},
        },
        "head_pruning": {
            "shared_parameters": shared("head_pruning", method="l1", num_heads=4),
            "different_groups": {
                "hp": {"params": {"dense_ratio": 0.5}, "modules": ["attn.c_proj"]}
            },
        },
        "activation_quantization": {
            "shared_parameters": shared("activation_quantization", range_calibration="static"),
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["mlp.c_proj"]}},
        },
        "row_pruning": {
            "shared_parameters": shared("row_pruning", method="l1"),
            "different_groups": {
                "rp": {
                    "params": {"dense_ratio": 0.25},
                    "modules": ["mlp.c_fc"],
                    "related_modules": [["mlp.c_proj"]],
                }
            },
        },
    }


def _flags(model: torch.nn.Module) -> dict[str, Any]:
    layer = model.get_submodule("transformer.h.0")
    quantizer = layer.attn.c_attn.weight_quantizer
    return {
        "weight_quantization": layer.attn.c_attn.weight_quantization_enabled,
        "sparse_pruning": layer.attn.c_attn.sparse_pruning_enabled,
        "head_pruning": layer.attn.c_proj.head_pruning_enabled,
        "activation_quantization": layer.mlp.c_proj.activation_quantization_enabled,
        "row_pruning": layer.mlp.c_fc.row_pruning_enabled,
        "bits": quantizer.bits if layer.attn.c_attn.weight_quantization_enabled else None,
    }


def test_each_technique_turns_on_at_its_offset_and_bits_follow_the_period() -> None:
    compression = _compression()
    model = init_compression(tiny.build("gpt2"), {"compression_training": compression})
    seen: list[dict[str, Any]] = []
    engine = tiny.train(
        model, "gpt2", STEPS, compression, before_step=lambda e, s: seen.append(_flags(e.module))
    )
    for step, flags in enumerate(seen):
        for technique, offset in OFFSETS.items():
            assert flags[technique] == (step >= offset), (step, technique, flags)
    # MoQ: 12 bits at the offset, one less after 2, 4, 8, 16 steps on (the period doubles)
    expected = [None, 12, 12, 11, 11] + [10] * 4 + [9] * 8 + [8]
    assert [f["bits"] for f in seen] == expected
    assert engine.compression_scheduler.training_steps == STEPS
    assert engine.compression_scheduler.enabled_at == OFFSETS

    # the masks act: half of c_attn, half of the heads, a quarter of c_fc's rows survive
    layer = engine.module.get_submodule("transformer.h.0")
    weight, _ = layer.attn.c_attn.compressed_weight()
    assert (weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)
    assert layer.attn.c_proj.get_mask("head").sum().item() == 2
    assert layer.mlp.c_fc.get_mask("row").sum().item() == 64
    # the learned sparse scores trained (a straight-through gradient reaches them)
    assert layer.attn.c_attn.sparse_mask_scores.grad is not None

    # redundancy_clean: c_fc loses 3/4 of its rows and c_proj the matching input columns
    engine.module.eval()
    for module in engine.module.modules():
        # a one-ulp difference of the smaller matmul can flip an activation's rounding step
        if isinstance(module, LinearLayer_Compress):
            module.activation_quantization_enabled = False
    ids = tiny.batch("gpt2", 3)["input_ids"]
    with torch.no_grad():
        masked = engine.module(ids).logits
    cleaned = redundancy_clean(copy.deepcopy(engine.module), {"compression_training": compression})
    with torch.no_grad():
        torch.testing.assert_close(cleaned(ids).logits, masked, rtol=1e-4, atol=1e-4)
    for i in range(2):
        mlp = cleaned.get_submodule(f"transformer.h.{i}.mlp")
        assert mlp.c_fc.weight.shape == (64, 64) and mlp.c_fc.bias.shape == (64,)
        assert mlp.c_proj.weight.shape == (64, 64)
        assert mlp.c_fc.out_features == mlp.c_proj.in_features == 64
    c_attn = cleaned.get_submodule("transformer.h.0.attn.c_attn")
    assert c_attn.weight.unique().numel() <= 4 * 255  # 8 bits, 4 groups, stored quantized
    assert not hasattr(c_attn, "sparse_mask_scores")


def test_offset_zero_is_on_before_the_first_forward() -> None:
    compression = {
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"sp": {"params": {"dense_ratio": 0.3}, "modules": ["mlp"]}},
        }
    }
    model = init_compression(tiny.build("gpt2"), {"compression_training": compression})
    seen: list[bool] = []
    tiny.train(
        model,
        "gpt2",
        2,
        compression,
        before_step=lambda e, s: seen.append(
            e.module.transformer.h[0].mlp.c_fc.sparse_pruning_enabled
        ),
    )
    assert seen == [True, True]


def test_engine_refuses_a_model_init_compression_did_not_prepare() -> None:
    compression = _compression()
    with pytest.raises(CompressionConfigError, match="init_compression"):
        tiny.train(tiny.build("gpt2"), "gpt2", 1, compression)


def test_no_section_no_scheduler_and_disabled_layers_compute_densely() -> None:
    engine = tiny.train(tiny.build("gpt2"), "gpt2", 1)
    assert engine.compression_scheduler is None
    model = tiny.build("gpt2")
    reference = copy.deepcopy(model).eval()
    init_compression(model, {"compression_training": _compression()})  # nothing on yet
    assert isinstance(model.transformer.h[0].mlp.c_fc, LinearLayer_Compress)
    ids = tiny.batch("gpt2", 4)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, reference(ids).logits)


def test_checkpoint_resume_keeps_the_techniques_and_masks(tmp_path) -> None:
    compression = {
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 2},
            "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["mlp"]}},
        }
    }
    config = {"compression_training": compression}
    engine = tiny.train(init_compression(tiny.build("gpt2"), config), "gpt2", 4, compression)
    engine.save_checkpoint(str(tmp_path), tag="t4")
    mask = engine.module.transformer.h[0].mlp.c_fc.sparse_pruning_mask.clone()

    resumed = tiny.train(
        init_compression(tiny.build("gpt2", seed=1), config), "gpt2", 0, compression
    )
    assert not resumed.module.transformer.h[0].mlp.c_fc.sparse_pruning_enabled
    resumed.load_checkpoint(str(tmp_path), tag="t4")
    layer = resumed.module.transformer.h[0].mlp.c_fc
    assert resumed.compression_scheduler.training_steps == 4
    assert layer.sparse_pruning_enabled and torch.equal(layer.sparse_pruning_mask, mask)
