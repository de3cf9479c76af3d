"""Predicted seconds of each way to run one pair: sequential, InterDecom(d), IntraFusion(schedule).

Built from the component models (GEMM, collective, overlap, decomposition).  Conventions:

* one rank runs ``Workload.matmuls`` GEMM launches whose columns (gather) or inner dims (reduced
  sum) add up to n or k (``gemm_shapes``); their times add;
* all_gather_matmul moves the m x k activation, matmul_reduce_scatter and matmul_all_reduce the
  m x n output, element size of ``dtype``;
* sequential and InterDecom use NCCL (ring schedule, ``nccl_sms`` SMs taken while overlapped);
* a fused operator computes the block of m/g rows it already holds while the next block moves on
  the chosen schedule, moving data with the copy engine (see overlap.py), at
  ``FUSED_GEMM_EFFICIENCY`` of cuBLAS's rate for the GEMM cut into blocks.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

from ..machine.calibration import calibrated_fused_host, gpu_spec
from ..machine.gpus import dtype_bytes
from ..machine.topology import Topology
from .collective import CollectiveTime, collective_time, schedule_steps
from .decomposition import DecompositionModel
from .overlap import overlapped_gemm_time
from .workload import Workload

# The fused operators multiply each piece with cuBLAS (no slower than the unsplit GEMM per flop
# on the shapes measured) and pay a fixed device-side cost per call: the own block's copy into
# symmetric memory and the first flag round trip, +16 us (all-gather) and +3 us (reduce-scatter)
# over NCCL + cuBLAS on a 512-row pair on 2 H200s (benchmarks/results/fused_ops/fused_ops-h200x2-small.json).
FUSED_GEMM_EFFICIENCY = 1.0
FUSED_SETUP_S = 15e-6
MAX_PARTS = 64                # decomposition beyond this many parts is not considered

# The host's work per fused call.  An eager call replays a CUDA graph of its plan's commands once
# its tensors' addresses recur (kernels/cuda/replay.py, the steady state of a training step): the
# dispatch and the C around the replay (kernels/cuda/lane.cpp), plus the driver's launch of the graph.  That launch
# costs the host per node of a slow kind, a copy to or from host memory (the host-staged
# transport's pieces) or a stream wait (a flag wait), ~1.5-4 us each, and next to nothing for the
# rest (a kernel ~0.1 us, a device-to-device copy ~0: benchmarks/results/graph_node_probe/).
# Fitted by benchmarks/fit_model_constants.py (fit_replay: least squares in the plan's slow nodes
# over 140 cases, each run and world scaled to the median launches) to the steady host times of 2, 4
# and 8 ranks sharing one H200 since replayed calls are issued from C: each call issued while the
# ones before it run, as a step issues them, which is what a host that sets the pace pays per call
# (benchmarks/results/fused_host_time/, eight runs on two machine starts, both transports:
# -lane-w2-steady-run1/-run2, -lane-w48-breakdown, -wake-w2-base, -wake-w8-base host-staged;
# -lane-peer-w48 and -schedule-direct-run1/-run2 on the peer transport): 21 us + 2.13 us per slow
# node (median error 16%, p90 47%; priced / measured 0.97 host-staged, 1.09 peer; 1.02, 1.09, 1.01
# at 2, 4, 8 ranks; the first start's four runs alone gave 19 + 2.19; held out, a later H200 start's
# six runs are priced 0.83x host-staged and 1.15x peer: model_constants_fit-h200x2-heldout).  The first
# call after the host waited for an idle GPU costs 2-12x that (the ".graph" column; the fit before, to that column at
# two ranks: 20 us + 7.0 per slow node), but a step pays it once per synchronisation, when the GPU
# is idle anyway.  The Python path before fitted 35 us + 2.97 us per slow node (".graph", median
# error 21%, p90 52%).  tests/test_bench_scripts.py checks that the fit gives these.
# A call of two replay graphs (the ring schedules' all-reduce: the fused reduce-scatter, then the
# gather of the sums) is issued from C as one call, so its second graph costs its launch, not a
# second call: 9 us + its slow nodes, fitted by benchmarks/fit_model_constants.py (fit_replay_graph)
# to the steady column of three runs of the ring and double ring at 2, 4 and 8 ranks (peer
# transport, on an H100: fused_host_time-h100-schedule-*-lane-run1/2/3): per run and world, the
# all-reduces' median excess over a one-graph call minus the one-graph operators' median excess
# (the same host's baseline), the median of those 18.  Priced as a second call before (21 us).
# A deferred call (fused_async's *_start) replays too, on a stream of its workspace's own
# (kernels/cuda/impl._Workspace._replay_apart), entered from Python.  Where its host time goes
# (fused_host_time --deferred-parts, one H100, two ranks, fused_host_time-h100-deferred-default-*): the
# start 33-73 us (a .graph call of the same rounds 13-54), of which the events that order its stream with
# the caller's 5-9; the wait 16-20; c10d's hand-off alone (a work registered for the output, taken back by
# wait_tensor, whose every call also runs the Python autograd wrapper torch registers for it) 14-24.
# Entering the start from C instead, a reverted candidate, cost the same (fused_host_time-h100-async-c-start-*).
# FUSED_DEFERRED_S, fitted by benchmarks/fit_model_constants.py (fit_deferred) to four runs of the
# asynchronous form (start, a GEMM, wait; fused_host_time-h100-async-entry-* and -deferred-default-*, two
# starts of one H100, two ranks, both transports): per run the median of its time less the .graph call's
# and a torch.mm's of the same rounds, each after an idle device (so this is its dearest; 89-131 us, the
# median taken).  Issued command by command, as every deferred call was before, the same form cost
# 1.8-2.6x the replayed one.
# FUSED_CALLS_REPLAYED = False prices every call issued command by command instead (the constants below).
FUSED_CALLS_REPLAYED = True
FUSED_REPLAY_CALL_S = 21e-6
FUSED_REPLAY_GRAPH_S = 9e-6
FUSED_DEFERRED_S = 96e-6
FUSED_REPLAY_SLOW_NODE_S = 2.13e-6
_REPLAY_FITTED_LAUNCH_S = {"Copy": 8.3e-6, "Matmul": 17.66e-6, "Record": 1.51e-6, "Reduce": 9.31e-6,
                           "SetFlag": 3.7e-6, "WaitEvent": 1.6e-6,
                           "WaitFlag": 3.68e-6}  # the launches alone on the host of that fit (the runs' median)

# Issued command by command, Python issues one launch per command of the plan (a cuBLAS GEMM,
# a copy or a stream memory operation through the driver, an event) after the custom op's dispatch.
# When the device work is shorter, the host sets the pace (a step keeps the host ahead of the GPU,
# so a call takes the longer of the two).  Each launch costs about 1.6 times what it costs alone (the
# closures and tensor views around it; benchmarks/results/fused_host_time/, run1 and run2, two
# ranks sharing one H200).  The fixed work of a call besides the dispatch is fitted to the two
# world-2 operator grids of the two-H200 machine (benchmarks/fit_model_constants.py ->
# results/model_constants_fit/), whose small fused calls were host-bound whatever their size.
FUSED_HOST_CALL_REST_S = 500e-6   # the fixed work of a call besides the dispatch, on the fitted host
FUSED_HOST_CALL_S = 40e-6 + FUSED_HOST_CALL_REST_S  # dispatch (40 us on the fitted host) + the rest
FUSED_HOST_COMMAND_S = {"Matmul": 17.6e-6, "Reduce": 9.1e-6, "Copy": 7.9e-6, "SetFlag": 3.0e-6, "WaitFlag": 3.1e-6,
                        "Record": 1.2e-6, "WaitEvent": 1.2e-6}
# A calibration that measured this machine's launches (compass-fx calibrate: "fused_host") replaces
# the per-command costs by LAUNCH_INSIDE_CALL times each launch alone, and the per-call cost by the
# measured dispatch plus the rest of a call's fixed work, scaled with the launches (the same host
# measured 1.6x dearer launches on another instance of the H200 machine).
LAUNCH_INSIDE_CALL = 1.6
_FITTED_LAUNCH_S = {"Matmul": 11.0e-6, "Reduce": 5.7e-6, "Copy": 4.9e-6, "SetFlag": 1.9e-6, "WaitFlag": 1.9e-6,
                    "Record": 0.7e-6, "WaitEvent": 0.8e-6}  # the launches alone on the fitted host

_OP = {"all_gather_matmul": "all_gather", "matmul_reduce_scatter": "reduce_scatter",
       "matmul_all_reduce": "all_reduce"}


def comm_bytes(w: Workload) -> int:
    """Bytes of the whole tensor the collective moves (gathered input or pre-scatter output)."""
    width = w.k if w.kind == "all_gather_matmul" else w.n
    return w.m * width * dtype_bytes(w.dtype)


def _even(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` near-equal positive pieces (fewer if total < parts)."""
    base, extra = divmod(total, parts)
    sizes = (base + (1 if i < extra else 0) for i in range(parts))
    return tuple(size for size in sizes if size > 0)


def gemm_shapes(w: Workload) -> tuple[tuple[int, int], ...]:
    """(n, k) of each GEMM launch sharing the collective (``Workload`` sums them into n or k):
    a gather's GEMMs split n (by ``extra_n`` when given, else evenly), a reduced sum's GEMMs
    split k evenly."""
    if w.kind == "all_gather_matmul":
        if w.extra_n:
            first = w.n - sum(w.extra_n)
            if first < 1:
                raise ValueError(f"Workload.extra_n {w.extra_n} must sum to less than n={w.n}")
            return tuple((n, w.k) for n in (first, *w.extra_n))
        return tuple((n, w.k) for n in _even(w.n, w.matmuls))
    return tuple((w.n, k) for k in _even(w.k, w.matmuls))


def _gemms_seconds(w: Workload, rows: int, topo: Topology, comm_sms: int = 0, comm_rate: float = 0.0) -> float:
    return sum(overlapped_gemm_time(rows, n, k, w.matmul_dtype, topo.gpu, comm_sms, comm_rate).seconds
               for n, k in gemm_shapes(w))


def nccl_time(w: Workload, topo: Topology, parts: int = 1) -> CollectiveTime:
    """One NCCL collective over 1/parts of the pair's tensor."""
    return collective_time(_OP[w.kind], comm_bytes(w) / parts, topo, w.group_size, "ring")


def _comm_hbm_rate(ct: CollectiveTime, message_bytes: float) -> float:
    """HBM traffic per second of a collective on one GPU: each step a rank reads the message it
    sends and writes the one it receives."""
    return 2.0 * message_bytes * ct.steps / ct.seconds if ct.seconds > 0 else 0.0


def sequential_seconds(w: Workload, topo: Topology) -> float:
    """NCCL collective, then (or before) the GEMMs, nothing overlapped."""
    if w.group_size == 1:
        return _gemms_seconds(w, w.m, topo)
    return nccl_time(w, topo).seconds + _gemms_seconds(w, w.m, topo)


def decomposition_models(w: Workload, topo: Topology, allowed: tuple[int, ...] | None = None
                         ) -> dict[int, DecompositionModel]:
    """The paper's T(d) = A*d + B + C/d for this pair, one model per feasible part count d > 1
    (keyed by ``parts``; ``allowed``: the part counts to price, default :func:`decompose_parts`).

    Cm and alpha come from the NCCL collective's transfer and latency parts, Gm is the GEMMs' time
    while NCCL runs beside them (see decomposition.py for how they make A, B, C).  beta, the
    per-part GEMM cost (launch, waves lost to small parts), is read off the GEMM model:
    ``beta(d) = (d*g(m/d) - g(m)) / (d - 1)``.  Wave quantization makes beta grow with d, so one
    constant A would misprice either the few-part or the many-part end; each part count is
    therefore predicted with the A that holds at it, and the model of the best part count is the
    one whose ``d* = sqrt(C/A)`` is reported.
    """
    spec = gpu_spec(topo.gpu)
    full = nccl_time(w, topo)
    alpha, cm = full.latency_s, full.transfer_s
    rate = _comm_hbm_rate(full, comm_bytes(w) / w.group_size)

    def g(parts: int) -> float:
        return parts * _gemms_seconds(w, w.m // parts, topo, spec.nccl_sms, rate)

    gm = g(1)

    def build(parts: int) -> DecompositionModel:
        beta = max((g(parts) - gm) / (parts - 1), spec.kernel_overhead_s)
        # software cost per part, on the critical path either way (under CUDA graphs the device's
        # alone; with the parts' gathers replayed, the host's GEMM launch and event wait)
        ov = (spec.graph_part_overhead_s if w.cuda_graphs else
              spec.replayed_part_overhead_s if w.parts_replayed else spec.part_overhead_s)
        comm_bound = DecompositionModel(alpha + ov, cm + beta, gm, "comm-bound")
        compute_bound = DecompositionModel(beta + ov, gm + alpha, cm, "compute-bound")
        # The pipeline takes the longer of the two forms (c + g + (d-1)*max(c, g)).
        return max((comm_bound, compute_bound), key=lambda m: m.seconds(parts))

    part_counts = [parts for parts in (allowed if allowed is not None else decompose_parts(w)) if parts > 1]
    return {parts: build(parts) for parts in part_counts}


def decomposition_model(w: Workload, topo: Topology, parts: int | None = None) -> DecompositionModel:
    """The decomposition model with A as it holds at ``parts`` (default: the best feasible part count)."""
    models = decomposition_models(w, topo)
    if not models:
        raise ValueError(f"decomposition_model: {w.kind} m={w.m} has no feasible part count above 1")
    if parts is None:
        parts = min(models, key=lambda p: (models[p].seconds(p), p))
    if parts not in models:
        raise ValueError(f"parts must be one of {sorted(models)}, got {parts!r}")
    return models[parts]


def decompose_part_seconds(w: Workload, topo: Topology, parts: int) -> tuple[float, float]:
    """(collective, GEMMs) seconds of one of ``parts`` parts, the GEMMs slowed by NCCL beside them."""
    ct = nccl_time(w, topo, parts)
    rate = _comm_hbm_rate(ct, comm_bytes(w) / w.group_size / parts)
    return ct.seconds, _gemms_seconds(w, w.m // parts, topo, gpu_spec(topo.gpu).nccl_sms, rate)


def decompose_parts(w: Workload) -> tuple[int, ...]:
    """Feasible part counts above 1 (``Workload.parts_allowed``), at most ``MAX_PARTS``."""
    return tuple(parts for parts in w.parts_allowed() if 1 < parts <= MAX_PARTS)


@dataclass(frozen=True)
class FusedBreakdown:
    piece_gemm_s: float        # the GEMM of the piece in hand (a block of m/g rows, or a host-staged piece)
    steps_s: tuple[float, ...]
    seconds: float
    gemm_s: float = 0.0        # host-staged: all GEMMs of the pair (steps_s: the one pipelined transfer)
    host_staged: bool = False


def _launch_speed(measured: dict, fitted: dict[str, float]) -> tuple[dict[str, float], float]:
    """This machine's launches (measured where calibrated, else the fitted host's) and their median
    ratio to the ``fitted`` host's."""
    launch = {kind: float(measured["launch_s"].get(kind, fitted[kind])) for kind in fitted}
    return launch, sorted(launch[k] / fitted[k] for k in launch)[len(launch) // 2]


def fused_host_costs() -> tuple[float, dict[str, float]]:
    """(seconds per call, seconds per command kind) of the host's work in a fused call issued command
    by command: this machine's calibration where it measured them, else the constants fitted on the
    H200 host."""
    measured = calibrated_fused_host()
    if measured is None:
        return FUSED_HOST_CALL_S, FUSED_HOST_COMMAND_S
    launch, speed = _launch_speed(measured, _FITTED_LAUNCH_S)
    dispatch = float(measured.get("dispatch_s", FUSED_HOST_CALL_S - FUSED_HOST_CALL_REST_S))
    call = dispatch + FUSED_HOST_CALL_REST_S * speed
    return call, {kind: LAUNCH_INSIDE_CALL * s for kind, s in launch.items()}


class ReplayCosts(NamedTuple):
    """The host's seconds of a replayed fused call: per call, per replay graph beyond its first,
    per slow node of its graphs, and beyond all that for a deferred call."""
    call_s: float
    graph_s: float
    node_s: float
    deferred_s: float


def fused_replay_costs() -> ReplayCosts:
    """The replayed fused call's host costs, scaled to this machine's launches where a calibration
    measured them."""
    costs = ReplayCosts(FUSED_REPLAY_CALL_S, FUSED_REPLAY_GRAPH_S, FUSED_REPLAY_SLOW_NODE_S, FUSED_DEFERRED_S)
    measured = calibrated_fused_host()
    if measured is None:
        return costs
    _, speed = _launch_speed(measured, _REPLAY_FITTED_LAUNCH_S)
    return ReplayCosts(*(s * speed for s in costs))


def replay_slow_nodes(plan, host: bool, batched_waits: bool = True) -> int:
    """The nodes of ``plan``'s replay graph that cost the host's graph launch microseconds each (as
    ``kernels/cuda/impl._compile_replay`` captures them by default): its flag waits (stream waits;
    with ``batched_waits``, as by default, each of the plan's runs of waits one node:
    ``Plan.wait_runs``) and, on the host-staged transport, its copies to or from host memory
    (copy-engine copies; each run of pulls, ``Plan.copy_runs``, as at most two: the peers below
    the rank and those above it, ``kernels/cuda/copy_runs``)."""
    from ..kernels.protocol import Copy, WaitFlag

    waits = sum(1 for c in plan.commands if isinstance(c, WaitFlag))
    if batched_waits:
        waits -= sum(len(run) - 1 for run in plan.wait_runs())
    if not host:
        return waits
    copies = sum(1 for c in plan.commands if isinstance(c, Copy) and plan.crosses_symmetric(c))
    return waits + copies - sum(len(run) - min(2, len(run)) for run in plan.copy_runs())


def _fused_plans(w: Workload, topo: Topology, schedule: str) -> tuple[list, bool]:
    """Rank 0's plans of one fused call as the CUDA path builds them for this transport, and
    whether that transport is host-staged."""
    from ..kernels.issue_order import call_plans

    host = topo.host_staged(w.group_size)
    g = w.group_size
    rows = w.m // g if w.kind == "all_gather_matmul" else w.m
    cols = w.k if w.kind == "all_gather_matmul" else w.n
    if not host:
        return call_plans(w.kind, schedule, g, 0, rows, cols, w.matmuls, dtype_bytes(w.dtype), False), host
    from ..kernels.protocol import host_most_pieces_setting, host_piece_bytes

    return call_plans(w.kind, "direct", g, 0, rows, cols, w.matmuls, dtype_bytes(w.dtype), True,
                      host_piece_bytes(), most_pieces=host_most_pieces_setting()), host


def fused_commands(w: Workload, topo: Topology, schedule: str) -> int:
    """The commands of one fused call's plans: what its replay graph holds, cheap to launch or not."""
    return sum(len(plan.commands) for plan in _fused_plans(w, topo, schedule)[0])


def fused_host_seconds(w: Workload, topo: Topology, schedule: str, replayed: bool | None = None) -> float:
    """Host seconds of one call of the fused operator: its plans' commands (as the CUDA path builds
    them for this transport), replayed from a captured graph per plan (``replayed``, default
    ``FUSED_CALLS_REPLAYED``: one call's work, each graph beyond the first its launch, each graph's
    slow nodes; a deferred call, ``Workload.deferred``, what its asynchronous form adds) or issued one
    by one and priced by kind, plus the per-call work for each plan."""
    plans, host = _fused_plans(w, topo, schedule)
    if FUSED_CALLS_REPLAYED if replayed is None else replayed:
        costs = fused_replay_costs()  # the graphs of one call are launched from C in one call
        return (costs.call_s + costs.graph_s * (len(plans) - 1) + (costs.deferred_s if w.deferred else 0.0)
                + costs.node_s * sum(replay_slow_nodes(plan, host) for plan in plans))
    per_call, per_kind = fused_host_costs()
    return sum(per_call + sum(per_kind.get(type(c).__name__, 0.0) for c in plan.commands) for plan in plans)


def fused_breakdown(w: Workload, topo: Topology, schedule: str) -> FusedBreakdown:
    """IntraFusion on ``schedule``: g blocks of m/g rows; step i's transfer hides behind the GEMM
    of the block in hand.  all_gather: local block first, the last arrival's GEMM exposed;
    reduce_scatter: the first block's GEMM exposed, each step adds into the travelling
    accumulator; all_reduce: fused reduce-scatter, then an all-gather of the result on the same
    schedule that nothing hides.  GPUs without peer access: :func:`host_staged_breakdown`."""
    if topo.host_staged(w.group_size):
        return host_staged_breakdown(w, topo)
    spec = gpu_spec(topo.gpu)
    g = w.group_size
    rows = math.ceil(w.m / g)
    elt = dtype_bytes(w.dtype)
    shard = comm_bytes(w) / g
    steps = schedule_steps(topo, g, shard, schedule)
    transfer = sum(t for _, t in steps)
    rate = 2.0 * shard * len(steps) / transfer if transfer > 0 else 0.0
    block_gemm = _gemms_seconds(w, rows, topo, 0, rate) / FUSED_GEMM_EFFICIENCY
    if w.kind != "all_gather_matmul":  # add the incoming partial sum: read two, write one
        block_gemm += 3 * rows * w.n * elt / (spec.hbm_gbps * 1e9 * spec.memory_efficiency)
    step_s = tuple(l + t for l, t in steps)
    if w.kind == "all_gather_matmul":
        total = FUSED_SETUP_S + _grouped_consumer_seconds(w, topo, rows, block_gemm, step_s, rate)
    else:
        total = FUSED_SETUP_S + block_gemm + sum(max(block_gemm, s) for s in step_s)
    if w.kind == "matmul_all_reduce":
        total += sum(step_s) + FUSED_SETUP_S
    return FusedBreakdown(block_gemm, step_s, total)


def _grouped_consumer_seconds(w: Workload, topo: Topology, rows: int, own: float, step_s: tuple[float, ...],
                              rate: float) -> float:
    """The fused all-gather's GEMMs as the CUDA path groups them: the own block first, then each
    group of arriving blocks (:func:`compass_fx.kernels.protocol.consumer_groups`) once its last
    block is in; one block arrives per step."""
    from ..kernels.protocol import consumer_group_rows, consumer_groups

    spec = gpu_spec(topo.gpu)
    min_rows = consumer_group_rows(max(w.n // max(w.matmuls, 1), 1), spec.sms)
    spans = [(i * rows, (i + 1) * rows) for i in range(1, len(step_s) + 1)]
    done, arrived = own, list(itertools.accumulate(step_s))
    for group in consumer_groups(spans, min_rows):
        gemm = _gemms_seconds(w, rows * len(group), topo, 0, rate) / FUSED_GEMM_EFFICIENCY
        done = max(done, arrived[group[-1]]) + gemm
    return done


def host_staged_pieces(w: Workload) -> int:
    """Into how many pieces a host-staged fused call cuts each peer's block (the all-reduce: its
    chunks, 0 where it falls back to a reduce-scatter and a gather), as the CUDA path cuts them
    (:func:`compass_fx.kernels.protocol.host_split`, at most
    :func:`~compass_fx.kernels.protocol.host_most_pieces` a block; ``COMPASS_HOST_PIECE_MIB`` and
    ``COMPASS_HOST_MOST_PIECES`` as the run reads them)."""
    from ..kernels.protocol import (host_all_reduce_chunks, host_most_pieces, host_most_pieces_setting,
                                    host_piece_bytes, host_split)

    total_bytes, target, setting = comm_bytes(w), host_piece_bytes(), host_most_pieces_setting()
    if w.kind == "matmul_all_reduce":
        return host_all_reduce_chunks(w.m, w.group_size, int(total_bytes), target, setting)
    return host_split(int(total_bytes / w.group_size), target, host_most_pieces(w.group_size, setting))


def host_staged_in_pieces(w: Workload) -> str:
    """What a report says of a host-staged fused call's pieces, and why that many (the cap by
    ranks, or the setting): "each block in 2 pieces (at most 2 a block at 8 ranks)"."""
    from ..kernels.protocol import host_most_pieces, host_most_pieces_setting

    setting = host_most_pieces_setting()
    pieces, most, g = host_staged_pieces(w), host_most_pieces(w.group_size, setting), w.group_size
    why = f"by COMPASS_HOST_MOST_PIECES={setting}" if setting else f"at {g} ranks"
    if w.kind == "matmul_all_reduce":
        if not pieces:
            return "a reduce-scatter, then a gather of its sums"
        whole = ", each pulled whole from the peer" if g == 2 else ""  # protocol.all_reduce_pair_plan
        return f"in {pieces} chunk{'s' * (pieces > 1)}{whole} (at most {most} {why})"
    return f"each block in {pieces} piece{'s' * (pieces > 1)} (at most {most} a block {why})"


def host_staged_breakdown(w: Workload, topo: Topology) -> FusedBreakdown:
    """A fused operator whose pieces travel device -> pinned host memory -> peer on the copy engines.

    Each rank publishes its pieces once (device to host) and pulls every peer's (host to device),
    both directions at once, the pieces pipelined (:func:`compass_fx.kernels.protocol.host_split`),
    so the busier direction sets the pace after the first piece.  The GEMMs run beside it on every
    SM: all_gather's own rows first and the last piece's rows after it arrives; reduce_scatter's
    first piece before anything can travel, the sum of the own block after the last arrival;
    all_reduce moves each chunk's partial products and then its reduced blocks (at two ranks, each
    rank the peer's whole partial of a chunk in one round)."""
    bw, per_piece = topo.host_copy(w.group_size)
    spec = gpu_spec(topo.gpu)
    g, elt = w.group_size, dtype_bytes(w.dtype)
    total_bytes = comm_bytes(w)
    block = total_bytes / g
    pieces = host_staged_pieces(w) or 1  # an all-reduce's 0: the fallback, priced as one
    if w.kind == "matmul_all_reduce":
        out_bytes, in_bytes = total_bytes, 2 * (g - 1) / g * total_bytes
        # two ranks pull each other's whole partial, a chunk at a time (protocol.all_reduce_pair_plan)
        first = total_bytes / pieces / (1 if g == 2 else g)
    else:
        out_bytes = block if w.kind == "all_gather_matmul" else (g - 1) * block
        in_bytes = (g - 1) * block
        first = block / pieces
    moving = first / bw + max(out_bytes, in_bytes) / bw + pieces * (g - 1) * per_piece
    gemm = _gemms_seconds(w, w.m, topo) / FUSED_GEMM_EFFICIENCY
    piece_gemm = gemm / (g * pieces)
    if w.kind == "all_gather_matmul":
        total = max(gemm, moving + piece_gemm)
    else:  # the last piece's sum (read two, write one) after it arrives
        reduce = 3 * w.m / (g * pieces) * w.n * elt / (spec.hbm_gbps * 1e9 * spec.memory_efficiency)
        total = max(gemm, piece_gemm + moving) + reduce
    return FusedBreakdown(piece_gemm, (moving,), FUSED_SETUP_S + total, gemm, host_staged=True)


def fused_seconds(w: Workload, topo: Topology, schedule: str) -> float:
    """The device's time of the fused call or the host's, whichever is longer (replayed in a CUDA
    graph, the host issues nothing: the device's)."""
    device = fused_breakdown(w, topo, schedule).seconds
    if w.group_size == 1 or w.cuda_graphs:
        return device
    return max(device, fused_host_seconds(w, topo, schedule))
