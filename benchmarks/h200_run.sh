#!/usr/bin/env bash
# One device session: the GPU tests, the benchmark suite and (with 2+ GPUs) the sharding
# check, from a source checkout with jax[cuda] installed. Logs and results go to $OUT.
#
#   OUT=/tmp/h200 bash benchmarks/h200_run.sh
#
# With two GPUs the backward then forward tests (GPU 0) and the benchmark then the backward
# knob sweep (GPU 1) run side by side, then the 2-GPU sharding check; with one GPU
# everything runs in turn. RUN_FWD=0 skips the forward tests. The forward tests run the
# whole GPU conformance file (FWD_SELECT=<pytest -k expression> narrows it, for a quick
# look only: after a kernel change commit the log of the whole suite). OUT defaults to a
# new folder attn-results/h200-<timestamp>, never a committed path; copy what you commit.
set -u
OUT=${OUT:-attn-results/h200-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$root/common/src:$root/packages/attn-reference/src:$root/packages/attn-mosaic-gpu/src
export PYTHONUNBUFFERED=1
tests=$root/packages/attn-mosaic-gpu/tests
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi -L | tee "$OUT/devices.txt"

bwd_tests() { timeout "${BWD_LIMIT:-330}" python3 -m pytest -v -p no:cacheprovider \
  "$tests/test_ranker_bwd_gpu.py" >"$OUT/h200_ranker_bwd_tests.log" 2>&1; echo "bwd tests rc=$?"; }
bench() { timeout "${BENCH_LIMIT:-330}" python3 -m attn_common.cli bench --out "$OUT" \
  --iterations "${ITERATIONS:-10}" --overwrite >"$OUT/bench.log" 2>&1; echo "bench rc=$?"; }
sweep() { timeout "${SWEEP_LIMIT:-200}" python3 "$root/benchmarks/ranker_bwd_sweep.py" \
  --out "$OUT" >"$OUT/sweep.log" 2>&1; echo "sweep rc=$?"; }
fwd_tests() { [ "${RUN_FWD:-1}" = 1 ] || return 0; timeout "${FWD_LIMIT:-600}" python3 -m pytest -v -p no:cacheprovider \
  "$tests/test_ranker_fwd_gpu.py" ${FWD_SELECT:+-k "$FWD_SELECT"} \
  >"$OUT/h200_ranker_fwd_tests.log" 2>&1; echo "fwd tests rc=$?"; }

if [ "$gpus" -ge 2 ]; then
  (CUDA_VISIBLE_DEVICES=0 bwd_tests; CUDA_VISIBLE_DEVICES=0 fwd_tests) &
  (CUDA_VISIBLE_DEVICES=1 bench; CUDA_VISIBLE_DEVICES=1 sweep) &
  wait
  timeout "${SHARD_LIMIT:-150}" python3 "$root/tests/sharding_gpu_check.py" --out "$OUT" \
    >"$OUT/sharding_gpu.log" 2>&1; echo "sharding rc=$?"
else
  bwd_tests; bench; sweep; fwd_tests
fi
for f in "$OUT"/*.log; do echo "== $f"; tail -n 3 "$f"; done
