"""Timelines of the model's predictions: what runs on the compute lane and on the communication
lane, per strategy, and a matplotlib picture of them (optional dependency: ``pip install
compass-fx[plot]``).  The segments come from the same per-part figures the predictions use; a
decomposed pipeline is drawn from its per-part collective and GEMM times, so its end can differ a
little from the three-term T(d)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .decision import Candidate
from .strategies import decompose_part_seconds, fused_breakdown, nccl_time, sequential_seconds
from .topology import Topology
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


def candidate_segments(w: Workload, topo: Topology, c: Candidate) -> list[Segment]:
    """The lanes of one candidate, starting at 0."""
    gather = w.kind == "all_gather_matmul"
    if c.strategy == "sequential" or w.group_size == 1:
        comm = nccl_time(w, topo).seconds if w.group_size > 1 else 0.0
        gemm = sequential_seconds(w, topo) - comm
        if gather:
            return [Segment(COMM, 0, comm), Segment(COMPUTE, comm, comm + gemm)]
        return [Segment(COMPUTE, 0, gemm), Segment(COMM, gemm, gemm + comm)]
    if c.strategy == "decompose":
        d = c.parts
        comm, g = decompose_part_seconds(w, topo, d)
        segs, comm_end, gemm_end = [], 0.0, 0.0
        for i in range(d):
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
        moving, piece = fb.steps_s[0], fb.chunk_gemm_s
        if gather:  # every row but the last piece's, then that piece once it has arrived
            rest = fb.gemm_s - piece
            return [Segment(COMM, 0, moving), Segment(COMPUTE, 0, rest),
                    Segment(COMPUTE, max(moving, rest), max(moving, rest) + piece, "last")]
        return [Segment(COMPUTE, 0, piece, "first"), Segment(COMPUTE, piece, fb.gemm_s),
                Segment(COMM, piece, piece + moving)]
    segs, t = [], 0.0
    if not gather:
        segs.append(Segment(COMPUTE, 0, fb.chunk_gemm_s))
        t = fb.chunk_gemm_s
    for i, s in enumerate(fb.steps_s):
        segs += [Segment(COMPUTE, t, t + fb.chunk_gemm_s, f"{i}"), Segment(COMM, t, t + s, f"{i}")]
        t += max(fb.chunk_gemm_s, s)
    if gather:
        segs.append(Segment(COMPUTE, t, t + fb.chunk_gemm_s))
        t += fb.chunk_gemm_s
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


def plot_timelines(views: Sequence[tuple[str, list[Segment]]], path: "str | Path", title: str = "") -> Path:
    """One row per view, with a compute and a communication lane; writes a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the timeline picture needs matplotlib: pip install 'compass-fx[plot]'") from exc
    fig, axes = plt.subplots(len(views), 1, figsize=(12, 1.2 + 1.1 * len(views)), sharex=True, squeeze=False)
    labels = list(dict.fromkeys(s.label for _, segs in views for s in segs))
    cmap = plt.get_cmap("tab10")
    colors = {l: cmap(i % 10) for i, l in enumerate(labels)}
    for ax, (name, segs) in zip(axes[:, 0], views):
        for s in segs:
            y = 1 if s.lane == COMPUTE else 0
            ax.barh(y, (s.end - s.start) * 1e3, left=s.start * 1e3, height=0.7,
                    color=colors[s.label], edgecolor="black", linewidth=0.3)
        end = max((s.end for s in segs), default=0.0)
        ax.set_yticks([0, 1], [COMM, COMPUTE])
        ax.set_title(f"{name}: {end * 1e3:.3f} ms", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("predicted time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[l]) for l in labels if l and not l.isdigit()]
    if handles:
        fig.legend(handles, [l for l in labels if l and not l.isdigit()], loc="upper right", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
