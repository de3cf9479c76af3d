"""The rewrites' metadata computed directly equals what the fake mode computes (issue 26).

``NodeBuilder`` fills a new node's ``meta["val"]`` by running the op's meta kernel itself (most
ops) instead of going through FakeTensorMode's dispatch, which costs several times more and, for a
64-layer model, made up most of the pass.  Here every node the rewrites create in the demo
transformer (with and without sequence parallelism, decomposed in 2 and 3 parts, forward and
backward) gets both: the direct result, and the fake mode's own (``with fake_mode: op(...)``, the
path taken before); they must agree in sizes, strides, offset, dtype, device, ``requires_grad``
and in which inputs they share storage with.
"""
from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_dense
from torch.fx.node import map_arg
from torch.utils._pytree import tree_leaves

import compass_fx
from compass_fx.demo import ModelArgs, Transformer, parallelize
from compass_fx.lowering import graph_edit

WORLD = 4
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def describe(value: Any, inputs: list[torch.Tensor]) -> list:
    """What a node's value says to the compiler: per tensor, its layout and the inputs it aliases."""
    out = []
    for t in tree_leaves(value):
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        storage = t.untyped_storage()._cdata
        aliases = tuple(i for i, x in enumerate(inputs) if x.untyped_storage()._cdata == storage)
        out.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad, aliases))
    return out


def reference(fake_mode: Any, node: Any, args: tuple, kwargs: dict) -> Any:
    with fake_mode:
        if node.target is auto_functionalized:
            return auto_functionalized_dense(*args, _only_clone_these_tensors=None, **kwargs)
        return node.target(*args, **kwargs)


@pytest.mark.parametrize("sequence_parallel,chunks", [(True, 2), (True, 3), (False, 2)])
def test_direct_metadata_equals_the_fake_modes(fake_mesh, monkeypatch, sequence_parallel, chunks):
    checked: collections.Counter = collections.Counter()
    mismatches: list[str] = []
    real_infer = graph_edit.NodeBuilder._infer_meta

    def checked_infer(self, node):
        real_infer(self, node)
        direct = node.target in graph_edit.META_DIRECT_OPS or node.target is auto_functionalized
        if self.fake_mode is None or not direct:
            return
        args = map_arg(node.args, lambda n: n.meta["val"])
        kwargs = map_arg(node.kwargs, lambda n: n.meta["val"])
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        got, want = describe(node.meta["val"], inputs), describe(reference(self.fake_mode, node, args, kwargs), inputs)
        checked[str(node.target)] += 1
        if got != want:
            mismatches.append(f"{node.format_node()}: direct {got}, fake mode {want}")

    monkeypatch.setattr(graph_edit.NodeBuilder, "_infer_meta", checked_infer)
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = parallelize(Transformer(ModelArgs(n_layers=1)), fake_mesh, sequence_parallel=sequence_parallel)
    report = compass_fx.explain(model, TOKENS, chunks=chunks)
    assert report.count(status="rewritten") > 0
    assert not mismatches, "\n".join(mismatches[:10])
    kinds = {"aten.view.default", "aten.cat.default", "_c10d_functional.wait_tensor.default"}
    kinds |= ({"auto_functionalized", "_c10d_functional.all_gather_into_tensor.default",
               "_c10d_functional.reduce_scatter_tensor.default"} if sequence_parallel
              else {"aten.add.Tensor", "_c10d_functional.all_reduce.default"})
    assert kinds <= set(checked), f"ops never checked: {kinds - set(checked)} (checked {dict(checked)})"
