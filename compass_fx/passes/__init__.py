"""FX analysis: find matmul<->collective pairs (one module per pair kind: its matching, the
strategies its lowering takes and the surgery for each), decide, and agree across ranks.  The pass
that drives them over a graph is ``compass_fx.graph_pass``."""
from ..graph.pairs import GatherPair, Pair, ReducePair, RowLayout
from .find import KINDS, find_pairs

__all__ = ["GatherPair", "KINDS", "Pair", "ReducePair", "RowLayout", "find_pairs"]
