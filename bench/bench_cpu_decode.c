/* bench_cpu_decode - the fast CPU decode (kvmix_view_decode) against the reference
   (kvmix_ref_view_decode) and the machine's memory bandwidth, in one process.

   Shape: one layer of 8 kv heads x 128 channels read by 32 query heads (Llama-3-8B's), one
   sequence of 4K or 32K tokens in pages of 32 tokens, as a cache's view lays them out: per page
   a key block and a value block per kv head. Mixes: fp16; int4; kivi2 (INT2 per-channel keys,
   INT2 values); int2/int4 75/25 (every fourth page INT4/INT4, the rest as kivi2).

   Printed per mix and context: the view's bytes, the reference's time, the fast decode's time
   on one thread and on every CPU (the library's own threads), the bandwidth each achieves over
   the view's bytes, and its share of memcpy bandwidth measured in the same run: one thread
   copying 256 MiB, and every CPU copying its own 256 MiB at once.

       bench_cpu_decode [--threads N] [--repeat R] [--reference-repeat R]

   Times are medians of R runs (R = 9; the reference 3, at 4K only unless asked). */
#define _POSIX_C_SOURCE 199309L
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include "bench_common.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#define N_KV     8
#define HEAD_DIM 128
#define N_Q      32
#define PAGE     32
#define COPY_MIB 256

typedef struct bench_mix {
    const char *name;
    kvmix_format key[4], value[4]; /* page i takes entry i % 4 */
} bench_mix;

static const bench_mix MIXES[] = {
    {"fp16",
     {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16},
     {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16}},
    {"int4",
     {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4},
     {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4}},
    {"kivi2",
     {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2_CHANNEL,
      KVMIX_FORMAT_INT2_CHANNEL},
     {KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2}},
    {"int2/int4 75/25",
     {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2_CHANNEL,
      KVMIX_FORMAT_INT4},
     {KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT4}},
};

typedef struct bench_view {
    kvmix_view view;
    kvmix_view_span *spans;
    int32_t first[2];
    uint8_t *base;
} bench_view;

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "bench_cpu_decode: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static size_t block_bytes(kvmix_format format) {
    kvmix_layout l;
    size_t bytes = 0;
    memset(&l, 0, sizeof l);
    l.format = format;
    l.n_tokens = PAGE;
    l.head_dim = HEAD_DIM;
    kvmix_layout_bytes(&l, &bytes);
    return bytes;
}

/* Quantizes random rows into every head's block of one operand of a page at base + *used. */
static uint64_t put_operand(kvmix_format format, uint8_t *base, size_t *used, float *rows,
                            uint32_t *head_bytes) {
    kvmix_layout l;
    size_t bytes = block_bytes(format);
    uint64_t offset = *used;
    int32_t h, i;
    memset(&l, 0, sizeof l);
    l.format = format;
    l.n_tokens = PAGE;
    l.head_dim = HEAD_DIM;
    for (h = 0; h < N_KV; h++) {
        for (i = 0; i < PAGE * HEAD_DIM; i++) rows[i] = (float)(rand() % 2001 - 1000) / 400.0f;
        if (kvmix_ref_quantize(&l, rows, 0, base + *used, bytes) != KVMIX_SUCCESS) {
            fprintf(stderr, "bench_cpu_decode: quantize failed\n");
            exit(1);
        }
        *used += bytes;
    }
    *head_bytes = (uint32_t)bytes;
    return offset;
}

static void build_view(bench_view *bv, const bench_mix *mix, int32_t n_tokens) {
    int32_t n_pages = n_tokens / PAGE, i;
    size_t total = 0, used = 0;
    float rows[PAGE * HEAD_DIM];
    for (i = 0; i < n_pages; i++)
        total += N_KV * (block_bytes(mix->key[i % 4]) + block_bytes(mix->value[i % 4]));
    memset(&bv->view, 0, sizeof bv->view);
    bv->base = (uint8_t *)xmalloc(total);
    bv->spans = (kvmix_view_span *)xmalloc((size_t)n_pages * sizeof(kvmix_view_span));
    for (i = 0; i < n_pages; i++) {
        kvmix_view_span *vs = &bv->spans[i];
        memset(vs, 0, sizeof *vs);
        vs->n_tokens = PAGE;
        vs->dead_index = -1;
        vs->key_format = (uint8_t)mix->key[i % 4];
        vs->value_format = (uint8_t)mix->value[i % 4];
        vs->key_offset = put_operand(mix->key[i % 4], bv->base, &used, rows, &vs->key_head_bytes);
        vs->value_offset =
            put_operand(mix->value[i % 4], bv->base, &used, rows, &vs->value_head_bytes);
    }
    bv->first[0] = 0;
    bv->first[1] = n_pages;
    bv->view.n_seqs = 1;
    bv->view.n_kv_heads = N_KV;
    bv->view.head_dim = HEAD_DIM;
    bv->view.n_spans = n_pages;
    bv->view.base = bv->base;
    bv->view.base_bytes = total;
    bv->view.spans = bv->spans;
    bv->view.seq_first_span = bv->first;
}

/* ---- memcpy bandwidth ---- */

typedef struct copy_job {
    uint8_t *src, *dst;
    size_t bytes;
    double seconds;
} copy_job;

static void *copy_run(void *arg) {
    copy_job *job = (copy_job *)arg;
    double t0 = now_seconds();
    memcpy(job->dst, job->src, job->bytes);
    job->seconds = now_seconds() - t0;
    return NULL;
}

/* Bytes read per second by n threads each copying its own buffer (best of 5). A copy reads and
   writes, so it is given as what a decode does: bytes read. */
static double copy_bandwidth(int32_t n) {
    copy_job *jobs = (copy_job *)xmalloc((size_t)n * sizeof(copy_job));
    pthread_t *threads = (pthread_t *)xmalloc((size_t)n * sizeof(pthread_t));
    double best = 0.0;
    int32_t i, round;
    for (i = 0; i < n; i++) {
        jobs[i].bytes = (size_t)COPY_MIB << 20;
        jobs[i].src = (uint8_t *)xmalloc(jobs[i].bytes);
        jobs[i].dst = (uint8_t *)xmalloc(jobs[i].bytes);
        memset(jobs[i].src, i + 1, jobs[i].bytes);
        memset(jobs[i].dst, 0, jobs[i].bytes);
    }
    for (round = 0; round < 5; round++) {
        double t0 = now_seconds(), seconds;
        for (i = 0; i < n; i++) pthread_create(&threads[i], NULL, copy_run, &jobs[i]);
        for (i = 0; i < n; i++) pthread_join(threads[i], NULL);
        seconds = now_seconds() - t0;
        if ((double)n * jobs[0].bytes / seconds > best) best = (double)n * jobs[0].bytes / seconds;
    }
    for (i = 0; i < n; i++) {
        free(jobs[i].src);
        free(jobs[i].dst);
    }
    free(jobs);
    free(threads);
    return best;
}

/* ---- decode timing ---- */

typedef struct decode_run {
    const kvmix_view *view;
    const float *q;
    float *out, *lse;
    void *ws;
    size_t ws_bytes;
} decode_run;

static double median_seconds(const decode_run *r, int reference, const kvmix_parallel *parallel,
                             int32_t repeat) {
    double *t = (double *)xmalloc((size_t)repeat * sizeof(double)), m;
    int32_t i;
    for (i = 0; i < repeat; i++) {
        double t0 = now_seconds();
        kvmix_result res = reference
                               ? kvmix_ref_view_decode(r->view, N_Q, 0.0f, r->q, r->out, r->lse)
                               : kvmix_view_decode(r->view, N_Q, 0.0f, r->q, r->out, r->lse, r->ws,
                                                   r->ws_bytes, parallel);
        t[i] = now_seconds() - t0;
        if (res != KVMIX_SUCCESS) {
            fprintf(stderr, "bench_cpu_decode: decode failed: %s\n", kvmix_result_string(res));
            exit(1);
        }
    }
    qsort(t, (size_t)repeat, sizeof(double), cmp_double);
    m = t[repeat / 2];
    free(t);
    return m;
}

static double max_abs_difference(const float *a, const float *b, size_t n) {
    double worst = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        double d = a[i] > b[i] ? (double)a[i] - b[i] : (double)b[i] - a[i];
        if (d > worst) worst = d;
    }
    return worst;
}

int main(int argc, char **argv) {
    static const int32_t CONTEXTS[] = {4096, 32768};
    int32_t threads = (int32_t)sysconf(_SC_NPROCESSORS_ONLN), repeat = 9, ref_repeat = 3;
    int32_t ref_at_32k = 0, c, m, i;
    double copy1, copy_all, fp16_one[2] = {0, 0};
    float q[N_Q * HEAD_DIM];
    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--repeat") == 0 && i + 1 < argc)
            repeat = atoi(argv[++i]);
        else if (strcmp(argv[i], "--reference-repeat") == 0 && i + 1 < argc) {
            ref_repeat = atoi(argv[++i]);
            ref_at_32k = 1;
        } else {
            fprintf(stderr, "usage: bench_cpu_decode [--threads N] [--repeat R] "
                            "[--reference-repeat R]\n");
            return 2;
        }
    }
    if (threads < 1 || repeat < 1 || ref_repeat < 1) return 2;
    for (i = 0; i < N_Q * HEAD_DIM; i++) q[i] = (float)(rand() % 2001 - 1000) / 1000.0f;
    printf("bench_cpu_decode: fast CPU decode (kvmix_view_decode) against the reference\n");
    print_cpu();
    printf("  compiler flags   %s\n", KVMIX_BENCH_CFLAGS);
    printf("  shape            1 layer, %d kv heads x %d channels, %d query heads, pages of %d"
           " tokens, one sequence\n",
           N_KV, HEAD_DIM, N_Q, PAGE);
    copy1 = copy_bandwidth(1);
    copy_all = copy_bandwidth(threads);
    printf("  memcpy           1 thread %.2f GB/s read; %d threads %.2f GB/s read (%d MiB each)\n",
           copy1 / 1e9, threads, copy_all / 1e9, COPY_MIB);
    printf("\n| mix | tokens | MB read | reference ms | fast 1 thread ms | GB/s | of memcpy |"
           " x reference | fast %d threads ms | GB/s | of memcpy | x fp16 (1 thread) |\n",
           threads);
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (c = 0; c < 2; c++)
        for (m = 0; m < (int32_t)(sizeof MIXES / sizeof MIXES[0]); m++) {
            bench_view bv;
            decode_run r;
            kvmix_parallel all;
            float *ref_out = (float *)xmalloc(sizeof q), *ref_lse = (float *)xmalloc(N_Q * 4);
            double t_ref = 0.0, t_one, t_all, bytes, diff;
            build_view(&bv, &MIXES[m], CONTEXTS[c]);
            r.view = &bv.view;
            r.q = q;
            r.out = (float *)xmalloc(sizeof q);
            r.lse = (float *)xmalloc(N_Q * sizeof(float));
            if (kvmix_view_decode_workspace(&bv.view, N_Q, &r.ws_bytes) != KVMIX_SUCCESS) return 1;
            r.ws = xmalloc(r.ws_bytes);
            memset(&all, 0, sizeof all);
            all.n_threads = threads;
            bytes = (double)bv.view.base_bytes;
            if (c == 0 || ref_at_32k)
                t_ref = median_seconds(&r, 1, NULL, ref_repeat);
            else
                median_seconds(&r, 1, NULL, 1); /* its output, for the agreement check */
            memcpy(ref_out, r.out, sizeof q);
            memcpy(ref_lse, r.lse, N_Q * sizeof(float));
            t_one = median_seconds(&r, 0, NULL, repeat);
            diff = max_abs_difference(r.out, ref_out, N_Q * HEAD_DIM);
            t_all = median_seconds(&r, 0, &all, repeat);
            if (m == 0) fp16_one[c] = t_one;
            printf("| %s | %d | %.1f | ", MIXES[m].name, CONTEXTS[c], bytes / 1e6);
            if (t_ref > 0.0)
                printf("%.2f | ", t_ref * 1e3);
            else
                printf("- | ");
            printf("%.2f | %.2f | %.0f%% | ", t_one * 1e3, bytes / t_one / 1e9,
                   100.0 * bytes / t_one / copy1);
            if (t_ref > 0.0)
                printf("%.1f | ", t_ref / t_one);
            else
                printf("- | ");
            printf("%.2f | %.2f | %.0f%% | %.2f |\n", t_all * 1e3, bytes / t_all / 1e9,
                   100.0 * bytes / t_all / copy_all, fp16_one[c] / t_one);
            if (diff > 1e-4) {
                fprintf(stderr, "bench_cpu_decode: %s at %d differs from the reference by %.3g\n",
                        MIXES[m].name, CONTEXTS[c], diff);
                return 1;
            }
            free(ref_out);
            free(ref_lse);
            free(r.out);
            free(r.lse);
            free(r.ws);
            free(bv.base);
            free(bv.spans);
        }
    return 0;
}
