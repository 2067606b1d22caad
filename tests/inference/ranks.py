"""Functions run on every rank of a gloo pool by the inference tests."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

import shardspeed
from shardspeed import comm
from tests.inference import models


def tp_parity(families: list[str], **config: Any) -> dict[str, dict[str, Any]]:
    """Each family sharded over the world vs the same model in one process: max logit error,
    whether 32 greedy tokens agree, and the fraction of the weight bytes this rank holds."""
    world = comm.get_world_size()
    results: dict[str, dict[str, Any]] = {}
    ids = models.prompt()
    for family in families:
        reference = models.build(family)
        want_logits = reference(ids).logits
        want_tokens = models.greedy(reference, ids)
        engine = shardspeed.init_inference(
            copy.deepcopy(reference),
            tensor_parallel={"tp_size": world},
            dtype=torch.float32,
            **config,
        )
        got_logits = engine(ids).logits
        got_tokens = models.greedy(engine, ids)
        results[family] = {
            "max_err": (got_logits - want_logits).abs().max().item(),
            "tokens_equal": torch.equal(got_tokens, want_tokens),
            "bytes_ratio": models.weight_bytes(engine.module) / models.weight_bytes(reference),
        }
    return results


def check_tp_parity(
    results: list[dict[str, dict[str, Any]]], families: list[str], slack: dict[str, float]
) -> None:
    """Assert :func:`tp_parity`'s figures from every rank: max logit error < 1e-5, identical
    greedy tokens, mean weight bytes per rank under 1/world + the family's slack (0.06 unless
    named: norms and anything split unevenly or replicated stay a little over 1/tp)."""
    world = len(results)
    for family in families:
        per_rank = [rank_results[family] for rank_results in results]
        for figures in per_rank:
            assert figures["max_err"] < 1e-5, (family, figures)
            assert figures["tokens_equal"], (family, figures)
        mean_ratio = sum(f["bytes_ratio"] for f in per_rank) / world
        assert mean_ratio < 1 / world + slack.get(family, 0.06), (family, per_rank)


def load_from_safetensors(family: str, directory: str) -> dict[str, Any]:
    """Rank 0 saves the model as several safetensors shards; every rank builds it on the meta
    device and loads only its slices. Returns the max logit error vs the in-memory model."""
    from accelerate import init_empty_weights

    reference = models.build(family)
    if comm.get_rank() == 0:
        reference.save_pretrained(directory, max_shard_size="40KB")
    comm.barrier()
    with init_empty_weights():
        empty = models.build(family)
    engine = shardspeed.init_inference(
        empty,
        checkpoint=directory,
        tensor_parallel={"tp_size": comm.get_world_size()},
        dtype=torch.float32,
    )
    ids = models.prompt()
    shards = len(list(Path(directory).glob("*.safetensors")))
    on_meta = [n for n, p in engine.module.named_parameters() if p.is_meta]
    err = (engine(ids).logits - reference(ids).logits).abs().max().item()
    return {"max_err": err, "shards": shards, "on_meta": on_meta}


def error_messages(directory: str) -> dict[str, str]:
    """The ValueError each misuse raises, by case."""
    world = comm.get_world_size()
    cases: dict[str, Any] = {
        "heads": lambda: shardspeed.init_inference(
            models.build("qwen2", num_attention_heads=1, num_key_value_heads=1, head_dim=64),
            tensor_parallel={"tp_size": world},
            dtype=torch.float32,
        ),
        "world": lambda: shardspeed.init_inference(
            models.build("qwen2"), tensor_parallel={"tp_size": 3}, dtype=torch.float32
        ),
        "shape": lambda: shardspeed.init_inference(
            models.build("llama", intermediate_size=64),
            checkpoint=directory,
            tensor_parallel={"tp_size": world},
            dtype=torch.float32,
        ),
        "unknown": lambda: shardspeed.init_inference(
            torch.nn.Sequential(_Block()), tensor_parallel={"tp_size": world}, dtype=torch.float32
        ),
    }
    messages = {}
    for name, make in cases.items():
        try:
            make()
        except ValueError as exc:
            messages[name] = str(exc)
        else:
            messages[name] = "no error"
    return messages


def int8_under_tp(family: str) -> dict[str, float]:
    """int8 weights on top of AutoTP over the world vs the fp32 single-process model."""
    from tests.inference.int8_quality import quality

    reference = models.trained(family)
    engine = shardspeed.init_inference(
        models.trained(family), tensor_parallel={"tp_size": comm.get_world_size()}, dtype=torch.int8
    )
    return quality(reference, engine)


def fused_tp_tokens(families: list[str]) -> dict[str, bool]:
    """Fused decoding sharded over the world: 32 greedy tokens equal single-process HF eager."""
    ids = models.prompt()
    equal = {}
    for family in families:
        want = models.greedy(models.build(family, attn_implementation="eager"), ids)
        engine = shardspeed.init_inference(
            models.build(family),
            tensor_parallel={"tp_size": comm.get_world_size()},
            dtype=torch.float32,
            replace_with_kernel_inject=True,
            max_out_tokens=64,
        )
        assert engine.fused is not None
        equal[family] = torch.equal(models.greedy(engine, ids), want)
    return equal


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = torch.nn.Linear(16, 64)
        self.fc_out = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(torch.relu(self.fc_in(x)))


def policy_parity() -> float:
    """A model AutoTP does not know, split by ``injection_policy``: max error vs unsplit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block()).eval()
    x = torch.randn(3, 16)
    want = model(x)
    engine = shardspeed.init_inference(
        copy.deepcopy(model),
        dtype=torch.float32,
        tensor_parallel={"tp_size": comm.get_world_size(), "tp_grain_size": 1},
        injection_policy={_Block: ("fc_out",)},
    )
    assert engine.module[0].fc_in.out_features == 64 // comm.get_world_size()
    return (engine(x) - want).abs().max().item()


def load_peak_rss(directory: str) -> dict[str, int]:
    """A ~21 MB Llama saved in 2 MB safetensors shards (its 8 MB embedding and head are single
    tensors) loaded at TP = world into an empty model: this rank's slice bytes, the largest
    shard, the whole model, and the peak RSS growth while loading."""
    from accelerate import init_empty_weights

    from tests.inference.peak_rss import PeakRSS

    sizes = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 512}
    reference = models.build("llama", vocab_size=8192, num_key_value_heads=4, **sizes)
    full = models.weight_bytes(reference)
    if comm.get_rank() == 0:
        reference.save_pretrained(directory, max_shard_size="2MB")
    del reference
    comm.barrier()
    with init_empty_weights():
        empty = models.build("llama", vocab_size=8192, num_key_value_heads=4, **sizes)
    with PeakRSS() as rss:
        engine = shardspeed.init_inference(
            empty,
            checkpoint=directory,
            tensor_parallel={"tp_size": comm.get_world_size()},
            dtype=torch.float32,
        )
    largest = max(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
    return {
        "slice": models.weight_bytes(engine.module),
        "largest_shard": largest,
        "full": full,
        "growth": rss.growth,
    }


def tp_in_subgroups() -> dict[str, Any]:
    """TP 2 on a world of 4: two groups of consecutive ranks, each equal to one process."""
    reference = models.build("llama")
    ids = models.prompt()
    engine = shardspeed.init_inference(
        copy.deepcopy(reference), tensor_parallel={"tp_size": 2}, dtype=torch.float32
    )
    err = (engine(ids).logits - reference(ids).logits).abs().max().item()
    return {"tp_rank": engine.tp.rank, "tp_size": engine.mp_world_size, "max_err": err}
