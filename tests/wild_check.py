"""Check rewrites without spawning ranks: replay graphs on every rank at once with LocalTensorMode.

The fake process group traces the same graphs as gloo; ``LocalTensorMode(world)`` then runs a
graph with one real tensor per rank, collectives included, so an original and a rewritten graph
can be compared on the same per-rank inputs in one process (FACTS.md).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

from compass_fx.cost.decision import Decision
from compass_fx.graph_pass import rewrite_pairs
from compass_fx.kernels.ops import _check_common, _check_divisible
from compass_fx.lowering import RewriteFailed
from compass_fx.lowering.row_blocks import run_in_place
from compass_fx.passes.find import find_pairs
from compass_fx.graph.pairs import Pair
from compass_fx.report import SkipRecord

c10d = torch.ops._c10d_functional


def local_inputs(gm: fx.GraphModule, world: int, seed: int) -> list[Any]:
    """Random per-rank tensors (different on each rank) for every placeholder of ``gm``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            out.append(val)
            continue
        shape = [int(d) for d in val.shape]
        per_rank = {}
        for r in range(world):
            if val.dtype == torch.bool:
                t = torch.rand(shape, generator=g) > 0.5
            elif val.dtype.is_floating_point:
                t = torch.randn(shape, generator=g).to(val.dtype)
            else:
                t = torch.randint(0, 4, shape, generator=g).to(val.dtype)
            strided = torch.empty_strided(shape, [int(x) for x in val.stride()], dtype=val.dtype)
            per_rank[r] = strided.copy_(t)  # saved activations may need their traced strides
        out.append(LocalTensor(per_rank))
    return out


def replay(gm: fx.GraphModule, inputs: list[Any], world: int) -> list[dict[int, torch.Tensor] | None]:
    """Run ``gm`` on all ranks at once; each output as {rank: tensor} (None for non-tensors).

    A copy runs, with the rewrite's functionalized in-place ops called in place as the eager inner
    compiler calls them (LocalTensorMode cannot dispatch ``auto_functionalized``)."""
    runnable = copy.deepcopy(gm)
    run_in_place(runnable)
    with LocalTensorMode(world):
        outs = runnable(*inputs)
    if not isinstance(outs, (tuple, list)):
        outs = [outs]
    res = []
    for o in outs:
        if isinstance(o, LocalTensor):
            res.append({r: t.clone() for r, t in o._local_tensors.items()})
        elif isinstance(o, torch.Tensor):
            res.append({r: o.clone() for r in range(world)})
        else:
            res.append(None)
    return res


def assert_same_outputs(ref: list, got: list, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert len(ref) == len(got), "rewritten graph returns a different number of outputs"
    for j, (a, b) in enumerate(zip(ref, got)):
        if a is None or b is None:
            assert a is None and b is None, f"output {j}: tensor vs non-tensor"
            continue
        for r in a:
            # Random inputs for saved activations can make sums large: the rewrite may reassociate
            # them, so the absolute tolerance scales with the output's magnitude.
            scale = max(1.0, float(a[r].abs().max())) if a[r].is_floating_point() and a[r].numel() else 1.0
            # A float32 sum rounded another way (addmm against mm + add) may round a bf16 or fp16
            # result to the next value: one unit in its last place is reassociation, not a wrong rewrite.
            ulp = torch.finfo(a[r].dtype).eps if a[r].dtype in (torch.bfloat16, torch.float16) else 0.0
            torch.testing.assert_close(b[r], a[r], rtol=max(rtol, ulp), atol=atol * scale,
                                       msg=lambda m, j=j, r=r: f"output {j} rank {r}: {m}")


def rewrite_all(gm: fx.GraphModule, parts: Callable[[Pair], int | None], graph_kind: str = "forward",
                group: str | None = None) -> tuple[list[Pair], list[SkipRecord]]:
    """The backend's pass with a chosen part count per pair (None: leave it); returns what was done."""
    def choose(pair: Pair) -> Decision:
        k = parts(pair)
        return Decision("decompose", k) if k is not None and k in pair.feasible_parts() else Decision("sequential")

    return rewrite_chosen(gm, choose, graph_kind, group)


def rewrite_chosen(gm: fx.GraphModule, choose: Callable[[Pair], Decision], graph_kind: str = "forward",
                   group: str | None = None, fused_async: bool = False) -> tuple[list[Pair], list[SkipRecord]]:
    """The backend's pass with ``choose(pair)``'s decision for each pair; returns what was done."""
    gm.graph.eliminate_dead_code()
    pairs, skips = find_pairs(gm, graph_kind, group)
    records, gone = rewrite_pairs(gm, graph_kind, pairs, choose, group, fused_async=fused_async)
    failed = [r for r in records if r.status == "skipped"]
    if failed:  # a rewrite that fails is a bug here: say so (the graph itself is left as it was)
        raise RewriteFailed(failed[0].reason)
    rewritten = {r.collective for r in records if r.status == "rewritten"}
    return [p for p in pairs if p.collective.name in rewritten], skips + gone


def _gathered_matmuls(a_shard, bs, schedule, group_name, group_size):
    _check_common(a_shard, bs, schedule, group_size)
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(a_shard.contiguous(), group_size, group_name))
    return gathered, [torch.mm(gathered, b) for b in bs]


def _scattered_matmul(a, b, schedule, group_name, group_size):
    _check_common(a, [b], schedule, group_size)
    _check_divisible(a.shape[0], group_size)
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(torch.mm(a, b), "sum", group_size, group_name))


def _reduced_matmul(a, b, schedule, group_name, group_size):
    _check_common(a, [b], schedule, group_size)
    return c10d.wait_tensor(c10d.all_reduce(torch.mm(a, b), "sum", group_name))


def fused_calls_as_collectives(gm: fx.GraphModule) -> int:
    """Replace each call of a fused operator in ``gm`` by what it computes, written with functional
    collectives and ``torch.mm`` (after the operator's own checks of its operands), so that
    LocalTensorMode can replay the graph: what the lowering around the calls does (views,
    permutes, weights, biases, waits) is then checked on every rank at once.  The operators
    themselves are checked against plain collectives elsewhere (test_kernels_ops, the GPU tests).
    Returns how many calls were replaced."""
    compass = torch.ops.compass
    semantics = {compass.all_gather_matmul.graph: _gathered_matmuls,
                 compass.all_gather_matmul.default: _gathered_matmuls,
                 compass.matmul_reduce_scatter.graph: _scattered_matmul,
                 compass.matmul_reduce_scatter.default: _scattered_matmul,
                 compass.matmul_reduce_scatter_start.default: _scattered_matmul,
                 compass.matmul_all_reduce.graph: _reduced_matmul,
                 compass.matmul_all_reduce.default: _reduced_matmul,
                 compass.matmul_all_reduce_start.default: _reduced_matmul}
    replaced = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in semantics:
            node.target = semantics[node.target]
            replaced += 1
    gm.recompile()
    return replaced


class GraphCapture:
    """A compass backend run that keeps a copy of each graph after the pass (inner compiler: eager)."""

    def __init__(self, options: dict) -> None:
        from compass_fx.options import parse_options

        self.options = parse_options({**options, "inner": "eager"})
        self.graphs: dict[str, fx.GraphModule] = {}
        self.reports: list = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Any) -> Callable:
        from compass_fx import backend

        def finish(graph: fx.GraphModule, inputs: Any, **kwargs: Any) -> Callable:
            kind = "backward" if kwargs.get("is_backward") else "forward"
            self.graphs[kind] = graph
            return backend._eager_inner(graph, inputs, **kwargs)

        with backend.collect_reports() as reports:
            out = backend.compile_graph(gm, example_inputs, self.options, finish=finish)
        self.reports += reports
        return out


def capture(model: torch.nn.Module, inputs: tuple, options: dict, backward: bool = True,
            dynamic: bool | None = False) -> GraphCapture:
    """Compile ``model`` with the compass backend and ``options``; run forward (and backward)."""
    torch._dynamo.reset()
    cap = GraphCapture(options)
    compiled = torch.compile(model, backend=cap, fullgraph=True, dynamic=dynamic)
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        out = compiled(*inputs)
        if backward:
            (out.float() ** 2).sum().backward() if out.dim() else out.backward()
    return cap


def compare_captures(ref: GraphCapture, got: GraphCapture, world: int, seed: int = 0) -> None:
    """Replay every captured graph of ``ref`` and ``got`` on the same per-rank inputs."""
    assert ref.graphs.keys() == got.graphs.keys()
    for kind, gm in ref.graphs.items():
        inputs = local_inputs(gm, world, seed)
        assert_same_outputs(replay(gm, inputs, world), replay(got.graphs[kind], inputs, world))
