"""The single place where a pair's strategy is chosen when the user leaves it to the compiler."""
from __future__ import annotations

from .decision import Candidate, Decision
from .workload import Workload


def select(workload: Workload, topology: object | None = None) -> Decision:
    """Choose how to run ``workload``.

    Placeholder policy until the performance model lands: decompose into ``group_size`` parts
    when that is feasible, otherwise leave the pair sequential.  Deterministic by construction.
    """
    allowed = workload.parts_allowed()
    parts = workload.group_size
    if parts > 1 and parts in allowed:
        chosen = Candidate("decompose", parts)
        return Decision("decompose", parts, candidates=(Candidate("sequential"), chosen),
                        reason=f"default policy: one part per rank (d={parts})")
    return Decision("sequential", candidates=(Candidate("sequential"),),
                    reason=f"d={parts} does not divide the split dimension")
