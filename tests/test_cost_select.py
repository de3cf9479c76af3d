"""Selection: which strategy wins where, the candidates listed, determinism, planning a layer."""
import pytest

from compass_fx.cost import SCHEDULES, Topology, Workload, plan, select
from compass_fx.cost.collective import collective_seconds
from compass_fx.cost.gemm import gemm_seconds
from compass_fx.cost.layer import format_layer_plan, layer_workloads, plan_layer
from compass_fx.cost.strategies import (MAX_PARTS, decomposition_models, fused_breakdown, fused_host_seconds, gemm_shapes,
                                       host_staged_in_pieces)

from calibrated_host import calibrated_fused_host

H200 = Topology.preset("h200-nvswitch-8")
A6000 = Topology.preset("a6000-nvlink-pairs-pcie-8")
A100_PCIE = Topology.preset("a100-pcie-8")


def _host_slower(tmp_path, factor: float):
    """The model priced for a host whose launches cost ``factor`` times those the replayed call's
    constants were fitted with, as ``compass-fx calibrate`` would measure it: replayed as a step
    issues them, the fitted H200 host keeps up with the device on every pair priced here, so the
    host-bound pricing is shown on a slower one."""
    from compass_fx.cost import strategies

    launch = {k: factor * v for k, v in strategies._REPLAY_FITTED_LAUNCH_S.items()}
    return calibrated_fused_host(tmp_path / f"host-slower-{factor}.json", {"launch_s": launch})


def test_sequential_when_communication_is_negligible():
    # n = 65536: priced in device time (the H200 constants fitted to device-time GEMMs), the
    # 16384 x 57344 x 512 GEMM of earlier took 1.30 ms and its gather 5.2% of that
    w = Workload("all_gather_matmul", m=16384, n=65536, k=512, group_size=8)
    comm = collective_seconds("all_gather", 16384 * 512 * 2, H200, 8)
    assert comm < 0.05 * gemm_seconds(16384, 65536, 512, "bfloat16", "H200")
    d = select(w, H200)
    assert d.strategy == "sequential"
    assert d.reason.startswith("sequential: best alternative")


def test_group_of_one_is_sequential_only():
    d = select(Workload("matmul_all_reduce", m=1024, n=1024, k=1024, group_size=1), H200, fused_schedules=SCHEDULES)
    assert d.strategy == "sequential" and [c.label for c in d.candidates] == ["sequential"]


def test_decompose_when_communication_and_compute_are_comparable():
    w = Workload("all_gather_matmul", m=8192, n=3584, k=8192, group_size=8)
    comm = collective_seconds("all_gather", 8192 * 8192 * 2, A100_PCIE, 8)
    gemm = gemm_seconds(8192, 3584, 8192, "bfloat16", "A100")
    assert 1 / 3 < comm / gemm < 3
    d = select(w, A100_PCIE)
    assert d.strategy == "decompose" and d.parts > 1
    assert d.reason == f"decompose(d={d.parts}) {d.speedup:.2f}x faster than sequential"
    assert d.coefficients is not None and d.d_star is not None and d.d_star > 1


def test_candidates_cover_every_feasible_part_count_and_respect_parts_allowed():
    w = Workload("matmul_reduce_scatter", m=4096, n=4096, k=1792, group_size=8)
    d = select(w, H200)
    expected = [p for p in w.parts_allowed() if 1 < p <= MAX_PARTS]
    assert [c.parts for c in d.candidates if c.strategy == "decompose"] == expected
    assert all(c.seconds > 0 for c in d.candidates)
    only = Workload("matmul_reduce_scatter", m=4096, n=4096, k=1792, group_size=8, feasible_parts=(2, 4))
    assert [c.label for c in select(only, H200).candidates] == ["sequential", "decompose(d=2)", "decompose(d=4)"]
    models = decomposition_models(w, H200)
    for c in d.candidates[1:]:
        assert c.seconds == models[c.parts].seconds(c.parts)


def test_fuse_only_when_the_operators_exist():
    w = Workload("all_gather_matmul", m=8192, n=3584, k=8192, group_size=8)
    assert not [c for c in select(w, A6000).candidates if c.strategy == "fuse"]
    d = select(w, A6000, fused_schedules=("ring", "double_ring"))
    assert [c.label for c in d.candidates if c.strategy == "fuse"] == ["fuse(ring)", "fuse(double_ring)"]
    assert [c.label for c in plan(w, A6000).candidates if c.strategy == "fuse"] == [
        "fuse(ring)", "fuse(double_ring)", "fuse(direct)"]
    with pytest.raises(ValueError, match="fused_schedules"):
        select(w, A6000, fused_schedules=("zigzag",))
    pair = Workload("all_gather_matmul", m=8192, n=3584, k=8192, group_size=2)
    assert [c.label for c in plan(pair, A6000).candidates if c.strategy == "fuse"] == [
        "fuse(double_ring)", "fuse(direct)"]  # at two ranks the ring moves what "direct" moves


def test_double_ring_wins_on_the_papers_machine_and_ties_go_to_the_simpler_schedule():
    w = Workload("all_gather_matmul", m=8192, n=1024, k=8192, group_size=8)
    d = plan(w, A6000)
    assert d.label == "fuse(double_ring)"
    assert d.candidate("fuse(double_ring)").seconds < 0.8 * d.candidate("fuse(ring)").seconds
    # on a switch the device time of the schedules ties, and a tie goes to the simpler one: a
    # schedule whose calls cost the host no more than any other's ("direct": every peer pulled
    # once, nothing relayed; its replay graph waits no more often than the ring's)
    w = Workload("matmul_reduce_scatter", m=32768, n=8192, k=4096, group_size=8)
    on_switch = plan(w, H200)
    assert on_switch.candidate("fuse(ring)").seconds == on_switch.candidate("fuse(double_ring)").seconds \
        == on_switch.candidate("fuse(direct)").seconds
    hosts = {s: fused_host_seconds(w, H200, s) for s in ("ring", "double_ring", "direct")}
    assert on_switch.schedule == "direct" and hosts["direct"] == min(hosts.values()), hosts


def test_a_host_bound_small_pair_prices_each_schedule_at_its_host_time(tmp_path):
    """Where a fused call's host issue exceeds its device time, each schedule is priced at its host
    time, and the double ring's twice as many pieces cost the host their extra waits.  Replayed
    from a captured graph as a step issues them, the fitted H200 host is never the bound at TP = 8
    (the ring's seven steps take longer on the device): a host whose launches cost three times as
    much, as a calibration would measure it, is."""
    small_w = Workload("matmul_reduce_scatter", m=512, n=2048, k=1024, group_size=8)
    fitted = {s: fused_host_seconds(small_w, H200, s) for s in ("ring", "double_ring")}
    device = {s: fused_breakdown(small_w, H200, s).seconds for s in ("ring", "double_ring")}
    assert all(fitted[s] < device[s] for s in fitted), (fitted, device)  # the fitted host keeps up
    with _host_slower(tmp_path, 3):
        small = plan(small_w, H200)
        host = {s: fused_host_seconds(small_w, H200, s) for s in ("ring", "double_ring")}
    assert host == pytest.approx({s: 3 * t for s, t in fitted.items()})
    assert host["double_ring"] > 1.2 * device["double_ring"]  # host-bound: the premise
    for s in ("ring", "double_ring"):
        assert small.candidate(f"fuse({s})").seconds == max(host[s], device[s])
    assert small.candidate("fuse(double_ring)").seconds > 1.2 * small.candidate("fuse(ring)").seconds


def test_selection_is_deterministic_and_validates_its_inputs():
    w = Workload("matmul_all_reduce", m=8192, n=8192, k=3584, group_size=4)
    assert plan(w, A6000) == plan(w, Topology.preset("a6000-nvlink-pairs-pcie-8"))
    import torch
    if not torch.cuda.is_available():  # without a GPU the default is the h200 preset, never detection
        assert select(w) == select(w, Topology.preset("h200-nvswitch-8"))
    with pytest.raises(ValueError, match="workload"):
        select("not a workload", H200)
    assert select(w, "a6000-nvlink-pairs-pcie-8") == select(w, A6000)
    with pytest.raises(ValueError, match="topology"):
        select(w, 42)
    with pytest.raises(ValueError, match="known presets"):
        select(w, "dgx-9000")
    big = Workload("matmul_all_reduce", m=64, n=64, k=64, group_size=16)
    with pytest.raises(ValueError, match="group size"):
        select(big, H200)                       # an explicit machine must hold the group
    if not torch.cuda.is_available():
        assert select(big).topology == "2x-h200-nvswitch-8-ib"  # the default spans two of them


def test_layer_workloads_follow_the_tp_plan():
    fwd = layer_workloads("llama3-70b", 8, 8192)
    assert [(n, w.kind) for n, w in fwd] == [
        ("attn.qkv", "all_gather_matmul"), ("attn.out", "matmul_reduce_scatter"),
        ("mlp.w1+w3", "all_gather_matmul"), ("mlp.w2", "matmul_reduce_scatter")]
    assert fwd[2][1].matmuls == 2 and fwd[2][1].n == 2 * 28672 // 8 and fwd[2][1].k == 8192
    assert fwd[0][1].n == 1024 + 2 * 128 and fwd[0][1].extra_n == (128, 128)
    assert gemm_shapes(fwd[0][1]) == ((1024, 8192), (128, 8192), (128, 8192))
    assert gemm_shapes(fwd[2][1]) == ((3584, 8192), (3584, 8192))
    reduced = Workload("matmul_reduce_scatter", m=64, n=4096, k=2 * 3584, matmuls=2)
    assert gemm_shapes(reduced) == ((4096, 3584), (4096, 3584))
    with pytest.raises(ValueError, match="extra_n"):
        gemm_shapes(Workload("all_gather_matmul", m=64, n=100, k=8, matmuls=2, extra_n=(100,)))
    plain = layer_workloads("llama3-8b", 4, 4096, sequence_parallel=False)
    assert [w.kind for _, w in plain] == ["matmul_all_reduce"] * 2
    assert len(layer_workloads("llama3-8b", 2, 4096, backward=True)) == 8
    with pytest.raises(ValueError, match="unknown model"):
        layer_workloads("gpt-5", 8, 8192)
    with pytest.raises(ValueError, match="tp=3"):
        layer_workloads("llama3-8b", 3, 8193)


def test_layer_plan_table():
    lp = plan_layer("llama3-70b", 8, 8192, A6000)
    assert lp.planned_s <= lp.sequential_s and lp.speedup >= 1
    text = format_layer_plan(lp)
    assert "mlp.w1+w3" in text and "speedup" in text and "on a6000-nvlink-pairs-pcie-8" in text


def test_auto_prices_fused_operators_by_default_only_without_peer_access():
    """auto_fuse=None (default): the fused operators are candidates where the group's GPUs lack
    peer access (host-staged transport), not on NVLink; True / False override; bad values fail."""
    from compass_fx import check_options
    from compass_fx.passes.decide import auto_fuse

    assert auto_fuse(None, 2, "h200-host-staged-8") and auto_fuse(None, 8, "h200-host-staged-8")
    assert not auto_fuse(None, 2, "h200-nvswitch-8")
    assert not auto_fuse(None, 1, "h200-host-staged-8")  # a group of one moves nothing
    assert not auto_fuse(None, 16, "h200-host-staged-8")  # across machines: no shared host memory
    assert auto_fuse(True, 2, "h200-nvswitch-8") and not auto_fuse(False, 2, "h200-host-staged-8")
    with pytest.raises(ValueError, match="auto_fuse"):
        check_options({"auto_fuse": "yes"})


def test_a_host_staged_fused_decision_says_into_how_many_pieces_and_why():
    """The reason names the pieces a block is cut into and the cap by ranks that set them (4 a
    block at two and four ranks, 2 at eight), the all-reduce its chunks; a forced fused pair too."""
    said = {}
    for g in (2, 4, 8):
        for kind, n, k in (("all_gather_matmul", 7168, 4096), ("matmul_all_reduce", 4096, 7168)):
            d = plan(Workload(kind, 32768 if g > 2 else 8192, n, k, "bfloat16", g), "h200-host-staged-8",
                     fused_schedules=("direct",))
            assert d.strategy == "fuse"
            said[g, kind] = d.reason.split(", through host memory: ")[1]
    assert said == {(2, "all_gather_matmul"): "each block in 4 pieces (at most 4 a block at 2 ranks)",
                    (2, "matmul_all_reduce"): "in 4 chunks, each pulled whole from the peer (at most 4 at 2 ranks)",
                    (4, "all_gather_matmul"): "each block in 4 pieces (at most 4 a block at 4 ranks)",
                    (4, "matmul_all_reduce"): "in 4 chunks (at most 4 at 4 ranks)",
                    (8, "all_gather_matmul"): "each block in 2 pieces (at most 2 a block at 8 ranks)",
                    (8, "matmul_all_reduce"): "in 2 chunks (at most 2 at 8 ranks)"}
    unset_host = fused_host_seconds(Workload("all_gather_matmul", 32768, 7168, 4096, "bfloat16", 8),
                                    Topology.preset("h200-host-staged-8"), "direct")
    small = Workload("all_gather_matmul", 2048, 7168, 4096, "bfloat16", 8)  # 2 MiB blocks
    assert host_staged_in_pieces(small) == "each block in 1 piece (at most 2 a block at 8 ranks)"
    tiny = Workload("matmul_all_reduce", 12, 4096, 7168, "bfloat16", 8)  # no chunk count splits 12 rows 8 ways
    assert host_staged_in_pieces(tiny) == "a reduce-scatter, then a gather of its sums"
    # the settings a run reads, the model and the reason read too
    big = Workload("all_gather_matmul", 32768, 7168, 4096, "bfloat16", 8)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("COMPASS_HOST_MOST_PIECES", "8")
        assert host_staged_in_pieces(big) == "each block in 8 pieces (at most 8 a block by COMPASS_HOST_MOST_PIECES=8)"
        assert fused_host_seconds(big, Topology.preset("h200-host-staged-8"), "direct") > unset_host  # 56 pulls, not 14
        m.setenv("COMPASS_HOST_PIECE_MIB", "16")
        assert host_staged_in_pieces(big).startswith("each block in 2 pieces")  # 32 MiB blocks, 16 MiB pieces
    peer = plan(Workload("all_gather_matmul", 8192, 7168, 4096, "bfloat16", 8), "h200-nvswitch-8",
                fused_schedules=("direct",))
    assert "host memory" not in peer.reason


def test_fused_calls_cost_at_least_the_hosts_work(tmp_path):
    """A fused call launches its plans' commands (replayed from a captured graph, or one by one
    from Python): a call is priced at the longer of its host's issue and its device time, so a
    small pair on a slow host is host-bound (its prediction is the host's time), a large one
    device-bound; the host-staged plans (more commands) cost the host more than the peer-to-peer
    ones."""
    from compass_fx.cost import strategies
    from compass_fx.cost.strategies import fused_breakdown, fused_host_seconds, fused_seconds

    staged, nvlink = Topology.preset("h200-host-staged-8"), Topology.preset("h200-nvswitch-8")
    small = Workload("all_gather_matmul", 128, 2048, 1024, "bfloat16", 2)
    large = Workload("all_gather_matmul", 16384, 7168, 4096, "bfloat16", 2)
    with _host_slower(tmp_path, 3):
        for topo in (staged, nvlink):
            host = fused_host_seconds(small, topo, "direct")
            assert fused_seconds(small, topo, "direct") == host > fused_breakdown(small, topo, "direct").seconds
            big = fused_breakdown(large, topo, "direct").seconds
            assert fused_seconds(large, topo, "direct") == big > fused_host_seconds(large, topo, "direct")
    # on the fitted host (steady: 13-24 us measured for the peer transport's calls at four ranks, issued
    # from C, fused_host_time-h200-lane-peer-w48-pin-mps) the small call keeps up with its device time
    for topo in (staged, nvlink):
        device = fused_breakdown(small, topo, "direct").seconds
        assert fused_seconds(small, topo, "direct") == device > fused_host_seconds(small, topo, "direct")
    assert fused_host_seconds(small, staged, "direct") > fused_host_seconds(small, nvlink, "direct") \
        > strategies.FUSED_REPLAY_CALL_S
    # the ring all-reduce is the fused reduce-scatter, then a gather, issued from C as one call: the
    # reduce-scatter's price, one more graph and the gather's slow nodes (as many as the reduce-scatter's)
    ring_ar = Workload("matmul_all_reduce", 8192, 4096, 7168, "bfloat16", 4)
    ring_rs = Workload("matmul_reduce_scatter", 8192, 4096, 7168, "bfloat16", 4)
    rs_nodes = (fused_host_seconds(ring_rs, nvlink, "ring") - strategies.FUSED_REPLAY_CALL_S) \
        / strategies.FUSED_REPLAY_SLOW_NODE_S
    assert rs_nodes == pytest.approx(round(rs_nodes)) and round(rs_nodes) >= 1
    assert fused_host_seconds(ring_ar, nvlink, "ring") == pytest.approx(
        fused_host_seconds(ring_rs, nvlink, "ring") + strategies.FUSED_REPLAY_GRAPH_S
        + round(rs_nodes) * strategies.FUSED_REPLAY_SLOW_NODE_S)
    assert strategies.FUSED_REPLAY_GRAPH_S < strategies.FUSED_REPLAY_CALL_S  # no second call's cost


def test_a_replayed_call_is_priced_by_its_waits_and_host_memory_copies():
    """A replay graph's launch costs the host per stream wait and per copy to or from host memory,
    next to nothing per kernel or device copy (graph_node_probe): a 4096-row gather at two ranks has
    8 waits and 16 of its 17 copies through host memory when host-staged (the breakdown of
    fused_host_time counts 8 stream waits and 17 copies in its graph), one wait and device copies
    on the peer transport; their prices differ by exactly those nodes."""
    from compass_fx.cost import strategies
    from compass_fx.kernels.issue_order import call_plans
    from compass_fx.kernels.protocol import Copy, WaitFlag

    # eight pieces a block, as the breakdown measured them (before the cap of four at two ranks)
    (staged_plan,) = call_plans("all_gather_matmul", "direct", 2, 0, 4096, 4096, 1, 2, host=True, most_pieces=8)
    (peer_plan,) = call_plans("all_gather_matmul", "direct", 2, 0, 4096, 4096, 1, 2, host=False)
    assert sum(isinstance(c, WaitFlag) for c in staged_plan.commands) == 8
    assert sum(isinstance(c, Copy) for c in staged_plan.commands) == 17
    assert strategies.replay_slow_nodes(staged_plan, host=True) == 8 + 16
    assert strategies.replay_slow_nodes(peer_plan, host=False) == 1
    w = Workload("all_gather_matmul", 8192, 7168, 4096, "bfloat16", 2)
    staged, nvlink = Topology.preset("h200-host-staged-8"), Topology.preset("h200-nvswitch-8")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("COMPASS_HOST_MOST_PIECES", "8")
        difference = (strategies.fused_host_seconds(w, staged, "direct")
                      - strategies.fused_host_seconds(w, nvlink, "direct"))
    assert difference == pytest.approx(23 * strategies.FUSED_REPLAY_SLOW_NODE_S)


def test_a_run_of_waits_a_replay_batches_is_priced_as_one_node():
    """An all-reduce at eight ranks waits for each chunk's pulls from the 7 peers in a row (4 runs
    of 7 waits at 8192 rows): batched, as replays wait by default, each run is one slow node."""
    from compass_fx.cost import strategies
    from compass_fx.kernels.issue_order import call_plans

    for host in (False, True):
        (plan,) = call_plans("matmul_all_reduce", "direct", 8, 0, 8192, 4096, 1, 2, host=host)
        one_each = strategies.replay_slow_nodes(plan, host, batched_waits=False)
        assert strategies.replay_slow_nodes(plan, host) == one_each - 4 * 6
    (peer,) = call_plans("matmul_all_reduce", "direct", 8, 0, 8192, 4096, 1, 2, host=False)
    assert strategies.replay_slow_nodes(peer, False) == 4  # its copies are device copies: only the 4 batches


def test_strategy_labels_are_written_and_read_by_one_rule():
    from compass_fx.cost.decision import Candidate, strategy_label

    for c in (Candidate("sequential"), Candidate("decompose", 4), Candidate("fuse", 1, "double_ring")):
        assert Candidate.from_label(c.label) == Candidate(c.strategy, c.parts, c.schedule)
    assert strategy_label("fuse", schedule="direct", asynchronous=True) == "fuse(direct, async)"
    for bad in ("fuse(ringg)", "decompose(d=x)", "decompose", "auto"):
        with pytest.raises(ValueError, match="not a strategy label"):
            Candidate.from_label(bad)


def test_at_two_ranks_a_tie_goes_to_direct_not_the_double_ring():
    """Both move each shard to the one peer over the same link (equal device time); the double
    ring cuts it in two halves, more launches for the host: "direct" is the simpler schedule."""
    two = Topology.from_dict({"name": "two-h200", "gpu": "H200",
                              "nodes": [{"id": "gpu0", "kind": "gpu"}, {"id": "gpu1", "kind": "gpu"}],
                              "links": [{"src": "gpu0", "dst": "gpu1", "gbps": 360.0, "latency_us": 0.9,
                                         "kind": "nvlink-bridge"},
                                        {"src": "gpu1", "dst": "gpu0", "gbps": 360.0, "latency_us": 0.9,
                                         "kind": "nvlink-bridge"}]})
    for kind, n, k in (("all_gather_matmul", 7168, 4096), ("matmul_reduce_scatter", 4096, 7168)):
        d = plan(Workload(kind, m=16384, n=n, k=k, group_size=2), two)
        assert d.candidate("fuse(direct)").seconds == d.candidate("fuse(double_ring)").seconds
        assert d.label == "fuse(direct)", d.reason


def test_a_gather_whose_parts_replay_is_priced_with_the_replayed_part_cost():
    """An eager decomposed gather whose parts' gathers replay from one CUDA graph (the default on
    NCCL) pays ``replayed_part_overhead_s`` per extra part instead of the issued part's cost; the
    decision says how its parts were priced when it decomposes, and nothing else moves."""
    from dataclasses import replace

    from compass_fx.machine.gpus import GPUS

    spec = GPUS["H200"]
    assert spec.graph_part_overhead_s < spec.replayed_part_overhead_s < spec.part_overhead_s
    nvlink = Topology.preset("h200-nvswitch-8")
    # Llama-3 8B's gate + up gather at TP = 8 and 32768 tokens: sequential issued, 4 parts replayed
    issued = Workload("all_gather_matmul", m=32768, n=7168, k=4096, group_size=8)
    replayed = replace(issued, parts_replayed=True)
    for parts, model in decomposition_models(issued, nvlink).items():
        saved = model.seconds(parts) - decomposition_models(replayed, nvlink)[parts].seconds(parts)
        assert saved == pytest.approx((spec.part_overhead_s - spec.replayed_part_overhead_s) * parts, rel=1e-6)
    before, after = select(issued, nvlink), select(replayed, nvlink)
    assert after.candidate("sequential").seconds == before.candidate("sequential").seconds
    assert (before.label, after.label) == ("sequential", "decompose(d=4)")
    assert after.reason.endswith("(its parts' gathers priced as replayed from one CUDA graph)")
    assert "replayed" not in before.reason


def test_cuda_graph_replays_are_priced_without_host_issue(tmp_path):
    """Replayed as CUDA graphs the host issues nothing: an extra InterDecom part costs the device's
    overhead alone (``graph_part_overhead_s``, measured under "reduce-overhead" on one H200), a
    fused call its device time however small, and every other price stays as it was."""
    from dataclasses import replace

    from compass_fx.cost.strategies import fused_breakdown, fused_host_seconds, fused_seconds
    from compass_fx.machine.gpus import GPUS

    spec = GPUS["H200"]
    assert spec.graph_part_overhead_s < 0.2 * spec.part_overhead_s
    eager = Workload("matmul_reduce_scatter", m=8192, n=4096, k=7168, group_size=2)
    graphs = replace(eager, cuda_graphs=True)
    nvlink = Topology.preset("h200-nvswitch-8")
    for parts, model in decomposition_models(eager, nvlink).items():
        replayed = decomposition_models(graphs, nvlink)[parts]
        saved = model.seconds(parts) - replayed.seconds(parts)
        assert saved == pytest.approx((spec.part_overhead_s - spec.graph_part_overhead_s) * parts, rel=1e-6)
    # a host-bound fused call (on a host whose launches cost three times the fitted one's)
    small = Workload("all_gather_matmul", 128, 2048, 1024, "bfloat16", 2)
    with _host_slower(tmp_path, 3):
        assert fused_host_seconds(small, nvlink, "direct") > fused_breakdown(small, nvlink, "direct").seconds
        assert fused_seconds(replace(small, cuda_graphs=True), nvlink, "direct") \
            == fused_breakdown(small, nvlink, "direct").seconds
        assert fused_seconds(small, nvlink, "direct") > fused_breakdown(small, nvlink, "direct").seconds
    assert select(graphs, nvlink).candidate("sequential").seconds == select(eager, nvlink).candidate("sequential").seconds
    # fewer host costs can only make the alternatives to sequential cheaper
    assert select(graphs, nvlink).predicted_s <= select(eager, nvlink).predicted_s


def test_a_reason_says_where_a_fused_call_is_priced_at_its_hosts_issue(tmp_path):
    """Eager, a fused call whose host issue is longer than its device time is priced at the host's:
    the reason says so, with both figures, whether it won or was the best alternative; a device-bound
    one, or the same call under CUDA graphs, says nothing of the host.  (Hosts whose launches cost
    two and three times the fitted one's: on that one these calls keep up with the device.)"""
    from dataclasses import replace

    staged, nvlink = Topology.preset("h200-host-staged-8"), Topology.preset("h200-nvswitch-8")
    thin = Workload("matmul_reduce_scatter", 256, 4096, 7168, "bfloat16", 8)
    with _host_slower(tmp_path, 3):
        won = select(thin, staged, fused_schedules=("direct",))
        host, device = fused_host_seconds(thin, staged, "direct"), fused_breakdown(thin, staged, "direct").seconds
    assert won.strategy == "fuse" and host > device and won.predicted_s == host >= 100e-6
    assert (f"faster than sequential (priced at the host's issue of a call, {host * 1e6:.0f} us, over its "
            f"{device * 1e6:.0f} us on the device), through host memory") in won.reason, won.reason
    small = Workload("all_gather_matmul", 128, 4096, 1024, "bfloat16", 8)
    with _host_slower(tmp_path, 2):
        lost = select(small, nvlink, fused_schedules=SCHEDULES)
        best = min(lost.candidates[1:], key=lambda c: c.seconds)
        small_host = fused_host_seconds(small, nvlink, best.schedule)
    assert lost.strategy == "sequential" and best.strategy == "fuse" and best.seconds == small_host < 100e-6
    assert (f"best alternative {best.label} would be" in lost.reason
            and f"(priced at the host's issue of a call, {small_host * 1e6:.1f} us, over its" in lost.reason), lost.reason
    assert "host's issue" not in select(small, nvlink, fused_schedules=SCHEDULES).reason  # the fitted host keeps up
    graphs = select(replace(small, cuda_graphs=True), nvlink, fused_schedules=SCHEDULES)
    big = select(Workload("all_gather_matmul", 8192, 4096, 7168, "bfloat16", 8), nvlink, fused_schedules=SCHEDULES)
    assert "host's issue" not in graphs.reason and "host's issue" not in big.reason, (graphs.reason, big.reason)


def test_a_deferred_fused_call_is_priced_as_replayed_plus_what_its_asynchronous_form_adds():
    """fused_async defers a reduction with work to overlap (a ``*_start`` call), which replays on a
    stream of its own: its host is priced as the replayed call plus ``FUSED_DEFERRED_S`` (the
    start's Python path, the events, the join), well under the same call issued command by command
    (as every deferred call was before).  A 128-row host-staged pair at two ranks stays
    sequential where the plain replayed call wins, and the reason names the deferred call; an
    8-rank 1024-row pair, whose deferred call issued command by command would outlast its device
    time, fuses; under CUDA graphs nothing is issued."""
    from dataclasses import replace

    from compass_fx.cost import strategies

    staged = Topology.preset("h200-host-staged-8")
    small = Workload("matmul_reduce_scatter", 128, 4096, 7168, "bfloat16", 2)
    deferred = replace(small, deferred=True)
    host = fused_host_seconds(deferred, staged, "direct")
    assert host == pytest.approx(fused_host_seconds(small, staged, "direct") + strategies.FUSED_DEFERRED_S)
    assert host < fused_host_seconds(small, staged, "direct", replayed=False) / 2
    plain, later = (select(w, staged, fused_schedules=("direct",)) for w in (small, deferred))
    assert plain.strategy == "fuse" and later.strategy == "sequential", (plain.reason, later.reason)
    assert (f"(priced at the host's issue of a deferred call, replayed on a stream of its own, {host * 1e6:.0f} us, "
            in later.reason), later.reason
    eight = replace(Workload("matmul_reduce_scatter", 1024, 4096, 7168, "bfloat16", 8), deferred=True)
    device = fused_breakdown(eight, staged, "direct").seconds
    assert fused_host_seconds(eight, staged, "direct") < device < fused_host_seconds(eight, staged, "direct",
                                                                                     replayed=False)
    assert select(eight, staged, fused_schedules=("direct",)).strategy == "fuse"
    graphs = [select(replace(w, cuda_graphs=True), staged, fused_schedules=("direct",)) for w in (small, deferred)]
    assert graphs[0].predicted_s == graphs[1].predicted_s and graphs[0].label == graphs[1].label
