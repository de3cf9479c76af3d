"""The planned device batches stay runnable: every step's arguments parse with its script's own
parser, every batch fits one device call, and the runner kills a step at its deadline and goes on."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_batches  # noqa: E402
from device_batches import BATCHES, Step  # noqa: E402


class _Parsed(Exception):
    """Raised by the patched parse_args once a script's parser accepted the arguments."""


def _parse_with_script(step: Step, monkeypatch) -> argparse.Namespace:
    """Run the step's script's main() up to its argument parsing, with the step's arguments."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    args = [a.replace(device_batches.RESULTS, "/tmp/results") for a in step.args]
    if step.script == "compass-fx":
        from compass_fx.cli import build_parser

        main = lambda: build_parser().parse_args(args)  # noqa: E731
    else:
        path = ROOT / "benchmarks" / step.script
        assert path.is_file(), step
        spec = importlib.util.spec_from_file_location(f"_batch_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        monkeypatch.setattr(sys, "argv", [str(path), *args])
        main = lambda: module.main(args)  # noqa: E731
    with pytest.raises(_Parsed) as parsed:
        main()
    return parsed.value.args[0]


@pytest.mark.parametrize("batch,step", [(b, s) for b, steps in BATCHES.items() for s in steps],
                         ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_step_parses_with_its_scripts_parser(batch, step, monkeypatch):
    namespace = _parse_with_script(step, monkeypatch)
    tag = getattr(namespace, "tag", None)
    if tag is not None:  # the machine in the results' names: x2-* batches two GPUs, h200-* one (or the one lent)
        machine = ("h200x2",) if batch.startswith("x2-") else ("h200-", f"{device_batches.MACHINE}-")
        assert batch.startswith(("x2-", "h200-")) and tag.startswith(machine), (batch, step.name, tag)
        assert ("hoststaged" in tag) == (step.env.get("NCCL_P2P_DISABLE") == "1"), step.name
    out = getattr(namespace, "out_dir", None) or getattr(namespace, "out", None)
    assert out and out.startswith("/tmp/results"), (step.name, out)  # results land under OUT/results


def test_a_bad_argument_is_caught(monkeypatch):
    bad = Step("bad", "multigpu_operators.py", ("--worlds", "2", "--no-such-flag"), 10)
    with pytest.raises(SystemExit):
        _parse_with_script(bad, monkeypatch)


def test_every_batch_fits_one_device_call():
    for name, steps in BATCHES.items():
        device_batches.check_batch(steps)
        assert len({s.name for s in steps}) == len(steps), name
    with pytest.raises(ValueError, match="over a device call"):
        device_batches.check_batch((Step("long", "fused_ops.py", (), device_batches.PER_CALL_LIMIT_S),))


def test_runner_kills_a_step_at_its_deadline_and_goes_on(tmp_path, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench.py").write_text("import sys, time, pathlib\n"
                                                      "pathlib.Path(sys.argv[2]).write_text('x')\n"
                                                      "time.sleep(float(sys.argv[1]))\n")
    monkeypatch.setattr(device_batches, "ROOT", tmp_path)  # steps name scripts under ROOT/benchmarks
    steps = (Step("stalls", "bench.py", ("60", f"{device_batches.RESULTS}/a.json"), 2),
             Step("quick", "bench.py", ("0", f"{device_batches.RESULTS}/b.json"), 30))
    monkeypatch.setitem(BATCHES, "probe", steps)
    out = tmp_path / "out"
    rows = device_batches.run_batch("probe", out)
    assert [r["timed_out"] for r in rows] == [True, False]
    assert rows[0]["seconds"] < 30 and rows[1]["rc"] == 0
    assert rows[0]["files"] == ["results/a.json"] and rows[1]["files"] == ["results/b.json"]
    summary = json.loads((out / "batch-probe.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["stalls", "quick"]
    assert (out / "logs" / "quick.log").read_text().startswith("$ ")


def test_a_packed_batch_leaves_one_archive_rewritten_after_every_step(tmp_path, monkeypatch):
    """``--pack``: OUT holds batch-<name>.tgz alone (the device tool brings back at most 8 files);
    while a step runs, the archive already holds every step before it (a call cut short keeps
    them), and the working folder is gone at the end."""
    import tarfile

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench.py").write_text(
        "import sys, tarfile, pathlib\n"
        "archive = pathlib.Path(sys.argv[1])\n"
        "names = sorted(tarfile.open(archive).getnames()) if archive.exists() else []\n"
        "pathlib.Path(sys.argv[2]).write_text('\\n'.join(names))\n")
    monkeypatch.setattr(device_batches, "ROOT", tmp_path)
    out = tmp_path / "out"
    archive = out / "batch-probe.tgz"
    steps = (Step("first", "bench.py", (str(archive), f"{device_batches.RESULTS}/first.txt"), 30),
             Step("second", "bench.py", (str(archive), f"{device_batches.RESULTS}/second.txt"), 30))
    monkeypatch.setitem(BATCHES, "probe", steps)
    assert device_batches.main(["probe", "--out", str(out), "--pack"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["batch-probe.tgz"]
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        seen_by_second = tar.extractfile("batch-probe/results/second.txt").read().decode().split("\n")
        summary = json.loads(tar.extractfile("batch-probe/batch-probe.json").read())
    assert {"batch-probe/logs/first.log", "batch-probe/logs/second.log", "batch-probe/results/first.txt",
            "batch-probe/results/second.txt", "batch-probe/batch-probe.json"} <= names
    assert "batch-probe/results/first.txt" in seen_by_second and "batch-probe/logs/second.log" not in seen_by_second
    assert [r["step"] for r in summary["steps"]] == ["first", "second"]
    assert summary["steps"][1]["files"] == ["results/second.txt"]
    assert not list(Path(device_batches.tempfile.gettempdir()).glob("batch-probe-*"))


def test_a_step_runs_with_the_cores_kept_awake_or_not_at_all(tmp_path, monkeypatch):
    """``cpus_awake``: the step runs while the latency request (0 us) is held, and not at all where it
    cannot be made; the batch goes on and the summary says which."""
    from harness import cpu_power

    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench.py").write_text("import sys, pathlib\n"
                                                      "pathlib.Path(sys.argv[2]).write_bytes(pathlib.Path(sys.argv[1]).read_bytes())\n")
    request = tmp_path / "cpu_dma_latency"
    request.write_bytes((2_000_000_000).to_bytes(4, "little"))
    monkeypatch.setattr(device_batches, "ROOT", tmp_path)
    monkeypatch.setattr(cpu_power, "PM_QOS", request)
    seen = f"{device_batches.RESULTS}/seen.bin"
    steps = (Step("held", "bench.py", (str(request), seen), 30, cpus_awake=True),
             Step("missing", "bench.py", (str(request), seen), 30, cpus_awake=True))
    monkeypatch.setitem(BATCHES, "probe", steps[:1])
    rows = device_batches.run_batch("probe", tmp_path / "out")
    assert rows[0]["rc"] == 0 and rows[0]["cpus_awake"] is True
    assert (tmp_path / "out" / "results" / "seen.bin").read_bytes() == (0).to_bytes(4, "little")

    monkeypatch.setattr(cpu_power, "PM_QOS", tmp_path / "no" / "such" / "device")
    monkeypatch.setitem(BATCHES, "probe", (steps[1], Step("after", "bench.py", (str(request), seen), 30)))
    rows = device_batches.run_batch("probe", tmp_path / "out2")
    assert rows[0]["rc"] is None and rows[0]["files"] == [] and rows[1]["rc"] == 0
    assert "step not run" in (tmp_path / "out2" / "logs" / "missing.log").read_text()
    assert device_batches.main(["probe", "--out", str(tmp_path / "out3")]) == 1


def test_a_step_runs_from_the_snapshot_it_names(tmp_path):
    """A step with ``root`` runs its script from that snapshot, whose harness imports the snapshot's
    package (benchmarks/snapshot.py); without one, from this checkout."""
    mine = Step("x", "fused_host_time.py", ("--worlds", "2"), 10)
    theirs = Step("y", "fused_host_time.py", ("--worlds", "2"), 10, root="scratch/snapshot")
    assert mine.command(tmp_path)[1] == str(ROOT / "benchmarks" / "fused_host_time.py")
    assert theirs.command(tmp_path)[1] == str(ROOT / "scratch" / "snapshot" / "benchmarks" / "fused_host_time.py")


def test_a_snapshot_holds_a_commits_package_and_scripts_without_results(tmp_path):
    import subprocess

    import snapshot

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    out = snapshot.snapshot("HEAD", tmp_path / "snap")
    assert (out / "compass_fx" / "__init__.py").is_file() and (out / "benchmarks" / "harness" / "__init__.py").is_file()
    assert (out / "benchmarks" / "fused_host_time.py").is_file() and not (out / "benchmarks" / "results").exists()
    assert (out / "COMMIT").read_text().strip() == head.stdout.strip()
    with pytest.raises(SystemExit, match="git archive"):
        snapshot.snapshot("no-such-commit-anywhere", tmp_path / "bad")


def test_a_snapshot_may_take_its_scripts_from_another_revision(tmp_path):
    """``--scripts``: an older package under today's benchmark scripts (options added since)."""
    import subprocess

    import snapshot

    revs = subprocess.run(["git", "rev-list", "--max-count=2", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if revs.returncode or len(revs.stdout.split()) < 2:
        pytest.skip("not a git checkout with history")
    head, parent = revs.stdout.split()
    out = snapshot.snapshot(parent, tmp_path / "snap", scripts=head)
    short = [subprocess.run(["git", "rev-parse", "--short", r], cwd=ROOT, capture_output=True, text=True).stdout.strip()
             for r in (parent, head)]
    assert (out / "COMMIT").read_text().strip() == f"{short[0]} (scripts of {short[1]})"
    shown = subprocess.run(["git", "show", f"{head}:benchmarks/fused_host_time.py"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    assert (out / "benchmarks" / "fused_host_time.py").read_text() == shown
    shown = subprocess.run(["git", "show", f"{parent}:compass_fx/__init__.py"], cwd=ROOT, capture_output=True,
                           text=True).stdout
    assert (out / "compass_fx" / "__init__.py").read_text() == shown


@pytest.mark.parametrize("name,family", [("NVIDIA H100 80GB HBM3\n", "h100"), ("NVIDIA H200\n", "h200"),
                                         ("NVIDIA A100-SXM4-80GB\n", "gpu"), ("", "gpu")])
def test_a_step_names_its_results_after_the_gpu_it_runs_on(name, family, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=name))
    device_batches.machine_tag.cache_clear()  # asked once a process: the GPU does not change
    step = device_batches.BATCHES["h200-merge-ab"][0]
    tag = step.command(Path("/tmp/results"))
    device_batches.machine_tag.cache_clear()
    assert tag[tag.index("--tag") + 1].startswith(f"{family}-merge-ab1-"), tag


def test_a_batch_makes_the_snapshots_it_runs_from_where_they_are_missing(tmp_path, monkeypatch, capsys):
    """A step's snapshot (scratch/ is not committed) is made from its recorded revision before the
    batch runs, and left alone where it exists; one with no known revision is named as a problem."""
    import subprocess

    parent = subprocess.run(["git", "rev-parse", "--short", "HEAD~1"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    monkeypatch.setitem(device_batches.SNAPSHOT_REVISIONS, "snap/known", parent)
    steps = (Step("a", "fused_host_time.py", (), 10, root="snap/known"),
             Step("b", "fused_host_time.py", (), 10, root="snap/unknown"), Step("c", "fused_host_time.py", (), 10))
    problems = device_batches.ensure_snapshots(steps, root=tmp_path)
    assert problems == ["snap/unknown is missing and no revision is known to make it from"]
    made = tmp_path / "snap" / "known"
    assert (made / "compass_fx" / "__init__.py").is_file() and (made / "benchmarks" / "fused_host_time.py").is_file()
    assert (made / "COMMIT").read_text().strip() == parent
    marker = made / "compass_fx" / "kept"
    marker.write_text("")
    assert device_batches.ensure_snapshots(steps[:1], root=tmp_path) == [] and marker.exists()  # not made again
    assert device_batches.SNAPSHOT_REVISIONS[device_batches.SPLIT_GEMMS] == "eafad5d"
    assert any(s.root == device_batches.SPLIT_GEMMS for s in BATCHES["h200-first"])
