"""The multi-GPU benchmark scripts run end to end on 2 gloo CPU ranks (``--dry-run``, restricted
to a few configurations to stay fast) and write the JSON and markdown they promise.

The fused operators' dry run and the soak run as subprocesses exactly as a user runs them, so the
launch path (spawn, gloo, rank 0 writing the files) is the one that runs on the GPUs with NCCL.
The other scripts' ``main`` runs on the session's pool of 2 gloo ranks (``harness.launch`` runs a
dry run on a group that exists): the same script, arguments and files, without starting three
interpreters each (about 12 s of CPU a script).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.slow  # each runs a benchmark script in fresh processes

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _main_on_rank(rank: int, script: str, argv: list[str]) -> int:
    """One pool rank's part of a dry run: the script's ``main(argv)``, as its command line runs it."""
    import importlib

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    torch._dynamo.reset()  # the script compiles as a fresh process would
    return importlib.import_module(script.removesuffix(".py")).main(argv)


def _bench(module: str):
    """A module of benchmarks/ (a script, or ``harness.*``), imported with benchmarks/ on ``sys.path``
    for the import only."""
    import importlib

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(BENCH))


def _stand_in_clock(monkeypatch, module) -> list[float]:
    """``module``'s ``time.perf_counter`` replaced by a clock that only the test moves (``now[0] += s``):
    a timing loop's figures exact under any load, no timed assertion."""
    now = [100.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def _run(script: str, out: Path, *extra: str, ranks=None) -> dict:
    """A script's dry run and the files it wrote: on ``ranks`` (the pool fixture: its 2 ranks) or,
    without, in a subprocess."""
    argv = ["--dry-run", "--out-dir", str(out), *extra]
    if ranks is not None:
        codes = ranks(2).run(_main_on_rank, script, argv)
        assert codes == [0, 0], f"{script} exited with {codes}"
    else:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, str(BENCH / script), *argv], check=False, cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    name = script.removesuffix(".py")
    jpath, mpath = out / f"{name}-cpu.json", out / f"{name}-cpu.md"
    assert jpath.is_file() and mpath.is_file(), sorted(p.name for p in out.iterdir())
    assert mpath.read_text().startswith("# ")
    data = json.loads(jpath.read_text())
    assert data["benchmark"] == name and data["worlds"] == [2]
    assert data["environment"]["dry_run"] is True
    env = data["environment"]["env"]  # the regime's settings are recorded with every result
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NCCL_P2P_DISABLE": os.environ.get("NCCL_P2P_DISABLE"),
                   "COMPASS_FUSED_TRANSPORT": os.environ.get("COMPASS_FUSED_TRANSPORT"),
                   "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    assert data["environment"]["source_sha1"] == _source_digest()  # which code ran, whatever git HEAD says
    return data


@functools.cache
def _source_digest() -> str:
    """harness.output.source_digest() of this checkout (in a subprocess: importing the harness sets
    the benchmarks' environment)."""
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); from harness.output import source_digest; print(source_digest())"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def test_correctness_dry_run(tmp_path, ranks):
    # the cost model's d only (forced d take the same code path); the compiled level without off/auto
    data = _run("multigpu_correctness.py", tmp_path, "--forced-d", "", "--compiled-strategies", "decompose,fuse",
                ranks=ranks)
    rows = data["rows"]
    assert data["counts"]["FAIL"] == 0 and data["counts"]["error"] == 0
    assert data["topology"]["2"]["name"]
    for kind in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        ops = {r["strategy"] for r in rows if r["kind"] == kind and r["level"] == "ops" and r["status"] == "pass"}
        assert {"sequential", "fuse(ring)", "fuse(double_ring)", "fuse(direct)"} <= ops, (kind, ops)
        assert any(s.startswith("decompose(d=") for s in ops), (kind, ops)
        assert any(r["role"] == "model's d" for r in rows if r["kind"] == kind and r["level"] == "ops")
        # sequential and InterDecom ran as compass_fx's rewrite emits them, the backward pair (the
        # mirror collective; the all-reduce's row-parallel backward has none) rewritten as well
        graphs = ["forward"] if kind == "matmul_all_reduce" else ["forward", "backward"]
        for r in rows:
            if r["kind"] == kind and r["level"] == "ops" and (r["strategy"] == "sequential"
                                                             or r["strategy"].startswith("decompose")):
                want = ("kept sequential(1): strategy='off'" if r["strategy"] == "sequential"
                        else f"rewritten decompose({r['strategy'][12:-1]})")
                assert sorted(r["applied"].split("; ")) == sorted(f"{g}: {want}" for g in graphs), r
        compiled = [r for r in rows if r["kind"] == kind and r["level"] == "compiled"]
        assert compiled and all(r["status"] == "pass" and r["rewritten"] > 0 for r in compiled), compiled
        for r in rows:
            if r["kind"] == kind and r["status"] == "pass" and r["strategy"] != "symm_mem":
                assert r["err_grad_a"] <= r["tolerance"] and r["err_grad_b"] <= r["tolerance"]


def test_operators_dry_run(tmp_path, ranks):
    data = _run("multigpu_operators.py", tmp_path, "--models", "llama3-8b", "--tokens", "2048", "--decompose-ds", "2",
                ranks=ranks)
    rows = data["rows"]
    assert len(rows) == 3 and {r["kind"] for r in rows} == {"all_gather_matmul", "matmul_reduce_scatter",
                                                            "matmul_all_reduce"}
    assert data["topology"]["2"]["fused_schedules"] == ["ring", "double_ring", "direct"]
    for r in rows:
        measured = {k: c["measured_s"] for k, c in r["candidates"].items()}
        assert all(v and v > 0 for v in measured.values()), measured
        assert r["pick"] in measured and r["best"] in measured
        # at two ranks the ring runs the plan of "direct": measured once, under that name
        assert {"sequential", "decompose(d=2)", "fuse(double_ring)", "fuse(direct)"} <= set(measured)
        assert "fuse(ring)" not in measured
        # measured side by side (interleaved rounds), each with its spread over the rounds
        assert all(c["spread"] is not None and c["spread"] >= 0 for c in r["candidates"].values())
        # measured as the compiler's own rewrite emits each strategy, and it did apply the strategy
        compiler = {k: c["compiler"] for k, c in r["candidates"].items()}
        assert compiler["sequential"] == ["inference: kept sequential(1): strategy='off'"], compiler
        assert compiler["decompose(d=2)"] == ["inference: rewritten decompose(2)"], compiler
        assert compiler["fuse(direct)"] == ["inference: rewritten fuse(direct)"], compiler
        assert all(c["error"] is None for c in r["candidates"].values()), r["candidates"]
        assert r["gemm_s"] > 0 and r["comm_s"] > 0 and r["overlap_efficiency"] > 0
        assert isinstance(r["hit"], bool) and r["pred_err"] is not None
        if r["kind"] != "matmul_all_reduce":
            assert r["symm_mem_s"] > 0 and r["speedup_vs_symm_mem"] > 0
    s = data["summary"]
    assert s["configurations"] == 3 and 0 <= s["hit_rate"] <= 1
    assert s["worst_regression_vs_sequential"] is not None


def test_end_to_end_dry_run(tmp_path, ranks):
    # eager instead of (aot_eager-substituted) Inductor keeps the test fast; the dry run of the
    # committed results runs the real Inductor
    data = _run("multigpu_end_to_end.py", tmp_path, "--fast", "--sp", "on", "--layers", "1", "--steps", "1",
                "--warmup", "1", "--modes", "eager,async_tp,compass,megatron",
                "--compass-options", '{"strategy": "decompose", "chunks": 2}', ranks=ranks)
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"eager", "async_tp", "compass", "megatron"}
    for mode in ("eager", "compass"):
        assert rows[mode]["status"] == "ok" and rows[mode]["tokens_per_s"] > 0 and rows[mode]["step_s"] > 0
    assert rows["compass"]["compass_rewritten"] > 0
    assert rows["compass"]["loss_rel_diff_vs_eager"] < 1e-4
    assert rows["async_tp"]["status"] == "skipped" and "CUDA" in rows["async_tp"]["note"]
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        assert rows["megatron"]["status"] == "skipped" and "not installed" in rows["megatron"]["note"]


def test_fused_ops_dry_run(tmp_path, ranks):
    data = _run("fused_ops.py", tmp_path, "--models", "llama3-8b", "--tokens", "2048", "--calls", "4",
                "--schedules", "ring,direct", ranks=ranks)
    assert data["summary"]["stress_failures"] == [] and len(data["stress"]) == 12  # 3 kinds x 2 shapes x 2
    assert all(r["ok"] and r["elements_differing_between_calls"] == 0 for r in data["stress"])
    assert {r["kind"] for r in data["speed"]} == {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"}
    assert all(set(r["times_s"]) >= {"gemm", "comm", "sequential", "fuse(ring)", "fuse(direct)"} for r in data["speed"])
    # the sequential pair timed is the one compass_fx compiles with strategy off (kept as it is)
    assert all(r["sequential_compiler"] == ["inference: kept sequential(1): strategy='off'"] for r in data["speed"])


def test_profile_pair_dry_run(tmp_path, ranks):
    data = _run("profile_pair.py", tmp_path, "--skip-nccl", "--decompose-only", ranks=ranks)
    decomposed = [r for r in data["pairs"] if r["variant"].startswith("decompose")]
    assert len(decomposed) == 6 and all(r["rewritten"] == [f"inference: rewritten decompose({r['variant'][-1]})"]
                                        and "not_applied" not in r for r in decomposed), decomposed


def test_a_forced_decomposition_the_pair_cannot_take_shows_as_such():
    # a fake group of 2 in this process: what harness.pairs reports for a forced d the pair takes and
    # for one it cannot take (the scripts record the latter as the candidate's error, untimed)
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    pairs = _bench("harness.pairs")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = dist.group.WORLD.group_name
        a, b = pairs.pair_operands("matmul_reduce_scatter", 12, 8, 8, 2, 0, torch.float32, torch.device("cpu"))
        out = {}
        for label in ("sequential", "decompose(d=2)", "decompose(d=4)"):  # 12 rows: 2 x 2 parts divide them, 2 x 4 not
            fn, outcomes = pairs.lowered_fn("matmul_reduce_scatter", label, 2, group)
            with torch.no_grad():
                fn(a, b)
            out[label] = [outcomes(), pairs.not_applied(label, outcomes())]
    finally:
        dist.destroy_process_group()
    assert out["sequential"] == [["inference: kept sequential(1): strategy='off'"], None]
    assert out["decompose(d=2)"] == [["inference: rewritten decompose(2)"], None]
    (outcome,), why = out["decompose(d=4)"]
    assert outcome.startswith("inference: skipped sequential(1): chunks=4"), outcome
    assert why == f"decompose(d=4) not applied by the compiler: {outcome}"


def test_the_replay_fit_takes_the_column_it_is_asked_for():
    """``fit_replay(column=...)``: the line through the cases' host times of that column (each run
    scaled by its launches), and a clear error where the runs lack it (runs before the steady column)."""
    fit = _bench("fit_model_constants")
    launch = {"2": {"Copy": 8.0, "Matmul": 16.0, "WaitFlag": 4.0}}
    rows = [{"world": 2, "op": "matmul_reduce_scatter", "rows": rows, "k": 7168, "n": 4096,
             "host_us_graph": 99.0, "host_us_steady": None} for rows in (512, 8192)]
    slow = [fit._slow_nodes(r, 2, True, True, fit._run_most_pieces({}, 2)) for r in rows]
    assert slow[0] < slow[1]
    for r, x in zip(rows, slow):
        r["host_us_steady"] = 10.0 + 3.0 * x
    got = fit.fit_replay({"a": {"launch_us": launch, "rows": rows, "replay_waits": "batch"}}, column="host_us_steady")
    assert (got["call_us"], got["node_us"], got["column"], got["worlds"]) == (10, 3.0, "host_us_steady", [2])
    # one line for every world: a run's rows at four ranks, on a host launching twice as slowly there,
    # are scaled by that world's launches before the fit, to the median launches (1.5x those at two ranks)
    four = [dict(r, world=4) for r in rows]
    for r in four:
        r["host_us_steady"] = 2 * (10.0 + 3.0 * fit._slow_nodes(r, 4, True, True, fit._run_most_pieces({}, 4)))
    both = {"a": {"launch_us": launch, "rows": rows, "replay_waits": "batch"},
            "b": {"launch_us": {"4": {k: 2 * v for k, v in launch["2"].items()}}, "rows": four, "replay_waits": "batch"}}
    got = fit.fit_replay(both, worlds=(2, 4))
    assert (got["call_us"], got["node_us"], got["worlds"], got["points"]) == (15, 4.5, [2, 4], 4), got
    assert got["launch_us"] == {k: pytest.approx(1.5 * v) for k, v in launch["2"].items()}
    assert got["median_priced_over_measured_by_world"] == {"2": pytest.approx(1.0), "4": pytest.approx(1.0)}
    with pytest.raises(SystemExit, match="host_us_steady"):
        fit.fit_replay({"a": {"launch_us": launch, "rows": [dict(r, host_us_steady=None) for r in rows]}},
                       column="host_us_steady")
    # a run of another schedule (fused_host_time --schedule, peer transport) is priced with its plans
    ring, direct = (fit._slow_nodes(dict(rows[1], op="all_gather_matmul", k=4096, n=7168), 4, False, True, 0, s)
                    for s in ("double_ring", "direct"))
    assert ring > direct


def test_the_replay_fit_is_checked_on_runs_held_out_of_it():
    """``check_replay``: a fit's constants price other runs, each scaled by its launches against the
    fit's (a host launching twice as slowly is priced twice as high), and say how far off they are
    per transport and per world."""
    fit = _bench("fit_model_constants")
    launch = {"Copy": 8.0, "Matmul": 16.0, "WaitFlag": 4.0}
    rows = [{"world": 2, "op": "matmul_reduce_scatter", "rows": rows, "k": 7168, "n": 4096} for rows in (512, 8192)]
    for r in rows:  # measured on a host launching twice as slowly as the fit's: 2 x (10 us + 3 us per node)
        r["host_us_steady"] = 2 * (10.0 + 3.0 * fit._slow_nodes(r, 2, True, True, fit._run_most_pieces({}, 2)))
    slow_host = {"launch_us": {"2": {k: 2 * v for k, v in launch.items()}}, "rows": rows, "replay_waits": "batch"}
    got = fit.check_replay({"slow": slow_host}, 10.0, 3.0, launch, worlds=(2, 4))
    assert got["median_error"] == pytest.approx(0.0) and got["points"] == 2 and got["worlds"] == [2]
    assert got["median_priced_over_measured"] == {"host": pytest.approx(1.0)}
    off = fit.check_replay({"slow": slow_host}, 20.0, 6.0, launch, worlds=(2,))  # constants twice too high
    assert off["median_priced_over_measured_by_world"] == {"2": pytest.approx(2.0)}
    with pytest.raises(SystemExit, match="check_replay"):
        fit.check_replay({"slow": dict(slow_host, rows=[dict(r, world=4) for r in rows])}, 10.0, 3.0, launch,
                         worlds=(2,))


def test_a_second_replay_graph_is_fitted_against_the_one_graph_calls_of_its_rounds():
    """``fit_replay_graph``: a ring all-reduce (two graphs, issued as one call) costs its excess over
    one call less the one-graph operators' excess in the same run and world (their host's baseline,
    whatever the launches alone say of its speed); the median over runs and worlds; a clear error
    where no run holds calls of several graphs."""
    fit = _bench("fit_model_constants")
    from compass_fx.cost.strategies import replay_slow_nodes
    from compass_fx.kernels.issue_order import call_plans

    launch = {"Copy": 8.0, "Matmul": 16.0, "WaitFlag": 4.0}
    call_us, node_us = 20.0, 2.0

    def run(baseline_us: float, graph_us: float, slower: float) -> dict:
        rows = []
        for op, k, n in (("all_gather_matmul", 4096, 7168), ("matmul_reduce_scatter", 7168, 4096),
                         ("matmul_all_reduce", 7168, 4096)):
            plans = call_plans(op, "ring", 4, 0, 2048, k if op == "all_gather_matmul" else n, 1, 2, host=False)
            slow = sum(replay_slow_nodes(p, False) for p in plans)
            us = call_us + node_us * slow + baseline_us + graph_us * (len(plans) - 1)
            rows.append({"world": 4, "op": op, "rows": 2048, "k": k, "n": n, "host_us_steady": slower * us})
        return {"launch_us": {"4": {kind: slower * v for kind, v in launch.items()}}, "rows": rows,
                "transport": "peer", "schedule": "ring"}

    # three runs: hosts 1x, 2x (its launches say so) and 1.5x slower than the reference; a baseline
    # excess the launches do not explain (5, -3, 40 us) cancels
    runs = {"a": run(5.0, 8.0, 1.0), "b": run(-3.0, 10.0, 2.0), "c": run(40.0, 30.0, 1.5)}
    got = fit.fit_replay_graph(runs, launch, call_us, node_us, worlds=(2, 4, 8))
    assert got["graph_us"] == 10 and got["spread_us"] == [8.0, 30.0], got
    assert [d["world"] for d in got["by_run_and_world"]] == [4, 4, 4]
    with pytest.raises(SystemExit, match="several graphs"):
        fit.fit_replay_graph({"a": dict(runs["a"], schedule="direct")}, launch, call_us, node_us)


def test_fit_deferred_takes_the_median_extra_per_run_and_world():
    """``fit_deferred``: per run and world, the median of the asynchronous form's time less the
    ``.graph`` call's and the torch.mm's of the same rounds; then the median over runs and worlds.
    Rows without the asynchronous form (a gather) are left out; no run with it at all is an error."""
    fit = _bench("fit_model_constants")

    def row(world, op, async_us, graph_us, mm_us):
        return {"world": world, "op": op, "host_us_async": async_us, "host_us_graph": graph_us, "host_us_mm": mm_us}

    runs = {"a": {"rows": [row(2, "rs", 200, 30, 20), row(2, "ar", 300, 50, 10), row(2, "rs", 100, 20, 20),
                           row(4, "rs", 260, 40, 20), {"world": 4, "op": "ag", "host_us_graph": 40, "host_us_mm": 9}]},
            "b": {"rows": [row(2, "rs", 120, 10, 10)]}}
    got = fit.fit_deferred(runs)
    assert [(d["run"], d["world"], d["extra_us"], d["cases"]) for d in got["by_run_and_world"]] == [
        ("a", 2, 150, 3), ("a", 4, 200, 1), ("b", 2, 100, 1)]
    assert got["deferred_us"] == 150 and got["spread_us"] == [100, 200]
    with pytest.raises(SystemExit, match="asynchronous form"):
        fit.fit_deferred({"c": {"rows": [{"world": 2, "op": "ag", "host_us_graph": 1, "host_us_mm": 1}]}})


def test_the_models_software_constants_are_what_the_committed_grids_fit(tmp_path, monkeypatch):
    """``GpuSpec.part_overhead_s`` of the Hopper GPUs and the fused call's fixed host work are
    derived, not chosen: refitting them to the committed two-H200 grids (with the calibration they
    were priced with) gives the values in the code; so do the replayed call's host constants,
    refitted to the steady column of the committed ``fused_host_time`` runs of the default path on one
    H200 (2, 4 and 8 ranks, both transports), and the cost of a second replay graph in one call refitted
    to the ring schedules' runs, price no transport's and no world's calls far off
    (median priced / measured within 0.8-1.25)."""
    from compass_fx.cost import strategies
    from compass_fx.machine.gpus import GPUS

    monkeypatch.setenv("COMPASS_FX_CALIBRATION", str(BENCH / "results" / "calibration" / "calibration-h200x2.json"))
    assert _bench("fit_model_constants").main(["--out-dir", str(tmp_path)]) == 0
    fit = json.loads((tmp_path / "model_constants_fit-h200x2.json").read_text())
    assert fit["best_part_overhead_us"] * 1e-6 == pytest.approx(GPUS["H200"].part_overhead_s)
    assert fit["best_fused_call_rest_us"] * 1e-6 == pytest.approx(strategies.FUSED_HOST_CALL_REST_S)
    replay = fit["replay_fit"]
    runs = _bench("fit_model_constants").REPLAY_RUNS  # eight runs, two machine starts, both transports
    assert replay["runs"] == list(runs) and len(runs) == 8
    assert {"host", "peer"} == {json.loads((BENCH / "results" / "fused_host_time" / r).read_text()).get("transport", "host")
                                for r in runs}
    assert replay["column"] == "host_us_steady" and replay["worlds"] == [2, 4, 8] and replay["points"] == 140
    assert replay["call_us"] * 1e-6 == pytest.approx(strategies.FUSED_REPLAY_CALL_S)
    assert replay["node_us"] * 1e-6 == pytest.approx(strategies.FUSED_REPLAY_SLOW_NODE_S)
    for transport in ("host", "peer"):
        assert 0.8 <= replay["median_priced_over_measured"][transport] <= 1.25, replay
    for world in ("2", "4", "8"):
        assert 0.8 <= replay["median_priced_over_measured_by_world"][world] <= 1.25, replay
    assert {k: v * 1e-6 for k, v in replay["launch_us"].items()} == pytest.approx(strategies._REPLAY_FITTED_LAUNCH_S)
    # held out of the fit: the H200 runs of a later session, priced with these constants
    check = fit["replay_check"]
    assert check["runs"] == list(_bench("fit_model_constants").CHECK_RUNS) and check["worlds"] == [2, 4, 8]
    for transport in ("host", "peer"):
        assert 0.8 <= check["median_priced_over_measured"][transport] <= 1.25, check
    for world in ("2", "4", "8"):
        assert 0.8 <= check["median_priced_over_measured_by_world"][world] <= 1.25, check
    # a second graph in one call (the ring schedules' all-reduce from C): refitted to the ring runs
    graphs = fit["replay_graph_fit"]
    assert graphs["runs"] == list(_bench("fit_model_constants").REPLAY_GRAPH_RUNS)
    assert len(graphs["by_run_and_world"]) == 18  # two schedules, three runs, three worlds
    assert graphs["graph_us"] * 1e-6 == pytest.approx(strategies.FUSED_REPLAY_GRAPH_S)
    # a deferred call beyond a replayed one: refitted to the asynchronous form's runs
    deferred = fit["deferred_fit"]
    assert deferred["runs"] == list(_bench("fit_model_constants").DEFERRED_RUNS)
    assert len(deferred["by_run_and_world"]) == 4  # two ranks, both transports, two machine starts
    assert deferred["deferred_us"] * 1e-6 == pytest.approx(strategies.FUSED_DEFERRED_S)


def test_the_gemm_models_h200_constants_are_what_the_committed_gemms_fit(monkeypatch, capsys):
    """The H200's GEMM constants are derived, not chosen: refitting them to the two committed
    device-time measurement files together (gemm_families-h200's row splits and issue 11's set)
    gives the values in the code; priced with them, issue 11's set (16 TP = 8 Llama-3 projections
    split into 2-64 parts) has split/unsplit ratio errors of median <= 10% and p90 <= 25%, also on
    its held-out half, and the families' row splits median <= 8% and p90 <= 20% (issue 27's goal)."""
    from compass_fx.machine.gpus import GPUS

    families = BENCH / "results" / "gemm_families" / "gemm_families-h200.json"
    tp8 = str(BENCH / "results" / "gemm_model_validation" / "gemm_model_validation-h200-tp8.json")
    monkeypatch.delenv("COMPASS_FX_CALIBRATION", raising=False)
    assert _bench("gemm_model_validation").main(["--fit-jointly", f"{families},{tp8}", "--held-out", tp8]) == 0
    fit = json.loads(capsys.readouterr().out)
    spec = GPUS["H200"].to_dict()
    for key in ("efficiency", "kernel_overhead_s", "wave_overhead_s", "max_split_k"):
        assert fit["constants"][key] == pytest.approx(spec[key]), key
    assert [tuple(t) for t in fit["constants"]["tiles"]] == [tuple(t) for t in spec["tiles"]]
    for errors in (fit["in_sample"][tp8], fit["held_out_half"][tp8]):
        assert errors["median_ratio_error"] <= 0.10 and errors["p90_ratio_error"] <= 0.25, errors
    rows = fit["in_sample"][str(families)]
    assert rows["median_ratio_error"] <= 0.08 and rows["p90_ratio_error"] <= 0.20, rows


def test_operators_dry_run_priced_as_cuda_graph_replays(tmp_path, ranks):
    """``--cuda-graphs``: the model prices every candidate as a replay (each decomposition exactly
    as ``Workload.cuda_graphs`` prices it, cheaper than issued eagerly), the rows and the markdown
    say so.  (On CPU nothing is captured; on GPUs every candidate and baseline is timed from its
    replays.)"""
    from compass_fx.cost import Topology, Workload
    from compass_fx.cost.strategies import decomposition_models

    data = _run("multigpu_operators.py", tmp_path, "--models", "llama3-8b", "--tokens", "2048", "--decompose-ds", "2",
                "--kinds", "all_gather_matmul", "--cuda-graphs", ranks=ranks)
    row = data["rows"][0]
    assert row["cuda_graphs"] and all(c["measured_s"] and c["error"] is None for c in row["candidates"].values())
    topo = Topology.resolve(data["topology"]["2"]["name"])
    replayed = Workload(row["kind"], row["m"], row["n"], row["k"], data["dtype"], 2, cuda_graphs=True)
    issued = Workload(row["kind"], row["m"], row["n"], row["k"], data["dtype"], 2)
    price = {w.cuda_graphs: decomposition_models(w, topo, allowed=(2,))[2].seconds(2) for w in (replayed, issued)}
    assert row["candidates"]["decompose(d=2)"]["predicted_s"] == pytest.approx(price[True], rel=1e-9)
    assert price[True] < price[False]
    md = next(tmp_path.glob("*.md")).read_text()
    assert "replayed from a CUDA graph" in md


def test_gemm_validation_reprices_a_committed_file_into_json_and_markdown(tmp_path, monkeypatch):
    """``--reprice`` needs no GPU: the committed measurements priced with the code's constants come
    back with the committed errors, and the markdown beside them says whether the goal holds."""
    committed = BENCH / "results" / "gemm_model_validation" / "gemm_model_validation-h200-tp8.json"
    copy = tmp_path / "gemm_model_validation-h200-tp8.json"
    copy.write_text(committed.read_text())
    monkeypatch.delenv("COMPASS_FX_CALIBRATION", raising=False)
    assert _bench("gemm_model_validation").main(["--reprice", str(copy)]) == 0
    old, new = json.loads(committed.read_text()), json.loads(copy.read_text())
    assert new["builtin"]["median_ratio_error"] == pytest.approx(old["builtin"]["median_ratio_error"])
    md = copy.with_suffix(".md").read_text()
    assert md.startswith("# gemm_model_validation-h200-tp8") and "goal median_ratio_error <= 10%" in md
    assert md.count("\n| ") >= len(new["rows"]) + 3  # the summary's rows and every measurement


def test_decompose_overhead_dry_run_checks_every_rewrite_and_writes_markdown(tmp_path):
    """The InterDecom overhead benchmark on a one-rank gloo group: every decomposed pair rewritten
    and equal to the sequential result (it exits non-zero otherwise), JSON and markdown written,
    and ``--render`` rebuilds the markdown from the JSON alone."""
    out = tmp_path / "decompose_overhead-cpu.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(BENCH / "decompose_overhead.py"), "--dry-run", "--iters", "2",
                           "--parts", "2", "--out", str(out)], check=False, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # one part count: every code path, half the compiles
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert all(r["rewritten"] == (r["parts"] > 1) for r in data["rows"]), data["rows"]
    md = out.with_suffix(".md")
    first = md.read_text()
    md.unlink()
    proc = subprocess.run([sys.executable, str(BENCH / "decompose_overhead.py"), "--render", str(out)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert md.read_text() == first and first.count("\n| ") == len(data["rows"]) + 1


def _compile_time_dry_run(out: Path, *argv: str) -> dict:
    """compile_time's dry run in this process, where ``--dry-run`` measures its rows (a real run
    measures each in a fresh process, ``--one``); the results it wrote."""
    assert _bench("compile_time").main(["--dry-run", *argv, "--out-dir", str(out)]) == 0
    return json.loads((out / "compile_time-cpu.json").read_text())


def test_a_compile_time_row_that_fails_leaves_no_process_group_for_the_next(monkeypatch):
    """The dry run measures its rows in one process: a row whose model cannot be built (torchtitan on a
    torch it does not support) is that row's error, and the fake group it made is gone, so the next row
    does not fail with "trying to initialize the default process group twice"."""
    import torch.distributed as dist

    compile_time = _bench("compile_time")

    def no_model(model, layers, world):
        raise ImportError(f"cannot import {model}")

    monkeypatch.setattr(compile_time, "build", no_model)
    row = compile_time.measure_here(1, "off", "eager", 2, "torchtitan")
    assert row["error"] == "ImportError: cannot import torchtitan" and not dist.is_initialized(), row


def test_compile_time_dry_run_times_the_pass_and_the_compile(tmp_path):
    """The compile-time benchmark's dry run (1 layer, in one process; a real run starts a fresh one
    per row) at two group sizes, the pass off and every pair split into one part per rank: every
    row timed, every pair rewritten where forced (the input is shaped so that eight parts fit), the
    larger group's rewrite leaving more nodes, the growth with the group summed up, JSON and
    markdown written."""
    data = _compile_time_dry_run(tmp_path, "--modes", "off,parts", "--worlds", "2,8")
    rows = data["rows"]
    assert [(r["world"], r["layers"], r["mode"]) for r in rows] == [(2, 1, "off"), (2, 1, "parts"),
                                                                    (8, 1, "off"), (8, 1, "parts")]
    assert all("error" not in r and r["compile_s"] > r["pass_s"] > 0 and r["pairs"] > 0 for r in rows), rows
    assert all(r["rewritten"] == (r["pairs"] if r["mode"] == "parts" else 0) for r in rows), rows
    assert all(r["report_s"] > 0 and r["report_lines"] > 5 for r in rows), rows  # the explain report formatted
    assert all(r["peak_mib"] > 0 and r["compile_peak_mib"] >= 0 for r in rows), rows  # the compile's memory
    off2, parts2, off8, parts8 = rows
    assert parts8["nodes_out"] - off8["nodes_out"] > 2 * (parts2["nodes_out"] - off2["nodes_out"]) > 0
    summary = data["summary"]
    assert set(summary["added_compile"]) == {"w2/1/parts", "w8/1/parts"}
    growth = summary["pass_growth_with_world"]["1/parts"]
    assert growth["nodes_out"] == round(parts8["nodes_out"] / parts2["nodes_out"], 2)
    assert (tmp_path / "compile_time-cpu.md").read_text().startswith("# compile_time (cpu)")


def test_compile_time_sums_up_the_explain_reports_growth():
    """The summary sets the explain report's time and lines at 64 layers beside 8, per group and mode
    (a report whose rows grew with the layers would show here)."""
    def row(layers, report_s, lines):
        return {"world": 4, "layers": layers, "mode": "auto", "pass_s": 0.1 * layers, "compile_s": layers,
                "report_s": report_s, "report_lines": lines}

    summary = _bench("compile_time").summary([row(8, 0.002, 40), row(64, 0.012, 41)])
    assert summary["report_growth_8_to_64"] == {"w4/auto": {"time": 6.0, "lines": [40, 41]}}
    assert summary["pass_growth_8_to_64"] == {"w4/auto": 8.0}


def test_compile_time_sums_up_the_compiles_memory():
    """The summary sets what the compile raised the high-water mark by at 64 layers beside 8 (a pass
    whose memory grew faster than its graphs would show here), and each mode's peak over the pass off
    at the same depth; rows without memory (a kernel without ``/proc``) give neither."""
    def row(layers, mode, peak, compile_peak):
        return {"world": 4, "layers": layers, "mode": mode, "pass_s": 0.1 * layers, "compile_s": layers,
                "peak_mib": peak, "compile_peak_mib": compile_peak}

    compile_time = _bench("compile_time")
    rows = [row(8, "off", 450, 230), row(8, "auto", 470, 250), row(64, "off", 900, 680), row(64, "auto", 1010, 790)]
    summary = compile_time.summary(rows)
    assert summary["compile_peak_growth_8_to_64"] == {"w4/auto": {"growth": 3.16, "mib": [250, 790]},
                                                      "w4/off": {"growth": 2.96, "mib": [230, 680]}}
    assert summary["peak_over_off_mib"] == {"w4/8/auto": 20, "w4/64/auto": 110}
    md = compile_time.markdown({"tag": "cpu", "worlds": [4], "inner": "eager", "rows": rows, "summary": summary,
                                "environment": {"torch": "2.13.0", "cpus": 2, "commit": "abc"}})
    assert "| w4/auto | 3.16x | 250 -> 790 |" in md and "| w4/64/auto | +110 |" in md
    blank = compile_time.summary([dict(r, peak_mib=None, compile_peak_mib=None) for r in rows])
    assert blank["compile_peak_growth_8_to_64"] == blank["peak_over_off_mib"] == {}


def test_a_compile_time_row_measured_in_a_fresh_process_carries_its_memory():
    """A real run's row (a fresh interpreter, ``--one``, started by this large process): the one-layer
    demo compiled at two ranks, timed, with the fresh process's own high-water mark (not this one's,
    which ``getrusage`` would hand it from the fork) and what the compile raised it by."""
    compile_time = _bench("compile_time")
    ballast = bytearray(1 << 30)  # this process holds 1 GiB more than the fresh one will
    ballast[::4096] = b"\x01" * len(ballast[::4096])  # resident: every page touched
    here = compile_time.resident_mib("VmRSS")
    row = compile_time.run_fresh(1, "decompose", "eager", 2, "demo", timeout=300)
    del ballast
    assert "error" not in row and row["rewritten"] == row["pairs"] > 0, row
    assert row["peak_mib"] > row["compile_peak_mib"] > 0, row
    assert row["peak_mib"] < here - 512, (row, here)  # handed this process's, it would read at least ``here``


@pytest.mark.slow
def test_compile_time_compiles_torchtitan_with_checkpointed_layers(tmp_path):
    """The benchmark's torchtitan model (the tests' build of its Llama-3 and TP plan, every layer
    checkpointed): compiled forward and backward, every pair decomposed, the model named in the
    results."""
    pytest.importorskip("torchtitan")
    data = _compile_time_dry_run(tmp_path, "--modes", "decompose", "--worlds", "2", "--model", "torchtitan-checkpointed")
    [row] = data["rows"]
    assert data["model"] == row["model"] == "torchtitan-checkpointed"
    assert "error" not in row and row["rewritten"] == row["pairs"] > 0, row
    assert "every layer checkpointed" in (tmp_path / "compile_time-cpu.md").read_text()


@pytest.mark.slow
def test_compile_time_compiles_a_torchao_float8_stack(tmp_path):
    """The benchmark's float8 model (``tests/torchao_stack.py``, torchao's row-wise recipe): compiled
    forward and backward on four fake ranks, its pairs in both graphs found and decomposed, the rows
    per rank named in the results."""
    pytest.importorskip("torchao.float8")
    data = _compile_time_dry_run(tmp_path, "--modes", "decompose", "--model", "torchao-float8-rowwise")
    [row] = data["rows"]
    assert data["model"] == row["model"] == "torchao-float8-rowwise"
    assert "error" not in row and row["rewritten"] == row["pairs"] == 4, row  # 2 forward, 2 backward
    assert "rows per rank [8]" in (tmp_path / "compile_time-cpu.md").read_text()


@pytest.mark.slow
def test_float8_ranks_dry_run_checks_float8_steps_against_eager(tmp_path, ranks):
    """The float8 GPU check's dry run on the session's two gloo ranks (float8 gathers moved as
    bytes): the hand-built block gathering float8 bytes and torchao's row-wise stack (two of its four
    models: CI's time), a training step compiled (nothing rewritten, then every pair of both graphs
    decomposed) against eager, results written."""
    pytest.importorskip("torchao.float8")
    codes = ranks(2).run(_main_on_rank, "float8_ranks.py",
                         ["--dry-run", "--models", "block_bytes,torchao_rowwise", "--out-dir", str(tmp_path)])
    assert codes == [0, 0], codes
    data = json.loads((tmp_path / "float8_ranks-cpu.json").read_text())
    [world] = data["worlds"]
    assert [(c["model"], c["strategy"], c["status"]) for c in world["cases"]] == [
        (m, s, "pass") for m in ("block_bytes", "torchao_rowwise") for s in ("off-eager", "decompose-eager")], world
    for c in world["cases"]:
        rewritten = c["strategy"].startswith("decompose")
        assert c["pairs"] > 0 and c["decomposed"] == (c["pairs"] if rewritten else 0), c
        assert (c["backward_decomposed"] > 0) == rewritten, c
        assert c.get("status_vs_off") == ("pass" if rewritten else None), c
        # judged against the same compiler with nothing rewritten; the SQNR beside the tolerance
        assert c.get("vs_off") == ("off-eager" if rewritten else None), c
        assert c["sqnr_db"] == "equal" or c["sqnr_db"] > 30, c


def test_float8_ranks_fresh_ranks_meet_and_write_their_outcome(tmp_path):
    """The path the GPU run takes (fresh processes, each its own group; the dry run above runs the same
    cases on the pool's group): with no case to run, each rank joins a gloo group over the file store,
    puts the float8 gathers on gloo and takes them off, and writes a passing outcome with no cases."""
    worker = _bench("float8_ranks").worker
    ranks, killed = _bench("harness.launch").fresh_ranks(worker, 2, ([], [], True, {}, {}), str(tmp_path), 0, 120)
    assert killed == [] and ranks == [{"rank": r, "cases": [], "status": "pass"} for r in (0, 1)], ranks


@pytest.mark.parametrize("item, says", [("no_such_setting=1", "Inductor has no setting 'no_such_setting'"),
                                         ("pattern_matcher=Flase", "must be a Python literal")])
def test_float8_ranks_refuses_an_inductor_setting_it_cannot_patch(item, says, capsys):
    """``--inductor-config`` names a setting Inductor has, with a literal value, or nothing runs."""
    with pytest.raises(SystemExit) as stop:
        _bench("float8_ranks").main(["--dry-run", "--inductor-config", item])
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_float8_ranks_without_torchao_refuses_to_run_only_its_models(monkeypatch, capsys):
    """Where torchao does not import (the lent GPU machine), asking for its models alone is an error
    that says how to bring its source, not a run of nothing that reads as passed."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    with pytest.raises(SystemExit) as stop:
        _bench("float8_ranks").main(["--dry-run", "--models", "torchao_tensorwise,torchao_rowwise"])
    assert stop.value.code == 2 and "nothing to run" in capsys.readouterr().err


def test_compile_time_says_what_its_torchtitan_model_needs(tmp_path, monkeypatch, capsys):
    """Without torchtitan installed, ``--model torchtitan`` is refused before anything runs, saying
    how to install it (not a failed row per configuration)."""
    import importlib.util

    compile_time = _bench("compile_time")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchtitan" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_:
        compile_time.main(["--model", "torchtitan", "--dry-run", "--out-dir", str(tmp_path)])
    assert exit_.value.code == 2 and "pip install --no-deps torchtitan==0.3.0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_compile_time_refuses_a_group_of_one(tmp_path, capsys):
    """A group size under two is refused before anything runs."""
    with pytest.raises(SystemExit) as exit_:
        _bench("compile_time").main(["--dry-run", "--worlds", "1", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "at least 2 ranks" in err, err[-2000:]
    assert not list(tmp_path.iterdir())


def test_fresh_ranks_reports_every_rank(tmp_path):
    """The GPU stress scripts' launcher (``harness.launch.fresh_ranks``): every rank's result, a
    rank that wrote none as an error with its exit code, a rank past the deadline killed."""
    from fresh_rank_worker import fresh_rank

    fresh_ranks = _bench("harness.launch").fresh_ranks
    ranks, killed = fresh_ranks(fresh_rank, 2, ("answers",), str(tmp_path), 0, 60)
    assert [r["rank"] for r in ranks] == [0, 1] and killed == []
    ranks, killed = fresh_ranks(fresh_rank, 2, ("dies",), str(tmp_path), 1, 60)
    assert ranks[0]["status"] == "pass" and "exit code 3" in ranks[1]["error"] and killed == []
    ranks, killed = fresh_ranks(fresh_rank, 2, ("hangs",), str(tmp_path), 2, 4)  # rank 0 answers well within
    assert killed == [1] and ranks[1]["status"] == "error"
    ranks, killed = fresh_ranks(fresh_rank, 2, ("agrees",), str(tmp_path), 3, 60)
    assert killed == [] and [r["went_on"] for r in ranks] == [[True, False]] * 2  # one rank's failure stops both


def test_every_benchmark_script_starts():
    """Each script in benchmarks/ imports and answers ``--help`` (the GPU-only ones too, which no
    dry run exercises: an import or argument slip shows here, not on the GPU machine)."""
    scripts = sorted(p.stem for p in BENCH.glob("*.py"))
    driver = textwrap.dedent(f"""
        import contextlib, importlib, io, sys
        sys.path.insert(0, {str(BENCH)!r})
        for name in {scripts!r}:
            module = importlib.import_module(name)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                sys.argv = [name + ".py", "--help"]
                try:
                    module.main()
                except SystemExit as e:
                    assert e.code in (0, None), (name, e.code)
                else:
                    raise AssertionError(name + " did not stop at --help")
            assert "usage:" in out.getvalue(), name
            print("ok", name)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("ok ")) == scripts


def test_gloo_gather_soak_runs_decomposed_gathers_and_counts_them(tmp_path):
    """The soak of decomposed gathers on gloo as the lowering emits them, on a group of one gloo
    worker thread (functional gathers in flight): every case clean, each call ran ``parts`` gathers
    (so the pair was decomposed), all counted, the threads and the form said."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(BENCH / "gloo_gather_soak.py"), "--calls", "101", "--parts", "3",
                           "--inner", "eager", "--gloo-threads", "1", "--out-dir", str(tmp_path)], check=False,
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gloo_gather_soak-cpu.json").read_text())
    assert data["crashed"] == 0 and not data["functional"] and data["gloo_threads"] == 1
    (row,) = data["rows"]
    assert row["status"] == "clean" and row["gathers_per_call"] == 3 and row["gathers"] == 3 * 101
    assert data["gathers_clean"] == 303
    text = (tmp_path / "gloo_gather_soak-cpu.md").read_text()
    assert text.startswith("# gloo_gather_soak") and "gloo worker threads: 1;" in text, text
    assert "as the lowering emits them on a gloo group of one worker thread" in text, text


def test_fused_host_time_says_how_many_rows_meet_the_goal_per_world():
    """The markdown's goal lines: per world each form's range and the rows within 60 us at two ranks,
    150 beyond, and for the rows over it their host time over the GPU's per rank; a form no row has is
    left out, a world with none of them says nothing."""
    fused_host_time = _bench("fused_host_time")
    rows = [{"world": 2, "host_us_graph": 35.0, "host_us_back_to_back": 30.0, "period_us": 100.0},
            {"world": 2, "host_us_graph": 90.4, "host_us_back_to_back": 60.0, "period_us": 1808.0},
            {"world": 8, "host_us_graph": 149.0}, {"world": 8, "host_us_graph": 151.0, "period_us": 800.0},
            {"world": 4}]
    assert fused_host_time.goal_lines(rows) == [
        "Goal at world 2 (<= 60 us): .graph 35-90 us, 1 of 2 rows within; 16 back to back 30-60 us, 2 of 2 rows within "
        "(.graph over the goal: host / GPU per rank 0.10-0.10, below 1).",
        "", "Goal at world 8 (<= 150 us): .graph 149-151 us, 1 of 2 rows within "
        "(.graph over the goal: host / GPU per rank 1.51-1.51, not all below 1).", ""]


def test_fused_host_time_compares_the_c_entry_with_the_python_entry_row_by_row():
    """``entry_lines``: per world, each form through the C entry over the same form through the Python
    entry (its range over the rows that have both, the median microseconds saved); a world without the
    Python entry's forms (a run from before it) says nothing."""
    fused_host_time = _bench("fused_host_time")
    rows = [{"world": 2, "host_us_graph": 30.0, "host_us_graph_python_entry": 40.0, "host_us_steady": 18.0,
             "host_us_steady_python_entry": 20.0},
            {"world": 2, "host_us_graph": 45.0, "host_us_graph_python_entry": 50.0, "host_us_steady": 22.0},
            {"world": 4, "host_us_graph": 80.0}]
    assert fused_host_time.entry_lines(rows) == [
        "C entry over the Python entry at world 2 (host time, row by row): .graph 0.75-0.90x (median 7.5 us less); "
        "steady 0.90-0.90x (median 2.0 us less)."]


def test_fused_host_time_sets_the_call_beside_a_plain_torch_mm_of_the_same_rounds():
    """``mm_lines``: per world, a plain torch.mm's host time in each form (its range over the rows) and
    the first call's slowness after a wait (first of 16 over steady) for the .graph call and for
    torch.mm row by row; a world whose rows have no torch.mm forms (a run from before them) says nothing."""
    fused_host_time = _bench("fused_host_time")
    rows = [{"world": 2, "host_us_first_of_16": 120.0, "host_us_steady": 30.0, "host_us_mm": 14.0,
             "host_us_first_of_16_mm": 40.0, "host_us_steady_mm": 8.0},
            {"world": 2, "host_us_first_of_16": 60.0, "host_us_steady": 20.0, "host_us_mm": 11.5,
             "host_us_first_of_16_mm": 24.0, "host_us_steady_mm": 12.0},
            {"world": 4, "host_us_graph": 80.0, "host_us_steady": 40.0}]
    assert fused_host_time.mm_lines(rows) == [
        "A plain torch.mm of the case's operands in the same rounds at world 2: four calls after the device went idle "
        "11.5-14.0 us, first of 16 24.0-40.0 us, steady 8.0-12.0 us; first of 16 over steady: the .graph call "
        "3.0-4.0x, torch.mm 2.0-5.0x.", ""]


def test_fused_host_time_tells_the_first_call_after_a_wait_from_the_steady_ones(monkeypatch):
    """``period_us``'s issue times: the first of 16 calls (after the wait for the device) apart from
    the median of the other 15, on the host's clock; the mean over all 16 as before.  The clock is a
    stand-in that each call moves (no timing in a test: exact under any load)."""
    fused_host_time = _bench("fused_host_time")
    monkeypatch.setattr(fused_host_time.torch.cuda, "synchronize", lambda *a: None)
    now = _stand_in_clock(monkeypatch, fused_host_time)
    calls = []

    def call():  # the first call of each round of 16 takes 4 ms, the others 0.2 ms
        calls.append(None)
        now[0] += 4e-3 if len(calls) % 16 == 1 else 2e-4

    got = fused_host_time.period_us(call, calls=16, rounds=3)
    assert len(calls) == 48
    assert got["host_us_first_of_16"] == pytest.approx(4000) and got["host_us_steady"] == pytest.approx(200), got
    assert got["host_us_back_to_back"] == pytest.approx((4000 + 15 * 200) / 16), got
    assert got["period_us"] == pytest.approx(got["host_us_back_to_back"])  # nothing left to wait for after the last


def test_fused_host_time_times_a_call_between_a_steps_ops_and_not_the_ops(monkeypatch):
    """``between_ops_us``: each call issued after the step's other ops, only the call timed, the
    first after the wait for the device left out; and ``step_ops`` keeps the activations' shape."""
    fused_host_time = _bench("fused_host_time")
    monkeypatch.setattr(fused_host_time.torch.cuda, "synchronize", lambda *a: None)
    now = _stand_in_clock(monkeypatch, fused_host_time)
    order = []

    def other():  # the step's ops: 2 ms of host each time, never counted
        order.append("ops")
        now[0] += 2e-3

    def call():  # the first call of a round 3 ms, the others 0.1 ms
        order.append("call")
        now[0] += 3e-3 if order.count("call") % 16 == 1 else 1e-4

    got = fused_host_time.between_ops_us(call, other, calls=16, rounds=3)
    assert order[:4] == ["ops", "call", "ops", "call"] and len(order) == 96
    assert got["host_us_between_ops"] == pytest.approx(100), got
    x = fused_host_time.torch.randn(8, 16, dtype=fused_host_time.torch.bfloat16)
    y = fused_host_time.step_ops(x)
    assert y.shape == x.shape and y.dtype == x.dtype and fused_host_time.torch.isfinite(y.float()).all()


def test_fused_host_time_can_wait_for_the_device_by_polling(monkeypatch):
    """``--sync poll``: the timing loops wait by querying the stream in a busy loop until it is done,
    then synchronize (which then finds nothing to wait for); by default they only synchronize."""
    fused_host_time = _bench("fused_host_time")
    seen = []

    class Stream:
        def query(self):
            seen.append("query")
            return seen.count("query") == 3

    monkeypatch.setattr(fused_host_time.torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(fused_host_time.torch.cuda, "synchronize", lambda *a: seen.append("synchronize"))
    fused_host_time.wait_for_device()
    assert seen == ["synchronize"]
    monkeypatch.setattr(fused_host_time, "_POLLING", [True])
    seen.clear()
    fused_host_time.wait_for_device()
    assert seen == ["query"] * 3 + ["synchronize"]


def test_fused_host_time_refuses_a_sync_mode_it_does_not_know():
    """``--sync``: CUDA's own modes only, by name; anything else is refused before the driver is touched."""
    fused_host_time = _bench("fused_host_time")
    with pytest.raises(ValueError, match="sync must be one of"):
        fused_host_time.set_sync("fast")
    with pytest.raises(SystemExit):
        fused_host_time.main(["--sync", "fast"])


def test_fused_host_time_says_where_the_first_call_and_the_steady_ones_spend_their_host_time(monkeypatch):
    """``phases_of_16``: the fast path's phases (``lane.last_phases``) of the first of 16 calls apart
    from the median of the others, a call C declined (no phases) left out; the markdown shows both
    beside the calls' whole host times."""
    from compass_fx.kernels.cuda import lane

    fused_host_time = _bench("fused_host_time")
    monkeypatch.setattr(fused_host_time.torch.cuda, "synchronize", lambda *a: None)
    calls = []

    def phases():  # the first call of a round launches in 150 us, the others in 20 or 21 (8 and 6 of them:
        # median 20); the third is declined
        n = len(calls) % 16
        if n == 3:
            return None
        return dict(zip(lane.PHASES, (2.0, 9.0, 1.0, 150.0 if n == 1 else 20.0 + n % 2, 0.5)))

    now = _stand_in_clock(monkeypatch, fused_host_time)

    def call():  # the first call of a round takes 400 us of host, the others 60 (the phases' 162.5 and 32.5 or 33.5)
        calls.append(None)
        now[0] += 4e-4 if len(calls) % 16 == 1 else 6e-5

    monkeypatch.setattr(lane, "last_phases", phases)
    got = fused_host_time.phases_of_16(call, calls=16, rounds=3)
    assert len(calls) == 48 and got["first_from_c"] == 3
    outside = fused_host_time.OUTSIDE_C
    assert {k: v for k, v in got["first"].items() if k != outside} == dict(zip(lane.PHASES, (2.0, 9.0, 1.0, 150.0, 0.5)))
    assert got["first"][outside] == pytest.approx(400 - 162.5), got
    assert got["steady"]["launch"] == 20.0 and got["steady"]["outputs"] == 9.0
    assert got["steady"][outside] == pytest.approx(60 - 32.5), got  # the median call launches in 20 us
    # a committed run's last row, with these phases
    run = json.loads((BENCH / "results" / "fused_host_time" / "fused_host_time-h100-check-w2-breakdown-host-pin-mps.json")
                     .read_text())
    row = dict(run["rows"][-1], host_us_first_of_16=190.0, host_us_steady=40.0)
    row["breakdown"] = dict(row["breakdown"], phases_16=got)
    text = fused_host_time.markdown(dict(run, rows=[row]))
    line = next(l for l in text.splitlines() if l.startswith("| 2 | matmul_all_reduce | 8192 | 190"))
    assert "launch 150.0, outputs 9.0, checks 2.0" in line and "launch 20.0, outputs 9.0" in line, line


def test_fused_host_time_reports_a_deferred_calls_parts():
    """``--deferred-parts``: a row's parts of a deferred call make a table of their own, one line a
    row, every part in its column; rows without them (the gathers') are left out of it."""
    fused_host_time = _bench("fused_host_time")
    run = json.loads((BENCH / "results" / "fused_host_time" / "fused_host_time-h100-check-w2-breakdown-host-pin-mps.json")
                     .read_text())
    parts = {"host_us_start_gemm_wait": 171.0, "host_us_phase_start": 101.0, "host_us_phase_gemm": 12.0,
             "host_us_phase_wait": 41.0, "host_us_start_wait": 149.0, "host_us_gemm": 11.0, "host_us_events": 9.0,
             "host_us_register_wait": 23.0, "host_us_start_gemm_wait_packets": 190.0}
    rows = [dict(r, deferred_parts=parts) if r["op"] == "matmul_all_reduce" else r for r in run["rows"]]
    text = fused_host_time.markdown(dict(run, rows=rows)).splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("Where a deferred call's host microseconds go"))
    end = text.index("", start + 2)
    table = [line for line in text[start + 2:end] if line.startswith("| 2 |")]
    assert len(table) == sum(r["op"] == "matmul_all_reduce" for r in rows) > 0
    assert all(line.endswith("| 171.000 | 101.000 | 12.000 | 41.000 | 149.000 | 11.000 | 9.000 | 23.000 | 190.000 |")
               for line in table), table
    assert not any(line.startswith("Where a deferred") for line in fused_host_time.markdown(run).splitlines())


def test_join_handoff_times_each_form_and_says_what_a_join_in_c_would_save(tmp_path):
    """``join_handoff`` (CPU only): each form's microseconds per call, positive, in its files; with
    the C++ work's figure the markdown says what a join kept in C would save and what torch's
    autograd wrapper around ``wait_tensor`` costs; nonsense counts are usage errors."""
    handoff = _bench("join_handoff")
    assert handoff.main(["--no-cpp", "--calls", "50", "--rounds", "2", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "join_handoff-cpu.json").read_text())
    assert set(data["us"]) == {"python_work_us", "wait_tensor_us", "wait_below_autograd_us"}
    assert all(v > 0 for v in data["us"].values()), data["us"]
    assert (tmp_path / "join_handoff-cpu.md").read_text().startswith("# join_handoff (cpu)")
    us = {"python_work_us": 10.0, "cpp_work_us": 7.0, "wait_tensor_us": 5.0, "wait_below_autograd_us": 1.0}
    text = handoff.markdown(dict(data, us=us))
    assert "would save 3.0 us of the 10.0" in text and "costs 4.0 us of every call" in text, text
    assert "would save" not in handoff.markdown(data)
    with pytest.raises(SystemExit):
        handoff.main(["--no-cpp", "--calls", "0"])


def test_fused_host_time_runs_the_cases_of_the_operators_asked_for():
    """``fused_host_time.py --ops``: the named operators' cases only, in their order; an unknown
    name is an error that lists the known ones."""
    fused_host_time = _bench("fused_host_time")
    gathers = fused_host_time.selected_cases("all_gather_matmul")
    assert gathers and all(c[0] == "all_gather_matmul" for c in gathers)
    assert gathers == [c for c in fused_host_time.CASES if c[0] == "all_gather_matmul"]
    both = fused_host_time.selected_cases("matmul_all_reduce, all_gather_matmul")
    assert both == [c for c in fused_host_time.CASES if c[0] in ("all_gather_matmul", "matmul_all_reduce")]
    assert fused_host_time.selected_cases("") == fused_host_time.CASES
    with pytest.raises(SystemExit, match="unknown operator.*all_gather_matmul"):
        fused_host_time.selected_cases("all_gather")


def test_fused_host_time_runs_gathers_of_several_weights_and_checks_each(monkeypatch):
    """``--cases weights``: gathers feeding several weights (Q, K, V; w1, w3), each output checked
    against the gathered rows times its own weight (a wrong second output fails the check); the
    markdown names their widths and sets the C entry beside the dispatcher's path."""
    fused_host_time = _bench("fused_host_time")
    cases = fused_host_time.selected_cases("", "weights")
    assert cases == fused_host_time.WEIGHT_CASES and {len(c[3]) for c in cases} == {2, 3}
    assert fused_host_time.selected_cases("all_gather_matmul", "weights") == cases

    def operands(op, rows, k, n, rank):  # as the script's, on the CPU
        g = torch.Generator().manual_seed(11 + rank)
        a = torch.randn(rows, k, generator=g)
        bs = [torch.randn(k, width, generator=g) for width in fused_host_time.widths(n)]
        return a, (bs if isinstance(n, tuple) else bs[0])

    monkeypatch.setattr(fused_host_time, "operands", operands)
    op, rows, k, n = "all_gather_matmul", 4, 8, (6, 3, 3)
    everyone = torch.cat([operands(op, rows, k, n, r)[0] for r in range(2)])
    right = [everyone @ b for b in operands(op, rows, k, n, 1)[1]]
    assert fused_host_time.relative_error(op, (everyone, right), rows, k, n, 1, 2) < 1e-6
    wrong = [right[0], right[1] * 1.5, right[2]]
    assert fused_host_time.relative_error(op, (everyone, wrong), rows, k, n, 1, 2) == pytest.approx(0.5, rel=1e-5)
    row = {"world": 2, "op": op, "rows": 1024, "k": 4096, "n": [2048, 512, 512], "commands": {"Gemm": 6},
           "model_us": 30.0, "host_us_graph": 40.0, "host_us_graph_dispatcher": 64.0, "host_us_steady": 20.0,
           "host_us_steady_dispatcher": 36.0}
    text = fused_host_time.markdown({"tag": "t", "launch_us": {}, "rows": [row]})
    assert "| 2 | all_gather_matmul | 1024 | 4096 | 2048+512+512 | 6 |" in text, text
    assert ("C entry over the dispatcher at world 2 (host time, row by row): .graph 0.62-0.62x (median 24.0 us "
            "less); steady 0.56-0.56x (median 16.0 us less).") in text, text


def test_fused_host_stress_takes_gathers_of_several_weights():
    """``fused_host_stress.py --shapes``: a gather's n may name several weights' widths (a+b+...); only
    a gather takes several, and a size that is no whole number is refused."""
    stress = _bench("fused_host_stress")
    got = stress.cases([2, 8], "all_gather_matmul:4096:2048+512+512:4096,matmul_reduce_scatter:512:256:128",
                       ("direct",))
    assert [(c["kind"], c["world"], c["m"], c["n"], c["k"]) for c in got] == [
        ("all_gather_matmul", 2, 4096, [2048, 512, 512], 4096), ("matmul_reduce_scatter", 2, 512, 256, 128),
        ("all_gather_matmul", 8, 4096, [2048, 512, 512], 4096), ("matmul_reduce_scatter", 8, 512, 256, 128)]
    assert stress.widths(got[0]["n"]) == (2048, 512, 512) and stress.widths(256) == (256,)
    with pytest.raises(SystemExit, match="only a gather"):
        stress.cases([2], "matmul_all_reduce:512:256+256:128")
    with pytest.raises(SystemExit, match="whole numbers"):
        stress.cases([2], "all_gather_matmul:512:256+x:128")


def test_fused_host_time_measures_a_schedule_the_transport_runs(capsys):
    """``--schedule``: the peer transport's calls may run any schedule (the cost model chooses among
    them there); the host-staged transport runs only "direct" in rewritten graphs, so asking it for
    another is an error before any GPU is needed; a result says which schedule it timed."""
    fused_host_time = _bench("fused_host_time")
    with pytest.raises(SystemExit):
        fused_host_time.main(["--schedule", "ring"])
    assert "host-staged transport runs only 'direct'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fused_host_time.main(["--schedule", "triple_ring", "--transport", "peer"])
    row = {"world": 2, "op": "matmul_all_reduce", "rows": 512, "k": 7168, "n": 4096, "commands": {"Matmul": 2},
           "host_us_graph": 30.0, "model_us": 40.0}
    for schedule, said in (("double_ring", "schedule double_ring"), (None, "schedule direct")):
        payload = {"tag": "t", "transport": "peer", "launch_us": {}, "rows": [row],
                   **({"schedule": schedule} if schedule else {})}
        assert said + ", bf16" in fused_host_time.markdown(payload)


def test_the_fit_prices_each_two_rank_all_reduce_run_with_the_plan_it_captured():
    """``fit_model_constants`` rebuilds a run's two-rank host-staged all-reduce from the commands it
    recorded: a run of the one-round plan (before or after its slot reuse added events) as today's
    plan, a run before it as the reduce-scatter-then-gather plan."""
    fit = _bench("fit_model_constants")
    from compass_fx.cost.strategies import replay_slow_nodes
    from compass_fx.kernels.issue_order import call_plans

    results = BENCH / "results" / "fused_host_time"
    for name, one_round in (("fused_host_time-h200-pair-allreduce-ab3-host-pin-mps50.json", True),
                            ("fused_host_time-h200-rs-ag-allreduce-ab3-host-pin-mps50.json", False)):
        run = json.loads((results / name).read_text())
        for row in (r for r in run["rows"] if r["op"] == "matmul_all_reduce"):
            today = call_plans("matmul_all_reduce", "direct", 2, 0, row["rows"], row["n"], 1, 2, True)
            before = (fit._reduce_scatter_then_gather(row["rows"], row["n"], 0),)
            want = today if one_round else before
            assert fit._slow_nodes(row, 2, True, True) == sum(replay_slow_nodes(p, True) for p in want), (name, row["rows"])
            assert fit._census(want) == fit._census_of(row["commands"]), (name, row["rows"])


def test_host_time_ab_sets_changed_cases_against_the_spread_of_the_unchanged():
    """``host_time_ab.py`` on a committed A/B (the two-rank all-reduce's one-round plan against the
    reduce-scatter plan): the all-reduce cases changed (their commands differ), the others give the
    run's noise; ``--changed`` names the touched operators instead; a plan digest, where both runs
    have one, decides."""
    host_time_ab = _bench("host_time_ab")
    runs = [host_time_ab.load(t) for t in ("h200-rs-ag-allreduce-ab3-host-pin-mps50",
                                           "h200-pair-allreduce-ab3-host-pin-mps50")]
    result = host_time_ab.compare(runs)
    changed = {r["rows"] for r in result["rows"] if r["changed"][0]}
    assert {r["op"] for r in result["rows"] if r["changed"][0]} == {"matmul_all_reduce"} and changed == {512, 2048, 8192}
    low, median, high = result["unchanged"][0]["period"]
    assert 0.98 < low <= median <= high < 1.07
    two_k = next(r for r in result["rows"] if r["op"] == "matmul_all_reduce" and r["rows"] == 2048)
    assert abs(two_k["period_ratio"][0] - two_k["period_us"][1] / two_k["period_us"][0]) < 1e-12
    named = host_time_ab.compare(runs, frozenset({"all_gather_matmul"}))
    assert {r["op"] for r in named["rows"] if r["changed"][0]} == {"all_gather_matmul"}
    same = {"op": "x", "commands": {"Copy": 1}, "plan_digest": "a"}
    assert host_time_ab.plan_changed(same, dict(same, plan_digest="b"))  # order alone: the digest tells
    assert not host_time_ab.plan_changed(same, dict(same))
    assert "the noise between these runs" in host_time_ab.markdown(result)


def test_fused_host_time_fingerprints_a_cases_plans_in_order():
    """``plan_digest``: the same plans give the same digest; the gather's pulls in rounds or one per
    peer (the same commands by kind, in another order) give different ones."""
    fused_host_time = _bench("fused_host_time")
    from compass_fx.kernels import protocol as pr

    rounds = pr.all_gather_plan("direct", 8, 3, 64, 1, 2, grouped=True)
    peers = pr.all_gather_plan("direct", 8, 3, 64, 1, 2, grouped=False)
    census = [sorted(type(c).__name__ for c in p.commands) for p in (rounds, peers)]
    assert census[0] == census[1]
    assert fused_host_time.plan_digest((rounds,)) == fused_host_time.plan_digest((rounds,))
    assert fused_host_time.plan_digest((rounds,)) != fused_host_time.plan_digest((peers,))


def test_replay_trace_cuts_a_trace_into_calls_and_times_each_kind_of_work():
    """``replay_trace.py``'s summary of a Chrome trace (what torch.profiler exports): the device events
    cut into calls at each replay graph's ``compass_count`` kernel, each kind's first start and last
    end from the call's first event, the span and the idle time in it; host events ignored; a trace
    with no device events (a CPU run) has no calls."""
    replay_trace = _bench("replay_trace")

    def ev(name, ts, dur, cat="kernel"):
        return {"name": name, "ts": ts, "dur": dur, "cat": cat, "ph": "X"}

    def call(t):  # a GEMM, its publication, the peer's piece pulled, the sum, the count
        return [ev("nvjet_tst_128x256_h_bz_TNT", t, 50), ev("Memcpy DtoH (Device -> Pinned)", t + 50, 30, "gpu_memcpy"),
                ev("compass_set_flag", t + 80, 2), ev("Memcpy HtoD (Pinned -> Device)", t + 90, 30, "gpu_memcpy"),
                ev("vectorized_elementwise_kernel<add>", t + 125, 5), ev("compass_count", t + 130, 1)]

    trace = call(0) + call(200) + call(400) + [ev("cudaGraphLaunch", 5, 3, "cuda_runtime"), ev("stray", 600, 1)]
    calls = replay_trace.calls_of(trace)
    assert len(calls) == 3 and [len(c) for c in calls] == [6, 6, 6]  # the unfinished tail dropped
    one = replay_trace.call_summary(calls[1])
    assert one["span_us"] == 131 and one["idle_us"] == 131 - (80 + 2 + 30 + 5 + 1)  # gaps at 82-90, 120-125
    assert one["kinds"]["h2d"]["first_start"] == 90 and one["kinds"]["sum"]["last_end"] == 130
    assert one["kinds"]["gemm"]["busy"] == 50 and one["kinds"]["flag"]["n"] == 1
    summary = replay_trace.summarize(trace, skip=1)
    assert summary["calls"] == 2 and summary["span_us"] == 131 and summary["kinds"]["d2h"]["first_start"] == 50
    assert replay_trace.summarize([ev("aten::mm", 0, 10, "cpu_op")]) == {"calls": 0}
    assert replay_trace.kind_of("Memcpy DtoD (Device -> Device)") == "d2d"
    assert replay_trace.kind_of("compass_wait_flag") == "wait"
    payload = {"tag": "t", "calls": 3, "op": "matmul_reduce_scatter", "rows": 512, "k": 8, "n": 8, "world": 2,
               "variants": {"guards": {"settings": {}, **summary}, "no-guards": {"settings": {"X": "0"}, "calls": 0}}}
    md = replay_trace.markdown(payload)
    assert "span 131.0 us" in md and "| h2d |" in md and "no calls traced" in md


def test_replay_trace_places_a_peers_calls_against_rank_0s():
    """Every rank's calls on the machine's clock (the trace's base time + its events' times): each of
    rank 0's calls matched with the peer's nearest, the peer's start lag and rank 0's first pull after
    the peer's flag set, as medians; a peer with no calls gives nothing."""
    replay_trace = _bench("replay_trace")

    def ev(name, ts, dur, cat="kernel"):
        return {"name": name, "ts": ts, "dur": dur, "cat": cat, "ph": "X"}

    def call(t, pull_at):  # a GEMM, its flag set, the peer's piece pulled at pull_at, the count
        return [ev("nvjet_gemm", t, 50), ev("compass_set_flag", t + 50, 4),
                ev("Memcpy HtoD (Pinned -> Device)", t + pull_at, 20, "gpu_memcpy"), ev("compass_count", t + pull_at + 20, 1)]

    mine = replay_trace.timeline(call(0, 60) + call(200, 60) + call(400, 90), base_us=1000.0, skip=0)
    assert [c["start"] for c in mine] == [1000.0, 1200.0, 1400.0] and mine[2]["kinds"]["h2d"] == (1490.0, 1510.0)
    # the peer's trace counts from another base; on the machine's clock its calls start 30 us later
    peer = replay_trace.timeline(call(0, 60) + call(200, 60) + call(400, 60), base_us=1030.0, skip=0)
    lags = replay_trace.peer_lags(mine, peer)
    assert lags == {"start_lag_us": 30.0, "pull_after_peer_flag_us": 60 - (30 + 54)}  # median of -24, -24, 6
    assert replay_trace.peer_lags(mine, []) == {}
    payload = {"tag": "t", "calls": 3, "op": "matmul_reduce_scatter", "rows": 512, "k": 8, "n": 8, "world": 2,
               "variants": {"guards": {"settings": {}, **replay_trace.summarize(call(0, 60), skip=0),
                                       "peers": {"1": lags},
                                       "peer_summaries": {"1": replay_trace.summarize(call(0, 60), skip=0)}}}}
    md = replay_trace.markdown(payload)
    assert "Rank 1's calls start 30.0 us after rank 0's; rank 0's first pull starts -24.0 us" in md
    assert "Rank 1: span 81.0 us" in md and "h2d 60-80" in md


def test_replay_trace_reads_what_torch_profiler_exports(tmp_path):
    """A Chrome trace torch.profiler writes (on the CPU: host events only) parses, and has no calls."""
    replay_trace = _bench("replay_trace")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert events and replay_trace.summarize(events) == {"calls": 0}


def test_graph_node_probe_renders_each_section_as_a_table():
    """The probe's markdown from a committed result (issue 27's lines section, run on an H200): the
    note first, the section with its seconds, one table row per case with every key its rows hold;
    a section that failed says how, in one line."""
    probe = _bench("graph_node_probe")
    committed = BENCH / "results" / "graph_node_probe" / "graph_node_probe-h200-lines.json"
    res = json.loads(committed.read_text())
    md = probe.render(res, "graph_node_probe-h200-lines")
    assert md.startswith("# graph_node_probe-h200-lines\n\n" + res["note"] + "\n\n## lines (7.8 s)\n\n"), md[:400]
    header = "| case | nodes | idle_us | busy_x4_us | ms | gb_s | content_right |"
    assert header in md
    for row in res["lines"]:
        (line,) = [x for x in md.splitlines() if x.startswith(f"| {row['case']} |")]
        assert line.count("|") == header.count("|"), line
    assert '| h2d16_one_2d | {"memcpy": 1} | 6.926 | 6.699 | - | - | - |' in md
    failed = probe.render({"copy": {"error": "Traceback ...\nDriverError: cuMemHostRegister failed\n"}, "copy_s": 0.01}, "x")
    assert failed == "# x\n\n## copy (0.0 s)\n\nfailed: `DriverError: cuMemHostRegister failed`\n"


def test_graph_node_probe_writes_json_and_markdown_after_each_section(tmp_path, capsys):
    """A run writes X.json and X.md beside it after every section (here one the probe does not have:
    its failure, without a GPU); ``--render`` prints the same markdown again from the JSON."""
    probe = _bench("graph_node_probe")
    out = tmp_path / "probe.json"
    assert probe.main(["--out", str(out), "--sections", "no_such"]) == 0
    res = json.loads(out.read_text())
    assert "no_such_section" in res["no_such"]["error"]
    md = (tmp_path / "probe.md").read_text()
    assert md.startswith("# probe (no_such)\n\n## no_such (") and "failed: `KeyError: 'no_such_section'`" in md
    capsys.readouterr()
    assert probe.main(["--render", str(out)]) == 0
    assert capsys.readouterr().out == md.replace("# probe (no_such)", "# probe", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.json", "probe.md"]  # --render wrote nothing


def test_a_run_says_when_its_checkout_differs_from_the_commit_it_names(tmp_path, monkeypatch):
    """``harness.output.git_dirty``: a working tree copied onto a lent machine keeps an older ``.git``,
    so the commit a result names may not be the code that ran; ``dirty`` says when the tracked files
    differ from that HEAD (False when they do not, None outside a repository)."""
    output = _bench("harness.output")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "code.py"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "one"], check=True)
    monkeypatch.setattr(output, "ROOT", tmp_path)
    assert output.git_dirty() is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert output.git_dirty() is True
    monkeypatch.setattr(output, "ROOT", tmp_path / "nowhere")
    assert output.git_dirty() is None


def test_host_time_goals_counts_the_runs_whose_every_row_meets_the_goal(tmp_path):
    """``host_time_goals``: per run and world the rows within the goal in each form (60 us at two ranks,
    150 beyond) and the worst; per transport and world the runs with every row within; a run of another
    schedule, with a setting changed, or from before the steady form (or without calls from C) is left out."""
    host_time_goals = _bench("host_time_goals")

    def row(world, graph, steady, between=None, **more):
        return {"world": world, "host_us_graph": graph, "host_us_steady": steady, "host_us_between_ops": between,
                "fast_path_calls": 40, **more}

    cold = [{"host_us_first_of_16": 60.0, "host_us_first_of_16_mm": 30.0, "host_us_steady_mm": 10.0},
            {"host_us_first_of_16": 200.0, "host_us_first_of_16_mm": 20.0, "host_us_steady_mm": 10.0}]
    runs = {
        "fused_host_time-h100-a-host-pin-mps": {"transport": "host", "launch_us": {"2": {"Matmul": 8.0}},
                                                "rows": [row(2, 30.0, 20.0, 25.0, **cold[0]),
                                                         row(2, 59.0, 40.0, 61.0, **cold[1])]},
        "fused_host_time-h200-b-host-pin-mps": {"transport": "host", "settings": {"sync": "poll"},
                                                "launch_us": {"2": {"Matmul": 18.0}, "8": {"Matmul": 19.0}},
                                                "rows": [row(2, 90.0, 50.0), row(8, 149.0, 80.0), row(8, 151.0, 90.0)]},
        "fused_host_time-h200-ring-peer": {"transport": "peer", "schedule": "ring", "rows": [row(2, 10.0, 9.0)]},
        "fused_host_time-h200-kwait": {"settings": {"COMPASS_REPLAY_WAITS": "kernel"}, "rows": [row(2, 10.0, 9.0)]},
        "fused_host_time-h200-old": {"rows": [{"world": 2, "host_us_graph": 10.0, "fast_path_calls": 40}]},
        "fused_host_time-h200-weights": {"cases": "weights", "rows": [row(2, 10.0, 9.0)]},  # other cases
    }
    for stem, payload in runs.items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(payload))
    rows = host_time_goals.collect(tmp_path)
    assert [(r["card"], r["world"], r["sync"]) for r in rows] == [("h100", 2, "auto"), ("h200", 2, "poll"),
                                                                  ("h200", 8, "poll")]
    fast, slow, eight = rows
    assert (fast["host_us_graph_within"], fast["host_us_graph_rows"], fast["host_us_graph_max"]) == (2, 2, 59.0)
    assert (fast["host_us_between_ops_within"], fast["mm_launch_us"]) == (1, 8.0)
    assert (fast["first_over_steady"], fast["first_over_steady_mm"]) == (4.0, 2.5)  # medians of 3, 5 and of 3, 2
    assert slow["first_over_steady"] is None and slow["first_over_steady_mm"] is None  # a run without those forms
    assert slow["host_us_between_ops_rows"] is None and eight["host_us_graph_within"] == 1
    tally = host_time_goals.tally(rows)
    assert [(t["world"], t["runs"], t["host_us_graph_all_within"], t["host_us_steady_all_within"],
             t["host_us_between_ops_runs"], t["host_us_between_ops_all_within"]) for t in tally] == [
        (2, 2, 1, 2, 1, 0), (8, 1, 0, 1, 0, 0)]
    splits = host_time_goals.by_host_speed(rows)
    assert [(x["world"], x["form"], x["fast_runs"], x["fast_up_to_us"], x["slower_runs"], x["slower_within"],
             x["slower_from_us"]) for x in splits] == [
        (2, ".graph", 1, 8.0, 1, 0, 18.0),  # met on the fast host (8 us), not on the slow one (18 us)
        (2, "between a step's ops", 0, None, 1, 0, 8.0),  # missed on the only run that measured it
        (8, ".graph", 0, None, 1, 0, 19.0)]  # steady: met in every run, no split
    text = host_time_goals.markdown({"tag": "cpu", "rows": rows, "tally": tally, "by_host_speed": splits})
    assert ("host, world 2, .graph: every row within on the 1 fastest hosts (torch.mm launched in up to 8.0 us); "
            "from the first that missed it (18.0 us) on, in 0 of 1 runs.") in text
    assert "host, world 8, .graph: not every row within on the fastest host" in text
    text = host_time_goals.markdown({"tag": "cpu", "rows": rows, "tally": tally})
    assert "host, world 2 (2 runs): .graph every row within in 1 of 2 runs" in text
    assert "| 1/2 (max 61) |" in text and "On the H200 alone" not in text
    on_h200 = host_time_goals.tally([r for r in rows if r["card"] == host_time_goals.GOAL_CARD])
    text = host_time_goals.markdown({"tag": "cpu", "rows": rows, "tally": tally, "tally_goal_card": on_h200})
    assert ("* h200: host, world 2 (1 runs): .graph every row within in 0 of 1 runs; steady every row within in 1 of "
            "1 runs.") in text
    assert "* h200: host, world 8 (1 runs): .graph every row within in 0 of 1 runs" in text  # 149 and 151 us


def test_the_committed_host_time_goals_cover_every_committed_default_path_run():
    """benchmarks/results/host_time_goals/host_time_goals-cpu.json is rerun whenever a fused_host_time
    run of the default path is committed (``python benchmarks/host_time_goals.py``): its rows are the
    committed runs' as read now."""
    host_time_goals = _bench("host_time_goals")
    committed = json.loads((BENCH / "results" / "host_time_goals" / "host_time_goals-cpu.json").read_text())
    fresh = host_time_goals.collect()
    stale = "stale: rerun python benchmarks/host_time_goals.py"
    assert [r["run"] for r in committed["rows"]] == [r["run"] for r in fresh], stale
    assert committed["rows"] == fresh, stale


def test_cold_host_probe_times_the_first_work_after_the_wait_apart_from_the_steady(monkeypatch):
    """``cold_host_probe``: after the barrier and the wait, the first call is timed alone and the
    steady figure is the median of the calls after it (a first call 3 ms slower shows as such)."""
    probe = _bench("cold_host_probe")
    now = _stand_in_clock(monkeypatch, probe)
    calls, waited = [], []

    class Barrier:
        def wait(self):
            waited.append("barrier")

    def work():  # 3 ms right after the wait, then 10 us
        calls.append(len(waited))
        now[0] += 3e-3 if len(calls) == 1 else 1e-5

    first, steady = probe._one_round(Barrier(), lambda: waited.append("wait"), work)
    assert waited == ["barrier", "wait"] and len(calls) == 1 + probe.STEADY_CALLS
    assert first == pytest.approx(3000) and steady == pytest.approx(10), (first, steady)


def test_cold_host_probe_runs_pinned_processes_and_writes_every_condition(tmp_path):
    """One real run on the CPU (one process, no CUDA, one round): a row per wait, gap and work, the
    first and steady figures positive, the summary at the longest wait, both files written."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(BENCH / "cold_host_probe.py"), "--worlds", "1", "--cuda", "off",
                           "--rounds", "1", "--tag", "cpu-test", "--out-dir", str(tmp_path)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = _bench("cold_host_probe")
    payload = json.loads((tmp_path / "cold_host_probe-cpu-test.json").read_text())
    rows = payload["worlds"][0]["rows"]
    assert len(rows) == len(probe.WAITS_PLAIN) * len(probe.GAPS_MS) * 3
    assert {(r["wait"], r["gap_ms"], r["work"]) for r in rows} == {
        (w, g, k) for w in probe.WAITS_PLAIN for g in probe.GAPS_MS for k in ("loop", "dense", "walk")}
    assert all(r["first_us"] > 0 and r["steady_us"] > 0 and not r["cuda"] for r in rows)
    text = (tmp_path / "cold_host_probe-cpu-test.md").read_text()
    assert "* walk, no CUDA, wait spin 10 ms: world 1 " in text and "| 1 | no | sleep | 10.000 | walk |" in text


def test_cold_host_probe_says_a_worker_that_died_at_once(monkeypatch):
    """A worker that fails (here: asked for no rounds, so it has no rows to give) ends the run with an
    error naming its exit code within seconds, not after waiting for its rows."""
    import time

    monkeypatch.syspath_prepend(str(BENCH))  # the spawned worker imports the probe by name
    probe = _bench("cold_host_probe")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"world 1: a worker failed \(exit codes \[1\]\)"):
        probe.run_world(1, False, 0)
    assert time.monotonic() - start < 60


def test_cold_host_probe_waits_for_the_gpu_by_synchronize_or_by_polling(monkeypatch):
    """The CUDA waits (run on a GPU only): the GPU sleeps the gap's cycles, then the host synchronizes
    (``sync``) or polls the stream until it is done and then synchronizes (``poll``)."""
    monkeypatch.syspath_prepend(str(BENCH))
    probe = _bench("cold_host_probe")
    seen = []

    class Stream:
        def __init__(self):
            self.queries = 0

        def query(self):
            self.queries += 1
            seen.append("query")
            return self.queries >= 3

    monkeypatch.setattr(probe, "sleep_cycles_per_ms", lambda: 1000.0)  # the GPU's clock
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: seen.append(("sleep", cycles)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    probe._waiter("sync", 2e-3)()
    assert seen == [("sleep", 2000), "synchronize"]
    seen.clear()
    probe._waiter("poll", 10e-3)()
    assert seen == [("sleep", 10000), "query", "query", "query", "synchronize"]


@pytest.mark.parametrize("argv,said", [(["--rounds", "0"], "at least 1"), (["--worlds", "1,0"], "at least 1"),
                                       (["--worlds", "two"], "comma-separated process counts")])
def test_cold_host_probe_refuses_counts_it_cannot_run(argv, said, capsys):
    """A bad count is a one-line usage error before any process starts."""
    probe = _bench("cold_host_probe")
    with pytest.raises(SystemExit) as stop:
        probe.main(argv)
    assert stop.value.code == 2 and said in capsys.readouterr().err


def test_suite_cost_sorts_g_plus_plus_calls_by_kind_and_reads_pytests_summary(tmp_path):
    """suite_cost's parts without a suite: the timed g++ runs the real compiler and logs the call, the
    calls Inductor and the fast path's build make are told apart, pytest's summary and slowest tests read."""
    suite_cost = _bench("suite_cost")
    wrapper = suite_cost.timed_compiler(tmp_path)
    if wrapper is None:
        pytest.skip("no g++ on this machine")
    log = tmp_path / "gxx.log"
    proc = subprocess.run([str(wrapper), "--version"], env=dict(os.environ, COMPASS_SUITE_GXX_LOG=str(log)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "g++" in proc.stdout.lower() + proc.stderr.lower(), proc
    ms, args = log.read_text().split(" ", 1)
    assert int(ms) >= 0 and args.strip() == "--version"
    log.write_text("\n".join([
        "700 /tmp/x/torchinductor_root/gv/cgvf24.main.cpp -D TORCH_INDUCTOR_CPP_WRAPPER -O3 -o /tmp/x/cgvf24.main.so",
        "4351 -x c++-header /tmp/x/torchinductor_root/precompiled_headers/cq.h -D TORCH_INDUCTOR_CPP_WRAPPER",
        "135 /tmp/x/tmpjhl9soto/header.hpp -D TORCH_INDUCTOR_CPP_WRAPPER -E",
        "12000 -MMD -MF lane.o.d -DTORCH_EXTENSION_NAME=compass_lane -c /repo/compass_fx/kernels/cuda/lane.cpp -o lane.o",
        "7 --version"]) + "\n")
    got = suite_cost.builds(log)
    assert {k: v["count"] for k, v in got.items()} == {"Inductor kernel": 1, "precompiled header": 2,
                                                        "fast path extension": 1, "other": 1}
    assert got["precompiled header"]["seconds"] == pytest.approx(4.486)
    text = ("....\n============ slowest 2 durations ============\n"
            "9.61s call     tests/test_a.py::test_one[2]\n0.50s setup    tests/test_a.py::test_two\n"
            "===== 12 passed, 1 skipped, 2 warnings in 17.97s =====\n")
    assert suite_cost.outcome(text) == "12 passed, 1 skipped, 2 warnings"
    assert suite_cost.slowest(text) == [{"seconds": 9.61, "phase": "call", "test": "tests/test_a.py::test_one[2]"},
                                        {"seconds": 0.5, "phase": "setup", "test": "tests/test_a.py::test_two"}]
    assert suite_cost.outcome("Traceback ...\nImportError: no module\n") == "ImportError: no module"


def test_suite_cost_runs_a_module_and_writes_what_it_cost(tmp_path, capsys):
    """A real module through suite_cost (its main called here: only the module's pytest is a process of
    its own): its run, the machine's CPU read around it, the files; a module out of time; a bad path."""
    suite_cost = _bench("suite_cost")
    assert suite_cost.main(["tests/test_cpu_power.py", "--slowest", "2", "--tag", "cpu-test",
                            "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "suite_cost-cpu-test.json").read_text())
    (row,) = data["modules"]
    assert row["module"] == "tests/test_cpu_power.py" and row["status"] == 0, row
    assert row["outcome"].endswith("passed") and len(row["slowest"]) <= 2
    assert row["cpu_s"] is None or row["cpu_s"] >= 0
    assert data["totals"]["builds"]["Inductor kernel"]["count"] == 0  # nothing of it compiles
    md = (tmp_path / "suite_cost-cpu-test.md").read_text()
    assert md.startswith("# suite_cost (cpu-test)") and "tests/test_cpu_power.py" in md
    assert suite_cost.main(["tests/test_cpu_power.py", "--timeout-s", "0.5", "--tag", "cpu-late",
                            "--out-dir", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "suite_cost-cpu-late.json").read_text())["modules"]
    assert row["status"] is None and row["outcome"] == "timed out after 0.5 s", row
    # The collector timed in every process, here with CPython's own settings in the tests.
    assert suite_cost.main(["tests/test_cpu_power.py", "--collector", "--collector-defaults", "--tag", "cpu-gc",
                            "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "suite_cost-cpu-gc.json").read_text())
    (row,) = data["modules"]
    assert row["status"] == 0 and data["collector_defaults"] is True, row
    timed = row["collector"]
    assert timed["processes"] >= 1 and timed["collections"] > 0 and timed["seconds"] >= 0, timed
    assert data["totals"]["collector_s"] == timed["seconds"]
    md = (tmp_path / "suite_cost-cpu-gc.md").read_text()
    assert "with CPython's own settings" in md and "| collector s |" in md, md
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        suite_cost.main(["tests/no_such_test.py"])
    assert bad.value.code == 2 and "no such test file" in capsys.readouterr().err


def test_replay_scale_says_from_which_step_every_call_is_issued_from_c_and_whether_outputs_recur():
    scale = _bench("fused_replay_scale")
    assert scale.settled_step([0, 0, 61, 61], 61) == 3
    assert scale.settled_step([61, 30, 61, 61], 61) == 3  # a step that fell back starts the count again
    assert scale.settled_step([61, 61, 30], 61) is None  # the last step fell back: not settled
    addresses = [[10, 20], [30, 40], [10, 20]]  # each layer's output alternating between two addresses
    assert scale.same_share(addresses, 1) == 0.0 and scale.same_share(addresses, 2) == 1.0
    assert scale.same_share(addresses[:1], 1) is None
    assert scale.latest([3, 5]) == 5 and scale.latest([3, None]) is None
    with pytest.raises(SystemExit, match="at least 3"):
        scale.main(["--steps", "2"])


def test_replay_scale_case_bookkeeping_on_stand_ins(monkeypatch):
    """fused_replay_scale's case loop (per-step captures and calls from C, settled step, recurring
    addresses, a step's host and GPU time, the GPU's lag) on the CPU: the operator, CUDA's events and
    synchronize, the group and the replay counters are stand-ins; the loop and its figures are the
    script's own (on a GPU they run against the real operators)."""
    from compass_fx.kernels.cuda import replay

    scale = _bench("fused_replay_scale")
    layers, steps, calls = 3, 5, []
    monkeypatch.setattr(replay, "stats", dict(replay.stats))

    def fake_graph(a, b, schedule, group, world):
        """Captures in the first two steps, then every call from C (as a settled workspace)."""
        step = len(calls) // layers
        calls.append(step)
        replay.stats["replayed"] += 1
        replay.stats["captured" if step < 2 else "lane"] += 1
        return a @ b

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = len(calls)

        def elapsed_time(self, end):
            return float(end.at - self.at)  # "ms": the calls between the two records

    cuda = SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None, memory_reserved=lambda: 0, Event=Event)

    class Torch:  # the real torch but for its CUDA calls and the operators
        ops = SimpleNamespace(compass=SimpleNamespace(matmul_all_reduce=SimpleNamespace(graph=fake_graph)))

        def __getattr__(self, name):
            return getattr(torch, name)

    Torch.cuda = cuda
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(4, 4, generator=g) for _ in range(layers)]
    a = torch.randn(8, 4, generator=g)
    monkeypatch.setattr(scale, "torch", Torch())
    monkeypatch.setattr(scale, "stress", SimpleNamespace(operands=lambda kind, m, n, k, world, rank, layer:
                                                         (a, weights[layer]),
                                                         reference=lambda kind, m, n, k, world, rank, layer:
                                                         [a @ weights[layer]]))
    monkeypatch.setattr(scale, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=SimpleNamespace(group_name="g")),
                                                       barrier=lambda: None))
    r = scale.run_case(0, 2, "matmul_all_reduce", layers, 8, steps)
    assert r["status"] == "pass" and r["relative_error"] == 0.0
    assert r["captures_by_step"] == [3, 3, 0, 0, 0] and r["from_c_by_step"] == [0, 0, 3, 3, 3]
    assert r["settled_step"] == 3 and r["replayed"] == 1.0 and r["from_c"] == 1.0
    assert r["host_ms_per_step"] > 0 and r["gpu_ms_per_step"] == layers and r["gpu_behind_ms"] >= 0
    assert 0.0 <= r["same_outputs_as_step_before"] <= 1.0 and len(calls) == layers * steps


def test_funcol_gloo_inflight_takes_variants_and_gloo_threads():
    """The options that pick variants and the groups' worker threads: known names only, counts
    positive, ``default`` meaning torch's own; the markdown names the threads of each row."""
    bench = _bench("funcol_gloo_inflight")
    assert bench._variants("funcol:2, funcol:4") == (("functional all_gather", "funcol", 2),
                                                     ("functional all_gather", "funcol", 4))
    assert bench._threads("default,1,3") == [None, 1, 3]
    for bad in ("funcol:3", "nccl:4", ""):
        with pytest.raises(Exception, match="unknown variants"):
            bench._variants(bad)
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(Exception, match="neither 'default' nor a positive count"):
            bench._threads(bad)
    rows = [{"op": "functional all_gather", "in_flight": 4, "gloo_threads": g, "run": 1, "status": s,
             "calls_reached": n, "seconds": 1.0} for g, s, n in (("default", "killed by signal 6", 900),
                                                                 (1, "clean", 10000))]
    text = bench.markdown({"tag": "t", "environment": {"torch": "x"}, "calls": 10000, "rows": rows})
    assert "| gloo threads |" in text and "| 4 | default | 1 | killed by signal 6 | 900 |" in text \
        and "| 4 | 1 | 1 | clean | 10000 |" in text, text
