"""A model this project did not write: torchtitan 0.3.0's Llama-3 and its TP plan, on gloo ranks.

Compiled with backend="compass" (every pair forced to 2 parts) equals eager, forward and
backward, with and without sequence parallelism; the pairs found match a hand count of the
model's linears.  Needs torchtitan 0.3.0 (skipped without it): the README installs it with
``--no-deps`` and the test extra the two of its dependencies its model imports.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan")

pytestmark = pytest.mark.slow  # a real model traced and compiled on 2 and 4 ranks

LAYERS = 2


def hand_count(layers: int, sp: bool) -> dict[tuple[str, str], int]:
    """Pairs per (graph, kind), counted by hand from the model's linears.

    Per layer: wqkv (fused), wo, w1, w2, w3; then lm_head.  With SP the forward gathers before
    wqkv, before w1+w3 (one gather, two mms) and before lm_head, and reduce-scatters after wo and
    w2; the backward mirrors it (gathers of wo's and w2's output gradients, reduce-scatters of the
    input gradients of wqkv, of w1+w3 summed, and of lm_head).  The embedding's reduce-scatter
    (a masked lookup, no matmul) and the gather feeding its gradient are not pairs.  Without SP,
    wo and w2 all-reduce in the forward, and wqkv, w1+w3 and lm_head's input gradients in the backward.
    """
    if sp:
        return {("forward", "all_gather_matmul"): 2 * layers + 1,
                ("forward", "matmul_reduce_scatter"): 2 * layers,
                ("backward", "all_gather_matmul"): 2 * layers,
                ("backward", "matmul_reduce_scatter"): 2 * layers + 1}
    return {("forward", "matmul_all_reduce"): 2 * layers,
            ("backward", "matmul_all_reduce"): 2 * layers + 1}


def assert_step_equal(out: torch.Tensor, out_ref: torch.Tensor, model: torch.nn.Module,
                      eager: torch.nn.Module) -> None:
    """The compiled step's output and every weight gradient of ``model`` equal eager's (``eager``
    ran the same step), each gradient named where it differs."""
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def found(reports, model: torch.nn.Module) -> dict:
    """What the pass found in a compile's graph ``reports``: pairs per (graph, kind), their statuses,
    the forward pairs' matmuls, and the model's linears by name (for the hand count)."""
    import collections

    import real_torchtitan as rt

    pairs = [p for r in reports for p in r.pairs]
    return {"counts": dict(collections.Counter((p.graph, p.kind) for p in pairs)),
            "statuses": sorted({p.status for p in pairs}),
            "matmuls": sum(p.matmuls for p in pairs if p.graph == "forward"), "linears": rt.linear_count(model)}


def titan_compiled_vs_eager(rank: int, world: int, sp: bool, options: dict, checkpoint: bool = False,
                            layers: int = LAYERS) -> dict:
    import real_torchtitan as rt

    import compass_fx.backend

    torch._dynamo.reset()
    x = rt.tokens()
    eager = rt.build_llama3(world, sp, layers=layers, checkpoint=checkpoint)
    model = rt.build_llama3(world, sp, layers=layers, dims=eager.compass_dims, checkpoint=checkpoint)
    with rt.spmd_context(eager, x):
        out_ref = eager(x)
        (out_ref.float() ** 2).mean().backward()
    before = len(compass_fx.backend.history)
    with rt.spmd_context(model, x):
        out = torch.compile(model, backend="compass", options=options, fullgraph=True)(x)
        (out.float() ** 2).mean().backward()
    assert_step_equal(out, out_ref, model, eager)
    return found(list(compass_fx.backend.history)[before:], model)


# The option sets the one-layer tests below check with the eager inner compiler, and which of them
# each (world, SP) is checked with: the sets of one (world, SP) are compiled from one trace
# (titan_variants_vs_eager), once per session, and each test reads its own set's result.
EAGER_SETS = {"k2": {"chunks": 2, "inner": "eager"},
              "fuse": {"strategy": "fuse", "schedule": "direct", "inner": "eager", "fused_async": False},
              "fuse-async": {"strategy": "fuse", "schedule": "direct", "inner": "eager", "fused_async": True}}
ONE_LAYER_SETS = {(2, True): ("fuse", "fuse-async"), (2, False): ("k2", "fuse"), (4, True): ("k2", "fuse"),
                  (4, False): ("k2",)}


def one_layer_results(ranks, tmp_path_factory, world: int, sp: bool, name: str) -> list[dict]:
    """Every rank's result of option set ``name`` (:data:`EAGER_SETS`) on the one-layer model at
    ``world`` ranks, ``sp`` or not: its (world, SP)'s sets run on the first ask (session_cache)."""
    from session_cache import computed_once

    names = ONE_LAYER_SETS[(world, sp)]
    assert name in names, f"{name} is not among the sets of world {world}, SP {sp}: add it to ONE_LAYER_SETS"

    def run_sets() -> list[list[dict]]:  # kept as JSON: the counts' (graph, kind) keys as lists
        group = ranks(world).run(titan_variants_vs_eager, world, sp, [EAGER_SETS[n] for n in names], 1)
        return [[dict(r, counts=[[*key, n] for key, n in r["counts"].items()]) if "counts" in r else r
                 for r in rank_results] for rank_results in group]

    group = computed_once(tmp_path_factory, f"titan-one-layer-{world}-{sp}", run_sets)
    results = [rank_results[names.index(name)] for rank_results in group]
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, f"{name}: {errors[0]}"
    return [dict(r, counts={(graph, kind): n for graph, kind, n in r["counts"]}) for r in results]


# Two layers once (the pairs repeat per layer, the hand count says how), through torch.compile with
# backend="compass" as a user compiles; one layer for the rest: the same pair shapes at half the tracing.
@pytest.mark.parametrize("world,sp,layers", [(2, True, LAYERS), (2, False, 1), (4, True, 1), (4, False, 1)])
def test_torchtitan_llama3_matches_eager_and_hand_count(ranks, tmp_path_factory, world, sp, layers):
    if layers == 1:
        results = one_layer_results(ranks, tmp_path_factory, world, sp, "k2")
    else:
        results = ranks(world).run(titan_compiled_vs_eager, world, sp, EAGER_SETS["k2"], False, layers)
    res = results[0]
    assert all(r["counts"] == res["counts"] for r in results), "ranks found different pairs"
    assert res["counts"] == hand_count(layers, sp)
    assert res["statuses"] == ["rewritten"]
    assert res["linears"] == {"wqkv": layers, "wo": layers, "w1": layers, "w2": layers, "w3": layers,
                              "lm_head": 1}
    if sp:  # every linear of the forward sits in exactly one pair
        assert res["matmuls"] == sum(res["linears"].values())


def titan_variants_vs_eager(rank: int, world: int, sp: bool, option_sets: list[dict], layers: int) -> list[dict]:
    """``titan_compiled_vs_eager`` for several option sets compiled from one Dynamo and AOTAutograd
    trace (:mod:`shared_trace`): per set, what its pass found (:func:`found`), or the error of its
    compile or its comparison with eager."""
    import traceback

    import real_torchtitan as rt
    from shared_trace import Variants

    torch._dynamo.reset()
    x = rt.tokens()
    eager = rt.build_llama3(world, sp, layers=layers)
    model = rt.build_llama3(world, sp, layers=layers, dims=eager.compass_dims)
    with rt.spmd_context(eager, x):
        out_ref = eager(x)
        (out_ref.float() ** 2).mean().backward()
    variants = Variants(option_sets)
    compiled = torch.compile(model, backend=variants, fullgraph=True)
    results = []
    for i in range(len(option_sets)):
        variants.select(i)
        model.zero_grad(set_to_none=True)
        try:
            with rt.spmd_context(model, x):
                out = compiled(x)
                (out.float() ** 2).mean().backward()
            assert_step_equal(out, out_ref, model, eager)
        except Exception:  # noqa: BLE001 - the set's own assertion reports it
            results.append({"error": traceback.format_exc()[-3000:]})
            continue
        results.append(found(variants.reports[i], model))
    assert variants.traces == 1, f"{variants.traces} graphs traced: the model broke its graph"
    return results


@pytest.mark.inductor
def test_torchtitan_llama3_under_inductor(ranks):
    """Both rewrites under Inductor (every pair in 2 parts; every pair fused, direct), compiled from
    one trace.  One layer: Inductor's compile on the CPU is what costs here, and a second layer adds
    pairs the eager-inner tests above already check, not new graph shapes."""
    option_sets = [{"chunks": 2}, {"strategy": "fuse", "schedule": "direct"}]
    results = ranks(2).run(titan_variants_vs_eager, 2, True, option_sets, 1)
    for options, res in zip(option_sets, results[0]):
        assert "error" not in res, f"{options}: {res['error']}"
        assert res["counts"] == hand_count(1, True), options
        assert res["statuses"] == ["rewritten"], options
    assert results[1] == results[0], "ranks found different pairs"


def test_torchtitan_llama3_with_activation_checkpointing(ranks):
    """Every block wrapped in checkpoint_wrapper: the backward graph recomputes the forward's
    collectives; those recomputed pairs are found and rewritten too, and the result equals eager."""
    results = ranks(2).run(titan_compiled_vs_eager, 2, True, EAGER_SETS["k2"], True)
    counts = results[0]["counts"]
    plain = hand_count(LAYERS, True)
    assert results[1]["counts"] == counts
    assert {k: v for k, v in counts.items() if k[0] == "forward"} == \
        {k: v for k, v in plain.items() if k[0] == "forward"}
    # Recomputation per layer: the gathers before wqkv and before w1/w3 come back, and so does
    # the reduce-scatter after wo (ffn_norm needs its output); measured: 8 and 8 with 2 layers.
    assert counts[("backward", "all_gather_matmul")] == plain[("backward", "all_gather_matmul")] + 2 * LAYERS
    assert counts[("backward", "matmul_reduce_scatter")] > plain[("backward", "matmul_reduce_scatter")]
    assert results[0]["statuses"] == ["rewritten"]


def titan_explain(rank: int, world: int, sp: bool) -> dict:
    import real_torchtitan as rt

    import compass_fx

    torch._dynamo.reset()
    x = rt.tokens()
    model = rt.build_llama3(world, sp, layers=LAYERS)
    with rt.spmd_context(model, x):
        report = compass_fx.explain(model, x, strategy="off")
    kinds = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
    counts = {(g, k): report.count(k, g) for g in ("forward", "backward") for k in kinds}
    return {"counts": {key: n for key, n in counts.items() if n}, "text": str(report),
            "every_pair": report.format(every_pair=True), "pairs": len(report.pairs),
            "left_alone": sorted(s.reason for s in report.skipped)}


def titan_deferred(rank: int, world: int, sp: bool) -> dict:
    """torchtitan's Llama-3 under fused_async: which reductions ``fuse.would_defer`` said would be
    deferred (read before any rewrite: what the cost model priced) and which the rewrite deferred."""
    import real_torchtitan as rt

    import compass_fx
    import compass_fx.lowering.fuse as fuse

    torch._dynamo.reset()
    x = rt.tokens()
    model = rt.build_llama3(world, sp, layers=LAYERS)
    predicted, would_defer = [], fuse.would_defer

    def recorded(pair):
        predicted.append([pair.graph_name, would_defer(pair)])
        return predicted[-1][1]

    fuse.would_defer = recorded
    try:
        with rt.spmd_context(model, x):
            report = compass_fx.explain(model, x, strategy="fuse", schedule="direct", fused_async=True)
    finally:
        fuse.would_defer = would_defer
    return {"predicted": predicted, "deferred": [[p.graph, p.asynchronous] for p in report.pairs
                                                 if p.kind != "all_gather_matmul" and p.status == "rewritten"]}


@pytest.mark.parametrize("sp", [True, False])
def test_torchtitan_fused_async_defers_what_the_cost_model_priced_deferred(ranks, sp):
    """The reductions the cost model prices as deferred (``fuse.would_defer``) are exactly those the
    rewrite leaves deferred in torchtitan's graphs: the backward's, with a weight gradient between
    them and their first use (with SP, AOTAutograd puts that gradient before the reduce-scatter and
    the weight's transposes just before the matmul: those views move up with the call, so it starts
    before the gradient); the forward's, read at once, are plain calls."""
    res = ranks(2).run(titan_deferred, 2, sp)[0]
    assert res["predicted"] == res["deferred"] and res["deferred"], res
    assert {tuple(d) for d in res["deferred"]} == {("forward", False), ("backward", True)}, res


def test_explain_lists_every_pair_of_torchtitan_llama3(ranks):
    res = ranks(2).run(titan_explain, 2, True)[0]
    assert res["counts"] == hand_count(LAYERS, True)
    assert res["every_pair"].count("all_gather_matmul") >= 4 * LAYERS + 1
    # by default the layers' pairs alike share a row, whose counts add up to every pair
    rows = [line.split() for line in res["text"].splitlines() if line.split()[:1] in (["forward"], ["backward"])]
    assert sum(int(r[1]) for r in rows) == res["pairs"] and len(rows) < res["pairs"], res["text"]
    assert res["text"].startswith(f"{res['pairs']} pairs in {len(rows)} rows")
    # The embedding's reduce-scatter (masked lookup) and its gradient's gather are the only others.
    assert len(res["left_alone"]) == 2 and any("not by a matmul" in r for r in res["left_alone"])


@pytest.mark.parametrize("world,sp,deferred", [(2, True, False), (4, True, False), (2, False, False), (2, True, True)])
def test_torchtitan_llama3_through_the_fused_operators_matches_eager(ranks, tmp_path_factory, world, sp, deferred):
    """Every pair of torchtitan's Llama-3 through the fused operators (the CPU reference: the same
    rows, blocks and orders as the CUDA path) equals eager, forward and backward: with SP its
    reduce-scatters scatter the sum permuted (Shard(1): dims 0 and 1 swapped around the collective),
    which the fused call's output takes as a permute of its rows; and with ``fused_async`` (the
    backward's reduce-scatters started before the weight gradients, the weight's views moved up)."""
    results = one_layer_results(ranks, tmp_path_factory, world, sp, "fuse-async" if deferred else "fuse")
    assert all(r["counts"] == results[0]["counts"] for r in results), "ranks found different pairs"
    assert results[0]["counts"] == hand_count(1, sp)
    assert results[0]["statuses"] == ["rewritten"], results[0]
