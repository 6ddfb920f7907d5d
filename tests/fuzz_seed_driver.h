/* Plain driver for fuzz targets that bring their own seeds and mutations, for builds without
 * libFuzzer (any C compiler). A target includes it under FUZZ_DRIVER, after defining
 * FUZZ_MAX_INPUT (the largest input in bytes), builds its seeds and returns fuzz_seed_main():
 *
 *     prog [N] [-timeout=S] [-rss_limit_mb=M] [FILE...]
 *                               runs each FILE (also kept as a seed while there is room), then the
 *                               seeds, then N (default 4000) seeded mutations of the seeds in turn
 *     prog --write-seeds DIR    writes the seeds as DIR/seed-0, DIR/seed-1, ... for libFuzzer
 *
 * A numeric argument anywhere is N. The run is deterministic for a given rng seed. Any crash or
 * sanitizer report ends the program; so does an input that runs S seconds (default 10) or leaves
 * the process above M MiB (default 2048), saved first as ./timeout-* or ./oom-*
 * (tests/fuzz_limits.h: the target defines _POSIX_C_SOURCE before its first include). Otherwise
 * it prints one summary line and exits 0.
 */
#ifndef KVMIX_FUZZ_SEED_DRIVER_H
#define KVMIX_FUZZ_SEED_DRIVER_H

#ifndef FUZZ_MAX_INPUT
#error "define FUZZ_MAX_INPUT before including fuzz_seed_driver.h"
#endif

#include "fuzz_limits.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { FUZZ_DEFAULT_MUTATIONS = 4000 };

typedef struct buffer {
    uint8_t bytes[FUZZ_MAX_INPUT];
    size_t size;
} buffer;

/* xorshift64; the state must not be zero. */
static uint64_t next_random(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* One edit of a target's own kind (below the n_kinds given to fuzz_mutate) at byte at < b->size. */
typedef void fuzz_edit(buffer *b, size_t at, uint64_t kind, uint64_t *rng);

/* 1 to 4 edits, each at a random byte and of a random kind; stops early once b is empty. */
static void fuzz_mutate(buffer *b, uint64_t *rng, uint64_t n_kinds, fuzz_edit *edit) {
    int32_t n_edits = 1 + (int32_t)(next_random(rng) % 4);
    for (int32_t e = 0; e < n_edits && b->size > 0; e++) {
        size_t at = (size_t)(next_random(rng) % b->size);
        edit(b, at, next_random(rng) % n_kinds, rng);
    }
}

/* The edits the JSON readers' targets share (static inline: a target that uses none of them
   compiles without warnings). */

/* A byte that steers a JSON reader into its branches (digits, signs, exponents, quotes,
   brackets, separators, escapes, the letters of true/false/null, a space, NUL, 0xFF): the
   i-th of them, modulo their count. */
static inline uint8_t fuzz_json_byte(uint64_t i) {
    static const char bytes[] = "0123456789-+.eE\"{}[],:\\ntfu \x00\xff";
    return (uint8_t)bytes[i % (sizeof bytes - 1)];
}

/* Deletes a run of 1 to 8 bytes from byte at. */
static inline void fuzz_delete_run(buffer *b, size_t at, uint64_t *rng) {
    size_t n = 1 + (size_t)(next_random(rng) % 8);
    if (at + n > b->size) n = b->size - at;
    memmove(b->bytes + at, b->bytes + at + n, b->size - at - n);
    b->size -= n;
}

/* Inserts a random one of words[0 .. n_words) at byte at, when it fits. */
static inline void fuzz_insert_word(buffer *b, size_t at, const char *const *words, size_t n_words,
                                    uint64_t *rng) {
    const char *w = words[next_random(rng) % n_words];
    size_t n = strlen(w);
    if (b->size + n > FUZZ_MAX_INPUT) return;
    memmove(b->bytes + at + n, b->bytes + at, b->size - at);
    memcpy(b->bytes + at, w, n);
    b->size += n;
}

/* One edit of a JSON reader's input: kind 0 a steering byte (fuzz_json_byte), 1 a deleted run,
   2 the input cut at `at`, 3 a digit (numbers change, sizes and ids break), else one of words
   inserted. For fuzz_mutate with 5 kinds. */
static inline void fuzz_json_edit(buffer *b, size_t at, uint64_t kind, const char *const *words,
                                  size_t n_words, uint64_t *rng) {
    switch (kind) {
    case 0: b->bytes[at] = fuzz_json_byte(next_random(rng)); break;
    case 1: fuzz_delete_run(b, at, rng); break;
    case 2: b->size = at; break;
    case 3: b->bytes[at] = (uint8_t)('0' + next_random(rng) % 10); break;
    default: fuzz_insert_word(b, at, words, n_words, rng); break;
    }
}

static bool read_input(const char *path, buffer *b) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return false;
    b->size = fread(b->bytes, 1, FUZZ_MAX_INPUT, f);
    fclose(f);
    return true;
}

static int write_seeds(const char *dir, const buffer *seeds, int32_t n_seeds) {
    for (int32_t i = 0; i < n_seeds; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/seed-%d", dir, i);
        FILE *f = fopen(path, "wb");
        bool ok = f != NULL && fwrite(seeds[i].bytes, 1, seeds[i].size, f) == seeds[i].size;
        if (f != NULL) fclose(f);
        if (!ok) {
            fprintf(stderr, "fuzz: cannot write %s\n", path);
            return 1;
        }
    }
    return 0;
}

/* Runs b under the limits; *slowest keeps the longest time an input took, in seconds. */
static void fuzz_timed_run(const buffer *b, double *slowest) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    fuzz_limits_run(LLVMFuzzerTestOneInput, b->bytes, b->size);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    if (s > *slowest) *slowest = s;
}

/* seeds has max_seeds slots, the first n_seeds (at least one) filled; rng_seed is not zero. */
static int fuzz_seed_main(int argc, char **argv, buffer *seeds, int32_t n_seeds, int32_t max_seeds,
                          uint64_t rng_seed, void (*mutate)(buffer *, uint64_t *)) {
    static buffer work;
    if (argc == 3 && strcmp(argv[1], "--write-seeds") == 0)
        return write_seeds(argv[2], seeds, n_seeds);
    long n_mutations = FUZZ_DEFAULT_MUTATIONS;
    double slowest = 0.0;
    fuzz_limits_start(argv[0]);
    for (int i = 1; i < argc; i++) fuzz_limits_arg(argv[i]);
    for (int i = 1; i < argc; i++) {
        char *end;
        long count = strtol(argv[i], &end, 10);
        if (*argv[i] != 0 && *end == 0 && count >= 0) {
            n_mutations = count;
            continue;
        }
        if (fuzz_limits_arg(argv[i])) continue;
        if (!read_input(argv[i], &work)) {
            fprintf(stderr, "fuzz: cannot read %s\n", argv[i]);
            return 1;
        }
        fuzz_timed_run(&work, &slowest);
        if (n_seeds < max_seeds) seeds[n_seeds++] = work;
    }
    for (int32_t s = 0; s < n_seeds; s++) fuzz_timed_run(&seeds[s], &slowest);
    uint64_t rng = rng_seed;
    for (long i = 0; i < n_mutations; i++) {
        work = seeds[(size_t)i % (size_t)n_seeds];
        mutate(&work, &rng);
        fuzz_timed_run(&work, &slowest);
    }
    printf("fuzz: %d seeds, %ld mutations, no crash, slowest input %.1f ms\n", n_seeds, n_mutations,
           1e3 * slowest);
    return 0;
}

#endif /* KVMIX_FUZZ_SEED_DRIVER_H */
