#!/bin/sh
# The fast decode's vector loops (kvmix.h): fuzz_view (10,000 inputs) and unit_tests built for
# x86-64-v3 (KVMIX__AVX2) or x86-64-v4 (KVMIX__AVX512, also the AVX2 loops), or with
# KVMIX_NO_CPU_DISPATCH (the portable loops, which a plain build on an AVX2 CPU no longer takes),
# as this script is installed: unit_avx2_run, unit_avx512_run or unit_portable_run beside the
# binaries. The vector ones run where the CPU has the instructions; elsewhere it says so and
# counts nothing.
dir=$(dirname "$0")
case $(basename "$0") in
*avx512*) level=avx512 needs="avx2 fma f16c avx512f avx512bw avx512cd avx512dq avx512vl" ;;
*portable*) level=portable needs="" ;;
*) level=avx2 needs="avx2 fma f16c" ;;
esac
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
for f in $needs; do
    case " $flags " in
    *" $f "*) ;;
    *)
        echo "unit_tests_$level: this CPU lacks $f: the $level decode loops are not run here"
        echo "0 passed, 0 failed"
        exit 0
        ;;
    esac
done
if ! "$dir/fuzz_view_$level" 10000; then
    echo "fuzz_view_$level: an input broke an invariant (above)"
    echo "0 passed, 1 failed"
    exit 1
fi
exec "$dir/unit_tests_$level" unit_fast_decode unit_view unit_cache
