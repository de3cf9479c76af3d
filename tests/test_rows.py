"""The row moves of a decomposed pair's parts (``lowering/rows.py``), run on real tensors: the
ranks' slabs placed side by side along a dim and stacked back on dim 0 give exactly what a split
into one piece per rank and a cat give, at every group size and dim, in a node count that does
not grow with the group."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from compass_fx.lowering.graph_edit import NodeBuilder
from compass_fx.lowering.rows import ranks_side_by_side, ranks_stacked


def _built(move, x: torch.Tensor, world: int, dim: int) -> tuple[torch.Tensor, int]:
    """``move`` built into a graph of one placeholder and run on ``x``: its result and node count."""
    gm = make_fx(lambda t: t.clone(), tracing_mode="fake")(x)
    [clone] = [n for n in gm.graph.nodes if n.op == "call_function"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    b = NodeBuilder(gm.graph, out, clone.meta["val"].fake_mode)
    moved = move(b, clone, world, dim)
    out.args = (moved,)
    gm.graph.lint()
    gm.recompile()
    return fx.GraphModule(gm, gm.graph)(x), len(b.created)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("shape,dim", [((2, 3, 5), 1), ((2, 3, 5, 4), 2), ((3, 2, 4), 1), ((2, 2, 3, 4), 1)])
def test_ranks_side_by_side_is_the_cat_of_the_split(world, shape, dim):
    stacked = torch.randn(world * shape[0], *shape[1:])
    got, nodes = _built(ranks_side_by_side, stacked, world, dim)
    assert torch.equal(got, torch.cat(stacked.split(shape[0], 0), dim))
    assert got.is_contiguous() and nodes == 4


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("shape,dim", [((2, 3, 5), 1), ((2, 3, 5, 4), 2), ((3, 2, 4), 1), ((2, 2, 3, 4), 1)])
def test_ranks_stacked_is_the_cat_of_the_split(world, shape, dim):
    wide = list(shape)
    wide[dim] *= world
    x = torch.randn(wide)
    got, nodes = _built(ranks_stacked, x, world, dim)
    assert torch.equal(got, torch.cat(x.split(shape[dim], dim), 0))
    assert got.is_contiguous() and nodes == 4
    back, _ = _built(ranks_side_by_side, got, world, dim)
    assert torch.equal(back, x)
