"""Compiled with the compass backend equals eager, forward and backward, on real gloo ranks.

Each model is traced once per world size and inner compiler, and every option set the tests check
on it is compiled from that trace (:mod:`shared_trace`): Dynamo and AOTAutograd, the same for all
of them, were most of each test's time.  A test reads its own set's result; the first test of a trace to
run computes every set's, once per session (:mod:`session_cache`).  The end-to-end path,
``torch.compile(model, backend="compass", options=...)``, is what test_backend, test_real_models
and the wild tests compile."""
from __future__ import annotations

import pytest
import torch

def run_variants(rank: int, world: int, model_name: str, named_options: list[tuple[str, dict]]) -> dict:
    """Eager forward and backward once, then the compiled model with each option set (one Dynamo
    and AOTAutograd trace shared by all, :mod:`shared_trace`), each compared with eager; per set
    what was rewritten, or the error that stopped it."""
    import re
    import traceback
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tp_models
    from shared_trace import Variants

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    x = tp_models.example_input(model_name, rank, world)

    eager = tp_models.build(model_name, mesh)
    loss_ref = tp_models.loss_of(eager(x))
    loss_ref.backward()
    ref_grads = tp_models.local_grads(eager)

    model = tp_models.build(model_name, mesh)
    variants = Variants([options for _, options in named_options])
    compiled = torch.compile(model, backend=variants, fullgraph=True)
    results = {}
    for i, (name, options) in enumerate(named_options):
        variants.select(i)
        for p in model.parameters():
            p.grad = None
        try:
            loss = tp_models.loss_of(compiled(x))
            loss.backward()
            torch.testing.assert_close(loss, loss_ref, rtol=1e-4, atol=1e-5)
            grads = tp_models.local_grads(model)
            assert ref_grads.keys() == grads.keys()
            for key in ref_grads:
                assert grads[key] is not None, f"no gradient for {key}"
                torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-4, atol=1e-5,
                                           msg=lambda m, key=key: f"{key}: {m}")
        except Exception:  # noqa: BLE001 - reported by the set's own test
            results[name] = {"error": traceback.format_exc()}
            dist.barrier()
            continue
        reports = variants.reports[i]
        rewritten = [p for r in reports for p in r.pairs if p.status == "rewritten"]
        res = {
            "graphs": sorted(r.graph for r in reports),
            "rewritten": len(rewritten),
            "pairs": sum(len(r.pairs) for r in reports),
            "parts": sorted({p.parts for p in rewritten}),
            "not_rewritten": [p.reason for r in reports for p in r.pairs if p.status != "rewritten"],
            "async": [p.asynchronous for p in rewritten],
        }
        if options.get("inner", "inductor") == "inductor":
            res["wrapper_calls"] = _fused_calls(variants.modules[i])
        if options.get("dump_dir"):  # where each start, weight-gradient mm and wait sits in the backward
            dumped = sorted(Path(options["dump_dir"]).glob(f"rank{rank}_*_backward_after.py"))
            code = dumped[-1].read_text().splitlines()
            res["lines"] = {what: [j for j, line in enumerate(code) if re.search(pattern, line)]
                            for what, pattern in (("start", r"compass\.matmul_\w+_start"), ("wait", r"wait_tensor"),
                                                  ("mm", r"aten\.mm\.default"))}
            forward = sorted(Path(options["dump_dir"]).glob(f"rank{rank}_*_forward_after.py"))[-1].read_text()
            res["forward_reductions"] = {  # read at once there: nothing to overlap, so plain calls
                "start": len(re.findall(r"compass\.matmul_\w+_start", forward)),
                "plain": len(re.findall(r"compass\.matmul_(?:reduce_scatter|all_reduce)\.graph", forward)),
                "rewritten": sum(p.kind != "all_gather_matmul" for r in reports if r.graph == "forward"
                                 for p in r.pairs if p.status == "rewritten")}
        results[name] = res
        dist.barrier()
    assert variants.traces == 1, f"{variants.traces} graphs traced: the model broke its graph"
    return results


def _fused_calls(modules) -> list[dict]:
    """How Inductor's Python wrappers (``modules``) call the fused operators: per call the overload,
    its positional arguments, its keywords and, where the weights are a list literal, their count."""
    import ast

    calls = []
    for module in modules:
        with open(module.__file__) as f:
            for line in f:
                if "torch.ops.compass." not in line or line.lstrip().startswith("#"):
                    continue
                statement = ast.parse(line.strip()).body[0]
                call = getattr(statement, "value", None)
                if not isinstance(call, ast.Call) or not ast.unparse(call.func).startswith("torch.ops.compass."):
                    continue
                weights = call.args[1] if len(call.args) > 1 else None
                calls.append({"op": ast.unparse(call.func), "positional": len(call.args),
                              "keywords": [k.arg for k in call.keywords],
                              "weights": len(weights.elts) if isinstance(weights, ast.List) else None})
    return calls


CASES = [
    ("tp_mlp", "matmul_all_reduce"),
    ("sp0_mlp", "sp dim 0"),
    ("sp0_mlp_bias", "sp dim 0 with bias"),
    ("sp1_llama", "sp dim 1, Llama block"),
]


ASYNC = {"strategy": "fuse", "schedule": "direct", "fused_async": True}
ASYNC_CASES = {(2, "tp_mlp"), (2, "sp0_mlp"), (2, "sp1_llama"), (4, "tp_mlp"), (4, "sp1_llama")}


def _option_sets(world: int, model_name: str, inner: str, dump_dir: str) -> list[tuple[str, dict]]:
    """Every option set the tests below check on one model at one world size with one inner
    compiler: they share a trace (:func:`run_variants`)."""
    if model_name == "sp1_llama_b1":
        return [("k2", {"inner": "eager", "chunks": 2}),
                ("fuse-direct", {"inner": "eager", "strategy": "fuse", "schedule": "direct"})]
    if inner == "inductor":
        sets = [("k2", {"chunks": 2})]
        if model_name == "sp1_llama":
            sets += [("fuse-double_ring", {"strategy": "fuse", "schedule": "double_ring"}), ("async", dict(ASYNC))]
        return sets
    sets = [("off", {"strategy": "off"}), ("k2", {"chunks": 2}), ("auto", {})]
    if world != 2:
        sets.append(("kworld", {"strategy": "decompose"}))  # k = group size
    sets += [(f"fuse-{s}", {"strategy": "fuse", "schedule": s})
             for s in (("ring", "double_ring", "direct") if world != 2 else ("double_ring", "direct"))]
    if (world, model_name) in ASYNC_CASES:
        sets.append(("async", dict(ASYNC, dump_dir=dump_dir)))
    return [(name, dict(options, inner="eager")) for name, options in sets]


def _result(ranks, tmp_path_factory, world: int, model_name: str, inner: str, name: str) -> dict:
    """Rank 0's result of option set ``name``; its trace's sets run once per session (whichever
    worker asks first, :mod:`session_cache`), and every rank agrees on it."""
    from session_cache import computed_once

    def run_group() -> list[dict]:
        dump_dir = str(tmp_path_factory.mktemp(f"dump-{world}-{model_name}"))
        return ranks(world).run(run_variants, world, model_name, _option_sets(world, model_name, inner, dump_dir))

    group = computed_once(tmp_path_factory, f"numerics-{world}-{model_name}-{inner}", run_group)
    results = [r[name] for r in group]
    res = results[0]
    assert "error" not in res, res["error"]
    assert all(r == res for r in results), "ranks disagree on what was rewritten"
    return res


def _cases(worlds, models):
    """``(world, model_name)`` parameters (4 ranks: slow)."""
    return [pytest.param(w, m, marks=[pytest.mark.slow] if w != 2 else [], id=f"{m}-{w}")
            for w in worlds for m in models]


MODEL_NAMES = [c[0] for c in CASES]


@pytest.mark.parametrize("world,model_name", _cases((2, 4), MODEL_NAMES))
@pytest.mark.parametrize("strategy", ["off", "k2", "kworld", "auto"])
def test_eager_inner_matches_eager(ranks, tmp_path_factory, world, model_name, strategy):
    if strategy == "kworld" and world == 2:
        pytest.skip("the same graph as k2 at world 2 (d = group size = 2)")
    res = _result(ranks, tmp_path_factory, world, model_name, "eager", strategy)
    assert res["graphs"] == ["backward", "forward"]
    assert res["pairs"] > 0, "the matcher found no pair"
    if strategy == "off":
        assert res["rewritten"] == 0
    elif strategy in ("k2", "kworld"):
        assert res["rewritten"] == res["pairs"], "a forced decomposition left a pair untouched"
        assert res["parts"] == [2 if strategy == "k2" else world]


@pytest.mark.inductor
@pytest.mark.parametrize("world,model_name", _cases((2,), MODEL_NAMES))
def test_inductor_inner_matches_eager(ranks, tmp_path_factory, world, model_name):
    res = _result(ranks, tmp_path_factory, world, model_name, "inductor", "k2")
    assert res["rewritten"] == res["pairs"] > 0


@pytest.mark.parametrize("world,model_name", _cases((2, 4), MODEL_NAMES))
@pytest.mark.parametrize("schedule", ["ring", "double_ring", "direct"])
def test_fused_operators_match_eager(ranks, tmp_path_factory, world, model_name, schedule):
    if schedule == "ring" and world == 2:
        pytest.skip("the same transfers as direct at world 2 (test_schedules checks it for every world)")
    res = _result(ranks, tmp_path_factory, world, model_name, "eager", f"fuse-{schedule}")
    assert res["pairs"] > 0
    # Only a reduction with a bias inside it (different on every rank) stays unfused, with that reason.
    assert all("bias" in why for why in res["not_rewritten"]), res
    assert len(res["not_rewritten"]) == (1 if model_name in ("tp_mlp", "sp0_mlp_bias") else 0), res


@pytest.mark.inductor
def test_fused_operators_under_inductor(ranks, tmp_path_factory):
    """Also how Inductor's wrapper calls them: every call of a ``.graph`` overload with its five
    arguments positional and a gather's weights as a list, the form the overloads' C entry takes
    (``lane.enter_from_c``; keywords would send every call to the Python entry), a gather of Q, K
    and V's three weights among them."""
    res = _result(ranks, tmp_path_factory, 2, "sp1_llama", "inductor", "fuse-double_ring")
    assert res["rewritten"] == res["pairs"] > 0
    calls = [c for c in res["wrapper_calls"] if c["op"].endswith(".graph")]
    assert len(calls) == res["rewritten"], res["wrapper_calls"]
    assert all(c["positional"] == 5 and not c["keywords"] for c in calls), calls
    gathers = [c["weights"] for c in calls if "all_gather_matmul" in c["op"]]
    assert None not in gathers and 3 in gathers, calls


@pytest.mark.parametrize("name", ["k2", "fuse-direct"])
def test_batch_one_sequence_parallel_gathers_are_rewritten(ranks, tmp_path_factory, name):
    """Batch 1 (as in the end-to-end benchmark): the gather's dim before the sequence is size 1,
    which once made every gather pair 'infeasible' for InterDecom (extent 1) on the GPUs."""
    res = _result(ranks, tmp_path_factory, 2, "sp1_llama_b1", "eager", name)
    assert res["rewritten"] == res["pairs"] > 0, res["not_rewritten"]


@pytest.mark.parametrize("world,model_name", [p for p in _cases((2, 4), MODEL_NAMES)
                                              if tuple(p.values) in ASYNC_CASES])
def test_asynchronous_fused_reductions_match_eager(ranks, tmp_path_factory, world, model_name):
    """fused_async: the reducing fused operators start as soon as their operands exist and are
    waited for just before the first use; forward and backward still equal eager, in the
    backward graph a weight-gradient mm sits between a start and its wait (the overlap), and the
    forward's reductions, read at once, are plain calls (deferring them would overlap nothing)."""
    res = _result(ranks, tmp_path_factory, world, model_name, "eager", "async")
    assert res["rewritten"] > 0 and any(res["async"]), res
    forward = res["forward_reductions"]
    assert forward["start"] == 0 and forward["plain"] == forward["rewritten"], forward
    assert forward["rewritten"] > 0 or model_name == "tp_mlp", forward  # its forward reduction has a bias: kept
    lines = res["lines"]
    assert lines["start"], "no asynchronous start in the backward graph"
    assert any(s < m < w for s in lines["start"] for m in lines["mm"] for w in lines["wait"]
               if not any(s < x < w for x in lines["start"] if x != s)), lines


@pytest.mark.inductor
def test_asynchronous_fused_reductions_under_inductor(ranks, tmp_path_factory):
    res = _result(ranks, tmp_path_factory, 2, "sp1_llama", "inductor", "async")
    assert res["rewritten"] == res["pairs"] > 0


def _collectives_per_set(rank: int, world: int) -> list[dict]:
    """tp_mlp compiled from one trace with the pass off and with k=2: the process group's collectives
    each selected set runs, forward and backward (as the profiler records them)."""
    from collections import Counter

    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    import tp_models
    from shared_trace import Variants

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    x = tp_models.example_input("tp_mlp", rank, world)
    model = tp_models.build("tp_mlp", mesh)
    variants = Variants([{"inner": "eager", "strategy": "off"}, {"inner": "eager", "chunks": 2}])
    compiled = torch.compile(model, backend=variants, fullgraph=True)
    tp_models.loss_of(compiled(x)).backward()  # compiles forward and backward (traces the ops too: not counted)
    seen = []
    for i in (0, 1, 0):
        variants.select(i)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            tp_models.loss_of(compiled(x)).backward()
        seen.append(dict(Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))))  # the group's calls
    return seen


def test_each_option_set_runs_its_own_graphs(ranks):
    """The shared trace runs the selected set's graphs: k=2 issues twice the pass-off collectives,
    and selecting the first set again brings its count back."""
    off, k2, off_again = ranks(2).run(_collectives_per_set, 2)[0]
    assert off and off == off_again, (off, off_again)
    assert k2 == {name: 2 * n for name, n in off.items()}, (off, k2)
