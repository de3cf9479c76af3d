"""The performance framework: workloads, decisions and the selection between strategies."""
from .decision import Candidate, Decision, SCHEDULES, STRATEGIES
from .select import select
from .workload import PAIR_KINDS, Workload

__all__ = ["Candidate", "Decision", "PAIR_KINDS", "SCHEDULES", "STRATEGIES", "Workload", "select"]
