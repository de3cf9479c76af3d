"""A generator of small TP graphs mixing collectives, matmuls, views, casts and pointwise ops.

A ``spec`` (plain dict, printable for reproduction) describes rounds of "gather -> matmuls" and
"matmuls -> reduce-scatter / all-reduce" blocks, each with a random form taken from the shapes
seen in real graphs.  ``trace(spec)`` gives the aten graph (fake process group, fake tensors);
``check(spec, parts)`` rewrites every pair it can with ``parts`` and replays the original and
the rewritten graph on every rank with LocalTensorMode: outputs must agree.  ``specs(float8=True)``
draws the blocks' matmuls in float8 too (``_scaled_mm`` with the scalings torchao uses).  ``check_fused``
does the same with every pair the fused operators take rewritten to a call of one, the calls
replayed as what they compute (``wild_check.fused_calls_as_collectives``).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.fx as fx
import wild_check
from wild_models import all_gather_single, reduce_scatter_single
from hypothesis import strategies as st
from compass_fx.cost.decision import Decision
from compass_fx.passes.find import kind_of
from torch.fx.experimental.proxy_tensor import make_fx

c10d = torch.ops._c10d_functional
F8 = torch.float8_e4m3fn
GATHER_FORMS = ("view2d", "reshape", "unsqueeze_flatten", "bmm_expand", "einsum", "matmul3d")
REDUCE_FORMS = ("mm", "bmm_expand", "matmul3d")
# How a block's matmuls run in float8 (``specs(float8=True)``): None (as drawn without float8);
# "tensorwise" (one scale of A, an input); "rowwise" (a scale per row of A, from each row's amax, as
# torchao's row-wise recipe); "rowwise_expanded" (the same through an expand to its own shape, as code
# that broadcasts its scales leaves it); "rowwise_repeated" (one input scale expanded to every row); a gather's
# "bytes" (the shard cast to float8 before the gather: the gather moves float8 rows); and the one
# that no part can take, "tensorwise_of_gathered" (one amax over all the gathered rows: hostile).
GATHER_FLOAT8 = (None, "tensorwise", "rowwise", "rowwise_expanded", "rowwise_repeated", "bytes", "tensorwise_of_gathered")
REDUCE_FLOAT8 = (None, "tensorwise", "rowwise", "rowwise_expanded", "rowwise_repeated")


@st.composite
def specs(draw, world: int | None = None, float8: bool = False) -> dict:
    """A random spec; ``float8`` adds a float8 form to each block (drawn after the rest, so the
    specs drawn without it stay what they were for a seed)."""
    world = world or draw(st.sampled_from([2, 4]))
    three_d = draw(st.booleans())
    spec = {"world": world, "batch": draw(st.sampled_from([1, 2])) if three_d else 0,
            "local": draw(st.sampled_from([2, 4, 6])), "dim": draw(st.sampled_from([8, 12])), "rounds": []}
    for _ in range(draw(st.integers(1, 2))):
        gdim = draw(st.sampled_from([0, 1] if three_d else [0]))
        gather = {"dim": gdim, "style": draw(st.sampled_from(["fc", "slices"] if gdim else ["fc"])),
                  "cast": draw(st.sampled_from([None, "bf16_roundtrip", "double", "clone"])),
                  "form": draw(st.sampled_from(GATHER_FORMS if three_d else ("view2d", "reshape", "unsqueeze_flatten"))),
                  "consumers": draw(st.lists(st.booleans(), min_size=1, max_size=3)),  # True: with bias
                  "extra_use": draw(st.booleans()), "contraction": draw(st.booleans()),
                  "hidden": draw(st.sampled_from([8, 16])),
                  "hostile": draw(st.sampled_from([None, None, None, "relu", "narrow"]))}
        kind = draw(st.sampled_from(["rs", "ar"]))
        rdim = draw(st.sampled_from([0, 1] if three_d and kind == "rs" else [0]))
        reduce = {"kind": kind, "dim": rdim, "terms": draw(st.integers(1, 2)), "bias": draw(st.booleans()),
                  "cast": draw(st.sampled_from([None, "bf16", "clone", "term_double"])),
                  "escape": draw(st.booleans()),
                  "style": draw(st.sampled_from(["fc", "permute"] if rdim else ["fc"])),
                  "form": draw(st.sampled_from(REDUCE_FORMS if three_d else ("mm",))),
                  "hostile": draw(st.sampled_from([None, None, None, "scale", "max"]))}
        spec["rounds"].append({"gather": gather, "reduce": reduce, "noise": draw(st.booleans())})
        if float8:
            gather["f8"] = draw(st.sampled_from(GATHER_FLOAT8))
            reduce["f8"] = draw(st.sampled_from(REDUCE_FLOAT8))
            gather["f8_out"] = draw(st.sampled_from(["bf16", "float32"]))
            reduce["f8_out"] = draw(st.sampled_from(["bf16", "float32"]))
    return spec


def _logical_shape(spec: dict, dim: int, cols: int) -> list[int]:
    """Full (gathered) shape with the split dim ``dim`` of extent world * local."""
    w, n = spec["world"], spec["local"]
    if not spec["batch"]:
        return [w * n, cols]
    shape = [spec["batch"], 2, cols]
    shape[dim] = w * n if dim == 1 else w * spec["batch"]
    if dim == 0:
        shape[1] = n
    return shape


def _shard_shape(spec: dict, dim: int, cols: int) -> list[int]:
    shape = _logical_shape(spec, dim, cols)
    shape[dim] //= spec["world"]
    return shape


def _gather(x: torch.Tensor, g: dict, world: int, group: str) -> torch.Tensor:
    if g["style"] == "fc" or g["dim"] == 0:
        return all_gather_single(x, g["dim"], group)
    w = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world, group))
    n = x.shape[0]
    return torch.cat([w[i * n:(i + 1) * n] for i in range(world)], dim=g["dim"])


def _apply_linear(f: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, form: str) -> torch.Tensor:
    """``f @ w`` (+ b) written in one of the wild forms; returns [rows, N] or [B, M, N]."""
    d = f.shape[-1]
    if form in ("view2d", "reshape", "unsqueeze_flatten", "mm") or f.dim() == 2:
        if form == "reshape":
            f2 = f.reshape(-1, d)
        elif form == "unsqueeze_flatten":
            f2 = f.reshape(-1, d).unsqueeze(0).flatten(0, 1)
        else:
            f2 = f.reshape(-1, d) if f.dim() != 2 else f
        return torch.addmm(b, f2, w) if b is not None else torch.mm(f2, w)
    if form == "bmm_expand":
        out = torch.bmm(f.contiguous(), w.expand(f.shape[0], *w.shape))
    elif form == "einsum":
        out = torch.einsum("bsd,dn->bsn", f, w)
    else:
        out = torch.matmul(f, w)
    return out + b if b is not None else out


def _float8(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float8 rows (cast unless gathered in float8 already), as torchao hands ``_scaled_mm`` A."""
    return t if t.dtype == F8 else t.to(F8)


def _scaled_linear(f: torch.Tensor, w8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                   b: torch.Tensor | None, f8: str, out: str) -> torch.Tensor:
    """``f @ w8.t()`` (+ b) as ``_scaled_mm`` on f's rows, A scaled as ``f8`` says; f's leading dims kept."""
    f2 = f.reshape(-1, f.shape[-1])
    rows = f2.shape[0]
    if f8 in ("rowwise", "rowwise_expanded", "tensorwise_of_gathered"):  # scales from the rows themselves
        x = f2.float().abs()
        amax = x.amax().reshape(1, 1) if f8 == "tensorwise_of_gathered" else x.amax(dim=-1, keepdim=True)
        sa = amax.clamp_min(1e-6) / 448.0
        a8 = (f2.float() / sa).to(F8)
        sa = sa if f8 == "rowwise" else sa.expand(rows, 1).contiguous()  # a no-op, or one scale to every row
    else:
        a8 = _float8(f2)
        sa = sa.expand(rows, 1).contiguous() if f8 == "rowwise_repeated" else sa
    y = torch._scaled_mm(a8, w8.t(), sa, sb, out_dtype=torch.bfloat16 if out == "bf16" else torch.float32)
    y = y.reshape(*f.shape[:-1], y.shape[-1])
    return y + b if b is not None else y


def _linear(f: torch.Tensor, w: list[torch.Tensor], b: torch.Tensor | None, form: str, block: dict) -> torch.Tensor:
    """A block's matmul: in float8 when the block draws a float8 form, else in the drawn form."""
    if block.get("f8") is None:
        return _apply_linear(f, w[0], b, form)
    return _scaled_linear(f, *w, b, block["f8"], block["f8_out"])


def _hostile_rows(f: torch.Tensor, hostile: str | None) -> torch.Tensor:
    if hostile == "relu":  # a nonlinearity between gather and matmul: no pair (a float8 consumer, which
        return torch.relu(f)  # replays the row-local ops before it per part, takes it all the same)
    if hostile == "narrow":  # rows dropped before the matmul: no pair
        return torch.cat([f.narrow(-2, 0, 1), f.narrow(-2, 1, f.shape[-2] - 1) * 1.5], dim=-2)
    return f


def _on_float8_rows(f: torch.Tensor, g: dict) -> torch.Tensor:
    """A gather's cast and hostile op on its float8 rows (CPU float8 has no arithmetic)."""
    if g["cast"] == "clone":
        f = f.clone()
    elif g["cast"] is not None or g["hostile"] is not None:
        f = _hostile_rows(f.float(), g["hostile"]).to(F8)
    return f


def _reduce(y: torch.Tensor, r: dict, world: int, group: str) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    if r["hostile"] == "max":            # not a linear reduction: no pair
        return fc.all_reduce(y, "max", group) if r["kind"] == "ar" else \
            c10d.wait_tensor(c10d.reduce_scatter_tensor(y.flatten(0, -2).contiguous(), "max", world, group))
    if r["kind"] == "ar":
        return fc.all_reduce(y, "sum", group)
    if r["style"] == "permute":
        perm = [1, 0, 2]
        out = c10d.wait_tensor(c10d.reduce_scatter_tensor(y.permute(perm).contiguous(), "sum", world, group))
        return out.permute(perm)
    return reduce_scatter_single(y, "sum", r["dim"], group)


def program(spec: dict, group: str):
    """The function the spec describes and its inputs (weights are inputs too)."""
    world, dim = spec["world"], spec["dim"]
    inputs: list[torch.Tensor] = []
    gen = torch.Generator().manual_seed(0)

    def new(*shape: int, dtype=torch.float32) -> int:
        inputs.append((torch.randn(shape, generator=gen) / max(shape[-1] if shape else 1, 1) ** 0.5).to(dtype))
        return len(inputs) - 1

    def weight(k: int, n: int, f8: str | None, dtype=torch.float32) -> tuple:
        """A matmul's B ([k, n]), or in float8 B's transpose ([n, k], as torchao keeps it) and the scales."""
        if f8 is None:
            return (new(k, n, dtype=dtype),)
        return new(n, k, dtype=F8), new(), new() if f8 in ("tensorwise", "bytes") else new(1, n)

    plan = []
    for rd in spec["rounds"]:
        g, r = rd["gather"], rd["reduce"]
        wdtype = torch.float64 if g["cast"] == "double" else torch.float32
        x = new(*_shard_shape(spec, g["dim"], dim))
        ws = [(weight(dim, g["hidden"], g.get("f8"), wdtype), new(g["hidden"], dtype=wdtype) if bias else None)
              for bias in g["consumers"]]
        terms = [(weight(g["hidden"], dim, r.get("f8")), new(dim) if r["bias"] and t == 0 else None)
                 for t in range(r["terms"])]
        # a float8 block's contraction is torchao's weight gradient: _scaled_mm(clone(t(rows)), B),
        # tensorwise, B ([rows, hidden], column-major) an input of its own (the output's gradient)
        rows = math.prod(_logical_shape(spec, g["dim"], dim)[:-1])
        grad = (new(g["hidden"], rows, dtype=F8), new(), new()) if g.get("f8") and g["contraction"] else None
        plan.append((x, ws, terms, grad))

    def fn(*args: torch.Tensor):
        outs = []
        for rd, (xi, ws, terms, grad) in zip(spec["rounds"], plan):
            g, r = rd["gather"], rd["reduce"]
            shard = args[xi].to(F8) if g.get("f8") == "bytes" else args[xi]
            f = _gather(shard, g, world, group)
            if f.dtype == F8:  # what follows a gather of float8 rows runs on them in float32, cast back
                f = _on_float8_rows(f, g)
            elif g["cast"] == "bf16_roundtrip":
                f = f.to(torch.bfloat16).float()
            elif g["cast"] == "double":
                f = f.double()
            elif g["cast"] == "clone":  # a copy between gather and matmul (keeps the rows)
                f = f.clone()
            if f.dtype != F8:
                f = _hostile_rows(f, g["hostile"])
            hs = [_linear(f, [args[i] for i in w], args[b] if b is not None else None, g["form"], g)
                  for w, b in ws]
            h = hs[0]
            for other in hs[1:]:
                h = torch.relu(h) * other
            h = h.float()
            if g["extra_use"]:
                outs.append(f.float().sum(dim=-1))
            if grad is not None:
                f2 = f.reshape(-1, f.shape[-1])
                v8 = _float8(f2)
                b8, s1, s2 = (args[i] for i in grad)
                outs.append(torch._scaled_mm(v8.permute(1, 0).contiguous(), b8.permute(1, 0), s1, s2,
                                             out_dtype=torch.float32))
            elif g["contraction"]:  # transposed as the backend's graphs have it (Inductor decomposes t to permute)
                f2 = f.reshape(-1, f.shape[-1]).float()
                outs.append(torch.mm(f2.permute(1, 0), h.reshape(-1, h.shape[-1])))
            if rd["noise"]:
                h = torch.tanh(h) * 2
            y = None
            for t, (w, b) in enumerate(terms):
                src = h if t == 0 else torch.relu(h)
                term = _linear(src, [args[i] for i in w], args[b] if b is not None else None, r["form"], r)
                if r["cast"] == "term_double":  # each term converted before the sum
                    term = term.double()
                y = term if y is None else y + term
            if r["escape"]:
                outs.append(torch.sigmoid(y))
            if r["hostile"] == "scale":     # a pointwise op between matmul and reduce: no pair
                y = y * 0.5
            if r["cast"] == "bf16":
                y = y.to(torch.bfloat16)
            elif r["cast"] == "clone":
                y = y.clone()
            y = y.reshape(_logical_shape(spec, r["dim"], dim)) if spec["batch"] else y.reshape(-1, dim)
            outs.append(_reduce(y, r, world, group).float())
        return tuple(outs)

    return fn, inputs


def trace(spec: dict, group: str) -> fx.GraphModule:
    fn, inputs = program(spec, group)
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def traced_with_reference(spec: dict, group: str) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``spec``'s graph traced once, as a reference and a working copy to rewrite: the reference's
    nodes are copies (meta shallow-copied), so nothing a rewrite does to the working graph reaches it.
    Tracing is half of a check's time; a second trace gave the same graph."""
    gm = trace(spec, group)
    return fx.GraphModule(gm, copy.deepcopy(gm.graph)), gm


def check(spec: dict, group: str, parts_choice: int) -> dict:
    """Rewrite ``spec``'s graph (parts: the ``parts_choice``-th feasible count > 1) and compare."""
    ref, gm = traced_with_reference(spec, group)

    def parts(pair) -> int | None:
        options = [p for p in pair.feasible_parts() if p > 1] or [1]
        return options[parts_choice % len(options)]

    done, skips = wild_check.rewrite_all(gm, parts)
    _compare(spec, ref, gm)
    return {"rewritten": len(done), "skipped": [s.reason for s in skips],
            "blocks": 2 * len(spec["rounds"]), "hostile": _hostile(spec)}


def check_fused(spec: dict, group: str, schedule: str, fused_async: bool) -> dict:
    """Rewrite every pair of ``spec``'s graph that the fused operators take to a call of one (the
    rest stay as they are), replay it with the calls written as what they compute, and compare."""
    ref, gm = traced_with_reference(spec, group)
    refused: list[str] = []

    def choose(pair) -> Decision:
        why = kind_of(pair).refusals(pair).get("fuse")
        if why is None:
            return Decision("fuse", schedule=schedule)
        refused.append(why)
        return Decision("sequential")

    done, skips = wild_check.rewrite_chosen(gm, choose, fused_async=fused_async)
    calls = wild_check.fused_calls_as_collectives(gm)
    _compare(spec, ref, gm)
    return {"rewritten": len(done), "kinds": [p.kind for p in done], "calls": calls, "refused": refused,
            "skipped": [s.reason for s in skips], "blocks": 2 * len(spec["rounds"]), "hostile": _hostile(spec)}


def check_mixed(spec: dict, group: str, picks: list[int], schedule: str, fused_async: bool) -> dict:
    """Each pair of ``spec``'s graph takes the strategy ``picks`` names for it in turn (0: the fused
    operators where they take it, 1: InterDecom with the first feasible count > 1, 2: as it is), so
    rewrites of both kinds meet in one graph; replayed (fused calls as what they compute) and compared."""
    ref, gm = traced_with_reference(spec, group)
    chosen: list[str] = []
    refused: list[str] = []  # why the fused operators refused a pair drawn for them

    def choose(pair) -> Decision:
        pick = picks[len(chosen) % len(picks)]
        parts = [p for p in pair.feasible_parts() if p > 1]
        why = kind_of(pair).refusals(pair).get("fuse") if pick == 0 else None
        if why is not None:
            refused.append(why)
        if pick == 0 and why is None:
            decision = Decision("fuse", schedule=schedule)
        elif pick < 2 and parts:
            decision = Decision("decompose", parts[0])
        else:
            decision = Decision("sequential")
        chosen.append(decision.strategy)
        return decision

    done, _ = wild_check.rewrite_chosen(gm, choose, fused_async=fused_async)
    calls = wild_check.fused_calls_as_collectives(gm)
    _compare(spec, ref, gm)
    return {"rewritten": len(done), "chosen": chosen, "calls": calls, "refused": refused}


def _compare(spec: dict, ref: fx.GraphModule, gm: fx.GraphModule) -> None:
    inputs = wild_check.local_inputs(ref, spec["world"], seed=1)
    wild_check.assert_same_outputs(wild_check.replay(ref, inputs, spec["world"]),
                                   wild_check.replay(gm, inputs, spec["world"]), rtol=2e-2, atol=2e-2)


def _hostile(spec: dict) -> int:
    """The blocks made hostile on purpose (no pair: left alone)."""
    return sum((rd["gather"]["hostile"] is not None) + (rd["reduce"]["hostile"] is not None) for rd in spec["rounds"])


def differentiable(spec: dict) -> bool:
    """Specs whose every collective has a backward (functional collectives, linear reductions)."""
    return all(rd["gather"]["style"] == "fc" and rd["reduce"]["style"] == "fc" and rd["reduce"]["hostile"] != "max"
               for rd in spec["rounds"])


class SpecModule(torch.nn.Module):
    """The spec's program as a module: every input is a parameter, so the backward graph has the
    transposed pairs (gathers of output gradients, reduce-scatters of input gradients, weight
    gradients as contractions over the gathered rows)."""

    def __init__(self, spec: dict, group: str) -> None:
        super().__init__()
        self.fn, inputs = program(spec, group)
        self.inputs = torch.nn.ParameterList([torch.nn.Parameter(t) for t in inputs])

    def forward(self) -> torch.Tensor:
        outs = self.fn(*self.inputs)
        return sum((o.float() ** 2).sum() for o in outs)


def check_module(spec: dict, group: str, options: dict | None = None) -> dict:
    """Forward and backward graphs of ``SpecModule(spec)``: rewritten (``options``, default chunks=2)
    vs not, replayed (fused calls as what they compute: ``wild_check.fused_calls_as_collectives``)."""
    model = SpecModule(spec, group)
    ref = wild_check.capture(model, (), {"strategy": "off"})
    got = wild_check.capture(model, (), options or {"chunks": 2})
    for gm in got.graphs.values():
        wild_check.fused_calls_as_collectives(gm)
    wild_check.compare_captures(ref, got, spec["world"], seed=3)
    pairs = [p for r in got.reports for p in r.pairs]
    return {"graphs": len(got.graphs), "pairs": len(pairs),
            "rewritten": sum(p.status == "rewritten" for p in pairs),
            "backward_rewritten": sum(p.status == "rewritten" and p.graph == "backward" for p in pairs),
            "not_rewritten": [(p.graph, p.kind, p.status, p.reason) for p in pairs if p.status != "rewritten"]}
