"""all_gather -> matmul: a gather whose rows feed matmuls (the column-parallel side of sequence
parallelism; its backward feeds the weight gradient too).

* Matching: from ``all_gather_into_tensor`` and its one wait to the gathered tensor in its logical
  shape (through the split/cat or the slices that express a gather on a dim > 0), then through
  reshapes and dtype casts to the matmuls that take the gathered rows as their row operand
  (``mm``, ``addmm``, ``bmm`` by one broadcast matrix, a float8 ``_scaled_mm`` after a row-local
  quantization) or as their contraction dim (the weight gradient ``mm(t(V), Y)``).  Uses that
  need the whole tensor are counted: the rewrite rebuilds it for them.
* Strategies: InterDecom (``lowering.decompose.all_gather``) for every matched pair; the fused
  operator (``lowering.fuse.all_gather``) only for the plain DTensor shape.
"""
from __future__ import annotations

import math
import operator
import torch
import torch.fx as fx

from ..cost.decision import Decision
from ..graph.nodes import is_reshape, shape_of, slice_args
from ..graph.pairs import ALL_GATHER_MATMUL, ContractionConsumer, GatherPair, RowConsumer, RowLayout
from ..graph.row_local import RowRegion, row_region
from ..lowering import decompose, fuse, parts_replay
from ..lowering.graph_edit import NodeBuilder
from .match import (
    MM_OPS,
    NoMatch,
    batched_weight,
    cast_dtype,
    dtype_of,
    is_transpose,
    row_broadcast_bias,
    scaled_mm_args,
    scaled_mm_extras,
    scaled_mm_reason,
    single_wait,
    static_shape,
    unscaled,
)
from .pair_kind import PairKind

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def match(ag: fx.Node, graph_kind: str) -> GatherPair:
    """The pair at the gather ``ag``, or ``NoMatch`` with the reason."""
    seen: set[fx.Node] = {ag}
    shard, world = ag.args[0], int(ag.args[1])
    wait = single_wait(ag)
    seen.add(wait)
    shard_shape = static_shape(shard, "gather input")
    logical, dim = _gathered_logical(wait, world, shard_shape, seen)
    shape = static_shape(logical, "gathered tensor")
    if len(shape) < 2:
        raise NoMatch("gathered tensor is 1-D")
    if dim == len(shape) - 1:
        raise NoMatch("gathers the last dim (columns), not rows: only row gathers are overlapped with a matmul")
    found, whole_uses = _row_views(logical, shape, seen)
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
    seen |= region.nodes | set(region.edge())
    seen.update(c.mm for c in rows)
    for c in contractions:
        seen.update((c.mm, c.other, *c.mm.all_input_nodes))
    return GatherPair(graph_name=graph_kind, collective=ag, wait=wait,
                      layout=RowLayout(*_merged_slab(shape, dim), world), group_name=str(ag.args[2]),
                      group_size=world, dtype=dtype_of(logical), shard=shard, logical=logical,
                      row_consumers=rows, contraction_consumers=contractions, whole_tensor_uses=whole_uses,
                      footprint=frozenset(seen))


def refusals(pair: GatherPair) -> dict[str, str]:
    """The fused all-gather-matmul takes the plain DTensor shape only: one gather straight into
    mm/addmm on the gathered rows (it has no casts, bmm form or float8 quantization inside)."""
    details = []
    consumers = [*pair.row_consumers, *pair.contraction_consumers]
    if any(c.casts for c in consumers):
        details.append("dtype casts")
    if any(c.weight is not None for c in pair.row_consumers):
        details.append("bmm form")
    if pair._has_scaled_mm() or any(c.region for c in consumers):
        details.append("float8 _scaled_mm")
    if not details:
        return {}
    return {"fuse": f"the pair has wild-graph details ({', '.join(details)}); "
                    "the fused operators are not offered for it"}


def lower(b: NodeBuilder, pair: GatherPair, decision: Decision, asynchronous: bool = False) -> bool:
    """Build ``decision``'s rewrite of ``pair``.  Never asynchronous: the gather's GEMMs need what
    arrives."""
    if decision.strategy == "decompose":
        decompose.all_gather(b, pair, decision.parts)
    else:
        fuse.all_gather(b, pair, decision.schedule or "ring")
    return False


def parts_replayed(pair: GatherPair) -> bool:
    """Whether an eager step gathers this pair's parts, once decomposed, from one CUDA graph: the
    lowering makes them one ``compass::all_gather_mm_parts`` call (on NCCL) and the parts replay is
    on (``lowering.parts_replay``).  Read on every rank; the decisions are agreed after."""
    return parts_replay.enabled() and decompose.gathers_in_one_call(pair)


KIND = PairKind(ALL_GATHER_MATMUL, c10d.all_gather_into_tensor.default, match, refusals, lower, parts_replayed)


# ------------------------------------------------------------------ the gathered tensor

def _gathered_logical(wait: fx.Node, world: int, shard_shape: tuple[int, ...], seen: set[fx.Node]
                      ) -> tuple[fx.Node, int]:
    """The gathered tensor in its logical shape and the gather dim.

    A gather on dim g > 0 appears as ``split(wait, shard_rows, 0) -> getitem x world -> cat(dim g)``
    (DTensor's forward) or as ``slice(wait, 0, i*rows, (i+1)*rows) x world -> cat(dim g)`` (backward).
    """
    users = list(wait.users)
    seen.update(users)
    if len(users) == 1 and users[0].target is aten.split.Tensor:
        split = users[0]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        getitems = sorted(split.users, key=lambda n: n.args[1] if n.target is operator.getitem else -1)
        seen.update(getitems)
        if (dim == 0 and split.args[1] == shard_shape[0] and len(getitems) == world
                and all(g.target is operator.getitem and g.args[1] == i for i, g in enumerate(getitems))):
            return _cat_of_pieces(getitems, len(shard_shape), seen)
        raise NoMatch("gathered tensor is split in a way that is not a gather-dim change")
    if users and all(u.target is aten.slice.Tensor for u in users):
        return _cat_of_pieces(_ordered_slices(users, world, shard_shape[0]), len(shard_shape), seen)
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


def _cat_of_pieces(pieces: list[fx.Node], ndim: int, seen: set[fx.Node]) -> tuple[fx.Node, int]:
    """The one ``cat(pieces, g)`` with g > 0 that all rank pieces feed, and g."""
    cats = {u for p in pieces for u in p.users}
    seen.update(cats)
    if len(cats) == 1 and all(len(p.users) == 1 for p in pieces):
        cat = cats.pop()
        if cat.target is aten.cat.default and list(cat.args[0]) == pieces:
            cat_dim = (cat.args[1] if len(cat.args) > 1 else 0) % ndim
            if cat_dim == 0:
                raise NoMatch("split/cat around the gather does not change the gather dim")
            return cat, cat_dim
    raise NoMatch("gathered tensor is split in a way that is not a gather-dim change")


def _merged_slab(shape: tuple[int, ...], dim: int) -> tuple[tuple[int, ...], int]:
    """The layout with each rank's slab as one run of rows, where it is one.

    With nothing but size-1 dims before ``dim`` (batch 1), a rank's part of the gathered tensor
    is a contiguous block of rows of the 2-D matmul operand, e.g. ``[1, S, D]`` gathered on S, or
    ``[W, S/W, D]`` on dim 0: then the rows themselves are the dim to split, and a part can be any
    divisor of the rank's rows instead of a divisor of a size-1 dim."""
    if math.prod(shape[:dim]) != 1 or dim >= len(shape) - 2:
        return shape, dim
    return (math.prod(shape[dim:-1]), shape[-1]), 0


# ------------------------------------------------------------------ plain matmul consumers

def _row_views(logical: fx.Node, shape: tuple[int, ...], seen: set[fx.Node]
               ) -> tuple[list[tuple[fx.Node, tuple]], int]:
    """Nodes that hold the gathered rows, with the dtype casts on the way, and the count of uses
    that need the whole gathered tensor.

    From the logical tensor the walk follows reshapes (any chain: the element order is kept) and
    dtype conversions; a node reached that way whose last dim is the logical last dim holds the
    same rows.  Users that are neither followed nor classified later need the whole tensor.
    """
    found: list[tuple[fx.Node, tuple]] = []
    whole_uses = 0
    frontier: list[tuple[fx.Node, tuple]] = [(logical, ())]
    walked: set[fx.Node] = {logical}
    while frontier:
        node, casts = frontier.pop(0)
        nshape = shape_of(node)
        rows_here = nshape is not None and len(nshape) in (2, 3) and nshape[-1] == shape[-1]
        if rows_here:
            found.append((node, casts))
        seen.add(node)
        seen.update(node.users)
        for user in node.users:
            if user in walked:
                continue
            dtype = cast_dtype(user)
            if dtype is not None or is_reshape(user):
                walked.add(user)
                frontier.append((user, casts + ((dtype,) if dtype is not None else ())))
            elif not rows_here:
                whole_uses += 1
    return found, whole_uses


def _classify_view_users(view: fx.Node, views: set[fx.Node], casts: tuple, region: RowRegion,
                         ) -> tuple[list[RowConsumer], list[ContractionConsumer], int]:
    rows: list[RowConsumer] = []
    contractions: list[ContractionConsumer] = []
    whole_uses = 0
    two_d = len(shape_of(view)) == 2
    for user in view.users:
        if user in views or cast_dtype(user) is not None or is_reshape(user):
            continue  # followed by the walk in _row_views
        if two_d and user.target is aten.mm.default and user.args[0] is view and user.args[1] is not view:
            rows.append(RowConsumer(user, view, casts))
        elif user.target is aten._scaled_mm.default and user.args[0] is view and view in region.nodes:
            continue  # float8: found with its scales by _scaled_row_consumers
        elif two_d and user.target is aten.addmm.default and user.args[1] is view and user.args[2] is not view \
                and row_broadcast_bias(user.args[0]) and unscaled(user):
            rows.append(RowConsumer(user, view, casts))
        elif (not two_d and user.target is aten.bmm.default and user.args[0] is view
              and user.args[1] is not view and batched_weight(user.args[1]) is not None):
            rows.append(RowConsumer(user, view, casts, batched_weight(user.args[1])))
        elif two_d and user.target is aten.permute.default and list(user.args[1]) == [1, 0] and user.users and all(
                mm.target is aten.mm.default and mm.args[0] is user and mm.args[1] is not view
                for mm in user.users):
            for mm in user.users:
                contractions.append(ContractionConsumer(mm, view, mm.args[1], gathered_on_left=True, casts=casts))
        elif two_d and view in region.nodes and _scaled_contractions(user, region):
            continue  # float8 weight gradient: found by _scaled_contraction_consumers
        elif (two_d and user.target is aten.mm.default and user.args[1] is view
              and isinstance(user.args[0], fx.Node) and user.args[0].target is aten.permute.default
              and list(user.args[0].args[1]) == [1, 0] and user.args[0].args[0] is not view):
            contractions.append(ContractionConsumer(user, view, user.args[0].args[0], gathered_on_left=False,
                                                    casts=casts))
        else:
            whole_uses += 1
    return rows, contractions, whole_uses


# ------------------------------------------------------------------ float8 consumers

def _scaled_row_consumers(region: RowRegion) -> list[RowConsumer]:
    """Every float8 ``_scaled_mm`` whose A is computed row by row from the gathered rows."""
    return [_scaled_row_consumer(n, region) for n in region.edge()
            if n.target is aten._scaled_mm.default and n.args[0] in region.nodes]


def _scaled_row_consumer(mm: fx.Node, region: RowRegion) -> RowConsumer:
    """``mm`` as a row consumer whose parts replay the region's quantization, or NoMatch with why.

    Its scales of A must be one scale (from before the gather) or one per gathered row, computed
    row by row from the rows (a row-wise amax) or independently of them; B and its scales must not
    depend on the gathered rows."""
    a, b, scale_a, scale_b = scaled_mm_args(mm)
    if shape_of(a) is None or len(shape_of(a)) != 2 or shape_of(a)[0] != region.rows:
        raise NoMatch(f"{mm.name} is a float8 _scaled_mm whose A is not the gathered rows as one 2-D matrix")
    if not (region.independent(b) and region.independent(scale_b)):
        raise NoMatch(f"{mm.name} is a float8 _scaled_mm whose B or scale of B is computed from the gathered rows")
    if scaled_mm_extras(mm):
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
    if not is_transpose(permute) or not permute.users:
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
    for node in region.in_order(region.nodes):
        shape = shape_of(node)
        if shape is None or len(shape) != 2 or shape[0] != region.rows:
            continue
        for user in node.users:
            found += [ContractionConsumer(mm, node, mm.args[1], gathered_on_left=True,
                                          region=region.ancestors_in_region(node))
                      for mm in _scaled_contractions(user, region)]
    return found


def _tensorwise_contraction(mm: fx.Node, region: RowRegion) -> bool:
    """One scale each, and neither the scales nor B computed from the gathered rows."""
    _, b, scale_a, scale_b = scaled_mm_args(mm)
    scales_ok = all(isinstance(x, fx.Node) and shape_of(x) is not None and math.prod(shape_of(x)) == 1
                    and region.independent(x) for x in (scale_a, scale_b))
    return scales_ok and region.independent(b) and scaled_mm_reason(mm) is None


def _outside_uses(region: RowRegion, rows: list[RowConsumer], contractions: list[ContractionConsumer]) -> int:
    """Uses of the gathered rows' region by nodes that are neither in it nor a found matmul (nor the
    transposes and copies on a weight-gradient matmul's way): they need the whole gathered tensor."""
    handled = {rc.mm for rc in rows}
    for cc in contractions:  # mm, and t / clone / t between it and the gathered rows
        handled.add(cc.mm)
        stack = list(cc.mm.all_input_nodes)
        while stack:
            node = stack.pop()
            if node not in handled and (node.target is aten.clone.default or is_transpose(node)):
                handled.add(node)
                stack.extend(node.all_input_nodes)
    return sum(1 for n in region.nodes for u in n.users if u not in region.nodes and u not in handled)


def _no_consumer_reason(region: RowRegion) -> str:
    """Why no matmul takes the gathered rows: say so precisely when a float8 matmul does, but only
    after a step that mixes rows (a tensorwise scale computed from the whole gathered tensor).

    The walk goes forward from the gathered rows through every node that is not a matmul (it stops
    at matmuls: a later layer's float8 GEMM is no reason to name); it runs only for a gather that
    is left alone."""
    reached, stack, late = {region.logical}, [region.logical], []
    while stack:
        node = stack.pop()
        for user in node.users:
            if user.target is aten._scaled_mm.default and user.args[0] in reached:
                late.append(user)
            if user in reached or user.target in MM_OPS or user.target is aten.bmm.default:
                continue
            reached.add(user)
            stack.append(user)
    late = [mm for mm in late if mm.args[0] in reached]
    if late:
        first = region.in_order(late)[0]
        return (f"the float8 _scaled_mm {first.name} takes the gathered rows only after a step that is not "
                "computed row by row (it mixes rows, e.g. a tensorwise scale computed from the whole "
                "gathered tensor, or draws random numbers): no part can be cast to float8 on its own")
    return "gathered tensor feeds no matmul as its row operand"
