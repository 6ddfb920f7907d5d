/* Plain driver for libFuzzer-style targets, for builds without libFuzzer (any C compiler):
       cc -std=c11 -fsanitize=address,undefined -I. tests/fuzz_formats.c tests/fuzz_driver.c -lm
       ./a.out [N] [-timeout=S] [-rss_limit_mb=M] [FILE...]
   Runs the linked LLVMFuzzerTestOneInput on N (default 20000) deterministic inputs, then on each
   FILE (a crash reproducer or corpus entry). A numeric first argument is N. An input that runs
   S seconds (default 10) or leaves the process above M MiB (default 2048) fails the run and is
   saved as ./timeout-* or ./oom-* (tests/fuzz_limits.h). The inputs are a mix
   of
     - random bytes of random length,
     - structured inputs: the 12-byte header that tests/fuzz_formats.c documents, chosen to be
       mostly valid, followed by blocks that kvmix_ref_quantize really wrote (keys for every kv
       head, then values), so that calls get past argument checks into decoding and attention,
     - mutations of those: flipped bits, overwritten bytes (often a scale, minimum or boost
       index), truncation, extension, header changes.
   Other targets see the same bytes and simply interpret them their own way. Any crash or
   sanitizer report ends the program; otherwise it prints one summary line and exits 0.
   KVMIX_FUZZ_SEED=N changes the inputs. With -DKVMIX_FUZZ_STATS (also on the target) it prints
   how often each entry point returned each result. */
#define _POSIX_C_SOURCE 200809L /* alarm, sigaction, getrusage, clock_gettime (fuzz_limits.h) */
#include "kvmix.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#ifndef KVMIX_FUZZ_LIBFUZZER /* libFuzzer brings its own main() */

#include "fuzz_limits.h"

#include <time.h>

#define DRIVER_MAX_INPUT (1u << 20)

static uint64_t driver_state;

static uint64_t driver_next(void) { /* splitmix64 */
    uint64_t z = (driver_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t driver_below(uint32_t n) { return n ? (uint32_t)(driver_next() % n) : 0; }

static double driver_normal(void) { /* sum of uniforms: cheap, roughly normal */
    double s = 0.0;
    int i;
    for (i = 0; i < 4; i++) s += (double)(driver_next() >> 11) * 0x1p-53;
    return (s - 2.0) * 1.7;
}

/* Header byte values that decode (in fuzz_formats.c) to a given format, head_dim, ... */
static uint8_t enc_head_dim(int32_t d) { return (uint8_t)(d / 32 - 1); }
static uint8_t enc_group_index(int32_t g) {
    static const int32_t groups[8] = {0, 8, 16, 32, 64, 24, 12, 128};
    uint8_t i;
    for (i = 0; i < 8; i++)
        if (groups[i] == g) return i;
    return 0;
}

/* A layout that kvmix accepts, for format f and head_dim d. */
static void pick_layout_params(kvmix_format f, int32_t d, int32_t *group, int32_t *boost) {
    static const int32_t groups[4] = {0, 8, 16, 32};
    *group = 0;
    *boost = 0;
    if (f == KVMIX_FORMAT_INT8 || f == KVMIX_FORMAT_INT4 || f == KVMIX_FORMAT_INT2) {
        *group = groups[driver_below(4)];
        if (driver_below(4) == 0 && d % 64 == 0) *group = 64;
    }
    if (f == KVMIX_FORMAT_BOOSTED) {
        int32_t max = d < 188 ? d : 188; /* 4 * 47: what header byte 4 can say */
        *boost = 4 * (int32_t)driver_below((uint32_t)(max / 4) + 1);
    }
}

/* Quantizes n_kv blocks of random rows into out (head stride `stride`); returns bytes used. */
static size_t put_blocks(uint8_t *out, size_t cap, const kvmix_layout *l, int32_t n_kv,
                         size_t stride) {
    size_t block = 0, used;
    float *rows;
    int32_t h, i, n_elems = l->n_tokens * l->head_dim;
    double scale = (double)(1u << driver_below(8)) / 16.0;
    if (kvmix_layout_bytes(l, &block) != KVMIX_SUCCESS || block == 0) return 0;
    if (stride < block) stride = block;
    used = stride * (size_t)(n_kv - 1) + block;
    if (used > cap) return 0;
    rows = (float *)malloc(sizeof(float) * (size_t)(n_elems ? n_elems : 1));
    if (!rows) abort();
    memset(out, 0, used);
    for (h = 0; h < n_kv; h++) {
        for (i = 0; i < n_elems; i++) {
            double v = driver_normal() * scale;
            if (driver_below(64) == 0) v *= 300.0; /* outliers */
            if (driver_below(97) == 0) v = driver_below(2) ? 65504.0 : -65504.0;
            rows[i] = (float)v;
        }
        if (driver_below(8) == 0) /* a constant channel */
            for (i = (int32_t)driver_below((uint32_t)l->head_dim); i < n_elems; i += l->head_dim)
                rows[i] = 1.5f;
        if (kvmix_ref_quantize(l, rows, 0, out + stride * (size_t)h, block) != KVMIX_SUCCESS) {
            free(rows);
            return 0;
        }
    }
    free(rows);
    return used;
}

/* A structured input: header + valid key blocks + valid value blocks. */
static size_t make_structured(uint8_t *buf, size_t cap) {
    static const kvmix_format formats[6] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                            KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
                                            KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
    static const int32_t dims[6] = {32, 64, 96, 128, 256, 512};
    kvmix_layout kl, vl;
    int32_t kg, kb, vg, vb, n_kv = 1 + (int32_t)driver_below(3);
    uint8_t kpad = (uint8_t)(driver_below(3) == 0 ? 1 + driver_below(40) : 0);
    uint8_t vpad = (uint8_t)(driver_below(3) == 0 ? 1 + driver_below(40) : 0);
    size_t used, kstride, vstride, kblock = 0, vblock = 0;
    memset(&kl, 0, sizeof kl);
    kl.format = formats[driver_below(6)];
    kl.head_dim = dims[driver_below(6)];
    if (kl.head_dim >= 256 && driver_below(2)) kl.head_dim = 64;
    kl.n_tokens = (int32_t)driver_below(72);
    if (driver_below(4) == 0) kl.n_tokens = 1 + (int32_t)driver_below(4);
    vl = kl;
    vl.format = formats[driver_below(6)];
    pick_layout_params(kl.format, kl.head_dim, &kg, &kb);
    pick_layout_params(vl.format, vl.head_dim, &vg, &vb);
    kl.group_size = kg;
    kl.n_boost = kb;
    vl.group_size = vg;
    vl.n_boost = vb;
    if (cap < 12) return 0;
    buf[0] = (uint8_t)kl.format;
    buf[1] = enc_head_dim(kl.head_dim);
    buf[2] = (uint8_t)kl.n_tokens;
    buf[3] = (uint8_t)(enc_group_index(kg) | enc_group_index(vg) << 3 | driver_below(4) << 6);
    buf[4] = (uint8_t)(kb / 4);
    buf[5] = (uint8_t)vl.format;
    buf[6] = (uint8_t)(vb / 4);
    buf[7] =
        (uint8_t)((n_kv - 1) | driver_below(4) << 2 | driver_below(4) << 4 | driver_below(3) << 6);
    buf[8] = kpad;
    buf[9] = vpad;
    buf[10] = (uint8_t)driver_below(256);
    buf[11] = (uint8_t)driver_below(256);
    kvmix_layout_bytes(&kl, &kblock);
    kvmix_layout_bytes(&vl, &vblock);
    kstride = kpad ? kblock + kpad - 1 : kblock;
    vstride = vpad ? vblock + vpad - 1 : vblock;
    used = 12 + put_blocks(buf + 12, cap - 12, &kl, n_kv, kstride);
    used += put_blocks(buf + used, cap - used, &vl, n_kv, vstride);
    return used;
}

static size_t mutate(uint8_t *buf, size_t size, size_t cap) {
    uint32_t k, n_mutations = 1 + driver_below(4);
    for (k = 0; k < n_mutations; k++) {
        switch (driver_below(8)) {
        case 0: /* flip a bit */
            if (size) buf[driver_below((uint32_t)size)] ^= (uint8_t)(1u << driver_below(8));
            break;
        case 1: /* a random byte */
            if (size) buf[driver_below((uint32_t)size)] = (uint8_t)driver_next();
            break;
        case 2: /* a byte near the end: scales, minima and the boost index live there */
            if (size > 12)
                buf[size - 1 - driver_below((uint32_t)(size - 12 < 600 ? size - 12 : 600))] =
                    (uint8_t)driver_next();
            break;
        case 3: /* an FP16 special (inf, NaN, negative) written at an even offset */
            if (size > 14) {
                static const uint16_t specials[] = {0x7c00, 0xfc00, 0x7e00, 0xbc00,
                                                    0x8000, 0x7bff, 0x0001};
                size_t at = 12 + 2 * driver_below((uint32_t)((size - 13) / 2));
                uint16_t v = specials[driver_below(7)];
                buf[at] = (uint8_t)v;
                buf[at + 1] = (uint8_t)(v >> 8);
            }
            break;
        case 4: /* truncate */
            if (size) size -= 1 + driver_below((uint32_t)(size < 64 ? size : 64));
            break;
        case 5: /* extend with random bytes */
        {
            uint32_t extra = 1 + driver_below(64), i;
            for (i = 0; i < extra && size < cap; i++) buf[size++] = (uint8_t)driver_next();
        } break;
        case 6: /* a header byte */
            if (size) buf[driver_below(size < 12 ? (uint32_t)size : 12)] = (uint8_t)driver_next();
            break;
        default: /* a boost index entry: slot values and 0xFF */
            if (size > 12)
                buf[size - 1 - driver_below((uint32_t)(size - 12 < 512 ? size - 12 : 512))] =
                    (uint8_t)(driver_below(2) ? 0xff : driver_below(8));
            break;
        }
    }
    return size;
}

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    uint8_t *buf;
    size_t size;
    if (!f) {
        fprintf(stderr, "fuzz_driver: cannot open %s\n", path);
        return 0;
    }
    buf = (uint8_t *)malloc(DRIVER_MAX_INPUT);
    if (!buf) abort();
    size = fread(buf, 1, DRIVER_MAX_INPUT, f);
    fclose(f);
    {
        uint8_t *exact = (uint8_t *)malloc(size ? size : 1); /* exact size for ASan */
        if (!exact) abort();
        memcpy(exact, buf, size);
        fuzz_limits_run(LLVMFuzzerTestOneInput, exact, size);
        free(exact);
    }
    free(buf);
    return 1;
}

static double driver_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#ifdef KVMIX_FUZZ_STATS
extern long kvmix_fuzz_results[3][16];
static void print_stats(void) {
    static const char *names[3] = {"dequantize", "dequantize_row", "attention_decode"};
    int call, r;
    for (call = 0; call < 3; call++) {
        printf("  %-16s", names[call]);
        for (r = 0; r < 14; r++)
            if (kvmix_fuzz_results[call][r]) printf(" %d:%ld", -r, kvmix_fuzz_results[call][r]);
        printf("\n");
    }
}
#endif

int main(int argc, char **argv) {
    long n = 20000, i, n_random = 0, n_structured = 0, n_mutated = 0, n_files = 0;
    uint8_t *buf = (uint8_t *)malloc(DRIVER_MAX_INPUT), *exact;
    const char *seed_text = getenv("KVMIX_FUZZ_SEED");
    int first_file = 1;
    double start, slowest = 0.0;
    if (!buf) return 2;
    if (argc > 1 && argv[1][0] >= '0' && argv[1][0] <= '9') {
        n = strtol(argv[1], NULL, 10);
        first_file = 2;
    }
    fuzz_limits_start(argv[0]);
    for (i = first_file; i < argc; i++) fuzz_limits_arg(argv[i]);
    driver_state = seed_text ? strtoull(seed_text, NULL, 0) : 0x6b766d6978ull;
    for (i = 0; i < n; i++) {
        size_t size;
        uint32_t kind = driver_below(8);
        if (kind == 0) { /* random bytes */
            uint32_t j;
            size = driver_below(2) ? driver_below(64) : driver_below(8192);
            for (j = 0; j < size; j++) buf[j] = (uint8_t)driver_next();
            n_random++;
        } else {
            size = make_structured(buf, DRIVER_MAX_INPUT);
            if (kind >= 4) {
                size = mutate(buf, size, DRIVER_MAX_INPUT);
                n_mutated++;
            } else {
                n_structured++;
            }
        }
        exact = (uint8_t *)malloc(size ? size : 1);
        if (!exact) return 2;
        memcpy(exact, buf, size);
        start = driver_seconds();
        fuzz_limits_run(LLVMFuzzerTestOneInput, exact, size);
        if (driver_seconds() - start > slowest) slowest = driver_seconds() - start;
        free(exact);
    }
    for (i = first_file; i < argc; i++) {
        if (fuzz_limits_arg(argv[i])) continue;
        start = driver_seconds();
        n_files += run_file(argv[i]);
        if (driver_seconds() - start > slowest) slowest = driver_seconds() - start;
    }
    free(buf);
    printf("fuzz_driver: %ld inputs ran clean (%ld random, %ld valid blocks, %ld mutated, %ld "
           "files), slowest %.1f ms\n",
           n + n_files, n_random, n_structured, n_mutated, n_files, 1e3 * slowest);
#ifdef KVMIX_FUZZ_STATS
    print_stats();
#endif
    return 0;
}

#endif /* KVMIX_FUZZ_LIBFUZZER */
