"""One trace, several option sets: the compass backend's work on each graph, once per option set.

``torch.compile`` spends most of a small model's compile in Dynamo's bytecode tracing and in
AOTAutograd (its joint trace and partition): about 5 of the 6 CPU seconds a rank spends on the
1-layer Llama block, of which the compass pass is 0.4.  Neither depends on the compass options (the
pass runs on the graphs AOTAutograd produces, :func:`compass_fx.backend.graph_compiler`), so a test
that checks many option sets on one model can trace once: :class:`Variants` is a ``torch.compile``
backend that runs AOTAutograd once and hands each forward / backward graph to every option set's
own ``graph_compiler`` (the backend's hook, unchanged: pass, report, inner compiler), each on a
copy of the graph.  The compiled model then runs whichever set :meth:`Variants.select` chose.

What this leaves out per option set is what is the same for all of them: Dynamo's trace and
AOTAutograd's.  Options that change AOTAutograd's own settings (``mode``) cannot share a trace.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._guards import TracingContext
from torch._inductor.codecache import PyCodeCache

from compass_fx import backend
from compass_fx.options import parse_options


class Variants:
    """A ``torch.compile`` backend compiling each graph once per option set; ``select(i)`` picks
    the set the compiled model runs.  ``reports[i]``: the graph reports of set ``i``; a set whose
    compile raised keeps its error in ``errors[i]`` and raises it when selected and run."""

    def __init__(self, option_sets: Sequence[dict]) -> None:
        self.options = [parse_options(o) for o in option_sets]
        modes = {o.mode for o in self.options}
        if len(modes) > 1:
            raise ValueError(f"option sets with different modes {sorted(map(str, modes))} cannot share a trace")
        self.mode = modes.pop()
        self.reports: list[list] = [[] for _ in self.options]
        self.errors: list[BaseException | None] = [None] * len(self.options)
        self.modules: list[list] = [[] for _ in self.options]  # the Python modules each set's compile loaded
        self.current = 0
        self.traces = 0  # how many graphs Dynamo handed over (1 for a model without graph breaks)

    def select(self, index: int) -> None:
        if not 0 <= index < len(self.options):
            raise IndexError(f"option set {index} of {len(self.options)}")
        self.current = index

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.traces += 1
        compilers = [backend.graph_compiler(o) for o in self.options]

        def inner_compile(graph: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Callable:
            # Inductor notes each compiled graph's output strides in the tracing context, for
            # AOTAutograd to lay its outputs out: one graph's worth, so each set starts it empty and
            # the sets must agree on it (a rewrite keeps its graph's outputs as they were).
            context = TracingContext.try_get()
            noted = context.output_strides if context is not None else None
            first_strides = None
            compiled: list[Callable | None] = []
            for i, compile_one in enumerate(compilers):
                if noted is not None:
                    noted.clear()
                loaded = len(PyCodeCache.modules)
                with backend.collect_reports() as reports:
                    try:
                        fn = compile_one(copy.deepcopy(graph), inputs, **kwargs)
                        self.modules[i] += PyCodeCache.modules[loaded:]  # Inductor's wrappers
                        strides = list(noted) if noted is not None else None
                        if first_strides is None:
                            first_strides = strides
                        elif strides != first_strides:
                            raise RuntimeError(f"option set {i} lays out its graph's outputs with strides {strides}, "
                                               f"the first set with {first_strides}: they cannot share a trace")
                    except Exception as e:  # noqa: BLE001 - kept for the set's own test to report
                        self.errors[i] = e
                        fn = None
                compiled.append(fn)
                self.reports[i] += reports
            if noted is not None:
                noted[:] = first_strides or []

            def run(args: list) -> Any:
                fn = compiled[self.current]
                if fn is None:
                    raise RuntimeError(f"option set {self.current} failed to compile") from self.errors[self.current]
                return fn(args)

            run._boxed_call = True  # AOTAutograd's calling convention: one list of arguments
            return run

        return backend.aot_compile(gm, example_inputs, inner_compile, self.mode)
