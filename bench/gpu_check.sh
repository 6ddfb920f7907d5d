#!/bin/bash
# The GPU's check, in one run of under 10 minutes on an H100 or H200: builds the kernel pack and
# the GPU runner, runs test_cuda on both decode paths (Hopper's bulk copies, and the portable
# one through the compute_80 PTX), test_gpu_llama (the GPU runner against the CPU runner, and
# every policy kind at two batch sizes), the quick forms of both under compute-sanitizer's
# memcheck, racecheck and initcheck, and reruns the GPU-produced headline figures of
# bench/QUALITY.md and bench/RESULTS.md beside the figures recorded there
# (bench/gpu_check_figures.py, bench/gpu_check_figures.json). Run it before landing a change to
# kvmix_cuda.cu, examples/gpu_llama.cu, the device arena or a policy the GPU runner uses, and put
# its summary in the change's note.
#
#   bench/gpu_check.sh [SHARED_DIR]      (default ../shared: models/ and data/)
#
# PREBUILT=1 takes the binaries already in build/ (make cuda-build build/kvmix-eval, and
# build/libkvmix_cuda_bench.so). FIGURE_SECONDS bounds the figure reruns (default: what the
# 10 minutes leave); the checks it leaves run in another call with
#   python3 bench/gpu_check_figures.py --build build --shared SHARED_DIR --gpu-name "$(nvidia-smi
#       --query-gpu=name --format=csv,noheader)" --out DIR --rest $OUT/gpu_check_figures.jsonl
# Logs go to $OUT (default build/gpu-check); the summary ends the output.
# Exit status: nonzero when a test, a sanitizer or a quality figure fails.
set -u
cd "$(dirname "$0")/.."
SHARED=${1:-../shared}
OUT=${OUT:-build/gpu-check}
NVCC=${NVCC:-nvcc}
mkdir -p "$OUT"
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

# stage NAME LIMIT_SECONDS COMMAND...: runs it with its log in $OUT/NAME.log, one summary line.
stage() {
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -ne 0 ] && FAILED=1
    printf '%-22s %-9s %4ds  %s\n' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAIL($rc)")" \
        $(($(date +%s) - t0)) "$(summary_of "$name")" | tee -a "$SUMMARY"
}

# The line of a log that says how it went: a test's counts, a sanitizer's error summary.
summary_of() {
    grep -E "passed|ERROR SUMMARY|RACECHECK SUMMARY|verdicts" "$OUT/$1.log" | tail -1 | cut -c1-90
}

sanitize() { # sanitize TOOL NAME LIMIT PROGRAM ARGS...  ($SANITIZER_ARGS: more options)
    local tool=$1 name=$2 limit=$3
    shift 3
    local extra=""
    [ "$tool" = racecheck ] && extra="--racecheck-report all"
    stage "$name" "$limit" compute-sanitizer --tool "$tool" $extra ${SANITIZER_ARGS:-} \
        --error-exitcode 1 "$@"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    $NVCC --version | tail -1
    git rev-parse --short HEAD 2>/dev/null
} | tee "$OUT/machine.txt"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

if [ -z "${PREBUILT:-}" ]; then
    stage build 300 sh -c "make -j\$(nproc) build/kvmix_cuda.o build/test_cuda build/test_gpu_llama \
        build/kvmix-eval build/kvmix-eval-cuda build/bench_serve &&
        $NVCC -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Xcompiler -fPIC -shared \
        kvmix_cuda.cu bench/bench_glue.cu -o build/libkvmix_cuda_bench.so"
fi

stage test_cuda 150 build/test_cuda
stage test_cuda_portable 150 env CUDA_FORCE_PTX_JIT=1 build/test_cuda
stage test_gpu_llama 300 build/test_gpu_llama "$SHARED" # 189 s on an H200
for tool in memcheck racecheck initcheck; do
    sanitize $tool "cuda_$tool" 120 build/test_cuda --quick
    [ $tool = racecheck ] && continue
    sanitize $tool "llama_$tool" 120 build/test_gpu_llama --quick "$SHARED"
done
# racecheck on the runner's own kernel that shares memory: the pack's are test_cuda's above, and
# racecheck over every kernel of the runner's steps (the decode kernel's stages, cuBLAS) takes
# longer than the whole check.
SANITIZER_ARGS="--kernel-name kns=attend_kernel" \
    sanitize racecheck llama_racecheck_attend 120 build/test_gpu_llama --quick "$SHARED"

LEFT=$((570 - ($(date +%s) - START)))
FIGURE_SECONDS=${FIGURE_SECONDS:-$((LEFT > 60 ? LEFT : 60))}
python3 bench/gpu_check_figures.py --build build --shared "$SHARED" --gpu-name "$GPU" \
    --out "$OUT" --budget-seconds "$FIGURE_SECONDS" >"$OUT/figures.log" 2>&1
[ $? -ne 0 ] && FAILED=1
echo "== figures (recorded against measured; $GPU)"
cat "$OUT/figures.log"
echo "== summary ($(($(date +%s) - START)) s, $GPU)"
cat "$SUMMARY"
exit $FAILED
