/* What the fuzz targets of packed data share: a small deterministic generator for values a target
   derives from its input bytes, an invariant check that aborts (the fuzzer reports the crash),
   and a test that an output still holds its poison. Define FUZZ_TARGET_NAME (a string) first. */
#ifndef KVMIX_TESTS_FUZZ_INVARIANTS_H
#define KVMIX_TESTS_FUZZ_INVARIANTS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { POISON = 0x5a }; /* byte written over outputs before a call */

static uint32_t fuzz_rng;

static uint32_t next_random(void) {
    fuzz_rng = fuzz_rng * 1664525u + 1013904223u;
    return fuzz_rng >> 8;
}

static void require(int ok, const char *what) {
    if (!ok) {
        fprintf(stderr, "%s: invariant violated: %s\n", FUZZ_TARGET_NAME, what);
        abort();
    }
}

static int all_poisoned(const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    size_t i;
    for (i = 0; i < n; i++)
        if (b[i] != POISON) return 0;
    return 1;
}

#endif
