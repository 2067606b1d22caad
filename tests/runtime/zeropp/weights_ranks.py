"""Rank-side code of the ZeRO++ weight tests (hpZ, qwZ, quantized frozen weights), sent to the
shared pool of 4 gloo ranks seen as 2 nodes of 2."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import shardspeed
from shardspeed import comm
from shardspeed.runtime.comm.quantize import INT8, dequantize, quantize
from shardspeed.runtime.zero.flat_shard import FlatShard
from shardspeed.runtime.zero.quantized_shard import QuantizedFlatShard
from tests.runtime.zeropp.ranks import config, node_size


class Stack(nn.Module):
    """Three linear layers without tied weights (each unit is gathered once per pass), sized
    so the shards are not whole quantization blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 64)
        self.b = nn.Linear(64, 256)
        self.c = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Adapted(nn.Module):
    """A frozen base layer plus a trainable low-rank adapter (the LoRA case), and a frozen
    head whose unit also holds a trainable bias."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(128, 128)
        self.down = nn.Linear(128, 4, bias=False)
        self.up = nn.Linear(4, 128, bias=False)
        self.head = nn.Linear(128, 8)
        for param in (*self.base.parameters(), self.head.weight):
            param.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.base(x) + self.up(self.down(x)))
        return self.head(hidden)


def _data(step: int, inputs: int, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + 10 * step + comm.get_rank())
    x = torch.randn(4, inputs, generator=generator)
    y = torch.randint(0, outputs, (4,), generator=generator)
    return x, y


def _engine(
    model: nn.Module,
    zeropp: dict[str, Any],
    node: int = 2,
    extra: dict[str, Any] | None = None,
    **zero: Any,
) -> Any:
    """``model`` under ZeRO-3 with ``zeropp`` and the other ``zero_optimization`` keys
    ``zero`` (``extra``: top-level config keys), on nodes of ``node`` ranks."""
    cfg = config(zeropp, **(extra or {}))
    cfg["zero_optimization"].update(zero)
    with node_size(node):
        engine, *_ = shardspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=cfg,
        )
    return engine


def _units(engine: Any) -> list[Any]:
    return list(engine.strategy.sharding.units)


def _flats(engine: Any) -> list[FlatShard]:
    return [flat for unit in _units(engine) for flat in unit.flats]


def phase_volumes(
    zeropp: dict[str, Any], steps: int = 2, node: int = 2, bf16: bool = False
) -> dict[str, Any]:
    """Train :class:`Stack` ``steps`` steps (``bf16``: in bf16); per step the bytes of each
    phase (forward, backward, step) by op and group size, the losses, and the flats' sizes."""
    torch.manual_seed(0)
    extra = {"bf16": {"enabled": True}} if bf16 else None
    engine = _engine(Stack(), zeropp, node, extra)
    dtype = torch.bfloat16 if bf16 else torch.float32
    record: dict[str, Any] = {"loss": [], "phases": []}
    for step in range(steps):
        x, y = _data(step, 24, 10)
        comm.reset_comm_volume()
        loss = nn.functional.cross_entropy(engine(x.to(dtype)).float(), y)
        forward = comm.get_comm_volume(by_group_size=True)
        comm.reset_comm_volume()
        engine.backward(loss)
        backward = comm.get_comm_volume(by_group_size=True)
        record["secondary_nbytes"] = sum(
            f.secondary.numel() * f.secondary.element_size()
            for f in _flats(engine)
            if f.secondary is not None
        )
        comm.reset_comm_volume()
        engine.step()
        after = comm.get_comm_volume(by_group_size=True)
        record["phases"].append({"forward": forward, "backward": backward, "step": after})
        record["loss"].append(loss.item())
    flats = _flats(engine)
    record["full_nbytes"] = sum(f.full.numel() * f.full.element_size() for f in flats)
    record["chunks"] = [f.chunk_numel for f in flats]
    record["units"] = len(_units(engine))
    engine.destroy()
    return record


def _exact_full(flat: FlatShard) -> torch.Tensor:
    """The full buffer from the primary shards, gathered without quantization."""
    out = flat.full.new_empty(flat.full.numel())
    flat.comm.all_gather(out, flat.shard)
    return out


def _views(flat: FlatShard, buffer: torch.Tensor) -> dict[int, torch.Tensor]:
    return {
        id(param): buffer[offset : offset + param.numel()].view(param.shape)
        for param, offset in zip(flat.params, flat.offsets, strict=True)
    }


def exact_gathers_under_qwz(steps: int = 2) -> dict[str, Any]:
    """Under qwZ, every unit persistent and gathered lossy by the hooks: the module state dict,
    a saved checkpoint's module state and ``GatheredParameters(modifier_rank=0)`` edits give or
    keep the exact primary values."""
    torch.manual_seed(0)
    engine = _engine(
        Stack(), {"zero_quantized_weights": True}, stage3_param_persistence_threshold=10**9
    )
    for step in range(steps):
        x, y = _data(step, 24, 10)
        engine.backward(nn.functional.cross_entropy(engine(x), y))
        engine.step()
    engine.empty_partition_cache()
    engine(_data(99, 24, 10)[0])  # the hooks gather every (persistent) unit, quantized
    units = _units(engine)
    result: dict[str, Any] = {"lossy_before": all(unit.lossy for unit in units)}
    exact: dict[int, torch.Tensor] = {}
    differs = False
    for flat in _flats(engine):
        for key, view in _views(flat, _exact_full(flat)).items():
            exact[key] = view.clone()
    names = dict(engine.module.named_parameters())
    for param in names.values():
        differs = differs or not torch.equal(param.detach(), exact[id(param)])
    result["lossy_values_differ"] = differs
    state = engine.module_state_dict()
    result["state_dict_exact"] = all(
        torch.equal(state[name], exact[id(param)]) for name, param in names.items()
    )
    result["lossy_after_state_dict"] = any(unit.lossy for unit in units)
    # a checkpoint's module state: gathered lossy again first
    engine.empty_partition_cache()
    engine(_data(98, 24, 10)[0])
    folder = Path(tempfile.gettempdir()) / "shardspeed_qwz_ckpt"
    engine.save_checkpoint(str(folder), tag="qwz")
    saved = torch.load(folder / "qwz" / "mp_rank_00_model_states.pt", weights_only=False)
    result["checkpoint_exact"] = all(
        torch.equal(saved["module"][name], exact[id(param)]) for name, param in names.items()
    )
    # GatheredParameters(modifier_rank=0) on lossy-gathered units: only the edit changes
    engine.empty_partition_cache()
    engine(_data(97, 24, 10)[0])
    weight = engine.module.b.weight
    with shardspeed.zero.GatheredParameters([weight], modifier_rank=0):
        if comm.get_rank() == 0:
            weight.data[0, 0] = 42.0
    flat = next(f for unit in units for f in unit.flats if f.holds(weight))
    after = _views(flat, _exact_full(flat))
    expected = exact[id(weight)].clone()
    expected[0, 0] = 42.0
    result["edit_exact"] = torch.equal(after[id(weight)], expected)
    result["others_exact"] = all(
        torch.equal(after[id(p)], exact[id(p)]) for p in flat.params if p is not weight
    )
    engine.destroy()
    return result


def _chunked_round_trip(values: torch.Tensor, world: int) -> torch.Tensor:
    """``values`` (a flat buffer padded to ``world``) with each rank's chunk quantized and
    dequantized, as :class:`QuantizedFlatShard` stores it."""
    chunk = values.numel() // world
    out = values.clone()
    for member in range(world):
        part = out[member * chunk : (member + 1) * chunk]
        dequantize(quantize(part, INT8), chunk, INT8, out=part)
    return out


def quantized_frozen_weights(steps: int = 3) -> dict[str, Any]:
    """``zero_quantized_nontrainable_weights``: the frozen parameters' shards are int8 payloads,
    the adapter trains, and the frozen weights' gathered values are their chunk-wise
    quantized round trip, unchanged by training."""
    torch.manual_seed(0)
    model = Adapted()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = _engine(model, {"zero_quantized_nontrainable_weights": True})
    world = comm.get_world_size()
    result: dict[str, Any] = {"stored": [], "losses": []}
    names = dict(engine.module.named_parameters())
    for flat in _flats(engine):
        frozen = [not p.requires_grad for p in flat.params]
        result["stored"].append(
            {
                "frozen": frozen,
                "quantized": isinstance(flat, QuantizedFlatShard),
                "shard_nbytes": flat.shard.numel() * flat.shard.element_size(),
                "payload_nbytes": INT8.payload_nbytes(flat.chunk_numel),
                "fp32_nbytes": flat.chunk_numel * 4,
            }
        )
    for step in range(steps):
        x, y = _data(step, 128, 8)
        comm.reset_comm_volume()
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        result["losses"].append(loss.item())
    # expected: each frozen buffer's chunks quantized, built from the original values
    expected: dict[str, torch.Tensor] = {}
    for unit in _units(engine):
        for flat in unit.flats:
            if not isinstance(flat, QuantizedFlatShard):
                continue
            buffer = torch.zeros(flat.full.numel())
            for param, offset in zip(flat.params, flat.offsets, strict=True):
                name = next(n for n, p in names.items() if p is param)
                buffer[offset : offset + param.numel()] = original[name].reshape(-1)
            back = _chunked_round_trip(buffer, world)
            for param, offset in zip(flat.params, flat.offsets, strict=True):
                name = next(n for n, p in names.items() if p is param)
                expected[name] = back[offset : offset + param.numel()].view(param.shape)
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        gathered = {n: p.detach().clone() for n, p in names.items()}
    state = engine.module_state_dict()
    result["frozen_names"] = sorted(expected)
    result["frozen_equal_round_trip"] = all(
        torch.equal(gathered[n], v) and torch.equal(state[n], v) for n, v in expected.items()
    )
    result["frozen_changed_by_quantization"] = any(
        not torch.equal(v, original[n]) for n, v in expected.items()
    )
    result["adapter_trained"] = not torch.equal(gathered["up.weight"], original["up.weight"])
    result["bias_trained"] = not torch.equal(gathered["head.bias"], original["head.bias"])
    engine.destroy()
    return result


def init_accepts_quantized_keys() -> bool:
    """``zero.Init(zero_quantized_weights=True, zero_quantized_nontrainable_weights=True)``
    builds the model with rank 0's exact values."""
    torch.manual_seed(comm.get_rank())  # different per rank: rank 0's values must win
    with shardspeed.zero.Init(
        zero_quantized_weights=True, zero_quantized_nontrainable_weights=True
    ):
        model = Stack()
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(0)  # rank 0's seed
    reference = dict(Stack().named_parameters())
    return all(torch.equal(v, reference[n].detach()) for n, v in values.items())


def hpz_with_offload_refused() -> str:
    """The NotImplementedError hpZ with ``offload_param`` raises (on every rank)."""
    try:
        _engine(Stack(), {"zero_hpz_partition_size": 2}, offload_param={"device": "cpu"})
    except NotImplementedError as error:
        return str(error)
    return ""


def secondary_follows_primary() -> dict[str, Any]:
    """hpZ: a unit's secondary shard exists after the hooks released it and is dropped by the
    step, ``GatheredParameters(modifier_rank=...)`` and ``load_module_state_dict``."""
    torch.manual_seed(0)
    engine = _engine(Stack(), {"zero_hpz_partition_size": 2})
    x, y = _data(0, 24, 10)
    out: dict[str, Any] = {}
    engine.backward(nn.functional.cross_entropy(engine(x), y))
    flats = _flats(engine)
    out["after_backward"] = [f.secondary is not None for f in flats]
    out["sizes_ok"] = all(
        f.secondary is not None and f.secondary.numel() * 2 == f.full.numel() for f in flats
    )
    engine.step()
    out["after_step"] = [f.secondary is not None for f in flats]
    with torch.no_grad():
        engine(x)
    out["after_forward"] = [f.secondary is not None for f in flats]
    with shardspeed.zero.GatheredParameters([engine.module.a.weight], modifier_rank=0):
        pass
    out["after_modifier"] = [f.secondary is not None for f in flats]
    with torch.no_grad():
        engine(x)
    engine.load_module_state_dict(engine.module_state_dict())
    out["after_load"] = [f.secondary is not None for f in flats]
    engine.destroy()
    return out


def adapter_run(zeropp: dict[str, Any], steps: int = 3, **zero: Any) -> dict[str, Any]:
    """Train :class:`Adapted` ``steps`` steps with ``zeropp`` and the ``zero_optimization``
    keys ``zero`` (e.g. ``offload_param``): the losses and the final parameters."""
    torch.manual_seed(0)
    engine = _engine(Adapted(), zeropp, **zero)
    losses = []
    for step in range(steps):
        x, y = _data(step, 128, 8)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with shardspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"loss": losses, "params": params}
