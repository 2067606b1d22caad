"""ZeRO++ keeps no state of its own in a checkpoint's layout: a checkpoint saved with ZeRO++
on resumes exactly with it on, and loads bit for bit with it off (and the other way)."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.zeropp.ranks import train

ALL = {
    "zero_hpz_partition_size": 2,
    "zero_quantized_weights": True,
    "zero_quantized_gradients": True,
}


def _same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_resume_and_switch_modes(dist_pool, tmp_path):
    pool = dist_pool(4)
    on_dir, off_dir = str(tmp_path / "on"), str(tmp_path / "off")
    # ZeRO++ on: 6 steps straight, and 3 steps saved then 3 resumed
    straight = pool.run(train, ALL, 6)[0]
    first = pool.run(train, ALL, 3, save=(on_dir, 3))[0]
    resumed = pool.run(train, ALL, 3, load=on_dir, start=3)[0]
    assert first["loss"] + resumed["loss"] == straight["loss"]
    assert _same_params(resumed["params"], straight["params"])
    # on -> off: the loaded model is the saved one; it trains on with plain ZeRO-3
    loaded_off = pool.run(train, {}, 0, load=on_dir)[0]
    assert _same_params(loaded_off["params"], first["params"])
    off = pool.run(train, {}, 3, load=on_dir, start=3)[0]
    assert off["loss"] != resumed["loss"]  # plain collectives now
    assert abs(off["loss"][0] - resumed["loss"][0]) < 0.05 * resumed["loss"][0]
    # off -> on
    plain = pool.run(train, {}, 3, save=(off_dir, 3))[0]
    loaded_on = pool.run(train, ALL, 0, load=off_dir)[0]
    assert _same_params(loaded_on["params"], plain["params"])
