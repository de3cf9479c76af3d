"""FX analysis: find matmul<->collective pairs, decide, and drive their rewrite."""
from .match import find_pairs
from ..graph.pairs import Pair, RowLayout
from .run import compass_pass

__all__ = ["Pair", "RowLayout", "compass_pass", "find_pairs"]
