"""The single place where a pair's strategy is chosen: every candidate predicted, hooks applied,
the fastest taken.

Deterministic: the predictions are pure functions of the workload and the topology, candidates
come in a fixed order (sequential, decompose by ascending part count, fuse in ``SCHEDULES`` order), and a
tie goes to the simpler candidate: a fused schedule only where no other is as fast, and among fused
schedules the one whose calls cost the host least (fewer pieces), then the one with fewer commands,
then the earlier one; so every rank of a group reaches the same decision.
"""
from __future__ import annotations

from typing import Callable

from ..machine.topology import Topology
from .decision import SCHEDULES, Candidate, Decision
from .hooks import apply_cost_hooks
from .strategies import (decomposition_models, fused_breakdown, fused_commands, fused_host_seconds, fused_seconds,
                         host_staged_in_pieces, sequential_seconds)
from .workload import Workload


def _check_schedules(fused_schedules: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(fused_schedules, str):
        fused_schedules = (fused_schedules,)
    unknown = [s for s in fused_schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"fused_schedules must name schedules from {SCHEDULES}, got {unknown}")
    return tuple(s for s in SCHEDULES if s in fused_schedules)


def _ratio(a: float, b: float) -> str:
    """a/b for a reason string; a cost hook may legitimately predict 0 s."""
    return f"{a / b:.2f}x" if b > 0 else ("1.00x" if a == 0 else "infinitely")


def _reason(winner: Candidate, candidates: list[Candidate], priced: Callable[[Candidate], str]) -> str:
    """The winner against sequential (or sequential against the best alternative), with what
    ``priced`` says of how the candidate compared was priced."""
    seq = candidates[0]
    if winner is seq:
        others = [c for c in candidates[1:] if c.seconds is not None]
        if not others:
            return "sequential: no other strategy is feasible for this pair"
        best = min(others, key=lambda c: c.seconds)
        return (f"sequential: best alternative {best.label} would be {_ratio(best.seconds, seq.seconds)} slower"
                + priced(best))
    return f"{winner.label} {_ratio(seq.seconds, winner.seconds)} faster than sequential" + priced(winner)


def _host_bound(workload: Workload, topo: Topology, candidate: Candidate) -> str:
    """Where a fused call is priced at its host's issue, not its device time (eager: the host issues
    a call slower than the GPU runs it), the reason says so with both figures: the decision then
    rests on the host cost model (``fused_host_seconds``), and a CUDA-graph mode would price it lower."""
    if candidate.strategy != "fuse" or workload.cuda_graphs or workload.group_size == 1:
        return ""
    host = fused_host_seconds(workload, topo, candidate.schedule)
    device = fused_breakdown(workload, topo, candidate.schedule).seconds
    if host <= device or candidate.seconds != host:  # device-bound, or a cost hook set the price
        return ""
    call = "a deferred call, replayed on a stream of its own" if workload.deferred else "a call"
    return f" (priced at the host's issue of {call}, {_us(host)}, over its {_us(device)} on the device)"


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f} us" if us >= 100 else f"{us:.1f} us"


def _priced_as(workload: Workload) -> str:
    """How the decomposition's parts were priced, where not as issued one by one."""
    if workload.cuda_graphs:
        return ""  # the CUDA-graph mode is said by the report already
    return " (its parts' gathers priced as replayed from one CUDA graph)" if workload.parts_replayed else ""


def _how(workload: Workload, topo: Topology, winner: Candidate) -> str:
    """What the reason adds about how the winner runs: a decomposition's parts priced as replayed,
    a host-staged fused call's pieces."""
    if winner.strategy == "decompose":
        return _priced_as(workload)
    if winner.strategy == "fuse" and topo.host_staged(workload.group_size):
        return f", through host memory: {host_staged_in_pieces(workload)}"
    return ""


def _host_tie_break(workload: Workload, topo: Topology, candidate: Candidate) -> tuple[float, int]:
    """What breaks a tie of predicted times: a fused call's host seconds, then its commands (0 for
    the others).

    Schedules that move the same bytes over the same links tie on the device; the one cut into more
    pieces (the double ring at two ranks: each shard in two halves to the one peer) costs more
    launches and was measured slower in 17 of the 24 pairs of the two-H200 grid
    (benchmarks/results/multigpu_operators/multigpu_operators-h200x2.json: "direct" best, the double ring picked).
    Where their replay graphs wait alike (the ring and "direct" on a switch), the one with fewer
    commands is the simpler: no partial sums relayed through every rank."""
    if candidate.strategy != "fuse":
        return 0.0, 0
    return (fused_host_seconds(workload, topo, candidate.schedule),
            fused_commands(workload, topo, candidate.schedule))


def select(workload: Workload, topology: "Topology | str | None" = None, *,
           fused_schedules: tuple[str, ...] = ()) -> Decision:
    """Choose how to run ``workload`` on ``topology`` (a Topology, a preset name or a file; default
    :meth:`Topology.default`, replicated over InfiniBand when the group is larger than that machine).

    Candidates: sequential; decompose(d) for every feasible part count d > 1
    (``Workload.parts_allowed``, at most ``MAX_PARTS``) predicted by the decomposition model T(d) = A*d + B + C/d; fuse(s) only
    for the schedules in ``fused_schedules`` — the fused operators the caller has for this device
    and dtype; one of two schedules that move the same pieces at this group size (the ring and
    "direct" at two ranks) is priced under the later name — by peer-to-peer copies where the GPUs reach each other's memory, else ("direct"
    only) through pinned host memory on the copy engines.  ``Decision.coefficients`` and ``Decision.d_star`` are those of the best
    decompose candidate's model.
    """
    if workload is None or not isinstance(workload, Workload):
        raise ValueError(f"select: workload must be a Workload, got {workload!r}")
    if isinstance(topology, str):
        topology = Topology.resolve(topology)
    topo = Topology.default() if topology is None else topology
    if not isinstance(topo, Topology):
        raise ValueError(f"select: topology must be a Topology, a preset name, a file or None, got {topology!r}")
    if topology is None and workload.group_size > topo.num_gpus:
        # The group spans machines like this one (a detected single box, or the default preset).
        topo = topo.replicated(-(-workload.group_size // topo.num_gpus))
    schedules = _check_schedules(fused_schedules)
    topo.group(workload.group_size)  # ValueError when the group does not fit the machine

    candidates = [Candidate("sequential", 1, None, sequential_seconds(workload, topo))]
    coefficients = d_star = None
    models = decomposition_models(workload, topo) if workload.group_size > 1 else {}
    candidates += [Candidate("decompose", parts, None, model.seconds(parts)) for parts, model in models.items()]
    if workload.group_size > 1 and topo.peer_access(workload.group_size):
        from ..kernels.schedules import distinct_schedules  # the schedules' steps, pure Python

        candidates += [Candidate("fuse", 1, s, fused_seconds(workload, topo, s))
                       for s in distinct_schedules(schedules, workload.group_size)]
    elif topo.host_staged(workload.group_size) and "direct" in schedules:
        # no peer access: the fused operators meet in pinned host memory, every peer one hop away
        candidates.append(Candidate("fuse", 1, "direct", fused_seconds(workload, topo, "direct")))

    candidates = [apply_cost_hooks(workload, topo, c) for c in candidates]
    fastest = min(c.seconds for c in candidates)
    tied = [c for c in candidates if c.seconds == fastest]  # host costs are priced for a tie only
    winner = min(tied, key=lambda c: _host_tie_break(workload, topo, c))  # min keeps the first of equal ones
    decomposed = [c for c in candidates if c.strategy == "decompose"]
    if decomposed:
        model = models[min(decomposed, key=lambda c: c.seconds).parts]
        coefficients, d_star = (model.A, model.B, model.C), model.d_star()
    return Decision(winner.strategy, winner.parts, winner.schedule, winner.seconds, tuple(candidates),
                    _reason(winner, candidates, lambda c: _host_bound(workload, topo, c)) + _how(workload, topo, winner),
                    coefficients, d_star, topo.name)


def plan(workload: Workload, topology: "Topology | str | None" = None, *,
         fused_schedules: tuple[str, ...] | None = SCHEDULES) -> Decision:
    """What-if planning without a graph (CLI, benchmarks, reports): like :func:`select`, but by
    default with every fused schedule, i.e. the whole framework of the paper; ``None``: what
    strategy='auto' prices by default (:func:`fuses_by_default`)."""
    if fused_schedules is None:
        fused_schedules = SCHEDULES if fuses_by_default(Topology.resolve(topology), workload.group_size) else ()
    return select(workload, topology, fused_schedules=fused_schedules)


def fuses_by_default(topology: Topology, group_size: int) -> bool:
    """Whether strategy='auto' prices the fused operators without ``auto_fuse``: only where the
    group's GPUs lack peer access, where their host-staged transport (copy engines through pinned
    host memory) was measured 1.07-1.6x faster per pair than NCCL + cuBLAS on 2 H200s
    (benchmarks/results/fused_ops/fused_ops-h200x2-hoststaged.json); on peer links their gain is smaller and
    they stay opt-in."""
    return topology.host_staged(group_size)
