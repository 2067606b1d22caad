"""Rank side of the AutoTP checkpoint tests: a tiny Llama or Qwen2 trained 3 steps at TP 2 x
DP 2 ZeRO 1 and saved, then trained 3 more (the uninterrupted run); resumed from the save at
another tensor-parallel size, data-parallel size and ZeRO stage for the same 3 steps."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import shardspeed
from shardspeed.runtime.tensor_parallel.gather import whole_state_dict
from shardspeed.zero import GatheredParameters
from tests.runtime.tensor_parallel.autotp_ranks import OPT, batches, tiny_model

#: rows of every optimizer step's global batch, whatever the data-parallel size
ROWS = 4
SAVED, TOTAL = 3, 6


def _engine(kind: str, tp: int, stage: int) -> Any:
    dp = dist.get_world_size() // tp
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": dict(OPT)},
        "zero_optimization": {"stage": stage},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    model = tiny_model(kind)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def whole_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (ZeRO-3 gathered, tensor-parallel pieces assembled)."""
    model = engine.module
    with GatheredParameters(list(model.parameters())):
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
    if engine.tensor_parallel is None:
        return local
    return whole_state_dict(model, local, engine.tensor_parallel.group)


def _train(engine: Any, steps: range) -> list[float]:
    """Optimizer steps ``steps`` of the shared data; the global mean loss of each."""
    dp = dist.get_world_size() // (
        1 if engine.tensor_parallel is None else engine.tensor_parallel.group.world_size
    )
    dp_rank = dist.get_rank() // (dist.get_world_size() // dp)
    micro = ROWS // dp
    data = batches(TOTAL, ROWS)
    losses = []
    for step in steps:
        mine = data[step][dp_rank * micro : (dp_rank + 1) * micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tensor-parallel peers hold the same loss
        losses.append(float(mean) / dist.get_world_size())
    return losses


def save_and_continue(kind: str, path: str) -> dict[str, Any]:
    """TP 2 x DP 2 ZeRO 1: 3 steps, save tag ``step3`` into ``path``, 3 more steps."""
    engine = _engine(kind, 2, 1)
    _train(engine, range(SAVED))
    saved = whole_parameters(engine)
    engine.save_checkpoint(path, tag="step3")
    losses = _train(engine, range(SAVED, TOTAL))
    return {"saved": saved, "losses": losses, "params": whole_parameters(engine)}


def resume(kind: str, path: str, tp: int, stage: int) -> dict[str, Any]:
    """Load tag ``step3`` of ``path`` at ``tp`` x (world / tp) ranks and ZeRO ``stage``, then
    the same 3 steps as the uninterrupted run."""
    engine = _engine(kind, tp, stage)
    loaded, _ = engine.load_checkpoint(path, tag="step3")
    assert loaded is not None
    assert engine.global_steps == SAVED
    loaded_params = whole_parameters(engine)
    losses = _train(engine, range(SAVED, TOTAL))
    return {"loaded": loaded_params, "losses": losses, "params": whole_parameters(engine)}


def resume_cases(kind: str, path: str, cases: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """:func:`resume` for each (tp, stage), one after another in this process group."""
    return [resume(kind, path, tp, stage) for tp, stage in cases]


def load_error(kind: str, path: str, tp: int, stage: int) -> str:
    """The message of the error loading tag ``step3`` raises ('' if it loads)."""
    engine = _engine(kind, tp, stage)
    try:
        engine.load_checkpoint(path, tag="step3")
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return ""
