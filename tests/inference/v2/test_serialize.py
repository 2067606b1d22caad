"""``InferenceEngineV2.serialize`` and ``build_engine_from_ds_checkpoint`` at tp 1: an engine
loaded back from the folder gives bitwise the logits it gave before, for every layout family;
the folder is untrusted input: a pickle that would run code, a tensor of the wrong shape, a
missing one, another version or a DeepSpeed-written checkpoint are refused with the reason and
the way out, and nothing in them runs. (tp 2: ``test_engine_v2_tp.py``.)"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from shardspeed.inference.v2 import build_engine_from_ds_checkpoint, build_hf_engine
from tests.inference.v2 import hf_models as hm

BUFFER = "non_persistent_buffer:model.rotary_emb.inv_freq"

pytestmark = pytest.mark.timeout(300)

CONFIG = {
    "state_manager": {
        "max_context": 128,
        "kv_block_size": 8,
        "memory_config": {"mode": "allocate", "size": 32},
    }
}


def _logits(engine: Any) -> list[torch.Tensor]:
    """Two ragged batches (two new prompts; a decode token and a third prompt) and 4 greedy
    decode steps."""
    out = [engine.put([1, 2], [hm.tokens(11, 1), hm.tokens(5, 2)])]
    out.append(engine.put([1, 3], [out[-1][0:1].argmax(-1), hm.tokens(7, 3)]))
    for _ in range(4):
        out.append(engine.put([1, 3], [t.view(1) for t in out[-1].argmax(-1)]))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "gpt2", "llama:bfloat16"])
def test_serialized_engine_gives_the_same_logits(family: str, tmp_path: Path) -> None:
    family, _, dtype = family.partition(":")
    model = hm.build(family).to(getattr(torch, dtype or "float32"))
    engine = build_hf_engine(model, CONFIG)
    before = _logits(engine)
    engine.serialize(tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert {"config.json", "params_rank_0_of_1.pt", "metadata_rank_0_of_1.json"} <= set(names)
    assert not [n for n in names if n.startswith(".")]  # no temporary file left
    for loaded in (
        build_engine_from_ds_checkpoint(tmp_path, CONFIG),
        build_hf_engine(tmp_path, CONFIG),
    ):
        after = _logits(loaded)
        assert all(a.equal(b) for a, b in zip(before, after, strict=True)), family
        assert loaded.model.dtype == engine.model.dtype
    metadata = json.loads((tmp_path / "metadata_rank_0_of_1.json").read_text())
    assert metadata["policy"] == family and metadata["tp_size"] == 1
    # serializing again over the folder replaces it whole
    engine.serialize(tmp_path)
    assert sorted(os.listdir(tmp_path)) == names


class _RunsCode:
    """A pickle payload that would create ``marker`` when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    folder = tmp_path / "engine"
    build_hf_engine(hm.build("llama"), CONFIG).serialize(folder)
    return folder


def _refused(folder: Path, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        build_engine_from_ds_checkpoint(folder, CONFIG)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_untrusted_files_are_refused_unrun(saved: Path, tmp_path: Path) -> None:
    params = saved / "params_rank_0_of_1.pt"
    good = torch.load(params, weights_only=True)
    marker = tmp_path / "ran"
    # a params file that would run code when unpickled
    with open(params, "wb") as f:
        pickle.dump({"model.norm.weight": _RunsCode(marker)}, f)
    _refused(saved, "refused unread")
    assert not marker.exists()
    # a tensor of another shape, then a missing one
    name = "model.layers.0.mlp.down_proj.weight"
    torch.save({**good, name: good[name][:, :3].clone()}, params)
    _refused(saved, f"{name} is float32 \\[")
    torch.save({k: v for k, v in good.items() if k != name}, params)
    _refused(saved, "missing \\['model.layers.0.mlp.down_proj.weight'\\]")
    # a weight that is a window onto another's storage; weights of two dtypes; a buffer of
    # the wrong shape (the metadata rewritten to match each, as an attacker would)
    meta = saved / "metadata_rank_0_of_1.json"
    text = meta.read_text()
    other = "model.embed_tokens.weight"  # 256 x 64: room for a window at an offset
    window = good[other].view(-1)[1 : 1 + good[name].numel()].view(good[name].shape)
    for crafted, words in (
        ({**good, name: window}, "view into shared or larger storage"),
        ({**good, name: good[name].double()}, "mix dtypes"),
        ({**good, BUFFER: torch.ones(3)}, "saved buffer model.rotary_emb.inv_freq is"),
    ):
        torch.save(crafted, params)
        spec = json.loads(text)
        spec["tensors"] = {
            k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
            for k, v in crafted.items()
        }
        meta.write_text(json.dumps(spec))
        _refused(saved, words)
    meta.write_text(text)
    torch.save(good, params)
    build_engine_from_ds_checkpoint(saved, CONFIG)  # restored: it loads again
    # metadata from another format version, or not JSON
    meta.write_text(text.replace('"version": 1', '"version": 9'))
    _refused(saved, "format version 9")
    meta.write_text("{not json")
    _refused(saved, "not readable JSON")
    meta.write_text(text)
    # a tp size other than the saved one names the saved one
    os.rename(meta, saved / "metadata_rank_0_of_4.json")
    _refused(saved, "serialized with tensor_parallel.tp_size=4")


def test_a_deepspeed_checkpoint_is_refused_unpickled(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with open(saved / "ds_model_config.pkl", "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    for build in (build_engine_from_ds_checkpoint, build_hf_engine):
        with pytest.raises(ValueError, match="DeepSpeed inference v2 checkpoint"):
            build(saved, CONFIG)
    assert not marker.exists()
