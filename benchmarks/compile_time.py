"""What compiling a model with the compass pass costs, as the model and the group grow (issue 26).

The demo transformer (``compass_fx.demo``, sequence parallelism over a fake process group of 2, 4 or
8 ranks: tracing only, no numbers) at 2 to 64 layers, compiled forward and backward with the pass
off (``strategy="off"``: the pairs are still found and reported), ``auto`` (the cost model decides;
on CPU it keeps most pairs sequential), forced decomposition into two parts (``decompose``:
``chunks=2``, every pair rewritten), into one part per rank (``parts``: what grows with the group)
and the fused operators (``fuse``; ``fuse_async`` with ``fused_async``: the reductions started early,
spread and priced as deferred). Each rank's share of the sequence has as many tokens as ranks (a
sequence of at least 16) so that every pair can split into one part per rank, and the model has as
many heads as ranks (at least four). Each configuration runs in a fresh process, with one intra-op
thread (the shared CPU machine's cores are contended: more threads only add noise).
``--model torchtitan`` compiles torchtitan's Llama-3 instead, and ``torchtitan-checkpointed`` the same
with every layer checkpointed (its backward graph matches pairs again after rewrites: ``build``).

Times (wall clock, seconds):

* ``pass``: inside the compass pass (``GraphReport.pass_seconds``, forward + backward);
* ``compile``: the backend's whole compile of the graph dynamo captured: AOTAutograd (forward,
  backward and the partition), the pass, and the inner compiler (``--inner``: "eager", as
  ``compass_fx.explain`` compiles, or "inductor");
* ``first call``: the compiled model's first forward call (dynamo's tracing, the compile, one run);
* ``report``: formatting the explain report of the graphs compiled (``Report.format``: what
  ``compass-fx explain`` prints), beside its length in lines (pairs alike share a row: it should
  not grow with the layers).

Memory (MiB, resident, Linux's ``/proc/self/status``): ``peak``, the process's high-water mark
through the compile and first call (reset once the model is built: ``/proc/self/clear_refs``);
``compile peak``, that over the memory the process held then (the graphs, the pass's work, the
inner compiler's).  A pass whose memory grew faster than the graphs it writes would show in the
summary: the compile peak from 8 to 64 layers, and the peak over the pass off.  (Not
``getrusage``'s high-water mark: a process started by another carries its parent's from the fork.)

The machine's other load shows as noise: the modes of one layer count take turns, and the summary
compares the best of the repeats.

    python benchmarks/compile_time.py                  # 2..64 layers, writes compile_time-cpu.{json,md}
    python benchmarks/compile_time.py --layers 2,4,8   # a subset
    python benchmarks/compile_time.py --worlds 2,4,8 --modes off,auto,parts,fuse   # the group's growth
    python benchmarks/compile_time.py --model torchtitan-checkpointed --layers 8,16,32,64   # pairs matched again
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import output  # noqa: E402

NAME = "compile_time"
LAYERS = (2, 4, 8, 16, 32, 64)
MODES = {"off": {"strategy": "off"}, "auto": {"strategy": "auto"}, "decompose": {"chunks": 2},
         "parts": {"strategy": "decompose"}, "fuse": {"strategy": "fuse"},
         "fuse_async": {"strategy": "fuse", "fused_async": True}}
DEFAULT_MODES = ("off", "auto", "decompose")
WORLDS, BATCH = (4,), 2


MODEL_TEXT = {"demo": "The demo transformer", "torchtitan": "torchtitan's Llama-3 (debug model, its TP plan)",
              "torchtitan-checkpointed": "torchtitan's Llama-3 (debug model, its TP plan, every layer checkpointed)",
              "torchao-float8-tensorwise": "A stack of float8 blocks (torchao's tensorwise recipe and float8 TP styles)",
              "torchao-float8-rowwise": "A stack of float8 blocks (torchao's row-wise recipe, plain TP styles)"}
MODELS = tuple(MODEL_TEXT)
TESTS = Path(__file__).resolve().parents[1] / "tests"


def tokens_shape(world: int) -> tuple[int, int]:
    """The input at ``world`` ranks: each rank's share of the sequence as many tokens as ranks (so
    that every pair can split its rows into one part per rank), at least 16 in all."""
    return (BATCH, max(16, world * world))


def build(model: str, layers: int, world: int):
    """The model to compile, its tokens and the context its call needs.  ``demo``: this package's
    transformer (as many heads as ranks, at least four).  ``torchtitan``: torchtitan 0.3.0's
    Llama-3 debug model and TP plan with sequence parallelism, built as the tests build it
    (``tests/real_torchtitan.py``: its 6 layers repeated to ``layers``); ``-checkpointed``: every
    layer under activation checkpointing, whose backward graph has pairs matched again.
    ``torchao-float8-*``: ``tests/torchao_stack.py``'s float8 layers (torchao's recipe), each rank
    holding as many rows as the demo's tokens give it."""
    import contextlib

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    if model == "demo":
        from compass_fx.demo import ModelArgs, Transformer, parallelize

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        module = parallelize(Transformer(ModelArgs(n_layers=layers, n_heads=max(4, world))), mesh,
                             sequence_parallel=True)
        tokens = torch.randint(0, 256, tokens_shape(world), generator=torch.Generator().manual_seed(0))
        return module, tokens, contextlib.nullcontext()
    sys.path.insert(0, str(TESTS))
    if model.startswith("torchao-float8-"):
        import torchao_stack

        mesh = init_device_mesh("cpu", (world,))
        module = torchao_stack.build(model.removeprefix("torchao-float8-"), layers, mesh)
        batch, seq = tokens_shape(world)
        return module, torchao_stack.tokens(batch * seq // world), contextlib.nullcontext()  # a rank's rows
    import real_torchtitan as rt

    module = rt.build_llama3(world, True, layers=layers, checkpoint=model.endswith("-checkpointed"))
    tokens = rt.tokens(*tokens_shape(world))
    return module, tokens, rt.spmd_context(module, tokens)


def resident_mib(field: str) -> float | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (its high-water mark) of this process, in MiB; None
    where the kernel has no ``/proc`` status."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Restart this process's resident high-water mark from what it holds now (Linux 4.0 and
    later); False where it cannot (the peak then includes what came before)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(layers: int, mode: str, inner: str, world: int = 4, model: str = "demo") -> dict:
    """Compile ``model`` at ``layers`` over ``world`` fake ranks with ``mode``'s options (in this
    process) and time it."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import compass_fx.backend as backend
    from compass_fx.options import parse_options
    from compass_fx.report import Report

    torch.set_num_threads(1)
    opts = parse_options({**MODES[mode], "inner": inner})
    nodes: dict[str, int] = {}
    nodes_out: dict[str, int] = {}
    compile_s: list[float] = []
    real_pass = backend.compass_pass

    def counting_pass(gm, kind, *args, **kwargs):
        nodes[kind] = len(gm.graph.nodes)
        out = real_pass(gm, kind, *args, **kwargs)
        nodes_out[kind] = len(gm.graph.nodes)
        return out

    def timed_backend(gm, example_inputs):
        started = time.perf_counter()
        compiled = backend.compile_graph(gm, example_inputs, opts)
        compile_s.append(time.perf_counter() - started)
        return compiled

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    backend.compass_pass = counting_pass
    try:  # a row that fails, building its model included, leaves no group behind for the next row
        module, tokens, context = build(model, layers, world)
        compiled = torch.compile(module, backend=timed_backend, fullgraph=True)
        held = resident_mib("VmRSS") if reset_peak() else None
        started = time.perf_counter()
        with backend.collect_reports() as reports, context, \
                torch._functorch.config.patch(force_non_lazy_backward_lowering=True), torch.enable_grad():
            compiled(tokens)
        first_call = time.perf_counter() - started
        peak = resident_mib("VmHWM") if held is not None else None
    finally:
        backend.compass_pass = real_pass
        dist.destroy_process_group()
    pairs = [p for r in reports for p in r.pairs]
    started = time.perf_counter()
    text = Report(graphs=list(reports)).format()
    report_s = time.perf_counter() - started
    return {"model": model, "world": world, "layers": layers, "mode": mode, "inner": inner,
            "tokens": list(tokens_shape(world)),
            "nodes_forward": nodes.get("forward"), "nodes_backward": nodes.get("backward"),
            "nodes_out": sum(nodes_out.values()),
            "pairs": len(pairs), "rewritten": sum(p.status == "rewritten" for p in pairs),
            "pass_s": round(sum(r.pass_seconds or 0.0 for r in reports), 3),
            "compile_s": round(sum(compile_s), 3), "first_call_s": round(first_call, 3),
            "report_s": round(report_s, 4), "report_lines": len(text.splitlines()),
            "peak_mib": None if peak is None else round(peak),
            "compile_peak_mib": None if peak is None else round(peak - held)}


def _failed(layers: int, mode: str, inner: str, world: int, model: str, error: str) -> dict:
    """The row of a configuration that could not be measured."""
    return {"model": model, "world": world, "layers": layers, "mode": mode, "inner": inner, "error": error}


def run_fresh(layers: int, mode: str, inner: str, world: int, model: str, timeout: float) -> dict:
    """``measure`` in a fresh Python process (no dynamo cache, no warm fake-tensor cache)."""
    config = [layers, mode, inner, world, model]
    cmd = [sys.executable, __file__, "--one", json.dumps(config)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return _failed(*config, f"timed out after {timeout:.0f} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return _failed(*config, f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}")
    return json.loads(lines[-1])


def measure_here(layers: int, mode: str, inner: str, world: int, model: str) -> dict:
    """``measure`` in this process (the dry run: the script's every step, without a fresh
    interpreter's start per row); dynamo's cache is cleared first so each row compiles."""
    import torch

    torch._dynamo.reset()
    try:
        return measure(layers, mode, inner, world, model)
    except Exception as e:  # noqa: BLE001 - a row's failure is its outcome, as in a fresh process
        return _failed(layers, mode, inner, world, model, f"{type(e).__name__}: {e}")


def _ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` where both are counts or times above zero (a rewrite that leaves fewer nodes than
    it found, as fusing does, has no growth to compare)."""
    return round(a / b, 2) if a is not None and b is not None and a > 0 and b > 0 else None


def _added(row: dict) -> int | None:
    """The nodes the pass added to a row's graphs (what its rewrites wrote, less what they erased)."""
    if row.get("nodes_out") is None or None in (row.get("nodes_forward"), row.get("nodes_backward")):
        return None
    return row["nodes_out"] - row["nodes_forward"] - row["nodes_backward"]


def summary(rows: list[dict]) -> dict:
    """What the rows say about growth (best of the repeats per configuration): the compile added
    over the pass off; the pass from 8 to 64 layers (linear: 8x) per group size and mode; and the
    pass from the smallest group to the largest per layer count and mode, beside the growth of the
    graph it leaves and of the nodes it added (forward and backward): a pass that grows no faster
    than what it writes is linear in its work."""
    best: dict[tuple[int, int, str], dict] = {}
    for r in rows:
        key = (r.get("world", 4), r["layers"], r["mode"])
        if "error" not in r and (key not in best or r["compile_s"] < best[key]["compile_s"]):
            best[key] = r
    out: dict = {"added_compile": {}, "pass_s": {}, "pass_growth_8_to_64": {}, "report_growth_8_to_64": {},
                 "pass_growth_with_world": {}, "peak_over_off_mib": {}, "compile_peak_growth_8_to_64": {}}
    for (world, layers, mode), r in sorted(best.items()):
        name = f"w{world}/{layers}/{mode}"
        off = best.get((world, layers, "off"))
        if off and mode != "off":
            out["added_compile"][name] = round(r["compile_s"] / off["compile_s"] - 1, 3)
            if r.get("peak_mib") is not None and off.get("peak_mib") is not None:
                out["peak_over_off_mib"][name] = r["peak_mib"] - off["peak_mib"]
        out["pass_s"][name] = r["pass_s"]
    worlds = sorted({w for w, _, _ in best})
    modes = sorted({m for _, _, m in best})
    for world in worlds:
        for mode in modes:
            d8, d64 = best.get((world, 8, mode)), best.get((world, 64, mode))
            if d8 and d64 and (growth := _ratio(d64["pass_s"], d8["pass_s"])):
                out["pass_growth_8_to_64"][f"w{world}/{mode}"] = growth
            if d8 and d64 and (growth := _ratio(d64.get("compile_peak_mib"), d8.get("compile_peak_mib"))):
                out["compile_peak_growth_8_to_64"][f"w{world}/{mode}"] = {
                    "growth": growth, "mib": [d8["compile_peak_mib"], d64["compile_peak_mib"]]}
            if d8 and d64 and d8.get("report_s") is not None:
                out["report_growth_8_to_64"][f"w{world}/{mode}"] = {
                    "time": _ratio(d64["report_s"], d8["report_s"]),
                    "lines": [d8["report_lines"], d64["report_lines"]]}
    if len(worlds) > 1:
        small, large = worlds[0], worlds[-1]
        for layers in sorted({n for _, n, _ in best}):
            for mode in modes:
                a, b = best.get((small, layers, mode)), best.get((large, layers, mode))
                if a and b and (growth := _ratio(b["pass_s"], a["pass_s"])):
                    out["pass_growth_with_world"][f"{layers}/{mode}"] = {
                        "worlds": [small, large], "pass": growth,
                        "nodes_out": _ratio(b.get("nodes_out"), a.get("nodes_out")),
                        "nodes_added": _ratio(_added(b), _added(a))}
    return out


def _input_text(payload: dict) -> str:
    """What one call takes: the demo's and torchtitan's tokens, or the float8 stack's rows per rank."""
    shapes = {w: tokens_shape(w) for w in payload["worlds"]}
    if payload.get("model", "demo").startswith("torchao"):
        return "rows per rank " + str([b * s // w for w, (b, s) in shapes.items()])
    return f"tokens {[list(x) for x in shapes.values()]}"


def markdown(payload: dict) -> str:
    env = payload["environment"]
    rows = [dict(r, nodes=f"{r.get('nodes_forward')} / {r.get('nodes_backward')}") for r in payload["rows"]]
    s = payload["summary"]
    worlds = ", ".join(map(str, payload["worlds"]))
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"{MODEL_TEXT[payload.get('model', 'demo')]} with sequence parallelism on a fake process group of "
             f"{worlds} ranks, {_input_text(payload)}, compiled forward and backward (inner compiler: "
             f"{payload['inner']}), one fresh process per row, one intra-op thread; torch {env['torch']}, "
             f"{env.get('cpus')} CPUs (shared), commit {env['commit']}.  Seconds, wall clock.  `pass`: inside the "
             "compass pass; `compile`: the backend's compile (AOTAutograd, the pass, the inner compiler); `first "
             "call`: dynamo's tracing, the compile and one forward run; `nodes out`: the graphs the pass leaves, "
             "forward and backward together; `report`: formatting the explain report of those graphs, and its "
             "length in lines; `peak MiB`: the process's resident high-water mark through the compile and "
             "first call, `compile peak`: that over what the process held with the model built.", "",
             output.markdown_table(rows, ["world", "layers", "mode", ("nodes", "nodes fw / bw"), "pairs", "rewritten",
                                          ("nodes_out", "nodes out"), ("pass_s", "pass"), ("compile_s", "compile"),
                                          ("first_call_s", "first call"), ("report_s", "report"),
                                          ("report_lines", "report lines"), ("peak_mib", "peak MiB"),
                                          ("compile_peak_mib", "compile peak MiB"), "error"]), "",
             "Compile time added over the pass off (same ranks and layers; best of the repeats):", "",
             output.markdown_table([{"config": k, "added": f"{v:+.1%}"} for k, v in s["added_compile"].items()],
                                   [("config", "ranks / layers / mode"), "added"])]
    if s["pass_growth_8_to_64"]:
        lines += ["", "Pass time, 64 layers over 8 layers (linear growth: 8x):", "",
                  output.markdown_table([{"config": k, "growth": f"{v}x"} for k, v in s["pass_growth_8_to_64"].items()],
                                        [("config", "ranks / mode"), "growth"])]
    if s.get("compile_peak_growth_8_to_64"):
        lines += ["", "Memory the compile and first call raised the high-water mark by, 64 layers over 8 (linear: 8x):",
                  "", output.markdown_table(
                      [{"config": k, "growth": f"{v['growth']}x", "mib": " -> ".join(map(str, v["mib"]))}
                       for k, v in s["compile_peak_growth_8_to_64"].items()],
                      [("config", "ranks / mode"), "growth", ("mib", "MiB, 8 -> 64 layers")])]
    if s.get("peak_over_off_mib"):
        lines += ["", "High-water mark over the pass off (same ranks and layers; MiB):", "",
                  output.markdown_table([{"config": k, "mib": f"{v:+d}"} for k, v in s["peak_over_off_mib"].items()],
                                        [("config", "ranks / layers / mode"), ("mib", "MiB")])]
    if s.get("report_growth_8_to_64"):
        lines += ["", "The explain report, 64 layers over 8 layers (its time; its lines, which pairs alike share):", "",
                  output.markdown_table([{"config": k, "time": f"{v['time']}x" if v["time"] else None,
                                          "lines": " -> ".join(map(str, v["lines"]))}
                                         for k, v in s["report_growth_8_to_64"].items()],
                                        [("config", "ranks / mode"), "time", ("lines", "lines, 8 -> 64 layers")])]
    if s["pass_growth_with_world"]:
        lines += ["", "Pass time and the nodes it leaves, the largest group over the smallest (same layers and mode):",
                  "", output.markdown_table(
                      [{"config": k, "worlds": " over ".join(map(str, v["worlds"][::-1])), "pass": f"{v['pass']}x",
                        "nodes": f"{v['nodes_out']}x" if v["nodes_out"] else None,
                        "added": f"{v['nodes_added']}x" if v.get("nodes_added") else None}
                       for k, v in s["pass_growth_with_world"].items()],
                      [("config", "layers / mode"), ("worlds", "ranks"), "pass", ("nodes", "nodes out"),
                       ("added", "nodes added")])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=",".join(map(str, LAYERS)), help="comma-separated layer counts")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated fake group sizes")
    p.add_argument("--model", default="demo", choices=MODELS,
                   help="the transformer to compile (torchtitan's: needs torchtitan 0.3.0 installed)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (fresh processes)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one configuration may take")
    p.add_argument("--dry-run", action="store_true",
                   help="1 layer, one run per mode and group size, in this process (not a fresh one): "
                        "checks the script")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: [layers, mode, inner, world, model], measured here
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*json.loads(args.one))), flush=True)
        return 0
    if args.model.startswith("torchtitan") and importlib.util.find_spec("torchtitan") is None:
        p.error(f"--model {args.model} needs torchtitan 0.3.0: pip install --no-deps torchtitan==0.3.0 "
                "(and the test extra, the two of its dependencies its model imports)")
    if args.model.startswith("torchao") and importlib.util.find_spec("torchao") is None:
        p.error(f"--model {args.model} needs torchao: the test extra (pip install -e '.[test]')")
    layers = [1] if args.dry_run else [int(x) for x in args.layers.split(",")]
    worlds = [int(x) for x in args.worlds.split(",")]
    if any(w < 2 for w in worlds):
        p.error(f"--worlds: a group has at least 2 ranks, got {worlds}")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    rows, t0 = [], time.time()
    total = len(worlds) * len(layers) * len(modes) * args.repeats
    for world in worlds:
        for n in layers:
            for _ in range(args.repeats):
                for mode in modes:  # the modes take turns: a slow spell of the shared machine hits them all
                    row = (measure_here(n, mode, args.inner, world, args.model) if args.dry_run
                           else run_fresh(n, mode, args.inner, world, args.model, args.timeout))
                    rows.append(row)
                    print(f"[{len(rows)}/{total}] {world} ranks, {n} layers, {mode}: pass {row.get('pass_s')} s, "
                          f"compile {row.get('compile_s')} s, first call {row.get('first_call_s')} s "
                          f"{row.get('error', '')} ({time.time() - t0:.0f} s elapsed)", flush=True)
    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(args.dry_run),
               "model": args.model, "inner": args.inner, "worlds": worlds, "repeats": args.repeats,
               "seconds": round(time.time() - t0, 1), "rows": rows, "summary": summary(rows)}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
