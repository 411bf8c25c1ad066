#!/usr/bin/env bash
# Run the GPU checklist (../shared/gpu/CHECKLIST.md) on a lent GPU machine and
# keep every result under $OUT (default /tmp/nccl_pg_gpu_check).
#
#   tools/gpu_check.sh [STAGE ...]      STAGE: env doctor tests bench multi blocking nan compare (default: all, in
#                                       that order)
#
# From the project root, as the device tool runs commands (the wheels carried in
# .whl, see ../shared/gpu/README.md):
#   run(command="tools/gpu_check.sh doctor tests", carry=[".whl"])
# One device command may run 10 minutes: split the stages over several calls
# (e.g. "env doctor tests", then "bench multi blocking", then "nan compare").
# Record the results in docs/GPU_VALIDATION.md (the checklist table) and docs/BENCHMARKS.md.
#
# Environment: OUT (results folder), WHEELS (default .whl), QUICK=1 (shorter
# benchmarks), STAGE_TIMEOUT (seconds per stage, default 540).
#
# Every stage is bounded by `timeout`; a failing stage is recorded and the
# next one still runs. Exit status: 0 when every stage passed, 1 otherwise
# (3 when the wheels cannot be installed).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nccl_pg_gpu_check}
WHEELS=${WHEELS:-.whl}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-540}
QUICK=${QUICK:-0}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl \
        || { echo "gpu_check: cannot install the wheels in $WHEELS" | tee -a "$SUMMARY"; exit 3; }
    export PYTHONPATH=/tmp/site:$PWD
else
    echo "gpu_check: no wheels in $WHEELS (nccl4py is not on the GPU machines: carry it)" | tee -a "$SUMMARY"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

failed=0
stage() {  # stage NAME COMMAND...: run bounded, log to $OUT/NAME.txt, record the status
    local name=$1; shift
    local t0=$SECONDS
    echo "=== $name: $*" | tee -a "$SUMMARY"
    timeout --kill-after=10 "$STAGE_TIMEOUT" bash -c '"$@"' stage "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.txt"
    [ $rc -eq 124 ] && echo "gpu_check: $name timed out after $STAGE_TIMEOUT s" | tee -a "$SUMMARY"
    echo "=== $name: exit $rc ($((SECONDS - t0)) s)" | tee -a "$SUMMARY"
    [ $rc -eq 0 ] || failed=1
}

if [ "$QUICK" = 1 ]; then E=16M; N=20; OH=2000; CMP=--quick; NAN="--gib 0.25 --mb 64"
else E=256M; N=50; OH=10000; CMP=; NAN=; fi
SINGLE_OPS="all_reduce all_gather reduce_scatter broadcast reduce all_to_all"

run_env() {
    { date -u; hostname; nvidia-smi; nvidia-smi topo -m; python3 -VV; env | grep -E '^(NCCL|CUDA|PYTHONPATH)' ;
      python3 -m pip list 2>/dev/null | grep -iE 'nccl|cuda|cupy|torch|numpy'; } 2>&1
}
run_bench() {  # checklist 2 (bench side): every op at world size 1, checked; overhead of a 1 KB all_reduce
    local rc=0
    for op in $SINGLE_OPS; do
        python3 -m nccl_pg.cli.main bench --backend nccl --op "$op" -b 8 -e "$E" -f 4 -n "$N" --check \
            --json "$OUT/bench_1rank_$op.json" || rc=1
    done
    python3 -m nccl_pg.cli.main bench --backend nccl --op all_reduce -b 1K -e 1K -w 200 -n "$OH" --overhead --check \
        --json "$OUT/bench_overhead_1rank.json" || rc=1
    # checklist 8: the same ops captured into a CUDA graph and replayed
    python3 -m nccl_pg.cli.main bench --backend nccl --op all_reduce -b 1K -e 64M -f 8 -n 20 --graph --check \
        --json "$OUT/bench_graph_1rank.json" || rc=1
    return $rc
}
run_multi() {  # checklist 3 (bench side): 2 ranks on the one GPU (NCCL_HOSTID + socket, set by bench itself)
    local rc=0
    for op in all_reduce all_gather reduce_scatter broadcast reduce all_to_all send_recv; do
        python3 -m nccl_pg.cli.main bench --backend nccl --nproc 2 --op "$op" -b 8 -e 1M -f 16 -w 2 -n 5 --check \
            --timeout 120 --json "$OUT/bench_2ranks_$op.json" || rc=1
    done
    return $rc
}

export OUT E N OH SINGLE_OPS
export -f run_env run_bench run_multi  # stages run in a child bash, under timeout

stages=${*:-env doctor tests bench multi blocking nan compare}
for s in $stages; do
    case $s in
        env) stage env run_env ;;
        doctor) stage doctor python3 -m nccl_pg.cli.main doctor --json "$OUT/doctor.json" ;;
        tests) stage tests python3 -m pytest -m gpu -q -rA -p no:cacheprovider --junitxml "$OUT/pytest_gpu.xml" ;;
        bench) stage bench run_bench ;;
        multi) stage multi run_multi ;;
        blocking) stage blocking python3 tools/bench_nccl_blocking.py --real --json "$OUT/blocking.json" ;;  # checklist 6
        nan) stage nan python3 tools/bench_nan_check.py $NAN --json "$OUT/nan_check.json" ;;  # checklist 5
        compare) stage compare python3 tools/bench_nccl_compare.py $CMP --json "$OUT/compare.json" \
                     --markdown "$OUT/compare.md" ;;
        *) echo "gpu_check: unknown stage $s (env doctor tests bench multi blocking nan compare)" | tee -a "$SUMMARY"
           failed=1 ;;
    esac
done
echo "gpu_check: $([ $failed = 0 ] && echo all stages passed || echo 'some stage FAILED') (results in $OUT)" \
    | tee -a "$SUMMARY"
exit $failed
