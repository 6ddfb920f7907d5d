/* CPU time of the bit allocators (kvmix_alloc_two_level exhaustive and greedy,
   kvmix_alloc_knapsack) on random calibration tables, with baselines measured in the same run:
   the exhaustive search against a brute force that sums every assignment from scratch
   (O(n 2^n)) and against a Gray-code walk (one tag flips per step, running sums); the greedy and
   the knapsack by the distortion they reach against the two-level optimum at the same budget.

   Build and run (make bench does the same):
       cc -std=c11 -O2 -ffp-contract=off -I. bench/bench_alloc.c -o build/bench_alloc -lm
       ./build/bench_alloc [reps=7] [ms=30] [budget=3.5]
   Add -DKVMIX_BENCH_CFLAGS='"..."' to print the compiler flags with the configuration.

   Instances: per tag a token count (1 .. 4000) and, per precision, a distortion that falls with
   the precision's bits (sensitivity * 2^-bits, a tag-specific sensitivity over two decades, 30%
   noise), drawn from a seed that depends only on n_tags (rows of equal n_tags share their
   instance). The precisions are five kvmix key/value pairs at head_dim 128 and pages of 128 tokens,
   costed with kvmix_layout_bits (mean of the key and value layouts): INT2_CHANNEL + INT2,
   BOOSTED (16) + INT2, INT4 + INT4, INT8 + INT8, FP16 + FP16. Two-level runs use the first and
   the third (2.625 and 5 bits). A figure is the median over `reps` repetitions of a loop of calls
   lasting about `ms` milliseconds, timed with CLOCK_MONOTONIC; cpu% = CPU time / wall time. */
#define _POSIX_C_SOURCE 199309L
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_common.h"

#define MAX_REPS  64
#define N_PREC    5
#define LOW       0
#define HIGH      2
#define MAX_BRUTE 22

typedef struct bench_config {
    int32_t reps;
    double ms, budget;
} bench_config;

static uint64_t rng_state = 0x616c6c6f63ull;
static double rng_unit(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) * 0x1p-53;
}

typedef struct bench_instance {
    int32_t n;
    int64_t *tokens;
    double *distortion; /* [n][N_PREC] */
    double bits[N_PREC];
    kvmix_alloc_problem problem;
} bench_instance;

static int make_instance(bench_instance *in, int32_t n, const double *bits, double budget) {
    int32_t t, k;
    rng_state = 0x616c6c6f63ull + (uint64_t)n;   /* the same instance for the same n */
    memset(&in->problem, 0, sizeof in->problem); /* members not set below keep their defaults */
    in->n = n;
    in->tokens = (int64_t *)malloc(sizeof(int64_t) * (size_t)n);
    in->distortion = (double *)malloc(sizeof(double) * (size_t)n * N_PREC);
    if (!in->tokens || !in->distortion) return 0;
    memcpy(in->bits, bits, sizeof in->bits);
    for (t = 0; t < n; t++) {
        double sensitivity = pow(10.0, 2.0 * rng_unit());
        in->tokens[t] = 1 + (int64_t)(rng_unit() * 4000.0);
        for (k = 0; k < N_PREC; k++)
            in->distortion[(size_t)t * N_PREC + (size_t)k] =
                sensitivity * exp2(-bits[k]) * (1.0 + 0.3 * rng_unit());
    }
    in->problem.n_tags = n;
    in->problem.n_precisions = N_PREC;
    in->problem.tokens = in->tokens;
    in->problem.distortion = in->distortion;
    in->problem.bits = in->bits;
    in->problem.budget_bits = budget;
    return 1;
}

/* ---- baselines ------------------------------------------------------------------------------ */

/* Every assignment summed from scratch; returns the best distortion within the budget. */
static double brute_naive(const bench_instance *in) {
    const kvmix_alloc_problem *p = &in->problem;
    double best = HUGE_VAL, total = 0.0, limit;
    uint32_t mask;
    int32_t t;
    for (t = 0; t < p->n_tags; t++) total += (double)p->tokens[t];
    limit = p->budget_bits * total;
    for (mask = 0; mask < (1u << p->n_tags); mask++) {
        double c = 0.0, d = 0.0;
        for (t = 0; t < p->n_tags; t++) {
            int32_t k = (mask >> t) & 1u ? HIGH : LOW;
            c += (double)p->tokens[t] * p->bits[k];
            d += p->distortion[(size_t)t * N_PREC + (size_t)k];
        }
        if (c <= limit && d < best) best = d;
    }
    return best;
}

/* Gray-code walk: one tag flips per step, cost and distortion updated by running sums. */
static double brute_gray(const bench_instance *in) {
    const kvmix_alloc_problem *p = &in->problem;
    double dc[MAX_BRUTE], dd[MAX_BRUTE], c = 0.0, d = 0.0, total = 0.0, limit, best;
    uint32_t step, state = 0;
    int32_t t;
    for (t = 0; t < p->n_tags; t++) {
        total += (double)p->tokens[t];
        c += (double)p->tokens[t] * p->bits[LOW];
        d += p->distortion[(size_t)t * N_PREC + LOW];
        dc[t] = (double)p->tokens[t] * (p->bits[HIGH] - p->bits[LOW]);
        dd[t] = p->distortion[(size_t)t * N_PREC + HIGH] - p->distortion[(size_t)t * N_PREC + LOW];
    }
    limit = p->budget_bits * total;
    best = c <= limit ? d : HUGE_VAL;
    for (step = 1; step < (1u << p->n_tags); step++) {
        int32_t b = 0;
        while (!((step >> b) & 1u)) b++;
        state ^= 1u << b;
        if ((state >> b) & 1u) {
            c += dc[b];
            d += dd[b];
        } else {
            c -= dc[b];
            d -= dd[b];
        }
        if (c <= limit && d < best) best = d;
    }
    return best;
}

/* ---- timing --------------------------------------------------------------------------------- */

typedef enum bench_op { OP_EXHAUSTIVE, OP_GREEDY, OP_KNAPSACK, OP_NAIVE, OP_GRAY } bench_op;

typedef struct bench_call {
    bench_op op;
    const bench_instance *in;
    int32_t steps;
    void *ws;
    size_t ws_bytes;
    int32_t *choice;
    kvmix_alloc_summary summary;
    double baseline_best;
    int failed;
} bench_call;

static void run_call(bench_call *c) {
    kvmix_result r = KVMIX_SUCCESS;
    switch (c->op) {
    case OP_EXHAUSTIVE:
        r = kvmix_alloc_two_level(&c->in->problem, LOW, HIGH, KVMIX_ALLOC_EXHAUSTIVE, NULL, 0,
                                  c->choice, &c->summary);
        break;
    case OP_GREEDY:
        r = kvmix_alloc_two_level(&c->in->problem, LOW, HIGH, KVMIX_ALLOC_GREEDY, c->ws,
                                  c->ws_bytes, c->choice, &c->summary);
        break;
    case OP_KNAPSACK:
        r = kvmix_alloc_knapsack(&c->in->problem, c->steps, c->ws, c->ws_bytes, c->choice,
                                 &c->summary);
        break;
    case OP_NAIVE: c->baseline_best = brute_naive(c->in); break;
    case OP_GRAY: c->baseline_best = brute_gray(c->in); break;
    }
    if (r != KVMIX_SUCCESS) c->failed = 1;
}

/* CPU seconds per call of the last time_call (median over repetitions): on a shared machine it
   moves less than wall time, so the ratios use it. */
static double last_cpu_per_call;

/* Median wall seconds per call; *busy = CPU time / wall time of the repetitions. */
static double time_call(bench_call *c, const bench_config *cfg, double *busy) {
    double t0, c0, c1, wall = 0.0, cpu = 0.0, per, reps[MAX_REPS], cpus[MAX_REPS];
    long calls, i;
    int r;
    t0 = now_seconds();
    run_call(c); /* warm-up and calibration */
    per = now_seconds() - t0;
    calls = (long)(cfg->ms * 1e-3 / (per > 1e-9 ? per : 1e-9));
    if (calls < 1) calls = 1;
    for (r = 0; r < cfg->reps; r++) {
        t0 = now_seconds();
        c0 = cpu_seconds();
        for (i = 0; i < calls; i++) run_call(c);
        c1 = cpu_seconds();
        reps[r] = now_seconds() - t0;
        cpus[r] = c1 - c0;
        wall += reps[r];
        cpu += cpus[r];
        reps[r] /= (double)calls;
        cpus[r] /= (double)calls;
    }
    *busy = cpu / wall;
    qsort(reps, (size_t)cfg->reps, sizeof reps[0], cmp_double);
    qsort(cpus, (size_t)cfg->reps, sizeof cpus[0], cmp_double);
    last_cpu_per_call = cpus[cfg->reps / 2];
    return reps[cfg->reps / 2];
}

static int parse_arg(const char *arg, bench_config *cfg) {
    const char *eq = strchr(arg, '=');
    double v;
    if (!eq) return 0;
    v = atof(eq + 1);
    if (strncmp(arg, "reps=", 5) == 0)
        cfg->reps = (int32_t)v;
    else if (strncmp(arg, "ms=", 3) == 0)
        cfg->ms = v;
    else if (strncmp(arg, "budget=", 7) == 0)
        cfg->budget = v;
    else
        return 0;
    return 1;
}

/* Bits of a key/value precision pair: the mean of both layouts' effective bits. */
static double pair_bits(kvmix_format key, kvmix_format value, int32_t n_boost) {
    kvmix_layout k, v;
    double kb = 0.0, vb = 0.0;
    memset(&k, 0, sizeof k);
    memset(&v, 0, sizeof v);
    k.format = key;
    v.format = value;
    k.n_tokens = v.n_tokens = 128;
    k.head_dim = v.head_dim = 128;
    k.n_boost = n_boost;
    if (kvmix_layout_bits(&k, &kb) != KVMIX_SUCCESS || kvmix_layout_bits(&v, &vb) != KVMIX_SUCCESS)
        return -1.0;
    return (kb + vb) / 2.0;
}

static double min_busy = 1.0;

static void report(const char *name, int32_t n, const char *detail, double secs, double busy,
                   const char *baseline, double ratio, double distortion, const char *quality) {
    if (busy < min_busy) min_busy = busy;
    printf("%-11s %7d %-14s %12.3f %12.3f %5.0f  %-22s", name, (int)n, detail, secs * 1e6,
           last_cpu_per_call * 1e6, 100.0 * busy, baseline);
    if (ratio > 0.0)
        printf(" %9.2fx", ratio);
    else
        printf(" %10s", "-");
    printf(" %13.6g %s\n", distortion, quality);
}

int main(int argc, char **argv) {
    static const int32_t exhaustive_n[] = {10, 16, 22};
    static const int32_t greedy_n[] = {64, 1000, 100000};
    static const struct {
        int32_t n, steps;
    } knapsack_cfg[] = {{22, 1024},   {64, 1024},   {64, 4096},
                        {1000, 1024}, {1000, 4096}, {1000, 16384}};
    static const char *prec_names[N_PREC] = {"int2_channel+int2", "boosted16+int2", "int4+int4",
                                             "int8+int8", "fp16+fp16"};
    bench_config cfg = {7, 30.0, 3.5};
    double bits[N_PREC], busy, start = now_seconds();
    bench_call call;
    size_t i;
    int a, status = 0;
    char detail[64], quality[96];
    for (a = 1; a < argc; a++)
        if (!parse_arg(argv[a], &cfg)) {
            fprintf(stderr, "usage: %s [reps=N] [ms=X] [budget=BITS]\n", argv[0]);
            return 2;
        }
    if (cfg.reps < 1 || cfg.reps > MAX_REPS || cfg.ms <= 0 || !(cfg.budget > 0)) {
        fprintf(stderr, "bench_alloc: reps must be 1..%d, ms and budget positive\n", MAX_REPS);
        return 2;
    }
    bits[0] = pair_bits(KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2, 0);
    bits[1] = pair_bits(KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, 16);
    bits[2] = pair_bits(KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, 0);
    bits[3] = pair_bits(KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8, 0);
    bits[4] = pair_bits(KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 0);

    printf("bench_alloc: bit allocators, CPU time per call\n");
    printf("  precisions       ");
    for (i = 0; i < N_PREC; i++)
        printf("%s %.5g%s", prec_names[i], bits[i], i + 1 < N_PREC ? ", " : "\n");
    printf("  two-level        %s (low) / %s (high)\n", prec_names[LOW], prec_names[HIGH]);
    printf("  budget           %.4g bits per element (token-weighted mean)\n", cfg.budget);
    printf("  tokens per tag   1 .. 4000; distortion = sensitivity (1 .. 100) * 2^-bits * "
           "(1 + 0.3 u)\n");
    printf("  timing           1 warm-up call, then median of %d repetitions of ~%.0f ms, "
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
    printf("\n%-11s %7s %-14s %12s %12s %5s  %-22s %10s %13s %s\n", "allocator", "n_tags", "detail",
           "us/call", "cpu us/call", "cpu%", "baseline (same run)", "cpu ratio", "distortion",
           "quality");

    /* exhaustive, against brute force from scratch and a Gray-code walk */
    for (i = 0; i < sizeof exhaustive_n / sizeof exhaustive_n[0]; i++) {
        bench_instance in;
        int32_t *choice = (int32_t *)malloc(sizeof(int32_t) * (size_t)exhaustive_n[i]);
        double t_ex, c_ex, b2;
        if (!choice || !make_instance(&in, exhaustive_n[i], bits, cfg.budget)) return 1;
        memset(&call, 0, sizeof call);
        call.in = &in;
        call.choice = choice;
        call.op = OP_EXHAUSTIVE;
        t_ex = time_call(&call, &cfg, &busy);
        c_ex = last_cpu_per_call;
        {
            /* how far greedy is from the optimum on the same instance */
            size_t g_bytes = (size_t)in.n * 64;
            void *g_ws = malloc(g_bytes);
            kvmix_alloc_summary g;
            snprintf(quality, sizeof quality, "optimal");
            if (g_ws && kvmix_alloc_two_level(&in.problem, LOW, HIGH, KVMIX_ALLOC_GREEDY, g_ws,
                                              g_bytes, choice, &g) == KVMIX_SUCCESS)
                snprintf(quality, sizeof quality, "optimal; greedy reaches %.6f x it",
                         g.distortion / call.summary.distortion);
            free(g_ws);
        }
        report("exhaustive", in.n, "2 precisions", t_ex, busy, "-", 0.0, call.summary.distortion,
               call.failed ? "FAILED" : quality);
        status |= call.failed;
        call.op = OP_NAIVE;
        t_ex = time_call(&call, &cfg, &busy);
        report("  baseline", in.n, "from scratch", t_ex, busy, "baseline / exhaustive",
               last_cpu_per_call / c_ex, call.baseline_best,
               fabs(call.baseline_best - call.summary.distortion) <= 1e-12 * call.summary.distortion
                   ? "same optimum"
                   : "DIFFERENT optimum");
        b2 = call.baseline_best;
        call.op = OP_GRAY;
        t_ex = time_call(&call, &cfg, &busy);
        report("  baseline", in.n, "Gray code", t_ex, busy, "baseline / exhaustive",
               last_cpu_per_call / c_ex, call.baseline_best,
               fabs(call.baseline_best - b2) <= 1e-9 * b2 ? "same optimum" : "DIFFERENT optimum");
        free(choice);
        free(in.tokens);
        free(in.distortion);
    }

    /* greedy; quality against the two-level knapsack optimum (steps 2^16) at n <= 1000 */
    for (i = 0; i < sizeof greedy_n / sizeof greedy_n[0]; i++) {
        bench_instance in;
        size_t ws_bytes = 0, dp_bytes = 0;
        int32_t *choice = (int32_t *)malloc(sizeof(int32_t) * (size_t)greedy_n[i]);
        double t_g, greedy_d;
        if (!choice || !make_instance(&in, greedy_n[i], bits, cfg.budget) ||
            kvmix_alloc_two_level_workspace_bytes(in.n, KVMIX_ALLOC_GREEDY, &ws_bytes) !=
                KVMIX_SUCCESS)
            return 1;
        memset(&call, 0, sizeof call);
        call.in = &in;
        call.choice = choice;
        call.ws = malloc(ws_bytes);
        call.ws_bytes = ws_bytes;
        call.op = OP_GREEDY;
        t_g = time_call(&call, &cfg, &busy);
        greedy_d = call.summary.distortion;
        status |= call.failed;
        snprintf(quality, sizeof quality, "%s", call.failed ? "FAILED" : "-");
        if (in.n <= 1000) {
            /* the two-level optimum: the knapsack over {low, high} only, on a fine grid */
            bench_instance two = in;
            double two_bits[2];
            double *two_d = (double *)malloc(sizeof(double) * 2 * (size_t)in.n);
            int32_t t, steps = 65536;
            kvmix_alloc_summary s;
            void *dp;
            two_bits[0] = bits[LOW];
            two_bits[1] = bits[HIGH];
            for (t = 0; t < in.n; t++) {
                two_d[2 * t] = in.distortion[(size_t)t * N_PREC + LOW];
                two_d[2 * t + 1] = in.distortion[(size_t)t * N_PREC + HIGH];
            }
            two.problem.n_precisions = 2;
            two.problem.bits = two_bits;
            two.problem.distortion = two_d;
            if (kvmix_alloc_knapsack_workspace_bytes(&two.problem, steps, &dp_bytes) ==
                    KVMIX_SUCCESS &&
                (dp = malloc(dp_bytes)) != NULL) {
                if (kvmix_alloc_knapsack(&two.problem, steps, dp, dp_bytes, choice, &s) ==
                    KVMIX_SUCCESS)
                    snprintf(quality, sizeof quality, "%.6f x two-level DP (65536 steps)",
                             greedy_d / s.distortion);
                free(dp);
            }
            free(two_d);
        }
        report("greedy", in.n, "2 precisions", t_g, busy, "-", 0.0, greedy_d, quality);
        free(call.ws);
        free(choice);
        free(in.tokens);
        free(in.distortion);
    }

    /* knapsack over all five precisions; quality against the two-level greedy at that budget */
    for (i = 0; i < sizeof knapsack_cfg / sizeof knapsack_cfg[0]; i++) {
        bench_instance in;
        size_t ws_bytes = 0, g_bytes = 0;
        int32_t *choice = (int32_t *)malloc(sizeof(int32_t) * (size_t)knapsack_cfg[i].n);
        kvmix_alloc_summary g;
        void *g_ws;
        double t_k;
        if (!choice || !make_instance(&in, knapsack_cfg[i].n, bits, cfg.budget) ||
            kvmix_alloc_knapsack_workspace_bytes(&in.problem, knapsack_cfg[i].steps, &ws_bytes) !=
                KVMIX_SUCCESS ||
            kvmix_alloc_two_level_workspace_bytes(in.n, KVMIX_ALLOC_AUTO, &g_bytes) !=
                KVMIX_SUCCESS)
            return 1;
        memset(&call, 0, sizeof call);
        call.in = &in;
        call.choice = choice;
        call.steps = knapsack_cfg[i].steps;
        call.ws = malloc(ws_bytes);
        call.ws_bytes = ws_bytes;
        call.op = OP_KNAPSACK;
        t_k = time_call(&call, &cfg, &busy);
        status |= call.failed;
        g_ws = malloc(g_bytes + 8);
        if (kvmix_alloc_two_level(&in.problem, LOW, HIGH, KVMIX_ALLOC_AUTO, g_ws, g_bytes, choice,
                                  &g) == KVMIX_SUCCESS)
            snprintf(quality, sizeof quality, "%.4f x two-level %s, %.4g bits",
                     call.summary.distortion / g.distortion,
                     g.method == KVMIX_ALLOC_EXHAUSTIVE ? "optimum" : "greedy", call.summary.bits);
        else
            snprintf(quality, sizeof quality, "two-level failed");
        snprintf(detail, sizeof detail, "5 prec, %d st", (int)knapsack_cfg[i].steps);
        report("knapsack", in.n, detail, t_k, busy, "-", 0.0, call.summary.distortion,
               call.failed ? "FAILED" : quality);
        free(g_ws);
        free(call.ws);
        free(choice);
        free(in.tokens);
        free(in.distortion);
    }
    printf("\ncpu ratio = baseline CPU time / exhaustive CPU time on the same instance; the "
           "baselines' "
           "quality says whether they found the same least distortion\n");
    if (min_busy < 0.9)
        printf("warning: cpu%% fell to %.0f%%: other processes shared the CPU, so figures are "
               "high\n",
               100.0 * min_busy);
    printf("%.1f s in all\n", now_seconds() - start);
    return status;
}
