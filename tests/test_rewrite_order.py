"""Pairs are matched once per graph; a pair is matched again only where a rewrite before it touched
what its match looked at, and then the outcome is what matching the rewritten graph would give
(issue 26; before it the pass matched the whole graph again after every rewrite, and gave these
same reports and graph code).  Both graphs below have such pairs; each is rewritten with every pair
in 2 parts and replayed on every rank (LocalTensorMode) against the graph as traced.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import wild_check
from compass_fx.graph_pass import compass_pass
from compass_fx.lowering import Disorder, stable_toposort
from compass_fx.options import parse_options

WORLD, ROWS, D = 2, 4, 8
c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def _gather(x, group):
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, WORLD, group))


def chained(group):
    """A gathered tensor's matmul is itself reduce-scattered: rewriting the gather replaces the
    matmul the reduce-scatter's match found."""
    def fn(x, w):
        h = torch.mm(_gather(x, group), w)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(h, "sum", WORLD, group))
    return fn, (torch.randn(ROWS, D), torch.randn(D, D))


def shared_contraction(group):
    """Two gathered tensors meet in one weight-gradient matmul ``mm(t(g1), g2)``: both matches claim
    it; the first rewrite takes it and reads g2, which the second pair's match had counted."""
    def fn(x1, x2, w1, w2):
        g1, g2 = _gather(x1, group), _gather(x2, group)
        return torch.mm(g1, w1), torch.mm(g2, w2), torch.mm(g1.permute(1, 0), g2)
    return fn, (torch.randn(ROWS, D), torch.randn(ROWS, D), torch.randn(D, D), torch.randn(D, D))


@pytest.mark.parametrize("build,expected", [
    (chained, {"pairs": [("all_gather_matmul", "rewritten")], "skipped": ["not by a matmul"]}),
    (shared_contraction, {"pairs": [("all_gather_matmul", "rewritten"), ("all_gather_matmul", "rewritten")],
                          "skipped": []}),
])
def test_a_pair_touched_by_an_earlier_rewrite_is_matched_again(group, build, expected, caplog):
    fn, inputs = build(group)
    ref, gm = make_fx(fn, tracing_mode="fake")(*inputs), make_fx(fn, tracing_mode="fake")(*inputs)
    with caplog.at_level(logging.INFO, logger="compass_fx"):
        report = compass_pass(gm, "forward", parse_options({"chunks": 2}))
    assert "matched again" in caplog.text
    assert [(p.kind, p.status) for p in report.pairs] == expected["pairs"], report.pairs
    assert len(report.skipped) == len(expected["skipped"])
    assert all(why in s.reason for s, why in zip(report.skipped, expected["skipped"])), report.skipped
    assert report.collectives_after - report.collectives_before == len(report.pairs)  # no original left
    per_rank = wild_check.local_inputs(ref, WORLD, seed=3)
    wild_check.assert_same_outputs(wild_check.replay(ref, per_rank, WORLD), wild_check.replay(gm, per_rank, WORLD))


def _disordered_graph(seed: int, repairs: list) -> fx.Graph:
    """A random graph (sums of earlier nodes) edited as rewrites edit one, out of order: new nodes
    placed before an anchor that read an operand defined after it, and earlier nodes rewired to read
    a new node placed after them; an unused new node erased now and then.  Each round of edits ends
    in ``Disorder.repair`` (recorded as the pass records them: whether a backward edge was recorded
    goes to ``repairs``), or, with ``repairs`` None (the reference copy), in ``stable_toposort``."""
    import operator
    import random

    rng = random.Random(seed)
    graph = fx.Graph()
    nodes = [graph.placeholder(f"x{i}") for i in range(3)]
    for _ in range(60):
        nodes.append(graph.call_function(operator.add, (rng.choice(nodes), rng.choice(nodes))))
    graph.output(nodes[-1])
    for _ in range(3):  # rounds of edits, each followed by a repair
        disorder = Disorder() if repairs is not None else None
        for _ in range(rng.randint(1, 4)):
            body = [n for n in graph.nodes if n.op == "call_function"]
            anchor = rng.choice(body[:-2])
            operand = rng.choice([n for n in body if n > anchor])
            with graph.inserting_before(anchor):
                new = graph.call_function(operator.mul, (rng.choice(nodes[:3]), operand))
            made = [new]
            ancestors = _ancestors(operand)
            readers = [n for n in body if n < new and n not in ancestors and n.args[0] is not operand]
            if readers and rng.random() < 0.6:  # an earlier node reads the new one (replacement)
                rng.choice(readers).update_arg(0, new)
            elif rng.random() < 0.3:  # a new node that ends up unused
                graph.erase_node(new)
                made = []
            if disorder is not None:
                disorder.note(made)
        if repairs is not None:
            repairs.append(bool(disorder))
            disorder.repair()
        else:
            stable_toposort(graph)
    return graph


def _ancestors(node: fx.Node) -> set:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


@pytest.mark.parametrize("seed", range(40))
def test_sorting_the_stretches_left_out_of_order_gives_the_order_of_a_whole_sort(seed):
    """What ``_Rewriter`` does before matching a pair again (``Disorder``: sort only the stretches
    that edits left out of order) gives the graph the very order that sorting all of it gives, after
    every round of edits; so the pass's output is what it was when it sorted the whole graph."""
    repairs: list = []
    repaired, reference = _disordered_graph(seed, repairs), _disordered_graph(seed, None)
    assert [n.name for n in repaired.nodes] == [n.name for n in reference.nodes]
    repaired.lint()  # every node after its inputs
    assert any(repairs), "no edit left the graph out of order: the test checks nothing"
