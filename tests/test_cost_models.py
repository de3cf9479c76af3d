"""Properties of the component models: GEMM, collective, overlap, decomposition."""
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from compass_fx.cost import GPUS, Topology, gemm_seconds, split_gemm_seconds
from compass_fx.cost.gemm_fit import GemmMeasurement, fit_gpu_spec, model_errors
from compass_fx.cost.collective import collective_seconds, collective_time, double_ring_split
from compass_fx.cost.decomposition import DecompositionModel, optimum_expression
from compass_fx.machine.calibration import gpu_spec
from compass_fx.machine.gpus import with_overrides
from compass_fx.cost.overlap import slowdown

dims = st.integers(1, 20000)
BENCH_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
FAMILIES = BENCH_RESULTS / "gemm_families" / "gemm_families-h200.json"        # device time
TP8 = BENCH_RESULTS / "gemm_model_validation" / "gemm_model_validation-h200-tp8.json"  # device time
IDLE_GPU_GRID = BENCH_RESULTS / "gemm_model_validation" / "gemm_model_validation-h200.json"  # host launches included


@settings(max_examples=60, deadline=None)
@given(m=dims, n=dims, k=dims, dm=st.integers(0, 5000), gpu=st.sampled_from(sorted(GPUS)))
def test_gemm_monotonic_in_each_dimension(m, n, k, dm, gpu):
    base = gemm_seconds(m, n, k, "bfloat16", gpu)
    assert gemm_seconds(m + dm, n, k, "bfloat16", gpu) >= base
    assert gemm_seconds(m, n + dm, k, "bfloat16", gpu) >= base
    assert gemm_seconds(m, n, k + dm, "bfloat16", gpu) >= base


def test_gemm_roofline_and_dtype():
    big = gemm_seconds(8192, 8192, 8192, "bfloat16", "H100")
    spec = gpu_spec("H100")
    assert big >= 2 * 8192**3 / spec.peak_flops("bfloat16")
    assert gemm_seconds(8192, 8192, 8192, "float32", "H100") > big  # fp32 peak is far lower
    assert gemm_seconds(4096, 4096, 1792, "bf16", "H200") == gemm_seconds(4096, 4096, 1792, "bfloat16", "H200")


def test_wave_quantization_makes_small_parts_expensive():
    """Measured on one H200 (device time, gemm_model_validation-h200-tp8.json), Llama-3 8B's down
    projection at TP = 8 and 4096 tokens costs 1.04x whole in 2 parts, 1.35x in 8, 1.79x in 16,
    3.26x in 32 and 5.14x in 64: the model's ratios must stay within 25% of these."""
    whole = gemm_seconds(4096, 4096, 1792, "bfloat16", "H200")
    for parts, measured in ((2, 1.04), (8, 1.35), (16, 1.79), (32, 3.26), (64, 5.14)):
        ratio = split_gemm_seconds(4096, 4096, 1792, parts, "bfloat16", "H200") / whole
        assert abs(ratio / measured - 1) <= 0.25, (parts, ratio, measured)


def test_gemm_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gemm m"):
        gemm_seconds(0, 1, 1)
    with pytest.raises(ValueError, match="dtype"):
        gemm_seconds(1, 1, 1, "int3")
    with pytest.raises(ValueError, match="gpu must be one of"):
        gemm_seconds(1, 1, 1, gpu="TPU")
    with pytest.raises(ValueError, match="parts"):
        split_gemm_seconds(10, 1, 1, 3)


def test_gpu_names_are_forgiving():
    assert gpu_spec("rtx 4090").name == "RTX4090"
    assert gpu_spec("NVIDIA H200").name == "H200"
    assert gpu_spec("h100").name == "H100"


def _quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_model_meets_the_goal_on_the_committed_h200_measurements():
    """The built-in H200 constants against the committed device-time measurements of one H200
    (not a timing assertion: fixed data sets against the model), held to issue 27's goals:
    split/unsplit ratio error median <= 8%, p90 <= 20%, unsplit time median <= 8%.

    The model predicts device time (what a GEMM costs the GPU once the host keeps ahead of it), so
    its references are the files timed so: gemm_families-h200 (8 families, TP 2/4/8, 2048-16384
    tokens; each GEMM split into 2-8 parts along its rows and, its weight gradient, along the
    contraction, which the fit does not see) and issue 11's TP = 8 set (-tp8, queued calls).  The
    sweep grid's gemm_model_validation-h200.json timed each call from an idle GPU, the host's launch
    latency included (and the GPU starting from idle: on the 40 unsplit GEMMs it shares with the
    device-time files it is 1.08-1.52x slower, 21-808 us, more than a launch), so it is not a
    reference for a device-time model (see the next test)."""
    spec = gpu_spec("H200")
    rows = json.loads(FAMILIES.read_text())["rows"]
    assert len(rows) == 3072 and {r["split"] for r in rows} == {"rows", "contraction"}
    unsplit = {(r["split"], r["gemm_m"], r["gemm_n"], r["gemm_k"]): r["seconds"] for r in rows if r["parts"] == 1}
    ratio = {"rows": [], "contraction": []}
    whole_errors = []
    for r in rows:
        m, n, k, parts = r["gemm_m"], r["gemm_n"], r["gemm_k"], r["parts"]
        whole = gemm_seconds(m, n, k, "bfloat16", spec)
        if parts == 1:
            if r["split"] == "rows":  # each forward GEMM once (a contraction split's unsplit is another GEMM)
                whole_errors.append(abs(whole / r["seconds"] - 1))
            continue
        part = (gemm_seconds(m // parts, n, k, "bfloat16", spec) if r["split"] == "rows"
                else gemm_seconds(m, n, k // parts, "bfloat16", spec))
        measured_ratio = r["seconds"] / unsplit[(r["split"], m, n, k)]
        ratio[r["split"]].append(abs(parts * part / whole / measured_ratio - 1))
    both = ratio["rows"] + ratio["contraction"]
    assert len(both) == 2304 and len(whole_errors) == 384
    assert _quantile(both, 0.5) <= 0.08 and _quantile(both, 0.9) <= 0.20, (_quantile(both, 0.5), _quantile(both, 0.9))
    assert _quantile(ratio["rows"], 0.5) <= 0.08 and _quantile(ratio["contraction"], 0.5) <= 0.08
    assert _quantile(whole_errors, 0.5) <= 0.08, _quantile(whole_errors, 0.5)

    data = json.loads(TP8.read_text())
    assert data["timing"].startswith("device time")
    meas = [GemmMeasurement(r["m"], r["n"], r["k"], r["parts"], r["measured_s"]) for r in data["rows"]]
    assert len(meas) == 112
    errors = model_errors(meas, spec)
    whole_tp8 = [abs(r["abs_error"]) for r in errors["rows"] if r["parts"] == 1]
    assert errors["median_ratio_error"] <= 0.08 and errors["p90_ratio_error"] <= 0.20, errors["p90_ratio_error"]
    assert _quantile(whole_tp8, 0.5) <= 0.08, _quantile(whole_tp8, 0.5)


def test_the_idle_gpu_timed_grid_splits_alike_but_is_not_device_time():
    """gemm_model_validation-h200.json (the sweep grid's GEMMs split into 1-32 parts) timed each
    call from an idle GPU, the host's launch latency included: its split/unsplit ratios still
    follow the model (median error <= 10%, as this file was always held to), but its absolute
    times are not device time, and the device-time model prices well below them (15.8% at the
    median with the built-in constants; a refit that pulled the model up to them would price the
    launch latency into every GEMM)."""
    data = json.loads(IDLE_GPU_GRID.read_text())
    assert "timing" not in data or data["timing"].startswith("each call from an idle GPU")
    meas = [GemmMeasurement(r["m"], r["n"], r["k"], r["parts"], r["measured_s"]) for r in data["rows"]]
    assert len(meas) == 288
    errors = model_errors(meas, gpu_spec("H200"))
    assert errors["median_ratio_error"] <= 0.10
    signed = sorted(r["abs_error"] for r in errors["rows"])
    assert signed[len(signed) // 2] <= -0.10, signed[len(signed) // 2]


def test_fit_recovers_a_known_efficiency():
    truth = with_overrides(gpu_spec("A100"), efficiency=0.6, kernel_overhead_s=5e-6)
    shapes = [(2048, 4096, 4096), (8192, 1792, 4096), (4096, 8192, 3584)]
    meas = [GemmMeasurement(m, n, k, d, split_gemm_seconds(m, n, k, d, "bfloat16", truth))
            for m, n, k in shapes for d in (1, 2, 4, 8)]
    fitted = fit_gpu_spec(meas, gpu_spec("A100"), rounds=2)
    assert model_errors(meas, fitted)["median_abs_error"] < 0.02
    assert abs(fitted.efficiency - 0.6) <= 0.04


@settings(max_examples=40, deadline=None)
@given(b=st.floats(1e3, 1e9), extra=st.floats(0, 1e9), g=st.sampled_from([2, 4, 8]),
       preset=st.sampled_from(Topology.presets()), schedule=st.sampled_from(["ring", "double_ring", "direct"]),
       op=st.sampled_from(["all_gather", "reduce_scatter", "all_reduce"]))
def test_collective_monotonic_in_bytes(b, extra, g, preset, schedule, op):
    topo = _preset(preset)
    assert collective_seconds(op, b + extra, topo, g, schedule) >= collective_seconds(op, b, topo, g, schedule)


_PRESETS: dict = {}


def _preset(name):
    if name not in _PRESETS:
        _PRESETS[name] = Topology.preset(name)
    return _PRESETS[name]


def ring_topology(bandwidths, latencies):
    n = len(bandwidths)
    return Topology.from_dict({
        "name": "ring", "gpu": "A6000",
        "nodes": [{"id": f"gpu{i}", "kind": "gpu"} for i in range(n)],
        "links": [{"src": f"gpu{i}", "dst": f"gpu{(i + 1) % n}", "gbps": bandwidths[i], "latency_us": latencies[i]}
                  for i in range(n)] if n > 2 else
                 [{"src": "gpu0", "dst": "gpu1", "gbps": bandwidths[0], "latency_us": latencies[0]}],
    })


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(2, 8), nbytes=st.floats(1e3, 1e9))
def test_double_ring_never_slower_than_ring_on_full_duplex_rings(data, n, nbytes):
    bws = data.draw(st.lists(st.floats(1, 500), min_size=n, max_size=n))
    lats = data.draw(st.lists(st.floats(0, 5), min_size=n, max_size=n))
    topo = ring_topology(bws, lats)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        ring = collective_seconds(op, nbytes, topo, n, "ring")
        double = collective_seconds(op, nbytes, topo, n, "double_ring")
        assert double <= ring * (1 + 1e-12)


def test_double_ring_recovers_idle_pcie_direction_on_the_papers_machine():
    topo = Topology.preset("a6000-nvlink-pairs-pcie-8")
    ring = collective_seconds("all_gather", 256e6, topo, 8, "ring")
    double = collective_seconds("all_gather", 256e6, topo, 8, "double_ring")
    assert double < 0.75 * ring
    assert 0 < double_ring_split(topo, topo.group(8)) < 1
    # On a switch both directions are already busy: no bandwidth to win.
    h = Topology.preset("h100-nvswitch-8")
    assert collective_seconds("all_gather", 256e6, h, 8, "double_ring") == pytest.approx(
        collective_seconds("all_gather", 256e6, h, 8, "ring"))


def test_collective_parts_and_errors():
    topo = Topology.preset("h200-nvswitch-8")
    t = collective_time("all_reduce", 1e8, topo, 8)
    assert t.steps == 14 and t.seconds == pytest.approx(t.latency_s + t.transfer_s)
    assert collective_time("all_gather", 1e8, topo, 1).seconds == 0.0
    with pytest.raises(ValueError, match="op must be one of"):
        collective_seconds("broadcast", 1, topo, 2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        collective_seconds("all_gather", 1, topo, 2, "tree")
    with pytest.raises(ValueError, match="group size"):
        collective_seconds("all_gather", 1, topo, 9)


def test_overlap_slows_the_gemm_more_when_more_is_taken():
    args = (4096, 4096, 4096, "bfloat16", "H100")
    assert slowdown(*args) == pytest.approx(1.0)
    assert slowdown(*args, comm_sms=16) >= 1.0
    assert slowdown(*args, comm_sms=32) >= slowdown(*args, comm_sms=16)
    mem_bound = (16384, 128, 128, "bfloat16", "H100")
    assert slowdown(*mem_bound, comm_hbm_bytes_per_s=2e12) > slowdown(*mem_bound, comm_hbm_bytes_per_s=1e11) > 1.0
    with pytest.raises(ValueError, match="comm_sms"):
        slowdown(*args, comm_sms=500)


def test_optimum_is_derived_symbolically():
    assert optimum_expression().replace(" ", "") in ("sqrt(C)/sqrt(A)", "sqrt(C/A)")
    m = DecompositionModel(2e-6, 1e-4, 3e-4)
    assert m.d_star() == pytest.approx(math.sqrt(3e-4 / 2e-6))
    assert m.min_seconds() == pytest.approx(1e-4 + 2 * math.sqrt(2e-6 * 3e-4))


@settings(max_examples=200, deadline=None)
@given(a=st.floats(1e-7, 1e-3), b=st.floats(0, 1e-2), c=st.floats(0, 1e-1),
       allowed=st.lists(st.integers(1, 256), min_size=1, max_size=12))
def test_d_star_rounding_equals_brute_force(a, b, c, allowed):
    model = DecompositionModel(a, b, c)
    brute = min(sorted(set(allowed)), key=lambda d: (model.seconds(d), d))
    chosen = model.best_parts(allowed)
    assert model.seconds(chosen) == pytest.approx(model.seconds(brute), rel=1e-12)
    assert model.min_seconds() <= model.seconds(chosen) * (1 + 1e-12)


def test_decomposition_model_rejects_bad_coefficients():
    with pytest.raises(ValueError, match="DecompositionModel.A"):
        DecompositionModel(-1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="allowed"):
        DecompositionModel(1.0, 0.0, 1.0).best_parts([])


def test_calibration_file_refines_the_constants(tmp_path, monkeypatch):
    from compass_fx.machine.calibration import CALIBRATION_ENV, load_calibration, write_calibration

    slow = with_overrides(gpu_spec("L40S"), efficiency=0.35)
    path = tmp_path / "cal.json"
    write_calibration(path, [slow], {"device": "test"})
    assert load_calibration(path)["L40S"].efficiency == 0.35
    before = gemm_seconds(4096, 4096, 4096, "bfloat16", "L40S")
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    assert gpu_spec("L40S").efficiency == 0.35
    assert gemm_seconds(4096, 4096, 4096, "bfloat16", "L40S") > before
    assert gpu_spec("H100") == GPUS["H100"]          # GPUs absent from the file keep their constants
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="'gpus'"):
        load_calibration(bad)


def test_calibration_files_are_versioned_and_checked_against_the_machine(tmp_path):
    """A file of another format version, or measured on another GPU than the topology's, is a
    clear error; a matching one prices the compile and the report names it."""
    import json

    import compass_fx
    from compass_fx.machine.calibration import calibration_in_use, use_calibration, write_calibration

    h200 = tmp_path / "h200.json"
    write_calibration(h200, [with_overrides(gpu_spec("H200"), efficiency=0.5)], {"device": "NVIDIA H200"})
    data = json.loads(h200.read_text())
    assert data["format"] == "compass-fx-calibration" and data["version"] == 1 and data["device"] == "NVIDIA H200"

    old = tmp_path / "old.json"
    old.write_text(json.dumps({"gpus": {"H200": {"efficiency": 0.5}}}))
    with pytest.raises(ValueError, match="unversioned file.*run compass-fx calibrate again"):
        compass_fx.check_options(calibration=str(old))
    with pytest.raises(ValueError, match="measured on H200, but the topology a100-nvswitch-8 has A100"):
        compass_fx.check_options(calibration=str(h200), topology="a100-nvswitch-8")
    with pytest.raises(ValueError, match="option 'calibration'"):
        compass_fx.check_options(calibration=str(tmp_path / "missing.json"))
    assert compass_fx.check_options(calibration=str(h200), topology="h200-nvswitch-8").calibration == str(h200)

    before = gemm_seconds(4096, 4096, 4096, "bfloat16", "H200")
    with use_calibration(h200):
        assert gpu_spec("H200").efficiency == 0.5
        assert gemm_seconds(4096, 4096, 4096, "bfloat16", "H200") > before
        assert calibration_in_use() == f"calibration file {h200}"
    assert gpu_spec("H200") == GPUS["H200"] and calibration_in_use() == "datasheet (no calibration)"


def test_cost_hooks_compose_on_top_of_a_calibration(tmp_path):
    """A hook sees the calibrated prediction as ``candidate.seconds`` and may still replace it."""
    import compass_fx
    from compass_fx.cost import Workload, select
    from compass_fx.machine.calibration import use_calibration, write_calibration

    path = tmp_path / "h200.json"
    write_calibration(path, [with_overrides(gpu_spec("H200"), efficiency=0.4)], {"device": "NVIDIA H200"})
    w = Workload("all_gather_matmul", 8192, 7168, 4096, "bfloat16", 2)
    plain = select(w, "h200-nvswitch-8").candidate("sequential").seconds
    seen = []

    def hook(workload, topology, candidate):
        seen.append(candidate.seconds)
        return 1e-9 if candidate.label == "decompose(d=2)" else None

    compass_fx.register_cost_hook(hook)
    try:
        with use_calibration(path):
            d = select(w, "h200-nvswitch-8")
    finally:
        compass_fx.unregister_cost_hook(hook)
    assert d.candidate("sequential").seconds > plain  # the calibration (a slower GEMM) priced it
    assert d.candidate("sequential").seconds in seen  # what the hook saw was the calibrated price
    assert d.label == "decompose(d=2)"                # and the hook still has the last word
