"""Data sampling: the curriculum sampler and the data analyzer that indexes its metrics."""
