"""Checkpoint helpers DeepSpeed documents under ``deepspeed.checkpoint``."""

#: the model-states key a universal checkpoint (:mod:`.ds_to_universal`) adds
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
