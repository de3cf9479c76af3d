"""Timelines of the model's predictions: what runs on the compute lane and on the communication
lane, per strategy (``tools.timeline_plot`` draws them).  The segments come from the same
per-part figures the predictions use; a decomposed pipeline is drawn from its per-part collective
and GEMM times, so its end can differ a little from the three-term T(d)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..machine.topology import Topology
from .decision import Candidate
from .strategies import decompose_part_seconds, fused_breakdown, nccl_time, sequential_seconds
from .workload import Workload

COMPUTE, COMM = "compute", "comm"


@dataclass(frozen=True)
class Segment:
    lane: str
    start: float
    end: float
    label: str = ""


def _shift(segments: list[Segment], offset: float, label: str) -> list[Segment]:
    return [Segment(s.lane, s.start + offset, s.end + offset, label or s.label) for s in segments]


OTHER = "other"  # what a price holds beyond the lanes drawn: a fused call's setup and host floor, grouped GEMMs


def candidate_segments(w: Workload, topo: Topology, c: Candidate) -> list[Segment]:
    """The lanes of one candidate, starting at 0; where the candidate's price is longer than the
    lanes drawn, a segment labelled ``other`` on the compute lane takes the rest, so the drawing
    ends where the price does (a decomposition's lanes may end a little after its T(d))."""
    segments = _lanes(w, topo, c)
    end = max((s.end for s in segments), default=0.0)
    if c.seconds is not None and c.seconds > end * (1 + 1e-9):
        segments.append(Segment(COMPUTE, end, c.seconds, OTHER))
    return segments


def _lanes(w: Workload, topo: Topology, c: Candidate) -> list[Segment]:
    gather = w.kind == "all_gather_matmul"
    if c.strategy == "sequential" or w.group_size == 1:
        comm = nccl_time(w, topo).seconds if w.group_size > 1 else 0.0
        gemm = sequential_seconds(w, topo) - comm
        if gather:
            return [Segment(COMM, 0, comm), Segment(COMPUTE, comm, comm + gemm)]
        return [Segment(COMPUTE, 0, gemm), Segment(COMM, gemm, gemm + comm)]
    if c.strategy == "decompose":
        comm, g = decompose_part_seconds(w, topo, c.parts)
        segs, comm_end, gemm_end = [], 0.0, 0.0
        for i in range(c.parts):
            if gather:
                c0 = comm_end
                comm_end = c0 + comm
                g0 = max(comm_end, gemm_end)
                gemm_end = g0 + g
                segs += [Segment(COMM, c0, comm_end, f"{i}"), Segment(COMPUTE, g0, gemm_end, f"{i}")]
            else:
                g0 = gemm_end
                gemm_end = g0 + g
                c0 = max(gemm_end, comm_end)
                comm_end = c0 + comm
                segs += [Segment(COMPUTE, g0, gemm_end, f"{i}"), Segment(COMM, c0, comm_end, f"{i}")]
        return segs
    fb = fused_breakdown(w, topo, c.schedule or "ring")
    if fb.host_staged:  # one pipelined transfer through host memory beside the whole GEMM
        moving, piece = fb.steps_s[0], fb.piece_gemm_s
        if gather:  # every row but the last piece's, then that piece once it has arrived
            rest = fb.gemm_s - piece
            return [Segment(COMM, 0, moving), Segment(COMPUTE, 0, rest),
                    Segment(COMPUTE, max(moving, rest), max(moving, rest) + piece, "last")]
        return [Segment(COMPUTE, 0, piece, "first"), Segment(COMPUTE, piece, fb.gemm_s),
                Segment(COMM, piece, piece + moving)]
    segs, t = [], 0.0
    if not gather:
        segs.append(Segment(COMPUTE, 0, fb.piece_gemm_s))
        t = fb.piece_gemm_s
    for i, s in enumerate(fb.steps_s):
        segs += [Segment(COMPUTE, t, t + fb.piece_gemm_s, f"{i}"), Segment(COMM, t, t + s, f"{i}")]
        t += max(fb.piece_gemm_s, s)
    if gather:
        segs.append(Segment(COMPUTE, t, t + fb.piece_gemm_s))
        t += fb.piece_gemm_s
    if w.kind == "matmul_all_reduce":
        for s in fb.steps_s:
            segs.append(Segment(COMM, t, t + s, "ag"))
            t += s
    return segs


def sequence(pairs: Sequence[tuple[str, list[Segment]]]) -> list[Segment]:
    """Pairs one after another, each segment labelled with its pair's name."""
    out, t = [], 0.0
    for name, segs in pairs:
        out += _shift(segs, t, name)
        t = max([t] + [s.end + t for s in segs])
    return out
