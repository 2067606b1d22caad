"""Utilities: logging, timers, loaders."""
