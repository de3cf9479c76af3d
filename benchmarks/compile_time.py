"""What compiling a model with the compass pass costs, as the model grows (issue 26).

The demo transformer (``compass_fx.demo``, sequence parallelism over a 4-rank fake process group:
tracing only, no numbers) at 2 to 64 layers, compiled forward and backward with the pass off
(``strategy="off"``: the pairs are still found and reported), ``auto`` (the cost model decides; on
CPU it keeps most pairs sequential) and forced decomposition (``chunks=2``: every pair rewritten,
the most work the pass can do).  Each configuration runs in a fresh process, with one intra-op
thread (the shared CPU machine's cores are contended: more threads only add noise).

Times (wall clock, seconds):

* ``pass``: inside the compass pass (``GraphReport.pass_seconds``, forward + backward);
* ``compile``: the backend's whole compile of the graph dynamo captured: AOTAutograd (forward,
  backward and the partition), the pass, and the inner compiler (``--inner``: "eager", as
  ``compass_fx.explain`` compiles, or "inductor");
* ``first call``: the compiled model's first forward call (dynamo's tracing, the compile, one run).

The machine's other load shows as noise: the modes of one layer count take turns, and the summary
compares the best of the repeats.

    python benchmarks/compile_time.py                  # 2..64 layers, writes compile_time-cpu.{json,md}
    python benchmarks/compile_time.py --layers 2,4,8   # a subset
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import output  # noqa: E402

NAME = "compile_time"
LAYERS = (2, 4, 8, 16, 32, 64)
MODES = {"off": {"strategy": "off"}, "auto": {"strategy": "auto"}, "decompose": {"chunks": 2}}
WORLD, TOKENS = 4, (2, 16)


def measure(layers: int, mode: str, inner: str) -> dict:
    """Compile the demo at ``layers`` with ``mode``'s options (in this process) and time it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import compass_fx.backend as backend
    from compass_fx.demo import ModelArgs, Transformer, parallelize
    from compass_fx.options import parse_options

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = parallelize(Transformer(ModelArgs(n_layers=layers)), mesh, sequence_parallel=True)
    tokens = torch.randint(0, 256, TOKENS, generator=torch.Generator().manual_seed(0))
    opts = parse_options({**MODES[mode], "inner": inner})
    nodes: dict[str, int] = {}
    compile_s: list[float] = []
    real_pass = backend.compass_pass

    def counting_pass(gm, kind, *args, **kwargs):
        nodes[kind] = len(gm.graph.nodes)
        return real_pass(gm, kind, *args, **kwargs)

    def timed_backend(gm, example_inputs):
        started = time.perf_counter()
        compiled = backend.compile_graph(gm, example_inputs, opts)
        compile_s.append(time.perf_counter() - started)
        return compiled

    backend.compass_pass = counting_pass
    try:
        compiled = torch.compile(model, backend=timed_backend, fullgraph=True)
        started = time.perf_counter()
        with backend.collect_reports() as reports, \
                torch._functorch.config.patch(force_non_lazy_backward_lowering=True), torch.enable_grad():
            compiled(tokens)
        first_call = time.perf_counter() - started
    finally:
        backend.compass_pass = real_pass
        dist.destroy_process_group()
    pairs = [p for r in reports for p in r.pairs]
    return {"layers": layers, "mode": mode, "inner": inner,
            "nodes_forward": nodes.get("forward"), "nodes_backward": nodes.get("backward"),
            "pairs": len(pairs), "rewritten": sum(p.status == "rewritten" for p in pairs),
            "pass_s": round(sum(r.pass_seconds or 0.0 for r in reports), 3),
            "compile_s": round(sum(compile_s), 3), "first_call_s": round(first_call, 3)}


def run_fresh(layers: int, mode: str, inner: str, timeout: float) -> dict:
    """``measure`` in a fresh Python process (no dynamo cache, no warm fake-tensor cache)."""
    cmd = [sys.executable, __file__, "--one", json.dumps([layers, mode, inner])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "mode": mode, "inner": inner, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"layers": layers, "mode": mode, "inner": inner,
                "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:] or ''}"}
    return json.loads(lines[-1])


def measure_here(layers: int, mode: str, inner: str) -> dict:
    """``measure`` in this process (the dry run: the script's every step, without a fresh
    interpreter's start per row); dynamo's cache is cleared first so each row compiles."""
    import torch

    torch._dynamo.reset()
    try:
        return measure(layers, mode, inner)
    except Exception as e:  # noqa: BLE001 - a row's failure is its outcome, as in a fresh process
        return {"layers": layers, "mode": mode, "inner": inner, "error": f"{type(e).__name__}: {e}"}


def summary(rows: list[dict]) -> dict:
    """The issue's goals, read off the rows (best of the repeats per configuration)."""
    best: dict[tuple[int, str], dict] = {}
    for r in rows:
        key = (r["layers"], r["mode"])
        if "error" not in r and (key not in best or r["compile_s"] < best[key]["compile_s"]):
            best[key] = r
    out: dict = {"added_compile": {}, "pass_s": {}}
    for (layers, mode), r in sorted(best.items()):
        off = best.get((layers, "off"))
        if off and mode != "off":
            out["added_compile"][f"{layers}/{mode}"] = round(r["compile_s"] / off["compile_s"] - 1, 3)
        out["pass_s"][f"{layers}/{mode}"] = r["pass_s"]
    d8, d64 = best.get((8, "decompose")), best.get((64, "decompose"))
    if d8 and d64 and d8["pass_s"]:
        out["pass_growth_8_to_64"] = round(d64["pass_s"] / d8["pass_s"], 2)  # linear: 8.0
    return out


def markdown(payload: dict) -> str:
    env = payload["environment"]
    rows = [dict(r, nodes=f"{r.get('nodes_forward')} / {r.get('nodes_backward')}") for r in payload["rows"]]
    s = payload["summary"]
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"The demo transformer with sequence parallelism on a {WORLD}-rank fake process group, tokens "
             f"{list(TOKENS)}, compiled forward and backward (inner compiler: {payload['inner']}), one fresh process "
             f"per row, one intra-op thread; torch {env['torch']}, {env.get('cpus')} CPUs (shared), commit "
             f"{env['commit']}.  Seconds, wall clock.  `compile`: the backend's compile (AOTAutograd, the pass, the "
             "inner compiler); `first call`: dynamo's tracing, the compile and one forward run.", "",
             output.markdown_table(rows, ["layers", "mode", ("nodes", "nodes fw / bw"), "pairs", "rewritten",
                                          ("pass_s", "pass"), ("compile_s", "compile"),
                                          ("first_call_s", "first call"), "error"]), "",
             "Compile time added over the pass off (same layers; best of the repeats):", "",
             output.markdown_table([{"config": k, "added": f"{v:+.1%}"} for k, v in s["added_compile"].items()],
                                   [("config", "layers / mode"), "added"])]
    if "pass_growth_8_to_64" in s:
        lines += ["", f"Pass time, forced decomposition, 64 layers over 8 layers: {s['pass_growth_8_to_64']}x "
                      "(linear growth: 8x)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=",".join(map(str, LAYERS)), help="comma-separated layer counts")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration (fresh processes)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one configuration may take")
    p.add_argument("--dry-run", action="store_true",
                   help="1 layer, one run per mode, in this process (not a fresh one): checks the script")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: [layers, mode, inner], measured in this process
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*json.loads(args.one))), flush=True)
        return 0
    layers = [1] if args.dry_run else [int(x) for x in args.layers.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    rows, t0 = [], time.time()
    total = len(layers) * len(modes) * args.repeats
    for n in layers:
        for _ in range(args.repeats):
            for mode in modes:  # the modes take turns: a slow spell of the shared machine hits them all
                row = measure_here(n, mode, args.inner) if args.dry_run else run_fresh(n, mode, args.inner, args.timeout)
                rows.append(row)
                print(f"[{len(rows)}/{total}] {n} layers, {mode}: pass {row.get('pass_s')} s, compile "
                      f"{row.get('compile_s')} s, first call {row.get('first_call_s')} s {row.get('error', '')} "
                      f"({time.time() - t0:.0f} s elapsed)", flush=True)
    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(args.dry_run),
               "inner": args.inner, "world": WORLD, "tokens": list(TOKENS), "repeats": args.repeats,
               "seconds": round(time.time() - t0, 1), "rows": rows, "summary": summary(rows)}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
