"""activation_checkpointing."""
