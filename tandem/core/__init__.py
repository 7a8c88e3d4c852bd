"""tandem.core."""
