"""Topology presets, files, and detection from recorded ``nvidia-smi topo -m`` text."""
import json

import pytest

from compass_fx.cost import Topology
from compass_fx.machine.detect import parse_topo_matrix, topology_from_matrix

# Recorded on the lent one-GPU H200 machine (nvidia-smi underlines the header with ANSI codes).
H200_1GPU = ('\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X \t0-15\t0\t\tN/A\n\n'
             'Legend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect '
             'between NUMA nodes (e.g., QPI/UPI)\n  NV#  = Connection traversing a bonded set of # NVLinks\n')

# The layout of a DGX H100 (NVSwitch: every pair NV18), NIC columns and rows included.
DGX_H100 = "\t" + "\t".join([f"GPU{i}" for i in range(8)] + ["NIC0", "NIC1", "CPU Affinity", "NUMA Affinity",
                                                                 "GPU NUMA ID"]) + "\n"
for i in range(8):
    cells = ["X" if j == i else "NV18" for j in range(8)]
    DGX_H100 += f"GPU{i}\t" + "\t".join(cells + ["PXB" if i < 4 else "SYS", "SYS" if i < 4 else "PXB",
                                                  "0-55,112-167" if i < 4 else "56-111,168-223",
                                                  "0" if i < 4 else "1", "N/A"]) + "\n"
DGX_H100 += "NIC0\t" + "\t".join(["PXB"] * 4 + ["SYS"] * 4 + ["X", "SYS"]) + "\n\nLegend:\n\n  X    = Self\n"

# The paper's machine: NVLink bridges between pairs, PCIe host bridges, two sockets.
A6000_PAIRS = """        GPU0    GPU1    GPU2    GPU3    GPU4    GPU5    GPU6    GPU7    CPU Affinity    NUMA Affinity
GPU0     X      NV4     NODE    NODE    SYS     SYS     SYS     SYS     0-31    0
GPU1    NV4      X      NODE    NODE    SYS     SYS     SYS     SYS     0-31    0
GPU2    NODE    NODE     X      NV4     SYS     SYS     SYS     SYS     0-31    0
GPU3    NODE    NODE    NV4      X      SYS     SYS     SYS     SYS     0-31    0
GPU4    SYS     SYS     SYS     SYS      X      NV4     NODE    NODE    32-63   1
GPU5    SYS     SYS     SYS     SYS     NV4      X      NODE    NODE    32-63   1
GPU6    SYS     SYS     SYS     SYS     NODE    NODE     X      NV4     32-63   1
GPU7    SYS     SYS     SYS     SYS     NODE    NODE    NV4      X      32-63   1

Legend:

  X    = Self
"""

# Eight PCIe GPUs, two per PCIe switch, two sockets.
PCIE_SWITCHES = """\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t0-15\t0
GPU1\tPIX\t X \tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t0-15\t0
GPU2\tNODE\tNODE\t X \tPIX\tSYS\tSYS\tSYS\tSYS\t0-15\t0
GPU3\tNODE\tNODE\tPIX\t X \tSYS\tSYS\tSYS\tSYS\t0-15\t0
GPU4\tSYS\tSYS\tSYS\tSYS\t X \tPIX\tNODE\tNODE\t16-31\t1
GPU5\tSYS\tSYS\tSYS\tSYS\tPIX\t X \tNODE\tNODE\t16-31\t1
GPU6\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\t X \tPIX\t16-31\t1
GPU7\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\t X \t16-31\t1
"""


@pytest.mark.parametrize("name", Topology.presets())
def test_presets_load_and_route_between_every_gpu_pair(name):
    topo = Topology.preset(name)
    assert topo.num_gpus == (16 if name.startswith("2x") else 8)
    for a in topo.gpus:
        for b in topo.gpus:
            path = topo.route(a, b)
            assert (len(path) == 0) == (a == b)
            assert all(topo.bandwidth(e) > 0 for e in path)
    again = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again.fingerprint() == topo.fingerprint()


def test_preset_shapes():
    assert Topology.preset("h200-nvswitch-8").is_switched()
    assert not Topology.preset("a6000-nvlink-pairs-pcie-8").is_switched()
    two = Topology.preset("2x-h100-nvswitch-8-ib")
    assert two.is_switched(8) and not two.is_switched(16)
    assert {k for _, _, k in two.graph.edges(data="kind")} == {"nvlink4-switch", "ib-ndr"}
    pairs = Topology.preset("a6000-nvlink-pairs-pcie-8")
    assert pairs.route("gpu0", "gpu1") == (("gpu0", "gpu1"),)        # the NVLink bridge
    assert ("cpu0", "cpu1") in pairs.route("gpu3", "gpu4")           # across the sockets


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        Topology.preset("dgx-9000")
    assert "dgx-9000" in str(err.value) and "a6000-nvlink-pairs-pcie-8" in str(err.value)
    with pytest.raises(ValueError, match="neither a preset nor a file"):
        Topology.resolve("dgx-9000")


def test_from_file_json_and_yaml(tmp_path):
    desc = {"name": "two-bridged", "gpu": "A6000",
            "nodes": [{"id": "gpu0", "kind": "gpu"}, {"id": "gpu1", "kind": "gpu"}],
            "links": [{"src": "gpu0", "dst": "gpu1", "gbps": 50, "latency_us": 1.0, "kind": "nvlink"}]}
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(desc))
    topo = Topology.from_file(path)
    assert topo.num_gpus == 2 and topo.bandwidth(("gpu1", "gpu0")) == 50e9
    assert Topology.resolve(str(path)).fingerprint() == topo.fingerprint()
    yaml = pytest.importorskip("yaml")
    ypath = tmp_path / "machine.yaml"
    ypath.write_text(yaml.safe_dump(desc))
    assert Topology.from_file(ypath).fingerprint() == topo.fingerprint()


def test_bad_descriptions_are_named():
    with pytest.raises(ValueError, match="'gpu'"):
        Topology.from_dict({"nodes": [], "links": []})
    with pytest.raises(ValueError, match="unknown node 'gpu9'"):
        Topology.from_dict({"gpu": "H100", "nodes": [{"id": "gpu0", "kind": "gpu"}],
                            "links": [{"src": "gpu0", "dst": "gpu9", "gbps": 1}]})
    with pytest.raises(ValueError, match="gpu must be one of"):
        Topology.from_dict({"gpu": "Voodoo2", "nodes": [{"id": "gpu0", "kind": "gpu"}], "links": []})
    with pytest.raises(ValueError, match="group size"):
        Topology.preset("h100-nvswitch-8").group(9)


def test_default_on_cpu_is_the_h200_preset_without_detection():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: default() detects")
    assert Topology.default().name == "h200-nvswitch-8"


def test_parse_recorded_h200_text():
    assert parse_topo_matrix(H200_1GPU) == [["X"]]
    topo = topology_from_matrix([["X"]], "H200")
    assert topo.num_gpus == 1


def test_parse_dgx_text_gives_one_nvswitch():
    matrix = parse_topo_matrix(DGX_H100)
    assert len(matrix) == 8 and matrix[0][1] == "NV18" and matrix[3][3] == "X"
    topo = topology_from_matrix(matrix, "H100")
    assert topo.is_switched()
    assert topo.bandwidth(("gpu0", "nvswitch0")) == pytest.approx(18 * 20e9)


def test_parse_a6000_text_gives_bridges_and_two_sockets():
    topo = topology_from_matrix(parse_topo_matrix(A6000_PAIRS), "A6000")
    assert topo.route("gpu2", "gpu3") == (("gpu2", "gpu3"),)
    kinds = [topo.graph.edges[e]["kind"] for e in topo.route("gpu1", "gpu6")]
    assert "upi" in kinds
    assert not topo.is_switched()
    # The detected machine behaves like the preset: the double ring wins there too.
    from compass_fx.cost.collective import collective_seconds
    assert collective_seconds("all_gather", 1e8, topo, 8, "double_ring") < collective_seconds(
        "all_gather", 1e8, topo, 8, "ring")


def test_parse_pcie_switch_text():
    topo = topology_from_matrix(parse_topo_matrix(PCIE_SWITCHES), "L40S")
    assert [n for n, k in topo.graph.nodes(data="kind") if k == "pcie_switch"] == [
        "pcie_sw0", "pcie_sw1", "pcie_sw2", "pcie_sw3"]
    assert len(topo.route("gpu0", "gpu1")) == 2                      # through their switch only


def test_parse_rejects_garbage():
    with pytest.raises(ValueError, match="no header"):
        parse_topo_matrix("hello\nworld\n")
    with pytest.raises(ValueError, match="unexpected cell"):
        parse_topo_matrix("\tGPU0\tGPU1\nGPU0\t X \tWAT\nGPU1\tWAT\t X \n")


def test_replicated_machines_talk_over_infiniband():
    one = Topology.preset("h200-nvswitch-8")
    two = one.replicated(2)
    assert two.num_gpus == 16 and two.name == "2x-h200-nvswitch-8-ib"
    assert two.route("gpu0", "gpu1") == (("gpu0", "nvswitch0_n0"), ("nvswitch0_n0", "gpu1"))
    assert [two.graph.edges[e]["kind"] for e in two.route("gpu3", "gpu12")] == ["ib-ndr", "ib-ndr"]
    assert one.replicated(1) is one
    with pytest.raises(ValueError, match="nodes"):
        one.replicated(0)


def test_host_staged_regime_is_detected_and_offers_fused_operators_through_host_memory(monkeypatch):
    """NCCL_P2P_DISABLE=1 (PCIe cards without peer access, or told so): the detected topology
    routes through host memory at the measured rate; the fused operators are offered there only
    with the schedule that meets in pinned host memory ("direct"), priced at the copy engines'
    host rate, which is far above what NCCL reaches there (its kernels stage through SMs)."""
    from compass_fx.cost import Topology, Workload, plan, sequential_seconds
    from compass_fx.machine import detect
    from compass_fx.cost.strategies import fused_breakdown

    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert detect.host_staged()
    topo = detect.host_staged_topology(2, "H200")
    assert not topo.peer_access(2)
    bw, per_piece = topo.host_copy(2)
    assert 30e9 <= bw <= 60e9 and 0 < per_piece < 50e-6
    assert Topology.preset("h200-host-staged-8").to_dict()["gpu"] == "H200"
    assert Topology.preset("h200-nvswitch-8").peer_access(8)
    assert Topology.preset("h200-nvswitch-8").host_copy(8) is None
    w = Workload("all_gather_matmul", 8192, 7168, 4096, "bfloat16", 2)
    staged = plan(w, topo)
    fused = [c for c in staged.candidates if c.strategy == "fuse"]
    assert [c.schedule for c in fused] == ["direct"]
    # 32 MiB gathered = 16 MiB per rank: about 0.4 ms each way at 40 GB/s, pipelined, beside the GEMM
    assert fused[0].seconds < 0.7 * sequential_seconds(w, topo)
    assert fused[0].seconds == fused_breakdown(w, topo, "direct").seconds
    assert not any(c.strategy == "fuse" for c in plan(w, topo, fused_schedules=("ring",)).candidates)
    assert staged.strategy == "fuse", staged.reason
    # with peer access every distinct schedule (at two ranks the ring is "direct": priced once)
    assert [c.schedule for c in plan(w, "h200-nvswitch-8").candidates if c.strategy == "fuse"] == [
        "double_ring", "direct"]
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")
    assert not detect.host_staged()


def test_host_staged_timeline_matches_the_prediction():
    """The timeline of a host-staged fused pair draws the whole GEMM beside one pipelined transfer
    and ends where the model's prediction does (less the fixed setup and the last piece's sum)."""
    from compass_fx.cost import Workload, plan
    from compass_fx.machine import detect
    from compass_fx.cost.strategies import FUSED_SETUP_S
    from compass_fx.cost.timeline import COMPUTE, candidate_segments

    topo = detect.host_staged_topology(2, "H200")
    for kind, n, k in (("all_gather_matmul", 14336, 4096), ("matmul_reduce_scatter", 4096, 7168)):
        w = Workload(kind, 8192, n, k, "bfloat16", 2)
        fused = plan(w, topo).candidate("fuse(direct)")
        segs = candidate_segments(w, topo, fused)
        end = max(s.end for s in segs)
        assert fused.seconds - FUSED_SETUP_S - 50e-6 <= end <= fused.seconds, (kind, end, fused.seconds)
        gemm = sum(s.end - s.start for s in segs if s.lane == COMPUTE)
        assert gemm > 0.5 * end  # the whole GEMM is drawn, not one piece of it
