#!/usr/bin/env bash
# One TPU machine session: the TPU backend's conformance and isolation tests natively on
# the chip, then the sparse-MLA benchmark suite, `attn bench sparse-mla` (the TPU
# backend's: attn_pallas_tpu.bench_sparse_mla; run as `python3 -m attn_common.cli`, the
# `attn` command, which is not installed here) with this script's arguments (the suite's
# flags: `attn bench sparse-mla --help`). Logs and results go to
# $OUT (tpu_env.log, tpu_tests.log, tpu_sparse_mla.{json,md,svg} and tpu_bench.log).
# SUITES (default "sparse-mla") names the benchmark suites to run, in order, after the
# tests ("none": the tests alone): "sparse-mla" and/or "ranker" (`attn bench ranker`:
# attn_pallas_tpu.bench_ranker, the ranker suite at full batch, writing
# tpu_ranker.{json,md} and tpu_bench_ranker.log; the .svg where matplotlib is installed).
# Each suite gets this script's arguments and its own BENCH_LIMIT; with both, pass only
# flags both take (--sweep, --iterations, --smoke; --cases names differ per suite); the
# tests and both suites at their default limits
# exceed one 10-minute device call, so the ranker suite alone is the second line below.
# benchmarks/tpu_check.py's ranker rows (reduced batch, wall clock only) are superseded
# by the ranker suite.
#
#   OUT=/tmp/tpu bash benchmarks/tpu_run.sh [--sweep] [--cases NAME ...]
#   SUITES=ranker TEST_FILES=none OUT=/tmp/tpu bash benchmarks/tpu_run.sh [--modes fwd]
#
# TEST_FILES (default: the four conformance/isolation files) and TEST_K (pytest -k,
# default "tpu") select the tests; TEST_FILES=none skips them. TEST_LIMIT and
# BENCH_LIMIT (seconds, default 230 and 330; BENCH_LIMIT bounds each suite) bound the
# steps. Set
# ATTN_PROVENANCE_COMMIT to the commit under test: the device copy's git metadata may be
# the session's starting commit, not the tree's.
# The device image's TPU machine has Python 3.11 and jax 0.10.2 (the packages ask for
# >= 3.12 and 0.11.2, which it cannot install), so the sources run from the checkout
# through PYTHONPATH, and absl-py and pytest-timeout come from the image's own package
# index; results from it are on that jax, not the pinned one. One process holds the
# chip at a time: the tests and the benchmark run one after the other.
set -u
OUT=${OUT:-attn-results/tpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -d /opt/pypi/simple ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --isolated --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site absl-py pytest-timeout 2>&1 | tail -n 2
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$root/common/src:$root/packages/attn-reference/src:$root/packages/attn-pallas-tpu/src:/tmp/site
export PYTHONUNBUFFERED=1
cd "$root" || exit 1
python3 -c "import sys, jax; print(sys.version.split()[0], jax.__version__, jax.devices())" 2>&1 | tee "$OUT/tpu_env.log"
files=${TEST_FILES:-tests/test_conformance_ranker.py tests/test_conformance_sparse_mla.py tests/test_conformance_sparse_mla_grad.py tests/test_ranker_isolation.py}
if [ "$files" != none ]; then
  # shellcheck disable=SC2086
  timeout "${TEST_LIMIT:-230}" python3 -m pytest -v -p no:cacheprovider -m "not slow or fp8" \
    --durations=15 $files -k "${TEST_K:-tpu}" >"$OUT/tpu_tests.log" 2>&1
  echo "tests rc=$?" | tee -a "$OUT/tpu_tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tpu_tests.log" | tail -n 40
fi
for suite in ${SUITES:-sparse-mla}; do
  case $suite in
    sparse-mla) log=$OUT/tpu_bench.log ;;
    ranker) log=$OUT/tpu_bench_ranker.log ;;
    none) continue ;;
    *) echo "SUITES: unknown suite '$suite' (sparse-mla, ranker)"; continue ;;
  esac
  timeout "${BENCH_LIMIT:-330}" python3 -m attn_common.cli bench "$suite" --out "$OUT" "$@" \
    >"$log" 2>&1
  echo "bench $suite rc=$?" | tee -a "$log"
  grep -v '"sweep": true' "$log" | tail -n 25
done
