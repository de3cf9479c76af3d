"""The outcome of choosing how to run one pair: the winner and every candidate's prediction."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..kernels.schedules import SCHEDULES  # noqa: F401  (re-exported: the one list of schedule names)

STRATEGIES = ("sequential", "decompose", "fuse")


def strategy_label(strategy: str, parts: int = 1, schedule: str | None = None, asynchronous: bool = False) -> str:
    """How a strategy is written everywhere (reports, benchmarks, cost hooks' keys):
    "sequential", "decompose(d=4)", "fuse(ring)", "fuse(direct, async)"."""
    if strategy == "decompose":
        return f"decompose(d={parts})"
    if strategy == "fuse":
        return f"fuse({schedule}{', async' if asynchronous else ''})"
    return strategy


@dataclass(frozen=True)
class Candidate:
    """One way to run a pair and its predicted time (None when no model was consulted)."""

    strategy: str
    parts: int = 1
    schedule: str | None = None
    seconds: float | None = None

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.parts, self.schedule)

    @classmethod
    def from_label(cls, label: str) -> "Candidate":
        """The candidate a :func:`strategy_label` names (ValueError for anything else)."""
        if label == "sequential":
            return cls("sequential")
        if label.startswith("decompose(d=") and label.endswith(")") and label[12:-1].isdigit():
            return cls("decompose", int(label[12:-1]))
        if label.startswith("fuse(") and label.endswith(")") and label[5:-1] in SCHEDULES:
            return cls("fuse", 1, label[5:-1])
        raise ValueError(f"not a strategy label: {label!r} (e.g. 'sequential', 'decompose(d=4)', 'fuse(ring)')")


@dataclass(frozen=True)
class Decision:
    """What the compiler will do with a pair, and why.

    ``candidates`` holds every option that was considered with its predicted seconds, so that a
    report can show the margin by which the winner won.
    """

    strategy: str
    parts: int = 1
    schedule: str | None = None
    predicted_s: float | None = None
    candidates: tuple[Candidate, ...] = field(default=())
    reason: str = ""
    # The decomposition model behind the decompose candidates: T(d) = A*d + B + C/d, d* = sqrt(C/A).
    coefficients: tuple[float, float, float] | None = None
    d_star: float | None = None
    topology: str | None = None

    def candidate(self, label: str) -> Candidate:
        """The candidate with this label, e.g. ``"decompose(d=4)"`` (KeyError if absent)."""
        for c in self.candidates:
            if c.label == label:
                return c
        raise KeyError(f"no candidate {label!r}; have {[c.label for c in self.candidates]}")

    @property
    def speedup(self) -> float | None:
        """Predicted sequential time over the winner's (None without predictions)."""
        seq = next((c.seconds for c in self.candidates if c.strategy == "sequential"), None)
        if seq is None or not self.predicted_s:
            return None
        return seq / self.predicted_s

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"Decision.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"Decision.schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    @property
    def label(self) -> str:
        return Candidate(self.strategy, self.parts, self.schedule).label

    @property
    def rewrites(self) -> bool:
        return self.strategy != "sequential"
