"""What every stage shares: the FX vocabulary (:mod:`.nodes`) and the pair types (:mod:`.pairs`).

Stages, each importing only those before it: ``kernels`` and ``cost`` (pure), ``graph``, then
``passes`` finding and deciding, ``lowering``, and the pass on top (``passes.run``), the backend.
"""
from .pairs import GatherPair, Pair, ReducePair, RowLayout

__all__ = ["GatherPair", "Pair", "ReducePair", "RowLayout"]
