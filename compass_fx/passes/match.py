"""The matching vocabulary every pair kind shares: bail-outs, waits, shapes, dtype casts, float8
GEMM checks, and the walk from a reduced tensor down to the matmuls whose sum it is.

A match is accepted only when every node between the collective and the matmul is understood;
anything else raises ``NoMatch`` with the reason, and the graph is left alone there.  Each pair
kind's own matcher lives in its module (``all_gather_matmul``, ``matmul_reduce_scatter``,
``matmul_all_reduce``); every walk here starts at the pair and stays in its neighbourhood.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph.nodes import is_reshape, shape_of
from ..graph.pairs import BatchedWeight, mm_operands

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
prims = torch.ops.prims

MM_OPS = (aten.mm.default, aten.addmm.default, aten._scaled_mm.default)
LINEAR_REDUCE_OPS = ("sum", "avg")


class NoMatch(Exception):
    """Raised inside a matcher with the reason a collective is left as it is."""


def single_wait(coll: fx.Node) -> fx.Node:
    users = list(coll.users)
    if len(users) != 1 or users[0].target is not c10d.wait_tensor.default:
        raise NoMatch("collective result is not consumed by exactly one wait_tensor")
    return users[0]


def static_shape(node: fx.Node, what: str) -> tuple[int, ...]:
    shape = shape_of(node)
    if shape is None:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if isinstance(val, torch.Tensor):
            raise NoMatch(f"{what} has symbolic sizes (dynamic shapes): no part count is known to "
                          "divide them, so the pair is left as traced")
        raise NoMatch(f"{what} has no shape metadata")
    return shape


def dtype_of(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype of an elementwise dtype conversion node (None if ``node`` is not one)."""
    if node.target is prims.convert_element_type.default:
        return node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"} and len(node.args) == 1:
        return node.kwargs.get("dtype")
    return None


def scaled_mm_args(mm: fx.Node) -> tuple[object, object, object, object]:
    """A, B, scale_a, scale_b of a ``_scaled_mm`` (positional or keyword)."""
    names = ("self", "mat2", "scale_a", "scale_b")
    return tuple(mm.args[i] if len(mm.args) > i else mm.kwargs.get(n) for i, n in enumerate(names))


def scaled_mm_reason(node: fx.Node, row_scales_ok: bool = False) -> str | None:
    """Why a float8 ``_scaled_mm`` cannot have its rows split, or None: it can when A has one
    scale (tensorwise), or one per row where A is local (``row_scales_ok``: a reduce-scatter's
    or all-reduce's producer), and there is no bias and no output scale.  (The gather side checks
    its consumers itself: their row scales come from the gathered rows.)"""
    scale_a = node.args[2] if len(node.args) > 2 else node.kwargs.get("scale_a")
    shape = shape_of(scale_a) if isinstance(scale_a, fx.Node) else None
    rows = shape_of(node.args[0])
    row_scales = (row_scales_ok and shape is not None and rows is not None and len(shape) == 2
                  and shape == (rows[0], 1))  # local rows (a reduced sum): they split with A's rows
    if shape is None or (math.prod(shape) != 1 and not row_scales):
        return f"{node.name} is a float8 _scaled_mm with row-wise or block-wise scales of A (not split yet)"
    if scaled_mm_extras(node):
        return f"{node.name} is a float8 _scaled_mm with a bias or an output scale (not split yet)"
    return None


def scaled_mm_extras(mm: fx.Node) -> bool:
    """Whether a ``_scaled_mm`` has a bias or an output scale."""
    extra = list(mm.args[4:6]) + [mm.kwargs.get("bias"), mm.kwargs.get("scale_result")]
    return any(isinstance(x, fx.Node) for x in extra)


def is_transpose(node: object) -> bool:
    return isinstance(node, fx.Node) and node.target is aten.permute.default and list(node.args[1]) == [1, 0]


def unscaled(mm: fx.Node) -> bool:
    return mm.kwargs.get("beta", 1) == 1 and mm.kwargs.get("alpha", 1) == 1


def row_broadcast_bias(bias: object) -> bool:
    shape = shape_of(bias) if isinstance(bias, fx.Node) else None
    return shape is not None and (len(shape) == 1 or (len(shape) == 2 and shape[0] == 1))


def batched_weight(node: object) -> BatchedWeight | None:
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


# ---------------------------------------------------------------- a reduced sum of matmuls

@dataclass
class ReducedSum:
    """The matmul terms whose (cast) sum is reduced, the details the lowering needs, and every
    node the walk looked at (``seen``: what a rewrite elsewhere must not have touched)."""

    terms: list[fx.Node] = field(default_factory=list)
    batched_weights: dict[fx.Node, BatchedWeight] = field(default_factory=dict)
    shared_partial_sums: list[fx.Node] = field(default_factory=list)
    casts: tuple[torch.dtype, ...] = ()
    factors: dict[fx.Node, fx.Node] = field(default_factory=dict)  # mul node -> its row factor
    biases: list[fx.Node] = field(default_factory=list)  # column biases added to the sum (x + bias[N])
    seen: set[fx.Node] = field(default_factory=set)


def reduced_sum(root: fx.Node, shape: tuple[int, ...], collective_side: fx.Node) -> ReducedSum:
    """Walk down from the reduced tensor ``root`` to the matmuls whose sum it is.

    Dtype conversions and reshapes (they keep the row order) may sit anywhere, adds of
    same-shaped tensors, or of a term and a column bias.  A node on the way that has users outside the walk is
    a shared partial sum: the lowering rebuilds it for those users from the per-part pieces.
    """
    found = ReducedSum()
    casts: list[torch.dtype] = []

    def walk(node: fx.Node, parent: fx.Node) -> None:
        if not isinstance(node, fx.Node) or shape_of(node) is None:
            raise NoMatch("the reduced tensor has no static shape")
        found.seen.add(node)
        found.seen.update(node.users)
        if any(u is not parent for u in node.users) and node not in found.shared_partial_sums:
            found.shared_partial_sums.append(node)
        dtype = cast_dtype(node)
        if dtype is not None:  # elementwise: each part converts its own rows the same way
            casts.append(dtype)
            return walk(node.args[0], node)
        if is_reshape(node):
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
                found.seen.add(bias[0])
                found.biases.append(bias[0])
                walk(full[0], node)  # x + bias[N]: a bias added after a bmm-form matmul
                return None
        factored = _factored_term(node)
        if factored is not None:  # float8 row-wise: the unit-scale product times the outer product of scales
            found.factors[node] = factored[1]
            found.seen.add(factored[1])
            walk(factored[0], node)
            return None
        found.terms.append(_term(node, shape, found))
        return None

    walk(root, collective_side)
    found.casts = tuple(reversed(casts))
    return found


def _row_bias_of(bias: fx.Node, cols: int) -> bool:
    """A tensor that broadcasts one value per column over every row: shape [..1, cols]."""
    shape = shape_of(bias)
    return shape is not None and len(shape) >= 1 and shape[-1] == cols and all(d == 1 for d in shape[:-1])


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
    while cast_dtype(node) is not None or is_reshape(node):
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


def _term(node: fx.Node, shape: tuple[int, ...], found: ReducedSum) -> fx.Node:
    """Check that ``node`` is a matmul producing the reduced rows (row-aligned) and return it."""
    out = shape_of(node)
    if node.target in MM_OPS:
        if out != (math.prod(shape[:-1]), shape[-1]):
            raise NoMatch(f"{node.name} does not produce the reduced rows")
        if node.target is aten.addmm.default:
            if not row_broadcast_bias(node.args[0]):
                raise NoMatch(f"{node.name} adds a bias that is not a row broadcast")
            if not unscaled(node):
                raise NoMatch(f"{node.name} scales its terms (alpha/beta)")
        why = scaled_mm_reason(node, row_scales_ok=True) if node.target is aten._scaled_mm.default else None
        if why:
            raise NoMatch(why)
        a = mm_operands(node)[0]
        if shape_of(a) is None or len(shape_of(a)) != 2:
            raise NoMatch(f"{node.name}'s row operand has no static 2-D shape")
        return node
    if node.target is aten.bmm.default:
        weight = batched_weight(node.args[1])
        if weight is None:
            raise NoMatch(f"{node.name} is a bmm whose right operand is not one broadcast matrix")
        if out is None or out[-1] != shape[-1] or shape_of(node.args[0]) is None:
            raise NoMatch(f"{node.name} does not produce the reduced rows")
        found.batched_weights[node] = weight
        found.seen.update((node.args[1], weight.source))
        return node
    raise NoMatch(f"the reduced tensor is produced by {node.target}, not by a matmul or a sum of matmuls")
