"""Graph rewrites, behind one contract: a rewrite is built with a :class:`NodeBuilder` and
committed as one transaction (:func:`transaction`): the graph gets the whole rewrite, or the nodes
it added are erased and ``RewriteFailed`` says why.  InterDecom's pipelines of parts are built in
``decompose.py``, calls of the fused operators in ``fuse.py``, one function per pair kind each;
which one a pair gets is its kind's business (``passes``).  The rewrites import the shared
vocabulary (``graph``) and the operators (``kernels``), never the passes that decide."""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.fx as fx

# register compass::all_gather_blocking and compass::all_gather_mm_parts (counted as collectives)
from . import blocking_gather, gather_parts  # noqa: F401
from .graph_edit import Disorder, NodeBuilder, RewriteFailed, erase_unused, graph_fake_mode, stable_toposort

__all__ = ["Disorder", "NodeBuilder", "RewriteFailed", "erase_unused", "graph_fake_mode", "stable_toposort",
           "transaction"]

T = TypeVar("T")


def transaction(graph: fx.Graph, anchor: fx.Node, fake_mode: Any, build: Callable[[NodeBuilder], T],
                what: str) -> tuple[NodeBuilder, T]:
    """Build a rewrite before ``anchor`` with ``build(builder)`` and commit it; the builder (its new
    nodes, what they replaced) and ``build``'s result.

    If ``build`` fails, the nodes it added are erased (nothing else was touched yet) and
    ``RewriteFailed`` names ``what`` and the cause: a half-rewritten graph must never run."""
    b = NodeBuilder(graph, anchor, fake_mode)
    try:
        result = build(b)
        b.commit()
    except Exception as e:
        b.rollback()
        if isinstance(e, RewriteFailed):
            raise
        raise RewriteFailed(f"{what} rewrite failed ({type(e).__name__}: {e}); graph left as it was") from e
    return b, result
