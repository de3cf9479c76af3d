"""The picture of the model's timelines (``cost.timeline``): one row per view, a compute and a
communication lane each, drawn with matplotlib (optional dependency: ``pip install
compass-fx[plot]``)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..cost.timeline import COMM, COMPUTE, Segment


def plot_timelines(views: Sequence[tuple[str, list[Segment], float]], path: "str | Path", title: str = "") -> Path:
    """One row per view ``(name, segments, predicted seconds)``, with a compute and a communication
    lane, titled with the prediction (the figure the plan's table gives); writes a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("the timeline picture needs matplotlib: pip install 'compass-fx[plot]'") from exc
    fig, axes = plt.subplots(len(views), 1, figsize=(12, 1.2 + 1.1 * len(views)), sharex=True, squeeze=False)
    labels = list(dict.fromkeys(s.label for _, segs, _ in views for s in segs))
    cmap = plt.get_cmap("tab10")
    colors = {l: cmap(i % 10) for i, l in enumerate(labels)}
    for ax, (name, segs, predicted) in zip(axes[:, 0], views):
        for s in segs:
            y = 1 if s.lane == COMPUTE else 0
            ax.barh(y, (s.end - s.start) * 1e3, left=s.start * 1e3, height=0.7,
                    color=colors[s.label], edgecolor="black", linewidth=0.3)
        ax.set_yticks([0, 1], [COMM, COMPUTE])
        ax.set_title(f"{name}: {predicted * 1e3:.2f} ms", fontsize=9, loc="left")
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
