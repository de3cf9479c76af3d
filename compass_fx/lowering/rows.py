"""Row bookkeeping for decomposed pairs: which rows of a 2-D operand belong to part i.

The logical tensor around a collective has shape ``lead + [extent] + mid + [cols]`` with the
collective's dim of size ``extent = world * parts * c``.  Part i owns, on every rank, the i-th
block of c rows of that rank's slab; ``select_rows`` cuts them out of a row-aligned 2-D operand
and ``interleave_rows`` puts per-part results back into the original row order.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..graph.pairs import RowLayout
from ..graph.nodes import shape_of
from .graph_edit import NodeBuilder

aten = torch.ops.aten


def _split_shape(layout: RowLayout, parts: int, sub: int, trailing: list[int]) -> list[int]:
    g = layout.dim
    c = layout.shape[g] // (layout.world * parts)
    return list(layout.shape[:g]) + [layout.world, sub, c] + list(layout.shape[g + 1:-1]) + trailing


def block_shape(layout: RowLayout, parts: int) -> tuple[int, int]:
    """(blocks, rows of one part in a block): the layout's 2-D rows are ``blocks`` slabs (every
    lead index times every rank) of ``parts`` runs of that many rows each, as ``select_rows``
    splits them."""
    split, g = _split_shape(layout, parts, parts, []), layout.dim  # lead + [W, parts, c] + mid
    return math.prod(split[:g + 1]), math.prod(split[g + 2:])


def select_rows(b: NodeBuilder, x2d: fx.Node, layout: RowLayout, parts: int, i: int) -> fx.Node:
    """Rows of part ``i`` (on every rank's slab) of a 2-D tensor aligned with the layout's rows."""
    cols = shape_of(x2d)[-1]
    v = b.view(x2d, _split_shape(layout, parts, parts, [cols]))
    sel = b.contiguous(b.call(aten.select.int, v, layout.dim + 1, i))
    return b.view(sel, [layout.rows // parts, cols])


def interleave(b: NodeBuilder, pieces: list[fx.Node], layout: RowLayout, trailing: list[int]) -> fx.Node:
    """Inverse of ``select_rows`` for a list of per-part tensors: ``lead+[W,parts,c]+mid+trailing``."""
    parts = len(pieces)
    views = [b.view(p, _split_shape(layout, parts, 1, trailing)) for p in pieces]
    return b.cat(views, layout.dim + 1)


def interleave_rows(b: NodeBuilder, pieces: list[fx.Node], layout: RowLayout) -> fx.Node:
    """Per-part 2-D results (rows of part i) back into one 2-D tensor in the original row order."""
    cols = shape_of(pieces[0])[-1]
    return b.view(interleave(b, pieces, layout, [cols]), [layout.rows, cols])
