"""onebit."""
