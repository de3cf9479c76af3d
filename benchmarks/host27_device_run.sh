#!/bin/bash
# Issue 27's device run (one H200): main's code (the repository root) against this tree (.carry27),
# in one run so that the ratios compare on one host.  Results under $OUT/r, packed into $OUT/r.tgz.
# Usage, from the root of main's tree:  bash .carry27/benchmarks/host27_device_run.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD NEW=$PWD/.carry27 R=$OUT/r
mkdir -p $R
pack() { tar czf $OUT/r.tgz -C $R . ; }
trap pack EXIT
step() { local t=$1; shift; echo "=== $* ($(date +%T))"; timeout $t "$@" 2>&1 | tail -${TAIL:-25}; }
cd $NEW
PYTHONPATH=$NEW step 60 python3 benchmarks/graph_node_probe.py --sections copy --out $R/graph_node_probe-copy.json
PYTHONPATH=$NEW step 150 python3 benchmarks/fused_host_time.py --worlds 2,4,8 --tag h200-kernel-nodes --out-dir $R
cd $ROOT
PYTHONPATH=$ROOT step 150 python3 benchmarks/fused_host_time.py --worlds 2,4,8 --tag h200-main-baseline --out-dir $R
cd $NEW
PYTHONPATH=$NEW TAIL=8 step 120 python3 benchmarks/fused_host_stress.py --worlds 2,4,8 --calls 60 --mix --tag h200-kernel-nodes-recheck --out-dir $R
COMPASS_REPLAY_WAITS=kernel PYTHONPATH=$NEW TAIL=14 step 60 python3 benchmarks/fused_host_time.py --worlds 2 --profile --tag h200-kernel-waits --out-dir $R
echo done
