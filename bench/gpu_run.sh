#!/bin/bash
# Builds and runs the GPU test (under compute-sanitizer's memcheck, racecheck and synccheck on a
# reduced size, then in full), the decode benchmark and the payload benchmark on a machine with an
# NVIDIA GPU. Logs go to $OUT (default: build/logs).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-build/logs}
mkdir -p build "$OUT"
NVCC=${NVCC:-nvcc}
FLAGS="-std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 -Xcompiler -Wall,-Wextra,-Werror"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    $NVCC --version | tail -2
    if [ -z "${PREBUILT:-}" ]; then
        echo "== build"
        $NVCC $FLAGS -Xcompiler -fPIC -Xptxas -v -c kvmix_cuda.cu -o build/kvmix_cuda.o 2>&1 | grep -A2 decode_kernel | grep -v "^--"
        $NVCC $FLAGS tests/test_cuda.cu build/kvmix_cuda.o -o build/test_cuda || exit 1
        $NVCC $FLAGS -Xcompiler -fPIC -shared build/kvmix_cuda.o bench/bench_glue.cu -o build/libkvmix_cuda_bench.so || exit 1
    else
        echo "== prebuilt binaries from build/"
    fi
    echo "== resource usage"
    cuobjdump --dump-resource-usage build/kvmix_cuda.o | grep -B1 "REG" | grep -v "^--" | sed 's/_ZN[^ ]*kvmix__/kvmix__/'
} > "$OUT/build.log" 2>&1
tail -5 "$OUT/build.log"
echo "== compute-sanitizer (quick)"
{
    timeout 100 compute-sanitizer --tool memcheck --leak-check full build/test_cuda --quick 2>&1 | tail -8
    timeout 120 compute-sanitizer --tool racecheck --racecheck-report all build/test_cuda --quick 2>&1 | tail -6
    # the tool's automatic barrier count overflows on the decode kernel's mbarriers (8 per block;
    # the tool then faults the kernel): 256 holds the quick suite, the full one needs 4096
    timeout 120 compute-sanitizer --tool synccheck --num-cuda-barriers 4096 build/test_cuda --quick 2>&1 | tail -3
} > "$OUT/sanitizer.log" 2>&1
cat "$OUT/sanitizer.log"
echo "== test (full)"
timeout 150 build/test_cuda > "$OUT/test.log" 2>&1
grep -E "FAIL|passed" "$OUT/test.log" | head -40
if [ -z "${SKIP_DECODE_BENCH:-}" ]; then
    echo "== benchmark"
    PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-280} python3 bench/bench_decode.py --lib build/libkvmix_cuda_bench.so ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
fi
echo "== payload benchmark"
PYTHONUNBUFFERED=1 timeout ${PAYLOAD_TIMEOUT:-90} python3 bench/bench_payload.py --lib build/libkvmix_cuda_bench.so 2>&1 | tee "$OUT/payload.log"
