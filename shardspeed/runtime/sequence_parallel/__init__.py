"""Sequence parallelism for Hugging Face models: DeepSpeed's Arctic Long Sequence Training
(ALST). Import the public names from :mod:`.ulysses_sp` (DeepSpeed's module path)."""
