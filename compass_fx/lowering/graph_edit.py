"""Small, careful FX editing helpers shared by every rewrite.

A rewrite is built, then committed: the new nodes are inserted before an anchor (with a
``meta["val"]`` computed under the graph's own fake mode, so that the inner compiler sees the same
metadata it would get from tracing), and the uses of the nodes they replace, and any mark on an
existing node, are only recorded.  ``commit`` applies them; ``rollback`` erases the new nodes,
which nothing else uses yet.  So a rewrite that fails half-way leaves the graph as it was without
a copy of the graph, and the cost of a rewrite is that of the nodes it adds.

Operands defined after the anchor (a weight permuted late in a backward graph) leave the graph out
of order until ``stable_toposort`` runs, once per graph after every rewrite; where the pass needs
the order sooner (to match a pair again), :class:`Disorder` sorts only the stretches a rewrite left
out of order.
"""
from __future__ import annotations

import contextlib
import heapq
import operator
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_dense, get_mutable_args
from torch.fx.node import map_arg

from ..graph.nodes import PART_MARK

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class RewriteFailed(RuntimeError):
    """A rewrite could not be applied; the graph is exactly as it was before it started."""


def graph_fake_mode(graph: fx.Graph) -> Any:
    """The fake mode the graph's metadata was traced under (None without one): one walk per graph."""
    return detect_fake_mode([n.meta.get("val") for n in graph.nodes if "val" in n.meta])


class NodeBuilder:
    """Creates nodes before ``anchor`` in ``graph``, fills in their fake-tensor metadata, and
    records what the rewrite replaces, for ``commit`` (or ``rollback``)."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, fake_mode: Any = None) -> None:
        self.graph = graph
        self.anchor = anchor
        self.created: list[fx.Node] = []
        self.replacements: list[tuple[fx.Node, fx.Node]] = []
        self.marks: list[tuple[fx.Node, str, Any]] = []
        self.fake_mode = fake_mode

    def call(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.created.append(node)
        self._infer_meta(node)
        return node

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        """At commit, every use of ``old`` becomes a use of ``new``."""
        self.replacements.append((old, new))

    def mark(self, node: fx.Node, key: str, value: Any = True) -> None:
        """At commit, ``node.meta[key] = value`` (a node of the graph the rewrite must not touch yet)."""
        self.marks.append((node, key, value))

    def commit(self) -> None:
        """Apply the recorded marks and replacements; the new nodes are marked as a rewrite's own."""
        _check_no_cycle(self.created, self.replacements)
        for node, key, value in self.marks:
            node.meta[key] = value
        for old, new in self.replacements:
            old.replace_all_uses_with(new)
        for node in self.created:
            node.meta[PART_MARK] = True

    def rollback(self) -> None:
        """Erase every node this builder created (nothing outside them uses them before commit)."""
        for node in reversed(self.created):  # a new node's users are newer ones, erased before it
            self.graph.erase_node(node)
        self.created.clear()

    def _infer_meta(self, node: fx.Node) -> None:
        if self.fake_mode is None:
            return
        args = map_arg(node.args, _val)  # FX's own map: a fraction of pytree's cost, paid per new node
        kwargs = map_arg(node.kwargs, _val)
        if node.target is operator.getitem:  # a piece of a tuple or list of values: no tensor op
            node.meta["val"] = operator.getitem(*args)
        elif node.target in META_DIRECT_OPS and (val := meta_direct(self.fake_mode, node.target, args, kwargs)) \
                is not NOT_DIRECT:
            node.meta["val"] = val
        elif node.target is auto_functionalized and (val := meta_auto_functionalized(
                self.fake_mode, args[0], kwargs)) is not NOT_DIRECT:
            node.meta["val"] = val
        elif isinstance(node.target, torch._ops.OpOverload) and hasattr(self.fake_mode, "dispatch"):
            # what the fake mode's __torch_dispatch__ does with the op, without entering the mode and
            # going through the dispatcher to get there (a third of the cost of a new node's metadata)
            node.meta["val"] = self.fake_mode.dispatch(node.target, _FAKE_TYPES, args, kwargs)
        else:
            with self.fake_mode:
                if node.target is auto_functionalized:  # its fake implementation, less the higher-order op's dispatch
                    node.meta["val"] = auto_functionalized_dense(*args, _only_clone_these_tensors=None, **kwargs)
                else:
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
        s = self.call(aten.split.Tensor, x, size, dim)
        return [self.call(operator.getitem, s, j) for j in range(pieces)]

    def wait(self, x: fx.Node) -> fx.Node:
        return self.call(c10d.wait_tensor.default, x)


_FAKE_TYPES = (FakeTensor,)

# Ops whose fake result is exactly their meta kernel's result on the same device: no constructor
# (device taken from a keyword), no data-dependent output, no special case in FakeTensorMode.  The
# rewrites add thousands of these to a large graph; run directly, their metadata costs about a
# third of what the fake mode's dispatch (cache lookup and bookkeeping) costs.
META_DIRECT_OPS = frozenset({
    aten.view.default, aten.select.int, aten.slice.Tensor, aten.expand.default, aten.permute.default,
    aten.split.Tensor, aten.cat.default, aten.clone.default, aten.mm.default, aten.bmm.default,
    aten.add.Tensor, c10d.wait_tensor.default, c10d.all_gather_into_tensor.default,
    c10d.reduce_scatter_tensor.default, c10d.all_reduce.default,
})


def meta_direct(fake_mode: Any, op: Any, args: tuple, kwargs: dict) -> Any:
    """``op``'s fake result computed as FakeTensorMode computes it when its cache misses: the meta
    kernel run on the fake inputs (views keep sharing their input's storage), each tensor it returns
    wrapped as a fake tensor on the inputs' device.  ``NOT_DIRECT`` (use the fake mode) unless every
    tensor input is a fake tensor of ``fake_mode`` on one device.

    The meta kernels run with the Python dispatcher off: for these ops it would only route them to
    their Python references, which give the same sizes and strides (tests/test_meta_direct.py checks
    every node the rewrites make) at several times the cost."""
    device = _common_fake_device(fake_mode, (*args, *kwargs.values()))
    if device is None:
        return NOT_DIRECT
    shortcut = _LAYOUT_SHORTCUTS.get(op)
    with _on_meta(fake_mode):  # also keeps the fake mode, active around the pass, off new tensors
        out = shortcut(*args, **kwargs) if shortcut is not None else None
        if out is None:
            out = op(*args, **kwargs)
    if out is None or isinstance(out, torch.Tensor):
        return _wrap(fake_mode, out, device)
    if isinstance(out, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in out):
        return type(out)(_wrap(fake_mode, t, device) for t in out)
    return NOT_DIRECT


def meta_auto_functionalized(fake_mode: Any, op: Any, kwargs: dict) -> Any:
    """``auto_functionalized(op, **kwargs)``'s fake result, as its fake implementation builds it
    (the op's outputs, then a fresh copy, same sizes and strides, of each argument it mutates) but
    with the op's meta kernel run directly.  ``NOT_DIRECT`` where a mutated argument is a list or
    has symbolic sizes."""
    names, _ = get_mutable_args(op)
    copies = {}
    for name in names:
        x = kwargs.get(name)
        if not isinstance(x, FakeTensor) or x.fake_mode is not fake_mode or not _static(x):
            return NOT_DIRECT
        with _on_meta(fake_mode):
            fresh = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        copies[name] = FakeTensor(fake_mode, fresh, x.fake_device)
    out = meta_direct(fake_mode, op, (), {**kwargs, **copies})
    if out is NOT_DIRECT:
        return NOT_DIRECT
    return (*out, *copies.values()) if isinstance(out, tuple) else (out, *copies.values())


NOT_DIRECT = object()


@contextlib.contextmanager
def _on_meta(fake_mode: Any) -> Iterator[None]:
    """Run ops as the fake mode runs their kernels: fake inputs seen as meta tensors, no torch
    dispatch mode, no Python dispatcher, below autograd."""
    with torch._C._AutoDispatchBelowAutograd(), torch._C._DisablePythonDispatcher(), \
            in_kernel_invocation_manager(fake_mode):
        yield


def _cat_layout(tensors: list, dim: int = 0) -> Any:
    """``cat``'s result where it is plain (one dtype, one rank below 4, so no channels-last format:
    a new contiguous tensor); None otherwise.  Its meta kernel is Python, the costliest of the ops
    the rewrites add."""
    first = tensors[0] if tensors else None
    if first is None or first.dim() == 0 or first.dim() > 3 or not all(_static(t) for t in tensors):
        return None
    dim = dim % first.dim()
    shape = list(first.shape)
    for t in tensors[1:]:
        if t.dtype != first.dtype or t.dim() != first.dim() or any(
                a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != dim):
            return None
        shape[dim] += t.shape[dim]
    return torch.empty(shape, dtype=first.dtype, device="meta")


def _add_layout(a: Any, b: Any, *, alpha: Any = 1) -> Any:
    """``add``'s result for two contiguous tensors of one shape and dtype (a new contiguous tensor);
    None otherwise (broadcasting and type promotion are the meta kernel's)."""
    if (not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape or not _static(a)
            or not a.is_contiguous() or not b.is_contiguous()):
        return None
    return torch.empty(a.shape, dtype=a.dtype, device="meta")


_LAYOUT_SHORTCUTS = {aten.cat.default: _cat_layout, aten.add.Tensor: _add_layout}


def _common_fake_device(fake_mode: Any, values: Iterable[Any]) -> Any:
    device = None
    for a in values:
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, FakeTensor):
                if t.fake_mode is not fake_mode or (device is not None and t.fake_device != device):
                    return None
                device = t.fake_device
            elif isinstance(t, torch.Tensor):
                return None
    return device


def _wrap(fake_mode: Any, t: Any, device: Any) -> Any:
    return t if t is None or isinstance(t, FakeTensor) else FakeTensor(fake_mode, t, device)


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(d, int) for d in (*t.shape, *t.stride()))


def _val(node: fx.Node) -> Any:
    return node.meta["val"]


def _check_no_cycle(created: list[fx.Node], replacements: list[tuple[fx.Node, fx.Node]]) -> None:
    """A new node that uses a replaced node and also feeds its replacement would, once the uses
    are swapped, feed itself: refuse before anything is touched (looks at the new nodes only)."""
    made = set(created)
    for old, new in replacements:
        readers = {u for u in old.users if u in made}
        if not readers:
            continue
        stack, seen = [new], set()
        while stack:
            node = stack.pop()
            if node in readers:
                raise RewriteFailed(f"the replacement of {old.name} would feed itself through {node.name}")
            if node in seen or node not in made:
                continue
            seen.add(node)
            stack.extend(node.all_input_nodes)


def erase_unused(graph: fx.Graph, candidates: Iterable[fx.Node], retired: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """Dead-code elimination from ``candidates`` only: erase those without users (and, in turn,
    their inputs left without users), as ``graph.eliminate_dead_code`` would, plus the ``retired``
    nodes FX keeps as impure (a replaced ``wait_tensor``) once nothing uses them.  Returns the
    erased nodes; costs what it erases, not the graph."""
    retired = set(retired)
    stack = list(candidates) + list(retired)
    erased: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node._erased or node.users or node.op in ("placeholder", "output"):
            continue
        if node not in retired and node.is_impure():
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        stack.extend(inputs)
    return erased


def stable_toposort(graph: fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, moving as little as possible.

    Among the nodes whose inputs are ready, the one that came first in the current order goes
    first; so a graph that is already valid keeps its order exactly.
    """
    _sort_in_place(list(graph.nodes))


class Disorder:
    """The edges that rewrites left pointing backwards (a new node placed before an operand defined
    after its anchor, or a node now reading a replacement placed after it), so that the graph can
    be put in order again stretch by stretch.

    A stable sort of the stretch from an edge's reader to its operand, with every other backward
    edge that touches that stretch merged in, gives exactly the order ``stable_toposort`` gives the
    whole graph (a node before the stretch is ready before any in it, and one in it before any
    after it), at the cost of the stretch: the pass can keep the graph sorted after each rewrite
    without a walk of the graph each time."""

    def __init__(self) -> None:
        self._edges: list[tuple[fx.Node, fx.Node]] = []  # (reader, operand placed after it)

    def note(self, nodes: Iterable[fx.Node]) -> None:
        """Record the backward edges that touch ``nodes`` (what a commit created or wired in);
        every other edge was in order before the commit and still is."""
        for node in nodes:
            if node._erased:
                continue
            self._edges += [(node, i) for i in node.all_input_nodes if i > node]
            self._edges += [(u, node) for u in node.users if u < node]

    def __bool__(self) -> bool:
        return bool(self._edges)

    def forget(self) -> None:
        """Drop the recorded edges (the whole graph was just sorted)."""
        self._edges.clear()

    def repair(self) -> None:
        """Sort each stretch that a recorded edge spans (overlapping stretches as one), then forget
        the edges.  An edge whose end a later rewrite erased is gone with it; one that a sort of
        the whole graph already turned round needs nothing."""
        edges = sorted(((reader, operand) for reader, operand in self._edges
                        if not reader._erased and not operand._erased and operand > reader), key=lambda e: e[0])
        self.forget()
        stretches: list[list[fx.Node]] = []
        for reader, operand in edges:
            if stretches and reader <= stretches[-1][1]:
                stretches[-1][1] = max(stretches[-1][1], operand)
            else:
                stretches.append([reader, operand])
        for first, last in stretches:
            nodes, node = [first], first
            while node is not last:
                node = node.next
                nodes.append(node)
            _sort_in_place(nodes)


def _sort_in_place(nodes: list[fx.Node]) -> None:
    """Stable topological sort of ``nodes``, a stretch of consecutive nodes of one graph (or all of
    them), moved within the stretch; inputs from outside it are already in place before it."""
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: len({i for i in n.all_input_nodes if i in index}) for n in nodes}
    ready = [(index[n], n.name) for n in nodes if pending[n] == 0]
    by_name = {n.name: n for n in nodes}
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, name = heapq.heappop(ready)
        node = by_name[name]
        order.append(node)
        for user in node.users:
            if user not in index:
                continue
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
