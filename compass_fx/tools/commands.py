"""The ``compass-fx`` subcommands of the performance framework: ``plan``, ``sweep``, ``calibrate``.

``add_subcommands(subparsers)`` registers them on the CLI's argparse subparsers; each sets
``func(args) -> int`` (the exit status).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli_args import positive_int, positive_ints
from ..cost.decision import SCHEDULES
from ..cost.layer import MODELS, format_layer_plan, plan_layer
from ..cost.select import fuses_by_default
from ..cost.workload import PAIR_KINDS
from ..machine.calibration import CALIBRATION_ENV, calibration_path
from ..machine.topology import Topology


def _names(choices: tuple[str, ...] | None = None):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if choices is not None and v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"expected names from {', '.join(choices or ())}, got {text!r}")
        return values
    return parse


def _schedules(text: str) -> tuple[str, ...]:
    if text in ("none", ""):
        return ()
    if text == "all":
        return SCHEDULES
    return _names(SCHEDULES)(text)


PARTS_REPLAYED_NOTE = ("a decomposed gather's extra parts priced as replayed from one CUDA graph, as an eager "
                       "step on NCCL runs them (COMPASS_PARTS_REPLAY=0: as issued)")


def parts_replayed(cuda_graphs: bool) -> bool:
    """Whether plan and sweep price an eager gather's extra parts as replayed (the compiler's
    default on NCCL, ``lowering.parts_replay``); not under CUDA graphs, which price no host issue."""
    from ..lowering import parts_replay

    return not cuda_graphs and parts_replay.enabled()


def provenance(fused: tuple[str, ...] | None, staged: bool = False, unpriced: str | None = None,
               replayed: bool = False) -> str:
    """Where the predictions come from, and what was priced: one line for the output.  ``staged``:
    some GPU group planned has no peer access (where 'auto' prices the fused operators by default);
    ``unpriced``: why the fused operators were left out, where something else than that decided;
    ``replayed``: a decomposed gather's extra parts priced as replayed (:func:`parts_replayed`)."""
    path = calibration_path()
    constants = (f"GPU constants from the calibration file {path}" if path is not None else
                 f"built-in GPU constants (datasheets; Hopper's GEMM constants fitted on one H200), not "
                 f"measured on this machine (run compass-fx calibrate "
                 f"on a GPU and set {CALIBRATION_ENV} to the file it writes)")
    if unpriced is not None:
        priced = unpriced
    elif fused is None and staged:
        priced = ("fused operators priced where the GPUs lack peer access (through host memory), as "
                  "strategy='auto' does by default; elsewhere not (--fused all to include them)")
    elif fused is None or not fused:
        priced = "fused operators not priced (as strategy='auto' by default with peer access; --fused all to include them)"
    else:
        priced = (f"fused operators priced ({', '.join(fused)}): with peer access strategy='auto' uses them "
                  f"only with auto_fuse=True")
    return f"note: {constants}; {priced}" + (f"; {PARTS_REPLAYED_NOTE}" if replayed else "")


def fused_under_graphs(fused: tuple[str, ...] | None, cuda_graphs: bool) -> tuple[tuple[str, ...] | None, str | None]:
    """The fused schedules to price and a note: priced as CUDA graph replays, 'auto' offers the
    fused operators only when the graphs can take them in (``COMPASS_FUSED_GRAPHS=1``); else
    each would split the graphs.  An explicit ``--fused`` is priced as asked."""
    from ..kernels.cuda import graphs_enabled

    if not cuda_graphs or fused is not None or graphs_enabled():
        return fused, None
    return (), ("fused operators not priced: under CUDA graphs 'auto' offers them only with "
                "COMPASS_FUSED_GRAPHS=1 (uncaptured, each would split the graphs; --fused all prices them anyway)")


def _topology(text: str) -> Topology:
    try:
        return Topology.resolve(text)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---- plan --------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from ..cost.decision import Candidate
    from ..cost.timeline import candidate_segments, sequence
    from ..cost.workload import Workload
    from .timeline_plot import plot_timelines

    topo = args.topology
    png = None if args.no_png else picture_path(args, topo)
    fused, graphs_note = fused_under_graphs(args.fused, args.cuda_graphs)
    replayed = parts_replayed(args.cuda_graphs)
    lp = plan_layer(args.model, args.tp, args.tokens, topo, dtype=args.dtype,
                    sequence_parallel=not args.no_sequence_parallel, backward=args.backward,
                    fused_schedules=fused, cuda_graphs=args.cuda_graphs, parts_replayed=replayed)
    if args.json:
        print(json.dumps({
            "model": lp.model, "tp": lp.tp, "tokens": lp.tokens, "topology": lp.topology,
            "cuda_graphs": args.cuda_graphs, "parts_replayed": replayed,
            "sequential_s": lp.sequential_s, "planned_s": lp.planned_s,
            "speedup": lp.speedup,
            "pairs": [{"name": name, "kind": w.kind, "m": w.m, "n": w.n, "k": w.k, "choice": decision.label,
                       "predicted_s": decision.predicted_s, "reason": decision.reason,
                       "candidates": {c.label: c.seconds for c in decision.candidates}}
                      for name, w, decision in lp.rows],
        }, indent=2))
    else:
        print(format_layer_plan(lp))
    print(f"compass-fx plan: {provenance(fused, fuses_by_default(topo, args.tp), graphs_note, replayed)}",
          file=sys.stderr)
    if args.cuda_graphs:
        print("compass-fx plan: priced as CUDA graph replays (no host issue costs)", file=sys.stderr)
    if args.no_png:
        return 0
    def view(name: str, picks: list[tuple[str, Workload, Candidate]]) -> tuple[str, list, float]:
        """A picture row: the picks' lanes one after another, titled with the sum of their prices
        (the table's figures; the lanes are the model's breakdown of each price)."""
        return (name, sequence([(n, candidate_segments(w, topo, c)) for n, w, c in picks]),
                sum(c.seconds for _, _, c in picks))

    views = [view("sequential", [(n, w, decision.candidate("sequential")) for n, w, decision in lp.rows])]
    for family in ("decompose", "fuse"):
        picks = []
        for n, w, decision in lp.rows:
            cands = [c for c in decision.candidates if c.strategy == family]
            if cands:
                picks.append((n, w, min(cands, key=lambda c: c.seconds)))
        if len(picks) == len(lp.rows):
            views.append(view(f"best {family} per pair", picks))
    views.append(view("planned", [(n, w, next(c for c in decision.candidates if c.label == decision.label))
                                  for n, w, decision in lp.rows]))
    try:
        path = plot_timelines(views, png, f"{args.model} tp={args.tp} tokens={args.tokens} on {topo.name}")
    except ImportError as exc:  # an optional extra: the table above is the result, the picture a bonus
        print(f"compass-fx plan: note: {exc} (picture skipped; --no-png silences this)", file=sys.stderr)
        return 0
    print(f"timeline: {path}", file=sys.stderr)
    return 0


def picture_path(args: argparse.Namespace, topo: Topology) -> Path:
    """Where ``plan`` draws its timeline: ``--png``, else a file named for the plan in ``--out-dir``;
    the folder is made (or found unwritable) before any planning, so a bad path fails first."""
    png = Path(args.png) if args.png else \
        Path(args.out_dir) / f"compass-plan-{args.model}-tp{args.tp}-{args.tokens}-{topo.name}.png"
    ensure_writable_dir(png.parent)
    return png


def ensure_writable_dir(path: Path) -> None:
    """Make ``path`` (and its parents) if needed; OSError naming it if it cannot hold new files."""
    import errno
    import os

    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, "not writable", str(path))


# ---- sweep -------------------------------------------------------------------------------------
def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import SweepConfig, format_summary, progress_bar, run_sweep, summarize, write_csv

    fused, graphs_note = fused_under_graphs(args.fused, args.cuda_graphs)
    config = SweepConfig(topologies=args.topologies, models=args.models, kinds=args.kinds, tokens=args.tokens,
                         group_sizes=args.group_sizes, fused_schedules=fused, cuda_graphs=args.cuda_graphs,
                         parts_replayed=parts_replayed(args.cuda_graphs))
    for name in config.topologies:
        Topology.resolve(name)
    out = Path(args.out_dir)
    ensure_writable_dir(out)
    rows = run_sweep(config, None if args.no_progress else progress_bar())
    summary = summarize(rows)
    write_csv(rows, out / "sweep.csv")
    (out / "sweep-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = format_summary(summary)
    (out / "sweep-summary.txt").write_text(text + "\n")
    print(text)
    staged = any(fuses_by_default(Topology.resolve(t), g) for t in config.topologies for g in config.group_sizes)
    print(f"compass-fx sweep: {provenance(fused, staged, graphs_note, config.parts_replayed)}", file=sys.stderr)
    if args.cuda_graphs:
        print("compass-fx sweep: priced as CUDA graph replays (no host issue costs)", file=sys.stderr)
    print(f"wrote {out / 'sweep.csv'}, {out / 'sweep-summary.json'}, {out / 'sweep-summary.txt'}", file=sys.stderr)
    return 0


# ---- calibrate ---------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    from ..machine.gpus import gpu_name_from_device

    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        print("compass-fx calibrate needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("compass-fx calibrate needs a CUDA GPU (it measures GEMMs on it); none is available", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name()
    gpu = args.gpu or gpu_name_from_device(device_name)
    if gpu is None:
        print(f"unknown GPU {device_name!r}: pass --gpu with one of the known names", file=sys.stderr)
        return 2
    collectives = _measure_collectives_if_launched(args)
    if collectives is False:
        return 2
    try:
        return _fit_and_write(args, gpu, device_name, collectives)
    finally:
        if collectives is not None:  # the group --collectives started under torchrun
            import torch.distributed as dist

            dist.destroy_process_group()


def _fit_and_write(args: argparse.Namespace, gpu: str, device_name: str, collectives: list | None) -> int:
    """Measure the GEMMs, InterDecom's part and the fused calls' host work; fit; rank 0 writes."""
    from ..cost.gemm_fit import fit_gpu_spec, model_errors
    from ..machine.calibration import gpu_spec, write_calibration
    from ..machine.gpus import with_overrides
    from .calibrate import grid_shapes, measure_fused_host, measure_gemms, measure_part_overhead

    base = gpu_spec(gpu)
    shapes = grid_shapes(tokens=(4096, 16384) if args.quick else (2048, 4096, 8192, 16384))
    meas = measure_gemms(shapes, (1, 2, 4, 8, 16, 32), device="cuda", progress=not args.quiet)
    before = model_errors(meas, base)
    fitted = fit_gpu_spec(meas, base)
    after = model_errors(meas, fitted)
    if not args.quiet:
        print("  measuring InterDecom's cost per extra part, as lowered ...", flush=True)
    decomposition = measure_part_overhead()
    if decomposition["device_s"] is not None:  # what the model charges a part under CUDA graphs
        fitted = with_overrides(fitted, graph_part_overhead_s=max(decomposition["device_s"], 0.0))
    extra = {"device": device_name, "measurements": len(meas), "fused_host": measure_fused_host(),
             "decomposition": decomposition}
    kept = _other_regimes_kept(args.out, device_name, collectives or [])  # a GEMM-only run keeps the tables
    if kept or collectives:
        extra["collectives"] = kept + (collectives or [])
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return 0  # every rank measured the same (agreed); rank 0 writes
    write_calibration(args.out, [fitted], extra)
    print(f"{device_name}: median error before {before['median_abs_error']:.3f} (ratios "
          f"{before['median_ratio_error']:.3f}), after {after['median_abs_error']:.3f} "
          f"(ratios {after['median_ratio_error']:.3f})")
    print(f"InterDecom: an extra part costs the device {decomposition['device_s'] * 1e6:.1f} us, the host's "
          f"issue {decomposition['issue_s'] * 1e6:.0f} us (the model charges the device's under CUDA graphs)")
    print(f"wrote {args.out}; use it with options={{'calibration': '{args.out}'}} or COMPASS_FX_CALIBRATION={args.out}")
    return 0


def _other_regimes_kept(path: str, device_name: str, tables: list[dict]) -> list[dict]:
    """The collective tables in an existing calibration file of the same GPU that ``tables`` does not
    measure again, so that one file can hold both regimes (run once with NCCL_P2P_DISABLE=1, once
    without) and a run without --collectives keeps them."""
    import json
    from pathlib import Path

    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict) or old.get("device") != device_name:
        return []
    measured = {(t["regime"], t["op"], t["group_size"]) for t in tables}
    return [t for t in old.get("collectives", [])
            if isinstance(t, dict) and (t.get("regime"), t.get("op"), t.get("group_size")) not in measured]


def _measure_collectives_if_launched(args: argparse.Namespace):
    """With --collectives under torchrun: NCCL over this machine's GPUs, tagged with the regime;
    None without --collectives; False (after a message) when there is no group to measure."""
    if not args.collectives:
        return None
    import os

    import torch
    import torch.distributed as dist

    from ..machine.detect import host_staged
    from ..machine.links import HOST_STAGED, PEER_TO_PEER
    from .calibrate import measure_collectives

    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("compass-fx calibrate --collectives runs one process per GPU: "
              "torchrun --nproc-per-node <GPUs> -m compass_fx.cli calibrate --collectives", file=sys.stderr)
        return False
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    regime = HOST_STAGED if host_staged() else PEER_TO_PEER
    tables = measure_collectives()
    for t in tables:
        t["regime"] = regime
    return tables


def cmd_prepare(args: argparse.Namespace) -> int:
    """Build the fused calls' host fast path ahead (``kernels/cuda/lane.cpp``): otherwise the first
    fused call of a machine's first run compiles it, ~20 s inside a training step.  No GPU needed;
    the build lands in torch's extension cache, where every later process loads it."""
    import time

    from ..kernels.cuda import lane

    cached = lane.is_cached()
    if not cached:  # the build gives no sign of life for its ~20 s
        print(f"building the host fast path (a C++ build on one core, about 20 s; once per torch version) in "
              f"{lane.build_directory()} ...", flush=True)
    started = time.perf_counter()
    try:
        lane.compile_module()
    except Exception as e:  # noqa: BLE001 - a missing compiler, headers or the like: say what, exit 4
        raise ImportError(f"the host fast path cannot be built here ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); fused calls take the Python path") from e
    took = "loaded from the cache" if cached else f"built in {time.perf_counter() - started:.0f} s"
    off = "; COMPASS_FUSED_LANE is off, so calls will not use it" if not lane.wanted() else ""
    print(f"host fast path {took}: {lane.build_directory()}{off}")
    return 0


def add_subcommands(subparsers: "argparse._SubParsersAction") -> None:
    """Register ``plan``, ``sweep``, ``calibrate`` and ``prepare`` on the CLI's subparsers."""
    p = subparsers.add_parser("plan", help="predict every strategy for each pair of one transformer layer",
                              description="Print the cost model's table for one TP transformer layer and draw "
                                          "a timeline of compute and communication lanes per strategy.",
                              allow_abbrev=False)
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-70b")
    p.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel group size")
    p.add_argument("--tokens", type=positive_int, default=8192,
                   help="tokens per step (batch x sequence): m of each pair")
    p.add_argument("--topology", type=_topology, default="h200-nvswitch-8",
                   help=f"a preset ({', '.join(Topology.presets())}) or a JSON/YAML file")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fused", type=_schedules, default=None,
                   help="fused schedules to price, comma-separated, 'all' or 'none' (default: as "
                        "strategy='auto': only where the GPUs lack peer access)")
    p.add_argument("--backward", action="store_true", help="also plan the backward pass's pairs")
    p.add_argument("--no-sequence-parallel", action="store_true", help="plain TP: all-reduce after row-parallel GEMMs")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="price the step as CUDA graph replays (Inductor's mode='reduce-overhead'): no host issue "
                        "costs, an extra InterDecom part costs its device time alone")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out-dir", default="compass-plan",
                   help="folder for the timeline picture (default: compass-plan, made if needed)")
    p.add_argument("--png", default=None, help="timeline picture path (default: <out-dir>/compass-plan-<...>.png)")
    p.add_argument("--no-png", action="store_true", help="skip the timeline picture")
    p.set_defaults(func=cmd_plan)

    from .sweep import DEFAULT_GROUPS, DEFAULT_MODELS, DEFAULT_TOKENS, DEFAULT_TOPOLOGIES

    s = subparsers.add_parser("sweep", help="plan the paper's grid of configurations and summarise the winners",
                              description="3 pair kinds x 4 token counts x 3 group sizes x 2 model widths x "
                                          "4 topologies = 288 configurations by default.",
                              allow_abbrev=False)
    s.add_argument("--topologies", type=_names(None), default=DEFAULT_TOPOLOGIES,
                   help="comma-separated presets or files")
    s.add_argument("--models", type=_names(tuple(MODELS)), default=DEFAULT_MODELS)
    s.add_argument("--kinds", type=_names(PAIR_KINDS), default=PAIR_KINDS)
    s.add_argument("--tokens", type=positive_ints, default=DEFAULT_TOKENS)
    s.add_argument("--group-sizes", type=positive_ints, default=DEFAULT_GROUPS)
    s.add_argument("--fused", type=_schedules, default=None,
                   help="fused schedules to price: comma-separated, 'all' or 'none' (default: as 'auto': only "
                        "where the GPUs lack peer access)")
    s.add_argument("--cuda-graphs", action="store_true",
                   help="price every pair as a CUDA graph replay (Inductor's mode='reduce-overhead')")
    s.add_argument("--out-dir", default="compass-sweep", help="where sweep.csv and the summary go")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_sweep)

    c = subparsers.add_parser("calibrate", help="measure GEMMs on this GPU and fit the model's constants",
                              description="Needs a CUDA GPU.  Writes a calibration file; point "
                                          "COMPASS_FX_CALIBRATION at it to use it.",
                              allow_abbrev=False)
    c.add_argument("--out", default="compass-calibration.json")
    c.add_argument("--gpu", default=None, help="constants to start from (default: from the device name)")
    c.add_argument("--quick", action="store_true", help="fewer shapes (about a quarter of the time)")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("--collectives", action="store_true",
                   help="also time NCCL all-gather / reduce-scatter / all-reduce over message sizes on every "
                        "GPU of this machine (run under torchrun, one process per GPU; NCCL_P2P_DISABLE=1 "
                        "measures the host-staged regime)")
    c.set_defaults(func=cmd_calibrate)

    r = subparsers.add_parser("prepare", help="build the fused calls' host fast path ahead (else ~20 s in the first "
                                              "fused call on a new machine or torch)",
                              description="Build the fused operators' host fast path (a C++ extension) into "
                                          "torch's extension cache, or say that it is there; no GPU needed.  "
                                          "Without it the first fused call on a new machine or torch builds it, "
                                          "about 20 s inside a training step.",
                              allow_abbrev=False)
    r.set_defaults(func=cmd_prepare)
