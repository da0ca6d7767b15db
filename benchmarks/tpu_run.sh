#!/usr/bin/env bash
# One TPU machine session: the TPU backend's conformance and isolation tests natively on
# the chip (pytest -k tpu, "not slow", plus the FP8-cache conformance test), then
# benchmarks/tpu_check.py with this script's arguments. Logs and results go to $OUT
# (tpu_env.log, tpu_tests.log, tpu_check.json and its log).
#
#   OUT=/tmp/tpu bash benchmarks/tpu_run.sh [--no-ranker]
#
# The device image's TPU machine has Python 3.11 and jax 0.10.2 (the packages ask for
# >= 3.12 and 0.11.2, which it cannot install), so the sources run from the checkout
# through PYTHONPATH, and absl-py and pytest-timeout come from the image's own package
# index; results from it are on that jax, not the pinned one. One process holds the
# chip at a time: the tests and the check run one after the other. TEST_LIMIT and
# CHECK_LIMIT (seconds, default 230 each) bound the two steps.
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
timeout "${TEST_LIMIT:-230}" python3 -m pytest -v -p no:cacheprovider -m "not slow or fp8" \
  --durations=15 tests/test_conformance_ranker.py tests/test_conformance_sparse_mla.py \
  tests/test_conformance_sparse_mla_grad.py tests/test_ranker_isolation.py -k tpu \
  >"$OUT/tpu_tests.log" 2>&1
echo "tests rc=$?" | tee -a "$OUT/tpu_tests.log"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tpu_tests.log" | tail -n 40
timeout "${CHECK_LIMIT:-230}" python3 benchmarks/tpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/tpu_check.log" | tail -n 30
