"""The plan, sweep and calibrate subcommands, driven through a small argparse parser."""
import argparse
import csv
import json

import pytest

from compass_fx.tools.commands import add_subcommands
from compass_fx.tools.sweep import SweepConfig


def run(*argv):
    parser = argparse.ArgumentParser(prog="compass-fx")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_plan_prints_the_layer_table(capsys):
    assert run("plan", "--model", "llama3-70b", "--tp", "8", "--tokens", "8192",
               "--topology", "a6000-nvlink-pairs-pcie-8", "--no-png") == 0
    out = capsys.readouterr().out
    assert "llama3-70b tp=8 tokens=8192 on a6000-nvlink-pairs-pcie-8" in out
    for name in ("attn.qkv", "attn.out", "mlp.w1+w3", "mlp.w2"):
        assert name in out
    assert "layer: sequential" in out


def test_plan_json_without_fused_operators(capsys):
    assert run("plan", "--model", "llama3-8b", "--tp", "4", "--tokens", "4096", "--fused", "none",
               "--json", "--no-png", "--backward") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["topology"] == "h200-nvswitch-8" and len(data["pairs"]) == 8
    assert all(not label.startswith("fuse") for p in data["pairs"] for label in p["candidates"])


def test_plan_prices_a_gathers_parts_as_replayed_as_the_compiler_does(capsys, monkeypatch):
    """By default (COMPASS_PARTS_REPLAY on) plan prices an eager gather's extra parts as replayed
    from one CUDA graph, as the compiler does on NCCL, and says so; the reductions' parts, and every
    part with COMPASS_PARTS_REPLAY=0, as issued."""
    common = ("plan", "--model", "llama3-8b", "--tp", "8", "--tokens", "16384", "--topology",
              "h200-nvswitch-8", "--fused", "none", "--json", "--no-png", "--backward")
    monkeypatch.delenv("COMPASS_PARTS_REPLAY", raising=False)
    assert run(*common) == 0
    out = capsys.readouterr()
    replayed = json.loads(out.out)
    assert replayed["parts_replayed"] and "extra parts priced as replayed from one CUDA graph" in out.err
    monkeypatch.setenv("COMPASS_PARTS_REPLAY", "0")
    assert run(*common) == 0
    out = capsys.readouterr()
    issued = json.loads(out.out)
    assert not issued["parts_replayed"] and "replayed" not in out.err
    kinds = set()
    for r, i in zip(replayed["pairs"], issued["pairs"]):
        kinds.add(r["kind"])
        for label, seconds in i["candidates"].items():
            if not label.startswith("decompose"):
                assert r["candidates"][label] == seconds, (r["name"], label)
            elif r["kind"] == "all_gather_matmul":
                assert r["candidates"][label] < seconds, (r["name"], label)
            else:
                assert r["candidates"][label] == seconds, (r["name"], label)
    assert kinds == {"all_gather_matmul", "matmul_reduce_scatter"}


def test_plan_prices_cuda_graph_replays_when_asked(capsys, monkeypatch):
    """``--cuda-graphs`` prices the layer as CUDA graph replays: the sequential pairs cost the same,
    every decomposition less (no host issue per part), and the output says so.  As 'auto' under
    CUDA graphs, it prices the fused operators only where the graphs can take them in
    (COMPASS_FUSED_GRAPHS=1), and says why it left them out otherwise."""
    common = ("plan", "--model", "llama3-8b", "--tp", "2", "--tokens", "8192", "--topology",
              "h200-host-staged-8", "--json", "--no-png")
    monkeypatch.delenv("COMPASS_FUSED_GRAPHS", raising=False)
    assert run(*common, "--fused", "none") == 0
    eager = json.loads(capsys.readouterr().out)
    assert run(*common, "--fused", "none", "--cuda-graphs") == 0
    graphs = json.loads(capsys.readouterr().out)
    assert not eager["cuda_graphs"] and graphs["cuda_graphs"]
    assert graphs["sequential_s"] == eager["sequential_s"] and graphs["planned_s"] <= eager["planned_s"]
    for e, g in zip(eager["pairs"], graphs["pairs"]):
        for label, seconds in e["candidates"].items():
            if label.startswith("decompose"):
                assert g["candidates"][label] < seconds, (e["name"], label)

    def fused_labels(data):
        return {label for p in data["pairs"] for label in p["candidates"] if label.startswith("fuse")}

    assert run(*common, "--cuda-graphs") == 0  # as auto: the fused calls would split the graphs
    out = capsys.readouterr()
    assert not fused_labels(json.loads(out.out))
    assert "priced as CUDA graph replays" in out.err and "only with COMPASS_FUSED_GRAPHS=1" in out.err
    monkeypatch.setenv("COMPASS_FUSED_GRAPHS", "1")
    assert run(*common, "--cuda-graphs") == 0  # captured with the rest: priced, without a host floor
    assert fused_labels(json.loads(capsys.readouterr().out))


def test_plan_writes_a_timeline_picture(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert run("plan", "--tp", "4", "--tokens", "4096", "--model", "llama3-8b", "--png", str(png)) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_writes_csv_and_summary(tmp_path, capsys):
    assert SweepConfig().size() == 288
    assert run("sweep", "--topologies", "a6000-nvlink-pairs-pcie-8,h100-nvswitch-8", "--tokens", "2048,16384",
               "--group-sizes", "8", "--models", "llama3-70b", "--out-dir", str(tmp_path), "--no-progress") == 0
    rows = list(csv.DictReader(open(tmp_path / "sweep.csv")))
    assert len(rows) == 2 * 2 * 3
    assert all(float(r["speedup"]) >= 1.0 for r in rows)
    summary = json.loads((tmp_path / "sweep-summary.json").read_text())
    assert summary["configurations"] == 12 and set(summary["topologies"]) == {
        "a6000-nvlink-pairs-pcie-8", "h100-nvswitch-8"}
    assert "a6000-nvlink-pairs-pcie-8: wins" in capsys.readouterr().out


def test_sweep_prices_cuda_graph_replays_when_asked(tmp_path, capsys):
    """``--cuda-graphs``: the same grid priced without host issue costs; no prediction grows and
    the decompositions all shrink."""
    common = ("sweep", "--topologies", "a100-pcie-8", "--tokens", "4096", "--group-sizes", "4",
              "--models", "llama3-8b", "--no-progress")
    assert run(*common, "--out-dir", str(tmp_path / "eager")) == 0
    assert run(*common, "--cuda-graphs", "--out-dir", str(tmp_path / "graphs")) == 0
    assert "priced as CUDA graph replays" in capsys.readouterr().err
    eager, graphs = (list(csv.DictReader(open(tmp_path / d / "sweep.csv"))) for d in ("eager", "graphs"))
    assert len(eager) == len(graphs) == 3
    for e, g in zip(eager, graphs):
        assert float(g["predicted_s"]) <= float(e["predicted_s"]) and g["sequential_s"] == e["sequential_s"]
        assert float(g["best_decompose_s"]) < float(e["best_decompose_s"])


def test_calibrate_needs_a_gpu(tmp_path, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert run("calibrate", "--out", str(tmp_path / "c.json")) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bad_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        run("plan", "--topology", "dgx-9000")
    assert "known presets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run("sweep", "--tokens", "two")
    with pytest.raises(SystemExit):
        run("plan", "--fused", "zigzag")


def test_plan_says_where_its_numbers_come_from_and_prices_what_auto_uses(capsys, monkeypatch):
    monkeypatch.delenv("COMPASS_FX_CALIBRATION", raising=False)
    assert run("plan", "--model", "llama3-8b", "--tp", "4", "--tokens", "4096", "--json", "--no-png") == 0
    out, err = capsys.readouterr()
    assert "built-in GPU constants (datasheets; Hopper's GEMM constants fitted on one H200), not measured" in err and "fused operators not priced" in err
    labels = {label for pair in json.loads(out)["pairs"] for label in pair["candidates"]}
    assert not any(label.startswith("fuse") for label in labels)
    assert run("plan", "--model", "llama3-8b", "--tp", "4", "--tokens", "4096", "--json", "--no-png",
               "--fused", "all") == 0
    out, err = capsys.readouterr()
    assert "auto_fuse=True" in err
    assert any(label.startswith("fuse") for pair in json.loads(out)["pairs"] for label in pair["candidates"])
    # without peer access 'auto' prices the fused operators (through host memory) by default, and says so
    assert run("plan", "--model", "llama3-8b", "--tp", "4", "--tokens", "4096", "--json", "--no-png",
               "--topology", "h200-host-staged-8") == 0
    out, err = capsys.readouterr()
    assert "where the GPUs lack peer access" in err
    labels = {label for pair in json.loads(out)["pairs"] for label in pair["candidates"]}
    assert {label for label in labels if label.startswith("fuse")} == {"fuse(direct)"}


def test_the_plan_picture_says_what_the_table_says(capsys, monkeypatch, tmp_path):
    """Each row of the timeline picture is titled with the table's figure (the planned row with
    the table's "planned"), and every candidate's lanes end no earlier than its price: what the
    lanes do not draw (a fused call's setup and host floor) is a segment labelled "other"."""
    import re

    import compass_fx.tools.timeline_plot as timeline_plot

    seen = {}
    monkeypatch.setattr(timeline_plot, "plot_timelines", lambda views, path, title: seen.setdefault("views", views)
                        and path)
    assert run("plan", "--model", "llama3-70b", "--tp", "8", "--tokens", "8192", "--fused", "all",
               "--topology", "a6000-nvlink-pairs-pcie-8", "--out-dir", str(tmp_path)) == 0
    out = capsys.readouterr().out
    planned_ms = float(re.search(r"planned ([\d.]+)ms", out).group(1))
    views = {name: (segs, predicted) for name, segs, predicted in seen["views"]}
    segs, predicted = views["planned"]
    assert predicted * 1e3 == pytest.approx(planned_ms, abs=0.006)   # the table prints 2 decimals
    assert max(s.end for s in segs) >= predicted * (1 - 1e-9)
    fused, fused_predicted = views["best fuse per pair"]  # every fused price holds setup the lanes do not draw
    assert fused_predicted * (1 - 1e-9) <= max(s.end for s in fused) <= fused_predicted * 1.01
