"""Communication schedules of the fused operators: who sends which piece to whom, and when.

Pure Python, so that the reference implementation (:mod:`.reference`), the CUDA path's plans
(:mod:`.protocol`) and the cost model all walk the very same steps, and so that the schedules can
be property-tested for any world size without a process group.

Vocabulary.  The tensor that travels is cut into ``world_size`` *blocks* of rows, block ``b``
being the rows that rank ``b`` owns (its all-gather shard, or its reduce-scatter result).  A block
is cut into ``parts`` *pieces* (1 for "ring" and "direct", 2 for "double_ring", whose two halves
travel the ring in opposite directions so both directions of every link carry data).  A
:class:`Piece` is ``(block, part)``.

* All-gather: a send moves a piece the sender already holds; the receiver stores it.
  ``order`` is the order in which the GEMM may consume pieces (own block first, then arrival).
* Reduce-scatter: a send moves the sender's running sum of a piece (its own partial product
  plus everything it received for that piece); the receiver adds it to its own partial.  After
  the last step rank ``r`` holds the full sum of block ``r``.  ``order`` is the order in which
  the GEMM must produce the partial products of pieces so that each is ready when sent (own
  block last).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

SCHEDULES: tuple[str, ...] = ("ring", "double_ring", "direct")
Kind = Literal["all_gather", "reduce_scatter"]


@dataclass(frozen=True, order=True)
class Piece:
    """Part ``part`` of block ``block`` (the rows owned by rank ``block``)."""

    block: int
    part: int


@dataclass(frozen=True)
class Transfer:
    """One point-to-point move of one piece between this rank and ``peer``."""

    piece: Piece
    peer: int


@dataclass(frozen=True)
class Step:
    """What this rank sends and receives in one step; all of a step's transfers may overlap."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


@dataclass(frozen=True)
class Schedule:
    """The whole plan of one rank for one collective."""

    kind: Kind
    name: str
    world_size: int
    rank: int
    parts: int
    steps: tuple[Step, ...]
    order: tuple[Piece, ...]

    def arrival_step(self) -> dict[Piece, int]:
        """Step at which each received piece arrives (all-gather) or is received (reduce-scatter)."""
        return {t.piece: i for i, s in enumerate(self.steps) for t in s.recvs}


def check_schedule_name(schedule: str) -> str:
    """Return ``schedule`` if it is known, else raise a ValueError naming the argument."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got schedule={schedule!r}")
    return schedule


def parts_of(schedule: str) -> int:
    """How many pieces each block is cut into under ``schedule``."""
    return 2 if check_schedule_name(schedule) == "double_ring" else 1


def split_rows(rows: int, parts: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) of each part of a block of ``rows`` rows; earlier parts take the remainder."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for p in range(parts):
        n = base + (1 if p < extra else 0)
        out.append((start, start + n))
        start += n
    return tuple(out)


def piece_rows(blocks, parts: int, piece: Piece) -> tuple[int, int]:
    """Global row span of ``piece`` given the (start, stop) spans of the blocks."""
    start, stop = blocks[piece.block]
    a, b = split_rows(stop - start, parts)[piece.part]
    return start + a, start + b


def _check(world_size: int, rank: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


@lru_cache(maxsize=4096)
def all_gather_schedule(schedule: str, world_size: int, rank: int) -> Schedule:
    """Steps of an all-gather under ``schedule`` for ``rank``.

    ring: step s sends block r-s to r+1 and receives block r-s-1 from r-1.
    double_ring: part 0 does the same clockwise, part 1 the mirror image counter-clockwise.
    direct: step s (1..W-1) sends the own block to r+s and receives block r-s from it.
    """
    check_schedule_name(schedule)
    _check(world_size, rank)
    w, r = world_size, rank
    steps: list[Step] = []
    order: list[Piece] = []
    if schedule == "ring":
        order.append(Piece(r, 0))
        for s in range(w - 1):
            got = Piece((r - s - 1) % w, 0)
            steps.append(Step(sends=(Transfer(Piece((r - s) % w, 0), (r + 1) % w),),
                              recvs=(Transfer(got, (r - 1) % w),)))
            order.append(got)
    elif schedule == "double_ring":
        order += [Piece(r, 0), Piece(r, 1)]
        for s in range(w - 1):
            got0, got1 = Piece((r - s - 1) % w, 0), Piece((r + s + 1) % w, 1)
            steps.append(Step(
                sends=(Transfer(Piece((r - s) % w, 0), (r + 1) % w),
                       Transfer(Piece((r + s) % w, 1), (r - 1) % w)),
                recvs=(Transfer(got0, (r - 1) % w), Transfer(got1, (r + 1) % w))))
            order += [got0, got1]
    else:  # direct
        order.append(Piece(r, 0))
        for s in range(1, w):
            got = Piece((r - s) % w, 0)
            steps.append(Step(sends=(Transfer(Piece(r, 0), (r + s) % w),),
                              recvs=(Transfer(got, (r - s) % w),)))
            order.append(got)
    return Schedule("all_gather", schedule, w, r, parts_of(schedule), tuple(steps), tuple(order))


@lru_cache(maxsize=4096)
def reduce_scatter_schedule(schedule: str, world_size: int, rank: int) -> Schedule:
    """Steps of a reduce-scatter (sum) under ``schedule`` for ``rank``.

    ring: the running sum of block b starts at rank b+1 and travels clockwise to rank b; at step
    s rank r sends its sum of block r-1-s to r+1 and receives the sum of block r-2-s from r-1.
    double_ring: part 0 as ring, part 1 the mirror image (block r+1+s sent to r-1).
    direct: step s (1..W-1) sends the own partial of block r+s to rank r+s and receives rank
    r-s's partial of block r.
    """
    check_schedule_name(schedule)
    _check(world_size, rank)
    w, r = world_size, rank
    steps: list[Step] = []
    order: list[Piece] = []
    if schedule == "ring":
        for s in range(w - 1):
            sent = Piece((r - 1 - s) % w, 0)
            steps.append(Step(sends=(Transfer(sent, (r + 1) % w),),
                              recvs=(Transfer(Piece((r - 2 - s) % w, 0), (r - 1) % w),)))
            order.append(sent)
        order.append(Piece(r, 0))
    elif schedule == "double_ring":
        for s in range(w - 1):
            sent0, sent1 = Piece((r - 1 - s) % w, 0), Piece((r + 1 + s) % w, 1)
            steps.append(Step(
                sends=(Transfer(sent0, (r + 1) % w), Transfer(sent1, (r - 1) % w)),
                recvs=(Transfer(Piece((r - 2 - s) % w, 0), (r - 1) % w),
                       Transfer(Piece((r + 2 + s) % w, 1), (r + 1) % w))))
            order += [sent0, sent1]
        order += [Piece(r, 0), Piece(r, 1)]
    else:  # direct
        for s in range(1, w):
            sent = Piece((r + s) % w, 0)
            steps.append(Step(sends=(Transfer(sent, (r + s) % w),),
                              recvs=(Transfer(Piece(r, 0), (r - s) % w),)))
            order.append(sent)
        order.append(Piece(r, 0))
    return Schedule("reduce_scatter", schedule, w, r, parts_of(schedule), tuple(steps), tuple(order))


def _same_steps(a: str, b: str, world_size: int) -> bool:
    def steps(name: str, make) -> list:
        return [(s.steps, s.order) for s in (make(name, world_size, r) for r in range(world_size))]
    return all(steps(a, make) == steps(b, make) for make in (all_gather_schedule, reduce_scatter_schedule))


@lru_cache(maxsize=256)
def distinct_schedules(schedules: tuple[str, ...], world_size: int) -> tuple[str, ...]:
    """``schedules`` less those that move exactly the pieces of a schedule named later in
    ``SCHEDULES`` at this world size: at two ranks the ring is the one link used both ways, the
    very steps of "direct", so the cost model prices (and a benchmark measures) that operator once,
    under the name of the full mesh."""
    for name in schedules:
        check_schedule_name(name)
    later = {name: SCHEDULES[SCHEDULES.index(name) + 1:] for name in schedules}
    return tuple(name for name in schedules
                 if not any(other in schedules and _same_steps(name, other, world_size) for other in later[name]))


def refined(sched: Schedule, split: int) -> Schedule:
    """``sched`` with every piece cut into ``split`` consecutive pieces that travel in the same
    step, one after another: a pipeline inside each transfer (host-staged, one piece's copy to the
    host overlaps the previous piece's copy to the peer, and the GEMM starts on the first piece)."""
    if split < 1:
        raise ValueError(f"split must be >= 1, got split={split}")
    if split == 1:
        return sched

    def cut(piece: Piece) -> tuple[Piece, ...]:
        return tuple(Piece(piece.block, piece.part * split + i) for i in range(split))

    def transfers(ts: tuple[Transfer, ...]) -> tuple[Transfer, ...]:
        return tuple(Transfer(q, t.peer) for t in ts for q in cut(t.piece))

    return replace(sched, parts=sched.parts * split,
                   steps=tuple(Step(transfers(s.sends), transfers(s.recvs)) for s in sched.steps),
                   order=tuple(q for p in sched.order for q in cut(p)))
