#!/bin/bash
# Issue 27's second device run: the flag-write kernels' device cost beside a GEMM, and world 2's host
# time with the defaults (host copies on the copy engines) with flag writes as kernels and as stream writes.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NEW=$PWD/.carry27 R=$OUT/r
mkdir -p $R
pack() { tar czf $OUT/r2.tgz -C $R . ; }
trap pack EXIT
step() { local t=$1; shift; echo "=== $* ($(date +%T))"; timeout $t "$@" 2>&1 | tail -${TAIL:-14}; }
cd $NEW
PYTHONPATH=$NEW TAIL=4 step 40 python3 benchmarks/graph_node_probe.py --sections copy --out $R/graph_node_probe-copy2.json
PYTHONPATH=$NEW step 50 python3 benchmarks/fused_host_time.py --worlds 2 --tag h200-engine-copies --out-dir $R
COMPASS_REPLAY_FLAG_WRITES=stream PYTHONPATH=$NEW step 50 python3 benchmarks/fused_host_time.py --worlds 2 --tag h200-engine-copies-stream-flags --out-dir $R
echo done
