"""zero."""
