"""Run the fused operators' plans for several ranks on the CPU, under random interleavings.

A model of the GPUs that is strict where the hardware is loose: every stream of every rank is a
queue of commands (or, with ``one_queue``, all of a rank's streams are one queue in issue
order, as when the GPU feeds them through one hardware queue), and at each step one runnable
command (or one rank's host issuing its next call) is picked at random, so a rank's host, or one
of its streams, can fall arbitrarily far behind the others.  Every row of a symmetric buffer
carries the epoch of the call that wrote it, and every read checks it: a read of stale data, or
of data a fast peer already overwrote for a later call, raises :class:`ProtocolViolation` at once.  A state in which work remains and nothing
can run raises :class:`Deadlock`.  The results are compared with plain matmuls and sums.  With
``coded``, every evaluation of a flag wait also checks that the eager CUDA path's coded flags
(:mod:`.flag_codes`: the epoch as one bit of four) would decide it as the epoch does.

The plans are :mod:`.protocol`'s, the same objects the CUDA implementation executes.  The data
are NumPy arrays (the calls' tensors are seen through ``Tensor.numpy()``, so results land in them):
a slice or a copy of a small array costs NumPy a tenth of what it costs torch, and the commands'
slices and copies were half of a simulation's time.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from . import flag_codes
from .protocol import (MAIN, SELF, STREAMS, Copy, Matmul, Plan, Record, Reduce, Region, SetFlag,
                       WaitEvent, WaitFlag)


class Deadlock(RuntimeError):
    """Work remains and no command of any rank can run."""


class ProtocolViolation(RuntimeError):
    """A rank read data written for another call."""


@dataclass
class _Call:
    epoch: int
    tensors: dict[str, list[np.ndarray]]  # the call's tensors, seen as arrays (writes land in the tensors)


@dataclass
class RankState:
    """One simulated GPU: flags, double-buffered symmetric and private buffers (with per-row epoch
    tags), scratch, stream queues and recorded events."""

    rank: int
    flags: list[int]
    symmetric: dict[str, list[np.ndarray]]
    tags: dict[str, list[list[int]]]  # per buffer and parity, the epoch that wrote each row
    stage: list[np.ndarray]
    # per stream, the queued commands: (call, command, its handler)
    queues: dict[str, deque[tuple[_Call, object, Callable]]] = field(default_factory=lambda: {s: deque() for s in STREAMS})
    events: dict[str, int] = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)  # free for extra command handlers


Handler = Callable[["Simulator", RankState, object, _Call], bool]


class Simulator:
    """Several ranks running ``plans`` (one per rank) call after call."""

    def __init__(self, plans: list[Plan], cols: int, seed: int = 0,
                 handlers: dict[type, Handler] | None = None, buffers: int = 2, one_queue: bool = False,
                 parity: Callable[[int], int] | None = None, coded: bool = False) -> None:
        self.plans = plans
        self.coded = coded  # check each flag wait against the eager path's coded flags (flag_codes)
        # which buffer call e uses: e % buffers, as eager calls alternate; a CUDA graph's replays
        # repeat the parities they were captured with, so two calls in a row may share one
        self.parity = parity or (lambda epoch: epoch % buffers)
        self.one_queue = one_queue  # every stream of a rank on one queue, in issue order (shared hardware queues)
        self.buffers = buffers  # 2: double-buffered by the epoch's parity, as on the GPU
        self.world = len(plans)
        self.rng = random.Random(seed)
        self.handlers = {WaitFlag: _wait_flag, SetFlag: _set_flag, Copy: _copy, Matmul: _matmul,
                         Reduce: _reduce, Record: _record, WaitEvent: _wait_event, **(handlers or {})}
        p = plans[0]
        rows = {**p.symmetric_rows, **p.private_rows}
        self.ranks = [RankState(
            r, [0] * p.n_flags,
            {b: [np.zeros((n, cols)) for _ in range(2)] for b, n in rows.items()},
            {b: [[0] * n for _ in range(2)] for b, n in rows.items()},
            [np.zeros((p.stage_rows, cols)) for _ in range(p.stage_slots)])
            for r in range(self.world)]
        # what issuing a call queues, per rank: (stream, command, its handler), looked up once
        self._issues = [[(MAIN if one_queue else cmd.stream, cmd, self.handlers[type(cmd)]) for cmd in plan.commands]
                        for plan in plans]
        # the (queue, rank) pairs of the queues that hold commands, in rank then stream order; None
        # after a queue filled or emptied (rebuilt then; most steps leave every queue's emptiness as it was)
        self._queued: list[tuple[deque, RankState]] | None = None

    # -- driving ---------------------------------------------------------------------------
    def run(self, calls: list[list[dict[str, list[torch.Tensor]]]], lateness: float = 0.5) -> None:
        """``calls[e][rank]`` holds that rank's tensors for call ``e + 1`` (A, W, OUT, GATHERED).

        Each step runs one runnable stream command or lets one host issue its next call; a host
        that could issue passes its turn with probability ``lateness`` while other work can run."""
        issued = [0] * self.world
        n = len(calls)
        draw = self.rng.random
        self._queued = None
        while True:
            queued = self._queued
            if queued is None:  # an issue or a queue emptied: the hosts with calls left may have changed too
                hosts = [st for st in self.ranks if issued[st.rank] < n]
                queued = self._queued = [(st.queues[s], st) for st in self.ranks for s in STREAMS if st.queues[s]]
            actions = queued.copy()  # _step_any reorders its list
            for st in hosts:
                if draw() > lateness:
                    actions.append((None, st))
            if not self._step_any(actions, issued, calls):
                if hosts:
                    self._issue(self.rng.choice(hosts), issued, calls)
                elif self._busy():
                    raise Deadlock(self._describe())
                else:
                    return

    def _step_any(self, actions: list, issued: list[int], calls) -> bool:
        """Run the first action that can run (a queue's head, or a host's issue where the queue is
        None), trying ``actions`` in a uniformly random order: the action run is uniform among the
        runnable ones, as after a shuffle, but an order is drawn only as far as it is tried (a
        shuffle of every action at every step was most of a simulation's time)."""
        draw, left = self.rng.random, len(actions)
        while left:
            i = int(draw() * left)
            queue, st = actions[i]
            if queue is None:
                self._issue(st, issued, calls)
                return True
            call, cmd, handler = queue[0]
            if handler(self, st, cmd, call):
                queue.popleft()
                if not queue:
                    self._queued = None
                return True
            left -= 1
            actions[i] = actions[left]
        return False

    def _issue(self, st: RankState, issued: list[int], calls) -> None:
        """Rank ``st``'s host issues its next call: every command of its plan joins its stream's queue."""
        e = issued[st.rank]
        call = _Call(e + 1, {name: [t.numpy() for t in tensors] for name, tensors in calls[e][st.rank].items()})
        queues = st.queues
        for stream, cmd, handler in self._issues[st.rank]:
            queues[stream].append((call, cmd, handler))
        issued[st.rank] += 1
        self._queued = None

    def _busy(self) -> bool:
        return any(st.queues[s] for st in self.ranks for s in STREAMS)

    def _describe(self) -> str:
        heads = [f"rank {st.rank} {s}: call {st.queues[s][0][0].epoch} {st.queues[s][0][1]}"
                 for st in self.ranks for s in STREAMS if st.queues[s]]
        flags = [f"rank {st.rank} flags {st.flags}" for st in self.ranks]
        return "no command can run:\n  " + "\n  ".join(heads + flags)

    # -- addressing ------------------------------------------------------------------------
    def view(self, st: RankState, region: Region, call: _Call, *, reading: bool) -> np.ndarray:
        owner = self.ranks[st.rank if region.owner == SELF else region.owner]
        if region.owner != SELF and region.buf not in self.plans[owner.rank].symmetric_rows:
            raise ProtocolViolation(f"rank {st.rank} addresses a peer's private buffer {region}")
        if region.buf in owner.symmetric:
            parity = self.parity(call.epoch)
            tags, start, stop = owner.tags[region.buf][parity], region.start, region.stop
            if reading:
                if tags[start:stop].count(call.epoch) != stop - start:
                    raise ProtocolViolation(
                        f"rank {st.rank}, call {call.epoch}: {region} holds data of calls {sorted(set(tags[start:stop]))}")
            else:
                tags[start:stop] = [call.epoch] * (stop - start)
            return owner.symmetric[region.buf][parity][region.start:region.stop]
        if region.buf == "STAGE":
            return st.stage[region.index][:region.rows]
        tensor = call.tensors[region.buf][region.index]
        return tensor[region.start:region.stop]


def _wait_flag(sim: Simulator, st: RankState, cmd: WaitFlag, call: _Call) -> bool:
    target = call.epoch + cmd.delta
    value = sim.ranks[cmd.peer].flags[cmd.slot]
    released = target < 1 or value >= target
    if sim.coded and target >= 1:
        if value and not target - 1 <= value <= target + 1:
            raise ProtocolViolation(f"rank {st.rank}, call {call.epoch}: waits for rank {cmd.peer}'s flag "
                                    f"{cmd.slot} to reach {target} while it holds {value}: outside the window "
                                    "that coded flags tell apart (flag_codes)")
        if flag_codes.satisfied(flag_codes.code(value) if value else 0, target) != released:
            raise ProtocolViolation(f"rank {st.rank}, call {call.epoch}: the coded flag {value} decides the wait "
                                    f"for {target} otherwise than the epoch")
    return released


def _set_flag(sim: Simulator, st: RankState, cmd: SetFlag, call: _Call) -> bool:
    if st.flags[cmd.slot] > call.epoch:
        raise ProtocolViolation(f"rank {st.rank} flag {cmd.slot} would go back from {st.flags[cmd.slot]} "
                                f"to {call.epoch}")
    st.flags[cmd.slot] = call.epoch
    return True


def _copy(sim: Simulator, st: RankState, cmd: Copy, call: _Call) -> bool:
    src = sim.view(st, cmd.src, call, reading=True)
    sim.view(st, cmd.dst, call, reading=False)[...] = src  # NumPy copies through a buffer where the two overlap
    return True


def _matmul(sim: Simulator, st: RankState, cmd: Matmul, call: _Call) -> bool:
    src = sim.view(st, cmd.src, call, reading=True)
    w = call.tensors["W"][cmd.weight]
    sim.view(st, cmd.dst, call, reading=False)[...] = src @ w
    return True


def _reduce(sim: Simulator, st: RankState, cmd: Reduce, call: _Call) -> bool:
    first, *rest = cmd.srcs
    total = sim.view(st, first, call, reading=True).copy()  # every term read before the sum is written
    for src in rest:
        total += sim.view(st, src, call, reading=True)
    sim.view(st, cmd.dst, call, reading=False)[...] = total
    return True


def _record(sim: Simulator, st: RankState, cmd: Record, call: _Call) -> bool:
    st.events[cmd.event] = call.epoch
    return True


def _wait_event(sim: Simulator, st: RankState, cmd: WaitEvent, call: _Call) -> bool:
    return st.events.get(cmd.event, 0) >= call.epoch
