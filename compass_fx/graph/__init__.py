"""What every stage shares: the FX vocabulary (:mod:`.nodes`) and the pair types (:mod:`.pairs`).

Stages, each importing only those before it: ``kernels`` and ``cost`` (pure), ``graph``, then
``passes`` finding and deciding, ``lowering``, the pair kinds (``passes.all_gather_matmul`` ...:
matching, strategies, surgery), and the pass on top (``graph_pass``), the backend.
"""
from .pairs import GatherPair, Pair, ReducePair, RowLayout

__all__ = ["GatherPair", "Pair", "ReducePair", "RowLayout"]
