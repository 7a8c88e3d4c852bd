"""Tandem: shared pieces (CLI entry point, errors, artifact I/O)."""
