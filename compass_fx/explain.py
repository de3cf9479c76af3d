"""``explain``: run the backend's tracing on a model and report every pair and decision."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any, Iterator

import torch

from . import backend
from .options import parse_options
from .report import Report


def explain(model: torch.nn.Module | Any, *example_inputs: Any, **options: Any) -> Report:
    """Trace ``model`` forward and backward exactly as ``backend="compass"`` would; report it all.

    The model runs one forward pass (its collectives included, so call this on every rank, as
    any TP forward) with the backward graph compiled eagerly; no backward runs and no gradient or
    parameter changes.  Inductor code generation is skipped: only the graphs are produced.

    A model already compiled with ``backend="compass"`` is explained with the options (and mode)
    it was compiled with; passing other options as well is an error, since the report would then
    describe a compile that is not the model's.  A model compiled with another backend is
    explained as ``backend="compass"`` with ``options`` would compile its module.  Explain's own
    traces do not show in :func:`last_report`, nor count against Dynamo's recompile limit of the
    model's own compile (where torch has ``isolate_recompiles``), nor make its sizes dynamic: the
    example's shapes are traced as given (but for sizes marked dynamic), whatever shapes the model
    ran at before, and leave no trace in how the model's own compile treats its shapes.  A model
    Dynamo hands no graph of is an error, not an empty report.
    """
    module, compiled_with = unwrap_compiled(model)
    if compiled_with is not None:
        given = parse_options(options) if options else None
        if given is not None and given != parse_options(compiled_with):
            raise ValueError(f"explain: this model was compiled with backend='compass' and options {compiled_with}; "
                             "explain reports that compile, so pass no options (or explain the uncompiled module)")
        options = compiled_with
    opts = parse_options(options)

    def pass_only(gm: Any, example_inputs_: Any) -> Any:
        return backend.compile_graph(gm, example_inputs_, opts, finish=backend._eager_inner, in_history=False)

    compiled = torch.compile(module, backend=pass_only, **_OWN_RECOMPILES)
    with backend.collect_reports() as graphs, _sizes_noted_kept(), \
            torch._dynamo.config.patch(automatic_dynamic_shapes=False), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True), torch.enable_grad():
        compiled(*example_inputs)
    if not graphs:
        counted = ("explain's own traces do not count against the first" if _OWN_RECOMPILES else
                   "on this torch each explain of the same model counts too: call torch._dynamo.reset() first")
        raise RuntimeError("explain: Dynamo handed the backend no graph of this model, so there is nothing to "
                           "report: either its forward is excluded from compilation (torch.compiler.disable, a "
                           "skipped file), or Dynamo hit a recompile limit on it "
                           f"(torch._dynamo.config.recompile_limit, default 8, or accumulated_recompile_limit; {counted})")
    return Report(graphs=list(graphs), options=_jsonable(dataclasses.asdict(opts)))


# Each explain traces the model with a backend of its own, so each is a new compile of the model's
# code for Dynamo; sharing the model's cache entries, the ninth explain in a process would have hit
# Dynamo's recompile limit (8) and reported nothing, and every explain would count against the
# limit of the model's own torch.compile.  Where torch can (``isolate_recompiles``: 2.13 and 2.14
# have it), each explain keeps its entries apart.
_OWN_RECOMPILES = ({"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters
                   else {})


@contextlib.contextmanager
def _sizes_noted_kept() -> Iterator[None]:
    """Dynamo notes the sizes every compile of a code object sees and, once a later compile sees
    others, makes those sizes dynamic (automatic dynamic shapes), and the pass leaves pairs of
    symbolic size alone.  explain's traces are not the model's: they neither take the sizes other
    compiles noted (explain traces with automatic dynamic shapes off) nor leave theirs behind (the
    notes are put back as they were), so an explain with an example of another shape than the
    training batch does not make the model's own compile dynamic."""
    try:
        from torch._dynamo import pgo

        noted = pgo.get_code_state()
    except (ImportError, AttributeError):  # a torch that keeps them elsewhere: nothing to keep
        yield
        return
    kept = copy.deepcopy(noted)
    try:
        yield
    finally:
        noted.clear()
        noted.update(kept)


def unwrap_compiled(model: Any) -> tuple[Any, dict[str, Any] | None]:
    """``(module, options)`` for a model compiled with ``torch.compile(..., backend="compass")``: its
    original module and the options it was compiled with (``mode`` among them when not default);
    ``(module, None)`` for any other compiled model, ``(model, None)`` for one not compiled."""
    original = getattr(model, "_orig_mod", None)
    if original is None:
        return model, None
    wrapper = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    for _ in range(16):  # the callback wraps the backend a few times, each keeping the one inside
        inner = getattr(wrapper, "_torchdynamo_orig_backend", None)
        if inner is None or inner is wrapper:
            break
        wrapper = inner
    if getattr(wrapper, "compiler_fn", None) is not backend.compass_backend:
        return original, None
    kwargs = dict(getattr(wrapper, "kwargs", None) or {})
    options = dict(kwargs.get("options") or {})
    if kwargs.get("mode") not in (None, "default"):
        options["mode"] = kwargs["mode"]
    return original, options


def last_report(graphs: int | None = None) -> Report:
    """What the backend did in the most recent compile of a model (its forward graph, and its
    backward once the first backward call compiled it); ``graphs=N``: the last N graphs compiled,
    whichever compiles they came from."""
    reports = backend.latest_compile() if graphs is None else list(backend.history)[-graphs:]
    return Report(graphs=reports)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v)) for k, v in d.items()}
