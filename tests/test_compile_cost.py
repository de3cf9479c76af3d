"""What compiling costs grows with the graph, not with the graph times its pairs (issue 26).

Counted, not timed: how many times the pass walks a graph's whole node list (FX's ``Graph.nodes``:
dead-code elimination, a sort, a lint, a match of the whole graph, a copy of it all go through it)
and how many times it copies a graph.  A pass that matched the graph again after every rewrite, or
copied the graph to be able to undo one, walked it once or more per pair: the counts then grew with
the model's depth.  Here they must be the same at 1 and 3 layers (the demo transformer with
sequence parallelism: 9 and 25 pairs, every one decomposed; and torchtitan's Llama-3 with its
layers checkpointed, whose backward graph has a pair per layer matched again after a rewrite
touched it).
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.fx as fx

import compass_fx
import compass_fx.backend as backend
from compass_fx.demo import ModelArgs, Transformer, parallelize

WORLD = 4
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def walks_per_graph(fake_mesh, monkeypatch, layers: int, **options) -> tuple[dict[str, int], int]:
    """Whole-graph walks and graph copies inside the pass, per graph kind; and the pairs rewritten
    (the demo transformer)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = parallelize(Transformer(ModelArgs(n_layers=layers)), fake_mesh, sequence_parallel=True)
    return walks_of(monkeypatch, lambda: compass_fx.explain(model, TOKENS, **options))


def walks_of(monkeypatch, explain) -> tuple[dict[str, int], int]:
    """Whole-graph walks and graph copies inside the pass while ``explain()`` compiles, per graph
    kind; and the pairs rewritten (of the report ``explain`` returns)."""
    counts: collections.Counter = collections.Counter()
    inside: list[str] = []
    nodes, deepcopy = fx.Graph.nodes, fx.Graph.__deepcopy__

    def counted_nodes(graph):
        if inside:
            counts[inside[-1]] += 1
        return nodes.fget(graph)

    def counted_copy(graph, memo=None):
        if inside:
            counts["copies"] += 1
        return deepcopy(graph, memo)

    real_pass = backend.compass_pass

    def counted_pass(gm, kind, *args, **kwargs):
        inside.append(kind)
        try:
            return real_pass(gm, kind, *args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(fx.Graph, "nodes", property(counted_nodes))
    monkeypatch.setattr(fx.Graph, "__deepcopy__", counted_copy)
    monkeypatch.setattr(backend, "compass_pass", counted_pass)
    try:
        report = explain()
    finally:
        monkeypatch.undo()
    return dict(counts), report.count(status="rewritten")


@pytest.mark.parametrize("options", [{"chunks": 2}, pytest.param({"strategy": "auto"}, marks=pytest.mark.slow),
                                     pytest.param({"strategy": "fuse", "schedule": "direct"}, marks=pytest.mark.slow)])
def test_the_pass_walks_each_graph_a_fixed_number_of_times(fake_mesh, monkeypatch, options):
    small, rewritten_small = walks_per_graph(fake_mesh, monkeypatch, 1, **options)
    large, rewritten_large = walks_per_graph(fake_mesh, monkeypatch, 3, **options)
    if options.get("strategy") != "auto":  # auto on CPU may keep pairs sequential: then only the count matters
        assert rewritten_large > rewritten_small > 0
    assert small == large, f"whole-graph walks grow with the pairs: 1 layer {small}, 3 layers {large}"
    assert "copies" not in large, "the pass copies the graph"
    # dead code twice (each lints the graph), the normalizations, the fake mode, a sort, a lint, the code
    assert all(n <= 16 for n in large.values()), large


@pytest.mark.slow
def test_pairs_matched_again_cost_no_walk_of_the_graph(fake_mesh, monkeypatch, caplog):
    """torchtitan's Llama-3 with every layer checkpointed, every pair in 2 parts: in the backward
    graph a rewrite leaves a pair per layer touched (a weight permuted after the collective it now
    reads), so that pair is matched again on a graph put back in order.  Sorting only the stretches
    the rewrites left out of order costs no walk of the whole graph: the walks are the same at 1 and
    3 layers (sorting the whole graph before each match again walked it once per layer)."""
    pytest.importorskip("torchtitan")
    import logging

    import real_torchtitan as rt

    def explain(layers: int):
        torch._dynamo.reset()
        model = rt.build_llama3(WORLD, True, layers=layers, checkpoint=True)
        x = rt.tokens()
        with rt.spmd_context(model, x):
            return compass_fx.explain(model, x, chunks=2)

    walks = {}
    for layers in (1, 3):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="compass_fx"):
            walks[layers], rewritten = walks_of(monkeypatch, lambda: explain(layers))
        assert rewritten > 0
        again = caplog.text.count("matched again")
        assert again >= layers, f"{layers} layers: {again} pairs matched again (the test needs one a layer)"
    assert walks[1] == walks[3], f"whole-graph walks grow with the pairs matched again: {walks}"
