"""The AutoTP training plan (`runtime/tensor_parallel/plan.py`) on small Hugging Face models
built on the meta device: which modules split how, every rank's ranges, the head counts, and
the errors that name what does not fit."""

from __future__ import annotations

import pytest
import torch

from shardspeed.runtime.tensor_parallel.plan import build_training_plan, hf_tp_plan
from shardspeed.runtime.tensor_parallel.specs import resolve_autotp_config

transformers = pytest.importorskip("transformers")

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _meta(config_class: str, model_class: str, **extra: object) -> torch.nn.Module:
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    with torch.device("meta"):
        return getattr(transformers, model_class)(config)


def _ranges(plan, name: str) -> list[tuple[tuple[int, int], ...]]:
    layout = plan.splits[name].layout
    return [piece.pieces for piece in layout.pieces]


def test_llama_follows_its_hugging_face_plan_with_heads_kept_whole() -> None:
    model = _meta("LlamaConfig", "LlamaForCausalLM")
    assert hf_tp_plan(model)["model.layers.*.self_attn.q_proj"] == "colwise"
    plan = build_training_plan(model, 4)
    assert plan.source == "tp_plan"
    attn = "model.layers.0.self_attn"
    assert _ranges(plan, f"{attn}.q_proj") == [((0, 8),), ((8, 16),), ((16, 24),), ((24, 32),)]
    # 2 key/value heads over 4 ranks: ranks 0-1 keep head 0, ranks 2-3 head 1
    assert _ranges(plan, f"{attn}.k_proj") == [((0, 8),), ((0, 8),), ((8, 16),), ((8, 16),)]
    assert plan.splits[f"{attn}.o_proj"].kind == "row"
    assert plan.splits["model.embed_tokens"].kind == "vocab"
    assert plan.splits["lm_head"].gather_output
    assert (attn, "num_key_value_groups", 1) in plan.attrs
    assert plan.head_counts == {"num_attention_heads": 1, "num_key_value_heads": 1}


def test_mlp_widths_follow_the_grain() -> None:
    model = _meta("LlamaConfig", "LlamaForCausalLM", intermediate_size=80)
    plan = build_training_plan(model, 2, grain=16)
    # 80 = 5 x 16: the first rank takes the extra grain
    assert _ranges(plan, "model.layers.0.mlp.up_proj") == [((0, 48),), ((48, 80),)]


def test_phi3_preset_cuts_the_fused_projection_in_q_kv_kv_parts() -> None:
    model = _meta("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)
    specs = resolve_autotp_config(None, "phi3", "phi3")
    plan = build_training_plan(model, 2, specs=specs)
    assert plan.source == "partition_config"
    # q 32 rows, k 16, v 16; DeepSpeed's (3, -1) would cut at 21/42
    assert _ranges(plan, "model.layers.0.self_attn.qkv_proj") == [
        ((0, 16), (32, 40), (48, 56)),
        ((16, 32), (40, 48), (56, 64)),
    ]
    assert _ranges(plan, "model.layers.0.mlp.gate_up_proj") == [
        ((0, 24), (48, 72)),
        ((24, 48), (72, 96)),
    ]
    with pytest.raises(ValueError, match="shared by several tensor-parallel ranks"):
        build_training_plan(model, 4, specs=specs)


def test_phi3_hugging_face_plan_gathers_and_splits_whole_inputs() -> None:
    model = _meta("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)
    plan = build_training_plan(model, 4)
    qkv = plan.splits["model.layers.0.self_attn.qkv_proj"]
    out = plan.splits["model.layers.0.self_attn.o_proj"]
    assert qkv.gather_output and not out.input_is_parallel
    assert plan.head_counts == {}  # attention sees every head


def test_gpt2_has_no_plan_and_takes_the_structural_rules() -> None:
    config = transformers.GPT2Config(vocab_size=64, n_positions=8, n_embd=32, n_layer=1, n_head=4)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    assert hf_tp_plan(model) == {}
    plan = build_training_plan(model, 2)
    assert plan.source == "heuristics"
    assert plan.splits["transformer.h.0.attn.c_attn"].kind == "column"
    assert plan.splits["transformer.h.0.mlp.c_proj"].kind == "row"


def test_errors_name_what_does_not_fit() -> None:
    model = _meta("LlamaConfig", "LlamaForCausalLM")
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        build_training_plan(model, 3)
    mixtral = _meta("MixtralConfig", "MixtralForCausalLM", num_local_experts=2)
    with pytest.raises(ValueError, match="'moe_tp_experts'.*partition_config"):
        build_training_plan(mixtral, 2)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no rule splits Sequential.*\[.0., .1.\].*layer_specs"):
        build_training_plan(mlp, 2)
    strict = resolve_autotp_config(
        {
            "use_default_specs": False,
            "strict_mode": True,
            "layer_specs": [{"patterns": [r".*\.q_proj\.weight$"], "partition_type": "column"}],
        },
        None,
        "llama",
    )
    with pytest.raises(ValueError, match=r"strict_mode.*model\.layers\.0\.self_attn\.k_proj"):
        build_training_plan(model, 2, specs=strict)


def test_initialize_refuses_what_autotp_does_not_combine_with() -> None:
    from types import SimpleNamespace

    from shardspeed.config import DeepSpeedConfig
    from shardspeed.runtime.assembly import check_tensor_parallel

    config = DeepSpeedConfig(
        {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}},
        dp_world_size=1,
    )
    model = torch.nn.Linear(4, 4)
    # a PipelineModule's grid (sequence parallelism's mpu has a parallel_topology too)
    grid = SimpleNamespace(parallel_topology=object(), get_pipe_parallel_world_size=lambda: 2)
    with pytest.raises(NotImplementedError, match="autotp_size=2 with a PipelineModule"):
        check_tensor_parallel(config, model, grid)
    model.weight.ds_id = 0  # built under zero.Init: partitioned already
    with pytest.raises(NotImplementedError, match="built under zero.Init"):
        check_tensor_parallel(config, model, None)
    plain = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1}, dp_world_size=1)
    check_tensor_parallel(plain, model, grid)  # no AutoTP: nothing to refuse


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)


class _Custom(torch.nn.Module):
    """A model with its own ``_tp_plan`` on a child (no ``tp_plan`` property): the plan is
    collected with the child's prefix, layer numbers as ``*``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.blocks._tp_plan = {"*.up": "colwise", "*.down": "rowwise"}
        self.head = torch.nn.Linear(8, 4)


def test_a_plan_on_a_child_is_found_with_its_prefix() -> None:
    model = _Custom()
    assert hf_tp_plan(model) == {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
    plan = build_training_plan(model, 2)
    assert plan.source == "tp_plan"
    assert {n: s.kind for n, s in plan.splits.items()} == {
        "blocks.0.up": "column",
        "blocks.0.down": "row",
        "blocks.1.up": "column",
        "blocks.1.down": "row",
    }
    assert plan.replicated == ["head"]
    model.blocks._tp_plan = {"*.up": "local_colwise", "*.down": "rowwise"}
    with pytest.raises(ValueError, match=r"blocks\.0\.up.*'local_colwise'"):
        build_training_plan(model, 2)
