"""The ragged model: a Hugging Face causal LM's forward over a ragged batch and a blocked KV
cache, as a pure function."""

from shardspeed.inference.v2.model.ragged_lm import SUPPORTED_FAMILIES, RaggedCausalLM

__all__ = ["SUPPORTED_FAMILIES", "RaggedCausalLM"]
