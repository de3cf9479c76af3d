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
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import wild_check
from compass_fx.graph_pass import compass_pass
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
