"""Helpers for the checkpoint tests: a toy training setup and subprocess entry points."""
