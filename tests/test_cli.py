"""The ``compass-fx`` console script, run as a user would."""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from compass_fx.cli import build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("compass-fx")
    assert exe, "console script compass-fx is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # the console script in a fresh interpreter
def test_explain_prints_the_table():
    out = run_cli("explain", "--world", "2", "--layers", "1", "--dim", "64", "--seq", "16", "--chunks", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decompose(d=2)" in out.stdout and "rewritten" in out.stdout
    assert "left alone:" in out.stdout  # the embedding's collective, with its reason
    assert "legend: group = " in out.stdout  # what "0/2" in the group column means


@pytest.mark.slow  # traces the demo model (in this process: the console script itself is run above)
def test_explain_json_and_topology(capsys):
    status, stdout, stderr = run_main(capsys, "explain", "--world", "2", "--layers", "1", "--dim", "64", "--seq",
                                      "16", "--json", "--topology", "a6000-nvlink-pairs-pcie-8")
    assert status == 0, stderr[-3000:]
    data = json.loads(stdout)
    pairs = [p for g in data["graphs"] for p in g["pairs"]]  # 1 layer: 3+2 forward, 2+3 backward
    assert len(pairs) == 10 and all(p["topology"] == "a6000-nvlink-pairs-pcie-8" for p in pairs)
    assert all(len(p["candidates"]) > 1 for p in pairs)


@pytest.mark.slow  # traces the demo model (in this process)
def test_explain_says_which_reductions_fused_async_defers(capsys):
    """``--fused-async``: the backward's reductions (a weight gradient lies between each and its first
    use) run deferred, labelled ``async``; the forward's, read at once, stay plain calls, and their
    reason says why.  Without the flag no pair is deferred."""
    args = ("explain", "--world", "2", "--layers", "1", "--dim", "64", "--seq", "16", "--no-sequence-parallel",
            "--strategy", "fuse", "--schedule", "direct", "--json")
    status, stdout, stderr = run_main(capsys, *args, "--fused-async")
    assert status == 0, stderr[-3000:]
    pairs = [p for g in json.loads(stdout)["graphs"] for p in g["pairs"] if p["kind"] == "matmul_all_reduce"]
    deferred = {(p["graph"], p["asynchronous"]) for p in pairs if p["status"] == "rewritten"}
    assert deferred == {("forward", False), ("backward", True)}, deferred
    assert all("a plain call, not deferred" in p["reason"] for p in pairs if p["graph"] == "forward"
               and p["status"] == "rewritten")
    status, stdout, stderr = run_main(capsys, *args)
    assert status == 0, stderr[-3000:]
    assert not any(p["asynchronous"] for g in json.loads(stdout)["graphs"] for p in g["pairs"])


@pytest.mark.slow  # traces the demo model (in this process)
def test_explain_every_pair_gives_a_row_per_pair(capsys):
    """Two layers: by default their pairs alike share a row (with the count); ``--every-pair`` lists
    each pair on a row of its own, every collective named once."""
    status, stdout, stderr = run_main(capsys, "explain", "--world", "2", "--layers", "2", "--dim", "64", "--seq",
                                      "16", "--every-pair")
    assert status == 0, stderr[-3000:]
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] in (["forward"], ["backward"])]
    assert len(rows) == 18 and all(r[1] == "1" for r in rows), stdout  # 2 layers: 8+1 forward, 1+8 backward
    assert len({(r[0], r[2]) for r in rows}) == 18 and "like it" not in stdout
    assert not stdout.startswith("18 pairs in")


@pytest.mark.slow  # traces the demo model (in this process)
def test_explain_under_a_cuda_graph_mode_says_how_it_priced(capsys):
    """``--mode reduce-overhead``: the report notes, per graph, that the pairs were priced as CUDA
    graph replays, and every decomposition is priced as one (``Workload.cuda_graphs``: no host
    issue per part), cheaper than issued eagerly.  A bad mode is the usual argparse error."""
    from compass_fx.cost import Topology, Workload
    from compass_fx.cost.strategies import decomposition_models

    status, stdout, stderr = run_main(capsys, "explain", "--world", "2", "--layers", "1", "--dim", "64", "--seq",
                                      "16", "--json", "--mode", "reduce-overhead")
    assert status == 0, stderr[-3000:]
    graphs = json.loads(stdout)["graphs"]
    notes = [n for g in graphs for n in g["notes"] if "replays CUDA graphs" in n]
    assert len(notes) == 2 and all("priced without host issue costs" in n for n in notes), graphs
    checked = 0
    for p in (p for g in graphs for p in g["pairs"]):
        w = Workload(p["kind"], p["m"], p["n"], p["k"], p["dtype"], p["group_size"], matmuls=p["matmuls"],
                     cuda_graphs=True)
        for c in p["candidates"]:
            if c["strategy"] == "decompose":
                price = {graphs_: decomposition_models(replace(w, cuda_graphs=graphs_), Topology.resolve(
                    p["topology"]), allowed=(c["parts"],))[c["parts"]].seconds(c["parts"]) for graphs_ in (True, False)}
                assert c["seconds"] == pytest.approx(price[True], rel=1e-9) and price[True] < price[False], (p, c)
                checked += 1
    assert checked >= 10
    status, _, stderr = run_main(capsys, "explain", "--world", "2", "--mode", "turbo")
    assert status == 2 and "option 'mode' must be one of" in stderr


@pytest.mark.slow  # the console script in a fresh interpreter
def test_explain_bad_option_is_a_clear_error(capsys):
    # in this process (the console script's exit status on bad input: test_bad_number_exit_status_...)
    status, out, err = run_main(capsys, "explain", "--strategy", "fastest")
    assert status == 2 and out == ""
    assert "compass-fx explain: error: option 'strategy' must be one of" in err and "got 'fastest'" in err


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    """``compass-fx argv`` in this process: (exit status, stdout, stderr)."""
    try:
        status = main(list(argv))
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_no_parser_accepts_abbreviations(capsys):
    parsers = list(all_parsers(build_parser()))
    assert len(parsers) == 6 and not any(p.allow_abbrev for p in parsers)
    status, _, err = run_main(capsys, "sweep", "--out", "sweep.csv")  # not a silent --out-dir
    assert status == 2 and "unrecognized arguments: --out sweep.csv" in err


@pytest.mark.parametrize("argv, message", [
    (["plan", "--tokens", "-5", "--no-png"],
     "compass-fx plan: error: argument --tokens: must be a positive integer, got -5"),
    (["plan", "--tokens", "0", "--no-png"],
     "compass-fx plan: error: argument --tokens: must be a positive integer, got 0"),
    (["plan", "--tp", "two"], "compass-fx plan: error: argument --tp: must be a positive integer, got 'two'"),
    (["plan", "--tp", "3", "--no-png"], "compass-fx plan: error: tokens=8192 must be divisible by tp=3"),
    (["sweep", "--group-sizes", "8,0"], "compass-fx sweep: error: argument --group-sizes: must be comma-separated "
                                        "positive integers, got '8,0'"),
    (["explain", "--world", "0"], "compass-fx explain: error: argument --world: must be a positive integer, got 0"),
    (["explain", "--seq", "63"], "compass-fx explain: error: argument --seq: must be a multiple of --world (4) "
                                 "with sequence parallelism, got 63"),
    (["explain", "--heads", "6", "--dim", "192"], "compass-fx explain: error: argument --heads: must be a multiple "
                                                  "of --world (4), got 6"),
    (["explain", "--chunks", "0"], "compass-fx explain: error: argument --chunks: must be a positive integer, got 0"),
    (["explain", "--strategy", "fastest"], "compass-fx explain: error: option 'strategy' must be one of"),
])
def test_bad_numbers_are_argparse_errors(capsys, argv, message):
    status, out, err = run_main(capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err  # one line, the usage one --help away
    assert "Workload" not in err and "Traceback" not in err


def test_an_unknown_option_close_to_a_known_one_is_named(capsys):
    status, _, err = run_main(capsys, "sweep", "--out", "sweep.csv")
    assert status == 2 and err.count("\n") == 1
    assert "unrecognized arguments: --out sweep.csv (did you mean --out-dir?)" in err


@pytest.mark.parametrize("argv", [["sweep", "--no-progress", "--out-dir", "/proc/compass-x"],
                                  ["sweep", "--no-progress", "--out-dir", "{file}"],
                                  ["plan", "--png", "/proc/compass-x/plan.png"],
                                  ["plan", "--out-dir", "{file}/sub"]])
def test_paths_that_cannot_be_written_are_one_line_with_status_3(capsys, tmp_path, argv):
    """An unwritable or not-a-directory path fails before any planning (nothing on stdout), in one
    line naming the path, exit status 3 (the CLI's docstring lists the statuses)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [a.replace("{file}", str(blocker)) for a in argv]
    status, out, err = run_main(capsys, *argv)
    assert status == 3 and out == "", (out, err)
    assert err.startswith(f"compass-fx {argv[0]}: error: cannot use ") and err.count("\n") == 1, err


def test_a_missing_dependency_is_one_line_with_status_4_and_debug_shows_the_traceback(capsys, monkeypatch):
    import compass_fx.tools.commands as commands

    def needs_something(args):
        raise ImportError("this needs matplotlib: pip install 'compass-fx[plot]'")

    monkeypatch.setattr(commands, "cmd_sweep", needs_something)
    status, _, err = run_main(capsys, "sweep")
    assert status == 4 and err == "compass-fx sweep: error: this needs matplotlib: pip install 'compass-fx[plot]'\n"
    with pytest.raises(ImportError):
        main(["sweep", "--debug"])


def test_an_unexpected_error_says_how_to_see_the_traceback(capsys, monkeypatch):
    import compass_fx.tools.commands as commands

    monkeypatch.setattr(commands, "cmd_sweep", lambda args: {}["missing"])
    status, _, err = run_main(capsys, "sweep")
    assert status == 1 and err.count("\n") == 1 and "KeyError" in err and "--debug" in err


@pytest.mark.slow  # the console script in a fresh interpreter
def test_bad_number_exit_status_of_the_console_script():
    out = run_cli("plan", "--tokens", "-5", "--no-png")
    assert out.returncode == 2 and out.stdout == ""
    assert "compass-fx plan: error: argument --tokens: must be a positive integer, got -5" in out.stderr


def test_plan_without_matplotlib_is_a_note(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what "import matplotlib" meets when it is not installed
    png = tmp_path / "plan.png"
    status, out, err = run_main(capsys, "plan", "--tp", "4", "--tokens", "4096", "--png", str(png))
    assert status == 0 and "layer: sequential" in out and not png.exists()
    lines = err.splitlines()  # the provenance note, then the one about the missing extra
    assert all(line.startswith("compass-fx plan: note: ") for line in lines), err
    assert len([line for line in lines if "matplotlib" in line]) == 1 and len(lines) == 2, err


@pytest.mark.slow  # the console script in a fresh interpreter
def test_commands_import_without_warnings():
    # -W error: an import-time warning (numpy's "Failed to initialize NumPy" from torch) fails it.
    # And without Dynamo: the package and its commands load it only when something compiles.
    script = "import sys, compass_fx.cli; print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))"
    out = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == "[]\n", out.stdout[:300]
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert any(d.startswith("numpy") for d in pyproject["project"]["dependencies"])  # torch does not declare it


def test_progress_in_a_log_is_plain_lines():
    """stderr redirected to a file: a few whole lines, no carriage returns; on a terminal, one
    bar redrawn in place."""
    import io

    from compass_fx.tools.sweep import progress_bar

    log = io.StringIO()
    update = progress_bar(log)
    for done in range(289):
        update(done, 288)
    assert "\r" not in log.getvalue() and log.getvalue().splitlines()[-1] == "sweep: 288/288 configurations planned"
    assert len(log.getvalue().splitlines()) == 4

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    update = progress_bar(tty)
    for done in range(289):
        update(done, 288)
    assert tty.getvalue().count("\r") == 41 and tty.getvalue().endswith("288/288\n")


@pytest.mark.slow  # may build the C++ extension (~20 s) where no build is cached
def test_prepare_builds_the_host_fast_path_ahead_and_says_where(capsys):
    from compass_fx.kernels.cuda import lane

    cached = lane.is_cached()
    status, out, err = run_main(capsys, "prepare")
    assert status == 0 and err == "", err
    if not cached:  # said before the build starts, then how long it took
        building, out = out.split("\n", 1)
        assert building.startswith("building the host fast path (") and building.endswith(" ..."), building
        assert out.startswith("host fast path built in "), out
    assert out.startswith("host fast path ") and str(lane.build_directory()) in out, out
    assert lane.is_cached()
    status, out, _ = run_main(capsys, "prepare")  # the second time from the cache
    assert status == 0 and out.startswith("host fast path loaded from the cache: "), out


@pytest.mark.parametrize("cached", [False, True])
def test_prepare_without_a_compiler_is_one_line_with_status_4(capsys, monkeypatch, cached):
    """A build that fails is one line on stderr and exit status 4, on a machine's first prepare
    (which says first that it is building) as on a later one.  Until 2026-12-07 the test took the
    cache as it found it, and failed where no earlier test had built the fast path (the fast tier
    on a fresh machine)."""
    from compass_fx.kernels.cuda import lane

    def no_compiler():
        raise RuntimeError("Error building extension 'compass_lane': g++: not found\nmore lines")

    monkeypatch.setattr(lane, "compile_module", no_compiler)
    monkeypatch.setattr(lane, "is_cached", lambda: cached)
    status, out, err = run_main(capsys, "prepare")
    assert status == 4 and err.count("\n") == 1, err
    if cached:
        assert out == "", out
    else:
        assert out.startswith("building the host fast path (") and out.endswith(" ...\n") and out.count("\n") == 1, out
    assert err.startswith("compass-fx prepare: error: the host fast path cannot be built here (RuntimeError: "
                          "Error building extension 'compass_lane': g++: not found); fused calls take the Python "
                          "path"), err
