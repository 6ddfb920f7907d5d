/* unit_fast_decode: kvmix_view_decode (the fast CPU decode) against kvmix_ref_view_decode, the
   spec, over views built here: sequences of up to 60 spans (so several chunks of
   KVMIX_DECODE_CHUNK_SPANS are merged), every key and value format mixed span by span, padded
   head strides, dead tokens (whole spans of them too), empty sequences, head_dim 8 to 256,
   channel groups of 8 to 64 and query groups of 1 to 5. The fast path sums in another order, so the bound is NMSE < 1e-10 per
   output row (float rounding over a few thousand tokens) and 1e-5 relative for lse; the thread
   count must not change a bit. Bad arguments write nothing. kvmix_cache_decode is checked
   against the reference inside unit_cache's random runs. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FD_MAX_SPANS 120
#define FD_MAX_SEQS  3
#define FD_MAX_DEAD  (FD_MAX_SPANS * 40)

typedef struct fd_view {
    kvmix_view view;
    kvmix_view_span spans[FD_MAX_SPANS];
    int32_t first[FD_MAX_SEQS + 1];
    uint8_t dead[FD_MAX_DEAD];
    uint8_t *base;
    size_t base_bytes;
} fd_view;

static const kvmix_format FD_KEYS[] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                       KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
                                       KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
static const kvmix_format FD_VALUES[] = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4,
                                         KVMIX_FORMAT_INT2};

static kvmix_layout fd_layout(const kvmix_view *v, kvmix_format format, int is_value,
                              int32_t n_tokens) {
    kvmix_layout l;
    int32_t group = is_value && v->value_group_size ? v->value_group_size : v->group_size;
    memset(&l, 0, sizeof l);
    l.format = format;
    l.n_tokens = n_tokens;
    l.head_dim = v->head_dim;
    l.group_size =
        format == KVMIX_FORMAT_INT8 || format == KVMIX_FORMAT_INT4 || format == KVMIX_FORMAT_INT2
            ? group
            : 0;
    l.n_boost = format == KVMIX_FORMAT_BOOSTED ? v->n_boost : 0;
    return l;
}

/* Random rows of every kv head quantized into base at *used; returns the block offset. */
static uint64_t fd_blocks(test_rng *rng, fd_view *fv, kvmix_format format, int is_value,
                          int32_t n_tokens, size_t *used, uint32_t *head_bytes) {
    kvmix_layout l = fd_layout(&fv->view, format, is_value, n_tokens);
    size_t block = 0, pad = (size_t)test_rng_range(rng, 0, 1) * 24;
    uint64_t offset = *used;
    float *rows = (float *)test_alloc((size_t)n_tokens * fv->view.head_dim * sizeof(float));
    int32_t h, i;
    CHECK_RESULT(kvmix_layout_bytes(&l, &block), KVMIX_SUCCESS);
    for (h = 0; h < fv->view.n_kv_heads; h++) {
        for (i = 0; i < n_tokens * fv->view.head_dim; i++)
            rows[i] = (float)(test_rng_normal(rng) * (i % 11 == 0 ? 5.0 : 1.0));
        CHECK_RESULT(kvmix_ref_quantize(&l, rows, 0, fv->base + *used, fv->base_bytes - *used),
                     KVMIX_SUCCESS);
        *used += block + pad;
    }
    free(rows);
    *head_bytes = (uint32_t)(block + pad);
    return offset;
}

static void fd_span(test_rng *rng, fd_view *fv, size_t *used) {
    kvmix_view_span *vs = &fv->spans[fv->view.n_spans++];
    int32_t n_tokens = test_rng_range(rng, 1, 40), t, dead_kind = test_rng_range(rng, 0, 5);
    memset(vs, 0, sizeof *vs);
    vs->n_tokens = n_tokens;
    vs->key_format = (uint8_t)FD_KEYS[test_rng_range(rng, 0, 5)];
    vs->value_format = (uint8_t)FD_VALUES[test_rng_range(rng, 0, 3)];
    vs->key_offset =
        fd_blocks(rng, fv, (kvmix_format)vs->key_format, 0, n_tokens, used, &vs->key_head_bytes);
    vs->value_offset = fd_blocks(rng, fv, (kvmix_format)vs->value_format, 1, n_tokens, used,
                                 &vs->value_head_bytes);
    vs->dead_index = -1;
    if (dead_kind >= 4) { /* some dead, or (5) all dead */
        vs->dead_index = fv->view.n_dead_flags;
        for (t = 0; t < n_tokens; t++)
            fv->dead[fv->view.n_dead_flags++] = dead_kind == 5 || test_rng_range(rng, 0, 2) == 0;
    }
}

/* A random view: n_seqs sequences of 0 .. max_spans spans. */
static void fd_build(test_rng *rng, fd_view *fv, int32_t n_seqs, int32_t n_kv, int32_t dim,
                     int32_t max_spans) {
    static const int32_t GROUPS[] = {8, 16, 32, 48, 64};
    size_t used = 0;
    int32_t s, i;
    memset(&fv->view, 0, sizeof fv->view);
    fv->view.n_seqs = n_seqs;
    fv->view.n_kv_heads = n_kv;
    fv->view.head_dim = dim;
    do fv->view.group_size = GROUPS[test_rng_range(rng, 0, 4)];
    while (dim % fv->view.group_size != 0);
    do fv->view.value_group_size = GROUPS[test_rng_range(rng, 0, 4)];
    while (dim % fv->view.value_group_size != 0);
    fv->view.n_boost = (dim / 4 < 252 ? dim / 4 : 252) / 4 * 4;
    fv->view.base = fv->base;
    fv->view.base_bytes = fv->base_bytes;
    fv->view.spans = fv->spans;
    fv->view.seq_first_span = fv->first;
    fv->view.dead = fv->dead;
    fv->first[0] = 0;
    for (s = 0; s < n_seqs; s++) {
        int32_t n_spans = test_rng_range(rng, 0, max_spans);
        for (i = 0; i < n_spans && fv->view.n_spans < FD_MAX_SPANS; i++) fd_span(rng, fv, &used);
        fv->first[s + 1] = fv->view.n_spans;
    }
}

static double fd_nmse(const float *got, const float *want, int32_t n) {
    double err = 0.0, ref = 0.0;
    int32_t i;
    for (i = 0; i < n; i++) {
        err += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
        ref += (double)want[i] * want[i];
    }
    return ref > 0.0 ? err / ref : err;
}

/* A caller's parallel_for: the tasks in reverse order on the calling thread. */
static void fd_reverse_for(void *user, int32_t n_tasks, kvmix_task_fn task, void *task_arg) {
    int32_t i;
    ++*(int32_t *)user;
    for (i = n_tasks - 1; i >= 0; i--) task(task_arg, i);
}

static void *fd_workspace(const kvmix_view *v, int32_t nq, size_t *bytes) {
    CHECK_RESULT(kvmix_view_decode_workspace(v, nq, bytes), KVMIX_SUCCESS);
    return test_alloc(*bytes + 8);
}

/* The fast decode of the view against the reference, on one thread, three of the library's
   and a caller's parallel_for: the reference's numbers within float rounding, the same bits
   whatever ran it. */
static void fd_check_view(test_rng *rng, const fd_view *fv, int32_t nq) {
    const kvmix_view *v = &fv->view;
    size_t rows = (size_t)v->n_seqs * nq, n = rows * v->head_dim, ws_bytes = 0, i;
    float *q = (float *)test_alloc(n * sizeof(float) + 4);
    float *want = (float *)test_alloc(n * sizeof(float) + 4);
    float *got = (float *)test_alloc(n * sizeof(float) + 4);
    float *again = (float *)test_alloc(n * sizeof(float) + 4);
    float *want_lse = (float *)test_alloc(rows * sizeof(float) + 4);
    float *lse = (float *)test_alloc(rows * sizeof(float) + 4);
    float *again_lse = (float *)test_alloc(rows * sizeof(float) + 4);
    void *ws = fd_workspace(v, nq, &ws_bytes);
    kvmix_parallel own, caller;
    int32_t calls = 0, r;
    for (i = 0; i < n; i++) q[i] = (float)test_rng_normal(rng);
    CHECK_RESULT(kvmix_ref_view_decode(v, nq, 0.0f, q, want, want_lse), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, got, lse, ws, ws_bytes, NULL), KVMIX_SUCCESS);
    for (r = 0; r < (int32_t)rows; r++) {
        double e =
            fd_nmse(got + (size_t)r * v->head_dim, want + (size_t)r * v->head_dim, v->head_dim);
        CHECK_MSG(e < 1e-10, "row %d: NMSE %.3g against the reference", (int)r, e);
        if (isinf(want_lse[r]))
            CHECK(isinf(lse[r]) && lse[r] < 0);
        else
            CHECK_NEAR(lse[r], want_lse[r], 1e-5 * (1.0 + fabs(want_lse[r])));
    }
    memset(&own, 0, sizeof own);
    own.n_threads = 3;
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, again, again_lse, ws, ws_bytes, &own),
                 KVMIX_SUCCESS);
    CHECK_MEM_EQ(again, got, n * sizeof(float));
    CHECK_MEM_EQ(again_lse, lse, rows * sizeof(float));
    memset(&caller, 0, sizeof caller);
    caller.n_threads = 2; /* ignored: parallel_for runs the tasks */
    caller.parallel_for = fd_reverse_for;
    caller.user = &calls;
    test_poison(again, n * sizeof(float), 3);
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, again, NULL, ws, ws_bytes, &caller),
                 KVMIX_SUCCESS);
    CHECK_EQ_INT(calls, 1);
    CHECK_MEM_EQ(again, got, n * sizeof(float));
    free(q);
    free(want);
    free(got);
    free(again);
    free(want_lse);
    free(lse);
    free(again_lse);
    free(ws);
}

/* Bad arguments: a clear result and out untouched. */
static void fd_check_bad(test_rng *rng, fd_view *fv) {
    kvmix_view *v = &fv->view;
    int32_t nq = 2 * v->n_kv_heads;
    size_t n = (size_t)v->n_seqs * nq * v->head_dim, ws_bytes = 0;
    float *q = (float *)test_alloc(n * sizeof(float) + 4), *out;
    uint8_t *ws = (uint8_t *)fd_workspace(v, nq, &ws_bytes);
    kvmix_parallel bad;
    size_t i;
    out = (float *)test_alloc(n * sizeof(float) + 4);
    for (i = 0; i < n; i++) q[i] = (float)test_rng_normal(rng);
    test_poison(out, n * sizeof(float), 9);
    memset(&bad, 0, sizeof bad);
    bad.n_threads = -1;
    CHECK_RESULT(kvmix_view_decode(NULL, nq, 0.0f, q, out, NULL, ws, ws_bytes, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, NULL, out, NULL, ws, ws_bytes, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, out, NULL, NULL, ws_bytes, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_view_decode(v, nq + 1, 0.0f, q, out, NULL, ws, ws_bytes, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_view_decode(v, nq, -1.0f, q, out, NULL, ws, ws_bytes, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_view_decode(v, nq, (float)INFINITY, q, out, NULL, ws, ws_bytes, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, out, NULL, ws + 4, ws_bytes, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, out, NULL, ws, ws_bytes, &bad),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, out, NULL, ws, ws_bytes - 1, NULL),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    fv->spans[0].key_offset = v->base_bytes; /* a block past the base region */
    CHECK_RESULT(kvmix_view_decode(v, nq, 0.0f, q, out, NULL, ws, ws_bytes, NULL),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK(test_is_poisoned(out, n * sizeof(float), 9));
    CHECK_RESULT(kvmix_view_decode_workspace(v, nq, NULL), KVMIX_ERR_NULL_POINTER);
    free(q);
    free(out);
    free(ws);
}

/* Every finite FP16 value through the fast path's own conversion: one-token sequences whose value
   rows hold all 63,488 finite halves (a one-token softmax weighs its row by exactly 1), against
   kvmix_fp16_to_fp32, bit for bit. */
static void fd_check_every_half(void) {
    enum { DIM = 256, SEQS = 256 };
    kvmix_view_span *spans = (kvmix_view_span *)test_alloc(SEQS * sizeof(kvmix_view_span));
    int32_t *first = (int32_t *)test_alloc((SEQS + 1) * sizeof(int32_t));
    uint8_t *base = (uint8_t *)test_alloc((size_t)SEQS * DIM * 2 * 2);
    float *q = (float *)test_alloc((size_t)SEQS * DIM * sizeof(float));
    float *out = (float *)test_alloc((size_t)SEQS * DIM * sizeof(float));
    kvmix_view v;
    size_t ws_bytes = 0;
    void *ws;
    int32_t s, c, n_equal = 0, n_finite = 0;
    memset(&v, 0, sizeof v);
    for (s = 0; s < SEQS; s++) {
        uint8_t *key = base + (size_t)s * DIM * 4, *value = key + DIM * 2;
        for (c = 0; c < DIM; c++) {
            uint16_t h = (uint16_t)(s * DIM + c);
            key[2 * c] = 0;
            key[2 * c + 1] = 0;
            value[2 * c] = (uint8_t)(h & 0xff);
            value[2 * c + 1] = (uint8_t)(h >> 8);
        }
        memset(&spans[s], 0, sizeof spans[s]);
        spans[s].key_offset = (uint64_t)((size_t)s * DIM * 4);
        spans[s].value_offset = spans[s].key_offset + DIM * 2;
        spans[s].key_head_bytes = DIM * 2;
        spans[s].value_head_bytes = DIM * 2;
        spans[s].n_tokens = 1;
        spans[s].dead_index = -1;
        spans[s].key_format = KVMIX_FORMAT_FP16;
        spans[s].value_format = KVMIX_FORMAT_FP16;
        first[s] = s;
    }
    first[SEQS] = SEQS;
    v.n_seqs = SEQS;
    v.n_kv_heads = 1;
    v.head_dim = DIM;
    v.n_spans = SEQS;
    v.base = base;
    v.base_bytes = (size_t)SEQS * DIM * 4;
    v.spans = spans;
    v.seq_first_span = first;
    memset(q, 0, (size_t)SEQS * DIM * sizeof(float));
    ws = fd_workspace(&v, 1, &ws_bytes);
    CHECK_RESULT(kvmix_view_decode(&v, 1, 0.0f, q, out, NULL, ws, ws_bytes, NULL), KVMIX_SUCCESS);
    for (s = 0; s < SEQS; s++) {
        for (c = 0; c < DIM; c++) {
            uint16_t h = (uint16_t)(s * DIM + c);
            if ((h & 0x7c00u) == 0x7c00u)
                continue; /* infinities and NaNs: seals never write them */
            n_finite++;
            /* -0 comes out +0: the sum it joins starts at +0 */
            n_equal += test_float_bits(out[(size_t)s * DIM + c]) ==
                           test_float_bits(kvmix_fp16_to_fp32(h)) ||
                       (h == 0x8000u && out[(size_t)s * DIM + c] == 0.0f);
        }
    }
    CHECK_EQ_INT(n_finite, 63488);
    CHECK_EQ_INT(n_equal, n_finite);
    free(spans);
    free(first);
    free(base);
    free(q);
    free(out);
    free(ws);
}

/* A plain x86-64 build of GCC or Clang, which takes the AVX2 loops where the CPU has them. */
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) &&                               \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 5)) && defined(__x86_64__) &&         \
    !defined(_MSC_VER) && !defined(__CUDACC__) && !defined(KVMIX_NO_CPU_DISPATCH)
#define FD_DISPATCHING 1
#endif

#ifdef FD_DISPATCHING
/* Whether /proc/cpuinfo's first flags line has every flag of `flags` (space-separated); -1 where
   there is no such file. */
static int fd_cpu_has(const char *flags) {
    char line[8192], want[64];
    int found = 0, n = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return -1;
    while (!found && fgets(line, sizeof line - 1, f)) found = strncmp(line, "flags", 5) == 0;
    fclose(f);
    if (!found) return -1;
    line[strcspn(line, "\n")] = '\0';
    strcat(line, " "); /* every flag between spaces */
    while (sscanf(flags, "%63s%n", want, &n) == 1) {
        char padded[80];
        snprintf(padded, sizeof padded, " %s ", want);
        if (!strstr(line, padded)) return 0;
        flags += n;
    }
    return 1;
}
#endif

/* The loops this build names are the ones its flags and this CPU allow. */
static void fd_check_loops_named(void) {
    const char *loops = kvmix_cpu_decode_loops();
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    CHECK(strcmp(loops, "avx512") == 0);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    CHECK(strcmp(loops, "avx2") == 0);
#elif defined(FD_DISPATCHING)
    int has = fd_cpu_has("avx2 fma f16c");
    CHECK(has < 0 || strcmp(loops, has ? "avx2" : "portable") == 0);
#else
    CHECK(strcmp(loops, "portable") == 0);
#endif
}

void unit_fast_decode(void) {
    static const int32_t DIMS[] = {8, 48, 64, 80, 96, 128, 256};
    test_rng rng;
    fd_view fv;
    int32_t round;
    test_rng_init(&rng, "unit_fast_decode");
    fv.base_bytes = 24u << 20;
    fv.base = (uint8_t *)test_alloc(fv.base_bytes);
    for (round = 0; round < 42; round++) {
        int32_t dim = DIMS[round % 7], n_kv = test_rng_range(&rng, 1, 3);
        int32_t group = test_rng_range(&rng, 1, 5), max_spans = dim >= 128 ? 30 : 60;
        test_context("fast decode round %d: head_dim %d, %d kv heads, group %d", (int)round,
                     (int)dim, (int)n_kv, (int)group);
        fd_build(&rng, &fv, test_rng_range(&rng, 0, FD_MAX_SEQS), n_kv, dim, max_spans);
        CHECK_RESULT(kvmix_view_check(&fv.view, NULL), KVMIX_SUCCESS);
        fd_check_view(&rng, &fv, n_kv * group);
    }
    test_context("fast decode: bad arguments");
    do fd_build(&rng, &fv, 2, 2, 64, 20);
    while (fv.view.n_spans == 0);
    fd_check_bad(&rng, &fv);
    test_context("fast decode: every FP16 value");
    fd_check_every_half();
    test_context("fast decode: the loops named");
    fd_check_loops_named();
    test_context(NULL);
    free(fv.base);
}
