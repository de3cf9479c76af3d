"""What the compiler found and did, per graph and per pair: the data behind ``explain``."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

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

    def __str__(self) -> str:
        return format_report(self)


def format_report(report: Report) -> str:
    """A readable table: one row per pair, then the collectives left alone and why."""
    header = ("graph", "collective", "kind", "dim", "m x n x k", "group", "decision", "status", "why")
    rows = []
    for p in report.pairs:
        rows.append((p.graph, p.collective, p.kind, str(p.dim), f"{p.m}x{p.n}x{p.k}",
                     f"{p.group}/{p.group_size}", _decision_label(p), p.status, p.reason))
    lines = []
    if rows:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header[:-1])]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
        lines.append(fmt.format(*header))
        lines.append(fmt.format(*("-" * w for w in widths), "---"))
        lines += [fmt.format(*r) for r in rows]
    else:
        lines.append("no matmul<->collective pairs found")
    for g in report.graphs:
        for s in g.skipped:
            lines.append(f"left alone: {s.graph} {s.kind} {s.collective}: {s.reason}")
        lines += [f"note ({g.graph}): {note}" for note in g.notes]
    summary = ", ".join(f"{g.graph}: {sum(p.status == 'rewritten' for p in g.pairs)}/{len(g.pairs)} pairs "
                        f"rewritten, collectives {g.collectives_before}->{g.collectives_after}"
                        for g in report.graphs)
    if summary:
        lines.append(summary)
    topologies = sorted({p.topology for p in report.pairs if p.topology})
    if topologies:
        lines.append(f"cost model topology: {', '.join(topologies)}")
    calibrations = sorted({p.calibration for p in report.pairs if p.calibration})
    if calibrations:
        lines.append(f"cost model constants: {', '.join(calibrations)}")
    for p in report.pairs:
        if len(p.candidates) > 1 and any(c.get("seconds") is not None for c in p.candidates):
            cands = ", ".join(f"{c['label']}={format_seconds(c.get('seconds'))}" for c in p.candidates)
            d_star = f" (d*={p.d_star:.2f})" if p.d_star else ""
            lines.append(f"candidates {p.graph}/{p.collective}{d_star}: {cands}")
    for p in report.pairs:
        for r in p.refused:
            lines.append(f"refused {p.graph}/{p.collective}: {r['strategy']}: {r['reason']}")
    return "\n".join(lines + _legend(report))


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
