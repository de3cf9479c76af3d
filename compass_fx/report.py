"""What the compiler found and did, per graph and per pair: the data behind ``explain``."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from .cost.decision import strategy_label
from .cost.layer import format_seconds


@dataclass
class PairRecord:
    """One matched pair and what happened to it."""

    graph: str
    collective: str
    kind: str
    dim: int
    shape: list[int]
    m: int
    n: int
    k: int
    matmuls: int
    group: str
    group_size: int
    dtype: str
    strategy: str
    parts: int
    status: str              # "rewritten", "kept" (sequential chosen) or "skipped" (could not apply)
    reason: str
    schedule: str | None = None
    predicted_s: float | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)
    topology: str | None = None
    calibration: str | None = None         # the calibration file that priced the decision, if any
    gemm_dtype: str | None = None          # the matmuls' dtype when it differs from dtype (float8)
    d_star: float | None = None            # the decomposition model's continuous optimum sqrt(C/A)
    coefficients: list[float] | None = None  # A, B, C of T(d) = A*d + B + C/d
    asynchronous: bool = False             # a fused reduction started early, waited for at first use
    # strategies this pair's lowering cannot take, never priced: {"strategy": ..., "reason": ...}
    refused: list[dict[str, str]] = field(default_factory=list)


@dataclass
class SkipRecord:
    """A collective that was not paired, and why."""

    graph: str
    collective: str
    kind: str
    reason: str


@dataclass
class GraphReport:
    """Everything the pass did to one graph (forward, backward or inference)."""

    graph: str
    pairs: list[PairRecord] = field(default_factory=list)
    skipped: list[SkipRecord] = field(default_factory=list)
    collectives_before: int = 0
    collectives_after: int = 0
    notes: list[str] = field(default_factory=list)  # what the backend changed around the pass
    pass_seconds: float | None = None  # wall time of the pass on this graph (find, decide, agree, rewrite)


@dataclass
class Report:
    """The explain report: every graph the backend saw, in compile order."""

    graphs: list[GraphReport] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def pairs(self) -> list[PairRecord]:
        return [p for g in self.graphs for p in g.pairs]

    @property
    def skipped(self) -> list[SkipRecord]:
        return [s for g in self.graphs for s in g.skipped]

    def count(self, kind: str | None = None, graph: str | None = None, status: str | None = None) -> int:
        """How many pairs match the given kind / graph / status (None matches all)."""
        return sum(1 for p in self.pairs if (kind is None or p.kind == kind)
                   and (graph is None or p.graph == graph) and (status is None or p.status == status))

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"options": self.options, "graphs": [asdict(g) for g in self.graphs]},
                          indent=indent, default=str)

    def format(self, every_pair: bool = False) -> str:
        """The report as text (:func:`format_report`): pairs alike share a row, or a row per pair."""
        return format_report(self, every_pair)

    def __str__(self) -> str:
        return format_report(self)


def format_report(report: Report, every_pair: bool = False) -> str:
    """A readable table, then the collectives left alone and why, the candidates' times and what each
    pair's lowering refused.  Pairs alike (graph, kind, shapes, dtypes, group, decision, status and
    reason: the same layer repeated) share a row with their count, so the table grows with the
    model's distinct pairs, not its depth; ``every_pair``: a row per pair."""
    pairs = report.pairs
    rows = _rows(pairs, _row_key, every_pair)
    lines = []
    if rows and not every_pair:
        lines.append(f"{len(pairs)} pairs in {len(rows)} rows (pairs alike share a row; one row per pair: "
                     "report.format(every_pair=True), compass-fx explain --every-pair)")
    if rows:
        header = ("graph", "pairs", "collective", "kind", "dim", "m x n x k", "group", "decision", "status", "why")
        cells = [r.cells() for r in rows]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header[:-1])]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
        lines.append(fmt.format(*header))
        lines.append(fmt.format(*("-" * w for w in widths), "---"))
        lines += [fmt.format(*c) for c in cells]
    else:
        lines.append("no matmul<->collective pairs found")
    skips = _rows(report.skipped, _skip_key, every_pair)
    lines += [f"left alone: {r.first.graph} {r.first.kind} {r.named()}: {r.first.reason}" for r in skips]
    notes = _rows([_Note(g.graph, note) for g in report.graphs for note in g.notes], _note_key, every_pair)
    lines += [f"note ({r.first.graph}{_times(r.count, 'graphs')}): {r.first.text}" for r in notes]
    summary = ", ".join(f"{name}{_times(len(gs), 'graphs')}: {sum(p.status == 'rewritten' for g in gs for p in g.pairs)}/"
                        f"{sum(len(g.pairs) for g in gs)} pairs rewritten, collectives "
                        f"{sum(g.collectives_before for g in gs)}->{sum(g.collectives_after for g in gs)}"
                        for name, gs in _by_name(report.graphs, every_pair))
    if summary:
        lines.append(summary)
    predicted = _predicted(report.graphs)
    if predicted:
        lines.append(predicted)
    topologies = sorted({p.topology for p in pairs if p.topology})
    if topologies:
        lines.append(f"cost model topology: {', '.join(topologies)}")
    calibrations = sorted({p.calibration for p in pairs if p.calibration})
    if calibrations:
        lines.append(f"cost model constants: {', '.join(calibrations)}")
    priced = [p for p in pairs if len(p.candidates) > 1 and any(c.get("seconds") is not None for c in p.candidates)]
    for r in _rows(priced, _candidates_key, every_pair):
        p = r.first
        cands = ", ".join(f"{c['label']}={format_seconds(c.get('seconds'))}" for c in p.candidates)
        d_star = f" (d*={p.d_star:.2f})" if p.d_star else ""
        lines.append(f"candidates {p.graph}/{r.named()}{d_star}: {cands}")
    refusals = [_Refusal(p.graph, p.collective, r["strategy"], r["reason"]) for p in pairs for r in p.refused]
    for r in _rows(refusals, _refusal_key, every_pair):
        lines.append(f"refused {r.first.graph}/{r.named()}: {r.first.strategy}: {r.first.reason}")
    return "\n".join(lines + _legend(report))


@dataclass
class _Refusal:
    """One strategy a pair's lowering refused, as the report lists it."""

    graph: str
    collective: str
    strategy: str
    reason: str


class _Row:
    """Records alike (pairs, collectives left alone, refusals) as one line: the first and how many."""

    def __init__(self, first: Any) -> None:
        self.first, self.count = first, 1

    def named(self) -> str:
        """The first record's collective, and how many more share its line."""
        more = f" (+{self.count - 1} like it)" if self.count > 1 else ""
        return f"{self.first.collective}{more}"

    def cells(self) -> tuple[str, ...]:
        p = self.first
        return (p.graph, str(self.count), p.collective, p.kind, str(p.dim), f"{p.m}x{p.n}x{p.k}",
                f"{p.group}/{p.group_size}", _decision_label(p), p.status, p.reason)


def _rows(records: list, key: Callable[[Any], tuple], every: bool) -> list[_Row]:
    """``records`` with equal ``key`` merged into one row each, in the order of their first (a row
    each where ``every``)."""
    if every:
        return [_Row(record) for record in records]
    rows: dict[tuple, _Row] = {}
    for record in records:
        k = key(record)
        if k in rows:
            rows[k].count += 1
        else:
            rows[k] = _Row(record)
    return list(rows.values())


def _predicted(graphs: list[GraphReport]) -> str | None:
    """The cost model's bottom line per graph name: the priced pairs' predicted time as decided (a
    pair not rewritten runs sequentially) against every one of them sequential."""
    parts = []
    for name, gs in _by_name(graphs, every=False):
        decided = sequential = 0.0
        priced = 0
        for p in (p for g in gs for p in g.pairs):
            seq = next((c.get("seconds") for c in p.candidates if c.get("label") == "sequential"), None)
            if seq is None:
                continue  # a forced strategy prices nothing
            priced += 1
            sequential += seq
            decided += p.predicted_s if p.status == "rewritten" and p.predicted_s is not None else seq
        if priced:
            change = f", {(1 - decided / sequential) * 100:.0f}% less" if decided < sequential else ""
            parts.append(f"{name}: {format_seconds(decided)} as decided, {format_seconds(sequential)} all "
                         f"sequential ({priced} pairs{change})")
    return "predicted time of the pairs (cost model), " + "; ".join(parts) if parts else None


@dataclass
class _Note:
    """A note of one graph, as the report lists it."""

    graph: str
    text: str


def _times(count: int, what: str) -> str:
    return f", {count} {what}" if count > 1 else ""


def _by_name(graphs: list[GraphReport], every: bool) -> list[tuple[str, list[GraphReport]]]:
    """The graphs by name (forward, backward...), in the order of their first; a graph each where
    ``every`` (a model compiled block by block has many graphs of each name)."""
    if every:
        return [(g.graph, [g]) for g in graphs]
    named: dict[str, list[GraphReport]] = {}
    for g in graphs:
        named.setdefault(g.graph, []).append(g)
    return list(named.items())


def _note_key(n: _Note) -> tuple:
    return (n.graph, n.text)


def _row_key(p: PairRecord) -> tuple:
    """What makes pairs alike: what the table shows, and what it does not but tells pairs apart (the
    full shape, the dtypes, how many matmuls share the collective)."""
    return (p.graph, p.kind, p.dim, p.m, p.n, p.k, p.group, p.group_size, _decision_label(p), p.status, p.reason,
            tuple(p.shape), p.dtype, p.gemm_dtype, p.matmuls)


def _skip_key(s: SkipRecord) -> tuple:
    return (s.graph, s.kind, s.reason)


def _candidates_key(p: PairRecord) -> tuple:
    """Pairs of one table row whose candidates were priced alike (a row's pairs may still be priced
    apart, one deferred and one not, say, so their times are compared too)."""
    return (*_row_key(p), p.d_star, tuple((c["label"], c.get("seconds")) for c in p.candidates))


def _refusal_key(r: _Refusal) -> tuple:
    return (r.graph, r.strategy, r.reason)


def _legend(report: Report) -> list[str]:
    """The columns and numbers a first-time reader cannot guess, explained under the table."""
    if not report.pairs:
        return []
    first = report.pairs[0]  # the example is a row of this very table
    lines = [f"legend: group = the collective's process group as name/ranks ({first.group}/{first.group_size}: "
             f"group '{first.group}' of {first.group_size} ranks)",
             "        dim = the tensor dim the collective gathers or scatters"]
    if any(p.d_star for p in report.pairs):
        lines += ["        d* = the decomposition model's continuous optimum sqrt(C/A) of T(d) = A*d + B + C/d,",
                  "             before rounding to a feasible part count d (d* <= 1: splitting does not pay)"]
    return lines


def _decision_label(p: PairRecord) -> str:
    return strategy_label(p.strategy, p.parts, p.schedule, p.asynchronous)
