"""Each technique on a tiny BERT (masked LM) and a tiny GPT-2, trained through the engine on a
learnable token stream: the dense model trains ``PRETRAIN`` steps, then it and each compressed
copy train ``FINETUNE`` more steps (the technique on from step ``OFFSET`` of those); the
compressed model's held-out loss ends within ``MARGIN`` of the dense one's. Layer reduction
keeps 2 of a 4-layer teacher's layers and distils from it for ``FINETUNE`` steps.

Measured (fp32, one thread): see the printed figures; the untrained loss is ln(33) = 3.50."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch

from shardspeed.compression import Distiller, init_compression, redundancy_clean
from tests.compression import tiny

PRETRAIN, FINETUNE, OFFSET = 120, 40, 5
MARGIN = {"bert": 0.08, "gpt2": 0.05}  # measured: bert heads +0.043, others <= +0.01
HEADS = 4


def _sparse(family: str) -> dict[str, Any]:
    modules = ["encoder.layer"] if family == "bert" else ["attn", "mlp"]
    return {
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": OFFSET},
            "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": modules}},
        }
    }


def _heads(family: str) -> dict[str, Any]:
    if family == "bert":  # learned head scores; Q/K/V shrink with the output projection
        group = {
            "params": {"dense_ratio": 0.5},
            "modules": ["attention.output.dense"],
            "related_modules": [["self.query", "self.key", "self.value"]],
        }
        method = "topk"
    else:  # GPT-2's fused c_attn: heads masked on the output projection only
        group = {"params": {"dense_ratio": 0.5}, "modules": ["attn.c_proj"]}
        method = "l1"
    shared = {"enabled": True, "method": method, "num_heads": HEADS, "schedule_offset": OFFSET}
    return {"head_pruning": {"shared_parameters": shared, "different_groups": {"hp1": group}}}


def _int8(family: str) -> dict[str, Any]:
    modules = ["encoder.layer"] if family == "bert" else ["attn", "mlp"]
    kind = "symmetric" if family == "bert" else "asymmetric"
    shared = {"enabled": True, "quantization_type": kind, "schedule_offset": OFFSET}
    params = {"start_bits": 10, "target_bits": 8, "quantization_period": 10}
    return {
        "weight_quantization": {
            "shared_parameters": shared,
            "different_groups": {"wq1": {"params": params, "modules": modules}},
        }
    }


TECHNIQUES = {"sparse": _sparse, "heads": _heads, "int8": _int8}


def finetune(family: str, compression: dict[str, Any] | None) -> Any:
    model = tiny.dense(family, 2, PRETRAIN)
    if compression is not None:
        init_compression(model, {"compression_training": compression})
    return tiny.train(model, family, FINETUNE, compression, first_seed=PRETRAIN)


@functools.cache
def dense_loss(family: str) -> float:
    return tiny.eval_loss(finetune(family, None).module, family)


def _outputs(model: torch.nn.Module, family: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**tiny.batch(family, 77)).logits


def _size(model: torch.nn.Module) -> tuple[int, int]:
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


@pytest.mark.parametrize("technique", sorted(TECHNIQUES))
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_compressed_loss_near_dense_and_clean_keeps_outputs(family: str, technique: str) -> None:
    compression = TECHNIQUES[technique](family)
    engine = finetune(family, compression)
    loss, dense = tiny.eval_loss(engine.module, family), dense_loss(family)
    print(f"{family} {technique}: compressed {loss:.4f} dense {dense:.4f}")
    assert loss <= dense + MARGIN[family], (loss, dense)
    assert loss < 3.0  # far below the untrained ln(33) = 3.50
    model = engine.module
    masked, before = _outputs(model, family), _size(model)
    cleaned = redundancy_clean(copy.deepcopy(model), {"compression_training": compression})
    torch.testing.assert_close(_outputs(cleaned, family), masked, rtol=1e-4, atol=1e-4)
    after = _size(cleaned)
    if technique == "heads" and family == "bert":  # Q/K/V rows and O columns of 2 heads gone
        # per layer: the 2 heads' slices of Q, K, V, O (64 x 32 each), of the Q/K/V biases,
        # and the 4 learned head scores
        removed = 2 * (4 * 64 * 32 + 3 * 32 + HEADS)
        assert before[0] - after[0] == removed, (before, after)
        assert before[1] - after[1] == 4 * removed
    else:
        assert after == before
    _check_fixed(cleaned, technique)


def _check_fixed(model: torch.nn.Module, technique: str) -> None:
    from shardspeed.compression.layers import LinearLayer_Compress

    layers = [m for m in model.modules() if isinstance(m, LinearLayer_Compress)]
    if technique == "sparse":
        pruned = [m for m in layers if (m.weight == 0).float().mean() >= 0.5]
        assert len(pruned) >= 8  # every transformer linear holds half zeros for good
        assert all(m.sparse_pruning_method is None for m in layers)
    if technique == "int8":
        quantized = [m for m in layers if m.weight.unique().numel() <= 256 * 1]
        assert len(quantized) >= 8  # at most 2^8 levels per tensor (one group)
    if technique == "heads":
        assert all(m.head_pruning_method is None for m in layers)


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_layer_reduction_with_distillation(family: str) -> None:
    teacher = tiny.dense(family, 4, PRETRAIN)
    teacher_loss = tiny.eval_loss(teacher, family)
    assert teacher_loss < 3.0  # the teacher has learned the task
    prefix = "bert.encoder.layer" if family == "bert" else "transformer.h"
    others = (
        ["bert.embeddings", "cls"]
        if family == "bert"
        else ["transformer.wte", "transformer.wpe", "transformer.ln_f"]
    )
    reduction = {
        "enabled": True,
        "keep_number_layer": 2,
        "module_name_prefix": prefix,
        "teacher_layer": [1, 3],
        "other_module_name": others,
    }
    config = {"compression_training": {"layer_reduction": reduction}}
    student = init_compression(tiny.build(family, 2, seed=5), config, teacher_model=teacher)
    first = dict(student.named_parameters())[f"{prefix}.1.{_probe(family)}"]
    torch.testing.assert_close(
        first, dict(teacher.named_parameters())[f"{prefix}.3.{_probe(family)}"]
    )
    distiller = Distiller.from_config(teacher, config, temperature=2.0, hidden_weight=1.0)
    assert distiller.layer_map == [(0, 0), (1, 2), (2, 4)]

    def loss_fn(engine: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        out = engine(**inputs, output_hidden_states=True)
        return distiller.loss(out, distiller.teacher_outputs(**inputs), out.loss)

    engine = tiny.train(student, family, FINETUNE, None, first_seed=PRETRAIN, loss_fn=loss_fn)
    loss = tiny.eval_loss(engine.module, family)
    print(f"{family} layer reduction 2 of 4: student {loss:.4f} teacher {teacher_loss:.4f}")
    assert loss <= teacher_loss + MARGIN[family], (loss, teacher_loss)


def _probe(family: str) -> str:
    return "attention.self.query.weight" if family == "bert" else "attn.c_attn.weight"
