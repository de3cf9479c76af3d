"""What this process's eager fused calls did: how many replayed a captured graph (and of those, how
many the C fast path issued), how many were issued command by command, and what each workspace keeps.

Why: an eager fused call replayed from its graph costs the host tens of microseconds, one issued
command by command hundreds (``docs/fused-operators.md``), and nothing outside says which a run
got.  A workspace keeps graphs for a bounded number of sets of addresses (a call site of one
operator and shape is a set: its weight, input and output); a step with more call sites than that
evicts each capture before it replays, and the workspace stops capturing (it warns once).  Read
after a few steps (a set is captured on its second call, a graph per residue of its epoch mod 4):

    print(compass_fx.fused_calls())

or one step's own, to see whether the run has settled (every call replayed, none captured):

    before = compass_fx.fused_calls(); train_step(); print(compass_fx.fused_calls().since(before))

Nothing here touches the GPU or loads the operators: it reads the counters the calls keep.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkspaceUse:
    """One workspace (an operator, its width, ranks and transport) and its replay graphs.
    ``deferred``: the graphs of its deferred calls (``fused_async``'s starts), kept apart."""

    op: str
    ranks: int
    columns: int
    transport: str
    deferred: bool
    sets: int  # sets of addresses it holds graphs for
    seen_once: int  # sets of addresses met once and not (yet) again: many, and addresses do not recur
    graphs: int  # graphs held (up to one per residue of a set's epoch mod 4)
    limit: int  # the sets it may hold (COMPASS_FUSED_REPLAY_GRAPHS)
    evicted: int  # sets evicted to make room
    stopped: bool  # stopped capturing: its sets were evicted before they replayed


@dataclass(frozen=True)
class FusedCalls:
    """The eager fused calls of this process so far (a ring all-reduce counts as its two parts)."""

    replayed: int  # served from a captured graph (a capture counts: the call ran as that graph)
    from_c: int  # of those, issued by the C fast path
    issued: int  # issued command by command from Python
    captured: int  # graphs captured
    replays_off: str  # why replays were turned off for the process (a capture failed), or ""
    workspaces: tuple[WorkspaceUse, ...]

    @property
    def calls(self) -> int:
        return self.replayed + self.issued

    @property
    def settled(self) -> bool:
        """Every call replayed and no graph captured: read over a step (:meth:`since`), a run that has
        warmed up."""
        return self.calls > 0 and self.issued == 0 and self.captured == 0

    def since(self, earlier: FusedCalls) -> FusedCalls:
        """The calls made after ``earlier`` was read, with the workspaces as they are now.

        Why: the process's totals keep its first steps, whose calls are issued from Python while the
        graphs are captured (up to seven steps at a depth that is odd), so they never read 100%;
        read one before a step and one after it, and the difference is that step's own
        (:attr:`settled` once every call replays and nothing is captured)."""
        counts = {name: getattr(self, name) - getattr(earlier, name)
                  for name in ("replayed", "from_c", "issued", "captured")}
        if min(counts.values()) < 0:
            raise ValueError("FusedCalls.since: `earlier` was read after this reading (its counts are larger)")
        return FusedCalls(**counts, replays_off=self.replays_off, workspaces=self.workspaces)

    def __str__(self) -> str:
        if not self.calls and not self.workspaces:
            return ("compass fused calls: no eager call of the CUDA fused operators in this process (on other devices "
                    "the reference schedules run, which keep no graphs)")
        share = f"{self.replayed / self.calls:.0%}" if self.calls else "-"
        lines = [f"compass fused calls: {self.calls} eager, {self.replayed} replayed ({share}; {self.from_c} from C), "
                 f"{self.issued} issued command by command; {self.captured} graphs captured"]
        if self.replays_off:
            lines.append(f"  replays are off in this process: {self.replays_off}")
        for w in self.workspaces:
            what = "deferred calls of " if w.deferred else ""
            stopped = "; STOPPED CAPTURING: raise COMPASS_FUSED_REPLAY_GRAPHS" if w.stopped else ""
            lines.append(f"  {what}{w.op} ({w.columns} columns, {w.ranks} ranks, {w.transport}): {w.sets} of "
                         f"{w.limit} sets, {w.graphs} graphs, {w.evicted} evicted, {w.seen_once} seen once{stopped}")
        return "\n".join(lines)


def fused_calls() -> FusedCalls:
    """This process's eager fused calls so far, and every workspace's replay graphs."""
    impl = sys.modules.get("compass_fx.kernels.cuda.impl")
    replay = sys.modules.get("compass_fx.kernels.cuda.replay")
    stats = replay.stats if replay is not None else {}
    workspaces = []
    for ws in (impl._workspaces.values() if impl is not None else ()):
        for deferred, replays in ((False, ws.replays), (True, getattr(getattr(ws, "apart", None), "replays", None))):
            if replays is None:
                continue
            workspaces.append(WorkspaceUse(
                op=ws.plan.op, ranks=ws.plan.world_size, columns=ws.cols, transport=ws.transport, deferred=deferred,
                sets=len(replays.graphs), seen_once=len(replays.seen), graphs=sum(g is not None for gs in replays.graphs.values() for g in gs),
                limit=replays.most, evicted=replays.evicted, stopped=replays.stopped))
    return FusedCalls(replayed=stats.get("replayed", 0), from_c=stats.get("lane", 0), issued=stats.get("issued", 0),
                      captured=stats.get("captured", 0),
                      replays_off="; ".join(replay._disabled) if replay is not None else "",
                      workspaces=tuple(workspaces))
