"""Graph rewrites, behind one contract: :func:`rewrite` turns one pair into what a Decision says
(InterDecom's pipeline of parts, ``decompose.py``; a call of a fused operator, ``fuse.py``) as one
transaction: the graph is rewritten whole, or restored and ``RewriteFailed`` says why.  The
rewrites import the shared vocabulary (``graph``) and the operators (``kernels``), never the
passes that decide."""
from __future__ import annotations

import copy

import torch.fx as fx

from ..cost.decision import Decision
from ..graph.pairs import Pair, ReducePair
from . import blocking_gather  # noqa: F401 - registers compass::all_gather_blocking (counted as a collective)
from .graph_edit import RewriteFailed

__all__ = ["RewriteFailed", "rewrite"]


def rewrite(gm: fx.GraphModule, pair: Pair, decision: Decision, asynchronous: bool = False) -> bool:
    """Rewrite ``pair`` in ``gm`` as ``decision`` says ("decompose" or "fuse"); True when the
    fused call runs asynchronously (``asynchronous`` asks for it; only reductions can).

    One transaction: if anything fails half-way, ``gm`` gets back a copy of its graph taken before
    and ``RewriteFailed`` names the pair and the cause (a half-rewritten graph must never run)."""
    from . import decompose, fuse

    if decision.strategy not in ("decompose", "fuse"):
        raise ValueError(f"rewrite: nothing to do for strategy {decision.strategy!r}")
    if decision.strategy == "decompose" and decision.parts not in pair.feasible_parts():
        raise ValueError(f"parts={decision.parts} does not divide the split dimension of {pair.describe()}")
    why = fuse.unsupported(pair) if decision.strategy == "fuse" else ""
    if why:  # refused before anything is touched: no copy to restore
        raise RewriteFailed(why)
    described = pair.describe()  # the pair's nodes are gone once it is rewritten
    backup = copy.deepcopy(gm.graph)
    try:
        if decision.strategy == "fuse":
            asynchronous = asynchronous and isinstance(pair, ReducePair)  # a gather's GEMMs need what arrives
            fuse.lower(gm, pair, decision, asynchronous)
        else:
            asynchronous = False
            decompose.decompose(gm, pair, decision.parts)
        gm.graph.lint()
    except Exception as e:  # restored, then reported with the pair
        gm.graph = backup
        if isinstance(e, RewriteFailed):
            raise
        raise RewriteFailed(f"{described}: {decision.label} rewrite failed ({type(e).__name__}: {e}); "
                            "graph left as it was") from e
    return asynchronous
