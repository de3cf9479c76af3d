"""Rewrites that change nothing but the graph's form, run before matching: so that code a user
writes in other words than DTensor's (an explicit wait, a gather into a list) still shows its
pairs to the matchers (:mod:`..passes.find`)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .nodes import shape_of, slice_args

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_aten = torch.ops.aten


def normalize(gm: fx.GraphModule) -> dict[str, int]:
    """Apply every rewrite below to ``gm`` in place; how many nodes each one replaced."""
    return {"repeated waits": drop_repeated_waits(gm), "identity re-gathers": drop_identity_regathers(gm)}


def drop_repeated_waits(gm: fx.GraphModule) -> int:
    """Replace ``wait_tensor(wait_tensor(x))`` by the inner wait.

    Why: waiting explicitly on a functional collective's result
    (``funcol.wait_tensor(funcol.all_gather_tensor(...))``) traces to two waits in a row; the
    second waits for nothing, but it hid the gathered tensor's matmul from the matcher, which left
    the pair alone ("gathered tensor feeds no matmul")."""
    dropped = 0
    for node in list(gm.graph.nodes):
        inner = node.args[0] if _is(node, _WAIT) and node.args else None
        if isinstance(inner, fx.Node) and _is(inner, _WAIT):
            node.replace_all_uses_with(inner)
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


def drop_identity_regathers(gm: fx.GraphModule) -> int:
    """Replace ``cat([t[0:r], t[r:2r], ...], dim 0)`` (the pieces of ``t`` cut along dim 0 by one
    ``split`` or by slices, all of them, in order, used only by the cat) by ``t``.

    Why: ``dist.all_gather(list_of_tensors, x)`` followed by ``torch.cat(list)`` (how much TP code
    gathers activations) traces to a gather into one tensor, cut into the ranks' pieces and put
    back together in the same order; the matcher saw a "split/cat that does not change the gather
    dim" and left the pair alone."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if not _is(node, _aten.cat.default) or _cat_dim(node) != 0:
            continue
        pieces = list(node.args[0])
        whole = _cut_from(pieces)
        if whole is None or shape_of(whole) != shape_of(node):
            continue
        node.replace_all_uses_with(whole)
        gm.graph.erase_node(node)
        for piece in pieces:  # now unused, and the split (if any) after them
            source = piece.args[0] if piece.args else None
            if not piece.users:
                gm.graph.erase_node(piece)
            if isinstance(source, fx.Node) and source is not whole and not source.users:
                gm.graph.erase_node(source)
        dropped += 1
    return dropped


def _is(node: fx.Node, target) -> bool:
    return node.op == "call_function" and node.target is target


def _cat_dim(cat: fx.Node) -> int | None:
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    shape = shape_of(cat)
    return dim % len(shape) if shape else None


def _cut_from(pieces: list) -> fx.Node | None:
    """The tensor that ``pieces`` cut along dim 0 into consecutive, complete, in-order parts, each
    used only by one consumer, or None."""
    if not pieces or not all(isinstance(p, fx.Node) and len(p.users) == 1 for p in pieces):
        return None
    if all(p.op == "call_function" and p.target is operator.getitem for p in pieces):
        split = pieces[0].args[0]
        if not (isinstance(split, fx.Node) and _is(split, _aten.split.Tensor)):
            return None
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        whole = split.args[0]
        if dim != 0 or [p.args for p in pieces] != [(split, i) for i in range(len(pieces))]:
            return None
        if len(split.users) != len(pieces):
            return None
        return whole
    if all(_is(p, _aten.slice.Tensor) for p in pieces):
        whole, stop = pieces[0].args[0], 0
        for p in pieces:
            src, dim, start, end, step = slice_args(p)
            if src is not whole or dim != 0 or step != 1 or p.kwargs or start != stop or not isinstance(end, int):
                return None
            stop = end
        shape = shape_of(whole)
        return whole if shape and stop == shape[0] else None
    return None
