"""Per-block Hessian eigenvalues (``eigenvalue``): the power iteration against the dense Hessian
of a tiny model, its stopping rule, degenerate blocks, and the engine's monitor events."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import shardspeed
from shardspeed.runtime.eigenvalue import EIGENVALUE_EVENT, Eigenvalue, EigenvalueConfigError

# the standalone path is DeepSpeed's: backward(create_graph=True) leaves the graph on .grad
pytestmark = pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")

WIDTH = 6  # one block: Linear(6, 6) + tanh, 42 parameters


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Encoder(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Block() for _ in range(blocks))


class Net(nn.Module):
    """Blocks at ``encoder.layer``, a linear head, mean-squared-error loss. ``mute`` multiplies
    the output of the block at that index by zero (its gradient and Hessian are zero)."""

    def __init__(self, blocks: int = 2, mute: int | None = None, skip: int | None = None) -> None:
        super().__init__()
        self.encoder = Encoder(blocks)
        self.head = nn.Linear(WIDTH, 1)
        self.mute, self.skip = mute, skip

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.encoder.layer):
            if index == self.skip:
                continue
            out = block(x)
            x = out * 0.0 if index == self.mute else out
        return nn.functional.mse_loss(self.head(x), y)


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(16, WIDTH, generator=gen), torch.randn(16, 1, generator=gen)


def _estimator(**kwargs) -> Eigenvalue:
    settings = {"layer_name": "encoder.layer", "layer_num": 2, **kwargs}
    return Eigenvalue(**settings)


def _backward(model: nn.Module, scale: float = 1.0) -> None:
    model.zero_grad(set_to_none=True)
    (model(*_data()) * scale).backward(create_graph=True, retain_graph=True)


def _dense_top_eigenvalue(model: Net, index: int) -> float:
    """The largest-magnitude eigenvalue of the dense Hessian of the loss in block ``index``'s
    parameters (every other parameter held fixed)."""
    block = model.encoder.layer[index]
    names = [f"encoder.layer.{index}.{name}" for name, _ in block.named_parameters()]
    shapes = [p.shape for p in block.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in block.parameters()])

    def loss_of(vector: torch.Tensor) -> torch.Tensor:
        pieces, offset = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            size = math.prod(shape)
            pieces[name] = vector[offset : offset + size].reshape(shape)
            offset += size
        # the whole model with this block's parameters replaced by the vector's pieces
        return torch.func.functional_call(model, pieces, _data())

    hessian = torch.autograd.functional.hessian(loss_of, flat)
    eigenvalues = torch.linalg.eigvalsh((hessian + hessian.T) / 2)
    return float(eigenvalues[eigenvalues.abs().argmax()])


def test_matches_dense_hessian_top_eigenvalue() -> None:
    torch.manual_seed(0)
    model = Net()
    dense = [_dense_top_eigenvalue(model, i) for i in range(2)]
    assert all(abs(d) > 1e-3 for d in dense)
    _backward(model)
    estimator = _estimator(tol=1e-6, max_iter=2000)
    result = estimator.compute_eigenvalue(model)
    for raw, expected in zip(estimator.raw_eigenvalues, dense, strict=True):
        assert raw == pytest.approx(expected, rel=1e-3)
    # DeepSpeed's shape: every parameter of each block maps to (|value| / largest, block)
    biggest = max(abs(d) for d in dense)
    for index, block in enumerate(model.encoder.layer):
        for p in block.parameters():
            value, block_id = result[id(p)]
            assert block_id == index
            assert value == pytest.approx(abs(dense[index]) / biggest, rel=2e-3)
    assert id(model.head.weight) not in result and len(result) == 4


def test_loss_scale_is_divided_out_and_rng_untouched() -> None:
    torch.manual_seed(0)
    model = Net()
    _backward(model)
    plain = _estimator(tol=1e-6, max_iter=2000)
    plain.compute_eigenvalue(model)
    _backward(model, scale=1024.0)
    scaled = _estimator(tol=1e-6, max_iter=2000)
    state = torch.random.get_rng_state()
    scaled.compute_eigenvalue(model, device="cpu", scale=1024.0)
    assert torch.equal(state, torch.random.get_rng_state())
    for a, b in zip(plain.raw_eigenvalues, scaled.raw_eigenvalues, strict=True):
        assert b == pytest.approx(a, rel=1e-3)


def test_stops_when_the_tolerance_is_met() -> None:
    torch.manual_seed(0)
    model = Net()
    _backward(model)
    loose, tight = _estimator(tol=1e-2), _estimator(tol=1e-9, max_iter=4)
    loose.compute_eigenvalue(model)
    tight.compute_eigenvalue(model)
    assert tight.iterations == [4, 4]  # never met: max_iter ends it
    assert all(2 <= n < 100 for n in loose.iterations)
    # a Hessian that is c * identity: the second estimate equals the first, so two steps
    w = nn.Parameter(torch.randn(5))
    holder = nn.Module()
    holder.layers = nn.ModuleList([nn.Module()])
    holder.layers[0].w = w
    (0.5 * 3.0 * (w * w).sum()).backward(create_graph=True)
    exact = Eigenvalue(layer_name="layers", layer_num=1, tol=1e-6)
    result = exact.compute_eigenvalue(holder)
    assert exact.iterations == [2]
    assert exact.raw_eigenvalues[0] == pytest.approx(3.0, rel=1e-5)
    assert result == {id(w): (1.0, 0)}


@pytest.mark.parametrize("stability", [0.0, 1e-6])
def test_zero_gradient_block_gives_zero_not_nan(stability: float) -> None:
    torch.manual_seed(0)
    model = Net(blocks=3, mute=0, skip=2)  # block 0: zero Hessian; block 2: no gradient at all
    _backward(model)
    estimator = _estimator(layer_num=3, stability=stability)
    result = estimator.compute_eigenvalue(model)
    assert estimator.raw_eigenvalues[0] == 0.0 and estimator.raw_eigenvalues[2] == 0.0
    assert estimator.raw_eigenvalues[1] != 0.0 and math.isfinite(estimator.raw_eigenvalues[1])
    assert estimator.iterations[0] == 1 and estimator.iterations[2] == 0
    values = {index: value for value, index in result.values()}
    # DeepSpeed's post-processing: the measured block is the largest (1.0), a zero reads 1.0
    assert values == {0: 1.0, 1: 1.0, 2: 1.0}
    assert all(math.isfinite(v) for v, _ in result.values())


def test_without_a_gradient_graph_nothing_is_computed() -> None:
    model = Net()
    model(*_data()).backward()  # no create_graph
    estimator = _estimator()
    assert estimator.compute_eigenvalue(model) == {}
    assert estimator.iterations == [0, 0]


def test_post_process_normalises_by_the_largest_magnitude() -> None:
    assert Eigenvalue.post_process([2.0, -4.0, 0.0, float("nan")]) == [0.5, 1.0, 1.0, 1.0]


def test_settings_that_name_no_blocks_are_rejected() -> None:
    with pytest.raises(EigenvalueConfigError, match="layer_num"):
        Eigenvalue(layer_name="encoder.layer", layer_num=0)
    with pytest.raises(AssertionError, match="layer_name"):  # DeepSpeed asserts
        Eigenvalue(layer_name="", layer_num=2)
    model = Net()
    _backward(model)
    with pytest.raises(ValueError, match="no attribute 'layers'"):
        Eigenvalue(layer_name="encoder.layers", layer_num=1).compute_eigenvalue(model)
    with pytest.raises(ValueError, match="holds 2 layers"):
        Eigenvalue(layer_name="encoder.layer", layer_num=3).compute_eigenvalue(model)


def _engine(eigenvalue: dict | None):
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    if eigenvalue is not None:
        config["eigenvalue"] = eigenvalue
    engine, *_ = shardspeed.initialize(model=Net(), config=config)
    return engine


def test_engine_logs_block_eigenvalues_at_the_resolution() -> None:
    section = {
        "enabled": True,
        "layer_name": "encoder.layer",
        "layer_num": 2,
        "gas_boundary_resolution": 2,
    }
    engine, plain = _engine(section), _engine(None)
    written: list[tuple[str, float, int]] = []
    engine.observability.monitor.write_events = written.extend  # type: ignore[method-assign]
    computed_at = []
    reference = Net()
    for step in range(4):
        reference.load_state_dict(engine.module.state_dict())
        reference.zero_grad(set_to_none=True)
        for micro in range(2):
            x, y = _data(10 * step + micro)
            for e in (engine, plain):
                e.backward(e(x, y))
            # DeepSpeed's way: the whole window's gradient, kept with its graph, on .grad
            (reference(x, y) / 2).backward(create_graph=True)
            if micro == 1:
                expected = _estimator(gas_boundary_resolution=2)
                expected.compute_eigenvalue(reference)
            for e in (engine, plain):
                e.step()
        if (step + 1) % 2 == 0:
            computed_at.append(engine.global_samples)
            assert engine.eigenvalue.raw_eigenvalues == pytest.approx(
                expected.raw_eigenvalues, rel=1e-4
            )
            by_block = {index: value for value, index in engine.block_eigenvalue.values()}
            assert by_block == pytest.approx(dict(enumerate(Eigenvalue.post_process(
                expected.raw_eigenvalues))), rel=1e-4)  # fmt: skip
            assert set(engine.block_eigenvalue) == {
                id(p) for block in engine.module.encoder.layer for p in block.parameters()
            }
    names = [EIGENVALUE_EVENT.format(i) for i in range(2)]
    assert [(name, x) for name, _, x in written] == [
        (name, x) for x in computed_at for name in names
    ]
    assert computed_at == [64, 128]
    assert all(0.0 < v <= 1.0 for _, v, _ in written) and max(v for _, v, _ in written) == 1.0
    # keeping the gradient graph does not change training
    for a, b in zip(engine.module.parameters(), plain.module.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    engine.destroy()
    plain.destroy()


def test_engine_without_layer_settings_is_rejected() -> None:
    with pytest.raises(EigenvalueConfigError, match="layer_name"):
        _engine({"enabled": True})


def _stage_estimate(stage: int, half: bool = False) -> list[float]:
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage},
        "eigenvalue": {"enabled": True, "layer_name": "encoder.layer", "layer_num": 2},
    }
    if half:  # fp16 with a loss scale of 256: the gradients carry it, the estimate must not
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = shardspeed.initialize(model=Net(), config=config)
    for micro in range(2):
        x, y = _data(micro)
        if half:
            x, y = x.half(), y.half()
        engine.backward(engine(x, y))
        engine.step()
    raw = list(engine.eigenvalue.raw_eigenvalues)
    engine.destroy()
    return raw


def test_every_zero_stage_measures_the_same_blocks() -> None:
    """The kept gradients are taken apart from the stages' gradient buffers, so every stage
    (one rank) measures the same eigenvalues, and they are non-zero."""
    stage0 = _stage_estimate(0)
    assert all(v != 0.0 for v in stage0)
    for stage in (1, 2, 3):
        assert _stage_estimate(stage) == pytest.approx(stage0, rel=1e-5), stage


def test_fp16_loss_scale_is_divided_out_in_the_engine() -> None:
    assert _stage_estimate(0, half=True) == pytest.approx(_stage_estimate(0), rel=1e-2)
