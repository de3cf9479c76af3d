"""The benchmark runs planned for a lent GPU machine, each batch one device call.

A device call runs at most 10 minutes and a session gets 30 device minutes, so the runs a question
needs are planned ahead as batches and kept here, in the repository (a plan kept outside it was
lost with a session's scratch files once).  Each batch is a list of steps; a step is one benchmark
script (or ``compass-fx``) with its arguments, the environment of its regime and a deadline.

    python benchmarks/device_batches.py --list
    python benchmarks/device_batches.py x2-graphs --out "$OUT"     # on the machine, after installing

The runner starts each step in its own process group with its deadline (a stalled step is killed,
and the batch goes on), writes each step's output to ``OUT/logs/<step>.log``, lets the step write
its results under ``OUT/results`` and ends with ``OUT/batch-<name>.json``: per step the command,
exit status, seconds and the files it wrote.  ``tests/test_device_batches.py`` parses every step's
arguments with its script's own parser, so a plan cannot rot while the scripts change.

``--pack``: OUT holds one file, ``batch-<name>.tgz`` (the logs, results and summary under
``batch-<name>/``), rewritten after every step: the device tool brings back at most 8 files, and a
batch writes two per result and one log per step (a first call of 2026-12-05 lost 11 of its files
so), and a call cut short still brings back every step done.

    python benchmarks/device_batches.py h200-first --out "$OUT" --pack
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from harness import cpu_power
from harness.deadline import run_until

ROOT = Path(__file__).resolve().parent.parent
PER_CALL_LIMIT_S = 600      # the device tool's limit per call
INSTALL_MARGIN_S = 60       # the editable install and the machine's first CUDA context
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
HOST_STAGED = {"NCCL_P2P_DISABLE": "1"}   # NCCL through host memory: the regime of PCIe cards without peer access
TORCHAO_SOURCE = {"PYTHONPATH": str(ROOT / "scratch" / "carry")}  # torchao's Python, carried (float8_ranks says how)
TORCHAO_RUN = ("--worlds", "2,4", "--models", "torchao_tensorwise,torchao_rowwise", "--strategies",
               "off-eager,off-inductor,decompose-eager,decompose-inductor,torch-aot_eager,torch-inductor")
EAGER_ROUNDINGS = ("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING")
RESULTS = "{results}"      # replaced by OUT/results in the arguments
MACHINE = "{machine}"      # replaced by the GPU's family (h100, h200) in the arguments: results name their machine


@dataclass(frozen=True)
class Step:
    """One run: ``script`` is a path under benchmarks/ or ``compass-fx``; ``ranks`` > 1 runs it under
    torchrun with that many processes (scripts that spawn their own ranks leave it at 1); ``root``:
    a snapshot of another commit under the repository to run the script from, with that commit's
    package (``benchmarks/snapshot.py``; empty: this checkout); ``cpus_awake``: the host's cores are
    kept out of deep idle states while it runs (``harness/cpu_power.py``; where that cannot be
    done, the step is not run)."""

    name: str
    script: str
    args: tuple[str, ...]
    deadline_s: int
    env: dict[str, str] = field(default_factory=dict)
    ranks: int = 1
    root: str = ""
    cpus_awake: bool = False

    def command(self, results: Path) -> list[str]:
        args = [a.replace(RESULTS, str(results)) for a in self.args]
        args = [a.replace(MACHINE, machine_tag()) if MACHINE in a else a for a in args]
        if self.script == "compass-fx":
            program = ["compass-fx"] if self.ranks == 1 else ["--no-python", "compass-fx"]
        else:
            path = ROOT / self.root / "benchmarks" / self.script
            program = [sys.executable, str(path)] if self.ranks == 1 else [str(path)]
        if self.ranks > 1:
            return ["torchrun", "--standalone", f"--nproc-per-node={self.ranks}", *program, *args]
        return [*program, *args]


@lru_cache(maxsize=1)
def machine_tag() -> str:
    """The GPU's family as results name it (``h200``, ``h100``; ``gpu`` where neither): a batch may run
    on either kind of lent machine."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=False).stdout.lower()
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return next((family for family in ("h200", "h100") if family in name), "gpu")


def _grid(tag: str, env: dict[str, str], *extra: str, deadline_s: int = 200) -> Step:
    return Step(f"operators-{tag}", "multigpu_operators.py",
                ("--worlds", "2", "--repeats", "10", "--decompose-ds", "2,4,8", "--pick-fused", "all", *extra,
                 "--tag", tag, "--out-dir", RESULTS), deadline_s, env)


def _step(tag: str, env: dict[str, str], sp: str, mode: str, variants: str, modes: str = "inductor,async_tp,compass",
          deadline_s: int = 200) -> Step:
    return Step(f"end_to_end-{tag}", "multigpu_end_to_end.py",
                ("--worlds", "2", "--layers", "8", "--sp", sp, "--steps", "6", "--warmup", "2", "--modes", modes,
                 "--compile-mode", mode, "--compass-variants", variants, "--tag", tag, "--out-dir", RESULTS),
                deadline_s, env)


def _calibrate(regime: str, env: dict[str, str]) -> Step:
    """Both regimes write one file: a run keeps the other regime's collective tables."""
    return Step(f"calibrate-{regime}", "compass-fx",
                ("calibrate", "--collectives", "--out", f"{RESULTS}/calibration-h200x2.json"), 180, env, ranks=2)


def _host_time(name: str, worlds: int | str, tag: str, deadline_s: int, env: dict[str, str] | None = None,
               root: str = "", ops: str = "", extra: tuple[str, ...] = ()) -> Step:
    """One ``fused_host_time.py`` run, each rank pinned to a core: of ``ops``'s cases where named, from
    the snapshot at ``root`` where given (an A/B's turn)."""
    only = ("--ops", ops) if ops else ()
    return Step(name, "fused_host_time.py", ("--worlds", str(worlds), "--pin", *only, *extra, "--tag", tag,
                                             "--out-dir", RESULTS), deadline_s, env or {}, root=root)


def _deferred(label: str) -> tuple[Step, ...]:
    """fused_async's calls (``fused_host_stress --overload start``: 500 starts a case, each with a
    ``.graph`` call inside its window, host-staged at 2, 4 and 8 ranks), then their host time against
    the same issued command by command, the reductions at two ranks on both transports; results tagged
    ``<gpu>-start<label>-500-mps``, ``<gpu>-async<label>-w2-host-pin-mps`` and ``-async<label>-peer-w2-pin-mps``."""
    return (_stress("stress-500-start", "2,4,8", 500, REPLAY_ORDER_CASES, f"{MACHINE}-start{label}-500-mps", 200,
                    extra=("--overload", "start")),
            _host_time("host_time-async-w2", 2, f"{MACHINE}-async{label}-w2-host-pin-mps", 100, ops=REDUCTIONS),
            _host_time("host_time-async-peer-w2", 2, f"{MACHINE}-async{label}-peer-w2-pin-mps", 80, ops=REDUCTIONS,
                       extra=("--transport", "peer")))


def _stress(name: str, worlds: str, calls: int, shapes: str, tag: str, deadline_s: int,
            env: dict[str, str] | None = None, root: str = "", peer: bool = False, extra: tuple[str, ...] = ()) -> Step:
    """One ``fused_host_stress.py`` run of the direct schedule: ``calls`` calls in a row of each of
    ``shapes`` at each of ``worlds`` (every result checked), host-staged unless ``peer``, from the
    snapshot at ``root`` where given."""
    transport = ("--transport", "peer") if peer else ()
    return Step(name, "fused_host_stress.py",
                ("--worlds", worlds, *transport, "--schedules", "direct", "--calls", str(calls), "--shapes", shapes,
                 *extra, "--tag", tag, "--out-dir", RESULTS), deadline_s, env or {}, root=root)


GRAPHS = {"COMPASS_FUSED_GRAPHS": "1"}
ONE_QUEUE = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # every stream of a process on one hardware queue
HALF_THE_SMS = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}  # two ranks under MPS: a PCIe pair at half speed
# the gather's pulls, one package per way (h200-drain-ab, h200-slot-reuse): the halves (this checkout),
# whole rounds and one pull per peer (snapshots of earlier commits, benchmarks/snapshot.py)
GATHER_PULLS = {"drain": "", "rounds": "scratch/snapshot-rounds", "peers": "scratch/snapshot-peers"}
DRAIN_GATHERS = "all_gather_matmul:4096:256:256,all_gather_matmul:16384:1024:4096"  # one piece a block; 2-4
EARLY_WAITS = "scratch/snapshot-early-waits"  # the candidate 391f0f2, not kept (h200-early-waits)
EARLY_WAITS_AB = (("early-waits", EARLY_WAITS), ("main", ""))  # its A/B's two sides, candidate first
GUARD_ORDER = "scratch/snapshot-guard-order"  # the candidate fc578ed, now opt-in (h200-guard-order)
GUARD_ORDER_AB = (("guard-order", GUARD_ORDER), ("main", ""))
SPLIT_GEMMS = "scratch/snapshot-split-gemms"  # eafad5d: a GEMM per piece of a reduce-scatter's own block
# the snapshots a batch can make for itself where they are missing (scratch/ is not committed)
SNAPSHOT_REVISIONS = {SPLIT_GEMMS: "eafad5d"}


def _cold_probe(name: str, label: str, deadline_s: int, cpus_awake: bool = False) -> Step:
    """``graph_node_probe.py --sections cold`` (one process) into ``graph_node_probe-<gpu>-<label>.json``."""
    return Step(name, "graph_node_probe.py",
                ("--sections", "cold", "--out", f"{RESULTS}/graph_node_probe-{MACHINE}-{label}.json"), deadline_s,
                cpus_awake=cpus_awake)


# issue 27: the launch after each kind of wait (one process), and the two-rank rows' steady issue times
COLD_PROBE = _cold_probe("graph_node_probe-cold", "cold", 60)
W2_STEADY = _host_time("host_time-w2", 2, f"{MACHINE}-lane-w2-steady-host-pin-mps", 90)
# the call between a step's own ops (fused_host_time's step_ops), both transports at two ranks: in h200-step-ops
# and h200-step-sync
STEP_OPS_W2 = _host_time("host_time-w2", 2, f"{MACHINE}-step-ops-w2-host-pin-mps", 90)
STEP_OPS_PEER_W2 = _host_time("host_time-peer-w2", 2, f"{MACHINE}-step-ops-peer-w2-pin-mps", 70,
                              extra=("--transport", "peer"))


def _cpus_awake_ab() -> tuple[Step, ...]:
    """Issue 27: the same graph's launch after the host slept 10 ms took 68 us against 27-30 right
    after a wait for an idle GPU, whatever its copies' bytes (64 KiB-16 MiB: 39-43 us): the first
    fused call after a wait is 2-5x the steady ones.  Is it the cores' deep idle states?  The cold
    probe and the two- and eight-rank host times, each as the host is and with the cores kept
    out of deep idle states (``Step.cpus_awake``)."""
    sides = (("base", False), ("awake", True))
    cold = tuple(_cold_probe(f"cold-{side}", f"cold-{side}", 40, awake) for side, awake in sides)
    host = tuple(replace(_host_time(f"host_time-w{world}-{side}", world, f"{MACHINE}-wake-w{world}-{side}-host-pin-mps",
                                    deadline_s), cpus_awake=awake)
                 for world, deadline_s in ((2, 90), (8, 120)) for side, awake in sides)
    return cold + host  # each question's two sides one after the other, the shortest first


def _merge_ab(worlds: str, label: str, deadline_s: int) -> tuple[Step, ...]:
    """Issue 27: one GEMM for a reduce-scatter's own block (protocol.merged_matmuls) against the GEMM
    per piece before it (the snapshot SPLIT_GEMMS, made where missing), in two turns: the periods."""
    return tuple(_host_time(f"merge-{side}-{turn}", worlds, f"{MACHINE}-{label}{turn}-{side}-host-pin-mps", deadline_s,
                            root=root, ops="matmul_reduce_scatter")
                 for turn in (1, 2) for side, root in (("merged", ""), ("split", SPLIT_GEMMS)))


def _peer_schedules(schedules: tuple[str, ...], label: str) -> tuple[Step, ...]:
    """Issue 27: the peer transport's calls on each of ``schedules`` at 2, 4 and 8 ranks, one run each
    (``fused_host_time-<gpu>-schedule-<schedule><label>-peer-pin-mps``)."""
    return tuple(_host_time(f"host_time-peer-{schedule}", "2,4,8", f"{MACHINE}-schedule-{schedule}{label}-peer-pin-mps",
                            170, extra=("--transport", "peer", "--schedule", schedule))
                 for schedule in schedules)


REPLAY_ORDER_CASES = "matmul_reduce_scatter:8192:4096:7168,matmul_all_reduce:8192:4096:7168"  # the large reductions
EVERY_OP = "all_gather_matmul:16384:4096:7168," + REPLAY_ORDER_CASES  # one large case of each operator
REDUCTIONS = "matmul_reduce_scatter,matmul_all_reduce"  # the operators with an asynchronous form
# gathers of three and of two weights (Q, K, V; w1, w3), every rank's rows together
WEIGHT_GATHERS = "all_gather_matmul:4096:2048+512+512:4096,all_gather_matmul:4096:7168+7168:4096"
def _traces(variants: str, tag: str, deadline_s: int) -> tuple[Step, ...]:
    """``replay_trace.py`` on the 512-row reduce-scatter and all-reduce, ``variants`` traced in turns,
    half the SMs per rank (as the guards' cost was measured); results tagged ``h200-{rs|ar}512-{tag}``."""
    return tuple(Step(f"trace-{op}", "replay_trace.py",
                      ("--op", op, "--rows", "512", "--variants", variants,
                       "--tag", f"h200-{short}512-{tag}", "--out-dir", RESULTS), deadline_s, HALF_THE_SMS)
                 for op, short in (("matmul_reduce_scatter", "rs"), ("matmul_all_reduce", "ar")))


BATCHES: dict[str, tuple[Step, ...]] = {
    # Issues 9-11: the operator grid replayed from CUDA graphs (no host issue per part or per fused
    # call), both regimes.  Does InterDecom pay on NVLink without its host cost; do the small fused
    # calls stop losing; does the model, priced as replays, pick right?
    "x2-graphs": (
        _grid("h200x2-cudagraphs", GRAPHS, "--cuda-graphs"),
        _grid("h200x2-hoststaged-cudagraphs", {**HOST_STAGED, **GRAPHS}, "--cuda-graphs", "--no-symm-mem"),
    ),
    # Issue 10's training steps under Inductor's "reduce-overhead": the NVLink step with SP (auto
    # prices the parts as replays), the host-staged step SP off and on (goal 1.15x over Inductor).
    "x2-steps": (
        _step("h200x2-spon-cudagraphs", GRAPHS, "on", "reduce-overhead",
              '{"auto": {}, "decompose2": {"strategy": "decompose", "chunks": 2}}'),
        _step("h200x2-hoststaged-spoff-cudagraphs", {**HOST_STAGED, **GRAPHS}, "off", "reduce-overhead",
              '{"auto": {}}', modes="inductor,compass", deadline_s=140),
        _step("h200x2-hoststaged-spon-cudagraphs", {**HOST_STAGED, **GRAPHS}, "on", "reduce-overhead",
              '{"auto": {}}', deadline_s=140),
    ),
    # Issue 11: calibrate the two-GPU machine in both regimes (NCCL collectives over message sizes,
    # the seven-tile GEMM fit, InterDecom's per-part cost as lowered); issue 9: the captured fused
    # calls on two GPUs with one and with two buffer sets, and the fused-op stress.
    "x2-calibrate": (
        _calibrate("nvlink", {}),
        _calibrate("hoststaged", HOST_STAGED),
        Step("fused_graphs-1buffer", "fused_graphs.py", ("--world", "2", "--tag", "h200x2", "--out-dir", RESULTS),
             60, {"COMPASS_FUSED_GRAPH_BUFFERS": "1"}),
        Step("fused_graphs-2buffers", "fused_graphs.py",
             ("--world", "2", "--no-failure-cases", "--tag", "h200x2-2buffers", "--out-dir", RESULTS),
             45, {"COMPASS_FUSED_GRAPH_BUFFERS": "2"}),
    ),
    # The eager grids again after the .graph overloads (27-41 us less host per fused call), and the
    # stress of issue 9 (500 back-to-back calls per case, a late rank).
    "x2-eager": (
        _grid("h200x2", {}),
        _grid("h200x2-hoststaged", HOST_STAGED, "--no-symm-mem", deadline_s=150),
        Step("fused_ops-stress", "fused_ops.py", ("--worlds", "2", "--timeout-check", "--tag", "h200x2",
                                                   "--out-dir", RESULTS), 180),
    ),
    # One H200 (issue 27), MPS started first (nvidia-cuda-mps-control -d): the graph order's guards
    # (kernels/graph_order.py) on the GPU.  The cases that hung before any guards (16 MiB pieces,
    # half the SMs per rank) must pass; the period with and without the guards (the issue order's
    # guards cost the two-rank reductions 11-26%); the default stress at four and eight ranks.
    "h200-graph-guards": (
        Step("stress-replay-order", "fused_host_stress.py",
             ("--worlds", "2", "--schedules", "direct", "--shapes", REPLAY_ORDER_CASES, "--calls", "60",
              "--tag", "h200-graph-guards-mps50", "--out-dir", RESULTS), 110,
             {**HALF_THE_SMS, "COMPASS_HOST_MOST_PIECES": "2"}),
        _host_time("host_time-guards", 2, "h200-graph-guards-host-pin-mps50", 70, HALF_THE_SMS),
        _host_time("host_time-no-guards", 2, "h200-no-graph-guards-host-pin-mps50", 70,
                   {**HALF_THE_SMS, "COMPASS_GRAPH_GUARDS": "0"}),
        Step("stress-w4-w8", "fused_host_stress.py",
             ("--worlds", "4,8", "--calls", "60", "--tag", "h200-graph-guards-mps", "--out-dir", RESULTS), 250),
    ),
    # Issue 27, in turns with snapshots of earlier commits (benchmarks/snapshot.py; carry scratch; MPS
    # started first): the two-rank host-staged all-reduce in one round with one-piece chunks against the
    # reduce-scatter plan (`snapshot.py 402bf49`), and the grouped pulls' whole call at 4 and 8 ranks
    # against one copy per peer (`snapshot.py 659b7f9 --out scratch/snapshot-ungrouped`).
    "h200-pair-allreduce-ab": tuple(
        _host_time(f"host_time-{side}{run}", 2, f"h200-{side}-allreduce-ab{run}-host-pin-mps50", 45, HALF_THE_SMS, root)
        for run in (3, 4) for side, root in (("rs-ag", "scratch/snapshot"), ("pair", ""))
    ) + tuple(
        _host_time(f"host_time-w{world}-{side}", world, f"h200-{side}-w{world}-ab-host-pin-mps", {4: 50, 8: 115}[world],
                   root=root)
        for world in (4, 8) for side, root in (("ungrouped", "scratch/snapshot-ungrouped"), ("grouped", ""))
    ),
    # Issue 27: the gather's last round of pulls cut in halves (protocol.drain_segments) against whole
    # rounds (`snapshot.py c8829a9 --scripts HEAD --out scratch/snapshot-rounds`) and one copy per peer
    # (`snapshot.py 659b7f9 --scripts HEAD --out scratch/snapshot-peers`), the gathers only, in turns
    # (carry scratch; MPS started first); then the halves' stress at four and eight ranks.
    "h200-drain-ab": tuple(
        _host_time(f"host_time-w{world}-{side}{turn}", world, f"h200-{side}-w{world}-gather-ab{turn}-host-pin-mps",
                   {4: 45, 8: 75}[world], root=GATHER_PULLS[side], ops="all_gather_matmul")
        for world, turns in ((8, (("drain", 1), ("rounds", 1), ("peers", 1), ("drain", 2))),
                             (4, (("drain", 1), ("rounds", 1), ("peers", 1))))
        for side, turn in turns
    ) + (
        _stress("stress-drain-w4-w8", "4,8", 200, DRAIN_GATHERS, "h200-drain-gathers-mps", 95),
    ),
    # Issue 27 (carry scratch; MPS started first; `python -m pytest -q -m gpu tests` before it): the
    # two-rank all-reduce's pulls in two staging slots, stressed at 4 and 8 chunks (half the SMs per
    # rank), its period in turns against the whole partial staged (`snapshot.py de54a4f --scripts
    # HEAD --out scratch/snapshot-whole-stage`); the world-4 gathers of h200-drain-ab that ran out of
    # time; the last round in halves at 500 calls, worlds 4 and 8.
    "h200-slot-reuse": (
        _stress("stress-pair-slots", "2", 200,
                "matmul_all_reduce:8192:4096:7168,matmul_all_reduce:16384:4096:7168,matmul_all_reduce:2048:512:256",
                "h200-pair-slots-mps50", 60, HALF_THE_SMS),
        _stress("stress-pair-slots-8chunks", "2", 200,
                "matmul_all_reduce:8192:4096:7168,matmul_all_reduce:16384:4096:7168",
                "h200-pair-slots-cap8-mps50", 60, {**HALF_THE_SMS, "COMPASS_HOST_MOST_PIECES": "8"}),
    ) + tuple(
        _host_time(f"host_time-w2-{side}{turn}", 2, f"h200-{side}-allreduce-ab{turn}-host-pin-mps50", 35, HALF_THE_SMS,
                   root, "matmul_all_reduce")
        for turn in (1, 2) for side, root in (("two-slots", ""), ("whole-stage", "scratch/snapshot-whole-stage"))
    ) + tuple(
        _host_time(f"host_time-w4-{side}1", 4, f"h200-{side}-w4-gather-ab1-host-pin-mps", 45, root=root,
                   ops="all_gather_matmul")
        for side, root in GATHER_PULLS.items()
    ) + (
        _stress("stress-drain-500", "4,8", 500, DRAIN_GATHERS, "h200-drain-gathers-500-mps", 100),
    ),
    # Issue 27: where the host-staged goals stand with every change of the day (MPS started first):
    # world 2 with the breakdown of a replayed call's microseconds, then worlds 4 and 8.
    "h200-host-state": (
        _host_time("host_time-w2-breakdown", 2, "h200-warmstate-w2-breakdown-host-pin-mps", 90, extra=("--breakdown",)),
        _host_time("host_time-w4-w8", "4,8", "h200-warmstate-w48-host-pin-mps", 190),
    ),
    # Issue 27, run with MPS off (ranks time-slice the GPU; host-staged flag waits are stream waits, no
    # spin): how much of a call's host time is MPS's (every rank's launches pass through one server's
    # context), how much would be paid where each rank has a GPU of its own.  Then h200-mps-w2 with
    # MPS started: the same world-2 rows on the same machine, for ratios of one run.
    "h200-no-mps": (
        _host_time("host_time-w2-breakdown", 2, "h200-nomps-w2-breakdown-host-pin", 90, extra=("--breakdown",)),
        _host_time("host_time-w4", 4, "h200-nomps-w4-host-pin", 150),
    ),
    "h200-mps-w2": (
        _host_time("host_time-w2-breakdown", 2, "h200-mpsagain-w2-breakdown-host-pin-mps", 90, extra=("--breakdown",)),
    ),
    # Issue 27 (MPS started first): where the graph guards' ~1.1-1.2x of the small two-rank reductions'
    # period goes, every rank's device work traced over replayed calls, guarded against unguarded, half
    # the SMs per rank as when it was measured (rank 0's alone first: -mps50; every rank: -peers-mps50).
    "h200-guard-trace": _traces("guards,no-guards", "guards-peers-mps50", 90),
    # Issue 27 (MPS started first): h200-guard-trace again with every rank's own summary in the
    # results: in guarded replays rank 1's calls start 30-70 us after rank 0's; does rank 1 idle
    # between its calls, or start its call's work late?
    "h200-guard-ranks": _traces("guards,no-guards", "guards-ranks-mps50", 80),
    # Issue 27 (MPS started first): in guarded replays a pull whose peer's flag is already set starts
    # 70-90 us after its own rank's flag set (the guard: a graph edge from the flag-set kernel to the
    # wait), against ~9 us when the peer's flag releases it (h200-guard-ranks).  Is it the edge out of
    # a kernel into a copy's queue?  The flag sets as stream memory writes (the node an issued call
    # uses) traced, their host time and period against the kernels in turns, and a short stress.
    "h200-guard-flags": _traces("guards,stream-flag-writes,no-guards", "flag-writes-mps50", 80) + tuple(
        _host_time(f"host_time-w2-{writes}", 2, f"h200-{writes}-flags-w2-host-pin-mps50", 55,
                   {**HALF_THE_SMS, "COMPASS_REPLAY_FLAG_WRITES": writes})
        for writes in ("kernel", "stream")
    ) + (
        _stress("stress-stream-flags", "2,4", 100, REPLAY_ORDER_CASES + ",all_gather_matmul:4096:4096:7168",
                "h200-stream-flags-mps", 90, {"COMPASS_REPLAY_FLAG_WRITES": "stream"}),
    ),
    # Issue 27 (carry scratch; MPS started first): a four-rank gather's round of three pulls one pull at
    # a time (the candidate 13b0595, protocol.SINGLE_PULLS_UP_TO: `snapshot.py 13b0595 --out
    # scratch/snapshot-single`) against halves of 2 and 1 (this checkout; run first from `snapshot.py
    # 81e83c2 --out scratch/snapshot-halves` with the candidate checked out), the gathers only, in
    # turns; then the candidate stressed.  Period 0.98-1.03x of the halves: not kept.
    "h200-single-pulls": tuple(
        _host_time(f"host_time-w4-{side}{turn}", 4, f"h200-{side}-w4-gather-ab{turn}-host-pin-mps", 45,
                   root=root, ops="all_gather_matmul")
        for turn in (1, 2) for side, root in (("single", "scratch/snapshot-single"), ("halves", ""))
    ) + (
        _stress("stress-single-pulls-w4", "4", 100, DRAIN_GATHERS, "h200-single-pulls-w4-mps", 40,
                root="scratch/snapshot-single"),
    ),
    # Issue 27 (carry scratch; MPS started first): the candidate early waits (391f0f2, measured and not
    # kept, not in main: in the graph order every ready command that sets no flag goes before a flag
    # set, so each pull's guard is the rank's matching publication, not a later one: in main's replays
    # a four-piece gather's first pull waits for three of the rank's pieces, and every reduce-scatter
    # pull but the first for all of the rank's publications; `snapshot.py 391f0f2 --scripts HEAD --out
    # scratch/snapshot-early-waits`: the candidate's package under this checkout's scripts)
    # against this checkout, in turns: every operator at two ranks (half the SMs each) twice, at four
    # ranks once, the reduce-scatters at eight ranks once; then the changed cases stressed.  Merge the
    # branch if the changed rows' period is shorter beyond the unchanged rows' spread.
    "h200-early-waits": tuple(
        _host_time(f"host_time-w2-{side}{turn}", 2, f"h200-{side}-w2-ab{turn}-host-pin-mps50", 50, HALF_THE_SMS, root)
        for turn in (1, 2) for side, root in EARLY_WAITS_AB
    ) + tuple(
        _host_time(f"host_time-w4-{side}", 4, f"h200-{side}-w4-ab-host-pin-mps", 65, root=root)
        for side, root in EARLY_WAITS_AB
    ) + tuple(
        _host_time(f"host_time-w8-{side}", 8, f"h200-{side}-w8-rs-ab-host-pin-mps", 45, root=root,
                   ops="matmul_reduce_scatter")
        for side, root in EARLY_WAITS_AB
    ) + (
        _stress("stress-early-waits", "2,4,8", 100, EVERY_OP, "h200-early-waits-mps", 90, root=EARLY_WAITS),
    ),
    # Issue 27 (carry scratch; MPS started first): the same candidate on the peer transport (the NVLink
    # machines' plans, each rank mapping the others' buffers with CUDA IPC), whose four- and eight-rank
    # reduce-scatters and all-reduces main also guards late (every reduce-scatter pull but the first
    # after all of the rank's publications): those operators in turns at four and eight ranks, then
    # stressed.
    "h200-early-waits-peer": tuple(
        _host_time(f"host_time-w{world}-{side}", world, f"h200-{side}-w{world}-peer-ab-pin-mps", {4: 60, 8: 100}[world],
                   root=root, ops="matmul_reduce_scatter,matmul_all_reduce", extra=("--transport", "peer"))
        for world in (4, 8) for side, root in EARLY_WAITS_AB
    ) + (
        _stress("stress-early-waits-peer", "4,8", 100, REPLAY_ORDER_CASES, "h200-early-waits-peer-mps", 90,
                root=EARLY_WAITS, peer=True),
    ),
    # Issue 27 (carry scratch; MPS started first): the early-waits candidate (391f0f2) cut the guards'
    # waits but cost the gathers 5-24% of their period (h200-early-waits), also where only the capture
    # order changed (two-rank gathers of two pieces: the same guards, the own GEMM captured ahead of the
    # first flag set).  The candidate fc578ed (`snapshot.py fc578ed --scripts main --out
    # scratch/snapshot-guard-order`; since in main as the opt-in COMPASS_GRAPH_GUARD_SEQUENCE=sets-last)
    # captures in main's order and takes the guards from a sequence that sets flags last.  Against
    # early-waits and main at two ranks in turns twice, against main at four ranks (the gathers once
    # more, with early-waits) and at eight (the reduce-scatters, h200-guard-order-more); then stressed,
    # both transports.
    "h200-guard-order": tuple(
        _host_time(f"host_time-w2-{side}{turn}", 2, f"h200-{side}-w2-go{turn}-host-pin-mps50", 50, HALF_THE_SMS, root)
        for turn in (1, 2) for side, root in (GUARD_ORDER_AB[0], *EARLY_WAITS_AB)
    ) + tuple(
        _host_time(f"host_time-w4-{side}", 4, f"h200-{side}-w4-go-host-pin-mps", 65, root=root)
        for side, root in GUARD_ORDER_AB
    ),
    "h200-guard-order-more": tuple(
        _host_time(f"host_time-w4-gather-{side}", 4, f"h200-{side}-w4-go-gather-host-pin-mps", 40, root=root,
                   ops="all_gather_matmul")
        for side, root in (GUARD_ORDER_AB[0], *EARLY_WAITS_AB)
    ) + tuple(
        _host_time(f"host_time-w8-{side}", 8, f"h200-{side}-w8-go-rs-host-pin-mps", 45, root=root,
                   ops="matmul_reduce_scatter")
        for side, root in GUARD_ORDER_AB
    ) + (
        _stress("stress-guard-order", "2,4,8", 100, EVERY_OP, "h200-guard-order-mps", 90, root=GUARD_ORDER),
        _stress("stress-guard-order-peer", "4,8", 100, REPLAY_ORDER_CASES, "h200-guard-order-peer-mps", 90,
                root=GUARD_ORDER, peer=True),
    ),
    # Issue 27 (MPS started first): the guard sequence as landed (COMPASS_GRAPH_GUARD_SEQUENCE=sets-last,
    # this checkout; the candidate fc578ed measured from a snapshot in h200-guard-order): the four-rank
    # reduce-scatters and all-reduces and the eight-rank reduce-scatters in turns with the default,
    # a second turn of the rows that moved there (all-reduce 8192 rows 0.93, small reduce-scatters
    # 1.04-1.10); then stressed at four and eight ranks.
    "h200-guard-sequence": tuple(
        _host_time(f"host_time-w{world}-{side}", world, f"h200-{side}-guards-w{world}-host-pin-mps",
                   {4: 70, 8: 60}[world], {"COMPASS_GRAPH_GUARD_SEQUENCE": side},
                   ops="matmul_reduce_scatter,matmul_all_reduce" if world == 4 else "matmul_reduce_scatter")
        for world in (4, 8) for side in ("sets-last", "capture")
    ) + (
        _stress("stress-guard-sequence", "4,8", 100,
                "matmul_reduce_scatter:2048:4096:7168,matmul_all_reduce:8192:4096:7168",
                "h200-guard-sequence-mps", 90, {"COMPASS_GRAPH_GUARD_SEQUENCE": "sets-last"}),
    ),
    # Issue 27 (MPS started first): a replay graph's flag waits as spinning kernels instead of batches of
    # stream waits.  Guarded replays start a rank's pull 35-84 us after the peer's flag set against
    # 11-12 unguarded (h200-guard-trace, -peers-): is it how a guarded stream wait is released?  And a
    # kernel node launches for less host than a stream-wait node: the host time and the period at
    # worlds 2 and 8, each way once, in turns.
    "h200-kernel-waits": _traces("guards,kernel-waits,no-guards", "waits-peers-mps50", 80) + tuple(
        _host_time(f"host_time-w{world}-{waits}", world, f"h200-{waits}-waits-w{world}-host-pin-mps",
                   {2: 55, 8: 110}[world], {"COMPASS_REPLAY_WAITS": waits})
        for world in (2, 8) for waits in ("batch", "kernel")
    ),
    # Issue 27 (MPS started first; `python -m pytest -q -m gpu tests` before it): the goals
    # checked again on main as it stands, in one call, after sessions without a GPU: the host-staged
    # host time at two ranks (with its breakdown), at four and eight ranks, and the stress of 500 calls
    # per case at worlds 2, 4 and 8 (100 calls of these cases took 58 s: h200-early-waits-mps).
    # Issue 27: the host fast path (kernels/cuda/lane.cpp) against the Python path in turns, two
    # ranks with the breakdown; 500 calls a case at worlds 2, 4 and 8 through it, every result checked.
    "h200-lane": (
        _host_time("host_time-w2-breakdown", 2, "h200-lane-w2-breakdown-host-pin-mps", 110, extra=("--breakdown",)),
        _stress("stress-500", "2,4,8", 500, EVERY_OP, "h200-lane-500-mps", 210),
    ),
    # and beyond two ranks, the peer transport's two ranks; what is left of two ranks' calls is the
    # graph's launch: a second run of the defaults beside runs with flag waits as kernel nodes and
    # with two pieces a block (fewer copy and wait nodes) in the same session
    "h200-lane-worlds": (
        _host_time("host_time-w4-w8", "4,8", "h200-lane-w48-host-pin-mps", 190),
        _host_time("host_time-peer-w2", 2, "h200-lane-peer-w2-pin-mps", 60, extra=("--transport", "peer")),
        _host_time("host_time-w2-run2", 2, "h200-lane-w2-run2-host-pin-mps", 60),
        _host_time("host_time-w2-kernel-waits", 2, "h200-lane-w2-kernel-waits-host-pin-mps", 60,
                   env={"COMPASS_REPLAY_WAITS": "kernel"}),
        _host_time("host_time-w2-pieces2", 2, "h200-lane-w2-pieces2-host-pin-mps", 60,
                   env={"COMPASS_HOST_MOST_PIECES": "2"}),
    ),
    # where four and eight ranks' host-staged calls spend their time through the fast path, and the peer
    # transport's four and eight ranks through it (one device call with what a session had left)
    "h200-lane-breakdown": (
        COLD_PROBE,
        W2_STEADY,
        _host_time("host_time-w48-breakdown", "4,8", f"{MACHINE}-lane-w48-breakdown-host-pin-mps", 210,
                   extra=("--breakdown",)),
        _host_time("host_time-peer-w48", "4,8", f"{MACHINE}-lane-peer-w48-pin-mps", 170, extra=("--transport", "peer")),
    ),
    # Issue 27: the merge's A/B at two and four ranks
    "h200-merge-ab": _merge_ab("2,4", "merge-ab", 100),
    # Issue 27, the first call of a session lent one GPU (the rest: h200-lane-breakdown, h200-merge-ab): the
    # launch after each kind of wait, the two-rank rows' steady issue times, the merge's A/B at two ranks (its
    # snapshot is made where missing: SNAPSHOT_REVISIONS)
    "h200-first": (COLD_PROBE, W2_STEADY, *_merge_ab("2", "merge-w2-ab", 60)),
    # Issue 27: whether the cores' deep idle states make the first call after a wait slow
    "h200-cpus-awake": _cpus_awake_ab(),
    # Issue 27 asks for little host work "for every schedule": the cost model picks the ring and the double
    # ring too where GPUs reach each other (the peer transport; host-staged runs "direct" alone), and only
    # "direct" was timed; one run each at worlds 2, 4, 8, "direct" in the same call as the baseline
    "h200-peer-schedules": _peer_schedules(("ring", "double_ring", "direct"), ""),
    # Issue 27: the ring schedules' all-reduce replayed from C as one call (141d8bc; two calls from Python before:
    # 40-210 us as a step issues them), each row beside its Python path in the same rounds; and the host-staged
    # two-rank rows on a third machine start (their largest rows read 50-70 us steady, start to start).  Run
    # tests/test_fused_ipc_peer.py first: its ring all-reduce from C, checked against the reference.
    "h200-ring-lane": (
        *_peer_schedules(("ring", "double_ring"), "-lane"),
        _host_time("host_time-w2", 2, f"{MACHINE}-lane-w2-steady-run3-host-pin-mps", 90),
    ),
    # Issue 27, the goals checked again on main as it stands (MPS started first; `python3 -m pytest -q -m gpu
    # tests` before the first): the host-staged host times at two ranks (with the breakdown), four and eight,
    # then on the same warm machine the stress of 500 calls a case at worlds 2, 4 and 8 (two device calls:
    # with the install and the GPU tests one would pass its ten minutes)
    "h200-check-host": (
        _host_time("host_time-w2-breakdown", 2, f"{MACHINE}-check-w2-breakdown-host-pin-mps", 90, extra=("--breakdown",)),
        _host_time("host_time-w4-w8", "4,8", f"{MACHINE}-check-w48-host-pin-mps", 190),
    ),
    # Issue 27: where the first call after a wait for the device spends its 2-5x (the fast path's own clock:
    # lane.last_phases, the breakdown's first-of-16 phases against the steady ones), host-staged at 2, 4, 8
    # ranks and the peer transport at two
    "h200-first-call": (
        _host_time("host_time-w2-phases", 2, f"{MACHINE}-phases-w2-host-pin-mps", 90, extra=("--breakdown",)),
        _host_time("host_time-w48-phases", "4,8", f"{MACHINE}-phases-w48-host-pin-mps", 210, extra=("--breakdown",)),
        _host_time("host_time-peer-w2-phases", 2, f"{MACHINE}-phases-peer-w2-pin-mps", 70,
                   extra=("--breakdown", "--transport", "peer")),
    ),
    # and how much of those calls is outside C (the op's wrapper in Python): both transports at two ranks
    "h200-first-call-w2": (
        _host_time("host_time-w2-phases", 2, f"{MACHINE}-phases-w2-run2-host-pin-mps", 90, extra=("--breakdown",)),
        _host_time("host_time-peer-w2-phases", 2, f"{MACHINE}-phases-peer-w2-run2-pin-mps", 70,
                   extra=("--breakdown", "--transport", "peer")),
    ),
    "h200-check-stress": (_stress("stress-500", "2,4,8", 500, EVERY_OP, f"{MACHINE}-check-500-mps", 210),),
    # Issue 27: the .graph call between a step's own eager ops (fused_host_time's step_ops: an RMSNorm and a
    # gated product before each call), beside the back-to-back and first-after-a-wait forms of the same run:
    # host-staged at 2, 4 and 8 ranks, the peer transport at two
    "h200-step-ops": (
        STEP_OPS_W2, STEP_OPS_PEER_W2,
        _host_time("host_time-w4-w8", "4,8", f"{MACHINE}-step-ops-w48-host-pin-mps", 210),
    ),
    # Issue 27: the .graph overloads' eager calls entered from C (lane.enter_from_c) against their Python
    # entry in the same runs (fused_host_time's *_python_entry forms): host-staged at 2 (with the first call's
    # phases), 4 and 8 ranks, the peer transport at two; then 500 calls a case of the .graph overloads at 2/4/8
    "h200-c-entry": (
        _host_time("host_time-w2-breakdown", 2, f"{MACHINE}-c-entry-w2-breakdown-host-pin-mps", 110,
                   extra=("--breakdown",)),
        _host_time("host_time-peer-w2", 2, f"{MACHINE}-c-entry-peer-w2-pin-mps", 80, extra=("--transport", "peer")),
        _host_time("host_time-w4-w8", "4,8", f"{MACHINE}-c-entry-w48-host-pin-mps", 230),
    ),
    # Issue 27: gathers of several weights (Q, K, V; w1, w3: most gathers of a sequence-parallel block) entered
    # from C like those of one weight (they took the C++ dispatcher and the kernel in Python before), beside
    # the dispatcher's path in the same rounds: host-staged at 2 (with the breakdown), 4 and 8 ranks, peer at 2
    "h200-weights": (
        _host_time("host_time-weights-w2", 2, f"{MACHINE}-weights-w2-breakdown-host-pin-mps", 100,
                   extra=("--cases", "weights", "--breakdown")),
        _host_time("host_time-weights-peer-w2", 2, f"{MACHINE}-weights-peer-w2-pin-mps", 70,
                   extra=("--cases", "weights", "--transport", "peer")),
        _host_time("host_time-weights-w48", "4,8", f"{MACHINE}-weights-w48-host-pin-mps", 300,
                   extra=("--cases", "weights")),  # 170 s stopped one H100 before world 8's last row
    ),
    # and 500 calls a case of such gathers through the .graph overloads (every output checked), at 2, 4 and 8
    "h200-weights-stress": (
        _stress("stress-500-weights", "2,4,8", 500, WEIGHT_GATHERS, f"{MACHINE}-weights-500-graph-mps", 170,
                extra=("--overload", "graph")),
    ),
    "h200-c-entry-stress": (
        _stress("stress-500-graph", "2,4,8", 500, EVERY_OP, f"{MACHINE}-c-entry-500-graph-mps", 210,
                extra=("--overload", "graph")),
    ),
    # fused_async's deferred calls replayed on a stream of their own (impl._Workspace._replay_apart): 500
    # starts a case, each with a .graph call of the same operator while it is outstanding, every result
    # checked, host-staged at 2, 4 and 8 ranks; then their host time (start, a GEMM, wait) against the same
    # issued command by command (COMPASS_FUSED_REPLAY=0, as before), the reductions at two ranks, both transports
    "h200-deferred": _deferred(""),
    # the same after the start ops' plain calls skip the dispatcher (as the .graph overloads' do), with the
    # faster operand checks and the stream ordering through raw driver calls
    "h200-deferred-entry": _deferred("-entry"),
    # and the peer transport's starts at 2 and 4 ranks (its ring all-reduce defers a gather of the sums),
    # and the host time at 4 and 8 ranks host-staged
    "h200-deferred-more": (
        _stress("stress-500-start-peer", "2,4", 500, REPLAY_ORDER_CASES, f"{MACHINE}-start-500-peer-mps", 150,
                peer=True, extra=("--overload", "start")),
        _host_time("host_time-async-w48", "4,8", f"{MACHINE}-async-w48-host-pin-mps", 200, ops=REDUCTIONS),
    ),
    # Issue 27: where a deferred call's host time goes beyond a .graph call's (entering its start from C saved
    # nothing: fused_host_time-h100-async-c-start-*), timed through the .default overloads rewritten graphs call
    # (the runs before 2026-12-06 called the start's and the wait's packets, through the dispatcher; so did the
    # first run of this batch, fused_host_time-h100-deferred-parts-*): 500 starts a case, host-staged at 2, 4 and
    # 8 ranks, then the reductions' parts timed apart (--deferred-parts) at two ranks on both transports,
    # cProfile's view of the 512-row reduce-scatter's whole call host-staged
    "h200-deferred-default": (
        _stress("stress-500-start", "2,4,8", 500, REPLAY_ORDER_CASES, f"{MACHINE}-start-default-500-mps", 200,
                extra=("--overload", "start")),
        _host_time("host_time-parts-w2", 2, f"{MACHINE}-deferred-default-w2-host-pin-mps", 150, ops=REDUCTIONS,
                   extra=("--deferred-parts", "--profile")),
        _host_time("host_time-parts-peer-w2", 2, f"{MACHINE}-deferred-default-peer-w2-pin-mps", 110, ops=REDUCTIONS,
                   extra=("--deferred-parts", "--transport", "peer")),
    ),
    # Issue 27 at a deep model's depth (2026-12-07): every call of 2-128 layers replayed and the replay graphs'
    # memory flat in the depth (fused_replay_scale, host-staged at 4, 8 and 2 ranks), then the reductions' sums
    # in the workspace's float32 rows (impl.sum_scratch) under 500 calls a case at 4 and 8 ranks, through the
    # .graph overloads and as deferred starts (the detached plans sum on TAIL: not yet run on a GPU)
    "h200-replay-scale": (
        Step("replay_scale", "fused_replay_scale.py", ("--worlds", "4,8,2", "--layers", "2,8,32,64,80,128", "--steps",
                                                        "5", "--deadline", "45",
                                                        "--tag", f"{MACHINE}-host-mps", "--out-dir", RESULTS), 150),
        _stress("stress-500-sums-graph", "4,8", 500, REPLAY_ORDER_CASES, f"{MACHINE}-sums-500-graph-mps", 160,
                extra=("--overload", "graph")),
        _stress("stress-500-sums-start", "4,8", 500, REPLAY_ORDER_CASES, f"{MACHINE}-sums-500-start-mps", 160,
                extra=("--overload", "start")),
    ),
    # Issue 27 at depths that are not a multiple of 4 (2026-12-07): at 61 layers only half the measured calls
    # were issued from C (fused_replay_scale-h100-odd-depths-host-mps), where the replay policy alone has every
    # site's four graphs captured by step 5; per step, the captures, the calls from C and whether a layer's
    # outputs keep their address (a period-2 alternation of addresses would fit the figures), 12 steps, both
    # transports.  Answered on one H100 (fused_replay_scale-h100-settle-*): no alternation; step 1's outputs
    # lie elsewhere, so captures begin in step 3 and a site's four residues take steps 3-6
    "h200-replay-settle": (
        Step("replay_settle", "fused_replay_scale.py", ("--worlds", "2,8", "--layers", "61,64,126", "--steps", "12",
                                                         "--deadline", "100", "--tag", f"{MACHINE}-settle-host-mps",
                                                         "--out-dir", RESULTS), 150),
        Step("replay_settle-peer", "fused_replay_scale.py", ("--worlds", "2,8", "--layers", "61,64,126", "--steps",
                                                              "12", "--transport", "peer", "--deadline", "100", "--tag",
                                                              f"{MACHINE}-settle-peer-mps", "--out-dir", RESULTS), 150),
    ),
    # Issue 27: is plain host code slow after a wait because of the host, CUDA, or the ranks waking together?
    # cold_host_probe: fixed host work touching no GPU, first after a wait and steady, at 1, 2 and 8 pinned
    # processes, without and with a CUDA context (MPS), waits spun, slept, synchronized and polled
    "h200-cold-host": (
        Step("cold_host_probe", "cold_host_probe.py", ("--worlds", "1,2,8", "--tag", f"{MACHINE}-mps",
                                                       "--out-dir", RESULTS), 150),
    ),
    # Issue 27: is the first call after a wait slow because the waiting core looked idle (a virtual CPU that
    # pauses or halts in a synchronize may be handed to other work)?  fused_host_time --sync poll: the timing
    # loops wait by polling the stream in a busy loop; CUDA's auto before it, both transports, two ranks
    # (run once, one H100: polling leaves the first call as slow, fused_host_time-h100-poll-*)
    "h200-sync-poll": (
        _host_time("host_time-w2-auto", 2, f"{MACHINE}-poll-base-w2-breakdown-host-pin-mps", 110,
                   extra=("--breakdown",)),
        _host_time("host_time-w2-poll", 2, f"{MACHINE}-poll-w2-breakdown-host-pin-mps", 110,
                   extra=("--breakdown", "--sync", "poll")),
        _host_time("host_time-peer-w2-auto", 2, f"{MACHINE}-poll-base-peer-w2-pin-mps", 80,
                   extra=("--transport", "peer")),
        _host_time("host_time-peer-w2-poll", 2, f"{MACHINE}-poll-peer-w2-pin-mps", 80,
                   extra=("--transport", "peer", "--sync", "poll")),
    ),
    # Float8: every float8 rewrite had run on CPU ranks only; a training step of the hand-built block and of
    # torchao's stacks with every pair decomposed, eager and Inductor inner, on NCCL ranks sharing the GPU
    "h200-float8": (
        Step("float8_ranks", "float8_ranks.py", ("--worlds", "2,4", "--tag", f"{MACHINE}-mps", "--out-dir", RESULTS),
             300),
    ),
    # torchao's stacks, which the lent machine cannot import: its Python source goes to scratch/carry first
    # (float8_ranks' docstring; the device call carries "scratch/carry"); every strategy and torch's backends,
    # then with Inductor's eager-numerics switches (Inductor reads them at import: each step is its own process;
    # the step's environment sets them before anything can import Inductor, --env records them in the result);
    # each took ~190 s on an H100 (float8_ranks-h100-torchao-sqnr-mps, -emulated-casts-mps)
    "h200-float8-torchao": (
        Step("float8_ranks-torchao", "float8_ranks.py",
             (*TORCHAO_RUN, "--tag", f"{MACHINE}-torchao-sqnr-mps", "--out-dir", RESULTS), 240, TORCHAO_SOURCE),
        Step("float8_ranks-torchao-emulated", "float8_ranks.py",
             (*TORCHAO_RUN, *(a for name in EAGER_ROUNDINGS for a in ("--env", f"{name}=1")),
              "--tag", f"{MACHINE}-torchao-emulated-casts-mps", "--out-dir", RESULTS), 240,
             {**TORCHAO_SOURCE, **{name: "1" for name in EAGER_ROUNDINGS}}),
    ),
    # One hardware queue per process (CUDA_DEVICE_MAX_CONNECTIONS=1, what Megatron-style TP overlap sets): every
    # stream of a rank on one queue, where a wait issued ahead of its rank's own publication would hang.  Last
    # stressed so (h200-one-queue, 60 calls, fresh processes per case) before the replay graphs, their graph
    # order guards, the C fast path, the deferred starts and the sums' rows: today's .graph calls and starts at
    # 2, 4 and 8 ranks, host-staged, and the peer transport's at 2 and 4; run without MPS, so that each rank's
    # own context holds the setting (the ranks time-slice the GPU: slow, which a stress run does not mind)
    "h200-one-queue-replay": (
        _stress("stress-one-queue-graph", "2,4,8", 200, EVERY_OP, f"{MACHINE}-one-queue-200-graph", 180, ONE_QUEUE,
                extra=("--overload", "graph")),
        _stress("stress-one-queue-start", "2,4,8", 200, REPLAY_ORDER_CASES, f"{MACHINE}-one-queue-200-start", 150,
                ONE_QUEUE, extra=("--overload", "start")),
        _stress("stress-one-queue-peer", "2,4", 200, REPLAY_ORDER_CASES, f"{MACHINE}-one-queue-200-graph-peer", 90,
                ONE_QUEUE, peer=True, extra=("--overload", "graph")),
    ),
    # the same at two ranks, and whether how a rank waits for the device (fused_host_time --sync: the
    # context spinning or sleeping in a synchronize, not CUDA's auto) moves the first call after the wait
    "h200-step-sync": (
        STEP_OPS_W2,
        _host_time("host_time-w2-spin", 2, f"{MACHINE}-sync-spin-w2-host-pin-mps", 90, extra=("--sync", "spin")),
        _host_time("host_time-w2-blocking", 2, f"{MACHINE}-sync-blocking-w2-host-pin-mps", 90,
                   extra=("--sync", "blocking")),
        STEP_OPS_PEER_W2,
    ),
}


def check_batch(steps: tuple[Step, ...]) -> None:
    """A batch must fit one device call with room for the install."""
    total = sum(s.deadline_s for s in steps)
    if total + INSTALL_MARGIN_S > PER_CALL_LIMIT_S:
        raise ValueError(f"deadlines add up to {total} s: over a device call's {PER_CALL_LIMIT_S} s "
                         f"less {INSTALL_MARGIN_S} s for the install")


def run_step(step: Step, out: Path) -> dict:
    """Run one step in its own process group, killed at its deadline; its output to OUT/logs."""
    results, logs = out / "results", out / "logs"
    results.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    before = {p: p.stat().st_mtime for p in results.rglob("*")}
    cmd = step.command(results)
    env = {**os.environ, **NO_MULTICAST, **step.env}
    start = time.time()
    with open(logs / f"{step.name}.log", "w") as log:
        log.write(f"$ {' '.join(cmd)}\n# env {step.env}\n")
        log.flush()
        try:
            with cpu_power.kept_awake() if step.cpus_awake else nullcontext():
                rc, timed_out = run_until(cmd, ROOT, env, log, step.deadline_s)
        except OSError as e:  # the cores could not be kept awake: the step's condition is missing
            log.write(f"the cores could not be kept out of deep idle states ({e}): step not run\n")
            rc, timed_out = None, False
    written = sorted(str(p.relative_to(out)) for p in results.rglob("*")
                     if p.is_file() and before.get(p) != p.stat().st_mtime)
    return {"step": step.name, "command": cmd, "env": step.env, "cpus_awake": step.cpus_awake, "rc": rc,
            "timed_out": timed_out, "deadline_s": step.deadline_s, "seconds": round(time.time() - start, 1),
            "files": written}


def ensure_snapshots(steps: tuple[Step, ...], root: Path = ROOT) -> list[str]:
    """Make the snapshots the steps run from where they are missing under ``root``, from their
    revisions in ``SNAPSHOT_REVISIONS`` (``benchmarks/snapshot.py``: needs the repository's git
    history); what cannot be made, one line each (those steps then fail at once, the others run)."""
    from snapshot import snapshot

    problems = []
    for where in sorted({s.root for s in steps if s.root}):
        if (root / where / "compass_fx").is_dir():
            continue
        revision = SNAPSHOT_REVISIONS.get(where)
        if revision is None:
            problems.append(f"{where} is missing and no revision is known to make it from")
            continue
        try:
            snapshot(revision, root / where)
            print(f"snapshot of {revision} made in {where}", flush=True)
        except (SystemExit, OSError) as e:
            problems.append(f"{where}: the snapshot of {revision} could not be made ({e})")
    return problems


def run_batch(name: str, out: Path, pack: bool = False) -> list[dict]:
    """Run batch ``name``'s steps one after another into ``out`` (``pack``: into a folder beside it,
    packed into ``out/batch-<name>.tgz`` after every step)."""
    steps = BATCHES[name]
    check_batch(steps)
    for problem in ensure_snapshots(steps):
        print(f"[{name}] {problem}", flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"batch-{name}-")) / f"batch-{name}" if pack else out
    rows = []
    try:
        for i, step in enumerate(steps, 1):
            print(f"[{name} {i}/{len(steps)}] {step.name} (deadline {step.deadline_s} s)", flush=True)
            row = run_step(step, work)
            rows.append(row)
            state = "timed out" if row["timed_out"] else "not run" if row["rc"] is None else f"rc {row['rc']}"
            print(f"[{name} {i}/{len(steps)}] {step.name}: {state} in {row['seconds']} s, {len(row['files'])} files",
                  flush=True)
            (work / f"batch-{name}.json").write_text(json.dumps({"batch": name, "steps": rows}, indent=1))
            if pack:
                pack_folder(work, out / f"batch-{name}.tgz")
    finally:
        if pack:
            shutil.rmtree(work.parent, ignore_errors=True)
    return rows


def pack_folder(folder: Path, archive: Path) -> None:
    """``folder`` as a gzipped tar at ``archive``, its entries under the folder's name; written
    beside and renamed into place, so that a call cut short leaves the last whole archive."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    os.replace(partial, archive)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("batch", nargs="?", choices=sorted(BATCHES))
    p.add_argument("--out", default=os.environ.get("OUT"), help="where logs and results go (default $OUT)")
    p.add_argument("--list", action="store_true", help="print the batches and their steps")
    p.add_argument("--pack", action="store_true",
                   help="leave one file in --out, batch-<name>.tgz, rewritten after every step (the device tool "
                        "brings back at most 8 files)")
    p.add_argument("--snapshots-only", action="store_true",
                   help="make the snapshots the batch runs from, where missing, and stop (before a device call)")
    args = p.parse_args(argv)
    if args.snapshots_only:
        if not args.batch:
            p.error("--snapshots-only needs a batch")
        problems = ensure_snapshots(BATCHES[args.batch])
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    if args.list or not args.batch:
        for name, steps in BATCHES.items():
            print(f"{name} ({sum(s.deadline_s for s in steps)} s of deadlines)")
            for step in steps:
                awake = "  (cores kept awake)" if step.cpus_awake else ""
                print(f"  {step.name}: {' '.join(step.command(Path('OUT/results')))}  {step.env or ''}{awake}")
        return 0
    if not args.out:
        p.error("--out (or $OUT) is required")
    rows = run_batch(args.batch, Path(args.out), pack=args.pack)
    return 0 if all(r["rc"] == 0 and not r["timed_out"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
