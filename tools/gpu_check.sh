#!/usr/bin/env bash
# The GPU checklist (../shared/gpu/CHECKLIST.md) on a lent GPU machine, in ONE device call that ends within
# 8 minutes (a lent machine gives 15 minutes in all, its start included), plus an optional second call.
#
#   tools/gpu_check.sh              call 1: the essentials, in order of value (stage budgets sum to <= 480 s)
#   tools/gpu_check.sh --call 2     call 2 (optional): the rest of the checklist
#   tools/gpu_check.sh STAGE ...    only these stages (of either call), in the order given
#   tools/gpu_check.sh --plan       print both calls' stages, budgets and commands (no GPU, nothing installed)
#
# From the project root, the wheels carried in .whl (../shared/gpu/README.md):
#   run(command="tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
# then give the machine back and record the results in docs/GPU_VALIDATION.md and docs/BENCHMARKS.md.
#
# Every stage runs under `timeout` (SIGINT at its budget minus 5 s, so pytest and the tools print what they
# have; SIGKILL at its budget). Its output streams into $OUT/<stage>.log as it comes; when it ends, its last
# lines and its verdict are appended to $OUT/results.txt. No stage starts past the call's limit
# (GPU_CHECK_LIMIT, default 480 s from the start of the script), and one that would run past it gets only what
# is left. OUT: results folder (default /tmp/nccl_pg_gpu_check). Exit status: 0 when every stage run passed.
cd "$(dirname "$0")/.." || exit 1
if [ "${1:-}" != "--plan" ]; then  # the wheel install line of ../shared/gpu/README.md
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1;
fi
set -u

LIMIT=${GPU_CHECK_LIMIT:-480}
WHEELS_ALLOWANCE=10  # seconds of call 1 spent on the wheel install above (counted in the plan's total)

# call|stage|budget (s)|what it proves|command (run by bash -c; $OUT is the results folder). Call 1's budgets and
# the wheel allowance sum to at most 470 s, 10 s under the limit for the script's own work
# (tests/test_gpu_check_plan.py checks the sums and that every command exists).
plan_text() {
    cat <<'PLAN'
1|setup|15|the machine: GPU, driver, NCCL/CUDA/Python package versions (nvidia-smi, pip list)|gpu_env
1|doctor|40|checklist 1: NCCL, driver, GPU, NVRTC; the NaN kernels compiled by the runtime's NVRTC and LOADED (cuModuleLoadData) on this driver, or why not; a one-rank all_reduce|python3 -m nccl_pg.cli.main doctor --sanity-timeout 30 --json $OUT/doctor.json
1|world1|55|checklist 2: every collective and p2p op x every dtype (bf16, fp8 all_gather) at world size 1, checked against numpy; torch tensors and DLPack|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/world1.xml tests/test_nccl_backend.py::test_world_size_one_every_op tests/test_nccl_backend.py::test_torch_and_dlpack_interop
1|same_gpu_multirank|25|checklist 3: two ranks on the one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30; CTAs limited): all_reduce at 3 sizes, checked|NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=8 python3 -m nccl_pg.cli.main bench --backend nccl --nproc 2 --op all_reduce -b 1K -e 64K -f 8 -w 1 -n 3 --check --timeout 20 --json $OUT/same_gpu_multirank.json
1|same_gpu_hostid|25|checklist 3: two ranks on the one GPU with NCCL_HOSTID per process and the socket transport (what nccl-pg run sets): all_reduce at 3 sizes, checked|python3 -m nccl_pg.cli.main bench --backend nccl --nproc 2 --op all_reduce -b 1K -e 64K -f 8 -w 1 -n 3 --check --timeout 20 --json $OUT/same_gpu_hostid.json
1|skip_named|50|checklist 4: a rank skips a collective, the other rank's timeout error names it: the communicator's first collective (2 ranks), and a later one (3 ranks, flight-recorder dump)|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/skip_named.xml tests/test_gpu_faults.py::test_first_collective_skipped_is_named 'tests/test_fault_matrix.py::test_fault_matrix_nccl[skip-all_reduce-mode2-nccl]'
1|abort_stuck|45|checklist 4: abort() from another thread ends a call stuck in NCCL (a first collective still connecting) and a wait on a collective stuck on the GPU|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/abort_stuck.xml tests/test_gpu_faults.py::test_abort_unsticks_a_first_call_stuck_in_nccl tests/test_nccl_backend.py::test_abort_unblocks_stuck_op
1|destroy_graph|50|issue 23 defect 2: destroy without a live CUDA graph completes; with a graph that captured a collective alive it returns or refuses, never hangs, and completes once the graph is gone|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/destroy_graph.xml tests/test_gpu_faults.py::test_destroy_without_a_live_graph_completes tests/test_gpu_faults.py::test_destroy_with_a_live_graph_never_hangs
1|family|35|issue 23 defect 1: which communicator family variant (NCCL_PG_NCCL_OPS) must be the default: µs per 1 KB all_reduce on nonblocking (the default; NCCL starts a thread per op) vs blocking, and whether NCCL returns cleanly from the overlapping abort the blocking variant needs to stop a stuck call|python3 tools/bench_nccl_blocking.py --real --iters 2000 --json $OUT/family.json ; r=$? ; NCCL_PG_NCCL_OPS=blocking python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/family_abort.xml tests/test_nccl_backend.py::test_abort_unblocks_stuck_op && exit $r
1|nan_gbps|35|checklist 5: the NaN kernel's GB/s on 1 GiB per dtype against the device's read and copy bandwidth (same run); its cost on a 64 MB all_reduce|python3 tools/bench_nan_check.py --gib 1 --mb 64 --reps 5 --json $OUT/nan_check.json
1|overhead|50|checklist 6: host overhead of a 1 KB in-place all_reduce, world size 1, 10k calls x 3 rounds: nccl_pg vs raw nccl4py vs torch.distributed|python3 tools/bench_nccl_compare.py --peers nccl_pg raw torch --iters 10000 --rounds 3 --repeat 1 --bw-min 1M --bw-max 1M --timeout 50 --json $OUT/overhead.json --markdown $OUT/overhead.md
1|bandwidth|35|checklist 7: bandwidth ratio nccl_pg / raw nccl4py (out-of-place all_gather, world size 1) at 1 MB, 16 MB, 256 MB|python3 tools/bench_nccl_compare.py --peers nccl_pg raw --iters 100 --warmup 10 --rounds 3 --repeat 2 --bw-min 1M --bw-max 256M --bw-factor 16 --timeout 30 --json $OUT/bandwidth.json --markdown $OUT/bandwidth.md
2|setup|15|the machine (again: a later call may get another one)|gpu_env
2|seeds_nccl|60|checklist 3: two ranks on one GPU: collectives, new_group and split counts, send/recv, barrier, nonblocking init; events and the priority stream|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/seeds_nccl.xml tests/test_nccl_backend.py::test_two_ranks_one_gpu tests/test_nccl_backend.py::test_two_ranks_nonblocking_init tests/test_nccl_backend.py::test_events_and_priority_stream
2|graph|45|checklist 8: collectives captured into a CUDA graph replay correctly, 1 and 2 ranks, unnumbered and unrecorded|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/graph.xml tests/test_nccl_backend.py::test_graph_capture_replays
2|graph_bench|25|checklist 8: µs per captured all_reduce replayed, 1 KB .. 64 MB, checked|python3 -m nccl_pg.cli.main bench --backend nccl --op all_reduce -b 1K -e 64M -f 8 -n 20 --graph --check --json $OUT/graph_bench.json
2|nan_modes|45|checklist 5: the kernels on every dtype, NaN position, size and offset; > 2^31 lanes; raise/async keep the context usable; trap ends it|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/nan_modes.xml -m gpu tests/test_nan_check.py
2|faults_rest|50|checklist 4: a killed rank, a rank exiting 1, a hung rank (3 ranks on NCCL)|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/faults_rest.xml 'tests/test_fault_matrix.py::test_fault_matrix_nccl[kill-all_reduce-mode2-nccl]' 'tests/test_fault_matrix.py::test_fault_matrix_nccl[exit1-send_recv-mode2-nccl]' 'tests/test_fault_matrix.py::test_fault_matrix_nccl[hang-all_reduce-mode2-nccl]'
2|ops_api|45|checklist 2: every collective through the API, in and out of place, async_op=True, checked (nccl-pg bench --check)|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/ops_api.xml tests/test_bench_cli.py::test_gpu_bench_one_rank
2|bandwidth_full|35|checklist 7: nccl_pg / raw nccl4py, 1 MB .. 1 GB; the cupy.cuda.nccl peer's overhead|python3 tools/bench_nccl_compare.py --peers nccl_pg raw cupy --iters 2000 --rounds 3 --repeat 1 --bw-min 1M --bw-max 1G --bw-factor 4 --timeout 30 --json $OUT/bandwidth_full.json --markdown $OUT/bandwidth_full.md
2|shrink|45|checklist 4: shrink after a peer died, revoke ending a stuck collective (NCCL >= 2.27/2.28.7)|python3 -m pytest -p no:cacheprovider -v -rfE --junitxml $OUT/shrink.xml -m gpu tests/test_shrink.py
2|nccl232|50|issue 36: a replay one rank does not run is named within the timeout + 1 s; launch-completion marks (NCCL >= 2.32.3); a per-call config; suspend/resume and the blocking variant's refusal|python3 -m pytest -p no:cacheprovider -v -rfEP --junitxml $OUT/nccl232.xml -m gpu tests/test_gpu_nccl232.py
2|reconfigure|60|issue 26: reconfigure, two ranks on the one GPU: one leaves and one joins (ncclCommShrink, then ncclCommGrow of a one-rank communicator); one SIGKILLed and replaced (does NCCL shrink a communicator that lost a peer, or does reconfigure start afresh?)|python3 -m pytest -p no:cacheprovider -v -rfEP --junitxml $OUT/reconfigure.xml -m gpu tests/test_gpu_reconfigure.py
PLAN
}

# shellcheck disable=SC2317  # the stage functions run through `bash -c` (export -f), not from here
gpu_env() {  # what the machine is
    date -u; hostname; nvidia-smi; nvidia-smi topo -m; python3 -VV
    env | grep -E '^(NCCL|CUDA|PYTHONPATH)' | sort
    python3 -m pip list 2>/dev/null | grep -iE 'nccl|cuda|cupy|torch|numpy|nvrtc|jax'
    return 0
}

export -f gpu_env

print_plan() {
    local call total what
    echo "tools/gpu_check.sh --plan: each stage runs under timeout (its budget, in seconds) and streams to \$OUT/<stage>.log"
    for call in 1 2; do
        total=0
        [ "$call" = 1 ] && what="tools/gpu_check.sh (one device call; ends within $LIMIT s)" \
                        || what="tools/gpu_check.sh --call 2 (optional; another device call)"
        echo
        echo "call $call: $what"
        if [ "$call" = 1 ]; then
            printf '  %4s s  %-19s %s\n' "$WHEELS_ALLOWANCE" wheels "the wheel install line of ../shared/gpu/README.md (nccl4py, carried in .whl)"
            total=$WHEELS_ALLOWANCE
        fi
        while IFS='|' read -r c name budget proves cmd; do
            [ "$c" = "$call" ] || continue
            printf '  %4s s  %-19s %s\n' "$budget" "$name" "$proves"
            printf '                             $ %s\n' "$cmd"
            total=$((total + budget))
        done < <(plan_text)
        echo "call $call total: $total s (limit $LIMIT s)"
    done
}

if [ "${1:-}" = "--plan" ]; then
    print_plan
    exit 0
fi

OUT=${OUT:-/tmp/nccl_pg_gpu_check}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
RESULTS="$OUT/results.txt"
call=1
if [ "${1:-}" = "--call" ]; then call=${2:?--call needs 1 or 2}; shift 2; fi
declare -A RC=()
failed=0

run_stage() {  # NAME BUDGET COMMAND
    local name=$1 budget=$2 cmd=$3 t0=$SECONDS left verdict rc
    left=$((LIMIT - SECONDS))
    if [ "$left" -lt 15 ]; then
        echo "--- $name: NOT RUN (only $left s of the call's $LIMIT s left)" | tee -a "$RESULTS"
        RC[$name]=notrun; failed=1; return
    fi
    [ "$budget" -gt "$left" ] && budget=$left
    echo "=== $name (budget $budget s, at $SECONDS s): $cmd" | tee -a "$RESULTS"
    timeout -s INT -k 5 $((budget - 5)) bash -c "$cmd" >"$OUT/$name.log" 2>&1 </dev/null
    rc=$?
    case $rc in
        0) verdict=ok ;;
        124|137) verdict="TIMED OUT (budget $budget s): what it measured is above and in $name.log" ;;
        *) verdict="FAILED (exit $rc)" ;;
    esac
    { tail -n 40 "$OUT/$name.log"; echo "--- $name: $verdict after $((SECONDS - t0)) s"; echo; } >>"$RESULTS"
    echo "--- $name: $verdict after $((SECONDS - t0)) s"
    RC[$name]=$rc
    [ "$rc" = 0 ] || failed=1
    if [ "$name" = same_gpu_hostid ]; then same_gpu_method; fi
}

same_gpu_method() {  # which way of sharing the GPU works; later stages use it
    local a=${RC[same_gpu_multirank]:-notrun} b=${RC[same_gpu_hostid]:-notrun}
    echo "same GPU, two ranks: NCCL_MULTI_RANK_GPU_ENABLE=1 $([ "$a" = 0 ] && echo works || echo "fails ($a)");" \
         "NCCL_HOSTID + socket $([ "$b" = 0 ] && echo works || echo "fails ($b)")" | tee -a "$RESULTS"
    if [ "$b" != 0 ] && [ "$a" = 0 ]; then
        export NCCL_MULTI_RANK_GPU_ENABLE=1
        echo "later stages: NCCL_MULTI_RANK_GPU_ENABLE=1 (harness.forked then sets no NCCL_HOSTID)" | tee -a "$RESULTS"
    fi
}

echo "gpu_check: $(date -u) call $call, results in $OUT (limit $LIMIT s)" | tee -a "$RESULTS"
if [ $# -gt 0 ]; then
    for want in "$@"; do
        line=$(plan_text | awk -F'|' -v s="$want" '$2 == s {print; exit}')
        if [ -z "$line" ]; then echo "gpu_check: no stage $want (see --plan)" | tee -a "$RESULTS"; failed=1; continue; fi
        IFS='|' read -r _ name budget _ cmd <<<"$line"
        run_stage "$name" "$budget" "$cmd"
    done
else
    while IFS='|' read -r c name budget _ cmd; do
        [ "$c" = "$call" ] && run_stage "$name" "$budget" "$cmd"
    done < <(plan_text)
fi
echo "gpu_check: $([ $failed = 0 ] && echo 'every stage passed' || echo 'some stage FAILED or was not run')" \
     "after $SECONDS s (results in $RESULTS)" | tee -a "$RESULTS"
exit $failed
