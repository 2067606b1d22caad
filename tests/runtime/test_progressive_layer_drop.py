"""Progressive layer drop: the keep-probability schedule, the keywords the engine passes to the
model's forward (and when it moves the schedule: DeepSpeed's order), a model that drops layers
at the documented rate, the disabled default, config errors and the pipeline refusal. Cases
after DeepSpeed's ``tests/unit/runtime/test_pld.py``."""

from __future__ import annotations

import math

import pytest

from shardspeed.config import DeepSpeedConfig
from shardspeed.runtime.progressive_layer_drop import ProgressiveLayerDrop
from tests.runtime import pld_ranks


def _theta(theta_bar: float, gamma: float, step: int) -> float:
    return (1.0 - theta_bar) * math.exp(-gamma * step) + theta_bar


# -- the schedule on its own -----------------------------------------------------------------
@pytest.mark.parametrize("theta", [0.0, 0.1, 0.9, 1.0])
def test_schedule_follows_the_formula(theta: float) -> None:
    pld = ProgressiveLayerDrop(theta=theta, gamma=0.001)
    assert pld.get_theta() == 1.0  # before the first update: keep every layer
    for step in range(10):
        pld.update_state(step)
        assert pld.get_theta() == _theta(theta, 0.001, step)
        assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": pld.get_theta()}


def test_schedule_values() -> None:
    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.1)
    values = []
    for step in range(5):
        pld.update_state(step)
        values.append(pld.get_theta())
    assert values == pytest.approx([1.0, 0.9524187090, 0.9093653765, 0.8704091103, 0.8351600230])
    pld.update_state(10_000)  # decays to theta_bar
    assert pld.get_theta() == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize(("kwargs", "name"), [({"theta": 1.5}, "theta"), ({"gamma": -1}, "gamma")])
def test_schedule_refuses_out_of_range(kwargs: dict[str, float], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ProgressiveLayerDrop(**kwargs)


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"theta": 1.5}, "progressive_layer_drop.theta"),
        ({"theta": -0.1}, "progressive_layer_drop.theta"),
        ({"gamma": -0.5}, "progressive_layer_drop.gamma"),
        ({"thta": 0.5}, "progressive_layer_drop.thta"),
    ],
)
def test_config_errors_name_the_key(section: dict[str, float], key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        DeepSpeedConfig({"train_batch_size": 1, "progressive_layer_drop": section})


def test_config_defaults_and_theta_zero() -> None:
    default = DeepSpeedConfig({"train_batch_size": 1}).progressive_layer_drop
    assert (default.enabled, default.theta, default.gamma) == (False, 1.0, 0.001)
    # DeepSpeed's own PLD test trains with theta = 0 (the deepest layers' keep probability
    # then tends to 1/L): accepted
    zero = DeepSpeedConfig(
        {"train_batch_size": 1, "progressive_layer_drop": {"enabled": True, "theta": 0}}
    )
    assert zero.progressive_layer_drop.theta == 0.0


# -- through the engine (a one-rank pool) ---------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("gas", [1, 2])
def test_engine_passes_theta_and_updates_at_each_optimizer_step(dist_pool, gas: int) -> None:
    theta, gamma, steps = 0.5, 0.1, 5
    (result,) = dist_pool(1).run(pld_ranks.kwargs_per_step, theta, gamma, gas, steps)
    # after step t (0-based) the schedule stands at theta(t), as DeepSpeed's test asserts
    assert result["after"] == [_theta(theta, gamma, t) for t in range(steps)]
    assert result["after"] == pytest.approx([1.0, 0.95241871, 0.90936538, 0.87040911, 0.83516002])
    # the forwards of step t ran before its update: theta(t - 1), and 1.0 before any update
    for step, seen in enumerate(result["seen"]):
        expected = 1.0 if step == 0 else _theta(theta, gamma, step - 1)
        assert seen == [{"progressive_layer_drop": True, "pld_theta": expected}] * gas
    assert result["eval"] == {}  # an evaluation forward runs every layer


@pytest.mark.timeout(240)
def test_disabled_passes_no_keywords(dist_pool) -> None:
    (result,) = dist_pool(1).run(pld_ranks.disabled_passes_nothing)
    assert result["seen"] == [{}, {}, {}]
    assert result["theta"] is None and result["schedule"] is None
    assert result["enabled"] is False


@pytest.mark.timeout(240)
def test_model_drops_layers_at_the_documented_rate(dist_pool) -> None:
    theta, gamma, depth, steps = 0.5, 1.0, 4, 400
    (result,) = dist_pool(1).run(pld_ranks.drop_counts, theta, gamma, depth, steps)
    assert result["forwards"] == steps
    assert result["final_theta"] == _theta(theta, gamma, steps - 1)
    # the keep probability each layer was given: the schedule's theta of each forward
    forward_thetas = [1.0] + [_theta(theta, gamma, t) for t in range(steps - 1)]
    for i in range(depth):
        probs = [1.0 - i / depth * (1.0 - t) for t in forward_thetas]
        assert result["expected"][i] == pytest.approx(sum(probs))
        # what the layers actually ran: within 4 standard deviations of the binomial count
        sigma = math.sqrt(sum(p * (1.0 - p) for p in probs))
        assert abs(result["kept"][i] - sum(probs)) <= 4.0 * sigma + 1e-9, (i, result)
    assert result["kept"][0] == steps  # the first layer is always kept
    # the deepest layer runs about 1 - 3/4 * (1 - 0.5) = 62.5% of the time once theta settles
    assert 0.56 < result["kept"][-1] / steps < 0.70


@pytest.mark.timeout(240)
def test_pipeline_refuses_pld(dist_pool) -> None:
    (message,) = dist_pool(1).run(pld_ranks.pipeline_refuses_pld)
    assert "progressive_layer_drop.enabled" in message and "PipelineModule" in message


@pytest.mark.timeout(240)
def test_resumed_run_continues_the_schedule(dist_pool, tmp_path) -> None:
    theta, gamma, steps = 0.5, 0.1, 4
    (result,) = dist_pool(1).run(pld_ranks.resumed_theta, str(tmp_path), theta, gamma, steps)
    assert result["steps"] == steps
    expected = {"progressive_layer_drop": True, "pld_theta": _theta(theta, gamma, steps - 1)}
    assert result["unbroken"] == expected
    assert result["resumed"] == expected
