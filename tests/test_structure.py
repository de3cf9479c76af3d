"""What the matcher finds and what the rewrite produces, traced on the fake process group."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import compass_fx
import tp_models
from compass_fx.demo import ModelArgs, Transformer, parallelize

WORLD = 4


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield init_device_mesh("cpu", (WORLD,))
    dist.destroy_process_group()


def demo(mesh, sp: bool, layers: int = 2):
    torch.manual_seed(0)
    torch._dynamo.reset()
    return parallelize(Transformer(ModelArgs(n_layers=layers)), mesh, sequence_parallel=sp)


TOKENS = torch.randint(0, 256, (2, 16))


@pytest.mark.parametrize("layers", [1, 2])
def test_sequence_parallel_pair_counts(mesh, layers):
    report = compass_fx.explain(demo(mesh, True, layers), TOKENS, strategy="off")
    # Per layer: one gather feeding q/k/v, one feeding w1/w3, reduce-scatters after wo and w2;
    # plus the final norm's gather into the output projection.  Backward mirrors it.
    assert report.count("all_gather_matmul", "forward") == 2 * layers + 1
    assert report.count("matmul_reduce_scatter", "forward") == 2 * layers
    assert report.count("all_gather_matmul", "backward") == 2 * layers
    assert report.count("matmul_reduce_scatter", "backward") == 2 * layers + 1
    assert report.count("matmul_all_reduce") == 0
    qkv = [p for p in report.pairs if p.graph == "forward" and p.kind == "all_gather_matmul"][0]
    assert qkv.dim == 1 and qkv.matmuls == 3 and qkv.status == "kept"
    # The embedding's reduce-scatter is not a matmul's: left alone, with the reason.
    assert any("index_put" in s.reason for s in report.skipped)


def test_plain_tp_pair_counts(mesh):
    report = compass_fx.explain(demo(mesh, False, 2), TOKENS, strategy="off")
    assert report.count("matmul_all_reduce", "forward") == 4           # wo, w2 per layer
    assert report.count("matmul_all_reduce", "backward") == 5          # q+k+v, w1+w3 per layer, output
    assert report.count("all_gather_matmul") == report.count("matmul_reduce_scatter") == 0
    summed = [p for p in report.pairs if p.graph == "backward" and p.matmuls == 3]
    assert summed, "the sum of the q/k/v input gradients was not matched as one pair"


@pytest.mark.parametrize("chunks", [2, 4])
def test_chunks_gives_k_collectives_per_pair(mesh, chunks):
    report = compass_fx.explain(demo(mesh, True, 1), TOKENS, chunks=chunks)
    for graph in report.graphs:
        rewritten = sum(p.status == "rewritten" for p in graph.pairs)
        assert rewritten == len(graph.pairs) > 0
        assert graph.collectives_after - graph.collectives_before == (chunks - 1) * rewritten
    assert {p.parts for p in report.pairs} == {chunks}


def test_indivisible_chunks_are_skipped_not_wrong(mesh, caplog):
    # 16 tokens over 4 ranks: 4 local rows, which 3 does not divide.
    with caplog.at_level(logging.INFO, logger="compass_fx"):
        report = compass_fx.explain(demo(mesh, True, 1), TOKENS, chunks=3)
    assert report.pairs and all(p.status == "skipped" for p in report.pairs)
    assert all("does not divide" in p.reason for p in report.pairs)
    assert all(g.collectives_after == g.collectives_before for g in report.graphs)
    assert "does not divide" in caplog.text


def test_report_renders_table_and_json(mesh):
    import json

    report = compass_fx.explain(demo(mesh, True, 1), TOKENS, chunks=2)
    text = str(report)
    assert "all_gather_matmul" in text and "decompose(d=2)" in text and "rewritten" in text
    data = json.loads(report.to_json())
    assert data["options"]["chunks"] == 2
    assert sum(len(g["pairs"]) for g in data["graphs"]) == len(report.pairs)


class TwoGroupModel(torch.nn.Module):
    """A TP MLP whose output is then all-reduced over the data-parallel group too."""

    def __init__(self, mesh2d) -> None:
        super().__init__()
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.dp_group = mesh2d["dp"].get_group()
        self.mlp = parallelize_module(tp_models.MLP(bias=False), mesh2d["tp"],
                                      {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        self.head = torch.nn.Linear(tp_models.DIM, tp_models.DIM, bias=False)

    def forward(self, x):
        from torch.distributed._functional_collectives import all_reduce

        y = self.head(self.mlp(x))  # head: a plain mm, reduced over DP below
        return all_reduce(y, "sum", self.dp_group)


def test_only_the_chosen_group_is_touched(mesh):
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_name = mesh2d["tp"].get_group().group_name
    torch._dynamo.reset()
    model = TwoGroupModel(mesh2d)
    x = torch.randn(8, tp_models.DIM)
    everything = compass_fx.explain(model, x, strategy="decompose")
    assert {p.group for p in everything.pairs} == {tp_name, mesh2d["dp"].get_group().group_name}
    torch._dynamo.reset()
    tp_only = compass_fx.explain(model, x, strategy="decompose", group=mesh2d["tp"])
    assert {p.group for p in tp_only.pairs} == {tp_name}
    assert all(p.status == "rewritten" for p in tp_only.pairs)
    assert any("not the optimised group" in s.reason for s in tp_only.skipped)


def test_each_graph_is_matched_once_whether_its_pairs_are_kept_or_rewritten(mesh, monkeypatch):
    """The pairs are found once per graph: a rewrite leaves the pairs after it valid (they are
    rewritten without matching the graph again), so rewriting every pair costs no extra match."""
    import compass_fx.graph_pass as graph_pass

    calls = []
    real = graph_pass.find_pairs
    monkeypatch.setattr(graph_pass, "find_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    kept = compass_fx.explain(demo(mesh, True, 2), TOKENS, strategy="off")
    assert len(kept.pairs) > 2 * len(kept.graphs) and len(calls) == len(kept.graphs)  # one match per graph
    calls.clear()
    rewritten = compass_fx.explain(demo(mesh, True, 2), TOKENS, chunks=2)
    n = sum(p.status == "rewritten" for p in rewritten.pairs)
    assert n == len(kept.pairs) and len(calls) == len(rewritten.graphs)
    assert [(p.graph, p.kind, p.m, p.n, p.k) for p in rewritten.pairs] == \
        [(p.graph, p.kind, p.m, p.n, p.k) for p in kept.pairs]  # the same pairs, in the same order


def test_a_failed_rewrite_restores_the_graph_and_the_next_pairs_still_rewrite(mesh, monkeypatch):
    """A decomposition that fails half-way has the nodes it added erased (the graph is as it was);
    the pairs after it are rewritten as usual."""
    import compass_fx.lowering.decompose as dec

    real, failed = dec.all_gather, []

    def first_fails(b, pair, parts):
        if not failed:
            failed.append(pair.describe())
            real(b, pair, parts)  # half-way there...
            raise RuntimeError("injected failure after the rewrite")
        return real(b, pair, parts)

    monkeypatch.setattr(dec, "all_gather", first_fails)
    report = compass_fx.explain(demo(mesh, True, 1), TOKENS, chunks=2)
    statuses = [p.status for p in report.pairs]
    assert statuses[0] == "skipped" and "injected failure" in report.pairs[0].reason
    assert statuses[1:] and all(s == "rewritten" for s in statuses[1:]), statuses
    first = report.graphs[0]
    assert first.collectives_after - first.collectives_before == sum(s == "rewritten" for s in
                                                                     (p.status for p in first.pairs))


def test_a_fused_rewrite_that_fails_half_way_is_undone_by_the_same_transaction(mesh, monkeypatch):
    """lowering.rewrite is one transaction for both rewrites: a fused call whose build fails after
    creating nodes leaves the graph as it was, and the other pairs are still rewritten."""
    import compass_fx.lowering.fuse as fuse

    real, failed = fuse._all_gather, []

    def first_fails(b, pair, schedule, asynchronous):
        out = real(b, pair, schedule, asynchronous)  # nodes created...
        if not failed:
            failed.append(pair.describe())
            raise RuntimeError("injected failure in the fused build")
        return out

    monkeypatch.setattr(fuse, "_all_gather", first_fails)
    report = compass_fx.explain(demo(mesh, True, 1), TOKENS, strategy="fuse", schedule="direct")
    gathers = [p for p in report.pairs if p.kind == "all_gather_matmul"]
    assert gathers[0].status == "skipped" and "injected failure" in gathers[0].reason
    assert all(p.status == "rewritten" for p in report.pairs if p is not gathers[0]), \
        [(p.kind, p.status, p.reason) for p in report.pairs]
    first = report.graphs[0]
    assert first.collectives_before - first.collectives_after == sum(p.status == "rewritten" for p in first.pairs)


def test_forced_fused_rings_run_direct_without_peer_access(mesh):
    """Without peer access the pieces meet in host memory, one hop from every peer: a forced ring
    runs (and is reported) as "direct", with the reason; with peer links it stays a ring."""
    staged = compass_fx.explain(demo(mesh, True, 1), TOKENS, strategy="fuse", schedule="ring",
                                topology="h200-host-staged-8")
    assert staged.pairs and all(p.schedule == "direct" and "run as direct" in p.reason for p in staged.pairs)
    linked = compass_fx.explain(demo(mesh, True, 1), TOKENS, strategy="fuse", schedule="ring",
                                topology="h200-nvswitch-8")
    assert all(p.schedule == "ring" for p in linked.pairs)


def test_asynchronous_fused_calls_are_reported_and_survive_a_failed_move(mesh, monkeypatch, caplog):
    """fused_async marks the fused reductions (not the gathers) asynchronous in the report where
    something runs between the call and its first use (the backward's weight gradients); a forward
    reduction, read at once, stays a plain call and its reason says why.  If moving a start or its
    wait fails, the call stays where the rewrite put it, the graph stays valid and the reason is
    logged."""
    import compass_fx.lowering.fuse as fuse

    options = dict(strategy="fuse", schedule="direct", fused_async=True)
    report = compass_fx.explain(demo(mesh, True, 1), TOKENS, **options)
    rewritten = [p for p in report.pairs if p.status == "rewritten"]
    reductions = [p for p in rewritten if p.kind != "all_gather_matmul"]
    assert rewritten and not any(p.asynchronous for p in rewritten if p.kind == "all_gather_matmul")
    assert {p.graph for p in reductions} == {"forward", "backward"}
    assert all(p.asynchronous == (p.graph == "backward") for p in reductions), [(p.graph, p.reason) for p in reductions]
    assert all("a plain call, not deferred" in p.reason for p in reductions if p.graph == "forward")
    assert "async" in str(report)

    def fails(graph, created):
        raise RuntimeError("injected failure while moving")

    monkeypatch.setattr(fuse, "_spread", fails)
    with caplog.at_level(logging.WARNING, logger="compass_fx"):
        report = compass_fx.explain(demo(mesh, False, 1), TOKENS, **options)
    assert all(p.status == "rewritten" for p in report.pairs if p.kind == "matmul_all_reduce" and "bias" not in p.reason)
    assert "left where it was" in caplog.text and "injected failure" in caplog.text


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_cost_model_knows_which_fused_calls_fused_async_defers(mesh, monkeypatch, sequence_parallel):
    """``fuse.would_defer``, read off each reduction before any rewrite (the cost model prices a
    deferred call's host as replayed on a stream of its own), says what the rewrite then does: deferred
    exactly where the report has the call asynchronous (the backward's, with weight gradients to
    overlap), plain where its result is read at once (the forward's)."""
    import compass_fx.lowering.fuse as fuse

    predicted = []
    would_defer = fuse.would_defer

    def recorded(pair):
        predicted.append((pair.graph_name, would_defer(pair)))
        return predicted[-1][1]

    monkeypatch.setattr(fuse, "would_defer", recorded)
    report = compass_fx.explain(demo(mesh, sequence_parallel, 2), TOKENS, strategy="fuse", schedule="direct",
                                fused_async=True)
    done = [(p.graph, p.asynchronous) for p in report.pairs if p.kind != "all_gather_matmul" and p.status == "rewritten"]
    assert len(done) == len(predicted) > 0 and predicted == done, (predicted, done)
    assert {d for _, d in predicted} == {True, False}

