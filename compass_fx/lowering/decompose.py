"""InterDecom: rewrite one pair into a pipeline of ``parts`` smaller collectives and matmuls, one
function per pair kind (:func:`all_gather`, :func:`reduce_scatter`, :func:`all_reduce`), each
building with a ``NodeBuilder`` inside ``lowering.transaction``.

Consumer side (all_gather_matmul): the gather of part i+1 is issued before the matmul of part i,
and each wait sits just before its first use.  Producer side (matmul_reduce_scatter,
matmul_all_reduce): the collective of part i is issued right after its matmul, so it travels
while the matmul of part i+1 runs; the waits sit where the result is first needed.
A part's plain matmul reads (reduce side) or writes (gather side) its rows where they lie in the
whole tensor (:mod:`.row_blocks`), so no rows are copied to put the parts together.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from ..graph.pairs import BatchedWeight, GatherPair, ReducePair, mm_operands
from ..graph.nodes import shape_of
from ..groups import backend_for, gloo_threads_of
from . import blocking_gather  # noqa: F401 - defines compass::all_gather_blocking
from . import gather_parts  # noqa: F401 - defines compass::all_gather_mm_parts
from .graph_edit import NodeBuilder
from .replay import RowReplay
from .row_blocks import block_matmul, matmul_into_rows, part_row_blocks, result_buffer
from .rows import interleave, interleave_rows, ranks_side_by_side, ranks_stacked, select_rows

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
prims = torch.ops.prims


def _matmul_like(b: NodeBuilder, mm: fx.Node, rows: fx.Node, weight: fx.Node | None = None) -> fx.Node:
    """The same mm/addmm as ``mm`` with its row operand replaced by ``rows`` (2-D).

    ``weight`` is the 2-D weight of a bmm-form matmul (see ``batched_weight_2d``).
    """
    if mm.target is aten.addmm.default:
        return b.call(aten.addmm.default, mm.args[0], rows, mm.args[2], **mm.kwargs)
    if mm.target is aten.bmm.default:
        return b.call(aten.mm.default, rows, weight)
    return b.call(aten.mm.default, rows, mm.args[1])


def scaled_mm_like(b: NodeBuilder, mm: fx.Node, a: fx.Node, mat2: fx.Node | None = None,
                   scale_a: fx.Node | None = None, out_dtype: torch.dtype | None = None) -> fx.Node:
    """The float8 ``_scaled_mm`` ``mm`` with some of its operands (and its output dtype) replaced."""
    args, kwargs = list(mm.args), dict(mm.kwargs)
    for pos, name, value in ((1, "mat2", mat2), (2, "scale_a", scale_a), (6, "out_dtype", out_dtype)):
        if value is None:
            continue
        if len(args) > pos:
            args[pos] = value
        else:
            kwargs[name] = value
    args[0] = a
    return b.call(aten._scaled_mm.default, *args, **kwargs)


def shared_float8_b(b: NodeBuilder, mat2: fx.Node) -> fx.Node:
    """The B of a float8 GEMM that the parts now share, marked so that Inductor keeps its strides.

    A float8 GEMM wants B column-major, and Inductor checks that.  With one user, B's layout
    follows the traced strides; with several (the parts), Inductor lays a computed B out
    row-major (``realize_hint``) and then refuses the GEMM; ``inductor_realize_to_strides``
    makes it realize B, and the views between B and what computes it, with the traced strides."""
    node = mat2
    while isinstance(node, fx.Node) and node.op == "call_function":
        b.mark(node, "inductor_realize_to_strides")
        if node.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            break
        node = node.args[0]
    return mat2


def part_row_scales(scales: fx.Node) -> fx.Node:
    """A part's [rows, 1] scales of A, marked so that Inductor lays them out as traced: the float8
    GEMM checks that their last stride is 1, which a layout Inductor picks for a [rows, 1] buffer
    (or the broadcast of a repeated scale) need not be."""
    scales.meta["inductor_realize_to_strides"] = True
    return scales


def _as_row_scales(b: NodeBuilder, scales: fx.Node) -> fx.Node:
    rows = shape_of(scales)[0]
    return part_row_scales(b.call(aten.as_strided.default, b.contiguous(scales), [rows, 1], [1, 1]))


def _scaled_row_part(b: NodeBuilder, replay: RowReplay, rc, mat2: fx.Node) -> fx.Node:
    """Part of a float8 row consumer: its A and scales of A replayed on the part's rows."""
    region = set(rc.region)
    scale_a = rc.mm.args[2] if len(rc.mm.args) > 2 else rc.mm.kwargs["scale_a"]
    part_scales = replay.scale(scale_a, region)
    if part_scales is not scale_a:
        part_scales = _as_row_scales(b, part_scales)
    return scaled_mm_like(b, rc.mm, replay.value(rc.view, region), mat2, scale_a=part_scales)


def _scaled_contraction_part(b: NodeBuilder, cc, rows: fx.Node, other_rows: fx.Node) -> fx.Node:
    """Part of a float8 weight gradient ``_scaled_mm(clone(t(V)), B)``: the part's rows of V and of B
    (B column-major, as the original), multiplied into float32 so that the parts add up exactly.

    Both are marked to be realized with their traced strides: CUDA's float8 GEMM takes only a
    row-major A and a column-major B, and Inductor, free to lay out a copy of a transpose, laid the
    part's A out column-major (the GEMM refused it on an H100: "Only multiplication of row-major and
    column-major matrices is supported by cuBLASLt"); the CPU kernel takes either."""
    a = b.contiguous(b.call(aten.permute.default, rows, [1, 0]))
    mat2 = b.call(aten.permute.default, b.contiguous(b.call(aten.permute.default, other_rows, [1, 0])), [1, 0])
    for operand in (a, mat2):
        b.mark(operand, "inductor_realize_to_strides")
    return scaled_mm_like(b, cc.mm, a, mat2, out_dtype=torch.float32)


def batched_weight_2d(b: NodeBuilder, weight: BatchedWeight | None) -> fx.Node | None:
    """The [K, N] matrix that a bmm-form matmul multiplies every batch by."""
    if weight is None:
        return None
    w = weight.source
    shape = shape_of(w)
    if len(shape) == 3:
        w = b.view(w, list(shape[1:]))
    if weight.transpose:
        w = b.call(aten.permute.default, w, [1, 0])
    return w


def _cast(b: NodeBuilder, x: fx.Node, casts: tuple[torch.dtype, ...]) -> fx.Node:
    for dtype in casts:
        x = b.call(prims.convert_element_type.default, x, dtype)
    return x


def _rows_as(b: NodeBuilder, cache: dict[tuple, fx.Node], casts: tuple) -> fx.Node:
    """This part's gathered rows after ``casts`` (``cache[()]`` holds them uncast)."""
    if casts not in cache:
        cache[casts] = _cast(b, cache[()], casts)
    return cache[casts]


def all_gather(b: NodeBuilder, pair: GatherPair, parts: int) -> None:
    """all_gather -> matmul in ``parts`` parts: part i+1's gather is issued before part i's matmuls."""
    if gathers_in_one_call(pair):
        _all_gather_one_call(b, pair, parts)
        return
    layout, world, g = pair.layout, pair.group_size, pair.layout.dim
    shard, shard_shape = pair.shard, shape_of(pair.shard)
    if len(shard_shape) != len(layout.shape):  # the layout took each rank's slab as rows
        shard_shape = [layout.local_extent, layout.shape[-1]]
        shard = b.view(b.contiguous(shard), shard_shape)
    c = shard_shape[g] // parts
    flat = [layout.rows // parts, layout.shape[-1]]
    weights = [shared_float8_b(b, mm_operands(rc.mm)[1]) if rc.mm.target is aten._scaled_mm.default
               else batched_weight_2d(b, rc.weight) for rc in pair.row_consumers]

    # a float8 weight gradient's B is column-major: its rows are cut from one row-major copy
    others_rowmajor = [b.contiguous(cc.other) if cc.mm.target is aten._scaled_mm.default else None
                       for cc in pair.contraction_consumers]
    shard_parts = []
    for i in range(parts):
        piece = b.slice(shard, g, i * c, (i + 1) * c)
        shard_parts.append(b.contiguous(piece) if g > 0 else piece)
    gathers: list[fx.Node] = []

    blocking = gathers_blocking(pair)

    def issue(i: int) -> None:
        if blocking:  # gloo: gathered before the op returns, nothing left in flight
            gathers.append(b.call(torch.ops.compass.all_gather_blocking.default, shard_parts[i], world,
                                  pair.group_name))
        else:
            gathers.append(b.call(c10d.all_gather_into_tensor.default, shard_parts[i], world, pair.group_name))

    issue(0)
    logical_parts: list[fx.Node] = []
    row_outs: list[list[fx.Node]] = [[] for _ in pair.row_consumers]
    # plain matmuls write each part into its rows of one result (no cat of the parts)
    in_place = [result_buffer(b, layout, rc.mm) if _writes_in_place(rc.mm) else None for rc in pair.row_consumers]
    sums: list[fx.Node | None] = [None for _ in pair.contraction_consumers]
    for i in range(parts):
        if i + 1 < parts:
            issue(i + 1)  # in flight while part i is waited for and multiplied
        gathered = gathers[i] if blocking else b.wait(gathers[i])
        if g > 0:
            gathered = ranks_side_by_side(b, gathered, world, g)
        logical_parts.append(gathered)
        plain = gathered if len(layout.shape) == 2 else b.view(gathered, flat)
        cast_rows: dict[tuple, fx.Node] = {(): plain}  # each distinct cast chain once per part
        replay = RowReplay(b, pair, parts, i, plain)
        for j, rc in enumerate(pair.row_consumers):
            if rc.mm.target is aten._scaled_mm.default:
                row_outs[j].append(_scaled_row_part(b, replay, rc, weights[j]))
                continue
            rows = _rows_as(b, cast_rows, rc.casts)
            if in_place[j] is not None:
                weight = weights[j] if weights[j] is not None else rc.mm.args[1]
                in_place[j] = matmul_into_rows(b, in_place[j], rows, weight, layout, parts, i)
            else:
                row_outs[j].append(_matmul_like(b, rc.mm, rows, weights[j]))
        for j, cc in enumerate(pair.contraction_consumers):
            if cc.mm.target is aten._scaled_mm.default:
                rows = replay.value(cc.view, set(cc.region))
                part = _scaled_contraction_part(b, cc, rows, select_rows(b, others_rowmajor[j], layout, parts, i))
            else:
                rows = _rows_as(b, cast_rows, cc.casts)
                other = select_rows(b, cc.other, layout, parts, i)
                if cc.gathered_on_left:
                    part = b.call(aten.mm.default, b.call(aten.permute.default, rows, [1, 0]), other)
                else:
                    part = b.call(aten.mm.default, b.call(aten.permute.default, other, [1, 0]), rows)
            sums[j] = part if sums[j] is None else b.add(sums[j], part)

    for rc, outs, whole in zip(pair.row_consumers, row_outs, in_place):
        out = whole if whole is not None else interleave_rows(b, outs, layout)
        if rc.mm.target is aten.bmm.default:
            out = b.view(out, list(shape_of(rc.mm)))
        b.replace(rc.mm, out)
    for cc, total in zip(pair.contraction_consumers, sums):
        if cc.mm.target is aten._scaled_mm.default:  # float32 sum of the parts, then the output dtype
            total = b.call(prims.convert_element_type.default, total, cc.mm.meta["val"].dtype)
        b.replace(cc.mm, total)
    if pair.whole_tensor_uses:
        full = b.view(interleave(b, logical_parts, layout, [layout.shape[-1]]), list(shape_of(pair.logical)))
        b.replace(pair.logical, full)


def gathers_in_one_call(pair: GatherPair) -> bool:
    """Whether the pair's parts can be one ``compass::all_gather_mm_parts`` call (what costs the
    host least per part, :mod:`.gather_parts`): a 2-D shard gathered on dim 0 whose gathered rows
    feed only plain matmuls (mm, or bmm by one broadcast matrix, no casts), on NCCL (gloo's gathers
    must not be left in flight; a fake group's, which the tests replay under LocalTensorMode,
    must stay functional collectives).  Every other pair gets one node per step."""
    layout = pair.layout
    if layout.dim != 0 or len(layout.shape) != 2 or len(shape_of(pair.shard) or ()) != 2:
        return False
    if pair.contraction_consumers or pair.whole_tensor_uses or not pair.row_consumers:
        return False
    if any(rc.casts or rc.region or not _writes_in_place(rc.mm) for rc in pair.row_consumers):
        return False
    val = pair.shard.meta.get("val")
    return isinstance(val, torch.Tensor) and backend_for(pair.group_name, val.device.type) == "nccl"


def _all_gather_one_call(b: NodeBuilder, pair: GatherPair, parts: int) -> None:
    """The pair as one call that gathers its parts and multiplies each into its rows of the results."""
    weights = [batched_weight_2d(b, rc.weight) if rc.weight is not None else rc.mm.args[1]
               for rc in pair.row_consumers]
    outs = b.call(torch.ops.compass.all_gather_mm_parts.default, pair.shard, weights, parts,
                  pair.group_size, pair.group_name)
    for j, rc in enumerate(pair.row_consumers):
        out = b.call(operator.getitem, outs, j)
        if rc.mm.target is aten.bmm.default:
            out = b.view(out, list(shape_of(rc.mm)))
        b.replace(rc.mm, out)


# what gloo's own gathers move (float8 has no gloo type: blocking_gather moves it as bytes)
GLOO_FUNCTIONAL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def gathers_blocking(pair: GatherPair) -> bool:
    """Whether the parts are gathered by ``compass::all_gather_blocking``: on gloo (CPU tensors)
    whose group runs torch's two worker threads, where functional gathers in flight corrupt the
    heap (``blocking_gather`` says why), or whose dtype gloo has no type for.  A gloo group of one
    worker thread (``compass_fx.gloo_worker_threads(1)``; the ranks agree on it, ``passes.agree``)
    and other backends (NCCL) keep the functional collectives in flight, the pipelined form."""
    val = pair.shard.meta.get("val")
    device = val.device.type if isinstance(val, torch.Tensor) else "cpu"
    if backend_for(pair.group_name, device) != "gloo":
        return False
    dtype = val.dtype if isinstance(val, torch.Tensor) else None
    return gloo_threads_of(pair.group_name) != 1 or dtype not in GLOO_FUNCTIONAL_DTYPES


def _writes_in_place(mm: fx.Node) -> bool:
    """A plain matmul (mm, or bmm by one broadcast matrix): its parts go straight into their rows of
    the result (:mod:`.row_blocks`).  addmm and float8 GEMMs keep the cat of their parts."""
    return mm.target in (aten.mm.default, aten.bmm.default)


def _row_scales(mm: fx.Node) -> bool:
    """A float8 _scaled_mm with one scale per row of A: the scales split with the rows."""
    shape = shape_of(mm.args[2])
    return shape is not None and math.prod(shape) > 1


class _PartValues:
    """Per-part values, as 2-D row blocks, of every node of a reduced sum of matmuls."""

    def __init__(self, b: NodeBuilder, pair: ReducePair, parts: int) -> None:
        self.b, self.pair, self.parts = b, pair, parts
        self.weights = {t: batched_weight_2d(b, w) for t, w in pair.batched_weights.items()}
        self.weights.update({t: shared_float8_b(b, mm_operands(t)[1]) for t in pair.terms
                             if t.target is aten._scaled_mm.default})
        self.memo: dict[tuple[fx.Node, int], fx.Node] = {}

    def rows_of(self, x: fx.Node, i: int) -> fx.Node:
        """Rows of part ``i`` of a row-aligned operand (any rank; flattened to 2-D first)."""
        shape = shape_of(x)
        if len(shape) != 2:
            x = self.b.view(x, [self.pair.layout.rows, shape[-1]])
        if self.pair.all_reduce:  # every rank keeps every row: a part is a run of rows
            r = self.pair.layout.rows // self.parts
            return self.b.slice(x, 0, i * r, (i + 1) * r)
        return select_rows(self.b, x, self.pair.layout, self.parts, i)

    def _row_blocks(self, x: fx.Node, i: int) -> fx.Node:
        """Part ``i``'s rows of a 2-D row-aligned operand as strided rank blocks (no copy)."""
        return part_row_blocks(self.b, x, self.pair.layout, self.parts, i)

    def value(self, node: fx.Node, i: int) -> fx.Node:
        key = (node, i)
        if key not in self.memo:
            self.memo[key] = self._compute(node, i)
        return self.memo[key]

    def _compute(self, node: fx.Node, i: int) -> fx.Node:
        if node in self.pair.terms:
            a, _ = mm_operands(node)
            if node.target is aten._scaled_mm.default:  # float8: row scales are cut with the rows
                scale_a = _as_row_scales(self.b, self.rows_of(node.args[2], i)) if _row_scales(node) else None
                return scaled_mm_like(self.b, node, self.rows_of(a, i), self.weights[node], scale_a=scale_a)
            if node.target is aten.mm.default and not self.pair.all_reduce:  # rows read in place
                return block_matmul(self.b, self._row_blocks(a, i), node.args[1])
            return _matmul_like(self.b, node, self.rows_of(a, i), self.weights.get(node))
        if node in self.pair.row_factors:  # mul(term, f): the part's rows of f (or f itself, broadcast)
            factor = self.pair.row_factors[node]
            term = node.args[1] if node.args[0] is factor else node.args[0]
            return self.b.call(aten.mul.Tensor, self.value(term, i), self._factor(factor, i))
        if node.target is aten.add.Tensor:  # a sum of terms, or a term plus a column bias
            a, c = (self.value(x, i) if shape_of(x) == shape_of(node) else self._bias(x) for x in node.args)
            return self.b.add(a, c)
        if node.target is prims.convert_element_type.default:
            return _cast(self.b, self.value(node.args[0], i), (node.args[1],))
        if node.target is aten._to_copy.default:
            return _cast(self.b, self.value(node.args[0], i), (node.kwargs["dtype"],))
        return self.value(node.args[0], i)  # a reshape: the row blocks are the same

    def _factor(self, factor: fx.Node, i: int) -> fx.Node:
        shape = shape_of(factor)
        if all(d == 1 for d in shape[:-1]):
            return self._bias(factor) if shape else factor
        return self.rows_of(self.b.contiguous(factor), i)

    def _bias(self, bias: fx.Node) -> fx.Node:
        """A [..1, N] bias as [N], so that it broadcasts over a 2-D row block."""
        shape = shape_of(bias)
        return bias if len(shape) == 1 else self.b.view(bias, [shape[-1]])

    def whole(self, node: fx.Node) -> fx.Node:
        """``node`` rebuilt from its part values, for its users outside the sum."""
        pieces = [self.value(node, i) for i in range(self.parts)]
        if self.pair.all_reduce:
            flat = self.b.cat(pieces, 0)
        else:
            flat = interleave_rows(self.b, pieces, self.pair.layout)
        return self.b.view(flat, list(shape_of(node)))


def _rebuild_shared_partial_sums(values: _PartValues) -> None:
    """Nodes of the sum that other nodes use too get their whole value back from the parts."""
    for node in values.pair.shared_partial_sums:
        values.b.replace(node, values.whole(node))


def reduce_scatter(b: NodeBuilder, pair: ReducePair, parts: int) -> None:
    """matmul -> reduce_scatter in ``parts`` parts: part i's collective is issued after its matmuls."""
    layout, world, g = pair.layout, pair.group_size, pair.layout.dim
    part_shape = list(layout.shape)
    part_shape[g] //= parts
    values = _PartValues(b, pair, parts)
    pending = []
    for i in range(parts):
        total = values.value(pair.reduced, i)
        logical = b.view(total, part_shape)
        if g > 0:
            logical = ranks_stacked(b, logical, world, g)
        pending.append(b.call(c10d.reduce_scatter_tensor.default, logical, pair.reduce_op, world,
                              pair.group_name))
    out = b.cat([b.wait(p) for p in pending], g)
    if pair.scatter_perm is not None:
        out = b.call(aten.permute.default, out, list(pair.scatter_perm))
    _rebuild_shared_partial_sums(values)
    b.replace(pair.wait, out)


def all_reduce(b: NodeBuilder, pair: ReducePair, parts: int) -> None:
    """matmul -> all_reduce in ``parts`` parts, each a run of the rows every rank keeps."""
    values = _PartValues(b, pair, parts)
    pending = [b.call(c10d.all_reduce.default, values.value(pair.reduced, i), pair.reduce_op,
                      pair.group_name) for i in range(parts)]
    out = b.cat([b.wait(p) for p in pending], 0)
    if len(pair.layout.shape) != 2:
        out = b.view(out, list(pair.layout.shape))
    _rebuild_shared_partial_sums(values)
    b.replace(pair.wait, out)
