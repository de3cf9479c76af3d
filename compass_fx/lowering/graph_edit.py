"""Small, careful FX editing helpers shared by every rewrite.

New nodes get a ``meta["val"]`` computed under the graph's own fake mode, so that the inner
compiler (Inductor) sees the same metadata it would get from tracing.  Blocks are inserted before
an anchor and the graph is then re-sorted stably, so that an operand defined after the anchor
(a weight permuted late in a backward graph) never breaks the graph.
"""
from __future__ import annotations

import heapq
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

from ..graph.nodes import PART_MARK


class RewriteFailed(RuntimeError):
    """A rewrite could not be applied; the graph is exactly as it was before it started."""


class NodeBuilder:
    """Creates nodes before ``anchor`` in ``graph`` and fills in their fake-tensor metadata."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node) -> None:
        self.graph = graph
        self.anchor = anchor
        self.created: list[fx.Node] = []
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if "val" in n.meta])

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.created.append(node)
        self._infer_meta(node)
        return node

    def _infer_meta(self, node: fx.Node) -> None:
        def val(a: Any) -> Any:
            return a.meta["val"] if isinstance(a, fx.Node) else a

        args = tree_map(val, node.args)
        kwargs = tree_map(val, node.kwargs)
        if self.fake_mode is None:
            return
        with self.fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)

    # Shorthands for the few ops the rewrites use.
    def view(self, x: fx.Node, shape: Iterable[int]) -> fx.Node:
        return self.call(aten.view.default, x, list(shape))

    def contiguous(self, x: fx.Node) -> fx.Node:
        return self.call(aten.clone.default, x, memory_format=torch.contiguous_format)

    def slice(self, x: fx.Node, dim: int, start: int, end: int) -> fx.Node:
        return self.call(aten.slice.Tensor, x, dim, start, end)

    def cat(self, xs: list[fx.Node], dim: int) -> fx.Node:
        return self.call(aten.cat.default, list(xs), dim)

    def add(self, a: fx.Node, b: fx.Node) -> fx.Node:
        return self.call(aten.add.Tensor, a, b)

    def split(self, x: fx.Node, size: int, dim: int, pieces: int) -> list[fx.Node]:
        import operator

        s = self.call(aten.split.Tensor, x, size, dim)
        return [self.call(operator.getitem, s, j) for j in range(pieces)]

    def wait(self, x: fx.Node) -> fx.Node:
        return self.call(c10d.wait_tensor.default, x)


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, moving as little as possible.

    Among the nodes whose inputs are ready, the one that came first in the current order goes
    first; so a graph that is already valid keeps its order exactly.
    """
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(index[n], n.name) for n in nodes if pending[n] == 0]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        node = by_name[name]
        order.append(node)
        for user in node.users:
            pending[user] -= 1
            if pending[user] == 0:
                heapq.heappush(ready, (index[user], user.name))
    if len(order) != len(nodes):
        raise RuntimeError("compass_fx: graph has a cycle after rewrite (this is a bug)")
    if order == nodes:
        return
    prev = order[0]
    for node in order[1:]:
        prev.append(node)
        prev = node


def finish_rewrite(gm: fx.GraphModule, created: Iterable[fx.Node], retired: Iterable[fx.Node]) -> None:
    """Close a rewrite: mark its nodes, re-sort, and remove what it replaced.

    Operands defined after the insertion point (weights permuted late) force a stable re-sort.
    Then the replaced matmuls, views and the original collective are dead; collectives are not
    side-effectful in FX, so dead-code elimination removes them and the old communication never
    runs, except ``wait_tensor``, which FX keeps (impure): ``retired`` nodes are dropped by hand.
    """
    for node in created:
        node.meta[PART_MARK] = True
    stable_toposort(gm.graph)
    gm.graph.eliminate_dead_code()
    for node in retired:
        if not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
