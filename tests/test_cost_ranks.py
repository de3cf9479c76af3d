"""Every rank of a group must reach the same decision, or the ranks deadlock: checked on real gloo
ranks.  Detection's agreement (rank 0's answer wins) is exercised with deliberately different
local readings."""


def _decisions(rank):
    from compass_fx.cost import Topology, Workload, plan, select

    topo = Topology.preset("a6000-nvlink-pairs-pcie-8")
    out = []
    for kind in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        for m in (2048, 16384):
            w = Workload(kind, m=m, n=3584, k=8192, group_size=8)
            out.append(repr(select(w, topo)))
            out.append(repr(plan(w, topo)))
    import torch
    default = None if not torch.cuda.is_available() else Topology.preset("h200-nvswitch-8")
    out.append(repr(select(Workload("all_gather_matmul", m=4096, n=4096, k=4096, group_size=2), default)))
    return out


def _agree(rank, key):
    from compass_fx.cost import Topology
    from compass_fx.machine.detect import agree_across_ranks

    # Pretend each rank read a different machine (a flaky driver, a late NVLink).
    local = Topology.preset(["h100-nvswitch-8", "a100-pcie-8"][rank]).to_dict()
    agreed = Topology.from_dict(agree_across_ranks(local, key))
    return agreed.name, agreed.fingerprint()


def _agree_late(rank, key):
    """Rank 0 publishes and returns without waiting; rank 1 asks only afterwards."""
    import time

    import torch.distributed as dist
    from compass_fx.cost import Topology
    from compass_fx.machine.detect import agree_across_ranks

    local = Topology.preset(["l40s-pcie-8", "h200-nvswitch-8"][rank]).to_dict()
    if rank == 0:
        name = agree_across_ranks(local, key)["name"]
        dist.barrier()
        return name
    dist.barrier()
    time.sleep(0.2)
    return agree_across_ranks(local, key)["name"]


def test_decisions_identical_across_ranks(ranks):
    results = ranks(2).run(_decisions)
    assert results[0] == results[1]
    assert len(results[0]) == 13


def test_detection_uses_rank_zeros_answer(ranks):
    (name0, fp0), (name1, fp1) = ranks(2).run(_agree, "test/agree")
    assert name0 == name1 == "h100-nvswitch-8"
    assert fp0 == fp1


def test_rank_zero_does_not_wait_for_the_others(ranks):
    assert ranks(2).run(_agree_late, "test/late") == ["l40s-pcie-8", "l40s-pcie-8"]


def test_agreement_without_a_process_group_keeps_the_local_answer():
    from compass_fx.machine.detect import agree_across_ranks

    local = {"gpu": "H100", "nodes": [], "links": []}
    assert agree_across_ranks(local) is local
