"""Tests of shardspeed.runtime.precision and torch_autocast."""
