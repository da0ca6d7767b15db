#!/usr/bin/env bash
# One device session: the GPU tests, the benchmark suite and (with 2+ GPUs) the sharding
# check, from a source checkout with jax[cuda] installed. Logs and results go to $OUT.
#
#   OUT=/tmp/h200 bash benchmarks/h200_run.sh
#   PARTS="bwd fwd sparse" XDIST=4 COMMIT=$(git rev-parse --short HEAD) bash benchmarks/h200_run.sh
#
# PARTS picks what runs, in this order on one GPU (default: "bwd bench sweep fwd
# sparse"; "variants", "train", "fp8", "qblock" and "suite" on request): the backward test file,
# `attn bench`, the backward knob sweep, the sparse-MLA kernel variants, the sparse-MLA
# training-step benchmark (benchmarks/sparse_mla_train.py; TRAIN_ARGS: its options), the forward and the
# sparse-MLA test files. PARTS=fp8 runs the FP8-cache sparse-MLA GPU tests (FP8_TEST_LIMIT,
# default 240 s; log h200_sparse_mla_fp8_tests.log), then benchmarks/sparse_mla_fp8.py
# (bf16 and FP8 caches in the same run, FP8_LIMIT default 300 s; sparse_mla_fp8.{json,md,svg}
# and sparse_mla_fp8.log in $OUT). PARTS=qblock runs benchmarks/sparse_mla_qblock_gpu.py (the
# query-blocked sparse-MLA kernel against the per-query one; QBLOCK_ARGS: its options, e.g.
# --cases; QBLOCK_LIMIT default 300 s; sparse_mla_qblock_gpu.{json,md,svg} and .log in
# $OUT). PARTS=suite runs the whole GPU test suite instead, in one pytest call sized for
# one 600 s device call on one H200 (16 cores): every packages/attn-mosaic-gpu/tests/
# *_gpu.py file and the conformance, isolation and bad-input tests of tests/, with
# -n ${XDIST:-14} workers (worksteal: an idle worker takes queued tests from a busy one),
# -v (a killed run still shows which tests passed), --durations=25
# and SUITE_LIMIT (default 560 s) on the whole call; log h200_gpu_suite.log. The whole
# suite takes longer than one 600 s call: SUITE_HALF=a (the gradients: the ranker backward
# file, the sparse-MLA gradient files and the isolation file) and SUITE_HALF=b (every
# other *_gpu.py file, the ranker and sparse-MLA conformance and the bad-input files) run
# it in two calls, logs h200_gpu_suite_a.log and _b.log. A test still running after
# TEST_TIMEOUT - 60 s has every thread's stack written to the log (faulthandler), before
# pytest-timeout ends its worker (which loses the test's own output).
# On one H200 the test files take about 8 minutes in one pytest process each, so split
# them over calls where a call is time-limited, or set XDIST=N to run each file in N
# pytest-xdist processes (GPU memory is then allocated on demand; -n 4 ran the backward
# file in ~5 minutes and -n 5 the forward one in ~3.5 on 2026-12-01). COMMIT names the commit measured, for a checkout whose git
# metadata is absent or stale: it becomes the reports' commit (ATTN_PROVENANCE_COMMIT)
# and the first line of every log. With two GPUs the test files (GPU 0) and the bench
# and sweep (GPU 1) run side by side, then the 2-GPU sharding check. RUN_FWD=0 skips the
# forward tests; FWD_SELECT=<pytest -k expression> narrows them, for a quick look only:
# after a kernel change commit the log of the whole suite. TEST_TIMEOUT (default 240 s)
# fails a single test that runs longer, so a kernel that hangs costs one test's time,
# not the file's whole limit (a hung sparse-MLA test did on 2026-12-02). OUT defaults
# to a new folder attn-results/h200-<timestamp>, never a committed path; copy what you
# commit. The device machine hands back only a few files per call: pack $OUT into one
# tarball when calling through it.
set -u
OUT=${OUT:-attn-results/h200-$(date +%Y%m%d-%H%M%S)}
PARTS=${PARTS:-bwd bench sweep fwd sparse}
mkdir -p "$OUT"
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$root/common/src:$root/packages/attn-reference/src:$root/packages/attn-mosaic-gpu/src
export PYTHONUNBUFFERED=1
commit=${COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
[ -n "${COMMIT:-}" ] && export ATTN_PROVENANCE_COMMIT=$COMMIT
tests=$root/packages/attn-mosaic-gpu/tests
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi -L | tee "$OUT/devices.txt"
xdist=()
if [ -n "${XDIST:-}" ]; then xdist=(-n "$XDIST"); export XLA_PYTHON_CLIENT_PREALLOCATE=false; fi

want() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
header() { echo "commit $commit ($(nvidia-smi -L | head -n 1))" >"$1"; }
pytest_log() {  # pytest_log LOG LIMIT FILE [pytest args]
  local log=$1 limit=$2; shift 2; header "$log"
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider --timeout "${TEST_TIMEOUT:-240}" \
    ${xdist[@]+"${xdist[@]}"} "$@" >>"$log" 2>&1
  local rc=$?; echo "rc=$rc" >>"$log"; echo "$(basename "$log" .log) rc=$rc"
}
bwd_tests() { want bwd && pytest_log "$OUT/h200_ranker_bwd_tests.log" "${BWD_LIMIT:-330}" \
  "$tests/test_ranker_bwd_gpu.py"; }
fwd_tests() { want fwd && [ "${RUN_FWD:-1}" = 1 ] && pytest_log "$OUT/h200_ranker_fwd_tests.log" \
  "${FWD_LIMIT:-600}" "$tests/test_ranker_fwd_gpu.py" ${FWD_SELECT:+-k "$FWD_SELECT"}; }
sparse_tests() { want sparse && pytest_log "$OUT/h200_sparse_mla_tests.log" "${SPARSE_LIMIT:-200}" \
  "$tests/test_sparse_mla_gpu.py" "$tests/test_sparse_mla_kernel_gpu.py" "$tests/test_row_sort_gpu.py"; }
suite_files() {  # suite_files [a|b]: the GPU suite, whole or one of its two halves
  local a=("$tests/test_ranker_bwd_gpu.py" "$tests"/*sparse_mla_grad*_gpu.py
    "$root/tests/test_conformance_sparse_mla_grad.py" "$root/tests/test_ranker_isolation.py")
  local b=() f  # every other *_gpu.py file, then the rest of tests/
  for f in "$tests"/*_gpu.py; do case " ${a[*]} " in *" $f "*) ;; *) b+=("$f") ;; esac; done
  b+=("$root/tests/test_conformance_ranker.py" "$root/tests/test_conformance_sparse_mla.py"
    "$root/tests/test_bad_inputs.py")
  case ${1:-} in a) echo "${a[@]}" ;; b) echo "${b[@]}" ;; *) echo "${a[@]}" "${b[@]}" ;; esac
}
suite_tests() {  # the GPU suite (SUITE_HALF a or b: half of it), one pytest call, XDIST workers
  want suite || return 0
  local log=$OUT/h200_gpu_suite${SUITE_HALF:+_$SUITE_HALF}.log; header "$log"
  # shellcheck disable=SC2046  # the file list is split on purpose (paths have no spaces)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${SUITE_LIMIT:-560}" python3 -m pytest -v \
    -p no:cacheprovider --timeout "${TEST_TIMEOUT:-240}" -n "${XDIST:-14}" --dist worksteal \
    -o faulthandler_timeout=$((${TEST_TIMEOUT:-240} - 60)) \
    --durations=25 $(suite_files "${SUITE_HALF:-}") >>"$log" 2>&1
  local rc=$?; echo "rc=$rc" >>"$log"; echo "$(basename "$log" .log) rc=$rc"
}
bench() { want bench || return 0; header "$OUT/bench.log"; timeout "${BENCH_LIMIT:-330}" \
  python3 -m attn_common.cli bench --out "$OUT" --iterations "${ITERATIONS:-10}" --overwrite \
  >>"$OUT/bench.log" 2>&1; echo "bench rc=$?"; }
sweep() { want sweep || return 0; header "$OUT/sweep.log"; timeout "${SWEEP_LIMIT:-200}" \
  python3 "$root/benchmarks/ranker_bwd_sweep.py" --out "$OUT" >>"$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"; }
train() { want train || return 0; header "$OUT/sparse_mla_train.log"; timeout "${TRAIN_LIMIT:-300}" \
  python3 "$root/benchmarks/sparse_mla_train.py" --out "$OUT" ${TRAIN_ARGS:-} \
  >>"$OUT/sparse_mla_train.log" 2>&1
  echo "train rc=$?"; }
fp8() {  # the FP8-cache tests first, then the bf16-vs-FP8 benchmark
  want fp8 || return 0
  pytest_log "$OUT/h200_sparse_mla_fp8_tests.log" "${FP8_TEST_LIMIT:-240}" \
    "$tests/test_sparse_mla_fp8_gpu.py"
  header "$OUT/sparse_mla_fp8.log"; timeout "${FP8_LIMIT:-300}" \
    python3 "$root/benchmarks/sparse_mla_fp8.py" --out "$OUT" --iterations "${ITERATIONS:-10}" \
    >>"$OUT/sparse_mla_fp8.log" 2>&1; echo "sparse_mla_fp8 rc=$?"; }
qblock() { want qblock || return 0; header "$OUT/sparse_mla_qblock_gpu.log"
  timeout "${QBLOCK_LIMIT:-300}" python3 "$root/benchmarks/sparse_mla_qblock_gpu.py" --out "$OUT" \
    --iterations "${ITERATIONS:-10}" ${QBLOCK_ARGS:-} >>"$OUT/sparse_mla_qblock_gpu.log" 2>&1
  echo "sparse_mla_qblock_gpu rc=$?"; }
variants() { want variants || return 0; header "$OUT/variants.log"; timeout "${VARIANTS_LIMIT:-200}" \
  python3 "$root/benchmarks/sparse_mla_variants.py" --out "$OUT" >>"$OUT/variants.log" 2>&1
  echo "variants rc=$?"; }

if [ "$gpus" -ge 2 ]; then
  (export CUDA_VISIBLE_DEVICES=0; suite_tests; bwd_tests; fwd_tests; sparse_tests; fp8) &
  (export CUDA_VISIBLE_DEVICES=1; bench; sweep; variants; train; qblock) &
  wait
  if want sharding || [ "$PARTS" = "bwd bench sweep fwd sparse" ]; then
    timeout "${SHARD_LIMIT:-150}" python3 "$root/tests/sharding_gpu_check.py" --out "$OUT" \
      >"$OUT/sharding_gpu.log" 2>&1; echo "sharding rc=$?"
  fi
else
  suite_tests; qblock; bwd_tests; bench; sweep; variants; train; fwd_tests; sparse_tests; fp8
fi
for f in "$OUT"/*.log; do echo "== $f"; tail -n 3 "$f"; done
