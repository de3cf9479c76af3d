"""Measured collectives in a calibration file: taken on real gloo ranks (every rank gets the same
numbers), written and read back, and reproduced by the cost model."""
from __future__ import annotations

import json

import pytest

from compass_fx.cost import Topology, Workload, select
from compass_fx.machine.calibration import fit_latency_bandwidth, write_calibration
from compass_fx.cost.collective import collective_time
from compass_fx.machine.calibration import gpu_spec, use_calibration
from compass_fx.machine.gpus import with_overrides

from calibrated_host import calibrated_fused_host


def _measure(rank: int) -> list[dict]:
    from compass_fx.tools.calibrate import measure_collectives

    return measure_collectives(sizes_mib=(1, 2), repeats=2)


def test_collectives_are_measured_and_agreed_across_ranks(ranks):
    results = ranks(2).run(_measure)
    assert results[0] == results[1], "ranks would price differently"
    ops = {t["op"] for t in results[0]}
    assert ops == {"all_gather", "reduce_scatter", "all_reduce"}
    for table in results[0]:
        assert table["group_size"] == 2 and len(table["points"]) == 2
        assert all(b > 0 and s > 0 for b, s in table["points"])


def _part_overhead(rank: int) -> dict:
    from compass_fx.tools.calibrate import measure_part_overhead

    return measure_part_overhead(parts=4, shard_rows=32, k=32, n=48, calls=20)  # enough calls to rise above noise


def test_interdecom_part_overhead_is_measured_as_lowered_and_agreed(ranks):
    """calibrate's per-part cost of InterDecom: the pair compiled by the backend whole and in parts
    on the group at hand; every rank gets the slowest rank's figures.  On CPU only the host's issue
    is measured (the device figure needs CUDA events)."""
    results = ranks(2).run(_part_overhead)
    assert results[0] == results[1], "ranks would price differently"
    got = results[0]
    assert got["group_size"] == 2 and got["m"] == 64 and got["parts"] == 4
    assert got["device_s"] is None and got["issue_s"] > 0  # a part is one more collective and GEMM to issue


def test_interdecom_part_overhead_needs_no_group_set_up():
    """Without a process group calibrate measures on a one-rank group of its own, and tears it down."""
    import torch.distributed as dist

    from compass_fx.tools.calibrate import measure_part_overhead

    got = measure_part_overhead(parts=2, shard_rows=16, k=16, n=16, calls=2)
    assert got["group_size"] == 1 and got["m"] == 16 and not dist.is_initialized()


def test_the_model_reproduces_a_synthetic_calibration(tmp_path):
    """Points on a line latency + bytes / bandwidth come back exactly, for the regime they were
    measured in only; a real file round-trips through write_calibration."""
    lat, per_byte = 30e-6, 1 / 25e9
    points = [[b, lat + b * per_byte] for b in (4 << 20, 16 << 20, 64 << 20)]
    a, b = fit_latency_bandwidth(points)
    assert a == pytest.approx(lat, rel=1e-6) and b == pytest.approx(per_byte, rel=1e-6)

    path = tmp_path / "cal.json"
    tables = [{"op": op, "group_size": 2, "regime": "host-staged", "points": points}
              for op in ("all_gather", "reduce_scatter")]
    write_calibration(path, [with_overrides(gpu_spec("H200"), efficiency=0.7, graph_part_overhead_s=2e-6)],
                      {"device": "NVIDIA H200", "collectives": tables})
    assert json.loads(path.read_text())["collectives"] == tables
    staged, nvlink = Topology.preset("h200-host-staged-8"), Topology.preset("h200-nvswitch-8")
    before = collective_time("all_gather", 64 << 20, nvlink, 2).seconds
    with use_calibration(path):
        got = collective_time("all_gather", 64 << 20, staged, 2)
        assert got.seconds == pytest.approx(lat + (64 << 20) * per_byte, rel=1e-6)
        assert got.latency_s == pytest.approx(lat, rel=1e-6)
        assert collective_time("all_gather", 64 << 20, nvlink, 2).seconds == before  # other regime: the model
        w = Workload("all_gather_matmul", 8192, 7168, 4096, "bfloat16", 2)
        assert select(w, staged).candidate("sequential").seconds > got.seconds
        # the per-part cost calibrate measured under CUDA graphs comes back too
        assert gpu_spec("H200").graph_part_overhead_s == 2e-6 and gpu_spec("H200").efficiency == 0.7


def test_a_second_regime_is_added_to_the_same_file(tmp_path):
    """calibrate --collectives in the host-staged regime keeps the peer-to-peer tables already in
    the file (same GPU), and replaces only what it measured again."""
    import json

    from compass_fx.tools.commands import _other_regimes_kept

    path = tmp_path / "cal.json"
    p2p = [{"op": "all_gather", "group_size": 2, "regime": "peer-to-peer", "points": [[1, 1e-5], [2, 2e-5]]}]
    staged = [{"op": "all_gather", "group_size": 2, "regime": "host-staged", "points": [[1, 1e-4], [2, 2e-4]]}]
    path.write_text(json.dumps({"device": "NVIDIA H200", "collectives": p2p}))
    assert _other_regimes_kept(str(path), "NVIDIA H200", staged) == p2p
    assert _other_regimes_kept(str(path), "NVIDIA H200", p2p) == []  # measured again: replaced
    assert _other_regimes_kept(str(path), "NVIDIA H100", staged) == []  # another GPU: not mixed
    assert _other_regimes_kept(str(tmp_path / "missing.json"), "NVIDIA H200", staged) == []
    assert _other_regimes_kept(str(path), "NVIDIA H200", []) == p2p  # a run without --collectives keeps them


def test_a_calibrated_host_prices_the_fused_calls(tmp_path):
    """A calibration that measured this host's launches (compass-fx calibrate's "fused_host")
    prices the fused calls' host time from them: the fitted host's own launches give back the
    built-in constants; launches twice as dear give commands twice as dear and the call's fixed
    work too (the measured dispatch kept as measured); a file without them leaves the constants."""
    from compass_fx.cost import strategies as st

    staged = Topology.preset("h200-host-staged-8")
    w = Workload("matmul_all_reduce", 2048, 4096, 7168, "bfloat16", 2)
    default = st.fused_host_seconds(w, staged, "direct", replayed=False)  # issued command by command
    replayed = st.fused_host_seconds(w, staged, "direct")  # replayed from a captured graph (the default)
    dispatch = st.FUSED_HOST_CALL_S - st.FUSED_HOST_CALL_REST_S

    def priced(fused_host: dict | None) -> tuple[float, dict, float]:
        with calibrated_fused_host(tmp_path / f"cal{len(list(tmp_path.iterdir()))}.json", fused_host):
            call, per_command = st.fused_host_costs()
            return call, per_command, st.fused_host_seconds(w, staged, "direct", replayed=False)

    def replay_priced(launch_s: dict) -> float:
        with calibrated_fused_host(tmp_path / f"cal{len(list(tmp_path.iterdir()))}.json", {"launch_s": launch_s}):
            return st.fused_host_seconds(w, staged, "direct")

    # a replayed call: the launches of the host its constants were fitted on give them back; twice as dear, twice
    assert replay_priced(dict(st._REPLAY_FITTED_LAUNCH_S)) == pytest.approx(replayed)
    assert replay_priced({k: 2 * v for k, v in st._REPLAY_FITTED_LAUNCH_S.items()}) == pytest.approx(2 * replayed)
    assert replayed < default / 2  # measured: 3.6x less host time at two ranks (fused_host_time-h200-replay)

    call, per_command, same = priced({"launch_s": dict(st._FITTED_LAUNCH_S), "dispatch_s": dispatch})
    assert call == pytest.approx(st.FUSED_HOST_CALL_S)
    for kind, cost in st.FUSED_HOST_COMMAND_S.items():
        assert per_command[kind] == pytest.approx(cost, rel=0.1)
    assert same == pytest.approx(default, rel=0.05)
    dear = {k: 2 * v for k, v in st._FITTED_LAUNCH_S.items()}
    call, per_command, slower = priced({"launch_s": dear, "dispatch_s": dispatch})
    assert call == pytest.approx(dispatch + 2 * st.FUSED_HOST_CALL_REST_S)
    assert per_command == pytest.approx({k: st.LAUNCH_INSIDE_CALL * v for k, v in dear.items()})
    assert 1.7 * default < slower < 2 * default
    assert priced(None)[2] == default
    with use_calibration(tmp_path / "cal3.json"):  # the file with dear launches prices the choice too
        dear_replayed = st.fused_host_seconds(w, staged, "direct")
        assert dear_replayed > replayed
        assert select(w, staged, fused_schedules=("direct",)).candidate("fuse(direct)").seconds >= dear_replayed
