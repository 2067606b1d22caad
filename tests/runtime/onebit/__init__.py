"""Tests of the 1-bit optimizers."""
