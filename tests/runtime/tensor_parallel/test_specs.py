"""AutoTP partition specifications (`runtime/tensor_parallel/specs.py`, `presets.py`): pattern
matching, shape rules, sub-parameter sizes, the JSON form, merging, the presets on real Hugging
Face parameter names, and which source `resolve_autotp_config` picks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.config.errors import DeepSpeedConfigError
from shardspeed.runtime.tensor_parallel import specs as specs_module
from shardspeed.runtime.tensor_parallel.presets import PRESET_NAMES
from shardspeed.runtime.tensor_parallel.specs import (
    AutoTPConfig,
    AutoTPPresets,
    PartitionType,
    TPLayerSpec,
    merge_autotp_configs,
    resolve_autotp_config,
)

COLUMN, ROW, SKIP = PartitionType.COLUMN, PartitionType.ROW, PartitionType.SKIP


# --- PartitionType -----------------------------------------------------------------------------


def test_partition_type_takes_any_case_and_names_the_choices_when_wrong() -> None:
    assert PartitionType("Column") is COLUMN
    assert PartitionType("ROW") is ROW
    assert PartitionType("skip") == "skip"  # a str enum: compares equal to its JSON value
    with pytest.raises(ValueError, match="'column', 'row', 'skip'"):
        PartitionType("colwise")


# --- TPLayerSpec: matching ---------------------------------------------------------------------


def test_partition_dim_defaults_to_the_split_dim_of_a_2d_weight() -> None:
    assert TPLayerSpec(patterns=["a"]).get_partition_dim() == 0
    assert TPLayerSpec(patterns=["a"], partition_type="row").get_partition_dim() == 1
    assert TPLayerSpec(patterns=["a"], partition_type="skip").get_partition_dim() == 1
    assert (
        TPLayerSpec(patterns=["a"], partition_type="row", partition_dim=0).get_partition_dim() == 0
    )


def test_patterns_match_from_the_start_of_the_parameter_name() -> None:
    spec = TPLayerSpec(patterns=[r"q_proj", r".*\.o_proj\.weight$"])
    # re.match anchors at the start: a bare name only matches a name that begins with it
    assert not spec.matches("model.layers.0.self_attn.q_proj.weight")
    assert spec.matches("q_proj.weight")
    assert spec.matches("model.layers.3.self_attn.o_proj.weight")
    assert not spec.matches("model.layers.3.self_attn.o_proj.bias")


def test_model_types_limit_a_spec_case_insensitively() -> None:
    spec = TPLayerSpec(patterns=[".*"], model_types=["Qwen2", "llama"])
    assert spec.matches("x.weight", "qwen2")
    assert spec.matches("x.weight", "LLAMA")
    assert not spec.matches("x.weight", "mistral")
    assert not spec.matches("x.weight", None)  # a limited spec needs to know the model
    assert TPLayerSpec(patterns=[".*"]).matches("x.weight", None)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"patterns": []}, ValueError, "patterns is empty"),
        ({"patterns": r".*\.weight$"}, TypeError, "must be a list of strings"),
        ({"patterns": ["(unclosed"]}, ValueError, "not a valid regular expression"),
        ({"patterns": ["a"], "partition_type": "diagonal"}, ValueError, "'column', 'row', 'skip'"),
        ({"patterns": ["a"], "partition_dim": -1}, ValueError, "non-negative integer"),
        ({"patterns": ["a"], "model_types": "llama"}, TypeError, r"\['llama'\]"),
        (
            {"patterns": ["a"], "gather_output": "yes"},
            TypeError,
            "gather_output must be true or false",
        ),
    ],
)
def test_bad_spec_fields_are_refused(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        TPLayerSpec(**kwargs)


# --- TPLayerSpec: shapes -----------------------------------------------------------------------


def test_json_lists_become_tuples_at_every_depth() -> None:
    spec = TPLayerSpec(patterns=["a"], shape=[[8, 4, 4], -1], partition_dim=0)
    assert spec.shape == ((8, 4, 4), -1)


@pytest.mark.parametrize(
    ("shape", "partition_dim", "message"),
    [
        ([2, [1, 1]], 0, "allowed only at partition_dim=0, found one at index 1"),
        ([[[1, 2], 3], -1], 0, "only one level of nesting"),
        ([[], -1], 0, "sizes is empty"),
        ([[4, 0], -1], 0, "positive integers"),
        ([0, -1], 0, "entry 0 at index 0"),
        ([2, -2], 0, "entry -2 at index 1"),
        ([2, 1.5], 0, "entry 1.5"),
        ([2, -1], 2, "partition_dim 2 is out of range"),
        ([], 0, "shape must be a list"),
    ],
)
def test_shapes_that_break_the_rules_are_refused(
    shape: Any, partition_dim: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TPLayerSpec(patterns=["a"], shape=shape, partition_dim=partition_dim)


def test_sub_param_sizes_of_plain_equal_and_unequal_packing() -> None:
    assert TPLayerSpec(patterns=["a"]).sub_param_sizes(12) == (12,)
    assert TPLayerSpec(patterns=["a"], shape=(2, -1), partition_dim=0).sub_param_sizes(16) == (8, 8)
    gqa = TPLayerSpec(patterns=["a"], shape=((8, 4, 4), -1), partition_dim=0)
    assert gqa.sub_param_sizes(16) == (8, 4, 4)
    # a row-parallel weight packs along its input features, dim 1
    assert TPLayerSpec(patterns=["a"], partition_type="row", shape=(-1, 3)).sub_param_sizes(12) == (
        4,
        4,
        4,
    )
    assert TPLayerSpec(patterns=["a"], partition_type="skip").sub_param_sizes(7) == (7,)


def test_sub_param_sizes_that_do_not_fit_the_weight_are_errors() -> None:
    with pytest.raises(ValueError, match="cannot hold 3 equal sub-parameters"):
        TPLayerSpec(patterns=["a"], shape=(3, -1), partition_dim=0).sub_param_sizes(16)
    with pytest.raises(ValueError, match=r"add up to 16, but the weight is 20 long"):
        TPLayerSpec(patterns=["a"], shape=((8, 4, 4), -1), partition_dim=0).sub_param_sizes(20)


def test_views_training_cannot_split_name_the_pattern() -> None:
    moe = TPLayerSpec(patterns=[r".*\.experts\.w1\.weight$"], shape=(8, -1, 16), partition_dim=1)
    with pytest.raises(ValueError, match=r"experts.*split dimension only"):
        moe.sub_param_sizes(64)
    across = TPLayerSpec(patterns=["a"], partition_type="column", partition_dim=1)
    with pytest.raises(ValueError, match="partition_dim is 0 for a column spec"):
        across.sub_param_sizes(16)


# --- AutoTPConfig: JSON form, matching, merging ------------------------------------------------

_PARTITION_CONFIG = {
    "use_default_specs": False,
    "strict_mode": True,
    "lm_head_patterns": ["lm_head"],
    "layer_specs": [
        {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
        {
            "patterns": [r".*\.qkv_proj\.weight$"],
            "partition_type": "COLUMN",
            "shape": [[8, 4, 4], -1],
            "partition_dim": 0,
            "model_types": ["llama"],
        },
        {"patterns": [r".*\.lm_head\.weight$"], "gather_output": True, "grad_allreduce": True},
    ],
}


def test_from_dict_reads_every_field_and_round_trips() -> None:
    config = AutoTPConfig.from_dict(_PARTITION_CONFIG)
    assert (config.use_default_specs, config.strict_mode) == (False, True)
    assert config.lm_head_patterns == ["lm_head"]
    row, qkv, head = config.layer_specs
    assert row.partition_type is ROW and row.get_partition_dim() == 1
    assert qkv.shape == ((8, 4, 4), -1) and qkv.model_types == ["llama"]
    assert head.partition_type is COLUMN and head.gather_output and head.grad_allreduce
    assert AutoTPConfig.from_dict(config.to_dict()) == config
    assert AutoTPConfig.from_dict({}) == AutoTPConfig()  # every default, DeepSpeed's


@pytest.mark.parametrize(
    ("partition_config", "message"),
    [
        ({"layer_spec": []}, "did you mean 'layer_specs'"),
        (
            {"layer_specs": [{"patterns": ["a"], "partition_typ": "row"}]},
            r"layer_specs\[0\]\.partition_typ.*'partition_type'",
        ),
        (
            {"layer_specs": [{"patterns": ["a"]}, {"partition_type": "row"}]},
            r"layer_specs\[1\] has no 'patterns'",
        ),
        (
            {"layer_specs": [{"patterns": ["a"], "shape": [2, [1, 1]]}]},
            r"layer_specs\[0\].*allowed only at partition_dim",
        ),
        ({"layer_specs": {"patterns": ["a"]}}, "must be a list of objects"),
        ({"use_default_specs": "no"}, "use_default_specs must be true or false"),
        ({"embedding_partition_dim": 2}, "embedding_partition_dim must be 0"),
    ],
)
def test_from_dict_errors_name_the_key(partition_config: dict[str, Any], message: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=message) as caught:
        AutoTPConfig.from_dict(partition_config)
    assert isinstance(caught.value, ValueError)


def test_first_matching_spec_wins_and_overlaps_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    monkeypatch.setattr(specs_module, "warning_once", warnings.append)
    skip = TPLayerSpec(patterns=[r".*linears\.0\.weight$"], partition_type="skip")
    column = TPLayerSpec(patterns=[r".*\.weight$"])
    config = AutoTPConfig(layer_specs=[skip, column])
    assert config.find_matching_spec("linears.0.weight") is skip
    assert len(warnings) == 1 and "linears.0.weight" in warnings[0]
    assert config.find_matching_spec("linears.1.weight") is column
    assert len(warnings) == 1  # one match: no warning
    assert config.find_matching_spec("linears.1.bias") is None


def test_merge_puts_the_override_first_and_its_settings_win() -> None:
    base = AutoTPConfig(tp_size=4, layer_specs=[TPLayerSpec(patterns=["base"])], strict_mode=True)
    override = AutoTPConfig(layer_specs=[TPLayerSpec(patterns=["mine"])], lm_head_patterns=[])
    merged = merge_autotp_configs(base, override)
    assert [spec.patterns for spec in merged.layer_specs] == [["mine"], ["base"]]
    assert merged.tp_size == 4  # the override's 1 means "unset"
    assert merged.lm_head_patterns == ["lm_head", "embed_out"]  # an empty list falls back
    assert merged.strict_mode is False
    assert merge_autotp_configs(base, AutoTPConfig(tp_size=2)).tp_size == 2


# --- presets -----------------------------------------------------------------------------------


def _tiny(family: str) -> tuple[torch.nn.Module, str]:
    import transformers

    sizes = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[family]
    heads = {"num_attention_heads": 4, "num_key_value_heads": 4 if family == "phi3" else 2}
    config = config_cls(**sizes, **heads, pad_token_id=0)
    with torch.device("meta"):
        return model_cls(config), config.model_type


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_and_qwen2_presets_split_every_projection_of_a_real_model(family: str) -> None:
    model, model_type = _tiny(family)
    preset = AutoTPPresets.get_preset(model_type)
    assert preset is not None
    expected = {"q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "o_proj": ROW}
    expected |= {"gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW}
    seen = {}
    for name, param in model.named_parameters():
        spec = preset.find_matching_spec(name, model_type)
        layer = name.split(".")[-2]
        if name.endswith(".weight") and layer in expected:
            assert spec is not None, name
            seen[layer] = spec.partition_type
            dim = spec.get_partition_dim()
            assert spec.sub_param_sizes(param.shape[dim]) == (param.shape[dim],)
        else:  # embeddings, norms, the head, biases: not the preset's business
            assert spec is None, name
    assert seen == expected


def test_phi3_preset_splits_the_fused_weights_of_a_real_model_per_sub_parameter() -> None:
    model, model_type = _tiny("phi3")
    preset = AutoTPPresets.get_preset(model_type)
    assert preset is not None
    params = dict(model.named_parameters())
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    gate_up = params["model.layers.0.mlp.gate_up_proj.weight"]
    qkv_spec = preset.find_matching_spec("model.layers.0.self_attn.qkv_proj.weight")
    gate_up_spec = preset.find_matching_spec("model.layers.0.mlp.gate_up_proj.weight")
    assert qkv_spec is not None and gate_up_spec is not None
    assert qkv_spec.sub_param_sizes(qkv.shape[0]) == (16, 16, 16)
    assert gate_up_spec.sub_param_sizes(gate_up.shape[0]) == (32, 32)
    down = preset.find_matching_spec("model.layers.0.mlp.down_proj.weight")
    assert down is not None and down.partition_type is ROW


def test_llama_gqa_preset_packs_unequal_q_k_v() -> None:
    preset = AutoTPPresets.llama_gqa(num_heads=8, num_kv_heads=2, head_dim=4)
    spec = preset.find_matching_spec("model.layers.5.self_attn.qkv_proj.weight")
    assert spec is not None and spec.partition_type is COLUMN
    assert spec.sub_param_sizes(32 + 8 + 8) == (32, 8, 8)


@pytest.mark.parametrize(
    ("preset", "name", "kind"),
    [
        ("bloom", "transformer.h.0.self_attention.query_key_value.weight", COLUMN),
        ("bloom", "transformer.h.0.self_attention.dense.weight", ROW),
        ("bloom", "transformer.h.0.mlp.dense_4h_to_h.weight", ROW),
        ("chatglm", "transformer.encoder.layers.0.self_attention.query_key_value.weight", COLUMN),
        ("chatglm", "transformer.encoder.layers.0.mlp.dense_h_to_4h.weight", COLUMN),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w1.weight", COLUMN),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w3.weight", COLUMN),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.7.w2.weight", ROW),
        ("mixtral", "model.layers.0.block_sparse_moe.gate.weight", SKIP),
        ("deepseek_v2", "model.layers.1.self_attn.q_a_proj.weight", SKIP),
        ("deepseek_v2", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", SKIP),
        ("deepseek_v2", "model.layers.1.self_attn.kv_b_proj.weight", COLUMN),
        ("deepseek_v2", "model.layers.1.mlp.experts.3.gate_proj.weight", COLUMN),
        ("deepseek_v2", "model.layers.1.mlp.shared_experts.down_proj.weight", ROW),
        ("deepseek_v2", "model.layers.1.mlp.gate.weight", SKIP),
    ],
)
def test_other_presets_classify_their_family_names(
    preset: str, name: str, kind: PartitionType
) -> None:
    config = AutoTPPresets.get_preset(preset)
    assert config is not None
    spec = config.find_matching_spec(name)
    assert spec is not None and spec.partition_type is kind


def test_chatglm_packs_qkv_in_thirds_and_the_mlp_input_in_halves() -> None:
    config = AutoTPPresets.chatglm()
    qkv = config.find_matching_spec(
        "transformer.encoder.layers.0.self_attention.query_key_value.weight"
    )
    mlp = config.find_matching_spec("transformer.encoder.layers.0.mlp.dense_h_to_4h.weight")
    assert qkv is not None and mlp is not None
    assert qkv.sub_param_sizes(48) == (16, 16, 16)
    assert mlp.sub_param_sizes(64) == (32, 32)


def test_get_preset_is_case_insensitive_and_hands_out_fresh_copies() -> None:
    assert set(PRESET_NAMES) == {
        "llama",
        "bloom",
        "chatglm",
        "mixtral",
        "deepseek_v2",
        "qwen2",
        "phi3",
    }
    first = AutoTPPresets.get_preset("LLaMA")
    assert first is not None and len(first.layer_specs) == 4
    first.layer_specs.clear()
    again = AutoTPPresets.get_preset("llama")
    assert again is not None and len(again.layer_specs) == 4
    assert AutoTPPresets.get_preset("gpt2") is None


# --- resolve_autotp_config ---------------------------------------------------------------------

_CUSTOM = {"layer_specs": [{"patterns": [r".*\.special\.weight$"], "partition_type": "row"}]}


def _patterns(config: AutoTPConfig | None) -> list[list[str]]:
    assert config is not None
    return [spec.patterns for spec in config.layer_specs]


def test_resolve_without_config_or_preset_leaves_the_choice_to_the_caller() -> None:
    assert resolve_autotp_config(None, None, "llama") is None
    assert resolve_autotp_config({}, None, "llama") is None  # an empty section is no section


def test_resolve_preset_alone_and_unknown_preset() -> None:
    assert _patterns(resolve_autotp_config(None, "Phi3", None)) == _patterns(AutoTPPresets.phi3())
    with pytest.raises(ValueError, match="'gpt2' is not a preset; choose one of llama, bloom"):
        resolve_autotp_config(None, "gpt2", None)


def test_resolve_puts_custom_specs_on_top_of_the_preset() -> None:
    llama = _patterns(AutoTPPresets.llama())
    custom = [[r".*\.special\.weight$"]]
    assert _patterns(resolve_autotp_config(_CUSTOM, "llama", None)) == custom + llama
    # without preset_model, the model's own type picks the preset
    assert _patterns(resolve_autotp_config(_CUSTOM, None, "LLAMA")) == custom + llama
    # preset_model outranks the model type
    assert _patterns(resolve_autotp_config(_CUSTOM, "bloom", "llama")) == custom + _patterns(
        AutoTPPresets.bloom()
    )
    assert _patterns(resolve_autotp_config(_CUSTOM, None, "gpt2")) == custom


def test_resolve_custom_specs_alone_when_defaults_are_off() -> None:
    alone = {**_CUSTOM, "use_default_specs": False}
    resolved = resolve_autotp_config(alone, "llama", "llama")
    assert _patterns(resolved) == [[r".*\.special\.weight$"]]
    assert resolved is not None and resolved.use_default_specs is False


def test_specs_module_and_module_inject_offer_the_same_objects() -> None:
    import shardspeed.module_inject as module_inject
    from shardspeed.module_inject.autotp_config import AutoTPConfig as ShimConfig

    assert module_inject.AutoTPPresets is AutoTPPresets
    assert module_inject.TPLayerSpec is TPLayerSpec
    assert ShimConfig is AutoTPConfig
    assert specs_module.resolve_autotp_config is resolve_autotp_config
