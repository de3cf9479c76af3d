"""The compass pass over one graph, top-down: find every pair once, decide each among the
strategies its kind can lower, agree across ranks, rewrite, report.

Its cost grows with the graph, not with the graph times its pairs: the graph is walked a fixed
number of times (dead code, the normalizations, the fake mode, one sort and one lint at the
end); each pair costs what its neighbourhood and its new nodes cost.  Pairs are matched once: a
rewrite commits or rolls back only the nodes it adds, and a later pair is matched again only
where an earlier rewrite touched what its match looked at (then it is decided, and agreed, again).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.fx as fx

from .cost.decision import Decision
from .graph.normalize import normalize
from .graph.pairs import Pair, ReducePair
from .lowering import Disorder, RewriteFailed, erase_unused, graph_fake_mode, stable_toposort, transaction
from .lowering import fuse
from .machine.calibration import calibration_in_use
from .options import CompassOptions
from .passes.agree import agree
from .passes.decide import Infeasible, decide
from .passes.find import find_pairs, kind_of, match_one
from .report import GraphReport, PairRecord, SkipRecord

log = logging.getLogger("compass_fx")

COLLECTIVES = (
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops.compass.all_gather_blocking.default,  # a decomposed gather's part on gloo
)


def compass_pass(gm: fx.GraphModule, graph_kind: str, options: CompassOptions,
                 topology: object | None = None) -> GraphReport:
    """Rewrite ``gm`` in place and return what was found and done."""
    with _collector_skips_older_objects():
        return _compass_pass(gm, graph_kind, options, topology)


@contextlib.contextmanager
def _collector_skips_older_objects() -> Iterator[None]:
    """Python's full garbage collection walks every object of the process: under a compile, the
    model, dynamo's state and both graphs (about 640,000 objects at 16 layers), and the pass's
    allocations set one off about once per graph, a fifth of the pass.  Objects older than the pass
    are moved out of the collector's sight for its duration (``gc.freeze``) and given back after;
    not where the program froze objects itself (unfreezing would undo that)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _compass_pass(gm: fx.GraphModule, graph_kind: str, options: CompassOptions,
                  topology: object | None = None) -> GraphReport:
    started = time.perf_counter()
    _prepare(gm, graph_kind)
    report = GraphReport(graph_kind, collectives_before=count_collectives(gm))
    _dump(gm, graph_kind, "before", options)
    pairs, report.skipped = find_pairs(gm, graph_kind, options.group)
    plans = [_plan(pair, options, topology) for pair in pairs]
    _agree(plans)

    def plan_again(pair: Pair) -> _Plan:  # a pair matched again after a rewrite touched it
        again = _plan(pair, options, topology)
        _agree([again])
        return again

    rewriter = _Rewriter(gm, graph_kind, options.group, options.fused_async, plan_again, report.skipped)
    report.pairs = rewriter.run(plans)
    report.collectives_after = count_collectives(gm)
    _dump(gm, graph_kind, "after", options)
    report.pass_seconds = time.perf_counter() - started
    return report


def rewrite_pairs(gm: fx.GraphModule, graph_kind: str, pairs: list[Pair], choose: Callable[[Pair], Decision],
                  group: str | None = None, *, fused_async: bool = False) -> tuple[list[PairRecord], list[SkipRecord]]:
    """Rewrite ``pairs`` (found in ``gm`` by ``passes.find_pairs``) as ``choose(pair)`` says, as the
    pass does but without options, costs or ranks to agree with (tools and tests): the records,
    and the pairs that a rewrite before them turned into no pair.  ``fused_async``: as the option."""
    def plan(pair: Pair) -> _Plan:
        return _Plan(pair, kind_of(pair).refusals(pair), choose(pair))

    skipped: list[SkipRecord] = []
    records = _Rewriter(gm, graph_kind, group, fused_async, plan, skipped).run([plan(p) for p in pairs])
    return records, skipped


def count_collectives(gm: fx.GraphModule) -> int:
    """The graph's collectives; a decomposed gather issued as one call counts its parts' gathers."""
    parts = sum(n.args[2] for n in gm.graph.find_nodes(op="call_function", sort=False,
                                                       target=torch.ops.compass.all_gather_mm_parts.default))
    return parts + sum(len(gm.graph.find_nodes(op="call_function", target=t, sort=False)) for t in COLLECTIVES)


def _prepare(gm: fx.GraphModule, graph_kind: str) -> None:
    """Dead code out (backward graphs carry dead recomputations), then the normalizations."""
    gm.graph.eliminate_dead_code()
    changed = {what: n for what, n in normalize(gm).items() if n}
    if changed:
        log.info("compass_fx: %s graph: normalized before matching: %s", graph_kind,
                 ", ".join(f"{n} {what}" for what, n in changed.items()))


@dataclass
class _Plan:
    """A pair, what its kind refuses (and why), and the decision for it."""

    pair: Pair
    refused: dict[str, str]
    decision: Decision
    infeasible: bool = False  # the options force what this pair cannot take: it stays as it is
    # the pair as decided (its nodes may be gone once a rewrite before it touched them)
    described: str = ""
    workload: object = None

    def __post_init__(self) -> None:
        self.described = self.described or self.pair.describe()
        self.workload = self.workload or self.pair.workload()


def _plan(pair: Pair, options: CompassOptions, topology: object | None) -> _Plan:
    kind = kind_of(pair)
    refused = kind.refusals(pair)
    try:
        deferred = (options.fused_async and isinstance(pair, ReducePair) and "fuse" not in refused
                    and fuse.would_defer(pair))
        return _Plan(pair, refused, decide(pair, options, topology, refused, kind.parts_replayed(pair), deferred))
    except Infeasible as e:
        return _Plan(pair, refused, e.decision or Decision("sequential", reason=str(e)), infeasible=True)


def _agree(plans: list[_Plan]) -> None:
    """Every rank takes the group's first rank's decisions: one store round trip per group."""
    agreed = agree([p.pair for p in plans], [p.decision for p in plans])
    for plan, decision in zip(plans, agreed):
        plan.decision = decision


@dataclass
class _Rewriter:
    """Rewrites the planned pairs in graph order, then closes the graph once."""

    gm: fx.GraphModule
    graph_kind: str
    group: str | None                       # the optimised group (None: all)
    fused_async: bool
    plan_again: Callable[[Pair], "_Plan"]   # the plan of a pair matched again
    skipped: list[SkipRecord]
    touched: set[fx.Node] = field(default_factory=set)  # what the rewrites so far changed
    disorder: Disorder = field(default_factory=Disorder)  # where they left the graph out of order
    sorted_whole: bool = False  # the graph was sorted whole once (so only the rewrites disorder it)
    # the asynchronous calls' (created nodes, description, record), given their overlap once the graph is sorted
    asynchronous: list[tuple[list[fx.Node], str, PairRecord]] = field(default_factory=list)
    rewritten: int = 0
    _fake_mode: object = None

    def run(self, plans: list[_Plan]) -> list[PairRecord]:
        records = []
        for plan in plans:
            if plan.pair.footprint & self.touched:
                plan = self._match_again(plan)
                if plan is None:
                    continue
            records.append(self._apply(plan))
        self._close()
        return records

    def fake_mode(self) -> object:
        """The graph's fake mode, found once (the first time a pair is rewritten)."""
        if self._fake_mode is None:
            self._fake_mode = graph_fake_mode(self.gm.graph)
        return self._fake_mode

    def _apply(self, plan: _Plan) -> PairRecord:
        pair, decision = plan.pair, plan.decision
        record = _record(pair, decision, plan.refused)
        if plan.infeasible:
            record.status = "skipped"
            log.info("compass_fx: %s graph: %s left untouched: %s", pair.graph_name, pair.describe(),
                     decision.reason)
            return record
        if decision.strategy == "sequential":
            record.status = "kept"
            log.info("compass_fx: %s graph: %s kept sequential: %s", pair.graph_name, pair.describe(),
                     decision.reason)
            return record
        described = pair.describe()
        log.info("compass_fx: %s graph: %s -> %s", pair.graph_name, described, decision.label)
        lower = kind_of(pair).lower
        try:
            built, record.asynchronous = transaction(
                self.gm.graph, pair.collective, self.fake_mode(),
                lambda b: lower(b, pair, decision, self.fused_async), f"{described}: {decision.label}")
        except RewriteFailed as e:  # the graph is as it was; the same happens on every rank
            record.status, record.reason = "skipped", str(e)
            # a pair the fused operators do not take is expected; a decomposition that fails is not
            (log.info if decision.strategy == "fuse" else log.warning)(
                "compass_fx: %s graph: %s left untouched: %s", pair.graph_name, described, e)
            return record
        record.status = "rewritten"
        self.rewritten += 1
        made = set(built.created)
        replaced = [old for old, _ in built.replacements]
        erased = erase_unused(self.gm.graph, [*built.created, *replaced], (pair.wait, pair.collective))
        read = {a for n in built.created for a in n.all_input_nodes if a not in made}
        self.touched |= {pair.collective, pair.wait, *replaced, *read, *erased}
        self.disorder.note([*built.created, *(new for _, new in built.replacements)])
        if record.asynchronous:
            self.asynchronous.append((built.created, described, record))
        return record

    def _match_again(self, plan: _Plan) -> _Plan | None:
        """A rewrite before this pair touched what its match looked at: match its collective again
        (on a sorted graph: the whole graph the first time, whatever order it came in, then only
        the stretches the rewrites since left out of order), as if the graph had been matched after
        that rewrite; decide and agree again only when the pair changed.  None when it is no pair
        any more (then it is a skip)."""
        if self.sorted_whole:
            self.disorder.repair()
        else:
            stable_toposort(self.gm.graph)
            self.disorder.forget()
            self.sorted_whole = True
        log.info("compass_fx: %s graph: %s matched again: a rewrite before it touched its nodes",
                 self.graph_kind, plan.described)
        kind = kind_of(plan.pair)
        outcome = match_one(plan.pair.collective, kind, self.graph_kind, self.group)
        if isinstance(outcome, SkipRecord):
            self.skipped.append(outcome)
            return None
        if outcome.describe() == plan.described and outcome.workload() == plan.workload:
            return _Plan(outcome, kind.refusals(outcome), plan.decision, plan.infeasible)
        return self.plan_again(outcome)

    def _close(self) -> None:
        """Once per graph: order, dead code, check, then the asynchronous calls' overlap."""
        graph = self.gm.graph
        if self.rewritten:
            stable_toposort(graph)
            graph.eliminate_dead_code()
        graph.lint()
        for created, described, record in self.asynchronous:
            record.asynchronous = fuse.spread(graph, created, described)
            if not record.asynchronous:
                record.reason += "; a plain call, not deferred: nothing runs between its operands and its first use"
        if self.asynchronous:
            graph.lint()
        self.gm.recompile()


def _record(pair: Pair, decision: Decision, refused: dict[str, str]) -> PairRecord:
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
        coefficients=list(decision.coefficients) if decision.coefficients else None,
        refused=[{"strategy": s, "reason": why} for s, why in sorted(refused.items())])


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
