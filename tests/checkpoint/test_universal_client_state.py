"""DeepSpeed's universal-checkpoint flow, as its tests run it: the job puts
``universal_checkpoint_info`` in its client state, rank 0 converts with
``ds_to_universal.main(namespace)`` while the others wait, every rank loads the result.

The client-state key must not make an ordinary tag look universal (the ``zero/`` folder marks
a universal one), and a conversion failing on rank 0 must reach every rank, not leave them
waiting at the next barrier.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from shardspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO
from shardspeed.checkpoint.ds_to_universal import main as convert_to_universal
from shardspeed.checkpoint.files import MODEL_STATES
from shardspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from tests.runtime.parity import MLP
from tests.runtime.zero.ranks import _engine


def _state(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in engine.module.named_parameters():
        out[name] = safe_get_full_fp32_param(param).clone()
        out[f"{name}:exp_avg"] = safe_get_full_optimizer_state(param, "exp_avg").clone()
    return out


def _convert_on_rank0(args: SimpleNamespace) -> None:
    """Convert on rank 0 only; its outcome reaches every rank before anyone goes on."""
    failure = [None]
    if dist.get_rank() == 0:
        try:
            convert_to_universal(args)
        except Exception as error:  # noqa: BLE001 - handed to every rank below
            failure[0] = f"{type(error).__name__}: {error}"
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise RuntimeError(f"conversion failed on rank 0: {failure[0]}")


def universal_flow(folder: str) -> None:
    torch.manual_seed(0)
    engine = _engine(MLP(width=8), 1)
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * step + dist.get_rank())
        engine.backward(engine(torch.randn(2, 8, generator=gen), torch.randn(2, 1, generator=gen)))
        engine.step()
    saved = _state(engine)
    client = {UNIVERSAL_CHECKPOINT_INFO: {}, "iteration": 2}
    engine.save_checkpoint(folder, tag="mid", client_state=client)
    engine.destroy()

    # the ordinary tag loads as one: the client-state key does not make it universal
    torch.manual_seed(1)
    plain = _engine(MLP(width=8), 1)
    _, got = plain.load_checkpoint(folder, tag="mid")
    assert got == client
    loaded = _state(plain)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    plain.destroy()

    # DeepSpeed's argument namespace, converted on rank 0 while the others wait
    dist.barrier()
    _convert_on_rank0(
        SimpleNamespace(
            input_folder=f"{folder}/mid",
            output_folder=f"{folder}/mid_universal",
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
    )
    torch.manual_seed(2)
    universal = _engine(MLP(width=8), 2, checkpoint={"load_universal": True})
    path, got = universal.load_checkpoint(folder)
    assert path is not None and "mid_universal" in path and got == client
    loaded = _state(universal)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())
    universal.destroy()

    # a failing conversion is reported on every rank (none is left at a barrier)
    with pytest.raises(RuntimeError, match="conversion failed on rank 0"):
        _convert_on_rank0(SimpleNamespace(input_folder=f"{folder}/nope", output_folder=folder))
    dist.barrier()


@pytest.mark.timeout(240)
def test_universal_flow_with_client_state_key(dist_pool, tmp_path):
    dist_pool(2).run(universal_flow, str(tmp_path))
    model = torch.load(Path(tmp_path) / "mid_universal" / MODEL_STATES, weights_only=False)
    assert model[UNIVERSAL_CHECKPOINT_INFO] == {}  # the job's own entry, kept as it was
    assert (tmp_path / "latest_universal").read_text() == "mid_universal"


def test_main_takes_a_namespace_or_arguments(tmp_path):
    with pytest.raises(ValueError, match="no input_folder"):
        convert_to_universal(SimpleNamespace(output_folder=str(tmp_path)))
    with pytest.raises(SystemExit):  # argparse: --input_folder is required
        convert_to_universal(["--output_folder", str(tmp_path)])
