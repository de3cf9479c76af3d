"""Cost hooks: user functions that override or refine any prediction.

A hook is called as ``hook(workload, topology, candidate)`` for every candidate of every pair,
where ``candidate.seconds`` is the prediction so far (the model's, or the previous hook's).  It
returns a replacement figure in seconds, or None to keep it.  Hooks run in registration order,
so each one refines what the ones before it said.  A hook that raises stops the selection with a
:class:`CostHookError` naming it: a silently ignored hook would make ranks disagree or hide bugs.

Example, a hook fed by measurements::

    measured = {("all_gather_matmul", 8192, "decompose(d=4)"): 412e-6}

    def from_measurements(workload, topology, candidate):
        return measured.get((workload.kind, workload.m, candidate.label))

    compass_fx.register_cost_hook(from_measurements)
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional

from .decision import Candidate
from .workload import Workload

CostHook = Callable[[Workload, object, Candidate], Optional[float]]

_HOOKS: list[CostHook] = []


class CostHookError(RuntimeError):
    """A cost hook raised or returned something that is not a time."""


def register_cost_hook(fn: CostHook) -> CostHook:
    """Add ``fn`` after the hooks already registered; returns it, so it works as a decorator."""
    if not callable(fn):
        raise ValueError(f"register_cost_hook: fn must be callable, got {fn!r}")
    _HOOKS.append(fn)
    return fn


def unregister_cost_hook(fn: CostHook) -> None:
    """Remove one registered hook (ValueError if it is not registered)."""
    try:
        _HOOKS.remove(fn)
    except ValueError:
        raise ValueError(f"unregister_cost_hook: {_name(fn)} is not registered") from None


def clear_cost_hooks() -> None:
    """Remove every hook."""
    _HOOKS.clear()


def cost_hooks() -> tuple[CostHook, ...]:
    return tuple(_HOOKS)


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def apply_cost_hooks(workload: Workload, topology: object, candidate: Candidate) -> Candidate:
    """``candidate`` with its seconds as the registered hooks, in order, leave them."""
    for hook in tuple(_HOOKS):
        try:
            value = hook(workload, topology, candidate)
        except Exception as exc:
            raise CostHookError(f"cost hook {_name(hook)} raised on {candidate.label} of {workload.kind} "
                                f"(m={workload.m}, n={workload.n}, k={workload.k}): {exc!r}") from exc
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise CostHookError(f"cost hook {_name(hook)} returned {value!r} for {candidate.label}; "
                                "expected seconds (a finite number >= 0) or None")
        candidate = replace(candidate, seconds=float(value))
    return candidate
