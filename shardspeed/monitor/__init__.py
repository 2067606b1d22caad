"""monitor."""
