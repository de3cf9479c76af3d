"""Find every matmul<->collective pair in an AOTAutograd graph.

A match is accepted only when every node between the collective and the matmul is understood
(views that flatten the logical tensor, the split/cat pair that expresses a non-zero gather or
scatter dim); anything else becomes a ``Skip`` with its reason, and the graph is left alone there.
"""
from __future__ import annotations

import logging
import math
import operator

import torch
import torch.fx as fx

from ..lowering.graph_edit import PART_MARK, shape_of
from .pairs import ContractionConsumer, Pair, RowConsumer, RowLayout, Skip, mm_operands

log = logging.getLogger("compass_fx")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
MM_OPS = (aten.mm.default, aten.addmm.default)
LINEAR_REDUCE_OPS = ("sum", "avg")


class NoMatch(Exception):
    """Raised inside a matcher with the reason a collective is left as it is."""


def find_pairs(gm: fx.GraphModule, graph_kind: str, group: str | None = None) -> tuple[list[Pair], list[Skip]]:
    """All pairs in ``gm`` (in graph order) and the collectives that were not paired, with reasons."""
    pairs: list[Pair] = []
    skips: list[Skip] = []
    matchers = {
        c10d.all_gather_into_tensor.default: ("all_gather_matmul", _match_all_gather),
        c10d.reduce_scatter_tensor.default: ("matmul_reduce_scatter", _match_reduce_scatter),
        c10d.all_reduce.default: ("matmul_all_reduce", _match_all_reduce),
    }
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in matchers or node.meta.get(PART_MARK):
            continue  # part collectives made by an earlier rewrite are never matched again
        kind, matcher = matchers[node.target]
        try:
            group_name = str(node.args[-1])
            if group is not None and group_name != group:
                raise NoMatch(f"group {group_name!r} is not the optimised group {group!r}")
            pair = matcher(node, graph_kind)
        except NoMatch as e:
            skips.append(Skip(graph_kind, node.name, kind, str(e)))
            log.info("compass_fx: %s graph: %s %s left untouched: %s", graph_kind, kind, node.name, e)
            continue
        pairs.append(pair)
    return pairs, skips


def _single_wait(coll: fx.Node) -> fx.Node:
    users = list(coll.users)
    if len(users) != 1 or users[0].target is not c10d.wait_tensor.default:
        raise NoMatch("collective result is not consumed by exactly one wait_tensor")
    return users[0]


def _static_shape(node: fx.Node, what: str) -> tuple[int, ...]:
    shape = shape_of(node)
    if shape is None:
        raise NoMatch(f"{what} has no static shape (symbolic or missing metadata)")
    return shape


def _dtype(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


# --------------------------------------------------------------------------- all_gather -> matmul

def _gathered_logical(wait: fx.Node, world: int, shard_shape: tuple[int, ...]) -> tuple[fx.Node, int]:
    """The gathered tensor in its logical shape and the gather dim.

    A gather on dim g > 0 appears as ``split(wait, shard_rows, 0) -> getitem x world -> cat(dim g)``.
    """
    users = list(wait.users)
    if len(users) == 1 and users[0].target is aten.split.Tensor:
        split = users[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        getitems = sorted(split.users, key=lambda n: n.args[1] if n.target is operator.getitem else -1)
        if (dim == 0 and split.args[1] == shard_shape[0] and len(getitems) == world
                and all(g.target is operator.getitem and g.args[1] == i for i, g in enumerate(getitems))):
            cats = {u for g in getitems for u in g.users}
            if len(cats) == 1 and all(len(g.users) == 1 for g in getitems):
                cat = cats.pop()
                if (cat.target is aten.cat.default and list(cat.args[0]) == getitems):
                    cat_dim = cat.args[1] if len(cat.args) > 1 else 0
                    ndim = len(shard_shape)
                    cat_dim = cat_dim % ndim
                    if cat_dim == 0:
                        raise NoMatch("split/cat around the gather does not change the gather dim")
                    return cat, cat_dim
        raise NoMatch("gathered tensor is split in a way that is not a gather-dim change")
    return wait, 0


def _flat_views(logical: fx.Node, shape: tuple[int, ...]) -> tuple[list[fx.Node], int]:
    """2-D views of ``logical`` that flatten its leading dims, and the count of other users.

    Views that keep the logical shape are followed through.
    """
    flat = (math.prod(shape[:-1]), shape[-1])
    views: list[fx.Node] = []
    others = 0
    frontier = [logical]
    if len(shape) == 2:
        views.append(logical)
    seen = set()
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target in VIEW_OPS:
                ushape = shape_of(user)
                if ushape == flat and user not in views:
                    views.append(user)
                    continue
                if ushape == shape:
                    frontier.append(user)
                    continue
            if node is logical and len(shape) == 2:
                continue  # classified below as a user of the 2-D view itself
            others += 1
    return views, others


def _classify_view_users(view: fx.Node, views: list[fx.Node]) -> tuple[list[RowConsumer], list[ContractionConsumer], int]:
    rows: list[RowConsumer] = []
    contractions: list[ContractionConsumer] = []
    others = 0
    for user in view.users:
        if user in views:
            continue  # a flattening view of a flattening view: classified on its own
        if user.target is aten.mm.default and user.args[0] is view and user.args[1] is not view:
            rows.append(RowConsumer(user, view))
        elif user.target is aten.addmm.default and user.args[1] is view and user.args[2] is not view \
                and _row_broadcast_bias(user.args[0]):
            rows.append(RowConsumer(user, view))
        elif user.target is aten.permute.default and list(user.args[1]) == [1, 0] and user.users and all(
                mm.target is aten.mm.default and mm.args[0] is user and mm.args[1] is not view
                for mm in user.users):
            for mm in user.users:
                contractions.append(ContractionConsumer(mm, view, mm.args[1], gathered_on_left=True))
        elif (user.target is aten.mm.default and user.args[1] is view
              and isinstance(user.args[0], fx.Node) and user.args[0].target is aten.permute.default
              and list(user.args[0].args[1]) == [1, 0] and user.args[0].args[0] is not view):
            contractions.append(ContractionConsumer(user, view, user.args[0].args[0], gathered_on_left=False))
        else:
            others += 1
    return rows, contractions, others


def _row_broadcast_bias(bias: object) -> bool:
    shape = shape_of(bias) if isinstance(bias, fx.Node) else None
    return shape is not None and (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1))


def _match_all_gather(ag: fx.Node, graph_kind: str) -> Pair:
    shard, world = ag.args[0], int(ag.args[1])
    wait = _single_wait(ag)
    shard_shape = _static_shape(shard, "gather input")
    logical, dim = _gathered_logical(wait, world, shard_shape)
    shape = _static_shape(logical, "gathered tensor")
    if len(shape) < 2:
        raise NoMatch("gathered tensor is 1-D")
    if dim == len(shape) - 1:
        raise NoMatch("gather on the last dim (the matmul's inner dim) is not a row gather")
    views, others = _flat_views(logical, shape)
    rows: list[RowConsumer] = []
    contractions: list[ContractionConsumer] = []
    for view in views:
        r, c, o = _classify_view_users(view, views)
        rows += r
        contractions += c
        others += o
    for c in contractions:
        other_shape = shape_of(c.other)
        if other_shape is None or len(other_shape) != 2 or other_shape[0] != math.prod(shape[:-1]):
            raise NoMatch(f"weight-gradient operand {c.other.name} does not have the gathered rows")
    if not rows and not contractions:
        raise NoMatch("gathered tensor feeds no matmul as its row operand")
    return Pair("all_gather_matmul", graph_kind, ag, wait, RowLayout(shape, dim, world),
                str(ag.args[2]), world, _dtype(logical), shard=shard, logical=logical,
                row_consumers=rows, contraction_consumers=contractions, other_users=others)


# ------------------------------------------------------------------------ matmul -> collectives

def _terms(node: fx.Node, shape: tuple[int, ...], root: bool = False) -> list[fx.Node]:
    """The mm/addmm nodes whose sum is ``node`` (in the 2-D or the logical shape).

    Each node on the way must be used only by the sum; views may flatten or unflatten the rows
    (``add(view(mm_a), view(mm_b))`` is how DTensor sums two input gradients).
    """
    flat = (math.prod(shape[:-1]), shape[-1])
    if not root and len(node.users) != 1:
        raise NoMatch(f"matmul result {node.name} is used elsewhere too")
    if node.target in VIEW_OPS:
        src = node.args[0]
        if not isinstance(src, fx.Node) or shape_of(src) not in (flat, shape):
            raise NoMatch(f"view {node.name} before the collective is not a flattening of the rows")
        return _terms(src, shape)
    if node.target is aten.mm.default or node.target is aten.addmm.default:
        if shape_of(node) != flat:
            raise NoMatch(f"{node.name} does not produce the reduced rows")
        if node.target is aten.addmm.default:
            if not _row_broadcast_bias(node.args[0]):
                raise NoMatch(f"{node.name} adds a bias that is not a row broadcast")
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                raise NoMatch(f"{node.name} scales its terms (alpha/beta)")
        a = mm_operands(node)[0]
        if shape_of(a) is None or len(shape_of(a)) != 2:
            raise NoMatch(f"{node.name}'s row operand has no static 2-D shape")
        return [node]
    if node.target is aten.add.Tensor and "alpha" not in node.kwargs and len(node.args) == 2 \
            and all(isinstance(a, fx.Node) and shape_of(a) == shape_of(node) for a in node.args):
        return _terms(node.args[0], shape) + _terms(node.args[1], shape)
    raise NoMatch(f"the reduced tensor is produced by {node.target}, not by a matmul or a sum of matmuls")


def _scatter_logical(inp: fx.Node, world: int) -> tuple[fx.Node, int]:
    """The reduce-scatter input in its logical shape and the scatter dim.

    A scatter on dim g > 0 appears as ``split(x, local, g) -> getitem x world -> cat(dim 0)``.
    """
    if inp.target is aten.cat.default and (len(inp.args) < 2 or inp.args[1] == 0):
        pieces = list(inp.args[0])
        split = pieces[0].args[0] if pieces and pieces[0].target is operator.getitem else None
        if (split is not None and split.target is aten.split.Tensor and len(pieces) == world
                and all(p.target is operator.getitem and p.args[0] is split and p.args[1] == i
                        and len(p.users) == 1 for i, p in enumerate(pieces))
                and len(split.users) == world):
            logical = split.args[0]
            shape = _static_shape(logical, "reduce-scatter input")
            dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % len(shape)
            if dim == 0 or split.args[1] * world != shape[dim]:
                raise NoMatch("split/cat before the reduce-scatter is not a scatter-dim change")
            if len(logical.users) != 1:
                raise NoMatch("reduce-scatter input is used elsewhere too")
            return logical, dim
        if split is not None and split.target is aten.split.Tensor:
            raise NoMatch("split/cat before the reduce-scatter is not a scatter-dim change")
    return inp, 0


def _match_reduce_scatter(rs: fx.Node, graph_kind: str) -> Pair:
    inp, op, world = rs.args[0], rs.args[1], int(rs.args[2])
    if op not in LINEAR_REDUCE_OPS:
        raise NoMatch(f"reduce op {op!r} does not distribute over row blocks")
    wait = _single_wait(rs)
    logical, dim = _scatter_logical(inp, world)
    shape = _static_shape(logical, "reduce-scatter input")
    if len(shape) < 2 or dim == len(shape) - 1:
        raise NoMatch("scatter on the last dim (the matmul's columns) is not a row scatter")
    if shape[dim] % world:
        raise NoMatch("scatter dim does not divide by the group size")
    if dim == 0 and len(inp.users) != 1:
        raise NoMatch("reduce-scatter input is used elsewhere too")
    terms = _terms(logical, shape, root=True)
    return Pair("matmul_reduce_scatter", graph_kind, rs, wait, RowLayout(shape, dim, world),
                str(rs.args[3]), world, _dtype(logical), reduce_op=op, terms=terms, reduced=logical)


def _match_all_reduce(ar: fx.Node, graph_kind: str) -> Pair:
    inp, op = ar.args[0], ar.args[1]
    if op not in LINEAR_REDUCE_OPS:
        raise NoMatch(f"reduce op {op!r} does not distribute over row blocks")
    wait = _single_wait(ar)
    shape = _static_shape(inp, "all_reduce input")
    if len(shape) < 2:
        raise NoMatch("all_reduce of a 1-D tensor")
    if len(inp.users) != 1:
        raise NoMatch("all_reduce input is used elsewhere too")
    terms = _terms(inp, shape, root=True)
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        world = _resolve_process_group(str(ar.args[2])).size()
    except Exception as e:  # noqa: BLE001 - an unknown group is a reason to leave the pair alone
        raise NoMatch(f"cannot resolve process group {ar.args[2]!r}: {e}") from None
    return Pair("matmul_all_reduce", graph_kind, ar, wait, RowLayout(shape, 0, world),
                str(ar.args[2]), world, _dtype(inp), reduce_op=op, terms=terms, reduced=inp)
