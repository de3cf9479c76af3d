"""The edges a CUDA graph of a fused call needs so that shared hardware queues cannot deadlock it.

Why: :mod:`.issue_order` makes an eager call safe however its streams share hardware queues,
because a queue then holds its commands in the host's issue order.  A CUDA graph has no issue
order: its launch hands the nodes to the hardware queues in some order of their dependencies
alone, so a flag wait with no dependency on a publication issued before it may be queued ahead of
it.  On a queue shared by both, the wait then holds back the rank's own publication, the peer's
matching wait holds back the peer's, and both wait forever.  Two ranks sharing one H200 under MPS
replayed the two-rank host-staged reduce-scatter of 8192 rows so (two pieces of 16 MiB a block):
each rank waited for the peer's first partial sum with its own first one unpublished, in every
such run with waits as stream waits, batches or spinning kernels; issued eagerly, or with
``CUDA_DEVICE_MAX_CONNECTIONS=32`` (more queues than streams), the same calls completed
(``benchmarks/results/fused_host_stress``, ``-h200-replay-order``).

The fix: in a replay, every flag wait depends on every flag its rank set before it in the issue
order, on any stream (an event from the last such flag set on each other stream; one on the same
stream precedes it already).  Then whatever a peer needs from a rank before that rank's wait
was issued is in the graph ahead of the wait, on every queue, as the issue order has it.  What
the graph may still move ahead of a wait is issued after it, which the issue order's proof allows
for (a queue may hold it behind the wait).  The cost: a wait starts only once the publications
issued before it are done, which an eager call on one queue waits for too; the simulator runs
the guarded plans in random orders of their dependencies on one queue per rank
(``tests/test_protocol.py``).
"""
from __future__ import annotations

from dataclasses import replace

from .protocol import Command, Plan, Record, SetFlag, WaitEvent, WaitFlag

GUARD_EVENT = "graph_guard"  # events named GUARD_EVENT + the guarding flag set's position


def guards(plan: Plan) -> tuple[tuple[int, int], ...]:
    """(flag set, flag wait) positions in ``plan``: the flag set a replay must finish before that
    wait starts.  For each wait, the last flag set before it on each other stream, unless an
    earlier wait on the same stream was guarded by it (or a later one) already."""
    pairs: list[tuple[int, int]] = []
    last_set: dict[str, int] = {}
    guarded: dict[tuple[str, str], int] = {}  # (wait's stream, set's stream) -> latest set guarded
    for i, cmd in enumerate(plan.commands):
        if isinstance(cmd, SetFlag):
            last_set[cmd.stream] = i
        elif isinstance(cmd, WaitFlag):
            for stream, j in last_set.items():
                if stream != cmd.stream and guarded.get((cmd.stream, stream), -1) < j:
                    pairs.append((j, i))
                    guarded[(cmd.stream, stream)] = j
    return tuple(pairs)


def guarded(plan: Plan) -> Plan:
    """``plan`` with its :func:`guards` as commands: a ``Record`` right after each guarding flag set
    and a ``WaitEvent`` on the wait's stream right before the wait (what a replay captures)."""
    pairs = guards(plan)
    if not pairs:
        return plan
    records = {j for j, _ in pairs}
    waits: dict[int, list[int]] = {}
    for j, i in pairs:
        waits.setdefault(i, []).append(j)
    commands: list[Command] = []
    for i, cmd in enumerate(plan.commands):
        commands += [WaitEvent(cmd.stream, f"{GUARD_EVENT}{j}") for j in waits.get(i, ())]
        commands.append(cmd)
        if i in records:
            commands.append(Record(cmd.stream, f"{GUARD_EVENT}{i}"))
    return replace(plan, commands=tuple(commands))
