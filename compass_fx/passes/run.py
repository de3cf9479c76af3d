"""The pass the backend runs on every graph: match, decide, rewrite, record."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.fx as fx

from ..cost.decision import Decision
from ..machine.calibration import calibration_in_use
from ..graph.normalize import normalize
from ..graph.pairs import Pair
from ..lowering import RewriteFailed, rewrite
from ..options import CompassOptions
from ..report import GraphReport, PairRecord
from .agree import agree
from .decide import Infeasible, decide
from .match import find_pairs

log = logging.getLogger("compass_fx")

COLLECTIVES = (
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops.compass.all_gather_blocking.default,  # a decomposed gather's part on gloo
)


def count_collectives(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVES)


def compass_pass(gm: fx.GraphModule, graph_kind: str, options: CompassOptions,
                 topology: object | None = None) -> GraphReport:
    """Rewrite ``gm`` in place and return what was found and done.

    Pairs are handled one at a time and the graph is matched again after each rewrite (only then:
    a pair kept or skipped leaves the graph as it was), so that a rewrite never acts on nodes
    another rewrite has replaced.
    """
    gm.graph.eliminate_dead_code()
    changed = {what: n for what, n in normalize(gm).items() if n}
    if changed:
        log.info("compass_fx: %s graph: normalized before matching: %s", graph_kind,
                 ", ".join(f"{n} {what}" for what, n in changed.items()))
    report = GraphReport(graph_kind, collectives_before=count_collectives(gm))
    _dump(gm, graph_kind, "before", options)
    handled: set[str] = set()
    skips_seen: set[str] = set()
    todo: list[Pair] | None = None  # None: the graph changed since it was last matched
    while True:
        if todo is None:
            pairs, skips = find_pairs(gm, graph_kind, options.group)
            for s in skips:
                if s.collective not in skips_seen:
                    skips_seen.add(s.collective)
                    report.skipped.append(s)
            todo = [p for p in pairs if p.collective.name not in handled]
        if not todo:
            break
        pair = todo.pop(0)
        handled.add(pair.collective.name)
        graph = gm.graph
        record = _apply(gm, pair, options, topology)
        report.pairs.append(record)
        if record.status == "rewritten" or gm.graph is not graph:  # changed, or restored from a copy
            todo = None
    gm.graph.lint()
    gm.recompile()
    report.collectives_after = count_collectives(gm)
    _dump(gm, graph_kind, "after", options)
    return report


def _apply(gm: fx.GraphModule, pair: Pair, options: CompassOptions, topology: object | None) -> PairRecord:
    try:
        decision = agree(pair, decide(pair, options, topology))
    except Infeasible as e:
        agree(pair, Decision("sequential", reason=str(e)))  # every rank takes part in each agreement
        record = _record(pair, Decision("sequential", reason=str(e)))
        record.status = "skipped"
        log.info("compass_fx: %s graph: %s left untouched: %s", pair.graph_name, pair.describe(), e)
        return record
    record = _record(pair, decision)
    if decision.strategy == "sequential":
        record.status = "kept"
        log.info("compass_fx: %s graph: %s kept sequential: %s", pair.graph_name, pair.describe(), decision.reason)
        return record
    log.info("compass_fx: %s graph: %s -> %s", pair.graph_name, pair.describe(), decision.label)
    try:
        record.asynchronous = rewrite(gm, pair, decision, asynchronous=options.fused_async)
    except RewriteFailed as e:  # the graph is as it was; the same happens on every rank
        record.status, record.reason = "skipped", str(e)
        # a pair the fused operators do not take is expected; a decomposition that fails is not
        (log.info if decision.strategy == "fuse" else log.warning)(
            "compass_fx: %s graph: %s left untouched: %s", pair.graph_name, pair.describe(), e)
        return record
    record.status = "rewritten"
    return record


def _record(pair: Pair, decision: Decision) -> PairRecord:
    m, n, k = pair.mnk()
    return PairRecord(
        graph=pair.graph_name, collective=pair.collective.name, kind=pair.kind, dim=pair.layout.dim,
        shape=list(pair.layout.shape), m=m, n=n, k=k, matmuls=len(pair.matmuls),
        group=pair.group_name, group_size=pair.group_size, dtype=str(pair.dtype).replace("torch.", ""),
        strategy=decision.strategy, parts=decision.parts, status="", reason=decision.reason,
        schedule=decision.schedule, predicted_s=decision.predicted_s,
        candidates=[{"label": c.label, "strategy": c.strategy, "parts": c.parts, "schedule": c.schedule,
                     "seconds": c.seconds} for c in decision.candidates],
        topology=decision.topology, calibration=calibration_in_use(), d_star=decision.d_star,
        gemm_dtype=pair.workload().gemm_dtype,
        coefficients=list(decision.coefficients) if decision.coefficients else None)


_dump_counter = 0


def _dump(gm: fx.GraphModule, graph_kind: str, when: str, options: CompassOptions) -> None:
    """Write the graph's code to ``options.dump_dir`` (one file per graph and stage)."""
    global _dump_counter
    if options.dump_dir is None:
        return
    if when == "before":
        _dump_counter += 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = Path(options.dump_dir)
    path.mkdir(parents=True, exist_ok=True)
    name = f"rank{rank}_{_dump_counter:03d}_{graph_kind}_{when}.py"
    (path / name).write_text(gm.print_readable(print_output=False))
    log.debug("compass_fx: wrote %s", os.fspath(path / name))
