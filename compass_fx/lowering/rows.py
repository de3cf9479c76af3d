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


def ranks_side_by_side(b: NodeBuilder, stacked: fx.Node, world: int, dim: int) -> fx.Node:
    """The ranks' slabs, stacked on dim 0 as a gather returns them, placed side by side along
    ``dim`` instead: what ``cat(split(stacked, rows, 0), dim)`` gives, in four nodes whatever the
    group's size (a view that names the ranks, a permute that moves them next to ``dim``, one copy,
    a view) where the split and cat take one per rank."""
    slab = list(shape_of(stacked))
    slab[0] //= world
    named = b.view(stacked, [world, *slab])
    order = [*range(1, dim + 1), 0, *range(dim + 1, len(slab) + 1)]
    moved = b.contiguous(b.call(aten.permute.default, named, order))
    out = list(slab)
    out[dim] *= world
    return b.view(moved, out)


def ranks_stacked(b: NodeBuilder, x: fx.Node, world: int, dim: int) -> fx.Node:
    """The inverse of ``ranks_side_by_side``: ``x`` cut along ``dim`` into one run per rank, the
    runs stacked on dim 0 as a reduce-scatter takes them (``cat(split(x, extent // world, dim),
    0)``), in four nodes whatever the group's size."""
    shape = list(shape_of(x))
    run = shape[dim] // world
    named = b.view(x, [*shape[:dim], world, run, *shape[dim + 1:]])
    order = [dim, *range(dim), *range(dim + 1, len(shape) + 1)]
    moved = b.contiguous(b.call(aten.permute.default, named, order))
    out = list(shape)
    out[0] *= world
    out[dim] = run
    return b.view(moved, out)
