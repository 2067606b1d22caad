"""Checkpoint helpers DeepSpeed documents under ``deepspeed.checkpoint``."""
