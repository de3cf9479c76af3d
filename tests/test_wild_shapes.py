"""Graph shapes seen in the wild (issue 5): each one rewritten correctly or left alone with a reason.

Structure and numerics of every rewritten graph are checked in one process (fake process group,
graphs replayed with LocalTensorMode on the same per-rank inputs); the same models then run on
real gloo ranks, compiled against eager, forward and backward.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import fuzz_graphs
import wild_check
import wild_models
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 2

# (graph, kind, matmuls) of every pair found, per model; all of them rewritten under chunks=2.
EXPECTED = {
    "einsum_bmm": [("forward", "all_gather_matmul", 1), ("forward", "matmul_reduce_scatter", 1),
                   ("backward", "all_gather_matmul", 1)],
    "reshape_chain": [("forward", "all_gather_matmul", 1), ("forward", "matmul_reduce_scatter", 1),
                      ("backward", "all_gather_matmul", 2)],
    "dtype_casts": [("forward", "all_gather_matmul", 1), ("forward", "matmul_reduce_scatter", 1),
                    ("backward", "all_gather_matmul", 2)],
    "shared_uses": [("forward", "all_gather_matmul", 2), ("forward", "matmul_all_reduce", 1)],
    # The backward recomputes the checkpointed block: its gather feeds w1 again (and w1's weight
    # gradient), the gradient's gather feeds w2's input and weight gradients.
    "checkpointed": [("forward", "all_gather_matmul", 1), ("forward", "matmul_reduce_scatter", 1),
                     ("backward", "all_gather_matmul", 2), ("backward", "all_gather_matmul", 2)],
    "unmatched": [],
}
# Collectives left alone, by (graph, reason fragment).
LEFT_ALONE = {
    "shared_uses": [("backward", "produced by tangents")],
    "unmatched": [("forward", "reduce op 'max'"), ("forward", "gathers the last dim"),
                  ("forward", "not a row broadcast"), ("backward", "feeds no matmul")],
}


@pytest.fixture(scope="module")
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("name", list(wild_models.WILD))
def test_wild_shape_rewritten_or_left_with_reason(fake_group, name, caplog):
    model, x = wild_models.build(name, fake_group), wild_models.shard_input(name, 0)
    ref = wild_check.capture(model, (x,), {"strategy": "off"})
    with caplog.at_level(logging.INFO, logger="compass_fx"):
        got = wild_check.capture(model, (x,), {"chunks": 2})
    pairs = [p for r in got.reports for p in r.pairs]
    assert [(p.graph, p.kind, p.matmuls) for p in pairs] == EXPECTED[name]
    assert all(p.status == "rewritten" and p.parts == 2 for p in pairs)
    skipped = [s for r in got.reports for s in r.skipped]
    assert len(skipped) == len(LEFT_ALONE.get(name, []))
    for graph, why in LEFT_ALONE.get(name, []):
        assert any(s.graph == graph and why in s.reason for s in skipped), (graph, why, skipped)
        assert why in caplog.text, "a collective left alone must be logged with its reason"
    for r in got.reports:  # each rewritten pair adds one collective per extra part
        assert r.collectives_after - r.collectives_before == sum(p.status == "rewritten" for p in r.pairs)
    wild_check.compare_captures(ref, got, WORLD)


def test_replay_check_catches_a_wrong_rewrite(fake_group, monkeypatch):
    """The numerics check above can fail: a rewrite that swaps two row blocks is caught."""
    import compass_fx.lowering.decompose as dec

    real = dec.matmul_into_rows  # where the parts' products go into the result's rows
    monkeypatch.setattr(dec, "matmul_into_rows", lambda b, buf, rows, weight, layout, parts, i:
                        real(b, buf, rows, weight, layout, parts, parts - 1 - i))
    model, x = wild_models.build("reshape_chain", fake_group), wild_models.shard_input("reshape_chain", 0)
    ref = wild_check.capture(model, (x,), {"strategy": "off"})
    got = wild_check.capture(model, (x,), {"chunks": 2})
    with pytest.raises(AssertionError):
        wild_check.compare_captures(ref, got, WORLD)


FUSED = {"einsum_bmm": 0, "reshape_chain": 3, "dtype_casts": 0, "shared_uses": 1, "checkpointed": 4, "unmatched": 0}


@pytest.mark.parametrize("fused_async", [False, True])
@pytest.mark.parametrize("name", list(wild_models.WILD))
def test_wild_shape_through_the_fused_operators(fake_group, name, fused_async):
    """strategy=fuse: each pair becomes a call of a fused operator or keeps its form with the
    reason the operators refuse it; the graphs, their calls replayed as what they compute, match."""
    model, x = wild_models.build(name, fake_group), wild_models.shard_input(name, 0)
    ref = wild_check.capture(model, (x,), {"strategy": "off"})
    got = wild_check.capture(model, (x,), {"strategy": "fuse", "fused_async": fused_async})
    pairs = [p for r in got.reports for p in r.pairs]
    assert sum(p.status == "rewritten" for p in pairs) == FUSED[name]
    assert all(p.status == "rewritten" or "fused operators" in p.reason or "fused GEMM" in p.reason for p in pairs)
    assert sum(wild_check.fused_calls_as_collectives(gm) for gm in got.graphs.values()) == FUSED[name]
    wild_check.compare_captures(ref, got, WORLD)


def _round(gather: dict, reduce: dict) -> dict:
    """One round of ``fuzz_graphs.specs``: a gather into a matmul, a matmul into a reduction."""
    return {"gather": {"dim": 0, "style": "fc", "cast": None, "form": "view2d", "consumers": [False],
                       "extra_use": False, "contraction": False, "hidden": 8, "hostile": None, **gather},
            "reduce": {"kind": "rs", "dim": 0, "terms": 1, "bias": False, "cast": None, "escape": False,
                       "style": "fc", "form": "mm", "hostile": None, **reduce},
            "noise": False}


@pytest.mark.parametrize("kind", ["rs", "ar"])
def test_a_bias_added_to_a_reduced_3d_matmul_keeps_the_pair_off_the_fused_operators(fake_group, kind):
    """``matmul(h, w) + b`` reduced: each rank's b is summed with the products, which one fused GEMM
    without a bias cannot give.  (The fused rewrite dropped the bias, found by the fuzzer.)"""
    spec = {"world": WORLD, "batch": 1, "local": 2, "dim": 8,
            "rounds": [_round({"form": "matmul3d"}, {"kind": kind, "bias": True, "form": "matmul3d"})]}
    res = fuzz_graphs.check_fused(spec, fake_group.group_name, "ring", False)  # the replays agree
    assert res["kinds"] == ["all_gather_matmul"]
    assert res["refused"] == ["a bias added inside the reduction differs per rank; the fused GEMM has no bias"]
    assert fuzz_graphs.check(spec, fake_group.group_name, 0)["rewritten"] == 2  # decomposed, the bias in each part


def test_replay_of_fused_calls_catches_a_wrong_lowering(fake_group, monkeypatch):
    """The check above can fail: a gather on dim 1 whose rows the lowering leaves rank-major is caught."""
    import compass_fx.lowering.fuse as fuse

    spec = {"world": WORLD, "batch": 2, "local": 2, "dim": 8, "rounds": [_round({"dim": 1}, {"kind": "ar"})]}
    assert fuzz_graphs.check_fused(spec, fake_group.group_name, "direct", False)["kinds"] == [
        "all_gather_matmul", "matmul_all_reduce"]
    monkeypatch.setattr(fuse, "_rank_major_to_logical", lambda b, t2d, pair: t2d)
    with pytest.raises(AssertionError, match="not close"):
        fuzz_graphs.check_fused(spec, fake_group.group_name, "direct", False)


# ------------------------------------------------------------------------------- real gloo ranks

def compiled_vs_eager(rank: int, name: str, options: dict) -> list[tuple]:
    import compass_fx.backend

    torch._dynamo.reset()
    group = dist.group.WORLD
    x = wild_models.shard_input(name, rank)
    eager = wild_models.build(name, group)
    out_ref = eager(x)
    (out_ref.float() ** 2).sum().backward()
    model = wild_models.build(name, group)
    before = len(compass_fx.backend.history)
    out = torch.compile(model, backend="compass", options=options, fullgraph=True)(x)
    (out.float() ** 2).sum().backward()
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    reports = list(compass_fx.backend.history)[before:]
    return [(p.graph, p.kind, p.status) for r in reports for p in r.pairs]


@pytest.mark.parametrize("name", list(wild_models.WILD))
def test_wild_shape_on_gloo_matches_eager(ranks, name):
    results = ranks(WORLD).run(compiled_vs_eager, name, {"chunks": 2, "inner": "eager"})
    assert results[0] == results[1], "ranks rewrote different pairs"
    assert [(g, k) for g, k, _ in results[0]] == [(g, k) for g, k, _ in EXPECTED[name]]
    assert all(s == "rewritten" for *_, s in results[0])


@pytest.mark.parametrize("name", [n for n, fused in FUSED.items() if fused])
def test_wild_shape_through_the_fused_operators_on_gloo(ranks, name):
    """The fused calls run for real (their CPU path: the schedule's point-to-point messages)."""
    results = ranks(WORLD).run(compiled_vs_eager, name, {"strategy": "fuse", "inner": "eager"})
    assert results[0] == results[1], "ranks rewrote different pairs"
    assert sum(s == "rewritten" for *_, s in results[0]) == FUSED[name]


@pytest.mark.inductor
def test_wild_shapes_under_inductor(ranks):
    for name in ("einsum_bmm", "dtype_casts", "shared_uses"):
        results = ranks(WORLD).run(compiled_vs_eager, name, {"chunks": 2})
        assert results[0] and all(s == "rewritten" for *_, s in results[0])


def test_a_rewrite_that_fails_half_way_leaves_the_graph_as_it_was(fake_group, monkeypatch, caplog):
    import compass_fx.lowering.decompose as dec

    real = dec.matmul_into_rows

    def broken(b, buf, rows, weight, layout, parts, i):  # the first part is written, the second fails
        if i == 1:
            raise KeyError("injected failure")
        return real(b, buf, rows, weight, layout, parts, i)

    monkeypatch.setattr(dec, "matmul_into_rows", broken)
    model, x = wild_models.build("shared_uses", fake_group), wild_models.shard_input("shared_uses", 0)
    ref = wild_check.capture(model, (x,), {"strategy": "off"})
    with caplog.at_level(logging.WARNING, logger="compass_fx"):
        got = wild_check.capture(model, (x,), {"chunks": 2})
    gather = [p for r in got.reports for p in r.pairs if p.kind == "all_gather_matmul"]
    assert gather and all(p.status == "skipped" and "injected failure" in p.reason for p in gather)
    assert "graph left as it was" in caplog.text
    assert got.graphs["forward"].code.count("all_gather_into_tensor") == \
        ref.graphs["forward"].code.count("all_gather_into_tensor")
    wild_check.compare_captures(ref, got, WORLD)


def test_a_gather_lowered_as_one_call_is_priced_with_its_parts_replayed(fake_group, monkeypatch):
    """The decision prices an eager gather's extra parts as replayed from one CUDA graph exactly
    when the lowering makes its parts one ``compass::all_gather_mm_parts`` call (NCCL) and the parts
    replay is on: never for a reduce-scatter, nor on this fake group (not NCCL) as it is."""
    import compass_fx.lowering.decompose as dec
    from compass_fx.passes.find import find_pairs, kind_of

    model, x = wild_models.build("reshape_chain", fake_group), wild_models.shard_input("reshape_chain", 0)
    gm = wild_check.capture(model, (x,), {"strategy": "off"}, backward=False).graphs["forward"]
    pairs, _ = find_pairs(gm, "forward", None)
    gather = next(p for p in pairs if p.kind == "all_gather_matmul")
    scatter = next(p for p in pairs if p.kind == "matmul_reduce_scatter")
    def replayed(pair) -> bool:
        return kind_of(pair).parts_replayed(pair)

    assert not replayed(gather)  # the fake group's gathers are not one NCCL call
    monkeypatch.setattr(dec, "gathers_in_one_call", lambda pair: True)
    monkeypatch.delenv("COMPASS_PARTS_REPLAY", raising=False)
    assert replayed(gather) and not replayed(scatter)
    monkeypatch.setenv("COMPASS_PARTS_REPLAY", "0")
    assert not replayed(gather)
