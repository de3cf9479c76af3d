"""Turn the user's options and the cost model's advice into one Decision per pair."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from ..cost.decision import Decision
from ..cost.select import fuses_by_default, select
from ..cost.strategies import host_staged_in_pieces
from ..machine.topology import Topology
from ..options import CompassOptions
from ..graph.pairs import Pair


class Infeasible(Exception):
    """The options ask for something this pair cannot take; the pair stays as it is.  ``decision``:
    what the options asked for, when the pair's kind refuses it (the report shows it skipped)."""

    def __init__(self, reason: str, decision: Decision | None = None) -> None:
        super().__init__(reason)
        self.decision = decision


def decide(pair: Pair, options: CompassOptions, topology: object | None = None,
           refused: Mapping[str, str] | None = None, parts_replayed: bool = False,
           deferred: bool = False) -> Decision:
    """The strategy for ``pair``: forced by options, or chosen by ``cost.select`` among the
    strategies its lowering can take.

    ``refused`` maps a strategy ("decompose", "fuse") to why the pair's kind cannot lower it: such a
    strategy is never priced, so "auto" takes the best of the others (the report lists it, with why).
    A forced strategy or part count the pair cannot take raises ``Infeasible`` with the reason.
    ``parts_replayed``: an eager step would run the decomposed parts' collectives from one CUDA graph
    (the pair kind's ``parts_replayed``), so an extra part is priced as replayed.  ``deferred``: its
    fused call would run deferred (``fused_async``: ``lowering.fuse.would_defer``), its host issue
    priced as the asynchronous form's (a replay on a stream of its own, with events and a join).
    """
    refused = refused or {}
    forced = options.forced(pair.group_size)
    if forced is not None:
        strategy, parts, schedule = forced
        if strategy == "sequential":
            return Decision("sequential", reason="strategy='off'" if options.strategy == "off" else "chunks=1")
        if strategy == "fuse":
            # without peer access a ring only relays through host memory pieces every rank could pull
            # at once (and a reduce-scatter ring stalled at three ranks sharing one GPU): "direct",
            # which is also what the cost model prices there
            if Topology.resolve(topology).host_staged(pair.group_size):
                pieces = host_staged_in_pieces(pair.workload())
                forced_decision = Decision("fuse", schedule="direct", reason=(
                    f"forced: schedule={schedule}, through host memory: {pieces}" if schedule == "direct" else
                    f"forced: schedule={schedule}, run as direct: without peer access every piece goes through "
                    f"host memory, where every peer is one hop away; {pieces}"))
            else:
                forced_decision = Decision("fuse", schedule=schedule, reason=f"forced: schedule={schedule}")
        elif parts not in pair.feasible_parts():
            raise Infeasible(f"chunks={parts} does not divide the split dimension (extent {pair.split_extent})")
        else:
            forced_decision = Decision("decompose", parts, reason=f"forced: chunks={parts}")
        if strategy in refused:
            raise Infeasible(refused[strategy], dataclasses.replace(forced_decision, reason=refused[strategy]))
        return forced_decision
    workload = pair.workload()
    if "decompose" in refused:
        workload = dataclasses.replace(workload, feasible_parts=(1,))
    fused = offered_fused_schedules(pair) if auto_fuse(options.auto_fuse, pair.group_size, topology) else ()
    if "fuse" in refused:
        fused = ()
    if options.captures_cuda_graphs():
        workload = dataclasses.replace(workload, cuda_graphs=True)
        if not _fused_calls_captured():
            fused = ()  # each fused call would split the CUDA graphs, and run with its host floor
    else:
        workload = dataclasses.replace(workload, parts_replayed=parts_replayed, deferred=deferred)
    return select(workload, topology, fused_schedules=fused)  # "direct" only, host-staged


def _fused_calls_captured() -> bool:
    from ..kernels import fused_ops_capturable

    return fused_ops_capturable()


def auto_fuse(option: bool | None, group_size: int, topology: object | None = None) -> bool:
    """Whether "auto" may price the fused operators: as the option says, else the default rule."""
    if option is not None:
        return option
    return fuses_by_default(Topology.resolve(topology), group_size)


def offered_fused_schedules(pair: Pair) -> tuple[str, ...]:
    """Fused schedules the cost model may choose for this pair: real implementations on GPUs only.

    On CPU the fused operators are a correct reference (point-to-point messages), not a fast path,
    so "auto" never picks them there; ``strategy="fuse"`` still forces them anywhere.
    """
    val = pair.logical_tensor.meta.get("val")
    if val is None or val.device.type != "cuda":
        return ()
    from ..kernels import fused_schedules_available

    return fused_schedules_available("cuda", val.dtype)
