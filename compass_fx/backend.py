"""The ``torch.compile`` backend: AOTAutograd, the compass pass on each graph, the inner compiler.

Inductor's own ``compile_fx`` drives AOTAutograd (its decompositions, joint-graph passes and
partitioner), and the pass runs in its ``inner_compile`` hook, on the forward and the backward
graph, right before Inductor lowers them.  So the graphs rewritten are exactly those Inductor
would have compiled; with ``inner="eager"`` the rewritten graphs run as plain PyTorch instead.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from .options import CompassOptions, parse_options
from .graph_pass import compass_pass
from .report import GraphReport

log = logging.getLogger("compass_fx")

# Every graph report of this process, newest last: what ``last_report`` shows.  Unbounded on
# purpose: a report is small, a training job compiles few graphs, and a capped buffer would make
# ``history[before:]`` silently empty once full.
history: list[GraphReport] = []
_compiles: list[int] = []  # beside ``history``: which compile (one compile_graph call) each graph came from
_compile_count = 0
_collectors: list[list[GraphReport]] = []


@contextlib.contextmanager
def collect_reports() -> Iterator[list[GraphReport]]:
    """Collect the reports of every graph compiled inside the block."""
    sink: list[GraphReport] = []
    _collectors.append(sink)
    try:
        yield sink
    finally:
        _collectors.remove(sink)


def _record(report: GraphReport, compile_id: int | None) -> None:
    """Give ``report`` to every collector, and to ``history`` unless ``compile_id`` is None (explain's
    own traces: ``last_report`` shows only what models compiled themselves)."""
    if compile_id is not None:
        history.append(report)
        _compiles.append(compile_id)
    for sink in _collectors:
        sink.append(report)


def latest_compile() -> list[GraphReport]:
    """The graphs of the most recent compile: its forward, and its backward once compiled (AOTAutograd
    compiles a backward at the first backward call); inference graphs alone."""
    if not history:
        return []
    last = _compiles[-1]
    return [r for r, c in zip(history, _compiles) if c == last]


def _eager_inner(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
    from torch._functorch.aot_autograd import make_boxed_func

    from .lowering.row_blocks import run_in_place

    run_in_place(gm)
    return make_boxed_func(gm.forward)


def compass_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: Any = None,
                    mode: str | None = None, **unexpected: Any) -> Callable:
    """Entry point for ``torch.compile(model, backend="compass", options={...})``."""
    if unexpected:
        raise ValueError(f"unknown compass backend argument(s) {sorted(unexpected)}; "
                         "pass settings as options={...}")
    try:
        opts = parse_options(options, **({"mode": mode} if mode is not None and mode != "default" else {}))
    except ValueError as e:  # met at the first call of a compiled model: say it as ours, not as dynamo's crash
        raise _options_error_type()(str(e), first_useful_frame=inspect.currentframe()) from None
    return compile_graph(gm, example_inputs, opts)


@functools.cache
def _options_error_type() -> type:
    """``CompassOptionsError``, made on first use: its base is Dynamo's, and importing Dynamo costs a
    process 1.5 CPU-s that ``import compass_fx`` alone (the command line's help, the planning
    tools, a rank that only runs the fused operators) does not need."""
    from torch._dynamo.exc import ShortenTraceback

    class CompassOptionsError(ShortenTraceback, ValueError):
        """A bad option given to ``torch.compile(backend="compass", options=...)``.  Dynamo passes
        this kind of error on as it is (its traceback cut to the backend's frame) instead of wrapping
        it in ``BackendCompilerFailed``, so the user's last line is the project's message."""

    CompassOptionsError.__module__, CompassOptionsError.__qualname__ = __name__, "CompassOptionsError"
    return CompassOptionsError


def __getattr__(name: str) -> Any:
    if name == "CompassOptionsError":
        return _options_error_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: CompassOptions,
                  finish: Callable | None = None, in_history: bool = True) -> Callable:
    """AOTAutograd + compass pass + inner compiler (``finish`` overrides the inner compiler).
    ``in_history=False``: the reports go to collectors only (explain's traces)."""
    return aot_compile(gm, example_inputs, graph_compiler(opts, finish, in_history), opts.mode)


def graph_compiler(opts: CompassOptions, finish: Callable | None = None, in_history: bool = True) -> Callable:
    """The ``inner_compile`` hook of one compile: the compass pass on the graph AOTAutograd hands
    it (forward, backward or inference), its report recorded, then ``finish`` (Inductor's
    ``compile_fx_inner`` or the eager runner) on the rewritten graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    global _compile_count
    _compile_count += 1
    compile_id = _compile_count if in_history else None

    topology = _topology(opts)
    if opts.calibration is not None and topology is None:  # the default topology: check it now
        from .machine.calibration import calibrated_gpus
        from .machine.topology import Topology
        from .options import check_calibration_matches

        check_calibration_matches(opts.calibration, calibrated_gpus(opts.calibration), Topology.default())
    if finish is None:
        finish = compile_fx_inner if opts.inner == "inductor" else _eager_inner

    def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
        kind = "backward" if kwargs.get("is_backward") else ("forward" if kwargs.get("is_inference") is False
                                                             else "inference")
        from .machine.calibration import use_calibration

        with use_calibration(opts.calibration):
            report = compass_pass(graph, kind, opts, topology)
        _note_shared_queues(report)
        _note_launch_mode(report, opts)
        _note_gloo_threads(report, graph)
        _record(report, compile_id)
        with _keep_pipelines(report, finish is compile_fx_inner):
            return finish(graph, inputs, **kwargs)

    return inner_compile


def aot_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], inner_compile: Callable,
                mode: str | None = None) -> Callable:
    """Inductor's ``compile_fx`` (AOTAutograd: decompositions, joint-graph passes, partitioner) with
    ``inner_compile`` on each graph it produces, under ``mode``'s Inductor settings."""
    from torch._inductor.compile_fx import compile_fx

    config_patches = {}
    if mode is not None:
        config_patches.update(torch._inductor.list_mode_options(mode))
    # The AOTAutograd cache would serve a graph compiled without this pass (or with other
    # options) and skip inner_compile altogether; keep it out of the way.
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=config_patches or None)


STREAMS_OF_A_PAIR = 4  # a rewritten pair's work runs on up to 4 streams: the caller's, NCCL's or the fused ops' side streams


def _note_shared_queues(report: GraphReport) -> None:
    """Say so when ``CUDA_DEVICE_MAX_CONNECTIONS`` (Megatron sets it to 1) leaves fewer hardware
    queues than a rewritten pair has streams: streams that share a queue run in issue order, so the
    overlap the cost model priced may not happen.  (The fused operators stay deadlock-free there:
    their issue order allows one shared queue, ``kernels/issue_order.py``.)"""
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
    if not value.isdigit() or int(value) >= STREAMS_OF_A_PAIR:
        return
    if any(p.status == "rewritten" for p in report.pairs):
        report.notes.append(f"CUDA_DEVICE_MAX_CONNECTIONS={value}: this process's CUDA streams share {value} hardware "
                            f"queue(s), where they run in issue order; the overlap predicted for the rewritten pairs "
                            f"assumes a queue per stream (no gain was measured with shared queues)")


def _note_gloo_threads(report: GraphReport, graph: fx.GraphModule) -> None:
    """Say so when the graph, as it will run, holds torch's functional collectives on a gloo group
    of more than one worker thread: torch 2.13-2.14 corrupt the heap now and then when two such
    gathers run at once on its threads (a rank dies; ``groups.gloo_worker_threads`` says more).
    Read from the graph, not the pairs: collectives left alone (symbolic shapes, no pair) count."""
    from .groups import gloo_threads_of

    names = {a for n in graph.graph.nodes if n.op == "call_function"
             and getattr(n.target, "namespace", None) == "_c10d_functional" for a in n.args if isinstance(a, str)}
    for name in sorted(names):
        threads = gloo_threads_of(name)
        if threads is not None and threads > 1:
            report.notes.append(f"group {name!r} runs gloo with {threads} worker threads: torch 2.13-2.14's functional "
                                f"collectives on it corrupt the heap now and then (two gathers at once on its threads "
                                f"kill a rank); create CPU groups inside compass_fx.gloo_worker_threads(1)")


def _note_launch_mode(report: GraphReport, opts: CompassOptions) -> None:
    """Say how the graph will be launched, eagerly or in CUDA graphs, and what that means for its
    pairs.  In a CUDA graph mode: that the cost model priced the pairs as replays, and what becomes
    of the fused calls: captured with the rest (``COMPASS_FUSED_GRAPHS=1`` when compass_fx was imported:
    the ops carry no ``cudagraph_unsafe`` tag), or left out, which splits the graph or leaves it
    uncaptured (so "auto" does not price them then).  Without such a mode, where to see how the
    fused calls ran eagerly (:func:`compass_fx.fused_calls`)."""
    fused = [p for p in report.pairs if p.status == "rewritten" and p.strategy == "fuse"]
    if not opts.captures_cuda_graphs():
        if fused:  # eager: each call replays a graph of its own once its addresses recur
            report.notes.append(f"the {len(fused)} fused pair(s) run eagerly; print(compass_fx.fused_calls()) after a "
                                "few steps says how their calls ran (replayed from their own graphs, or issued "
                                "command by command)")
        return
    from .kernels import fused_ops_capturable

    captured = fused_ops_capturable()
    if opts.strategy == "auto" and opts.chunks is None:  # the cost model chose (forced strategies price nothing)
        report.notes.append(f"mode={opts.mode!r} replays CUDA graphs: the pairs were priced without host issue "
                            "costs (an extra InterDecom part costs its device time alone"
                            + (", a fused call no host floor)" if captured else
                               "; without COMPASS_FUSED_GRAPHS=1 'auto' offers no fused operator: it would split "
                               "the graphs)"))
    if not fused:
        return
    if not captured:
        report.notes.append(f"mode={opts.mode!r} captures CUDA graphs, but they leave the {len(fused)} fused pair(s) "
                            "out (the graph is split around them, or not captured): set COMPASS_FUSED_GRAPHS=1 "
                            "before importing compass_fx to capture them too")
    else:
        report.notes.append(f"mode={opts.mode!r}: the {len(fused)} fused pair(s) are captured in Inductor's CUDA "
                            "graphs (COMPASS_FUSED_GRAPHS=1; Inductor's warm-up run builds their workspaces)")


@contextlib.contextmanager
def _keep_pipelines(report: GraphReport, inductor: bool) -> Iterator[None]:
    """Keep Inductor from undoing a decomposition.

    Inductor's peak-memory reordering (``reorder_for_peak_memory``) moves each collective's wait
    right behind the collective, since that frees its buffer soonest; in a decomposed pair that
    makes every part wait for its own collective before the next part's matmul starts, and the
    pipeline runs sequentially (measured on 2 H200s: no overlap at all in a decomposed
    reduce-scatter).  So a graph with a decomposed pair is compiled without that reordering;
    its other memory optimisations stay on.  The report says so."""
    decomposed = any(p.status == "rewritten" and p.strategy == "decompose" for p in report.pairs)
    started = any(p.status == "rewritten" and p.asynchronous for p in report.pairs)
    if not (inductor and (decomposed or started)):
        yield
        return
    report.notes.append("Inductor's reorder_for_peak_memory turned off for this graph: it would move each "
                        "collective's wait right behind it and serialize the "
                        + ("decomposed parts" if decomposed else "asynchronous fused calls"))
    with torch._inductor.config.patch(reorder_for_peak_memory=False):
        yield


def _topology(opts: CompassOptions) -> Any:
    """The Topology named by the options (a preset or a file), resolved once per compile."""
    if opts.topology is None or not isinstance(opts.topology, str):
        return opts.topology
    from .machine.topology import Topology

    try:
        return Topology.resolve(opts.topology)
    except (ValueError, OSError) as e:
        raise ValueError(f"option 'topology': {e}") from None
