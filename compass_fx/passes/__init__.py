"""FX analysis: find matmul<->collective pairs, decide, and drive their rewrite."""
from .match import find_pairs
from ..graph.pairs import GatherPair, Pair, ReducePair, RowLayout
from .run import compass_pass

__all__ = ["GatherPair", "Pair", "ReducePair", "RowLayout", "compass_pass", "find_pairs"]
