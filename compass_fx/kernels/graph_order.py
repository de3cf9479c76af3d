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
(``benchmarks/results/fused_host_stress/fused_host_stress-h200-replay-order``).

The fix: a graph captures every rank's commands in one more safe order (:func:`waits_first`: found
as :func:`.issue_order.serialized` finds the issue order, each wait after what releases it, all
ranks together, in rounds, but issuing a ready flag wait before anything else and at most one flag
set per rank and round; each stream keeps its order, so the graph is the same but for the guards),
and in it every flag wait depends on every flag its rank set before it in that order
(:func:`guarded`: an event from the last such flag set on each other stream; one on the same stream
precedes it already).  Whatever a peer needs before a wait is released is then in the graph ahead
of the wait, on every queue, so the issue order's proof holds for the graph's queues with this
order as its sequence.  Waits come early in that order, so a wait depends on few publications: the
two-rank reduce-scatter's pull of the peer's first piece waits for the rank's first publication
only, not for every publication the issue order puts before it (guards on the issue order cost that
reduce-scatter 11-19% of its period on one H200 shared by two ranks:
``fused_host_time-h200-w2cap4-guards-host-pin-mps50``).

Earlier still (``sets_last``, opt-in): the guards may come from another safe sequence than the
capture order, :func:`guard_sequence`, which sets a flag only when nothing else is ready, so that a
reduce-scatter's k-th pull waits for the rank's first k partial sums and a gather's k-th round of
pulls for its first k pieces (guarded by the capture order, a reduce-scatter pull but the first may
wait for all of its rank's publications, a four-piece gather's rounds for 3, 4, 4, 4 pieces).
On one H200 shared by four or eight ranks that bought the 8192-row all-reduce 4-7% of its period
and cost the small reduce-scatters 4-10%, in two runs (``fused_host_time-h200-guard-order-*``,
``fused_host_time-h200-sets-last-guards-*``), so it waits for a machine with a GPU per rank.
Capturing in that sequence as well moved the own GEMM ahead of the first flag set and cost the
gathers up to a quarter of their period: the capture order stays.  The simulator runs the guarded
plans in random orders of their dependencies, every stream of a rank on one queue
(``tests/test_protocol.py``).
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Sequence

from .issue_order import call_plans, serialized
from .protocol import HOST_PIECE_BYTES, Command, Plan, Record, SetFlag, WaitEvent, WaitFlag

GUARD_EVENT = "graph_guard"  # events named GUARD_EVENT + the guarding flag set's position

Guards = tuple[tuple[int, int], ...]  # (flag set, flag wait) positions in one rank's plan


def waits_first(plans: Sequence[Plan]) -> tuple[Plan, ...]:
    """Every rank's plan with its commands in a safe order that issues a ready flag wait first and
    at most one flag set per rank and round: the order a graph captures (see the module's
    docstring); the join stays last."""
    return serialized(plans, waits_first=True)


def guard_sequence(plans: Sequence[Plan]) -> tuple[Plan, ...]:
    """:func:`waits_first`'s order but with a flag set only when nothing else is ready: the safe
    sequence the guards are taken from, in which each wait follows as few of its rank's flag sets
    as the rounds allow."""
    return serialized(plans, waits_first=True, sets_last=True)


def guards(plan: Plan, sequence: Plan | None = None) -> Guards:
    """The (flag set, flag wait) positions in ``plan`` a graph of it must order: for each wait, the
    last flag set before it in ``sequence`` (``plan`` itself where not given; the same commands
    stream by stream) on each other stream, unless an earlier wait on the same stream was guarded
    by that one already (flag sets on one stream come in its order)."""
    sequence = sequence or plan
    position = {key: i for i, key in enumerate(stream_keys(plan.commands))}
    keys = stream_keys(sequence.commands)
    if len(keys) != len(position) or any(key not in position or plan.commands[position[key]] != cmd
                                         for key, cmd in zip(keys, sequence.commands)):
        raise ValueError(f"{plan.op}: the guards' sequence is not the plan's commands stream by stream")
    pairs: list[tuple[int, int]] = []
    last_set: dict[str, int] = {}
    guarded_by: dict[tuple[str, str], int] = {}  # (wait's stream, set's stream) -> the set guarded last
    for key, cmd in zip(keys, sequence.commands):
        i = position[key]
        if isinstance(cmd, SetFlag):
            last_set[cmd.stream] = i
        elif isinstance(cmd, WaitFlag):
            for stream, j in last_set.items():
                if stream != cmd.stream and guarded_by.get((cmd.stream, stream)) != j:
                    if j > i:
                        raise ValueError(f"{plan.op}: {plan.commands[i]} comes before its guard {plan.commands[j]}")
                    pairs.append((j, i))
                    guarded_by[(cmd.stream, stream)] = j
    return tuple(sorted(pairs, key=lambda pair: pair[1]))


def stream_keys(commands: Sequence[Command]) -> list[tuple[str, int]]:
    """Each command as (its stream, its place on that stream): the same in any order of a plan that
    keeps each stream's."""
    seen: dict[str, int] = {}
    keys = []
    for cmd in commands:
        keys.append((cmd.stream, seen.get(cmd.stream, 0)))
        seen[cmd.stream] = keys[-1][1] + 1
    return keys


def guarded(plan: Plan, sequence: Plan | None = None) -> Plan:
    """``plan`` with its :func:`guards` (taken from ``sequence``'s order where given) as commands: a
    ``Record`` right after each guarding flag set and a ``WaitEvent`` on the wait's stream right
    before the wait (what a graph captures)."""
    pairs = guards(plan, sequence)
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


@lru_cache(maxsize=256)
def graph_plans(op: str, schedule: str, world: int, rank: int, rows: int, cols: int, matmuls: int,
                itemsize: int, host: bool, piece_bytes: int = HOST_PIECE_BYTES, detach: bool = False,
                group_rows: int = 0, fence: bool = False, most_pieces: int = 0,
                sets_last: bool = False) -> tuple[Plan, ...]:
    """:func:`.issue_order.call_plans` (same arguments) as a CUDA graph of the call captures them:
    each stage's plan in :func:`waits_first`'s order, :func:`guarded` by that order or, where
    ``sets_last``, by :func:`guard_sequence`'s (each wait on fewer publications; not the default: see
    the module)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    orders = _group_orders(op, schedule, world, rows, cols, matmuls, itemsize, host, piece_bytes, detach,
                           group_rows, fence, most_pieces, sets_last)
    return tuple(guarded(order[rank], sequence[rank] if sequence else None) for order, sequence in orders)


@lru_cache(maxsize=64)
def _group_orders(op: str, schedule: str, world: int, rows: int, cols: int, matmuls: int, itemsize: int,
                  host: bool, piece_bytes: int, detach: bool, group_rows: int, fence: bool, most_pieces: int,
                  sets_last: bool) -> tuple[tuple[tuple[Plan, ...], tuple[Plan, ...] | None], ...]:
    """Per stage, every rank's plan in the capture order and (``sets_last``) in the guards' sequence:
    found for the whole group at once, so ranks asked for one after another (the simulator's tests)
    share one search."""
    every = [call_plans(op, schedule, world, r, rows, cols, matmuls, itemsize, host, piece_bytes, detach,
                        group_rows, fence, most_pieces) for r in range(world)]
    return tuple((waits_first(stage), guard_sequence(stage) if sets_last else None) for stage in zip(*every))

