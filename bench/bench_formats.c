/* CPU throughput of the format references, kvmix_ref_quantize and kvmix_ref_dequantize, per
   format, against memcpy of the same fp32 bytes measured in the same run.

   Build and run (make bench does the same):
       cc -std=c11 -O2 -ffp-contract=off -I. bench/bench_formats.c -o build/bench_formats -lm
       ./build/bench_formats [head_dim=128] [tokens=128] [boost=16] [group=32] [reps=9] [ms=40]
   Add -DKVMIX_BENCH_CFLAGS='"..."' to print the compiler flags with the configuration.

   Method: each format quantizes (or dequantizes) BLOCKS_PER_BUFFER blocks of one kv head
   (tokens x head_dim) from one of N_BUFFERS input buffers in turn, so the working set (about
   8 MiB of fp32) does not sit in the L2 cache (it may in a large L3). A repetition runs enough
   passes to last about `ms` milliseconds (calibrated after one warm-up pass); the figure is the
   median of `reps` repetitions, timed with clock_gettime(CLOCK_MONOTONIC). GB/s is 1e9 bytes
   per second of fp32 data (input of quantize, output of dequantize) and, separately, of packed
   bytes. The cpu% column (CPU time / wall time) tells whether other processes took the CPU. */
#define _POSIX_C_SOURCE 199309L
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_common.h"

#define N_BUFFERS         4
#define BLOCKS_PER_BUFFER 32
#define MAX_REPS          64

typedef struct bench_config {
    int32_t head_dim, tokens, boost, group, reps;
    double ms;
} bench_config;

static uint64_t rng_state = 0x62656e6368ull;
static double rng_normal(void) {
    double s = 0.0;
    int i;
    for (i = 0; i < 12; i++) { /* Irwin-Hall: good enough for bench data */
        uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        s += (double)((z ^ (z >> 31)) >> 11) * 0x1p-53;
    }
    return s - 6.0;
}

/* The operation timed: one pass over every block of buffer `which`. */
typedef enum bench_op { OP_MEMCPY, OP_QUANTIZE, OP_DEQUANTIZE } bench_op;

typedef struct bench_state {
    bench_op op;
    kvmix_layout layout;
    size_t block_floats, block_bytes;
    float *fp32[N_BUFFERS]; /* [BLOCKS_PER_BUFFER][block_floats] inputs */
    uint8_t *packed[N_BUFFERS];
    float *out[N_BUFFERS]; /* dequantize / memcpy destinations */
    int failed;
} bench_state;

static void run_pass(bench_state *s, int which) {
    int b;
    for (b = 0; b < BLOCKS_PER_BUFFER; b++) {
        float *in = s->fp32[which] + (size_t)b * s->block_floats;
        float *out = s->out[which] + (size_t)b * s->block_floats;
        uint8_t *packed = s->packed[which] + (size_t)b * s->block_bytes;
        switch (s->op) {
        case OP_MEMCPY: memcpy(out, in, s->block_floats * sizeof(float)); break;
        case OP_QUANTIZE:
            if (kvmix_ref_quantize(&s->layout, in, 0, packed, s->block_bytes) != KVMIX_SUCCESS)
                s->failed = 1;
            break;
        case OP_DEQUANTIZE:
            if (kvmix_ref_dequantize(&s->layout, packed, s->block_bytes, out, 0) != KVMIX_SUCCESS)
                s->failed = 1;
            break;
        }
    }
}

/* Median seconds per pass (one buffer) over cfg->reps repetitions; *busy = CPU time / wall time
   of the repetitions (near 1 on an idle machine). */
static double time_op(bench_state *s, const bench_config *cfg, double *busy) {
    double t0, c0, wall = 0.0, per_pass, reps[MAX_REPS];
    long passes, p;
    int r, which = 0;
    t0 = now_seconds(); /* warm-up, which also calibrates the passes per repetition */
    for (p = 0; p < N_BUFFERS; p++) run_pass(s, (int)p);
    per_pass = (now_seconds() - t0) / N_BUFFERS;
    passes = (long)(cfg->ms * 1e-3 / (per_pass > 1e-9 ? per_pass : 1e-9));
    if (passes < N_BUFFERS) passes = N_BUFFERS;
    c0 = cpu_seconds();
    for (r = 0; r < cfg->reps; r++) {
        t0 = now_seconds();
        for (p = 0; p < passes; p++) {
            run_pass(s, which);
            which = (which + 1) % N_BUFFERS;
        }
        reps[r] = now_seconds() - t0;
        wall += reps[r];
        reps[r] /= (double)passes;
    }
    *busy = (cpu_seconds() - c0) / wall;
    qsort(reps, (size_t)cfg->reps, sizeof reps[0], cmp_double);
    return reps[cfg->reps / 2];
}

static int parse_arg(const char *arg, bench_config *cfg) {
    const char *eq = strchr(arg, '=');
    double v;
    if (!eq) return 0;
    v = atof(eq + 1);
    if (strncmp(arg, "head_dim=", 9) == 0)
        cfg->head_dim = (int32_t)v;
    else if (strncmp(arg, "tokens=", 7) == 0)
        cfg->tokens = (int32_t)v;
    else if (strncmp(arg, "boost=", 6) == 0)
        cfg->boost = (int32_t)v;
    else if (strncmp(arg, "group=", 6) == 0)
        cfg->group = (int32_t)v;
    else if (strncmp(arg, "reps=", 5) == 0)
        cfg->reps = (int32_t)v;
    else if (strncmp(arg, "ms=", 3) == 0)
        cfg->ms = v;
    else
        return 0;
    return 1;
}

int main(int argc, char **argv) {
    static const kvmix_format formats[] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                           KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
                                           KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
    bench_config cfg = {128, 128, 16, 32, 9, 40.0};
    bench_state s;
    size_t max_block_bytes, f, i;
    double memcpy_s, busy, min_busy, start = now_seconds();
    int a, b, status = 0;
    unsigned checksum = 0;
    for (a = 1; a < argc; a++)
        if (!parse_arg(argv[a], &cfg)) {
            fprintf(stderr,
                    "usage: %s [head_dim=N] [tokens=N] [boost=N] [group=N] [reps=N] [ms=X]\n",
                    argv[0]);
            return 2;
        }
    if (cfg.reps < 1 || cfg.reps > MAX_REPS || cfg.head_dim <= 0 || cfg.tokens <= 0 ||
        cfg.ms <= 0) {
        fprintf(stderr, "bench_formats: reps must be 1..%d, sizes and ms positive\n", MAX_REPS);
        return 2;
    }
    memset(&s, 0, sizeof s);
    s.block_floats = (size_t)cfg.tokens * (size_t)cfg.head_dim;
    max_block_bytes = s.block_floats * 2; /* FP16 is the largest format */

    printf("bench_formats: CPU reference quantize / dequantize throughput\n");
    printf("  head_dim         %d\n", (int)cfg.head_dim);
    printf("  tokens per block %d (one kv head)\n", (int)cfg.tokens);
    printf("  group size       %d (INT8 / INT4 / INT2)\n", (int)cfg.group);
    printf("  n_boost          %d (BOOSTED)\n", (int)cfg.boost);
    printf("  blocks           %d per buffer, %d buffers in rotation (%.1f MiB fp32)\n",
           BLOCKS_PER_BUFFER, N_BUFFERS,
           (double)(s.block_floats * sizeof(float) * BLOCKS_PER_BUFFER * N_BUFFERS) / 1048576.0);
    printf("  timing           1 warm-up round, then median of %d repetitions of ~%.0f ms, "
           "CLOCK_MONOTONIC\n",
           (int)cfg.reps, cfg.ms);
#if defined(__clang__)
    printf("  compiler         %s\n", __VERSION__);
#elif defined(__GNUC__)
    printf("  compiler         gcc %s\n", __VERSION__);
#endif
    printf("  flags            %s\n", KVMIX_BENCH_CFLAGS);
#if defined(__OPTIMIZE__)
    printf("  optimized        yes (__OPTIMIZE__)\n");
#else
    printf("  optimized        NO (__OPTIMIZE__ undefined: figures are not meaningful)\n");
#endif
    print_cpu();

    for (i = 0; i < N_BUFFERS; i++) {
        size_t c;
        s.fp32[i] = (float *)malloc(sizeof(float) * s.block_floats * BLOCKS_PER_BUFFER);
        s.out[i] = (float *)malloc(sizeof(float) * s.block_floats * BLOCKS_PER_BUFFER);
        s.packed[i] = (uint8_t *)malloc(max_block_bytes * BLOCKS_PER_BUFFER);
        if (!s.fp32[i] || !s.out[i] || !s.packed[i]) {
            fprintf(stderr, "bench_formats: out of memory\n");
            return 1;
        }
        /* keys-like rows: per-channel offsets, every 16th channel of high magnitude */
        for (c = 0; c < s.block_floats * BLOCKS_PER_BUFFER; c++) {
            size_t ch = c % (size_t)cfg.head_dim;
            double v = rng_normal() + 0.3 * (double)((ch * 7) % 5) - 0.6;
            if (ch % 16 == 3) v *= 12.0;
            s.fp32[i][c] = (float)v;
        }
        memset(s.out[i], 0, sizeof(float) * s.block_floats * BLOCKS_PER_BUFFER);
        memset(s.packed[i], 0, max_block_bytes * BLOCKS_PER_BUFFER);
    }

    s.op = OP_MEMCPY;
    memcpy_s = time_op(&s, &cfg, &busy);
    min_busy = busy;
    printf("\n%-13s %-10s %10s %11s %9s %10s %10s %5s\n", "format", "op", "fp32 GB/s",
           "packed GB/s", "bits/elem", "vs memcpy", "us/block", "cpu%");
    printf("%-13s %-10s %10.2f %11s %9s %10s %10.2f %5.0f\n", "(baseline)", "memcpy",
           (double)(s.block_floats * sizeof(float) * BLOCKS_PER_BUFFER) / memcpy_s * 1e-9, "-",
           "32", "1.000", memcpy_s / BLOCKS_PER_BUFFER * 1e6, 100.0 * busy);

    for (f = 0; f < sizeof formats / sizeof formats[0]; f++) {
        kvmix_layout l;
        double bits = 0.0, secs;
        memset(&l, 0, sizeof l);
        l.format = formats[f];
        l.n_tokens = cfg.tokens;
        l.head_dim = cfg.head_dim;
        if (formats[f] == KVMIX_FORMAT_INT8 || formats[f] == KVMIX_FORMAT_INT4 ||
            formats[f] == KVMIX_FORMAT_INT2)
            l.group_size = cfg.group;
        if (formats[f] == KVMIX_FORMAT_BOOSTED) l.n_boost = cfg.boost;
        if (kvmix_layout_bytes(&l, &s.block_bytes) != KVMIX_SUCCESS ||
            kvmix_layout_bits(&l, &bits) != KVMIX_SUCCESS) {
            printf("%-13s invalid layout for this configuration\n", kvmix_format_name(formats[f]));
            status = 1;
            continue;
        }
        s.layout = l;
        for (b = 0; b < 2; b++) {
            double fp32_bytes = (double)(s.block_floats * sizeof(float) * BLOCKS_PER_BUFFER);
            double packed_bytes = (double)(s.block_bytes * BLOCKS_PER_BUFFER);
            s.op = b == 0 ? OP_QUANTIZE : OP_DEQUANTIZE;
            s.failed = 0;
            secs = time_op(&s, &cfg, &busy);
            if (busy < min_busy) min_busy = busy;
            if (s.failed) {
                printf("%-13s %-10s failed\n", kvmix_format_name(formats[f]),
                       b ? "dequantize" : "quantize");
                status = 1;
                continue;
            }
            printf("%-13s %-10s %10.3f %11.3f %9.4g %10.4f %10.2f %5.0f\n",
                   kvmix_format_name(formats[f]), b ? "dequantize" : "quantize",
                   fp32_bytes / secs * 1e-9, packed_bytes / secs * 1e-9, bits, memcpy_s / secs,
                   secs / BLOCKS_PER_BUFFER * 1e6, 100.0 * busy);
        }
    }
    /* use the results, so no pass can be optimized away */
    for (i = 0; i < N_BUFFERS; i++) {
        size_t j;
        for (j = 0; j < max_block_bytes * BLOCKS_PER_BUFFER; j += 4093)
            checksum = checksum * 31u + s.packed[i][j];
        for (j = 0; j < s.block_floats * BLOCKS_PER_BUFFER; j += 4093)
            checksum += (unsigned)(s.out[i][j] != 0.0f);
        free(s.fp32[i]);
        free(s.out[i]);
        free(s.packed[i]);
    }
    printf(
        "\n\"vs memcpy\" = memcpy time / operation time for the same fp32 bytes; cpu%% = CPU time /"
        " wall time of the timed repetitions\n");
    if (min_busy < 0.9)
        printf(
            "warning: cpu%% fell to %.0f%%: other processes shared the CPU, so figures are low\n",
            100.0 * min_busy);
    printf("checksum %08x, %.1f s in all\n", checksum, now_seconds() - start);
    return status;
}
