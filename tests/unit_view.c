/* unit_view: kvmix_view_check, kvmix_ref_view_decode and kvmix_ref_view_score over views built
   here by hand: several sequences whose spans (mixed formats, padded head strides, dead tokens)
   share one base region. Decode and score are compared with double-precision computations over
   rows read back with kvmix_ref_dequantize_row, so a wrong offset, stride, dead flag or sequence
   boundary shows as a large error. Bounds as in unit_attention: NMSE < 1e-10 for outputs (float
   arithmetic over a few hundred tokens), 1e-5 relative for lse; a score may cancel to near zero,
   so its bound is 1e-5 of the sum of its terms' magnitudes. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define VIEW_MAX_SPANS  16
#define VIEW_MAX_SEQS   4
#define VIEW_BASE_BYTES (8u << 20) /* room for the largest random view: 16 spans of 70 FP16 rows */

typedef struct test_view {
    kvmix_view view;
    kvmix_view_span spans[VIEW_MAX_SPANS];
    int32_t first[VIEW_MAX_SEQS + 1];
    uint8_t dead[4096];
    uint8_t *base;
} test_view;

static const kvmix_format KEY_FORMATS[] = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4,
                                           KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
static const kvmix_format VALUE_FORMATS[] = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_INT8,
                                             KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT2};

static kvmix_layout view_layout(const kvmix_view *v, kvmix_format format, int32_t n_tokens) {
    kvmix_layout l;
    memset(&l, 0, sizeof l);
    l.format = format;
    l.n_tokens = n_tokens;
    l.head_dim = v->head_dim;
    l.n_boost = format == KVMIX_FORMAT_BOOSTED ? v->n_boost : 0;
    return l;
}

/* Quantizes random rows of every kv head into base at *used, heads `pad` bytes apart beyond the
   block size; returns the block offset and writes the head stride. */
static uint64_t put_blocks(test_rng *rng, test_view *tv, kvmix_format format, int32_t n_tokens,
                           size_t *used, uint32_t *head_bytes) {
    kvmix_layout l = view_layout(&tv->view, format, n_tokens);
    size_t block = 0, pad = (size_t)test_rng_range(rng, 0, 2) * 16;
    uint64_t offset = *used;
    float *rows = (float *)test_alloc((size_t)n_tokens * tv->view.head_dim * sizeof(float));
    int32_t h, i;
    kvmix_layout_bytes(&l, &block);
    for (h = 0; h < tv->view.n_kv_heads; h++) {
        for (i = 0; i < n_tokens * tv->view.head_dim; i++)
            rows[i] = (float)(test_rng_normal(rng) * (i % 7 == 0 ? 4.0 : 1.0));
        CHECK_RESULT(kvmix_ref_quantize(&l, rows, 0, tv->base + *used, VIEW_BASE_BYTES - *used),
                     KVMIX_SUCCESS);
        *used += block + pad;
    }
    free(rows);
    *head_bytes = (uint32_t)(block + pad);
    return offset;
}

/* A random view of n_seqs sequences, 0..4 spans each, about a quarter of tokens dead. */
static void build_view(test_rng *rng, test_view *tv, int32_t n_seqs, int32_t n_kv_heads,
                       int32_t head_dim) {
    size_t used = 0;
    int32_t s, i;
    memset(&tv->view, 0, sizeof tv->view);
    tv->view.n_seqs = n_seqs;
    tv->view.n_kv_heads = n_kv_heads;
    tv->view.head_dim = head_dim;
    tv->view.n_boost = head_dim / 8;
    tv->view.base = tv->base;
    tv->view.base_bytes = VIEW_BASE_BYTES;
    tv->view.spans = tv->spans;
    tv->view.seq_first_span = tv->first;
    tv->view.dead = tv->dead;
    tv->first[0] = 0;
    for (s = 0; s < n_seqs; s++) {
        int32_t n_spans = test_rng_range(rng, 0, VIEW_MAX_SPANS / VIEW_MAX_SEQS);
        for (i = 0; i < n_spans; i++) {
            kvmix_view_span *vs = &tv->spans[tv->view.n_spans++];
            int32_t n_tokens = test_rng_range(rng, 1, 70), t;
            memset(vs, 0, sizeof *vs);
            vs->n_tokens = n_tokens;
            vs->key_format = (uint8_t)KEY_FORMATS[test_rng_range(rng, 0, 4)];
            vs->value_format = (uint8_t)VALUE_FORMATS[test_rng_range(rng, 0, 3)];
            vs->key_offset = put_blocks(rng, tv, (kvmix_format)vs->key_format, n_tokens, &used,
                                        &vs->key_head_bytes);
            vs->value_offset = put_blocks(rng, tv, (kvmix_format)vs->value_format, n_tokens, &used,
                                          &vs->value_head_bytes);
            vs->dead_index = -1;
            if (test_rng_range(rng, 0, 1)) {
                vs->dead_index = tv->view.n_dead_flags;
                for (t = 0; t < n_tokens; t++)
                    tv->dead[tv->view.n_dead_flags++] = test_rng_range(rng, 0, 3) == 0;
            }
        }
        tv->first[s + 1] = tv->view.n_spans;
    }
    CHECK(used <= VIEW_BASE_BYTES);
}

/* Row t of a span's kv head h, read back through the public dequantizer. */
static void span_row(const test_view *tv, const kvmix_view_span *vs, int is_value, int32_t h,
                     int32_t t, float *row) {
    kvmix_format format = (kvmix_format)(is_value ? vs->value_format : vs->key_format);
    kvmix_layout l = view_layout(&tv->view, format, vs->n_tokens);
    uint64_t offset = is_value ? vs->value_offset : vs->key_offset;
    uint32_t stride = is_value ? vs->value_head_bytes : vs->key_head_bytes;
    size_t block = 0;
    kvmix_layout_bytes(&l, &block);
    CHECK_RESULT(
        kvmix_ref_dequantize_row(&l, tv->base + offset + (size_t)stride * h, block, t, row),
        KVMIX_SUCCESS);
}

static int token_dead(const test_view *tv, const kvmix_view_span *vs, int32_t t) {
    return vs->dead_index >= 0 && tv->dead[vs->dead_index + t];
}

/* Double-precision decode of one query row q over kv head h of sequence s. */
static void reference_decode(const test_view *tv, int32_t s, int32_t h, const float *q, double *out,
                             double *lse) {
    int32_t d = tv->view.head_dim, i, t, c, pass;
    double max = -INFINITY, sum = 0.0, scale = 1.0 / sqrt((double)d);
    float key[KVMIX_MAX_HEAD_DIM], value[KVMIX_MAX_HEAD_DIM];
    for (c = 0; c < d; c++) out[c] = 0.0;
    for (pass = 0; pass < 2; pass++) /* the max first, then the weighted sum */
        for (i = tv->first[s]; i < tv->first[s + 1]; i++)
            for (t = 0; t < tv->spans[i].n_tokens; t++) {
                double dot = 0.0, w;
                if (token_dead(tv, &tv->spans[i], t)) continue;
                span_row(tv, &tv->spans[i], 0, h, t, key);
                for (c = 0; c < d; c++) dot += (double)q[c] * key[c];
                dot *= scale;
                if (pass == 0) {
                    if (dot > max) max = dot;
                    continue;
                }
                w = exp(dot - max);
                sum += w;
                span_row(tv, &tv->spans[i], 1, h, t, value);
                for (c = 0; c < d; c++) out[c] += w * value[c];
            }
    for (c = 0; c < d && sum > 0.0; c++) out[c] /= sum;
    *lse = sum > 0.0 ? max + log(sum) : -INFINITY;
}

static void check_decode(test_rng *rng, test_view *tv, int32_t n_q) {
    int32_t d = tv->view.head_dim, n = tv->view.n_seqs * n_q, group = n_q / tv->view.n_kv_heads;
    float *q = (float *)test_alloc((size_t)n * d * sizeof(float));
    float *out = (float *)test_alloc((size_t)n * d * sizeof(float));
    float *lse = (float *)test_alloc((size_t)n * sizeof(float));
    double ref[KVMIX_MAX_HEAD_DIM], ref_lse;
    int32_t i, c;
    for (i = 0; i < n * d; i++) q[i] = (float)test_rng_normal(rng);
    CHECK_RESULT(kvmix_ref_view_decode(&tv->view, n_q, 0.0f, q, out, lse), KVMIX_SUCCESS);
    { /* an lse not wanted (NULL): the same out, bit for bit */
        float *out_no = (float *)test_alloc((size_t)n * d * sizeof(float));
        test_poison(out_no, (size_t)n * d * sizeof(float), 4);
        CHECK_RESULT(kvmix_ref_view_decode(&tv->view, n_q, 0.0f, q, out_no, NULL), KVMIX_SUCCESS);
        CHECK_MEM_EQ(out_no, out, (size_t)n * d * sizeof(float));
        free(out_no);
    }
    for (i = 0; i < n; i++) {
        int32_t s = i / n_q, h = (i % n_q) / group;
        double err = 0.0, norm = 0.0;
        reference_decode(tv, s, h, q + (size_t)i * d, ref, &ref_lse);
        for (c = 0; c < d; c++) {
            err += (out[(size_t)i * d + c] - ref[c]) * (out[(size_t)i * d + c] - ref[c]);
            norm += ref[c] * ref[c];
        }
        if (ref_lse == -INFINITY) {
            CHECK(lse[i] == -INFINITY && err == 0.0);
        } else {
            CHECK_MSG(err <= 1e-10 * norm, "seq %d head %d: NMSE %.3g", (int)s, (int)(i % n_q),
                      err / norm);
            CHECK_NEAR(lse[i], ref_lse, 1e-5 * fmax(1.0, fabs(ref_lse)));
        }
    }
    free(q);
    free(out);
    free(lse);
}

/* Scores of every sequence against sums over the read-back keys; tokens past capacity stay. */
static void check_score(test_rng *rng, test_view *tv, int32_t n_q) {
    int32_t d = tv->view.head_dim, group = n_q / tv->view.n_kv_heads, s, i, t, h, c, g;
    float *memory = (float *)test_alloc((size_t)n_q * d * sizeof(float));
    float scores[VIEW_MAX_SPANS * 70 + 1], key[KVMIX_MAX_HEAD_DIM];
    for (i = 0; i < n_q * d; i++) memory[i] = (float)test_rng_normal(rng);
    for (s = 0; s < tv->view.n_seqs; s++) {
        int32_t pos = 0, capacity = test_rng_range(rng, 0, 1) ? VIEW_MAX_SPANS * 70 : 20;
        for (i = 0; i < (int32_t)(sizeof scores / sizeof scores[0]); i++) scores[i] = 12345.0f;
        CHECK_RESULT(kvmix_ref_view_score(&tv->view, s, n_q, memory, scores, capacity),
                     KVMIX_SUCCESS);
        for (i = tv->first[s]; i < tv->first[s + 1]; i++)
            for (t = 0; t < tv->spans[i].n_tokens; t++, pos++) {
                double sum = 0.0, magnitude = 0.0; /* sum of |terms| bounds float rounding */
                if (pos >= capacity) continue;
                if (token_dead(tv, &tv->spans[i], t)) {
                    CHECK(scores[pos] == -INFINITY);
                    continue;
                }
                for (h = 0; h < tv->view.n_kv_heads; h++) {
                    span_row(tv, &tv->spans[i], 0, h, t, key);
                    for (g = 0; g < group; g++)
                        for (c = 0; c < d; c++) {
                            double term = (double)memory[(size_t)(h * group + g) * d + c] * key[c];
                            sum += term;
                            magnitude += fabs(term);
                        }
                }
                CHECK_NEAR(scores[pos], sum, 1e-5 * magnitude);
            }
        for (i = pos < capacity ? pos : capacity; i < (int32_t)(sizeof scores / sizeof scores[0]);
             i++)
            CHECK_MSG(scores[i] == 12345.0f, "score %d past the sequence or capacity written",
                      (int)i);
    }
    free(memory);
}

/* Each malformed view is rejected with its code by check, decode and score, outputs untouched. */
static void check_bad_views(test_rng *rng, test_view *tv) {
    enum { N_Q = 4 };
    float q[N_Q * 64], out[N_Q * 64], lse[N_Q], memory[N_Q * 64], scores[8];
    kvmix_view saved = tv->view;
    kvmix_view_span span0;
    int32_t first0, i;
    for (i = 0; i < N_Q * 64; i++) q[i] = memory[i] = (float)test_rng_normal(rng);
    kvmix_error why = {NULL, NULL};
    /* the view fails with `code`, why names the field `name`, and nothing is written */
#define EXPECT_VIEW(code, name, what)                                                              \
    do {                                                                                           \
        test_context("bad view: %s", what);                                                        \
        why.field = why.reason = NULL;                                                             \
        CHECK_RESULT(kvmix_view_check(&tv->view, &why), code);                                     \
        CHECK_ERROR(why, name);                                                                    \
        test_poison(out, sizeof out, 1);                                                           \
        test_poison(lse, sizeof lse, 2);                                                           \
        test_poison(scores, sizeof scores, 3);                                                     \
        CHECK_RESULT(kvmix_view_check(&tv->view, NULL), code);                                     \
        CHECK_RESULT(kvmix_ref_view_decode(&tv->view, N_Q, 0.0f, q, out, lse), code);              \
        CHECK_RESULT(kvmix_ref_view_decode(&tv->view, N_Q, 0.0f, q, out, NULL), code);             \
        CHECK_RESULT(kvmix_ref_view_score(&tv->view, 0, N_Q, memory, scores, 8), code);            \
        CHECK(test_is_poisoned(out, sizeof out, 1) && test_is_poisoned(lse, sizeof lse, 2));       \
        CHECK(test_is_poisoned(scores, sizeof scores, 3));                                         \
        tv->view = saved;                                                                          \
        tv->spans[0] = span0;                                                                      \
        tv->first[0] = first0;                                                                     \
    } while (0)
    CHECK_RESULT(kvmix_view_check(NULL, &why), KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "view");
    CHECK_RESULT(kvmix_view_check(&tv->view, &why), KVMIX_SUCCESS);
    CHECK_ERROR(why, "");
    CHECK_RESULT(kvmix_ref_view_decode(&tv->view, N_Q, 0.0f, NULL, out, lse),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_view_score(&tv->view, 1, N_Q, memory, scores, 8),
                 KVMIX_ERR_INVALID_ARGUMENT); /* seq out of range */
    CHECK_RESULT(kvmix_ref_view_decode(&tv->view, 3, 0.0f, q, out, lse),
                 KVMIX_ERR_INVALID_ARGUMENT); /* 3 q heads over 2 kv heads */
    span0 = tv->spans[0];
    first0 = tv->first[0];
    tv->view.n_seqs = -1;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "n_seqs", "negative n_seqs");
    tv->view.head_dim = 48;
    EXPECT_VIEW(KVMIX_ERR_BAD_SHAPE, "group_size",
                "head_dim 48: the default 32 does not divide it");
    tv->view.head_dim = 44;
    EXPECT_VIEW(KVMIX_ERR_BAD_SHAPE, "head_dim", "head_dim 44");
    tv->view.seq_first_span = NULL;
    EXPECT_VIEW(KVMIX_ERR_NULL_POINTER, "seq_first_span", "no seq_first_span");
    tv->view.base = NULL;
    EXPECT_VIEW(KVMIX_ERR_NULL_POINTER, "base", "no base");
    tv->first[0] = 1;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "seq_first_span", "first sequence not at span 0");
    tv->view.n_spans = saved.n_spans - 1;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "seq_first_span", "last boundary beyond n_spans");
    tv->spans[0].n_tokens = 0;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "n_tokens", "empty span");
    tv->spans[0].key_format = 7;
    EXPECT_VIEW(KVMIX_ERR_UNKNOWN_FORMAT, "key_format", "key format 7");
    tv->spans[0].value_format = 0;
    EXPECT_VIEW(KVMIX_ERR_UNKNOWN_FORMAT, "value_format", "value format 0");
    tv->spans[0].dead_index = saved.n_dead_flags;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "dead_index", "dead flags past the array");
    tv->spans[0].dead_index = -2;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "dead_index", "dead_index -2");
    tv->spans[0].key_head_bytes = 16;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "key_head_bytes", "head stride below the block size");
    tv->spans[0].value_offset = saved.base_bytes - 16;
    EXPECT_VIEW(KVMIX_ERR_BUFFER_TOO_SMALL, "value_offset", "value block past the base region");
    tv->spans[0].key_offset = UINT64_MAX - 8;
    EXPECT_VIEW(KVMIX_ERR_BUFFER_TOO_SMALL, "key_offset", "key offset near 2^64");
    tv->view.base_bytes = 64;
    EXPECT_VIEW(KVMIX_ERR_BUFFER_TOO_SMALL, "key_offset", "base region too small");
    tv->view.n_kv_heads = 0;
    EXPECT_VIEW(KVMIX_ERR_INVALID_ARGUMENT, "n_kv_heads", "no kv heads");
    tv->view.value_group_size = 12;
    EXPECT_VIEW(KVMIX_ERR_BAD_SHAPE, "value_group_size", "value groups of 12");
    tv->view.group_size = 24; /* values take it too: the keys' name comes first */
    EXPECT_VIEW(KVMIX_ERR_BAD_SHAPE, "group_size", "groups of 24 over 64 channels");
    tv->view.n_boost = 6;
    EXPECT_VIEW(KVMIX_ERR_BAD_SHAPE, "n_boost", "6 boosted channels");
    tv->view.n_dead_flags = 1;
    tv->view.dead = NULL;
    EXPECT_VIEW(KVMIX_ERR_NULL_POINTER, "dead", "dead flags without an array");
    {
        /* a corrupt FP16 key row: structure is fine, the packed bytes are not */
        uint8_t saved_bytes[2];
        uint8_t *row = tv->base + tv->spans[0].key_offset;
        memcpy(saved_bytes, row, 2);
        row[0] = 0x00;
        row[1] = 0x7c; /* +infinity */
        test_context("bad view: infinite FP16 key");
        test_poison(out, sizeof out, 1);
        CHECK_RESULT(kvmix_view_check(&tv->view, NULL), KVMIX_SUCCESS); /* structure only */
        CHECK_RESULT(kvmix_ref_view_decode(&tv->view, N_Q, 0.0f, q, out, lse),
                     KVMIX_ERR_CORRUPT_DATA);
        CHECK(test_is_poisoned(out, sizeof out, 1));
        memcpy(row, saved_bytes, 2);
        tv->spans[0] = span0;
    }
#undef EXPECT_VIEW
    test_context(NULL);
}

void unit_view(void) {
    static const int32_t HEAD_DIMS[] = {32, 64, 128, 256};
    test_rng rng;
    test_view tv;
    int32_t round;
    test_rng_init(&rng, "unit_view");
    tv.base = (uint8_t *)test_alloc(VIEW_BASE_BYTES);
    memset(tv.base, 0, VIEW_BASE_BYTES);
    for (round = 0; round < 24; round++) {
        int32_t n_kv = test_rng_range(&rng, 1, 3), group = test_rng_range(&rng, 1, 4);
        int32_t d = HEAD_DIMS[round % 4];
        test_context("view round %d: head_dim %d, %d kv heads, group %d", (int)round, (int)d,
                     (int)n_kv, (int)group);
        build_view(&rng, &tv, test_rng_range(&rng, 0, VIEW_MAX_SEQS), n_kv, d);
        CHECK_RESULT(kvmix_view_check(&tv.view, NULL), KVMIX_SUCCESS);
        check_decode(&rng, &tv, n_kv * group);
        check_score(&rng, &tv, n_kv * group);
    }
    /* one sequence whose first span has FP16 keys, for the malformed-view cases */
    do build_view(&rng, &tv, 1, 2, 64);
    while (tv.view.n_spans == 0 || tv.spans[0].key_format != KVMIX_FORMAT_FP16);
    check_bad_views(&rng, &tv);
    free(tv.base);
}
