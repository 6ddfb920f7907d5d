/* What the fuzz targets of packed data share: a small deterministic generator for values a target
   derives from its input bytes, an invariant check that aborts (the fuzzer reports the crash),
   and a test that an output still holds its poison. Define FUZZ_TARGET_NAME (a string) first. */
#ifndef KVMIX_TESTS_FUZZ_INVARIANTS_H
#define KVMIX_TESTS_FUZZ_INVARIANTS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { POISON = 0x5a }; /* byte written over outputs before a call */

/* On a harness function that only makes inputs or checks outputs, element by element: libFuzzer
   leaves it uninstrumented (no coverage, no comparison tracing), so its loops cost what they
   cost in a plain build and the time goes to the library's code, which is what is explored.
   AddressSanitizer and UBSan still check it. */
#if defined(__clang__) && __clang_major__ >= 13
#define FUZZ_HARNESS __attribute__((no_sanitize("coverage")))
#else
#define FUZZ_HARNESS
#endif

static uint32_t fuzz_rng;

FUZZ_HARNESS static uint32_t next_random(void) {
    fuzz_rng = fuzz_rng * 1664525u + 1013904223u;
    return fuzz_rng >> 8;
}

static void require(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "%s: invariant violated: %s\n", FUZZ_TARGET_NAME, what);
        abort();
    }
}

/* A kvmix_error as a call left it: a field and a reason on failure, "" and "" on success
   (inline: not every target checks one). */
FUZZ_HARNESS static inline int error_filled(kvmix_result r, kvmix_error e) {
    if (!e.field || !e.reason) return 0;
    return r == KVMIX_SUCCESS ? e.field[0] == 0 && e.reason[0] == 0
                              : e.field[0] != 0 && e.reason[0] != 0;
}

FUZZ_HARNESS static int all_poisoned(const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    size_t i;
    for (i = 0; i < n; i++)
        if (b[i] != POISON) return 0;
    return 1;
}

#endif
