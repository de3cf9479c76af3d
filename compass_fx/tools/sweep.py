"""The planning grid of the paper's evaluation: pair kinds x token counts x group sizes x model
widths x topologies (3 x 4 x 3 x 2 x 4 = 288 configurations by default), each planned with every
strategy, written as CSV with a summary of which strategy wins where."""
from __future__ import annotations

import csv
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Callable, Iterable, Sequence

from ..cost.decision import SCHEDULES
from ..cost.layer import model_shape
from ..cost.select import plan
from ..cost.workload import PAIR_KINDS, Workload
from ..machine.topology import Topology

DEFAULT_TOPOLOGIES = ("a6000-nvlink-pairs-pcie-8", "h100-nvswitch-8", "a100-pcie-8", "rtx4090-pcie-8")
DEFAULT_TOKENS = (2048, 4096, 8192, 16384)
DEFAULT_GROUPS = (2, 4, 8)
DEFAULT_MODELS = ("llama3-8b", "llama3-70b")

FIELDS = ("topology", "model", "kind", "tokens", "group_size", "m", "n", "k", "winner", "family",
          "predicted_s", "sequential_s", "speedup", "best_decompose", "best_decompose_s", "best_fuse",
          "best_fuse_s", "d_star")


def grid_workload(kind: str, model: str, tokens: int, group_size: int, dtype: str = "bfloat16",
                  cuda_graphs: bool = False, parts_replayed: bool = False) -> Workload:
    """The MLP pair of ``kind`` for a model width: all_gather_matmul is w1 (m x ffn/g x hidden),
    the other two w2 (m x hidden x ffn/g); ``cuda_graphs``: replayed as CUDA graphs;
    ``parts_replayed``: an eager step replays a decomposed gather's parts from one graph."""
    s = model_shape(model)
    ffn = s.ffn // group_size
    if kind == "all_gather_matmul":
        return Workload(kind, tokens, ffn, s.hidden, dtype, group_size, cuda_graphs=cuda_graphs,
                        parts_replayed=parts_replayed)
    return Workload(kind, tokens, s.hidden, ffn, dtype, group_size, cuda_graphs=cuda_graphs)


@dataclass(frozen=True)
class SweepConfig:
    topologies: Sequence[str] = DEFAULT_TOPOLOGIES
    models: Sequence[str] = DEFAULT_MODELS
    kinds: Sequence[str] = PAIR_KINDS
    tokens: Sequence[int] = DEFAULT_TOKENS
    group_sizes: Sequence[int] = DEFAULT_GROUPS
    fused_schedules: tuple[str, ...] | None = SCHEDULES
    cuda_graphs: bool = False  # price every pair as a CUDA graph replay (no host issue costs)
    parts_replayed: bool = False  # price an eager gather's extra parts as replayed from one graph

    def size(self) -> int:
        return len(self.topologies) * len(self.models) * len(self.kinds) * len(self.tokens) * len(self.group_sizes)


def _family(label: str) -> str:
    return label.split("(")[0] if label.startswith("decompose") else label


def run_sweep(config: SweepConfig, progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """One row per configuration (see ``FIELDS``), in a fixed order."""
    topos = {name: Topology.resolve(name) for name in config.topologies}
    rows = []
    total = config.size()
    for i, (tname, model, kind, tokens, g) in enumerate(product(config.topologies, config.models, config.kinds,
                                                                config.tokens, config.group_sizes)):
        w = grid_workload(kind, model, tokens, g, cuda_graphs=config.cuda_graphs,
                          parts_replayed=config.parts_replayed)
        decision = plan(w, topos[tname], fused_schedules=config.fused_schedules)
        decs = [c for c in decision.candidates if c.strategy == "decompose"]
        fuses = [c for c in decision.candidates if c.strategy == "fuse"]
        best_dec = min(decs, key=lambda c: c.seconds) if decs else None
        best_fuse = min(fuses, key=lambda c: c.seconds) if fuses else None
        seq = decision.candidate("sequential").seconds
        rows.append({
            "topology": tname, "model": model, "kind": kind, "tokens": tokens, "group_size": g,
            "m": w.m, "n": w.n, "k": w.k, "winner": decision.label, "family": _family(decision.label),
            "predicted_s": decision.predicted_s, "sequential_s": seq, "speedup": seq / decision.predicted_s,
            "best_decompose": best_dec.label if best_dec else "", "best_decompose_s": best_dec.seconds if best_dec else "",
            "best_fuse": best_fuse.label if best_fuse else "", "best_fuse_s": best_fuse.seconds if best_fuse else "",
            "d_star": decision.d_star if decision.d_star is not None else "",
        })
        if progress:
            progress(i + 1, total)
    return rows


def write_csv(rows: Iterable[dict], path: "str | Path") -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)


def summarize(rows: Sequence[dict]) -> dict:
    """Per topology (and per topology and kind): wins by strategy family, speedup range."""
    out: dict = {"configurations": len(rows), "topologies": {}}
    by_topo: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_topo[r["topology"]].append(r)
    for tname, rs in by_topo.items():
        speedups = [r["speedup"] for r in rs]
        kinds = {}
        for kind in dict.fromkeys(r["kind"] for r in rs):
            ks = [r for r in rs if r["kind"] == kind]
            kinds[kind] = {"wins": dict(Counter(r["family"] for r in ks).most_common()),
                           "speedup_min": min(r["speedup"] for r in ks), "speedup_max": max(r["speedup"] for r in ks)}
        out["topologies"][tname] = {
            "wins": dict(Counter(r["family"] for r in rs).most_common()),
            "speedup_min": min(speedups), "speedup_median": statistics.median(speedups), "speedup_max": max(speedups),
            "by_kind": kinds,
        }
    all_speedups = [r["speedup"] for r in rows]
    if all_speedups:
        out["speedup_min"], out["speedup_max"] = min(all_speedups), max(all_speedups)
        out["wins"] = dict(Counter(r["family"] for r in rows).most_common())
    return out


def format_summary(summary: dict) -> str:
    lines = [f"{summary['configurations']} configurations; predicted speedup over sequential "
             f"{summary.get('speedup_min', 1):.2f}x-{summary.get('speedup_max', 1):.2f}x; wins: {summary.get('wins', {})}"]
    for tname, t in summary["topologies"].items():
        lines.append(f"{tname}: wins {t['wins']}, speedup {t['speedup_min']:.2f}x-{t['speedup_max']:.2f}x "
                     f"(median {t['speedup_median']:.2f}x)")
        for kind, k in t["by_kind"].items():
            lines.append(f"  {kind:22s} wins {k['wins']}, speedup {k['speedup_min']:.2f}x-{k['speedup_max']:.2f}x")
    return "\n".join(lines)


def progress_bar(stream=sys.stderr, width: int = 40) -> Callable[[int, int], None]:
    """A dependency-free progress bar: redrawn in place on a terminal; in a log (stderr not a
    terminal) one plain line per quarter, so no carriage returns end up in the file."""
    shown = [-1]
    live = hasattr(stream, "isatty") and stream.isatty()

    def update(done: int, total: int) -> None:
        steps = width if live else 4
        filled = steps * done // max(total, 1)
        if filled == shown[0] and done != total:
            return
        shown[0] = filled
        if live:
            stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}" + ("\n" if done == total else ""))
        elif done == total or filled > 0:
            stream.write(f"sweep: {done}/{total} configurations planned\n")
        stream.flush()
    return update
