"""The fused operators' cross-GPU protocol as data: per-rank plans of stream commands.

A plan is the list of commands one rank issues for one call of a fused operator, in issue order,
each bound to a stream (``MAIN``: the GEMMs and reductions, the caller's stream; ``COMM``: copies
and flag waits, a high-priority side stream; ``PUB``: publications through host memory,
:func:`host_staged`; ``TAIL``: the sums of a :func:`detached` reduction, which leaves the caller's
stream free once its GEMMs are issued).  The CUDA implementation (:mod:`.cuda.impl`) executes
plans with peer-to-peer copies (the copy engines), cuBLAS and stream memory operations for the
flags (one-thread kernels in calls captured in CUDA graphs); the simulator (:mod:`.simulate`)
executes the very same plans for several ranks on the CPU under random interleavings.  So the
protocol that the tests check is the protocol the GPUs run.

Data moves by *pulls*: a rank copies what it needs out of a peer's symmetric buffer into its own
memory.  No rank ever writes into a peer's memory, so the only cross-rank questions are "has the
peer published this piece for this call?" and "have the peers finished reading my buffer?".

Flags.  Every rank owns an int32 array of ``ready`` flags in symmetric memory, written only by
that rank and only by ``SetFlag``, which stores the call's *epoch* (1, 2, 3, ... per workspace,
the same on every rank because every rank calls the same operators in the same order).
``ready[slot] >= e`` means: the rank holds, in its symmetric buffer of call ``e`` (or later), the
piece (all-gather) or the running sum of the piece (reduce-scatter) that the slot names.  Flags
are never zeroed, only raised, so a late reader can never miss a value.

Buffers.  Symmetric buffers are double-buffered by the epoch's parity, and that is the whole
fence before reuse: (1) a rank completes call ``e + 1`` only with data that *every* rank published
in call ``e + 1`` (each result depends on every rank's input), and (2) a rank publishes for call
``e + 1`` only after its own pulls of call ``e`` (they precede the publication on its side stream,
or the caller's stream waits for them at the end of call ``e``).  So when a rank starts writing
call ``e + 2`` into the buffer that call ``e`` used, every peer has finished reading it.  One
buffer would not do (a rank writes call ``e + 1`` while a slow peer may still read call ``e``),
and the simulator catches that (``tests/test_protocol.py``).  A call captured in a CUDA graph replays fixed
addresses, so it cannot alternate: its plan is :func:`fenced` (one set of buffers, and a flag that
says a rank has finished reading the previous call).

Why a plan cannot deadlock.  Every wait is a ``WaitFlag`` on a flag that only its owner writes,
with the epoch that the owner writes unconditionally in that call, or a ``WaitEvent`` on an event
recorded earlier in the same rank's issue order.  Order the commands of all ranks by (epoch,
number of hops the awaited piece travels).  The ``SetFlag`` a ``WaitFlag`` of epoch ``e`` needs
comes after only earlier epochs' work (stream order) and waits on pieces of fewer hops (rings):
by induction every wait ends.  Nothing spins on a kernel of another stream that might not be
resident (the waiting kernel is one small program; copies run on the copy engines; cuBLAS never
waits), and every wait on the GPU is bounded by a timeout that names the operator, rank, slot and
peer.  The old protocol (flags zeroed at the start of a call, before a barrier) broke the "never
zeroed" rule: a fast rank could zero a flag a slow peer had not read yet; the simulator shows
that it hangs.  The argument above assumes that each stream advances on its own; a GPU may
feed several streams through one hardware queue in issue order, so the plans are issued in the
order of :mod:`.issue_order`, which completes even then.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import lru_cache, wraps
from typing import Callable, Literal, Union

from .schedules import Piece, all_gather_schedule, piece_rows, reduce_scatter_schedule, refined

MAIN, COMM, PUB, TAIL = "main", "comm", "pub", "tail"
Stream = Literal["main", "comm", "pub", "tail"]
STREAMS: tuple[str, ...] = (MAIN, COMM, PUB, TAIL)
SELF = -1

# Buffers a region may name.  Symmetric (peers can read them, double-buffered by parity; a plan's
# ``symmetric_rows`` lists them): G, P, or, in host-staged plans, their host mirrors HG, HP (G and
# P are then private to the rank, in ``private_rows``).  Call tensors: A (left operand), OUT (j-th
# output for a matmul, else the result), GATHERED.  Local scratch: STAGE (received partial sums).
HOST_MIRROR = {"G": "HG", "P": "HP"}


@dataclass(frozen=True)
class Region:
    """Rows ``[start, stop)`` of buffer ``buf`` owned by ``owner`` (``SELF`` or a peer rank)."""

    buf: str
    start: int
    stop: int
    owner: int = SELF
    index: int = 0  # which output (OUT) or which staging slot (STAGE)

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class WaitFlag:
    """Wait until ``peer``'s flag ``slot`` reaches ``epoch + delta`` (skipped when that is < 1)."""

    stream: Stream
    peer: int
    slot: int
    delta: int = 0


@dataclass(frozen=True)
class SetFlag:
    """Store the call's epoch into this rank's flag ``slot`` once the stream's prior work is done.

    ``publishes`` names the rows of this rank's symmetric buffer that the flag announces (what a
    host-staged plan must copy to the host mirror first)."""

    stream: Stream
    slot: int
    publishes: Region | None = None


@dataclass(frozen=True)
class Copy:
    stream: Stream
    dst: Region
    src: Region


@dataclass(frozen=True)
class Matmul:
    """``dst = src @ weight[index]`` (``dst`` is an OUT or P region, ``src`` an A/G/GATHERED one)."""

    stream: Stream
    dst: Region
    src: Region
    weight: int = 0


@dataclass(frozen=True)
class Reduce:
    """``dst = sum(srcs)``, accumulated in float32 when there are more than two terms."""

    stream: Stream
    dst: Region
    srcs: tuple[Region, ...]


@dataclass(frozen=True)
class Record:
    stream: Stream
    event: str


@dataclass(frozen=True)
class WaitEvent:
    stream: Stream
    event: str


Command = Union[WaitFlag, SetFlag, Copy, Matmul, Reduce, Record, WaitEvent]


def _kept(method: Callable[["Plan"], tuple]) -> Callable[["Plan"], tuple]:
    """A plan's answer derived from its commands, worked out at the first ask and kept with the
    plan (frozen: kept beside its fields, not compared; plans are built once per shape and asked
    often)."""
    name = f"_{method.__name__}"

    @wraps(method)
    def ask(self: "Plan") -> tuple:
        known = self.__dict__.get(name)
        if known is None:
            known = method(self)
            object.__setattr__(self, name, known)
        return known
    return ask


@dataclass(frozen=True)
class Plan:
    """One rank's commands for one call, plus the sizes of what they address."""

    op: str
    rank: int
    world_size: int
    commands: tuple[Command, ...]
    n_flags: int
    symmetric_rows: dict[str, int] = field(default_factory=dict)  # rows of G / P (peers read them)
    private_rows: dict[str, int] = field(default_factory=dict)  # double-buffered, read by no peer
    stage_slots: int = 0
    stage_rows: int = 0
    n_weights: int = 0
    slot_names: tuple[str, ...] = ()  # what each flag announces, for error messages

    def crosses_symmetric(self, cmd: "Copy") -> bool:
        """Whether ``cmd`` copies to or from a buffer the peers read: on the host-staged transport,
        a copy to or from host memory (the copy engines' work a replay graph launches dearly)."""
        return cmd.src.buf in self.symmetric_rows or cmd.dst.buf in self.symmetric_rows

    @_kept
    def wait_runs(self) -> tuple[tuple[int, ...], ...]:
        """Positions of flag waits that may wait as one: two or more waits for the call's own epoch
        on one stream, for the same flag slot of different peers (one chunk or piece from every
        peer), with nothing between them in the plan's order but copies on that stream (an
        all-reduce's pulls of a chunk from every peer).  Waiting for all of them before the first
        copy only delays the copies between, by no more than they could have run before the run's
        last flag was set (in the all-reduce nothing: the peer awaited first computes that chunk
        last), and no other command, stream, event or peer sees the points between the waits;
        whatever follows the run waited for every flag of it already, so the order stays as safe
        as it was (streams sharing a hardware queue too).  Waits for different slots (one peer's
        consecutive pieces, or another stage's flags) are joined only where they follow each other
        with nothing between (a round of :func:`grouped_pulls`): the stream waits for all of them
        there anyway.  With copies between they are not: those flags are set one after another,
        and a copy behind the later one would lose its overlap with it."""
        runs: list[tuple[int, ...]] = []
        run: list[int] = []
        for i, cmd in enumerate(self.commands):
            same_stream = bool(run) and cmd.stream == self.commands[run[0]].stream
            next_to_run = bool(run) and run[-1] == i - 1
            if (isinstance(cmd, WaitFlag) and cmd.delta == 0
                    and (not run or same_stream and (next_to_run or cmd.slot == self.commands[run[0]].slot))):
                run.append(i)
                continue
            if isinstance(cmd, Copy) and same_stream:
                continue
            if len(run) > 1:
                runs.append(tuple(run))
            run = [i] if isinstance(cmd, WaitFlag) and cmd.delta == 0 else []
        if len(run) > 1:
            runs.append(tuple(run))
        return tuple(runs)

    @_kept
    def copy_runs(self) -> tuple[tuple[int, ...], ...]:
        """Positions of two or more copies out of peers' buffers, of one size, on one stream, that
        follow each other with nothing between in the plan's order (a round of
        :func:`grouped_pulls`): each reads what its own flag wait, earlier on the stream, allowed,
        and none reads what another writes, so they may be issued in any order or as one
        (:mod:`.cuda.copy_runs`)."""
        runs: list[tuple[int, ...]] = []
        run: list[int] = []
        for i, cmd in enumerate(self.commands):
            pull = isinstance(cmd, Copy) and cmd.src.owner != SELF
            if pull and run and (cmd.stream, cmd.src.rows) == (self.commands[run[0]].stream, self.commands[run[0]].src.rows):
                run.append(i)
                continue
            if len(run) > 1:
                runs.append(tuple(run))
            run = [i] if pull else []
        if len(run) > 1:
            runs.append(tuple(run))
        return tuple(runs)


def _equal_blocks(world: int, block_rows: int) -> tuple[tuple[int, int], ...]:
    return tuple((b * block_rows, (b + 1) * block_rows) for b in range(world))


def _piece_names(slot: dict[Piece, int], what: str) -> tuple[str, ...]:
    return tuple(f"{what} of block {p.block} part {p.part}" for p, _ in sorted(slot.items(), key=lambda kv: kv[1]))


def _framed(cmds: list[Command]) -> tuple[Command, ...]:
    """The side stream starts after the caller's prior work (the inputs) and the caller's stream
    goes on only after the side stream's work (the outputs, and its reads of scratch buffers)."""
    return (Record(MAIN, "start"), WaitEvent(COMM, "start"), *merged_matmuls(cmds), Record(COMM, "end"),
            WaitEvent(MAIN, "end"))


def _adjoins(first: Region, then: Region) -> bool:
    return (then.buf, then.owner, then.index, then.start) == (first.buf, first.owner, first.index, first.stop)


def merged_matmuls(cmds: list[Command]) -> list[Command]:
    """``cmds`` with each run of GEMMs issued back to back on one stream, of one weight, whose rows
    continue each other in both operands, as one GEMM over all their rows.

    Why: a plan cuts every block into the pieces its schedule sends, so the pieces a rank keeps
    (its own block of a reduce-scatter) came as one GEMM per piece with nothing between them; no
    other stream can tell them apart (an event between them would be a command between them).  One
    GEMM of all their rows is one launch instead of several for a call issued command by command,
    and the H200's GEMM model prices it faster (4 x 1024 rows of a 7168 x 4096 weight 1.03x one GEMM
    of 4096 rows, 4 x 512 rows 1.11x).  The fused calls on one H200 (``h200-merge-ab``, periods of
    16 calls): two ranks' 8192-row reduce-scatter 2.6% faster merged (four runs each), four ranks'
    1.6% slower (two each; four ranks sharing one GPU run other ranks' GEMMs beside each one),
    other rows within 1%."""
    out: list[Command] = []
    for cmd in cmds:
        last = out[-1] if out else None
        if (isinstance(cmd, Matmul) and isinstance(last, Matmul) and cmd.stream == last.stream
                and cmd.weight == last.weight and _adjoins(last.dst, cmd.dst) and _adjoins(last.src, cmd.src)):
            out[-1] = replace(last, dst=replace(last.dst, stop=cmd.dst.stop), src=replace(last.src, stop=cmd.src.stop))
        else:
            out.append(cmd)
    return out


WAVE_TILE_ELEMENTS = 128 * 256  # output elements of cuBLAS's largest bf16 tile on Hopper
CONSUMER_WAVES = 2


def consumer_group_rows(cols: int, sms: int, waves: int = CONSUMER_WAVES) -> int:
    """Fewest rows a consumer GEMM of ``cols`` output columns should multiply: ``waves`` full
    waves of the largest tile over ``sms`` multiprocessors.

    Why: one GEMM per arriving piece leaves most of the GPU idle when a piece is thin (at TP = 8,
    a 512-row piece of Llama-3 8B's QKV projection fills 12 of 132 SMs).  On one H200, over the 12
    TP = 8 Llama-3 shapes (device time), eight piece-sized cuBLAS calls reached 0.41-1.01 of one
    call over all rows (median 0.91), the own block then arrivals grouped into GEMMs of at least
    one wave 0.78-1.01 (median 0.93), of two waves 0.78-1.01 (median 0.96)
    (``benchmarks/results/chunked_gemm/chunked_gemm-h200.json``).  The low end is a product of one wave
    (Llama-3 QKV at 4096 tokens): its own-block GEMM takes 10-23 us beside the 36-107 us of the
    whole, and the arrivals' GEMM is still one wave, 95-96% of the whole.  Alternating the
    GEMMs over two streams does not help (0.80-1.0, median 0.95): cuBLAS's Hopper kernels launch
    about one CTA per SM, so two of them do not run side by side.  Nor does one Triton GEMM over
    all rows whose programs wait per row block (``benchmarks/harness/triton_consumer.py``): 0.65-0.83
    of one cuBLAS call with the weight in ``nn.Linear``'s layout, its wait costing <= 1%."""
    return -(-waves * sms * WAVE_TILE_ELEMENTS // max(cols, 1))


def consumer_groups(spans: "list[tuple[int, int]]", min_rows: int) -> list[list[int]]:
    """Indices of the arriving pieces (rows ``spans``, in arrival order) that each consumer GEMM
    multiplies together: consecutive arrivals whose rows adjoin, until a group has ``min_rows``.

    A group waits for its last piece, so grouping trades overlap for GEMM efficiency; the groups
    fill from the front, so the GEMM left after the last arrival is never larger than one group.
    ``min_rows`` 0: one GEMM per piece."""
    groups: list[list[int]] = []
    lo = hi = 0
    for i, (plo, phi) in enumerate(spans):
        if groups and hi - lo < min_rows and (plo == hi or phi == lo):
            groups[-1].append(i)
            lo, hi = min(lo, plo), max(hi, phi)
        else:
            groups.append([i])
            lo, hi = plo, phi
    return groups


@lru_cache(maxsize=256)
def all_gather_plan(schedule: str, world: int, rank: int, block_rows: int, n_weights: int,
                    split: int = 1, group_rows: int = 0, grouped: bool = False) -> Plan:
    """``GATHERED = all_gather(A)``; ``OUT[j] = GATHERED @ W[j]``, own rows first.

    The own block is copied into ``G`` (symmetric) and published; each received piece is pulled
    from the peer the schedule names, once that peer has published it.  A piece that some other
    rank pulls from this one (a ring relay) lands in ``G`` and is published again; others land
    straight in ``GATHERED``.  ``split`` cuts every piece further (:func:`.schedules.refined`);
    ``group_rows``: the received pieces are multiplied in groups of at least that many rows
    (:func:`consumer_groups`), each once its last piece has arrived.  ``grouped`` (the direct
    schedule only): the pulls go in rounds, one part of every peer's block each, the round's
    flag waits first, then its copies (:func:`grouped_pulls` says why)."""
    if grouped and schedule != "direct":
        raise ValueError(f"grouped pulls need the direct schedule, got {schedule!r}")
    sched = refined(all_gather_schedule(schedule, world, rank), split)
    parts = sched.parts
    slot = {Piece(b, p): b * parts + p for b in range(world) for p in range(parts)}
    relayed = {t.piece for other in range(world) if other != rank
               for s in refined(all_gather_schedule(schedule, world, other), split).steps
               for t in s.recvs if t.peer == rank and t.piece.block != rank}
    blocks = _equal_blocks(world, block_rows)
    own_lo, own_hi = blocks[rank]
    own = Region("A", 0, block_rows)
    # Host issue order: publish the own block first (the peers wait for it), start the own rows'
    # GEMM next (it needs nothing), then the pulls; the own rows' copy into GATHERED goes last.
    cmds: list[Command] = [Copy(COMM, Region("G", own_lo, own_hi), own)]
    cmds += [SetFlag(COMM, slot[Piece(rank, p)], Region("G", *piece_rows(blocks, parts, Piece(rank, p))))
             for p in range(parts)]
    cmds += [Matmul(MAIN, Region("OUT", own_lo, own_hi, index=j), own, j) for j in range(n_weights)]
    recvs = [t for step in sched.steps for t in step.recvs]
    rounds = grouped_pulls(recvs, parts) if grouped else [[t] for t in recvs]
    for r, pulls in enumerate(rounds):
        cmds += [WaitFlag(COMM, t.peer, slot[t.piece]) for t in pulls]
        for segment in (drain_segments(pulls) if r == len(rounds) - 1 else [pulls]):
            for t in segment:
                lo, hi = piece_rows(blocks, parts, t.piece)
                if t.piece in relayed:
                    cmds += [Copy(COMM, Region("G", lo, hi), Region("G", lo, hi, owner=t.peer)),
                             SetFlag(COMM, slot[t.piece], Region("G", lo, hi)),
                             Copy(COMM, Region("GATHERED", lo, hi), Region("G", lo, hi))]
                else:
                    cmds.append(Copy(COMM, Region("GATHERED", lo, hi), Region("G", lo, hi, owner=t.peer)))
            cmds += [Record(COMM, f"got{slot[t.piece]}") for t in segment]
    cmds.append(Copy(COMM, Region("GATHERED", own_lo, own_hi), own))
    arrivals = tuple(t.piece for pulls in rounds for t in pulls)
    spans = [piece_rows(blocks, parts, piece) for piece in arrivals]
    for group in consumer_groups(spans, group_rows):
        lo, hi = min(spans[i][0] for i in group), max(spans[i][1] for i in group)
        cmds += [WaitEvent(MAIN, f"got{slot[arrivals[i]]}") for i in group]
        cmds += [Matmul(MAIN, Region("OUT", lo, hi, index=j), Region("GATHERED", lo, hi), j)
                 for j in range(n_weights)]
    return Plan("all_gather_matmul", rank, world, _framed(cmds), len(slot),
                {"G": world * block_rows}, n_weights=n_weights, slot_names=_piece_names(slot, "rows"))


def grouped_pulls(recvs: "list", parts: int) -> list[list]:
    """The direct all-gather's pulls (``Transfer``s, in the schedule's order) as rounds: part
    ``p`` of every peer's block, in the schedule's order of peers, round after round.

    Why: through host memory every pull is a copy-engine copy whose node a replay graph's launch
    pays ~1.3-2 us for (``graph_node_probe``), and a rank pulls ``world - 1`` of them per part.  In
    a round the copies follow each other with nothing between, so the CUDA path issues those whose
    addresses step evenly (the peers' mirrors lie at one stride in the arena,
    :mod:`.cuda.host_memory`) as one 2D copy, and the round's flag waits as one batch
    (:meth:`Plan.wait_runs`): the launch pays per part, not per part and peer.  In the direct
    schedule every rank publishes its own block's parts in order at the call's start, so a round's
    pieces become ready together, and pulling part by part (rather than peer by peer) is also the
    order in which they appear."""
    return [[t for t in recvs if t.piece.part == p] for p in range(parts)]


def drain_segments(pulls: list) -> list[list]:
    """The last round of :func:`grouped_pulls` cut in halves (7 pulls: 4, 2, 1), each segment's
    arrivals announced once its copies are done.

    Why: a piece's GEMM waits for the event after its round's copies, and a round's copies are
    one or two 2D copies, so after the last round's bytes arrive all ``world - 1`` of its GEMMs
    would still be to run (at eight ranks on one H200, the whole round's GEMMs after the last copy
    made the largest gathers' period 1.11-1.19x that of one copy per peer:
    ``fused_host_time-h200-*-w8-ab-*``; halved, 0.93-1.04x: ``*-drain-w8-gather-ab*``).  Halved,
    each segment's GEMMs run while the later, smaller segments travel, as long as a piece's GEMM
    is shorter than half its copy (the regime of a host-staged call, whose bytes cross PCIe
    twice), and one piece's GEMM is left after the last byte, as with one copy per peer; the
    round costs the launch one or two copies per segment, about log2 of the peers, instead of
    one or two in all."""
    segments = []
    while pulls:
        half = (len(pulls) + 1) // 2
        segments.append(pulls[:half])
        pulls = pulls[half:]
    return segments


@lru_cache(maxsize=256)
def reduce_scatter_plan(schedule: str, world: int, rank: int, block_rows: int, split: int = 1) -> Plan:
    """``OUT = reduce_scatter(A @ W)`` for this rank's block.

    ``P`` (symmetric) holds this rank's partial products, produced in the schedule's order (the
    pieces sent first are computed first), and then its running sums.  A rank publishes a piece
    when the schedule sends it; the receiver pulls it into ``STAGE`` (side stream) and adds it to
    its own partial (caller's stream, after the next piece's GEMM has been issued, so that the
    ring's chain of additions overlaps the GEMMs); its own block's sum goes to ``OUT``.  ``split``
    cuts every piece further (:func:`.schedules.refined`)."""
    sched = refined(reduce_scatter_schedule(schedule, world, rank), split)
    parts = sched.parts
    slot = {Piece(b, p): b * parts + p for b in range(world) for p in range(parts)}
    recvs = [(i, t) for i, s in enumerate(sched.steps) for t in s.recvs]
    sent = {t.piece for s in sched.steps for t in s.sends}
    received = {t.piece for _, t in recvs}
    blocks = _equal_blocks(world, block_rows)
    own_lo = blocks[rank][0]
    pulls: list[Command] = []
    stages: dict[Piece, list[Region]] = {}
    stage_rows = 0
    for n, (_, t) in enumerate(recvs):
        lo, hi = piece_rows(blocks, parts, t.piece)
        stage_rows = max(stage_rows, hi - lo)
        stage = Region("STAGE", 0, hi - lo, index=n)
        pulls += [WaitFlag(COMM, t.peer, slot[t.piece]), Copy(COMM, stage, Region("P", lo, hi, owner=t.peer)),
                  Record(COMM, f"pulled{n}")]
        stages.setdefault(t.piece, []).append(stage)
    last_pull = {t.piece: n for n, (_, t) in enumerate(recvs)}

    def reduce(piece: Piece) -> list[Command]:
        lo, hi = piece_rows(blocks, parts, piece)
        terms = (Region("P", lo, hi), *stages[piece])
        if piece.block == rank:
            return [WaitEvent(MAIN, f"pulled{last_pull[piece]}"),
                    Reduce(MAIN, Region("OUT", lo - own_lo, hi - own_lo), terms)]
        return [WaitEvent(MAIN, f"pulled{last_pull[piece]}"), Reduce(MAIN, Region("P", lo, hi), terms),
                SetFlag(MAIN, slot[piece], Region("P", lo, hi))]

    cmds: list[Command] = []
    relays = [q for q in sched.order if q in received and q.block != rank]  # sums this rank passes on

    def reduce_relays(upto: int) -> None:
        while relays and sched.order.index(relays[0]) < upto:
            cmds.extend(reduce(relays.pop(0)))

    for k, piece in enumerate(sched.order):
        lo, hi = piece_rows(blocks, parts, piece)
        cmds.append(Matmul(MAIN, Region("P", lo, hi), Region("A", lo, hi)))
        if piece in sent and piece not in received:  # a bare partial product: publish at once
            cmds.append(SetFlag(MAIN, slot[piece], Region("P", lo, hi)))
        if k == 0:
            cmds += pulls
        # a relayed sum is issued one step of GEMMs after its own partial, so that the caller's
        # stream has a GEMM to run while the pull it needs is on its way
        reduce_relays(k + 1 - parts)
    reduce_relays(len(sched.order))
    for p in range(parts):
        if Piece(rank, p) in received:
            cmds += reduce(Piece(rank, p))
        else:  # a group of one
            lo, hi = piece_rows(blocks, parts, Piece(rank, p))
            cmds.append(Copy(MAIN, Region("OUT", lo - own_lo, hi - own_lo), Region("P", lo, hi)))
    return Plan("matmul_reduce_scatter", rank, world, _framed(cmds), len(slot), {"P": world * block_rows},
                stage_slots=len(recvs), stage_rows=stage_rows, n_weights=1,
                slot_names=_piece_names(slot, "partial sum"))


@lru_cache(maxsize=256)
def all_reduce_plan(world: int, rank: int, rows: int, chunks: int, grouped: bool = False) -> Plan:
    """``OUT = all_reduce(A @ W)`` by direct pulls, pipelined over ``chunks`` row chunks.

    Chunk ``c`` is cut into ``world`` blocks; rank ``b`` reduces block ``b`` of every chunk (pulls
    the peers' partials of it, sums them into its ``P``) and publishes the sum; every rank then
    pulls the reduced blocks into ``OUT``.  The GEMM of chunk ``c + 1`` runs while chunk ``c``
    travels, and chunk ``c`` is summed after it.  Flags: ``world * chunks`` partial slots, then
    ``chunks`` reduced slots.  ``grouped``: each pull from every peer (a chunk's partials, its
    reduced blocks) waits for all of their flags first, then copies (as :func:`grouped_pulls`)."""
    if rows % (world * chunks):
        raise ValueError(f"{rows} rows do not split into {chunks} chunks of {world} blocks")
    block = rows // (world * chunks)
    peers = [(rank + s) % world for s in range(1, world)]

    def span(c: int, b: int) -> tuple[int, int]:
        lo = (c * world + b) * block
        return lo, lo + block

    def gemm_and_pull(c: int) -> list[Command]:
        cmds: list[Command] = []
        for b in peers + [rank]:  # the peers' blocks first: they are the ones that travel
            lo, hi = span(c, b)
            cmds.append(Matmul(MAIN, Region("P", lo, hi), Region("A", lo, hi)))
            if b != rank:
                cmds.append(SetFlag(MAIN, c * world + b, Region("P", lo, hi)))
        lo, hi = span(c, rank)
        waits = [WaitFlag(COMM, peer, c * world + rank) for peer in peers]
        copies = [Copy(COMM, Region("STAGE", 0, block, index=c * len(peers) + n), Region("P", lo, hi, owner=peer))
                  for n, peer in enumerate(peers)]
        return cmds + pulls_of(waits, copies) + [Record(COMM, f"pulled{c}")]

    def reduce_and_gather(c: int) -> list[Command]:
        lo, hi = span(c, rank)
        stages = tuple(Region("STAGE", 0, block, index=c * len(peers) + n) for n in range(len(peers)))
        cmds: list[Command] = [WaitEvent(MAIN, f"pulled{c}"),
                               Reduce(MAIN, Region("P", lo, hi), (Region("P", lo, hi), *stages)),
                               SetFlag(MAIN, world * chunks + c, Region("P", lo, hi)), Record(MAIN, f"reduced{c}"),
                               WaitEvent(COMM, f"reduced{c}"), Copy(COMM, Region("OUT", lo, hi), Region("P", lo, hi))]
        waits = [WaitFlag(COMM, peer, world * chunks + c) for peer in peers]
        copies = [Copy(COMM, Region("OUT", *span(c, peer)), Region("P", *span(c, peer), owner=peer)) for peer in peers]
        return cmds + pulls_of(waits, copies)

    def pulls_of(waits: list[WaitFlag], copies: list[Copy]) -> list[Command]:
        if grouped:
            return [*waits, *copies]
        return [cmd for pair in zip(waits, copies) for cmd in pair]

    cmds: list[Command] = []
    for c in range(chunks):
        cmds += gemm_and_pull(c)
        if c:
            cmds += reduce_and_gather(c - 1)
    cmds += reduce_and_gather(chunks - 1)
    return Plan("matmul_all_reduce", rank, world, _framed(cmds), world * chunks + chunks, {"P": rows},
                stage_slots=chunks * len(peers), stage_rows=block, n_weights=1,
                slot_names=tuple([f"partial product of chunk {c} block {b}" for c in range(chunks)
                                  for b in range(world)] + [f"reduced block of chunk {c}" for c in range(chunks)]))


PAIR_STAGE_SLOTS = 2  # staging slots of the two-rank all-reduce's pulls (all_reduce_pair_plan)


@lru_cache(maxsize=256)
def all_reduce_pair_plan(rank: int, rows: int, chunks: int) -> Plan:
    """``OUT = all_reduce(A @ W)`` between two ranks: each pulls the peer's whole partial product,
    chunk by chunk, and adds it to its own (the host-staged transport's plan at two ranks).

    Why: the reduce-scatter-then-gather plan (:func:`all_reduce_plan`) moves half a rank's
    partials out and its reduced half back, N bytes each way per rank, in two rounds of a flag, a
    publication and a pull per chunk, the second round after the first's sum.  At two ranks,
    pulling the peer's whole partial moves the same N bytes each way in one round: a chunk costs
    one publication, one wait and one pull (half the copies through host memory that a replay
    graph's launch pays for), and nothing waits for a peer's sum at the end.  Each rank adds the
    two partials in its own order; a + b is b + a in floating point, so both hold the same bits.
    Two staging slots take turns (chunk ``c`` in slot ``c % 2``): a pull into a slot waits for the
    sum that read it two chunks before (an event of the caller's stream), so the slots hold two
    chunks of the peer's partial, N / 2 bytes from four chunks on, as the reduce-scatter's did.
    That wait costs no overlap where the ranks keep pace: the peer publishes chunk ``c`` after its
    GEMM of chunk ``c``, while this rank's sum of chunk ``c - 2`` runs right after its own GEMM of
    chunk ``c - 1`` (on one H200, period 1.00-1.01x of the whole partial staged:
    ``fused_host_time-h200-two-slots-allreduce-ab*``).
    Beyond two ranks each rank would pull every peer's whole partial: more bytes than the
    reduce-scatter."""
    if rows % chunks:
        raise ValueError(f"{rows} rows do not split into {chunks} chunks")
    peer, size = 1 - rank, rows // chunks
    slots = min(chunks, PAIR_STAGE_SLOTS)

    def reduce(c: int) -> list[Command]:
        lo, hi = c * size, (c + 1) * size
        summed = [Record(MAIN, f"summed{c}")] if c + slots < chunks else []  # a later pull reuses the slot
        return [WaitEvent(MAIN, f"pulled{c}"),
                Reduce(MAIN, Region("OUT", lo, hi), (Region("P", lo, hi), Region("STAGE", 0, size, index=c % slots))),
                *summed]

    cmds: list[Command] = []
    for c in range(chunks):
        lo, hi = c * size, (c + 1) * size
        reused = [WaitEvent(COMM, f"summed{c - slots}")] if c >= slots else []
        cmds += [Matmul(MAIN, Region("P", lo, hi), Region("A", lo, hi)), SetFlag(MAIN, c, Region("P", lo, hi)),
                 WaitFlag(COMM, peer, c), *reused,
                 Copy(COMM, Region("STAGE", 0, size, index=c % slots), Region("P", lo, hi, owner=peer)),
                 Record(COMM, f"pulled{c}")]
        if c:  # the previous chunk's sum after this chunk's GEMM is issued: it overlaps the GEMM
            cmds += reduce(c - 1)
    cmds += reduce(chunks - 1)
    return Plan("matmul_all_reduce", rank, 2, _framed(cmds), chunks, {"P": rows}, stage_slots=slots,
                stage_rows=size, n_weights=1,
                slot_names=tuple(f"partial product of chunk {c}" for c in range(chunks)))


CHUNK_BYTES = 32 << 20  # about one chunk per 32 MiB of output, at most 4 (see all_reduce_chunks)


def all_reduce_chunks(rows: int, world: int, wanted: int = 4, out_bytes: int | None = None,
                      chunk_bytes: int = CHUNK_BYTES) -> int:
    """The largest chunk count <= ``wanted`` that splits ``rows`` into equal blocks per rank.

    With ``out_bytes``, fewer chunks for small outputs: every chunk adds a few flag round trips
    (on 2 H200s four chunks lost to one at 16 MiB, 0.37 against 0.24 ms, and won at 128 MiB,
    1.65 against 1.71 ms)."""
    if out_bytes is not None:
        wanted = max(1, min(wanted, out_bytes // chunk_bytes))
    for c in range(wanted, 0, -1):
        if rows % (world * c) == 0:
            return c
    return 0


def host_staged(plan: Plan) -> Plan:
    """``plan`` for GPUs that cannot read each other's memory: peers meet in pinned host memory.

    Each symmetric buffer (G, P) becomes private device memory with a host mirror (HG, HP) that
    the peers read.  Every ``SetFlag`` first copies the rows it announces to the mirror, on a third
    stream (``PUB``) that waits only for an event of this rank, so a publication never queues
    behind a wait for a peer (the deadlock argument above carries over unchanged); every pull
    from a peer reads the peer's mirror.  Both copies are DMA through the copy engines, so the
    GEMMs keep every multiprocessor, and the flags live in the host memory as well.  The caller's
    stream waits for ``PUB`` at the end of the call, which keeps the double-buffering argument:
    nothing of call ``e + 2`` overwrites a private buffer before call ``e``'s mirror copies read it.

    Rows a plan copies from its input into a symmetric buffer only to publish them (the gather's
    own block) are staged straight from the input: that device copy would sit on the critical path
    of every call and nobody else reads those rows."""
    from_input = [c for c in plan.commands
                  if isinstance(c, Copy) and c.src.buf == "A" and c.dst.buf in HOST_MIRROR and c.dst.owner == SELF]
    cmds: list[Command] = []
    for cmd in plan.commands[:-1]:  # the last command is the caller's wait for the side stream
        if cmd in from_input:
            continue
        if isinstance(cmd, SetFlag):
            if cmd.publishes is None or cmd.publishes.buf not in HOST_MIRROR:
                raise ValueError(f"{plan.op}: {cmd} announces no symmetric rows to stage")
            src = cmd.publishes
            mirror = Region(HOST_MIRROR[src.buf], src.start, src.stop)
            for c in from_input:
                if c.dst.start <= src.start and src.stop <= c.dst.stop:
                    lo = c.src.start - c.dst.start
                    src = Region("A", src.start + lo, src.stop + lo, index=c.src.index)
            event = f"publish{cmd.slot}"
            cmds += [Record(cmd.stream, event), WaitEvent(PUB, event), Copy(PUB, mirror, src),
                     SetFlag(PUB, cmd.slot, mirror)]
        elif isinstance(cmd, Copy) and cmd.src.owner != SELF:
            src = cmd.src
            cmds.append(Copy(cmd.stream, cmd.dst, Region(HOST_MIRROR[src.buf], src.start, src.stop, src.owner)))
        else:
            cmds.append(cmd)
    cmds += [Record(PUB, "published"), WaitEvent(MAIN, "published"), plan.commands[-1]]
    mirrors = {HOST_MIRROR[b]: n for b, n in plan.symmetric_rows.items()}
    return Plan(plan.op, plan.rank, plan.world_size, tuple(cmds), plan.n_flags, mirrors,
                {**plan.private_rows, **plan.symmetric_rows}, plan.stage_slots, plan.stage_rows,
                plan.n_weights, plan.slot_names)


HOST_PIECE_BYTES = 4 << 20  # host-staged pieces of about 4 MiB (see host_split)
HOST_MOST_PIECES = 8
HOST_PIECES_PER_CALL = 16  # pieces per block times ranks (see host_most_pieces)
HOST_DEFAULT_MOST_PIECES = 4  # pieces a block at two to four ranks (see host_most_pieces)


def host_most_pieces(world: int, setting: int = 0) -> int:
    """At most how many host-staged pieces a block is cut into in a group of ``world`` ranks:
    ``setting`` where given (``COMPASS_HOST_MOST_PIECES``), else 4 at two to four ranks, 3 at five,
    2 from six on (``HOST_PIECES_PER_CALL`` over the ranks, at least 2, at most
    ``HOST_DEFAULT_MOST_PIECES``).

    Why so few: each piece costs a flag round trip through host memory and a copy and a wait to
    every replay's launch (~3 us of host per piece pulled: graph_node_probe-h200-shape), and the
    pipeline's fill, one piece of the first block, shrinks less than that costs.  At two ranks on
    one H200 under MPS (half the SMs each, one PCIe link: a PCIe pair at half speed) 4 pieces a
    block instead of 8 shortened the period of every call whose plan changed (0.72-0.96x, two
    runs; 0.80-0.95x with the SMs shared) and cut its host time (fused_host_time-h200-w2cap*).
    Beyond four ranks the other peers' blocks keep the copy engines busy through the fill: the cost
    model prices this cap at 0.98-1.008x of eight pieces per block for the fused_host_time cases at
    four and eight ranks (tests/test_protocol.py), and the host's launch with a quarter of the
    pulls at eight ranks (fused_host_time-h200-cap-*)."""
    if setting:
        return setting
    return max(2, min(HOST_DEFAULT_MOST_PIECES, HOST_PIECES_PER_CALL // world))


def host_piece_bytes() -> int:
    """Target size of a host-staged piece: ``COMPASS_HOST_PIECE_MIB`` or the protocol's default (read
    here, beside the rule it feeds, by the CUDA path and the cost model alike)."""
    mib = os.environ.get("COMPASS_HOST_PIECE_MIB")
    if not mib:
        return HOST_PIECE_BYTES
    try:
        value = float(mib)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"COMPASS_HOST_PIECE_MIB must be a positive number of MiB, got {mib!r}")
    return int(value * (1 << 20))


def host_most_pieces_setting() -> int:
    """``COMPASS_HOST_MOST_PIECES``: at most this many host-staged pieces a block, or 0 (unset: by
    the number of ranks, :func:`host_most_pieces`)."""
    raw = os.environ.get("COMPASS_HOST_MOST_PIECES")
    return positive_integer("COMPASS_HOST_MOST_PIECES", raw) if raw else 0


def positive_integer(name: str, raw: str) -> int:
    """The value of setting ``name`` given as ``raw``, which must be a positive integer (else a
    ValueError naming the setting): the one parse of the kernels' integer settings."""
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return value


def host_split(piece_bytes: int, target: int = HOST_PIECE_BYTES, most: int = HOST_MOST_PIECES) -> int:
    """Into how many pieces host-staged transport cuts a piece of ``piece_bytes`` (a power of two).

    Through host memory every byte crosses PCIe twice, device -> host -> peer; cut into pieces,
    the second crossing of one piece overlaps the first of the next, and the GEMM starts on the
    first piece instead of the whole block.  Each piece costs a flag round trip through host
    memory (tens of microseconds), hence pieces of a few MiB."""
    split = 1
    while split * 2 <= most and piece_bytes // (split * 2) >= target:
        split *= 2
    return split


def host_all_reduce_chunks(rows: int, world: int, out_bytes: int, piece_bytes: int = HOST_PIECE_BYTES,
                           most_pieces: int = 0) -> int:
    """Host-staged all-reduce: chunks whose blocks are one host piece each, at most
    :func:`host_most_pieces` (0 when no such count splits ``rows``, as :func:`all_reduce_chunks`).
    At two ranks a chunk travels whole (:func:`all_reduce_pair_plan`), so a chunk is one piece:
    with the chunks of the reduce-scatter plan the pieces were twice as large, and the 2048-row
    call's period 1.16x the reduce-scatter plan's (``fused_host_time-h200-pair-allreduce-ab*``)."""
    most = host_most_pieces(world, most_pieces)
    if world == 2:
        return all_reduce_chunks(rows, 1, most, out_bytes, piece_bytes)
    return all_reduce_chunks(rows, world, most, out_bytes, world * piece_bytes)


def stream_plans(op: str, schedule: str, world: int, rank: int, rows: int, cols: int, matmuls: int,
                 itemsize: int, host: bool, piece_bytes: int = HOST_PIECE_BYTES,
                 detach: bool = False, group_rows: int = 0, most_pieces: int = 0) -> tuple[Plan, ...]:
    """The plans of one call as built stream by stream (each stream's order right, the order
    across streams not yet the one to issue in: :func:`.issue_order.call_plans`).

    ``rows``: rows of the A operand (a shard for ``all_gather_matmul``); ``cols``: width of the
    tensor that travels (k for the gather, n for the reduced output); ``host``: host-staged
    transport (pieces cut by :func:`host_split`, at most :func:`host_most_pieces` a block, which
    ``most_pieces`` sets where non-zero; plans rewritten by :func:`host_staged`).
    ``matmul_all_reduce`` pulls in chunks where it can (``"direct"`` and a chunk count that
    splits the rows; host-staged at two ranks, the peer's whole partial: :func:`all_reduce_pair_plan`),
    else runs the fused reduce-scatter and then the gather of its result.
    ``detach``: the reductions' plans :func:`detached` (not an all-gather's GEMMs: they need what
    arrives; the all-reduce's gather of its sums has none).  ``group_rows``: the all-gather's
    consumer GEMMs over peer-to-peer pulls multiply arrivals in groups of that many rows
    (:func:`consumer_group_rows`); host-staged pieces stay one GEMM each (their size is chosen
    for the transfer's pipeline, and the transfer is the slower side there)."""
    def staged(plan: Plan) -> Plan:
        plan = host_staged(plan) if host else plan
        return detached(plan) if detach and (plan.op != "all_gather_matmul" or not plan.n_weights) else plan

    def split(block_rows: int) -> int:
        if not host:
            return 1
        return host_split(block_rows * cols * itemsize, piece_bytes, host_most_pieces(world, most_pieces))

    grouped = host and schedule == "direct"  # see grouped_pulls
    if op == "all_gather_matmul":
        return (staged(all_gather_plan(schedule, world, rank, rows, matmuls, split(rows),
                                       0 if host else group_rows, grouped)),)
    if op == "matmul_reduce_scatter":
        return (staged(reduce_scatter_plan(schedule, world, rank, rows // world, split(rows // world))),)
    if op != "matmul_all_reduce":
        raise ValueError(f"unknown fused operator {op!r}")
    chunks = all_reduce_pull_chunks(schedule, world, rows, rows * cols * itemsize, host, piece_bytes, most_pieces)
    if chunks and host and world == 2:
        return (staged(all_reduce_pair_plan(rank, rows, chunks)),)
    if chunks:
        return (staged(all_reduce_plan(world, rank, rows, chunks, grouped)),)
    return (stream_plans("matmul_reduce_scatter", schedule, world, rank, rows, cols, 1, itemsize, host,
                         piece_bytes, detach, most_pieces=most_pieces)
            + stream_plans("all_gather_matmul", schedule, world, rank, rows // world, cols, 0, itemsize, host,
                           piece_bytes, detach, most_pieces=most_pieces))


def all_reduce_pull_chunks(schedule: str, world: int, rows: int, out_bytes: int, host: bool,
                           piece_bytes: int = HOST_PIECE_BYTES, most_pieces: int = 0) -> int:
    """Chunks of a fused all-reduce by direct pulls, or 0: the ring schedules (and row counts no
    chunk count splits) run the fused reduce-scatter, then the all-gather, on the same schedule."""
    if schedule != "direct":
        return 0
    if host:
        return host_all_reduce_chunks(rows, world, out_bytes, piece_bytes, most_pieces)
    return all_reduce_chunks(rows, world, out_bytes=out_bytes)


def fenced(plan: Plan) -> Plan:
    """``plan`` for one set of symmetric buffers instead of two: a call publishes into them only
    after every peer has finished reading them in the previous call.

    Why: a call captured in a CUDA graph replays with the addresses it was captured with, so the
    epoch's parity cannot pick the buffer (see the double-buffering argument above).  Each rank
    sets one more flag, ``done``, to the call's epoch once its last pull is complete; before its
    first write into a symmetric buffer (on each stream that writes one) a rank waits until every
    peer's ``done`` has reached the previous call.  The argument for deadlock-freedom is
    unchanged: the fence waits only for an earlier call's flag, which its owner sets
    unconditionally once that call's pulls are done.  This is the fence for one set of buffers;
    the CUDA path may keep two (``COMPASS_FUSED_GRAPH_BUFFERS=2``) and then waits, on the device,
    only for the last call that used the same set (:mod:`.cuda.graph_flags`), which is never
    later than the previous call."""
    if plan.world_size == 1:
        return plan
    reads = [i for i, c in enumerate(plan.commands) if isinstance(c, Copy) and c.src.owner != SELF]
    if not reads:
        raise ValueError(f"{plan.op}: a plan that reads no peer's buffer needs no fence")
    streams = {plan.commands[i].stream for i in reads}
    if len(streams) > 1:
        raise ValueError(f"{plan.op}: pulls on several streams ({sorted(streams)}); the fence needs them on one")
    done = plan.n_flags
    peers = [p for p in range(plan.world_size) if p != plan.rank]
    cmds: list[Command] = []
    fenced_streams: set[str] = set()
    for i, cmd in enumerate(plan.commands):
        dst = getattr(cmd, "dst", None)
        writes = (dst is not None and dst.owner == SELF and dst.buf in plan.symmetric_rows)
        if writes and cmd.stream not in fenced_streams:
            cmds += [WaitFlag(cmd.stream, p, done, delta=-1) for p in peers]
            fenced_streams.add(cmd.stream)
        cmds.append(cmd)
        if i == reads[-1]:
            cmds.append(SetFlag(cmd.stream, done))
    return replace(plan, commands=tuple(cmds), n_flags=plan.n_flags + 1,
                   slot_names=plan.slot_names + ("end of its reads of the previous call",))


def join_start(plan: Plan) -> int:
    """Index of the plan's join: the trailing waits of the caller's stream for the side streams.
    Everything before it can be issued and left running; the join is what makes the results
    visible to the caller's later work."""
    at = len(plan.commands)
    while at and isinstance(plan.commands[at - 1], WaitEvent) and plan.commands[at - 1].stream == MAIN:
        at -= 1
    return at


def detached(plan: Plan) -> Plan:
    """``plan`` with the caller's stream freed of every wait for communication before the join.

    The caller's stream keeps the GEMMs (and the flags and events that publish their products);
    each stretch of its commands that starts by waiting for another stream (a pull, before
    summing the pulled partials) moves, in order, to a fourth stream ``TAIL``, which first waits
    for the caller's stream to reach that point.  So the caller's stream is free as soon as its
    last GEMM is issued: work that does not need the result (a weight gradient beside an input
    gradient's all-reduce) runs while the pieces travel and are summed, and the caller joins
    ``TAIL`` with the other side streams at the end (:func:`join_start`).

    Nothing new can deadlock: ``TAIL`` waits only for events of its own rank recorded earlier in
    issue order (as the caller's stream did), and every command keeps its place in the order of
    the stream it ran on, so every dependency of the original plan still holds."""
    join = join_start(plan)
    recorded_on: dict[str, str] = {}
    cmds: list[Command] = []
    in_tail, gates = False, 0
    for cmd in plan.commands[:join]:
        if cmd.stream == MAIN:
            if isinstance(cmd, Matmul):
                if in_tail and cmd.src.buf != "A":
                    raise ValueError(f"{plan.op}: {cmd} multiplies rows that a wait for another stream guards; "
                                     "only GEMMs of the call's own input can run ahead of the pulls")
                in_tail = False
            elif isinstance(cmd, WaitEvent) and recorded_on.get(cmd.event, MAIN) != MAIN and not in_tail:
                gate = f"tailgate{gates}"
                gates += 1
                cmds += [Record(MAIN, gate), WaitEvent(TAIL, gate)]
                in_tail = True
            if in_tail:
                cmd = replace(cmd, stream=TAIL)
        if isinstance(cmd, Record):
            recorded_on[cmd.event] = cmd.stream
        cmds.append(cmd)
    if not gates:
        return plan
    cmds += [Record(TAIL, "tailed"), *plan.commands[join:], WaitEvent(MAIN, "tailed")]
    return replace(plan, commands=tuple(cmds))
