"""The cost model's two software constants fitted to the operator grids measured on a machine (no
GPU needed: it re-prices the committed grids).

Why: the model predicts each candidate from hardware figures plus two software costs that no
datasheet gives and that the grids (``multigpu_operators.py``, every candidate measured) pin down:

* ``part_overhead_s`` (``GpuSpec``): what each extra InterDecom part costs, the A term of
  T(d) = A*d + B + C/d.  Judged on the decompose candidates: how often the model's best part count
  is within 3% of the best measured one, then the median |predicted - measured| / measured.
* ``FUSED_HOST_CALL_REST_S`` (``cost.strategies``): the host's fixed work in one fused call issued
  command by command (as the grids measured them), besides the custom op's dispatch.  A small
  fused call is host-bound, so this decides whether the model sees the fused operators lose on
  small pairs.  Judged on the picks with the fused operators
  priced: the worst regression against sequential, then the hit rate (the pick within 3% of the
  best measured candidate).

For each constant the script re-prices every grid with each candidate value (the other constant
as in the code) and reports the measures per grid; the best value is the one best on all grids
together.  ``tests/test_bench_scripts.py`` checks that the code's constants are these values.
The replayed fused call's host constants (``FUSED_REPLAY_CALL_S``, ``FUSED_REPLAY_SLOW_NODE_S`` and
the launches alone they were fitted with, ``_REPLAY_FITTED_LAUNCH_S``) are fitted here too, to the
steady host times (each call issued while the ones before it run, as a step issues them) of 2, 4
and 8 ranks sharing one H200 in the committed ``fused_host_time.py`` runs (``--replay-runs``,
both transports): each run's times at each world scaled to the median launches (the median ratio
of its launches to those, as a calibration scales the constants), then one least-squares line in
the replay graph's slow nodes (copies to or from host memory, stream waits).  A call of two graphs
(the ring schedules' all-reduce, issued from C as one call) pays ``FUSED_REPLAY_GRAPH_S`` for its
second, fitted to the runs that hold such calls (``--replay-graph-runs``) against their one-graph
calls of the same rounds (``fit_replay_graph``).  A deferred call (``fused_async``'s ``*_start``,
replayed on a stream of its own) pays ``FUSED_DEFERRED_S`` beyond a replayed call, fitted to the runs
that time the asynchronous form (``--deferred-runs``, ``fit_deferred``).
Then the grids are repriced as the code prices now: eager fused calls
replayed from captured CUDA graphs at those constants.

    python benchmarks/fit_model_constants.py      # the committed h200x2 grids, both regimes
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402

NAME = "model_constants_fit"
PART_OVERHEAD_US = (182, 120, 70, 50, 30, 20, 10, 5)
FUSED_CALL_REST_US = (38, 100, 200, 300, 400, 500, 600, 800)
# the default fused path timed on one H200 since replayed calls are issued from C (kernels/cuda/lane.cpp),
# each with the steady column, on two machine starts (2026-12-05): host-staged at two ranks (three runs),
# four and eight ranks (two), the peer transport at four and eight ranks and on the "direct" schedule at
# 2, 4, 8 (twice; the ring schedules' runs held all-reduces issued from Python)
REPLAY_RUNS = ("fused_host_time-h200-lane-w2-steady-run1-host-pin-mps.json",
               "fused_host_time-h200-lane-w2-steady-run2-host-pin-mps.json",
               "fused_host_time-h200-lane-w48-breakdown-host-pin-mps.json",
               "fused_host_time-h200-lane-peer-w48-pin-mps.json",
               "fused_host_time-h200-wake-w2-base-host-pin-mps.json",
               "fused_host_time-h200-wake-w8-base-host-pin-mps.json",
               "fused_host_time-h200-schedule-direct-run1-peer-pin-mps.json",
               "fused_host_time-h200-schedule-direct-run2-peer-pin-mps.json")
REPLAY_WORLDS = (2, 4, 8)
# held out of the fit: the same default path timed on an H200 on 2026-12-05 (eighteenth session, code af43135,
# one machine start): host-staged at two ranks (three runs), four and eight, the peer transport's "direct" at
# 2, 4, 8 and at two again
CHECK_RUNS = ("fused_host_time-h200-check-w2-breakdown-host-pin-mps.json",
              "fused_host_time-h200-phases-w2-run2-host-pin-mps.json",
              "fused_host_time-h200-lane-w2-steady-run3-host-pin-mps.json",
              "fused_host_time-h200-check-w48-host-pin-mps.json",
              "fused_host_time-h200-schedule-direct-peer-pin-mps.json",
              "fused_host_time-h200-phases-peer-w2-run2-pin-mps.json")
# the calls of two replay graphs (the ring schedules' all-reduce) issued from C as one call, with the
# one-graph operators of the same rounds as their host's baseline: three runs of each ring schedule at
# 2, 4, 8 ranks on the peer transport (2026-12-05, on an H100: the service lent no H200 for them)
REPLAY_GRAPH_RUNS = tuple(f"fused_host_time-h100-schedule-{schedule}-lane-run{run}-peer-pin-mps.json"
                          for schedule in ("ring", "double_ring") for run in (1, 2, 3))

# fused_async's asynchronous form (start, a GEMM, wait_tensor) with deferred calls replayed, beside the
# .graph call and a torch.mm of the same rounds: the reductions at 2 ranks on both transports, two machine
# starts of one H100 each (2026-12-06: no H200 started).  The first two runs called the start and the wait
# through their packets (the dispatcher), the last two through the .default overloads rewritten graphs call
# (and timed the packets beside: no less, fused_host_time-h100-deferred-default-*).  The runs at 4 and 8
# ranks (-async-w48-) predate the start's direct entry: beyond the call 203-227 us against 190 at two ranks
# in the same code, so the extra does not grow much with the ranks
DEFERRED_RUNS = ("fused_host_time-h100-async-entry-w2-host-pin-mps.json",
                 "fused_host_time-h100-async-entry-peer-w2-pin-mps.json",
                 "fused_host_time-h100-deferred-default-w2-host-pin-mps.json",
                 "fused_host_time-h100-deferred-default-peer-w2-pin-mps.json")


@contextlib.contextmanager
def _priced(part_overhead_s: float | None = None, fused_call_rest_s: float | None = None):
    """The cost model with one of its software constants replaced."""
    import compass_fx.cost.strategies as strategies

    real_spec, real_rest, real_call = (strategies.gpu_spec, strategies.FUSED_HOST_CALL_REST_S,
                                       strategies.FUSED_HOST_CALL_S)
    real_replayed = strategies.FUSED_CALLS_REPLAYED
    strategies.FUSED_CALLS_REPLAYED = False  # the grids were measured with every command issued from Python
    if part_overhead_s is not None:
        strategies.gpu_spec = lambda gpu: dataclasses.replace(real_spec(gpu), part_overhead_s=part_overhead_s)
    if fused_call_rest_s is not None:  # the uncalibrated per-call cost moves with it
        strategies.FUSED_HOST_CALL_REST_S = fused_call_rest_s
        strategies.FUSED_HOST_CALL_S = real_call - real_rest + fused_call_rest_s
    try:
        yield
    finally:
        strategies.gpu_spec, strategies.FUSED_HOST_CALL_REST_S = real_spec, real_rest
        strategies.FUSED_HOST_CALL_S = real_call
        strategies.FUSED_CALLS_REPLAYED = real_replayed


def evaluate(grid: dict) -> dict:
    """The decompose predictions and the picks (fused priced as in the grid) of one grid, priced
    with the model as it stands (inside :func:`_priced`)."""
    from compass_fx.cost import Workload, plan
    from compass_fx.cost.decision import SCHEDULES
    from compass_fx.machine.topology import Topology

    topo = Topology.from_dict(grid["topology"]["2"]["description"])
    fused = tuple(grid["topology"]["2"].get("fused_schedules") or SCHEDULES)
    errors, d_hits, pick_hits, regressions, pick_errors = [], 0, 0, [], []
    for row in grid["rows"]:
        measured = {label: c["measured_s"] for label, c in row["candidates"].items() if c.get("measured_s")}
        w = Workload(row["kind"], row["m"], row["n"], row["k"], "bfloat16", row["group_size"])
        decision = plan(w, topo, fused_schedules=fused)
        decomposed = [c for c in decision.candidates if c.strategy == "decompose" and c.label in measured]
        errors += [abs(c.seconds - measured[c.label]) / measured[c.label] for c in decomposed]
        model_d = min(decomposed, key=lambda c: c.seconds)
        d_hits += measured[model_d.label] <= 1.03 * min(measured[c.label] for c in decomposed)
        picked = measured.get(decision.label)
        if picked is not None:
            pick_hits += picked <= 1.03 * min(measured.values())
            regressions.append(picked / measured["sequential"] - 1)
            pick_errors.append(abs(decision.predicted_s - picked) / picked)
    n = len(grid["rows"])
    return {"decompose_median_error": statistics.median(errors),
            "decompose_p90_error": sorted(errors)[int(0.9 * (len(errors) - 1))],
            "model_d_within_3pct": d_hits / n, "pick_hit_rate": pick_hits / n,
            "pick_median_error": statistics.median(pick_errors),
            "worst_regression_vs_sequential": max(regressions)}


def fit(grids: dict, constant: str, values_us: tuple[int, ...], rank) -> tuple[list[dict], int]:
    """Every grid priced with each value of ``constant``; the value whose rows ``rank`` orders
    first (a sort key over the value's rows, all grids)."""
    rows = []
    for us in values_us:
        with _priced(**{constant: us * 1e-6}):
            rows += [{"constant": constant, "value_us": us, "grid": name, **evaluate(grid)}
                     for name, grid in grids.items()]
    best = min(values_us, key=lambda us: rank([r for r in rows if r["value_us"] == us]))
    return rows, best


def _part_overhead_rank(rows: list[dict]) -> tuple:
    return (-statistics.mean(r["model_d_within_3pct"] for r in rows),
            statistics.mean(r["decompose_median_error"] for r in rows))


def _fused_call_rank(rows: list[dict]) -> tuple:
    return (round(max(r["worst_regression_vs_sequential"] for r in rows), 3),
            -statistics.mean(r["pick_hit_rate"] for r in rows))


@contextlib.contextmanager
def _replay_priced(call_s: float, node_s: float, launch_s: dict[str, float]):
    """The cost model with other replay constants (``cost.strategies.FUSED_REPLAY_*``, and the
    launches alone on the host they were fitted on, which a calibration scales them by)."""
    import compass_fx.cost.strategies as strategies

    real = strategies.FUSED_REPLAY_CALL_S, strategies.FUSED_REPLAY_SLOW_NODE_S, strategies._REPLAY_FITTED_LAUNCH_S
    strategies.FUSED_REPLAY_CALL_S, strategies.FUSED_REPLAY_SLOW_NODE_S = call_s, node_s
    strategies._REPLAY_FITTED_LAUNCH_S = {**real[2], **launch_s}
    try:
        yield
    finally:
        strategies.FUSED_REPLAY_CALL_S, strategies.FUSED_REPLAY_SLOW_NODE_S, strategies._REPLAY_FITTED_LAUNCH_S = real


def _replay_plans(row: dict, world: int, host: bool, most_pieces: int = 0, schedule: str = "direct") -> tuple:
    """Rank 0's plans of one case, a replay graph each, as the run captured them (``most_pieces``,
    ``schedule``: as it cut and scheduled them)."""
    from compass_fx.kernels.issue_order import call_plans

    cols = row["k"] if row["op"] == "all_gather_matmul" else row["n"]
    plans = call_plans(row["op"], schedule, world, 0, row["rows"], cols, 1, 2, host=host, most_pieces=most_pieces)
    if row["op"] == "matmul_all_reduce" and host and world == 2 and row.get("commands") is not None \
            and _census(plans) != _census_of(row["commands"]):
        plans = (_reduce_scatter_then_gather(row["rows"], cols, most_pieces),)  # what runs before 2026-12-04 captured
    return plans


def _slow_nodes(row: dict, world: int, host: bool, batched_waits: bool, most_pieces: int = 0,
                schedule: str = "direct") -> int:
    """The slow nodes (:func:`compass_fx.cost.strategies.replay_slow_nodes`) of one case's replay
    graphs (:func:`_replay_plans`) as the model prices them (``batched_waits``: as the run waited)."""
    from compass_fx.cost.strategies import replay_slow_nodes

    plans = _replay_plans(row, world, host, most_pieces, schedule)
    return sum(replay_slow_nodes(plan, host, batched_waits) for plan in plans)


ORDERING = ("Record", "WaitEvent")  # a plan's events: no node of the work (the two-rank plan gained some)


def _census(plans) -> dict[str, int]:
    """Commands by kind, as ``fused_host_time`` records them per case, less the events (which
    order the work and cost the launch next to nothing: the one-round all-reduce's slot reuse
    added some without changing the plan's work)."""
    return _census_of(collections.Counter(type(c).__name__ for plan in plans for c in plan.commands))


def _census_of(commands: dict[str, int]) -> dict[str, int]:
    return {kind: n for kind, n in commands.items() if kind not in ORDERING}


def _reduce_scatter_then_gather(rows: int, cols: int, most_pieces: int):
    """The two-rank host-staged all-reduce as it was before it became one round
    (``protocol.all_reduce_pair_plan``): a reduce-scatter then a gather of the sums, chunks whose
    blocks are one host piece each."""
    from compass_fx.kernels import protocol as pr

    most = pr.host_most_pieces(2, most_pieces)
    chunks = pr.all_reduce_chunks(rows, 2, most, rows * cols * 2, 2 * pr.host_piece_bytes())
    return pr.host_staged(pr.all_reduce_plan(2, 0, rows, chunks))


def _run_most_pieces(run: dict, world: int) -> int:
    """At most how many host-staged pieces a block the run cut at ``world`` ranks: what it recorded
    per world; runs before that name the setting alone (0: by the ranks, then 8 a block at two
    ranks, 4 at four, 2 beyond), runs before the cap by ranks nothing (8 a block)."""
    by_world = run.get("host_most_pieces_by_world", {}).get(str(world))
    if by_world:
        return by_world
    setting = run.get("host_most_pieces", 8)
    return setting or max(2, min(8, 16 // world))


REPLAY_COLUMNS = ("host_us_graph", "host_us_steady")


def _run_at(run: dict, world: int, reference: dict[str, float]) -> tuple[float, bool, int, str]:
    """How a ``fused_host_time.py`` run measured at ``world``: its launch speed against the launches
    ``reference`` (as a calibration scales the constants), whether host-staged (where it names no
    transport), its pieces' cap and its schedule ("direct" where it names none: runs before
    fused_host_time --schedule timed it)."""
    from compass_fx.cost.strategies import _launch_speed

    _, speed = _launch_speed({"launch_s": run["launch_us"][str(world)]}, reference)
    return speed, run.get("transport", "host") == "host", _run_most_pieces(run, world), run.get("schedule", "direct")


def _replay_points(runs: dict[str, dict], worlds: tuple[int, ...], column: str,
                   reference: dict[str, float] | None = None) -> tuple[list[tuple], dict[str, float]]:
    """Each case of ``runs`` at ``worlds`` as (slow nodes, host us in ``column`` scaled by its run's
    launch speed at that world, transport, world), and the launches alone it is scaled to:
    ``reference`` where given (a fit's, to price other runs as a calibration would scale the
    constants), else the median over the runs' and worlds' launches of each kind."""
    launches = {(name, world): run["launch_us"][str(world)]
                for name, run in runs.items() for world in worlds if str(world) in run.get("launch_us", {})}
    if not launches:
        raise SystemExit(f"fit_replay: no run of {list(runs)} measured worlds {list(worlds)}")
    if reference is None:
        kinds = sorted(set.intersection(*(set(l) for l in launches.values())))
        reference = {k: round(statistics.median(l[k] for l in launches.values()), 2) for k in kinds}
    points = []
    for name, world in launches:
        run = runs[name]
        speed, host, most, schedule = _run_at(run, world, reference)
        batched = run.get("replay_waits", "stream") == "batch"  # runs before batched waits name none
        points += [(_slow_nodes(r, world, host, batched, most, schedule), r[column] / speed,
                    "host" if host else "peer", world)
                   for r in run["rows"] if r["world"] == world and r.get(column)]
    return points, reference


def _priced_against(points: list[tuple], call_us: float, node_us: float, worlds: tuple[int, ...]) -> dict:
    """How ``call_us`` + ``node_us`` per slow node prices ``points``: the error's median and 90th
    percentile, and the median priced / measured per transport and per world."""
    def priced_over_measured(keep) -> list[float]:
        return sorted((call_us + node_us * x) / y for x, y, t, w in points if keep(t, w))

    by_transport = {t: priced_over_measured(lambda tt, w: tt == t) for t in ("host", "peer")}
    by_world = {str(world): priced_over_measured(lambda t, w: w == world) for world in worlds}
    errors = sorted(abs(r - 1) for r in priced_over_measured(lambda t, w: True))
    return {"worlds": [w for w in worlds if by_world[str(w)]], "points": len(points),
            "median_error": statistics.median(errors), "p90_error": errors[int(0.9 * (len(errors) - 1))],
            "median_priced_over_measured": {t: r[len(r) // 2] for t, r in by_transport.items() if r},
            "median_priced_over_measured_by_world": {w: r[len(r) // 2] for w, r in by_world.items() if r}}


def fit_replay(runs: dict[str, dict], worlds: tuple[int, ...] = (2, 4, 8), column: str = "host_us_steady") -> dict:
    """The replayed fused call's host constants fitted to ``fused_host_time.py`` runs (name ->
    payload): each case's host time at the ``worlds`` a run measured, in ``column`` (the steady
    one by default: each call issued while the ones before it run, as a step issues them, what a
    host that sets the pace pays per call; ``host_us_graph``, each call after a wait for an idle
    GPU, costs the first call after a wait, 2-12x), scaled by its run's launch speed at that world
    (the median over command kinds of the launch alone / the median launch of that kind over every
    run and world: what :func:`compass_fx.cost.strategies._launch_speed` does with a calibration),
    fitted by least squares as per-call + per-slow-node * slow nodes (a run's transport: its
    ``transport``, host-staged where it names none; its schedule, "direct" where it names none).
    One line for every world: the replay graph's slow nodes carry what grows with the ranks.
    Rounded as the code holds them: the launches to 0.01 us, the call to 1 us, the node to 0.01 us."""
    points, reference = _replay_points(runs, worlds, column)
    if len(points) < 2:
        raise SystemExit(f"fit_replay: {len(points)} case(s) with {column} at worlds {list(worlds)} in {list(runs)}")
    mean_x = statistics.fmean(p[0] for p in points)
    mean_y = statistics.fmean(p[1] for p in points)
    slope = (sum((p[0] - mean_x) * (p[1] - mean_y) for p in points)
             / sum((p[0] - mean_x) ** 2 for p in points))
    call_us, node_us = round(mean_y - slope * mean_x), round(slope, 2)
    return {"runs": list(runs), "column": column, "call_us": call_us, "node_us": node_us, "launch_us": reference,
            **_priced_against(points, call_us, node_us, worlds)}


def check_replay(runs: dict[str, dict], call_us: float, node_us: float, launch_us: dict[str, float],
                 worlds: tuple[int, ...] = (2, 4, 8), column: str = "host_us_steady") -> dict:
    """How a fit's constants (``call_us`` + ``node_us`` per slow node on a host with ``launch_us``)
    price runs it was not fitted to, each scaled by its launches as a calibration would scale the
    constants: the held-out test of :func:`fit_replay`."""
    points, _ = _replay_points(runs, worlds, column, launch_us)
    if not points:
        raise SystemExit(f"check_replay: no case with {column} at worlds {list(worlds)} in {list(runs)}")
    return {"runs": list(runs), "column": column, **_priced_against(points, call_us, node_us, worlds)}


def fit_replay_graph(runs: dict[str, dict], launch_us: dict[str, float], call_us: float, node_us: float,
                     worlds: tuple[int, ...] = (2, 4, 8), column: str = "host_us_steady") -> dict:
    """The host cost of a replay graph beyond a call's first (``FUSED_REPLAY_GRAPH_S``), from
    ``fused_host_time.py`` runs that hold calls of several graphs (the ring schedules' all-reduce):
    each case's time in ``column`` scaled to the launches ``launch_us`` (as :func:`fit_replay`), its
    excess over ``call_us + node_us * slow nodes``; per run and world, the several-graph cases'
    median excess per extra graph less the one-graph cases' median excess (their host's baseline,
    which the launches alone scale only roughly: other machines, other starts); the median of those."""
    from compass_fx.cost.strategies import replay_slow_nodes

    differences = []
    for name, run in runs.items():
        for world in worlds:
            if str(world) not in run.get("launch_us", {}):
                continue
            speed, host, most, schedule = _run_at(run, world, launch_us)
            excess: dict[int, list[float]] = collections.defaultdict(list)  # by graphs
            for r in run["rows"]:
                if r["world"] != world or not r.get(column):
                    continue
                plans = _replay_plans(r, world, host, most, schedule)
                slow = sum(replay_slow_nodes(plan, host, True) for plan in plans)  # calls from C: waits batched
                excess[len(plans)].append((r[column] / speed - call_us - node_us * slow, len(plans) - 1))
            if excess.get(1) and len(excess) > 1:
                baseline = statistics.median(e for e, _ in excess[1])
                several = [(e - baseline) / extra for graphs, cases in excess.items() if graphs > 1
                           for e, extra in cases]
                differences.append({"run": name, "world": world, "per_extra_graph_us": round(statistics.median(several), 1),
                                    "cases": len(several)})
    if not differences:
        raise SystemExit(f"fit_replay_graph: no run of {list(runs)} holds calls of several graphs beside one-graph ones")
    per_graph = [d["per_extra_graph_us"] for d in differences]
    return {"runs": list(runs), "column": column, "graph_us": round(statistics.median(per_graph)),
            "spread_us": [min(per_graph), max(per_graph)], "by_run_and_world": differences}


def fit_deferred(runs: dict[str, dict]) -> dict:
    """What a deferred call costs the host beyond a replayed one (``FUSED_DEFERRED_S``): per run and
    world, the median over its cases of the asynchronous form's time (start, a GEMM, wait_tensor) less
    the ``.graph`` call's and a ``torch.mm``'s of the same rounds (the GEMM's launch), all three timed
    after the device went idle; the median of those.  After an idle device a call costs more than
    while a step keeps the host ahead (what the replay constants are fitted to), so this is the
    asynchronous form's extra at its dearest."""
    by_run_and_world = []
    for name, run in runs.items():
        for world in sorted({r["world"] for r in run["rows"]}):
            extra = [r["host_us_async"] - r["host_us_graph"] - r["host_us_mm"] for r in run["rows"]
                     if r["world"] == world and r.get("host_us_async") and r.get("host_us_graph") and r.get("host_us_mm")]
            if extra:
                by_run_and_world.append({"run": name, "world": world, "extra_us": round(statistics.median(extra), 1),
                                         "cases": len(extra)})
    if not by_run_and_world:
        raise SystemExit(f"fit_deferred: no run of {list(runs)} times the asynchronous form beside the .graph call")
    extras = [d["extra_us"] for d in by_run_and_world]
    return {"runs": list(runs), "deferred_us": round(statistics.median(extras)), "spread_us": [min(extras), max(extras)],
            "by_run_and_world": by_run_and_world}


def strategies_replay_call_us() -> float:
    """The replayed fused call's fixed host work the code prices with (calibrated where a
    calibration is in force)."""
    from compass_fx.cost.strategies import fused_replay_costs

    return fused_replay_costs().call_s * 1e6


def _check_lines(check: dict, replay_fit: dict) -> list[str]:
    """The markdown of the held-out runs priced with the fit's constants."""
    return [f"### Held out: {check['points']} cases of runs not fitted, priced with {replay_fit['call_us']} us + "
            f"{replay_fit['node_us']} us per slow node (each run scaled by its launches): median error "
            f"{check['median_error']:.1%}, p90 {check['p90_error']:.1%}; priced / measured, median: "
            + ", ".join(f"{t} {v:.2f}" for t, v in check["median_priced_over_measured"].items()) + "; by ranks: "
            + ", ".join(f"{w}: {v:.2f}" for w, v in check["median_priced_over_measured_by_world"].items()), "",
            f"Runs: {', '.join(check['runs'])}.", ""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", default="multigpu_operators-h200x2.json,multigpu_operators-h200x2-hoststaged.json",
                   help="grid JSON files under --results")
    p.add_argument("--results", default=str(output.RESULTS / "multigpu_operators"), help="where the grids are")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    p.add_argument("--tag", default="h200x2")
    p.add_argument("--replay-runs", default=",".join(REPLAY_RUNS),
                   help="fused_host_time JSON files (under --host-results) the replay constants are fitted to")
    p.add_argument("--replay-graph-runs", default=",".join(REPLAY_GRAPH_RUNS),
                   help="fused_host_time JSON files (under --host-results) with calls of several replay graphs, "
                        "that the cost of a graph beyond a call's first is fitted to")
    p.add_argument("--deferred-runs", default=",".join(DEFERRED_RUNS),
                   help="fused_host_time JSON files (under --host-results) timing the asynchronous form, that a "
                        "deferred call's cost beyond a replayed one is fitted to")
    p.add_argument("--check-runs", default=",".join(CHECK_RUNS),
                   help="fused_host_time JSON files (under --host-results) held out of the fit, that its constants "
                        "price as a test ('' for none)")
    p.add_argument("--replay-column", choices=REPLAY_COLUMNS, default="host_us_steady",
                   help="the runs' host time the replay constants are fitted to: issued while the ones before it "
                        "run (steady, as a step issues them), or each call after a wait for the GPU (.graph)")
    p.add_argument("--replay-worlds", default=",".join(map(str, REPLAY_WORLDS)),
                   help="the ranks sharing the GPU whose rows the replay constants are fitted to")
    p.add_argument("--host-results", default=str(output.RESULTS / "fused_host_time"),
                   help="where the fused_host_time runs are")
    p.add_argument("--replay-constants", default=None, metavar="CALL_US,NODE_US,LAUNCH_JSON",
                   help="also reprice with proposed replay constants: per call and per slow node (us), and the "
                        "launches alone (JSON of seconds per kind) on the host they were fitted on")
    args = p.parse_args(argv)
    def loaded(folder: str, names: str) -> dict[str, dict]:  # comma-separated JSON files under folder
        return {name: json.loads((Path(folder) / name).read_text()) for name in names.split(",")}

    grids = loaded(args.results, args.grids)
    worlds = tuple(int(w) for w in args.replay_worlds.split(","))
    replay_fit = fit_replay(loaded(args.host_results, args.replay_runs), worlds=worlds, column=args.replay_column)
    graph_fit = fit_replay_graph(loaded(args.host_results, args.replay_graph_runs), replay_fit["launch_us"],
                                 replay_fit["call_us"], replay_fit["node_us"], column=args.replay_column)
    deferred_fit = fit_deferred(loaded(args.host_results, args.deferred_runs))
    check = (check_replay(loaded(args.host_results, args.check_runs), replay_fit["call_us"], replay_fit["node_us"],
                          replay_fit["launch_us"], worlds, args.replay_column) if args.check_runs else None)
    part_rows, part_best = fit(grids, "part_overhead_s", PART_OVERHEAD_US, _part_overhead_rank)
    call_rows, call_best = fit(grids, "fused_call_rest_s", FUSED_CALL_REST_US, _fused_call_rank)
    # the grids repriced as the code prices now: eager fused calls replayed from captured graphs
    # (cost.strategies.FUSED_REPLAY_*, measured on one H200); the measurements are still those of calls
    # issued command by command, so where the host bound them the picks are judged against stale times
    replay_rows = [{"constant": "FUSED_REPLAY_CALL_S", "value_us": round(strategies_replay_call_us()), "grid": name,
                    **evaluate(grid)} for name, grid in grids.items()]
    proposed_rows = []
    if args.replay_constants:
        call_us, node_us, launch = args.replay_constants.split(",", 2)
        with _replay_priced(float(call_us) * 1e-6, float(node_us) * 1e-6, json.loads(launch)):
            proposed_rows = [{"constant": "FUSED_REPLAY_CALL_S (proposed)", "value_us": round(strategies_replay_call_us()),
                              "node_us": float(node_us), "grid": name, **evaluate(grid)}
                             for name, grid in grids.items()]
    payload = {"benchmark": NAME, "grids": list(grids), "calibration": os.environ.get("COMPASS_FX_CALIBRATION"),
               "best_part_overhead_us": part_best, "best_fused_call_rest_us": call_best, "replay_fit": replay_fit,
               "replay_graph_fit": graph_fit, "deferred_fit": deferred_fit, "replay_check": check,
               "rows": part_rows + call_rows, "repriced_replayed": replay_rows}
    if proposed_rows:
        payload["repriced_replayed_proposed"] = proposed_rows
    columns = ["grid", ("value_us", "us"), ("decompose_median_error", "decompose median err"),
               ("decompose_p90_error", "p90"), ("model_d_within_3pct", "model d ok"),
               ("pick_hit_rate", "pick hit rate"), ("worst_regression_vs_sequential", "worst regression"),
               ("pick_median_error", "pick median err")]
    lines = [f"# The cost model's software constants fitted to the operator grids ({args.tag})", "",
             f"Grids: {', '.join(grids)}; calibration: {payload['calibration'] or 'none (datasheet)'}.  "
             "In-sample fits: the next grid measured is their test.", "",
             f"## part_overhead_s: **{part_best} us** (the model's d most often within 3% of the best "
             "measured d, then the lowest median decompose errors)", "", output.markdown_table(part_rows, columns), "",
             f"## FUSED_HOST_CALL_REST_S: **{call_best} us** (the smallest worst regression against "
             "sequential, then the highest hit rate; calls issued command by command, as the grids measured "
             "them)", "", output.markdown_table(call_rows, columns), "",
             f"## The replayed call's host constants: **{replay_fit['call_us']} us + {replay_fit['node_us']} us "
             "per slow node** (a copy to or from host memory, or a stream wait, in its replay graph; least squares "
             f"over the `{replay_fit['column']}` host times of {replay_fit['points']} cases at "
             f"{', '.join(map(str, replay_fit['worlds']))} ranks sharing one H200, each run and world scaled to the "
             f"median launches; median error {replay_fit['median_error']:.1%}, p90 {replay_fit['p90_error']:.1%}; "
             "priced / measured, median: "
             + ", ".join(f"{t} {v:.2f}" for t, v in replay_fit["median_priced_over_measured"].items()) + "; by ranks: "
             + ", ".join(f"{w}: {v:.2f}" for w, v in replay_fit["median_priced_over_measured_by_world"].items())
             + ")", "",
             f"Runs: {', '.join(replay_fit['runs'])}.  Launches alone the constants hold for (us): "
             + ", ".join(f"{k} {v}" for k, v in replay_fit["launch_us"].items()) + ".", "",
             *(_check_lines(check, replay_fit) if check else []),
             f"## A replay graph beyond a call's first: **{graph_fit['graph_us']} us** + its slow nodes (calls of "
             "several graphs issued from C as one call, the ring schedules' all-reduce; per run and world their "
             "median excess over one call at the constants above, less the one-graph operators' median excess "
             f"in the same rounds: {graph_fit['spread_us'][0]} to {graph_fit['spread_us'][1]} us over "
             f"{len(graph_fit['by_run_and_world'])} runs and worlds, the median taken)", "",
             f"Runs: {', '.join(graph_fit['runs'])}.", "",
             f"## A deferred call beyond a replayed one: **{deferred_fit['deferred_us']} us** (fused_async's "
             "asynchronous form, replayed on a stream of its own: per run and world the median of its time less "
             "the .graph call's and a torch.mm's of the same rounds, each after an idle device: "
             f"{deferred_fit['spread_us'][0]} to {deferred_fit['spread_us'][1]} us over "
             f"{len(deferred_fit['by_run_and_world'])} runs and worlds, the median taken)", "",
             f"Runs: {', '.join(deferred_fit['runs'])}.", "",
             "## Repriced as the code prices now (eager fused calls replayed from captured graphs: "
             f"FUSED_REPLAY_CALL_S {replay_rows[0]['value_us']} us + FUSED_REPLAY_SLOW_NODE_S per slow node, "
             "fitted on one H200)", "",
             "The grids' fused calls were measured issued command by command (host-bound at 0.27-0.63 ms "
             "below 8192 tokens), so a pick of a small fused call is judged here against a time the "
             "replayed call should beat; a new two-GPU grid is the test.", "",
             output.markdown_table(replay_rows, columns)]
    if proposed_rows:
        lines += ["", f"## Repriced with proposed replay constants ({args.replay_constants.split(',')[0]} us per call + "
                  f"{args.replay_constants.split(',')[1]} us per slow node on their host; 'us' is the call's cost scaled "
                  "to the calibration's launches)", "", output.markdown_table(proposed_rows, columns)]
    print("\n".join(lines))
    output.write_results(NAME, args.tag, payload, "\n".join(lines), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
