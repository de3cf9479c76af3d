"""Find every matmul<->collective pair in an AOTAutograd graph.

A match is accepted only when every node between the collective and the matmul is understood
(views that flatten the logical tensor, the split/cat pair that expresses a non-zero gather or
scatter dim); anything else becomes a ``SkipRecord`` with its reason, and the graph is left alone there.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph.nodes import PART_MARK, is_reshape as _is_reshape, shape_of, slice_args
from ..graph.pairs import (
    ALL_GATHER_MATMUL,
    MATMUL_ALL_REDUCE,
    MATMUL_REDUCE_SCATTER,
    BatchedWeight,
    ContractionConsumer,
    GatherPair,
    Pair,
    ReducePair,
    RowConsumer,
    RowLayout,
    mm_operands,
)
from ..groups import find_group
from ..report import SkipRecord
from ..graph.row_local import RowRegion, row_region

log = logging.getLogger("compass_fx")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

prims = torch.ops.prims

MM_OPS = (aten.mm.default, aten.addmm.default, aten._scaled_mm.default)


def _scaled_mm_reason(node: fx.Node, row_scales_ok: bool = False) -> str | None:
    """Why a float8 ``_scaled_mm`` cannot have its rows split, or None: it can when A has one
    scale (tensorwise), or one per row where A is local (``row_scales_ok``: a reduce-scatter's
    or all-reduce's producer), and there is no bias and no output scale.  (The gather side checks
    its consumers with ``_scaled_row_consumer``: their row scales come from the gathered rows.)"""
    scale_a = node.args[2] if len(node.args) > 2 else node.kwargs.get("scale_a")
    shape = shape_of(scale_a) if isinstance(scale_a, fx.Node) else None
    rows = shape_of(node.args[0])
    row_scales = (row_scales_ok and shape is not None and rows is not None and len(shape) == 2
                  and shape == (rows[0], 1))  # local rows (a reduced sum): they split with A's rows
    if shape is None or (math.prod(shape) != 1 and not row_scales):
        return f"{node.name} is a float8 _scaled_mm with row-wise or block-wise scales of A (not split yet)"
    extra = list(node.args[4:6]) + [node.kwargs.get("bias"), node.kwargs.get("scale_result")]
    if any(isinstance(x, fx.Node) for x in extra):
        return f"{node.name} is a float8 _scaled_mm with a bias or an output scale (not split yet)"
    return None
LINEAR_REDUCE_OPS = ("sum", "avg")


class NoMatch(Exception):
    """Raised inside a matcher with the reason a collective is left as it is."""


def find_pairs(gm: fx.GraphModule, graph_kind: str, group: str | None = None) -> tuple[list[Pair], list[SkipRecord]]:
    """All pairs in ``gm`` (in graph order) and the collectives that were not paired, with reasons."""
    pairs: list[Pair] = []
    skips: list[SkipRecord] = []
    matchers = {
        c10d.all_gather_into_tensor.default: (ALL_GATHER_MATMUL, _match_all_gather),
        c10d.reduce_scatter_tensor.default: (MATMUL_REDUCE_SCATTER, _match_reduce_scatter),
        c10d.all_reduce.default: (MATMUL_ALL_REDUCE, _match_all_reduce),
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
            skips.append(SkipRecord(graph_kind, node.name, kind, str(e)))
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
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor):
            raise NoMatch(f"{what} has symbolic sizes (dynamic shapes): no part count is known to "
                          "divide them, so the pair is left as traced")
        raise NoMatch(f"{what} has no shape metadata")
    return shape


def _dtype(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


# --------------------------------------------------------------------------- all_gather -> matmul

def _gathered_logical(wait: fx.Node, world: int, shard_shape: tuple[int, ...]) -> tuple[fx.Node, int]:
    """The gathered tensor in its logical shape and the gather dim.

    A gather on dim g > 0 appears as ``split(wait, shard_rows, 0) -> getitem x world -> cat(dim g)``
    (DTensor's forward) or as ``slice(wait, 0, i*rows, (i+1)*rows) x world -> cat(dim g)`` (backward).
    """
    users = list(wait.users)
    if len(users) == 1 and users[0].target is aten.split.Tensor:
        split = users[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        getitems = sorted(split.users, key=lambda n: n.args[1] if n.target is operator.getitem else -1)
        if (dim == 0 and split.args[1] == shard_shape[0] and len(getitems) == world
                and all(g.target is operator.getitem and g.args[1] == i for i, g in enumerate(getitems))):
            return _cat_of_pieces(getitems, len(shard_shape))
        raise NoMatch("gathered tensor is split in a way that is not a gather-dim change")
    if users and all(u.target is aten.slice.Tensor for u in users):
        return _cat_of_pieces(_ordered_slices(users, world, shard_shape[0]), len(shard_shape))
    return wait, 0


def _ordered_slices(slices: list[fx.Node], world: int, rows: int) -> list[fx.Node]:
    """The slices ``[i*rows, (i+1)*rows)`` of dim 0 for i < world, in order, or NoMatch."""
    by_start = {}
    for s in slices:
        _, dim, start, end, step = slice_args(s)
        if dim != 0 or step != 1 or s.kwargs or not isinstance(start, int) or end != start + rows:
            raise NoMatch("gathered tensor is sliced in a way that is not a gather-dim change")
        by_start[start] = s
    if sorted(by_start) != [i * rows for i in range(world)] or len(slices) != world:
        raise NoMatch("gathered tensor is sliced in a way that is not a gather-dim change")
    return [by_start[i * rows] for i in range(world)]


def _cat_of_pieces(pieces: list[fx.Node], ndim: int) -> tuple[fx.Node, int]:
    """The one ``cat(pieces, g)`` with g > 0 that all rank pieces feed, and g."""
    cats = {u for p in pieces for u in p.users}
    if len(cats) == 1 and all(len(p.users) == 1 for p in pieces):
        cat = cats.pop()
        if cat.target is aten.cat.default and list(cat.args[0]) == pieces:
            cat_dim = (cat.args[1] if len(cat.args) > 1 else 0) % ndim
            if cat_dim == 0:
                raise NoMatch("split/cat around the gather does not change the gather dim")
            return cat, cat_dim
    raise NoMatch("gathered tensor is split in a way that is not a gather-dim change")


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of an elementwise dtype conversion node (None if ``node`` is not one)."""
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        return node.kwargs.get("dtype")
    return None


def _row_views(logical: fx.Node, shape: tuple[int, ...]) -> tuple[list[tuple[fx.Node, tuple]], int]:
    """Nodes that hold the gathered rows, with the dtype casts on the way, and the count of uses
    that need the whole gathered tensor.

    From the logical tensor the walk follows reshapes (any chain: the element order is kept) and
    dtype conversions; a node reached that way whose last dim is the logical last dim holds the
    same rows.  Users that are neither followed nor classified later need the whole tensor.
    """
    found: list[tuple[fx.Node, tuple]] = []
    whole_uses = 0
    frontier: list[tuple[fx.Node, tuple]] = [(logical, ())]
    seen: set[fx.Node] = {logical}
    while frontier:
        node, casts = frontier.pop(0)
        nshape = shape_of(node)
        rows_here = nshape is not None and len(nshape) in (2, 3) and nshape[-1] == shape[-1]
        if rows_here:
            found.append((node, casts))
        for user in node.users:
            if user in seen:
                continue
            dtype = _cast_dtype(user)
            if dtype is not None or _is_reshape(user):
                seen.add(user)
                frontier.append((user, casts + ((dtype,) if dtype is not None else ())))
            elif not rows_here:
                whole_uses += 1
    return found, whole_uses


def _batched_weight(node: object) -> BatchedWeight | None:
    """The 2-D matrix that a bmm's right operand broadcasts over its batch, if it is one."""
    if not isinstance(node, fx.Node):
        return None
    shape = shape_of(node)
    if shape is None or len(shape) != 3:
        return None
    transpose = False
    if node.target is aten.permute.default and list(node.args[1]) == [0, 2, 1]:
        transpose, node = True, node.args[0]
    if node.target is aten.expand.default:
        src = node.args[0]
        sshape = shape_of(src)
        if sshape is not None and (sshape == tuple(shape_of(node)[1:]) or sshape == (1,) + tuple(shape_of(node)[1:])):
            return BatchedWeight(src, transpose)
        return None
    if shape_of(node)[0] == 1:
        return BatchedWeight(node, transpose)
    return None


def _classify_view_users(view: fx.Node, views: set[fx.Node], casts: tuple, region: RowRegion | None = None,
                         ) -> tuple[list[RowConsumer], list[ContractionConsumer], int]:
    rows: list[RowConsumer] = []
    contractions: list[ContractionConsumer] = []
    whole_uses = 0
    two_d = len(shape_of(view)) == 2
    for user in view.users:
        if user in views or _cast_dtype(user) is not None or _is_reshape(user):
            continue  # followed by the walk in _row_views
        if two_d and user.target is aten.mm.default and user.args[0] is view and user.args[1] is not view:
            rows.append(RowConsumer(user, view, casts))
        elif user.target is aten._scaled_mm.default and user.args[0] is view and region is not None \
                and view in region.nodes:
            continue  # float8: found with its scales by _scaled_row_consumers
        elif two_d and user.target is aten.addmm.default and user.args[1] is view and user.args[2] is not view \
                and _row_broadcast_bias(user.args[0]) and _unscaled(user):
            rows.append(RowConsumer(user, view, casts))
        elif (not two_d and user.target is aten.bmm.default and user.args[0] is view
              and user.args[1] is not view and _batched_weight(user.args[1]) is not None):
            rows.append(RowConsumer(user, view, casts, _batched_weight(user.args[1])))
        elif two_d and user.target is aten.permute.default and list(user.args[1]) == [1, 0] and user.users and all(
                mm.target is aten.mm.default and mm.args[0] is user and mm.args[1] is not view
                for mm in user.users):
            for mm in user.users:
                contractions.append(ContractionConsumer(mm, view, mm.args[1], gathered_on_left=True, casts=casts))
        elif two_d and region is not None and view in region.nodes and _scaled_contractions(user, region):
            continue  # float8 weight gradient: found by _scaled_contraction_consumers
        elif (two_d and user.target is aten.mm.default and user.args[1] is view
              and isinstance(user.args[0], fx.Node) and user.args[0].target is aten.permute.default
              and list(user.args[0].args[1]) == [1, 0] and user.args[0].args[0] is not view):
            contractions.append(ContractionConsumer(user, view, user.args[0].args[0], gathered_on_left=False,
                                                    casts=casts))
        else:
            whole_uses += 1
    return rows, contractions, whole_uses


def _row_bias_of(bias: fx.Node, cols: int) -> bool:
    """A tensor that broadcasts one value per column over every row: shape [..1, cols]."""
    shape = shape_of(bias)
    return shape is not None and len(shape) >= 1 and shape[-1] == cols and all(d == 1 for d in shape[:-1])


def _unscaled(mm: fx.Node) -> bool:
    return mm.kwargs.get("beta", 1) == 1 and mm.kwargs.get("alpha", 1) == 1


def _row_broadcast_bias(bias: object) -> bool:
    shape = shape_of(bias) if isinstance(bias, fx.Node) else None
    return shape is not None and (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1))


def _merged_slab(shape: tuple[int, ...], dim: int) -> tuple[tuple[int, ...], int]:
    """The layout with each rank's slab as one run of rows, where it is one.

    With nothing but size-1 dims before ``dim`` (batch 1), a rank's part of the gathered tensor
    is a contiguous block of rows of the 2-D matmul operand, e.g. ``[1, S, D]`` gathered on S, or
    ``[W, S/W, D]`` on dim 0: then the rows themselves are the dim to split, and a part can be any
    divisor of the rank's rows instead of a divisor of a size-1 dim."""
    if math.prod(shape[:dim]) != 1 or dim >= len(shape) - 2:
        return shape, dim
    return (math.prod(shape[dim:-1]), shape[-1]), 0


def _match_all_gather(ag: fx.Node, graph_kind: str) -> GatherPair:
    shard, world = ag.args[0], int(ag.args[1])
    wait = _single_wait(ag)
    shard_shape = _static_shape(shard, "gather input")
    logical, dim = _gathered_logical(wait, world, shard_shape)
    shape = _static_shape(logical, "gathered tensor")
    if len(shape) < 2:
        raise NoMatch("gathered tensor is 1-D")
    if dim == len(shape) - 1:
        raise NoMatch("gather on the last dim (the matmul's inner dim) is not a row gather")
    found, whole_uses = _row_views(logical, shape)
    views = {v for v, _ in found}
    region = row_region(logical, math.prod(shape[:-1]))
    rows: list[RowConsumer] = []
    contractions: list[ContractionConsumer] = []
    for view, casts in found:
        r, c, o = _classify_view_users(view, views, casts, region)
        rows += r
        contractions += c
        whole_uses += o
    scaled_rows, scaled_contractions = _scaled_row_consumers(region), _scaled_contraction_consumers(region)
    if scaled_rows or scaled_contractions:
        rows += scaled_rows
        contractions += scaled_contractions
        whole_uses = _outside_uses(region, rows, contractions)
    for c in contractions:
        other_shape = shape_of(c.other)
        if other_shape is None or len(other_shape) != 2 or other_shape[0] != math.prod(shape[:-1]):
            raise NoMatch(f"weight-gradient operand {c.other.name} does not have the gathered rows")
    if not rows and not contractions:
        raise NoMatch(_no_consumer_reason(region))
    return GatherPair(graph_name=graph_kind, collective=ag, wait=wait,
                      layout=RowLayout(*_merged_slab(shape, dim), world), group_name=str(ag.args[2]),
                      group_size=world, dtype=_dtype(logical), shard=shard, logical=logical,
                      row_consumers=rows, contraction_consumers=contractions, whole_tensor_uses=whole_uses)


def _scaled_mm_args(mm: fx.Node) -> tuple[object, object, object, object]:
    """A, B, scale_a, scale_b of a ``_scaled_mm`` (positional or keyword)."""
    names = ("self", "mat2", "scale_a", "scale_b")
    return tuple(mm.args[i] if len(mm.args) > i else mm.kwargs.get(n) for i, n in enumerate(names))


def _scaled_row_consumers(region: RowRegion) -> list[RowConsumer]:
    """Every float8 ``_scaled_mm`` whose A is computed row by row from the gathered rows."""
    return [_scaled_row_consumer(n, region) for n in region.logical.graph.nodes
            if n.target is aten._scaled_mm.default and n in region.downstream and n.args[0] in region.nodes]


def _scaled_row_consumer(mm: fx.Node, region: RowRegion) -> RowConsumer:
    """``mm`` as a row consumer whose parts replay the region's quantization, or NoMatch with why.

    Its scales of A must be one scale (from before the gather) or one per gathered row, computed
    row by row from the rows (a row-wise amax) or independently of them; B and its scales must not
    depend on the gathered rows."""
    a, b, scale_a, scale_b = _scaled_mm_args(mm)
    if shape_of(a) is None or len(shape_of(a)) != 2 or shape_of(a)[0] != region.rows:
        raise NoMatch(f"{mm.name} is a float8 _scaled_mm whose A is not the gathered rows as one 2-D matrix")
    if not (region.independent(b) and region.independent(scale_b)):
        raise NoMatch(f"{mm.name} is a float8 _scaled_mm whose B or scale of B is computed from the gathered rows")
    extra = list(mm.args[4:6]) + [mm.kwargs.get("bias"), mm.kwargs.get("scale_result")]
    if any(isinstance(x, fx.Node) for x in extra):
        raise NoMatch(f"{mm.name} is a float8 _scaled_mm with a bias or an output scale (not split yet)")
    shape = shape_of(scale_a) if isinstance(scale_a, fx.Node) else None
    one_scale = shape is not None and math.prod(shape) == 1 and region.independent(scale_a)
    row_scales = shape == (region.rows, 1) and (scale_a in region.nodes or region.independent(scale_a))
    if not (one_scale or row_scales):
        raise NoMatch(f"{mm.name} is a float8 _scaled_mm whose scales of A (shape {shape}) are neither one "
                      "scale from before the gather nor one per gathered row computed row by row "
                      "(block-wise scales, or a scale from all the gathered rows): left alone")
    return RowConsumer(mm, a, region=region.ancestors_in_region(a, scale_a))


def _scaled_contractions(permute: fx.Node, region: RowRegion) -> list[fx.Node]:
    """The float8 weight-gradient GEMMs ``_scaled_mm(clone(t(V)), B)`` fed by ``permute`` = t(V),
    if every use of ``permute`` is one (else none): the gathered rows are their contraction dim.
    Each has one scale per operand and B (column-major, with V's rows) computed without the
    gathered rows.  A B computed from them (the gradient of a forward recomputed in the backward,
    activation checkpointing) would wait for every part anyway: that GEMM takes the whole tensor."""
    if not _is_transpose(permute) or not permute.users:
        return []
    found = []
    for clone in permute.users:
        if clone.target is not aten.clone.default or not clone.users:
            return []
        for mm in clone.users:
            if mm.target is not aten._scaled_mm.default or mm.args[0] is not clone \
                    or not _tensorwise_contraction(mm, region):
                return []
            found.append(mm)
    return found


def _scaled_contraction_consumers(region: RowRegion) -> list[ContractionConsumer]:
    """Every float8 weight-gradient GEMM over the gathered rows, from any row-local node of them."""
    found = []
    for node in region.logical.graph.nodes:
        shape = shape_of(node) if node in region.nodes else None
        if shape is None or len(shape) != 2 or shape[0] != region.rows:
            continue
        for user in node.users:
            found += [ContractionConsumer(mm, node, mm.args[1], gathered_on_left=True,
                                          region=region.ancestors_in_region(node))
                      for mm in _scaled_contractions(user, region)]
    return found


def _is_transpose(node: object) -> bool:
    return isinstance(node, fx.Node) and node.target is aten.permute.default and list(node.args[1]) == [1, 0]


def _tensorwise_contraction(mm: fx.Node, region: RowRegion) -> bool:
    """One scale each, and neither the scales nor B computed from the gathered rows."""
    _, b, scale_a, scale_b = _scaled_mm_args(mm)
    scales_ok = all(isinstance(x, fx.Node) and shape_of(x) is not None and math.prod(shape_of(x)) == 1
                    and region.independent(x) for x in (scale_a, scale_b))
    return scales_ok and region.independent(b) and _scaled_mm_reason(mm) is None


def _outside_uses(region: RowRegion, rows: list[RowConsumer], contractions: list[ContractionConsumer]) -> int:
    """Uses of the gathered rows' region by nodes that are neither in it nor a found matmul (nor the
    transposes and copies on a weight-gradient matmul's way): they need the whole gathered tensor."""
    handled = {rc.mm for rc in rows}
    for cc in contractions:  # mm, and t / clone / t between it and the gathered rows
        handled.add(cc.mm)
        stack = list(cc.mm.all_input_nodes)
        while stack:
            node = stack.pop()
            if node not in handled and (node.target is aten.clone.default or _is_transpose(node)):
                handled.add(node)
                stack.extend(node.all_input_nodes)
    return sum(1 for n in region.nodes for u in n.users if u not in region.nodes and u not in handled)


def _reaches_without_matmul(node: fx.Node, region: RowRegion) -> bool:
    """Whether ``node`` is computed from the gathered rows through no matmul (a later layer's
    float8 GEMM is no reason to name)."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n is region.logical:
            return True
        if n in seen or n not in region.downstream or n.target in MM_OPS or n.target is aten.bmm.default:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _no_consumer_reason(region: RowRegion) -> str:
    """Why no matmul takes the gathered rows: say so precisely when a float8 matmul does, but only
    after a step that mixes rows (a tensorwise scale computed from the whole gathered tensor)."""
    for node in region.logical.graph.nodes:
        if node.target is aten._scaled_mm.default and node in region.downstream \
                and _reaches_without_matmul(node.args[0], region):
            return (f"the float8 _scaled_mm {node.name} takes the gathered rows only after a step that is not "
                    "computed row by row (it mixes rows, e.g. a tensorwise scale computed from the whole "
                    "gathered tensor, or draws random numbers): no part can be cast to float8 on its own")
    return "gathered tensor feeds no matmul as its row operand"


# ------------------------------------------------------------------------ matmul -> collectives

@dataclass
class _Sum:
    """The matmul terms whose (cast) sum is reduced, and the details the lowering needs."""

    terms: list[fx.Node] = field(default_factory=list)
    batched_weights: dict[fx.Node, BatchedWeight] = field(default_factory=dict)
    shared_partial_sums: list[fx.Node] = field(default_factory=list)
    casts: tuple[torch.dtype, ...] = ()
    factors: dict[fx.Node, fx.Node] = field(default_factory=dict)  # mul node -> its row factor


def _reduced_sum(root: fx.Node, shape: tuple[int, ...], collective_side: fx.Node) -> _Sum:
    """Walk down from the reduced tensor ``root`` to the matmuls whose sum it is.

    Dtype conversions and reshapes (they keep the row order) may sit anywhere, adds of
    same-shaped tensors, or of a term and a column bias.  A node on the way that has users outside the walk is
    a shared partial sum: the lowering rebuilds it for those users from the per-part pieces.
    """
    found = _Sum()
    casts: list[torch.dtype] = []

    def walk(node: fx.Node, parent: fx.Node) -> None:
        if not isinstance(node, fx.Node) or shape_of(node) is None:
            raise NoMatch("the reduced tensor has no static shape")
        if any(u is not parent for u in node.users) and node not in found.shared_partial_sums:
            found.shared_partial_sums.append(node)
        dtype = _cast_dtype(node)
        if dtype is not None:  # elementwise: each part converts its own rows the same way
            casts.append(dtype)
            return walk(node.args[0], node)
        if _is_reshape(node):
            return walk(node.args[0], node)
        if node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2 \
                and all(isinstance(a, fx.Node) and shape_of(a) is not None for a in node.args):
            full = [a for a in node.args if shape_of(a) == shape_of(node)]
            if len(full) == 2:
                walk(node.args[0], node)
                walk(node.args[1], node)
                return None
            bias = [a for a in node.args if a not in full]
            if len(full) == 1 and len(bias) == 1 and _row_bias_of(bias[0], shape[-1]):
                walk(full[0], node)  # x + bias[N]: a bias added after a bmm-form matmul
                return None
        factored = _factored_term(node)
        if factored is not None:  # float8 row-wise: the unit-scale product times the outer product of scales
            found.factors[node] = factored[1]
            walk(factored[0], node)
            return None
        found.terms.append(_term(node, shape, found))
        return None

    walk(root, collective_side)
    found.casts = tuple(reversed(casts))
    return found


def _factored_term(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``mul(x, f)`` where x leads to a matmul and f scales rows, columns or everything (its shape
    is x's, [..1, c] or [rows.., 1]): each part multiplies its rows by f's rows.  torchao's
    row-wise float8 backward computes ``_scaled_mm`` with unit scales, then multiplies by the
    outer product of the row and column scales; (term, factor), or None."""
    if node.target is not aten.mul.Tensor or node.kwargs or len(node.args) != 2:
        return None
    for x, f in (node.args, node.args[::-1]):
        if isinstance(x, fx.Node) and isinstance(f, fx.Node) and _leads_to_matmul(x) and not _leads_to_matmul(f) \
                and shape_of(x) == shape_of(node) and _row_factor_shape(shape_of(f), shape_of(x)):
            return x, f
    return None


def _leads_to_matmul(node: fx.Node) -> bool:
    while _cast_dtype(node) is not None or _is_reshape(node):
        node = node.args[0]
    return node.target in MM_OPS or node.target is aten.bmm.default


def _row_factor_shape(factor: tuple[int, ...] | None, term: tuple[int, ...] | None) -> bool:
    """f scales everything or columns ([..1, c]), or rows (the term's leading dims, last dim 1 or c)."""
    if factor is None or term is None or len(factor) > len(term):
        return False
    if factor and factor[-1] not in (1, term[-1]):
        return False
    lead = tuple(factor[:-1])
    return all(d == 1 for d in lead) or (len(factor) == len(term) and lead == tuple(term[:-1]))


def _term(node: fx.Node, shape: tuple[int, ...], found: _Sum) -> fx.Node:
    """Check that ``node`` is a matmul producing the reduced rows (row-aligned) and return it."""
    out = shape_of(node)
    if node.target in MM_OPS:
        if out != (math.prod(shape[:-1]), shape[-1]):
            raise NoMatch(f"{node.name} does not produce the reduced rows")
        if node.target is aten.addmm.default:
            if not _row_broadcast_bias(node.args[0]):
                raise NoMatch(f"{node.name} adds a bias that is not a row broadcast")
            if not _unscaled(node):
                raise NoMatch(f"{node.name} scales its terms (alpha/beta)")
        why = _scaled_mm_reason(node, row_scales_ok=True) if node.target is aten._scaled_mm.default else None
        if why:
            raise NoMatch(why)
        a = mm_operands(node)[0]
        if shape_of(a) is None or len(shape_of(a)) != 2:
            raise NoMatch(f"{node.name}'s row operand has no static 2-D shape")
        return node
    if node.target is aten.bmm.default:
        weight = _batched_weight(node.args[1])
        if weight is None:
            raise NoMatch(f"{node.name} is a bmm whose right operand is not one broadcast matrix")
        if out is None or out[-1] != shape[-1] or shape_of(node.args[0]) is None:
            raise NoMatch(f"{node.name} does not produce the reduced rows")
        found.batched_weights[node] = weight
        return node
    raise NoMatch(f"the reduced tensor is produced by {node.target}, not by a matmul or a sum of matmuls")


@dataclass
class _Scatter:
    """How the reduce-scatter's input relates to the logical tensor it scatters."""

    logical: fx.Node
    dim: int
    side: fx.Node                        # the node through which ``logical`` reaches the collective
    perm: tuple[int, ...] | None = None  # the collective sees permute(logical, perm)


def _scatter_logical(inp: fx.Node, world: int, rs: fx.Node) -> _Scatter:
    """The reduce-scatter input in its logical shape and the scatter dim.

    A scatter on dim g > 0 appears as ``split(x, local, g) -> getitem x world -> cat(dim 0)``
    (DTensor) or as ``clone(permute(x, perm))`` with ``perm`` swapping dims 0 and g (torchtitan).
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
            return _Scatter(logical, dim, split)
        if split is not None and split.target is aten.split.Tensor:
            raise NoMatch("split/cat before the reduce-scatter is not a scatter-dim change")
    permute = inp
    if inp.target is aten.clone.default and isinstance(inp.args[0], fx.Node) and len(inp.args) == 1:
        permute = inp.args[0] if len(inp.users) == 1 else inp
    if permute.target is aten.permute.default and len(permute.users) == 1:
        perm = tuple(int(p) for p in permute.args[1])
        g = perm[0] % len(perm)
        swap = list(range(len(perm)))
        swap[0], swap[g] = g, 0
        if g == 0 or list(perm) != swap:
            raise NoMatch(f"permute {perm} before the reduce-scatter is not a swap of dim 0 with another")
        return _Scatter(permute.args[0], g, permute, perm)
    return _Scatter(inp, 0, rs)


def _match_reduce_scatter(rs: fx.Node, graph_kind: str) -> ReducePair:
    inp, op, world = rs.args[0], rs.args[1], int(rs.args[2])
    if op not in LINEAR_REDUCE_OPS:
        raise NoMatch(f"reduce op {op!r} does not distribute over row blocks")
    wait = _single_wait(rs)
    scatter = _scatter_logical(inp, world, rs)
    logical, dim = scatter.logical, scatter.dim
    shape = _static_shape(logical, "reduce-scatter input")
    if len(shape) < 2 or dim == len(shape) - 1:
        raise NoMatch("scatter on the last dim (the matmul's columns) is not a row scatter")
    if shape[dim] % world:
        raise NoMatch("scatter dim does not divide by the group size")
    found = _reduced_sum(logical, shape, scatter.side)
    return ReducePair(graph_name=graph_kind, collective=rs, wait=wait, layout=RowLayout(shape, dim, world),
                      group_name=str(rs.args[3]), group_size=world, dtype=_dtype(logical), all_reduce=False,
                      reduce_op=op, terms=found.terms, reduced=logical, reduce_casts=found.casts,
                      batched_weights=found.batched_weights, shared_partial_sums=found.shared_partial_sums,
                      scatter_perm=scatter.perm, row_factors=found.factors)


def _match_all_reduce(ar: fx.Node, graph_kind: str) -> ReducePair:
    inp, op = ar.args[0], ar.args[1]
    if op not in LINEAR_REDUCE_OPS:
        raise NoMatch(f"reduce op {op!r} does not distribute over row blocks")
    wait = _single_wait(ar)
    shape = _static_shape(inp, "all_reduce input")
    if len(shape) < 2:
        raise NoMatch("all_reduce of a 1-D tensor")
    found = _reduced_sum(inp, shape, ar)
    try:
        world = find_group(str(ar.args[2])).size()
    except ValueError as e:  # an unknown group is a reason to leave the pair alone
        raise NoMatch(f"cannot resolve process group {ar.args[2]!r}: {e}") from None
    return ReducePair(graph_name=graph_kind, collective=ar, wait=wait, layout=RowLayout(shape, 0, world),
                      group_name=str(ar.args[2]), group_size=world, dtype=_dtype(inp), all_reduce=True,
                      reduce_op=op, terms=found.terms, reduced=inp, reduce_casts=found.casts,
                      batched_weights=found.batched_weights, shared_partial_sums=found.shared_partial_sums,
                      row_factors=found.factors)
