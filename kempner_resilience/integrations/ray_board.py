"""Moved to ``kempner_resilience.supervise.ray.board``; this path keeps working."""

from kempner_resilience.supervise.ray.board import (BoardWatcher, create_board)

__all__ = ["create_board", "BoardWatcher"]
