#!/usr/bin/env bash
# device driver (untracked)
set -u
export PYTHONPATH=$PWD/common/src:$PWD/packages/attn-reference/src:$PWD/packages/attn-mosaic-gpu/src
export PYTHONUNBUFFERED=1
C=${COMMIT:?}
export ATTN_PROVENANCE_COMMIT=$C
W=$OUT
hdr() { echo "commit $C ($(nvidia-smi -L | head -n 1))" > "$1"; }
for step in ${STEPS:?}; do
  case $step in
    ab) hdr $W/ab.log; timeout ${AB_LIMIT:-300} python3 benchmarks/ranker_reciprocal.py ${AB_CASES:-phoenix ragged} --variants ${AB_VARIANTS:-paired-rcp single-rsqrt paired-rsqrt paired-rcp} --iterations 20 >> $W/ab.log 2>&1; echo "ab rc=$?" | tee -a $W/ab.log ;;
    rescale) hdr $W/rescale.log; timeout ${RESCALE_LIMIT:-200} python3 benchmarks/ranker_fwd_rescale.py ${RESCALE_ARGS:-} >> $W/rescale.log 2>&1; echo "rescale rc=$?" | tee -a $W/rescale.log ;;
    fwdtests) hdr $W/fwdtests.log; XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${FT_LIMIT:-300} python3 -m pytest -v -p no:cacheprovider -n 6 --timeout 240 packages/attn-mosaic-gpu/tests/test_ranker_fwd_gpu.py >> $W/fwdtests.log 2>&1; echo "fwdtests rc=$?" | tee -a $W/fwdtests.log ;;
    dump) timeout 120 python3 benchmarks/kernel_dump.py --out $W/dump ranker-fwd > $W/dump.log 2>&1; echo "dump rc=$?" ;;
    knob) hdr $W/knob.log; timeout ${KNOB_LIMIT:-150} python3 benchmarks/ranker_fwd_knob.py ${KNOB_ARGS:?} >> $W/knob.log 2>&1; echo "knob rc=$?" | tee -a $W/knob.log ;;
    tsub) hdr $W/tsub.log; XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TSUB_LIMIT:-200} python3 -m pytest -v -p no:cacheprovider -n 6 --timeout 200 packages/attn-mosaic-gpu/tests/test_ranker_fwd_gpu.py packages/attn-mosaic-gpu/tests/test_ranker_bwd_gpu.py -k "${TSUB_K:?}" >> $W/tsub.log 2>&1; echo "tsub rc=$?" | tee -a $W/tsub.log ;;
    suite) mkdir -p $W/suite; COMMIT=$C OUT=$W/suite PARTS="bwd fwd" XDIST=6 bash benchmarks/h200_run.sh > $W/suite_driver.log 2>&1; echo "suite done" ;;
    bench) mkdir -p $W/bench; hdr $W/bench.log; timeout ${BENCH_LIMIT:-400} python3 -m attn_common.cli bench --out $W/bench --iterations 10 --overwrite ${BENCH_ARGS:-} >> $W/bench.log 2>&1; echo "bench rc=$?" | tee -a $W/bench.log ;;
  esac
done
tail -n 40 $W/*.log
