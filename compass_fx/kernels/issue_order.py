"""The plans a call of a fused operator issues, and the order it issues them in: one that cannot
deadlock even when the GPU runs all of a rank's streams through one hardware queue.

Why: CUDA feeds streams to the GPU through a few hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``,
8 by default, shared by every stream of the process: NCCL's, the compiler's, ours).  Two streams
that land on one queue run in the order the host issued their commands, so a stream memory wait
holds up every command issued after it on that queue, whatever its stream.  Plans built stream by
stream (:mod:`.protocol`) are deadlock-free while each stream has a queue of its own, but not
always when queues are shared: in the reduce-scatter rings a rank issued its wait for a peer's
second partial sum before its own second publication, on another stream; with both streams on
one queue every rank of a ring waits for the next one's publication, which sits behind that
rank's own wait.  Three ranks sharing one H200 hung exactly so
(``benchmarks/fused_host_stress.py``), and the simulator with one queue per rank shows it for
every reduce-scatter schedule beyond two ranks.

The order: each rank issues a command only once everything it waits for has been issued before
it, by this rank (the event it waits for was recorded) or by the peer (the flag it waits for was
set).  The ranks' orders are found together, as one run of the whole call in which every
command executes the moment it is issued, in rounds (a rank sees the flags its peers set in
earlier rounds, so ranks with alike plans get alike orders).  Each stream keeps its own order
(nothing changes on a GPU whose streams have queues of their own), and the join (the caller's
last waits) stays last.

Why it cannot deadlock however the streams share queues: the construction is one global
sequence S of every rank's commands in which each wait comes after what releases it.  A queue
holds a subsequence of one rank's issue order, hence of S.  If every queue's head were blocked,
take the blocked head earliest in S: what releases it is earlier in S, so it is not behind a
blocked head (that head would be earlier still), so it has run, and the head is not blocked.
Back-to-back calls keep this: a rank's queue holds its calls in order, so by induction every
earlier call of every rank completes, which is all that a wait for an earlier call's flag needs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from functools import lru_cache
from typing import Sequence

from .protocol import (HOST_PIECE_BYTES, Command, Plan, Record, SetFlag, WaitEvent, WaitFlag, fenced, join_start,
                       stream_plans)


def call_plans(op: str, schedule: str, world: int, rank: int, rows: int, cols: int, matmuls: int,
               itemsize: int, host: bool, piece_bytes: int = HOST_PIECE_BYTES,
               detach: bool = False, group_rows: int = 0, fence: bool = False,
               most_pieces: int = 0) -> tuple[Plan, ...]:
    """The plans one call of a fused operator runs, in order, as the CUDA path issues them (the
    cost model counts their commands to price the host's work): :func:`.protocol.stream_plans`
    (which documents the arguments) put in the order of :func:`serialized`.  ``fence``: for one
    set of symmetric buffers (:func:`.protocol.fenced`, the plans of calls captured in CUDA graphs)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return _every_rank(op, schedule, world, rows, cols, matmuls, itemsize, host, piece_bytes, detach,
                       group_rows, fence, most_pieces)[rank]


@lru_cache(maxsize=256)
def _every_rank(op: str, schedule: str, world: int, rows: int, cols: int, matmuls: int, itemsize: int,
                host: bool, piece_bytes: int, detach: bool, group_rows: int,
                fence: bool, most_pieces: int = 0) -> tuple[tuple[Plan, ...], ...]:
    """Every rank's plans (``[rank][stage]``): the order is found for all ranks together."""
    per_rank = [stream_plans(op, schedule, world, r, rows, cols, matmuls, itemsize, host, piece_bytes, detach,
                             group_rows, most_pieces) for r in range(world)]
    if fence:
        per_rank = [tuple(fenced(p) for p in plans) for plans in per_rank]
    stages = [serialized(stage) for stage in zip(*per_rank)]
    return tuple(zip(*stages))


class UnorderablePlan(ValueError):
    """No order of the plans' commands completes: the plans deadlock even stream by stream."""


def serialized(plans: Sequence[Plan], waits_first: bool = False, sets_last: bool = False) -> tuple[Plan, ...]:
    """Every rank's plan (``plans[r]`` is rank ``r``'s, one call of one operator) with its commands
    in an issue order that completes when all of a rank's streams share one queue.  ``waits_first``:
    a ready flag wait goes before anything else, and a rank sets at most one flag per round (the
    order a CUDA graph captures a call in, :mod:`.graph_order`); ``sets_last`` besides: a flag set
    only when nothing else is ready (the order :mod:`.graph_order` guards the waits by: each wait
    after as few flag sets as the rounds allow)."""
    world = len(plans)
    if [p.rank for p in plans] != list(range(world)):
        raise ValueError(f"serialized needs one plan per rank, in rank order; got ranks {[p.rank for p in plans]}")
    bodies = [p.commands[:join_start(p)] for p in plans]
    for p, body in zip(plans, bodies):
        _check_events(p, body)
    heads = [_stream_queues(body) for body in bodies]
    flags: list[set[int]] = [set() for _ in plans]
    events: list[set[str]] = [set() for _ in plans]
    orders: list[list[Command]] = [[] for _ in plans]
    left = sum(len(b) for b in bodies)
    while left:  # in rounds: a rank sees the flags its peers set in earlier rounds, so alike plans get alike orders
        progressed = False
        seen = [set(f) for f in flags]
        for r in range(world):
            while (i := _next_ready(bodies[r], heads[r], seen, events[r], waits_first, sets_last)) is not None:
                cmd = bodies[r][i]
                heads[r][cmd.stream].popleft()
                orders[r].append(cmd)
                left -= 1
                progressed = True
                if isinstance(cmd, SetFlag):
                    flags[r].add(cmd.slot)
                    if waits_first:
                        break
                elif isinstance(cmd, Record):
                    events[r].add(cmd.event)
        if not progressed:
            stuck = [f"rank {r}: {bodies[r][min(q[0] for q in heads[r].values() if q)]}"
                     for r in range(world) if any(heads[r].values())]
            raise UnorderablePlan(f"{plans[0].op}: the plans deadlock; first command left per rank: {stuck}")
    return tuple(replace(p, commands=tuple(order) + p.commands[len(body):])
                 for p, body, order in zip(plans, bodies, orders))


def _stream_queues(body: tuple[Command, ...]) -> dict[str, deque[int]]:
    """The positions of each stream's commands, in order: the head of each is what it runs next."""
    queues: dict[str, deque[int]] = {}
    for i, cmd in enumerate(body):
        queues.setdefault(cmd.stream, deque()).append(i)
    return queues


def _next_ready(body: tuple[Command, ...], heads: dict[str, deque[int]], flags: list[set[int]],
                events: set[str], waits_first: bool = False, sets_last: bool = False) -> int | None:
    """Of the commands next on their streams and waiting for nothing still to come, the first in
    the plan's order (``waits_first``: the first flag wait, if any is ready; ``sets_last``: a flag
    set only if nothing else is ready: only flag sets release peers, so every wait the rest lets
    through comes before the next one)."""
    ready = [q[0] for q in heads.values() if q and _released(body[q[0]], flags, events)]
    if waits_first:
        ready = [i for i in ready if isinstance(body[i], WaitFlag)] or ready
    if sets_last:
        ready = [i for i in ready if not isinstance(body[i], SetFlag)] or ready
    return min(ready) if ready else None


def _released(cmd: Command, flags: list[set[int]], events: set[str]) -> bool:
    if isinstance(cmd, WaitFlag):
        return cmd.delta < 0 or cmd.slot in flags[cmd.peer]  # delta < 0: an earlier call's flag
    if isinstance(cmd, WaitEvent):
        return cmd.event in events
    return True


def _check_events(plan: Plan, body: tuple[Command, ...]) -> None:
    """Each event is recorded at most once before the join and waited for only after its record:
    then a wait means the same record in any order that keeps it after the record."""
    recorded: set[str] = set()
    for cmd in body:
        if isinstance(cmd, Record):
            if cmd.event in recorded:
                raise ValueError(f"{plan.op}: event {cmd.event!r} is recorded twice in one call")
            recorded.add(cmd.event)
        elif isinstance(cmd, WaitEvent) and cmd.event not in recorded:
            raise ValueError(f"{plan.op}: {cmd} comes before the event's record")
        elif isinstance(cmd, WaitFlag) and cmd.delta > 0:
            raise ValueError(f"{plan.op}: {cmd} waits for a later call")
