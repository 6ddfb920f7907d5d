#!/bin/sh
# The fast decode's AVX2 loops (kvmix.h, KVMIX__AVX2): fuzz_view (10,000 inputs) and unit_tests
# built for x86-64-v3, run where the CPU has AVX2, FMA and F16C; elsewhere it says so and counts
# nothing.
bin=$(dirname "$0")/unit_tests_avx2
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
for f in avx2 fma f16c; do
    case " $flags " in
    *" $f "*) ;;
    *)
        echo "unit_tests_avx2: this CPU lacks $f: the AVX2 decode loops are not run here"
        echo "0 passed, 0 failed"
        exit 0
        ;;
    esac
done
if ! "$(dirname "$0")/fuzz_view_avx2" 10000; then
    echo "fuzz_view_avx2: an input broke an invariant (above)"
    echo "0 passed, 1 failed"
    exit 1
fi
exec "$bin" unit_fast_decode unit_view unit_cache
