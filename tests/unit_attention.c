/* unit_attention: kvmix_ref_attention_decode and kvmix_ref_attention_merge against a softmax
   attention computed here in double precision over the same dequantized keys and values.

   Accuracy bound. The reference removes quantization from the comparison (it dequantizes the
   packed blocks with kvmix_ref_dequantize), so what remains is kvmix's float arithmetic: a
   float dot product over D <= 512 channels, expf/logf and a float weighted sum over up to a few
   hundred tokens. Each carries a relative error of a few units of 2^-24 (6e-8) grown by about
   sqrt(length), so about 1e-6 relative on the output at worst, an NMSE of order 1e-12 for the
   logits used here (keys with high-magnitude channels, scales up to 2 / sqrt(D), |logit| up to
   about 15); over 300 seeds the largest NMSE seen was 7e-12. The bound NMSE < 1e-10 leaves more
   than a decade of headroom and still catches any real mistake: a dropped or extra token, a
   wrong kv head, a misplaced scale or one wrong weight gives an NMSE far above 1e-6.
   lse is a log of a sum of exponentials whose float evaluation is good to about 1e-6
   relative; the check is |lse - ref| <= 1e-5 * max(1, |ref|). */
#include "harness.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NMSE_BOUND 1e-10
#define LSE_RTOL   1e-5
#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

static double worst_nmse; /* largest NMSE seen, printed by the unit */

/* ---- spans built from random data ------------------------------------------------------------ */
typedef struct span_desc {
    kvmix_format key_format, value_format;
    int32_t key_group, key_boost, value_group, value_boost;
    int32_t n_tokens;
    size_t key_pad, value_pad; /* extra bytes between heads (0 with head_bytes 0 = packed) */
    int dead_mode;             /* 0: no dead array, 1: random flags, 2: all dead, 3: array of 0 */
} span_desc;

typedef struct built_span {
    kvmix_span span;
    uint8_t *keys, *values, *dead;
    float *kdec, *vdec; /* [n_kv][n][D] dequantized keys and values */
} built_span;

/* Keys: per-channel offsets and a few high-magnitude channels, as in real models; values:
   smaller, centred. */
static void gen_rows(test_rng *rng, float *x, int32_t n, int32_t d, int is_key) {
    int32_t t, c;
    for (c = 0; c < d; c++) {
        int hot = is_key && test_rng_range(rng, 0, 15) == 0;
        double mean =
            is_key ? (hot ? 3.0 : 0.3) * test_rng_normal(rng) : 0.1 * test_rng_normal(rng);
        double sigma = hot ? 3.0 : is_key ? 1.0 : 0.7;
        for (t = 0; t < n; t++) x[(size_t)t * d + c] = (float)(mean + sigma * test_rng_normal(rng));
    }
}

/* Quantizes n_kv heads of keys or values into one allocation of exactly the bytes the span
   declares (heads `pad` bytes apart beyond the block, padding filled with bytes that decode to
   NaN if anything read them) and keeps their dequantized values. */
static uint8_t *build_blocks(test_rng *rng, const kvmix_layout *l, int32_t n_kv, size_t pad,
                             int is_key, size_t *head_bytes, size_t *total_bytes, float **dec) {
    size_t block = 0, stride, total, n_elems = (size_t)l->n_tokens * (size_t)l->head_dim;
    uint8_t *buf;
    float *rows = (float *)test_alloc(sizeof(float) * (n_elems ? n_elems : 1));
    int32_t h;
    CHECK_RESULT(kvmix_layout_bytes(l, &block), KVMIX_SUCCESS);
    stride = block + pad;
    total = n_elems ? stride * (size_t)(n_kv - 1) + block : 0;
    buf = (uint8_t *)test_alloc(total);
    memset(buf, 0xff, total);
    *dec = (float *)test_alloc(sizeof(float) * (n_elems * (size_t)n_kv + 1));
    for (h = 0; h < n_kv && n_elems; h++) {
        gen_rows(rng, rows, l->n_tokens, l->head_dim, is_key);
        CHECK_RESULT(kvmix_ref_quantize(l, rows, 0, buf + stride * (size_t)h, block),
                     KVMIX_SUCCESS);
        CHECK_RESULT(
            kvmix_ref_dequantize(l, buf + stride * (size_t)h, block, *dec + n_elems * (size_t)h, 0),
            KVMIX_SUCCESS);
    }
    free(rows);
    *head_bytes = pad ? stride : (test_rng_u32(rng) & 1) ? block : 0; /* 0 = the block's size */
    *total_bytes = total;
    return buf;
}

static void build_span(test_rng *rng, built_span *b, const span_desc *s, int32_t n_kv, int32_t d) {
    int32_t t;
    memset(b, 0, sizeof *b);
    b->span.key_layout = test_layout(s->key_format, s->n_tokens, d, s->key_group, s->key_boost);
    b->span.value_layout =
        test_layout(s->value_format, s->n_tokens, d, s->value_group, s->value_boost);
    b->keys = build_blocks(rng, &b->span.key_layout, n_kv, s->key_pad, 1, &b->span.key_head_bytes,
                           &b->span.keys_bytes, &b->kdec);
    b->values = build_blocks(rng, &b->span.value_layout, n_kv, s->value_pad, 0,
                             &b->span.value_head_bytes, &b->span.values_bytes, &b->vdec);
    if (s->n_tokens == 0 && (test_rng_u32(rng) & 1)) { /* no tokens: pointers may be NULL */
        free(b->keys);
        free(b->values);
        b->keys = b->values = NULL;
    }
    b->span.keys = b->keys;
    b->span.values = b->values;
    if (s->dead_mode) {
        b->dead = (uint8_t *)test_alloc((size_t)s->n_tokens);
        for (t = 0; t < s->n_tokens; t++)
            b->dead[t] = s->dead_mode == 2 ? (uint8_t)test_rng_range(rng, 1, 255)
                         : s->dead_mode == 1 && test_rng_range(rng, 0, 3) == 0
                             ? (uint8_t)test_rng_range(rng, 1, 255)
                             : 0;
        b->span.dead = b->dead;
    }
}

static void free_span(built_span *b) {
    free(b->keys);
    free(b->values);
    free(b->dead);
    free(b->kdec);
    free(b->vdec);
    memset(b, 0, sizeof *b);
}

/* ---- the double-precision reference ---------------------------------------------------------- */
/* out [n_q][D], lse [n_q]; returns the number of live tokens. */
static int32_t reference_attention(const built_span *spans, int32_t n_spans, int32_t n_q,
                                   int32_t n_kv, int32_t d, double scale, const float *q,
                                   double *out, double *lse) {
    int32_t group = n_q / n_kv, qh, i, t, c, live = 0;
    for (i = 0; i < n_spans; i++)
        for (t = 0; t < spans[i].span.key_layout.n_tokens; t++)
            live += !(spans[i].dead && spans[i].dead[t]);
    for (qh = 0; qh < n_q; qh++) {
        int32_t h = qh / group;
        double m = -INFINITY, sum = 0.0;
        const float *qrow = q + (size_t)qh * d;
        for (c = 0; c < d; c++) out[(size_t)qh * d + c] = 0.0;
        for (i = 0; i < n_spans; i++) { /* the largest logit */
            int32_t n = spans[i].span.key_layout.n_tokens;
            for (t = 0; t < n; t++) {
                const float *k = spans[i].kdec + ((size_t)h * n + t) * d;
                double dot = 0.0;
                if (spans[i].dead && spans[i].dead[t]) continue;
                for (c = 0; c < d; c++) dot += (double)qrow[c] * (double)k[c];
                if (dot * scale > m) m = dot * scale;
            }
        }
        for (i = 0; i < n_spans; i++) {
            int32_t n = spans[i].span.key_layout.n_tokens;
            for (t = 0; t < n; t++) {
                const float *k = spans[i].kdec + ((size_t)h * n + t) * d;
                const float *v = spans[i].vdec + ((size_t)h * n + t) * d;
                double dot = 0.0, w;
                if (spans[i].dead && spans[i].dead[t]) continue;
                for (c = 0; c < d; c++) dot += (double)qrow[c] * (double)k[c];
                w = exp(dot * scale - m);
                sum += w;
                for (c = 0; c < d; c++) out[(size_t)qh * d + c] += w * (double)v[c];
            }
        }
        if (sum > 0.0) {
            for (c = 0; c < d; c++) out[(size_t)qh * d + c] /= sum;
            lse[qh] = m + log(sum);
        } else {
            lse[qh] = -INFINITY;
        }
    }
    return live;
}

/* Compares kvmix's out/lse with the reference. */
static void check_against_reference(const float *out, const float *lse, const double *ref_out,
                                    const double *ref_lse, int32_t n_q, int32_t d) {
    double err = 0.0, norm = 0.0, nmse;
    int32_t i;
    for (i = 0; i < n_q * d; i++) {
        double e = (double)out[i] - ref_out[i];
        err += e * e;
        norm += ref_out[i] * ref_out[i];
    }
    nmse = norm > 0.0 ? err / norm : err;
    if (nmse > worst_nmse) worst_nmse = nmse;
    CHECK_MSG(nmse < NMSE_BOUND, "output NMSE %.3g < %.0e", nmse, NMSE_BOUND);
    for (i = 0; i < n_q; i++) {
        if (isinf(ref_lse[i])) {
            CHECK_MSG(isinf(lse[i]) && lse[i] < 0, "lse[%d] = %g, expected -inf", (int)i,
                      (double)lse[i]);
            continue;
        }
        if (!CHECK_NEAR(lse[i], ref_lse[i], LSE_RTOL * fmax(1.0, fabs(ref_lse[i])))) break;
    }
}

static void random_q(test_rng *rng, float *q, int32_t n) {
    int32_t i;
    for (i = 0; i < n; i++) q[i] = (float)test_rng_normal(rng);
}

/* Runs kvmix over spans (out/lse poisoned first) and checks the result against the reference. */
static void run_and_compare(const kvmix_attention_desc *desc, const float *q,
                            const built_span *built, int32_t n_spans) {
    kvmix_span spans[16];
    size_t n_out = (size_t)desc->n_q_heads * (size_t)desc->head_dim;
    float *out = (float *)test_alloc(sizeof(float) * n_out);
    float *lse = (float *)test_alloc(sizeof(float) * (size_t)desc->n_q_heads);
    double *ref_out = (double *)test_alloc(sizeof(double) * n_out);
    double *ref_lse = (double *)test_alloc(sizeof(double) * (size_t)desc->n_q_heads);
    double scale = desc->scale > 0.0f ? (double)desc->scale : 1.0 / sqrt((double)desc->head_dim);
    int32_t i;
    for (i = 0; i < n_spans; i++) spans[i] = built[i].span;
    test_poison(out, sizeof(float) * n_out, 11);
    test_poison(lse, sizeof(float) * (size_t)desc->n_q_heads, 12);
    if (CHECK_RESULT(kvmix_ref_attention_decode(desc, q, spans, n_spans, out, lse),
                     KVMIX_SUCCESS)) {
        reference_attention(built, n_spans, desc->n_q_heads, desc->n_kv_heads, desc->head_dim,
                            scale, q, ref_out, ref_lse);
        check_against_reference(out, lse, ref_out, ref_lse, desc->n_q_heads, desc->head_dim);
    }
    free(out);
    free(lse);
    free(ref_out);
    free(ref_lse);
}

static kvmix_attention_desc make_desc(int32_t n_q, int32_t n_kv, int32_t d, float scale) {
    kvmix_attention_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.n_q_heads = n_q;
    desc.n_kv_heads = n_kv;
    desc.head_dim = d;
    desc.scale = scale;
    return desc;
}

static int32_t boost_for(int32_t d) {
    int32_t k = d / 8;
    return k < 4 ? 4 : k - k % 4;
}

/* The mixed sequence of a long-context cache: FP16 sink tokens, INT2-channel-key / INT2-value
   pages (one with evicted tokens), a boosted-key / INT4-value page, an INT8 page, a 0-token span
   and a partial FP16 page; heads padded apart in some spans. */
static int32_t mixed_sequence(test_rng *rng, span_desc *s, int32_t d, int32_t page) {
    int32_t n = 0;
    memset(s, 0, sizeof(span_desc) * 7);
    s[n].key_format = s[n].value_format = KVMIX_FORMAT_FP16;
    s[n++].n_tokens = 4;
    s[n].key_format = KVMIX_FORMAT_INT2_CHANNEL;
    s[n].value_format = KVMIX_FORMAT_INT2;
    s[n].key_pad = 48;
    s[n].value_pad = 16;
    s[n++].n_tokens = page;
    s[n].key_format = KVMIX_FORMAT_INT2_CHANNEL;
    s[n].value_format = KVMIX_FORMAT_INT2;
    s[n].value_group = 16;
    s[n].dead_mode = 1;
    s[n++].n_tokens = page;
    s[n].key_format = KVMIX_FORMAT_BOOSTED;
    s[n].key_boost = boost_for(d);
    s[n].value_format = KVMIX_FORMAT_INT4;
    s[n].key_pad = (size_t)test_rng_range(rng, 1, 64);
    s[n++].n_tokens = page;
    s[n].key_format = s[n].value_format = KVMIX_FORMAT_FP16; /* no tokens: skipped */
    s[n++].n_tokens = 0;
    s[n].key_format = s[n].value_format = KVMIX_FORMAT_INT8;
    s[n].key_group = s[n].value_group = 16;
    s[n].dead_mode = 3;
    s[n++].n_tokens = page;
    s[n].key_format = s[n].value_format = KVMIX_FORMAT_FP16; /* the local window, not full */
    s[n].value_pad = 2;
    s[n++].n_tokens = 13;
    return n;
}

static void test_mixed_sequences(void) {
    static const int32_t groups[] = {1, 2, 4, 8, 80};
    static const int32_t dims[] = {32, 64, 96, 128, 256, 512};
    test_rng rng;
    size_t gi, di;
    test_rng_init(&rng, "attention/mixed");
    for (gi = 0; gi < N_ELEMS(groups); gi++)
        for (di = 0; di < N_ELEMS(dims); di++) {
            int32_t d = dims[di], group = groups[gi];
            int32_t n_kv = group >= 8 ? 1 + (int32_t)(di % 2) : 1 + (int32_t)((gi + di) % 4);
            int32_t page = d >= 256 ? 32 : 64, n_spans, i;
            span_desc sd[7];
            built_span b[7];
            kvmix_attention_desc desc = make_desc(group * n_kv, n_kv, d, 0.0f);
            float *q = (float *)test_alloc(sizeof(float) * (size_t)desc.n_q_heads * (size_t)d);
            test_context("mixed sequence D=%d n_kv=%d group=%d", (int)d, (int)n_kv, (int)group);
            n_spans = mixed_sequence(&rng, sd, d, page);
            for (i = 0; i < n_spans; i++) build_span(&rng, &b[i], &sd[i], n_kv, d);
            random_q(&rng, q, desc.n_q_heads * d);
            run_and_compare(&desc, q, b, n_spans);
            for (i = 0; i < n_spans; i++) free_span(&b[i]);
            free(q);
        }
    test_context(NULL);
}

/* Every format for keys and for values, alone, with and without dead tokens. */
static void test_each_format_pair(void) {
    static const kvmix_format formats[] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                           KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
                                           KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
    test_rng rng;
    size_t ki, vi;
    test_rng_init(&rng, "attention/pairs");
    for (ki = 0; ki < N_ELEMS(formats); ki++)
        for (vi = 0; vi < N_ELEMS(formats); vi++) {
            int32_t d = 64 << (int32_t)((ki + vi) % 3), n_kv = 2, i;
            span_desc sd[2];
            built_span b[2];
            kvmix_attention_desc desc = make_desc(4, n_kv, d, 0.0f);
            float q[4 * 256];
            memset(sd, 0, sizeof sd);
            for (i = 0; i < 2; i++) {
                sd[i].key_format = formats[ki];
                sd[i].value_format = formats[vi];
                sd[i].key_boost = formats[ki] == KVMIX_FORMAT_BOOSTED ? 8 * (i + 1) : 0;
                sd[i].value_boost = formats[vi] == KVMIX_FORMAT_BOOSTED ? 4 : 0;
                sd[i].key_group = formats[ki] == KVMIX_FORMAT_INT4 ? 8 : 0;
                sd[i].n_tokens = i ? 33 : 40;
                sd[i].dead_mode = i;
                sd[i].key_pad = (size_t)(7 * i);
                build_span(&rng, &b[i], &sd[i], n_kv, d);
            }
            test_context("keys %d values %d D=%d", (int)formats[ki], (int)formats[vi], (int)d);
            random_q(&rng, q, 4 * d);
            run_and_compare(&desc, q, b, 2);
            for (i = 0; i < 2; i++) free_span(&b[i]);
        }
    test_context(NULL);
}

/* head_dims 48, 80 and 96 (multiples of 8 that 64 does not divide): every key and value format,
   in groups of 16, against the double reference. */
static void test_head_dims_of_8(void) {
    static const int32_t dims[] = {48, 80, 96};
    test_rng rng;
    size_t di;
    int32_t kf, vf, i;
    test_rng_init(&rng, "attention/head dims of 8");
    for (di = 0; di < N_ELEMS(dims); di++)
        for (kf = KVMIX_FORMAT_FP16; kf <= KVMIX_FORMAT_BOOSTED; kf++)
            for (vf = KVMIX_FORMAT_FP16; vf <= KVMIX_FORMAT_BOOSTED; vf++) {
                int32_t d = dims[di], n_kv = 2;
                span_desc sd[2];
                built_span b[2];
                kvmix_attention_desc desc = make_desc(4, n_kv, d, 0.0f);
                float q[4 * 96];
                memset(sd, 0, sizeof sd);
                for (i = 0; i < 2; i++) {
                    sd[i].key_format = (kvmix_format)kf;
                    sd[i].value_format = (kvmix_format)vf;
                    sd[i].key_boost = kf == KVMIX_FORMAT_BOOSTED ? 8 : 0;
                    sd[i].value_boost = vf == KVMIX_FORMAT_BOOSTED ? 4 : 0;
                    sd[i].key_group = kf >= KVMIX_FORMAT_INT8 && kf <= KVMIX_FORMAT_INT2 ? 16 : 0;
                    sd[i].value_group = vf >= KVMIX_FORMAT_INT8 && vf <= KVMIX_FORMAT_INT2 ? 16 : 0;
                    sd[i].n_tokens = i ? 17 : 32;
                    sd[i].dead_mode = i;
                    build_span(&rng, &b[i], &sd[i], n_kv, d);
                }
                test_context("D=%d keys %s values %s", (int)d, kvmix_format_name((kvmix_format)kf),
                             kvmix_format_name((kvmix_format)vf));
                random_q(&rng, q, 4 * d);
                run_and_compare(&desc, q, b, 2);
                for (i = 0; i < 2; i++) free_span(&b[i]);
            }
    test_context(NULL);
}

/* ---- structural properties ------------------------------------------------------------------- */
static int run_decode(const kvmix_attention_desc *desc, const float *q, const built_span *b,
                      int32_t n_spans, float *out, float *lse) {
    kvmix_span spans[16];
    int32_t i;
    for (i = 0; i < n_spans; i++) spans[i] = b[i].span;
    return CHECK_RESULT(
        kvmix_ref_attention_decode(desc, q, n_spans ? spans : NULL, n_spans, out, lse),
        KVMIX_SUCCESS);
}

static void test_empty_and_dead(void) {
    test_rng rng;
    const int32_t d = 64, n_kv = 2, n_q = 6;
    kvmix_attention_desc desc = make_desc(n_q, n_kv, d, 0.0f);
    float q[6 * 64], out[6 * 64], lse[6], out2[6 * 64], lse2[6];
    span_desc sd[4];
    built_span b[4];
    int32_t i;
    test_rng_init(&rng, "attention/empty");
    random_q(&rng, q, n_q * d);
    /* no spans at all (spans NULL, and a non-NULL array with n_spans 0) */
    test_context("no spans");
    test_poison(out, sizeof out, 13);
    if (run_decode(&desc, q, NULL, 0, out, lse))
        for (i = 0; i < n_q * d; i++) CHECK_EQ_FLOAT_BITS(out[i], 0.0f);
    for (i = 0; i < n_q; i++) CHECK(isinf(lse[i]) && lse[i] < 0);
    {
        kvmix_span dummy;
        memset(&dummy, 0, sizeof dummy);
        test_poison(out, sizeof out, 13);
        CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, &dummy, 0, out, lse), KVMIX_SUCCESS);
        CHECK(out[0] == 0.0f && isinf(lse[0]));
    }
    /* every token dead: zero output, lse -inf */
    test_context("all tokens dead");
    memset(sd, 0, sizeof sd);
    for (i = 0; i < 3; i++) {
        sd[i].key_format = i == 1 ? KVMIX_FORMAT_INT2_CHANNEL : KVMIX_FORMAT_FP16;
        sd[i].value_format = i == 2 ? KVMIX_FORMAT_INT4 : KVMIX_FORMAT_FP16;
        sd[i].n_tokens = 5 + 7 * i;
        sd[i].dead_mode = 2;
        build_span(&rng, &b[i], &sd[i], n_kv, d);
    }
    test_poison(out, sizeof out, 13);
    if (run_decode(&desc, q, b, 3, out, lse)) {
        for (i = 0; i < n_q * d; i++)
            if (!CHECK_EQ_FLOAT_BITS(out[i], 0.0f)) break;
        for (i = 0; i < n_q; i++) CHECK_MSG(isinf(lse[i]) && lse[i] < 0, "lse[%d] = -inf", (int)i);
    }
    /* one live token: out is exactly its value row (weight 1), lse its logit */
    test_context("one live token");
    b[1].dead[3] = 0;
    run_and_compare(&desc, q, b, 3);
    if (run_decode(&desc, q, b, 3, out, lse)) {
        int32_t h, c, n1 = sd[1].n_tokens;
        long bad = 0;
        for (h = 0; h < n_q; h++) /* q head h reads kv head h / 3 */
            for (c = 0; c < d; c++)
                bad += test_float_bits(out[h * d + c]) !=
                       test_float_bits(b[1].vdec[((size_t)(h / 3) * n1 + 3) * d + c]);
        CHECK_MSG(bad == 0, "one live token: out is its value row exactly (%ld differ)", bad);
    }
    for (i = 0; i < 3; i++) free_span(&b[i]);

    /* dead tokens are skipped: equal to the reference without them, and a dead array of zeros
       equals no dead array bit for bit */
    test_context("dead flags");
    memset(sd, 0, sizeof sd);
    sd[0].key_format = KVMIX_FORMAT_INT2_CHANNEL;
    sd[0].value_format = KVMIX_FORMAT_INT2;
    sd[0].n_tokens = 64;
    sd[0].dead_mode = 1;
    sd[1].key_format = KVMIX_FORMAT_FP16;
    sd[1].value_format = KVMIX_FORMAT_FP16;
    sd[1].n_tokens = 9;
    sd[1].dead_mode = 3;
    for (i = 0; i < 2; i++) build_span(&rng, &b[i], &sd[i], n_kv, d);
    run_and_compare(&desc, q, b, 2);
    if (run_decode(&desc, q, b, 2, out, lse)) {
        b[1].span.dead = NULL;
        if (run_decode(&desc, q, b, 2, out2, lse2)) {
            CHECK_MEM_EQ(out, out2, sizeof out);
            CHECK_MEM_EQ(lse, lse2, sizeof lse);
        }
        b[1].span.dead = b[1].dead;
    }
    /* spans of 0 tokens anywhere in the list change nothing (bit for bit) */
    test_context("0-token spans");
    memset(&sd[2], 0, sizeof sd[2]);
    sd[2].key_format = KVMIX_FORMAT_BOOSTED;
    sd[2].key_boost = 8;
    sd[2].value_format = KVMIX_FORMAT_INT8;
    build_span(&rng, &b[2], &sd[2], n_kv, d);
    {
        built_span list[5];
        list[0] = b[2];
        list[1] = b[0];
        list[2] = b[2];
        list[3] = b[1];
        list[4] = b[2];
        if (run_decode(&desc, q, b, 2, out, lse) && run_decode(&desc, q, list, 5, out2, lse2)) {
            CHECK_MEM_EQ(out, out2, sizeof out);
            CHECK_MEM_EQ(lse, lse2, sizeof lse);
        }
    }
    for (i = 0; i < 3; i++) free_span(&b[i]);
    test_context(NULL);
}

/* Heads packed back to back (head_bytes 0 or the block size) and heads padded apart give the
   same result bit for bit. */
static void test_head_strides(void) {
    test_rng rng;
    const int32_t d = 128, n_kv = 3, n_q = 6, n = 37;
    kvmix_attention_desc desc = make_desc(n_q, n_kv, d, 0.0f);
    float q[6 * 128], out[6 * 128], lse[6], out2[6 * 128], lse2[6];
    span_desc sd;
    built_span packed, padded;
    size_t kb = 0, vb = 0;
    int32_t h;
    test_rng_init(&rng, "attention/strides");
    test_context("head strides");
    memset(&sd, 0, sizeof sd);
    sd.key_format = KVMIX_FORMAT_BOOSTED;
    sd.key_boost = 16;
    sd.value_format = KVMIX_FORMAT_INT2;
    sd.n_tokens = n;
    build_span(&rng, &packed, &sd, n_kv, d);
    /* copy each head's blocks 100 / 36 bytes apart beyond their size */
    kvmix_layout_bytes(&packed.span.key_layout, &kb);
    kvmix_layout_bytes(&packed.span.value_layout, &vb);
    padded = packed;
    padded.span.key_head_bytes = kb + 100;
    padded.span.value_head_bytes = vb + 36;
    padded.span.keys_bytes = (kb + 100) * (n_kv - 1) + kb;
    padded.span.values_bytes = (vb + 36) * (n_kv - 1) + vb;
    padded.keys = (uint8_t *)test_alloc(padded.span.keys_bytes);
    padded.values = (uint8_t *)test_alloc(padded.span.values_bytes);
    test_poison(padded.keys, padded.span.keys_bytes, 14);
    test_poison(padded.values, padded.span.values_bytes, 15);
    for (h = 0; h < n_kv; h++) {
        memcpy(padded.keys + (kb + 100) * (size_t)h, packed.keys + kb * (size_t)h, kb);
        memcpy(padded.values + (vb + 36) * (size_t)h, packed.values + vb * (size_t)h, vb);
    }
    padded.span.keys = padded.keys;
    padded.span.values = padded.values;
    random_q(&rng, q, n_q * d);
    if (run_decode(&desc, q, &packed, 1, out, lse) &&
        run_decode(&desc, q, &padded, 1, out2, lse2)) {
        CHECK_MEM_EQ(out, out2, sizeof out);
        CHECK_MEM_EQ(lse, lse2, sizeof lse);
    }
    packed.span.key_head_bytes = kb; /* explicit block size = 0 */
    packed.span.value_head_bytes = 0;
    if (run_decode(&desc, q, &packed, 1, out2, lse2)) CHECK_MEM_EQ(out, out2, sizeof out);
    run_and_compare(&desc, q, &padded, 1);
    free(padded.keys);
    free(padded.values);
    free_span(&packed);
    test_context(NULL);
}

static void test_scale(void) {
    test_rng rng;
    const int32_t d = 96, n_kv = 1, n_q = 2;
    float q[2 * 96], out[2 * 96], lse[2], out2[2 * 96], lse2[2];
    span_desc sd;
    built_span b;
    kvmix_attention_desc desc = make_desc(n_q, n_kv, d, 0.0f), explicit_desc;
    test_rng_init(&rng, "attention/scale");
    test_context("softmax scale");
    memset(&sd, 0, sizeof sd);
    sd.key_format = KVMIX_FORMAT_INT4;
    sd.value_format = KVMIX_FORMAT_FP16;
    sd.n_tokens = 50;
    build_span(&rng, &b, &sd, n_kv, d);
    random_q(&rng, q, n_q * d);
    /* 0 means 1/sqrt(head_dim) */
    explicit_desc = desc;
    explicit_desc.scale = 1.0f / sqrtf((float)d);
    if (run_decode(&desc, q, &b, 1, out, lse) && run_decode(&explicit_desc, q, &b, 1, out2, lse2)) {
        CHECK_MEM_EQ(out, out2, sizeof out);
        CHECK_MEM_EQ(lse, lse2, sizeof lse);
    }
    /* -0.0 is 0 as well */
    explicit_desc.scale = -0.0f;
    if (run_decode(&explicit_desc, q, &b, 1, out2, lse2)) CHECK_MEM_EQ(out, out2, sizeof out);
    /* explicit scales, against the reference */
    explicit_desc.scale = 0.2f;
    run_and_compare(&explicit_desc, q, &b, 1);
    explicit_desc.scale = 0.01f;
    run_and_compare(&explicit_desc, q, &b, 1);
    explicit_desc.scale = 0.125f;
    run_and_compare(&explicit_desc, q, &b, 1);
    free_span(&b);
    test_context(NULL);
}

/* ---- merge ----------------------------------------------------------------------------------- */
static void test_merge(void) {
    test_rng rng;
    const int32_t d = 128, n_kv = 2, n_q = 8;
    kvmix_attention_desc desc = make_desc(n_q, n_kv, d, 0.0f);
    float q[8 * 128], whole[8 * 128], whole_lse[8];
    float oa[8 * 128], la[8], ob[8 * 128], lb[8], om[8 * 128], lm[8], tmp[8 * 128], tmp_lse[8];
    span_desc sd[7];
    built_span b[7], part_a[7], part_b[7];
    int32_t trial, i;
    test_rng_init(&rng, "attention/merge");
    mixed_sequence(&rng, sd, d, 48);
    for (i = 0; i < 7; i++) build_span(&rng, &b[i], &sd[i], n_kv, d);
    for (trial = 0; trial < 20; trial++) {
        int32_t na = 0, nb = 0;
        double err = 0.0, norm = 0.0;
        test_context("merge trial %d", (int)trial);
        random_q(&rng, q, n_q * d);
        for (i = 0; i < 7; i++) {
            if (test_rng_u32(&rng) & 1)
                part_a[na++] = b[i];
            else
                part_b[nb++] = b[i];
        }
        if (!run_decode(&desc, q, b, 7, whole, whole_lse) ||
            !run_decode(&desc, q, part_a, na, oa, la) || !run_decode(&desc, q, part_b, nb, ob, lb))
            break;
        test_poison(om, sizeof om, 16);
        if (!CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, ob, lb, om, lm), KVMIX_SUCCESS))
            break;
        for (i = 0; i < n_q * d; i++) {
            err += ((double)om[i] - whole[i]) * ((double)om[i] - whole[i]);
            norm += (double)whole[i] * whole[i];
        }
        /* two float computations of the same quantity: within a few float roundings */
        CHECK_MSG(err <= 1e-11 * norm, "merged halves equal the whole (NMSE %.3g)", err / norm);
        for (i = 0; i < n_q; i++)
            CHECK_NEAR(lm[i], whole_lse[i], 2e-6 * fmax(1.0, fabs(whole_lse[i])));
        /* symmetric, bit for bit */
        CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, ob, lb, oa, la, tmp, tmp_lse),
                     KVMIX_SUCCESS);
        CHECK_MEM_EQ(tmp, om, sizeof tmp);
        CHECK_MEM_EQ(tmp_lse, lm, sizeof tmp_lse);
        /* out aliasing a, then b: same bits as the separate output */
        memcpy(tmp, oa, sizeof tmp);
        memcpy(tmp_lse, la, sizeof tmp_lse);
        CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, tmp, tmp_lse, ob, lb, tmp, tmp_lse),
                     KVMIX_SUCCESS);
        CHECK_MEM_EQ(tmp, om, sizeof tmp);
        CHECK_MEM_EQ(tmp_lse, lm, sizeof tmp_lse);
        memcpy(tmp, ob, sizeof tmp);
        memcpy(tmp_lse, lb, sizeof tmp_lse);
        CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, tmp, tmp_lse, tmp, tmp_lse),
                     KVMIX_SUCCESS);
        CHECK_MEM_EQ(tmp, om, sizeof tmp);
        CHECK_MEM_EQ(tmp_lse, lm, sizeof tmp_lse);
    }
    /* an empty side (no spans: zeros, -inf) leaves the other side as it is, bit for bit */
    test_context("merge with an empty side");
    if (run_decode(&desc, q, b, 7, oa, la) && run_decode(&desc, q, NULL, 0, ob, lb)) {
        CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, ob, lb, om, lm), KVMIX_SUCCESS);
        CHECK_MEM_EQ(om, oa, sizeof om);
        CHECK_MEM_EQ(lm, la, sizeof lm);
        CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, ob, lb, oa, la, om, lm), KVMIX_SUCCESS);
        CHECK_MEM_EQ(om, oa, sizeof om);
        CHECK_MEM_EQ(lm, la, sizeof lm);
        /* both empty: zeros and -inf */
        test_poison(om, sizeof om, 17);
        CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, ob, lb, ob, lb, om, lm), KVMIX_SUCCESS);
        for (i = 0; i < n_q * d; i++)
            if (!CHECK_EQ_FLOAT_BITS(om[i], 0.0f)) break;
        for (i = 0; i < n_q; i++) CHECK(isinf(lm[i]) && lm[i] < 0);
        /* merging partial results of disjoint head ranges: heads are independent */
        CHECK_RESULT(
            kvmix_ref_attention_merge(n_q / 2, d, oa + (n_q / 2) * d, la + n_q / 2, ob, lb, om, lm),
            KVMIX_SUCCESS);
        CHECK_MEM_EQ(om, oa + (n_q / 2) * d, sizeof(float) * (size_t)(n_q / 2) * d);
    }
    /* bad input: nothing written */
    test_context("merge bad input");
    test_poison(om, sizeof om, 18);
    test_poison(lm, sizeof lm, 19);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, NULL, la, ob, lb, om, lm),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, NULL, ob, lb, om, lm),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, NULL, lb, om, lm),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, ob, NULL, om, lm),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, ob, lb, NULL, lm),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_attention_merge(-1, d, oa, la, ob, lb, om, lm),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, -1, oa, la, ob, lb, om, lm),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_attention_merge(-1, d, oa, la, ob, lb, om, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT); /* an lse not wanted: the rest still checked */
    CHECK_RESULT(kvmix_ref_attention_merge(0, d, oa, la, ob, lb, om, lm), KVMIX_SUCCESS);
    CHECK(test_is_poisoned(om, sizeof om, 18));
    CHECK(test_is_poisoned(lm, sizeof lm, 19));
    for (i = 0; i < 7; i++) free_span(&b[i]);
    test_context(NULL);
}

/* ---- lse not wanted -------------------------------------------------------------------------- */
/* A NULL lse means "not wanted": decode and merge write the same out, bit for bit, as with one. */
static void test_lse_not_wanted(void) {
    test_rng rng;
    const int32_t d = 64, n_kv = 2, n_q = 4;
    kvmix_attention_desc desc = make_desc(n_q, n_kv, d, 0.0f);
    float q[4 * 64], out[4 * 64], lse[4], out_no[4 * 64], oa[4 * 64], la[4], ob[4 * 64], lb[4];
    span_desc sd[7];
    built_span b[7];
    kvmix_span spans[7];
    int32_t i;
    test_rng_init(&rng, "attention/lse not wanted");
    test_context("lse not wanted");
    mixed_sequence(&rng, sd, d, 40);
    for (i = 0; i < 7; i++) {
        build_span(&rng, &b[i], &sd[i], n_kv, d);
        spans[i] = b[i].span;
    }
    random_q(&rng, q, n_q * d);
    test_poison(out_no, sizeof out_no, 24);
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, spans, 7, out, lse), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, spans, 7, out_no, NULL), KVMIX_SUCCESS);
    CHECK_MEM_EQ(out_no, out, sizeof out);
    /* merge: the halves' union without its lse is the union's out */
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, spans, 3, oa, la), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, spans + 3, 4, ob, lb), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, ob, lb, out, lse), KVMIX_SUCCESS);
    test_poison(out_no, sizeof out_no, 25);
    CHECK_RESULT(kvmix_ref_attention_merge(n_q, d, oa, la, ob, lb, out_no, NULL), KVMIX_SUCCESS);
    CHECK_MEM_EQ(out_no, out, sizeof out);
    for (i = 0; i < 7; i++) free_span(&b[i]);
    test_context(NULL);
}

/* ---- bad input ------------------------------------------------------------------------------- */
/* decode returns `want` and leaves out and lse untouched */
static void expect_decode(kvmix_result want, const kvmix_attention_desc *desc, const float *q,
                          const kvmix_span *spans, int32_t n_spans, const char *what) {
    float out[6 * 64 * 2], lse[12];
    kvmix_result r;
    test_poison(out, sizeof out, 20);
    test_poison(lse, sizeof lse, 21);
    r = kvmix_ref_attention_decode(desc, q, spans, n_spans, out, lse);
    CHECK_MSG(r == want, "decode with %s returns %s (got %s)", what, kvmix_result_string(want),
              kvmix_result_string(r));
    CHECK_MSG(test_is_poisoned(out, sizeof out, 20) && test_is_poisoned(lse, sizeof lse, 21),
              "decode with %s leaves out and lse untouched", what);
}

static void test_decode_bad_input(void) {
    test_rng rng;
    const int32_t d = 64, n_kv = 2;
    kvmix_attention_desc desc = make_desc(6, n_kv, d, 0.0f), bad;
    float q[12 * 64], out[6 * 64], lse[6];
    span_desc sd[2];
    built_span b[2];
    kvmix_span spans[2], s[2];
    size_t meta;
    int32_t i;
    test_rng_init(&rng, "attention/bad_input");
    test_context("decode bad input");
    memset(sd, 0, sizeof sd);
    sd[0].key_format = KVMIX_FORMAT_INT2_CHANNEL;
    sd[0].value_format = KVMIX_FORMAT_INT2;
    sd[0].n_tokens = 16;
    sd[1].key_format = KVMIX_FORMAT_FP16;
    sd[1].value_format = KVMIX_FORMAT_BOOSTED;
    sd[1].value_boost = 4;
    sd[1].n_tokens = 5;
    for (i = 0; i < 2; i++) {
        build_span(&rng, &b[i], &sd[i], n_kv, d);
        spans[i] = b[i].span;
    }
    random_q(&rng, q, 12 * d);
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, spans, 2, out, lse), KVMIX_SUCCESS);

    CHECK_RESULT(kvmix_ref_attention_decode(NULL, q, spans, 2, out, lse), KVMIX_ERR_NULL_POINTER);
    expect_decode(KVMIX_ERR_NULL_POINTER, &desc, NULL, spans, 2, "a NULL q");
    expect_decode(KVMIX_ERR_NULL_POINTER, &desc, q, NULL, 2, "NULL spans and n_spans 2");
    test_poison(lse, sizeof lse, 22);
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, spans, 2, NULL, lse), KVMIX_ERR_NULL_POINTER);
    CHECK(test_is_poisoned(lse, sizeof lse, 22));
    test_poison(out, sizeof out, 23); /* an lse not wanted: the rest is still checked */
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, q, spans, -1, out, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_attention_decode(&desc, NULL, spans, 2, out, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK(test_is_poisoned(out, sizeof out, 23));
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &desc, q, spans, -1, "n_spans -1");
    bad = desc;
    bad.n_q_heads = 5;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "n_q_heads 5 with 2 kv heads");
    bad = desc;
    bad.n_q_heads = 0;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "n_q_heads 0");
    bad = desc;
    bad.n_q_heads = -6;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "n_q_heads -6");
    bad = desc;
    bad.n_kv_heads = 0;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "n_kv_heads 0");
    bad = desc;
    bad.n_kv_heads = -2;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "n_kv_heads -2");
    bad = desc;
    bad.scale = NAN;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "a NaN scale");
    bad = desc;
    bad.scale = -1.0f;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "a negative scale");
    bad = desc;
    bad.scale = INFINITY;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &bad, q, spans, 2, "an infinite scale");
    bad = desc;
    bad.head_dim = 33;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &bad, q, spans, 2, "head_dim 33");
    bad = desc;
    bad.head_dim = 0;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &bad, q, spans, 2, "head_dim 0");
    bad = desc;
    bad.head_dim = 544;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &bad, q, spans, 2, "head_dim 544");
    bad = desc;
    bad.head_dim = 32;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &bad, q, spans, 2, "head_dim 32 with spans of 64");

    memcpy(s, spans, sizeof s);
    s[1].key_layout.head_dim = 32;
    s[1].value_layout.head_dim = 32;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &desc, q, s, 2, "a span of another head_dim");
    memcpy(s, spans, sizeof s);
    s[0].value_layout.head_dim = 128;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &desc, q, s, 2, "values of another head_dim");
    memcpy(s, spans, sizeof s);
    s[0].value_layout.n_tokens = 15;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &desc, q, s, 2, "key and value n_tokens 16 / 15");
    memcpy(s, spans, sizeof s);
    s[1].key_layout.n_tokens = s[1].value_layout.n_tokens = -1;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &desc, q, s, 2, "n_tokens -1");
    memcpy(s, spans, sizeof s);
    s[0].keys_bytes -= 1;
    expect_decode(KVMIX_ERR_BUFFER_TOO_SMALL, &desc, q, s, 2, "keys_bytes one short");
    memcpy(s, spans, sizeof s);
    s[1].values_bytes -= 1;
    expect_decode(KVMIX_ERR_BUFFER_TOO_SMALL, &desc, q, s, 2, "values_bytes one short");
    memcpy(s, spans, sizeof s);
    s[0].keys_bytes = 0;
    expect_decode(KVMIX_ERR_BUFFER_TOO_SMALL, &desc, q, s, 2, "keys_bytes 0");
    memcpy(s, spans, sizeof s);
    s[0].key_head_bytes = 7;
    expect_decode(KVMIX_ERR_INVALID_ARGUMENT, &desc, q, s, 2,
                  "key_head_bytes below the block size");
    memcpy(s, spans, sizeof s);
    s[0].keys = NULL;
    expect_decode(KVMIX_ERR_NULL_POINTER, &desc, q, s, 2, "NULL keys");
    memcpy(s, spans, sizeof s);
    s[1].values = NULL;
    expect_decode(KVMIX_ERR_NULL_POINTER, &desc, q, s, 2, "NULL values");
    memcpy(s, spans, sizeof s);
    s[0].key_layout.format = (kvmix_format)7;
    expect_decode(KVMIX_ERR_UNKNOWN_FORMAT, &desc, q, s, 2, "key format 7");
    memcpy(s, spans, sizeof s);
    s[1].value_layout.n_boost = 6;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &desc, q, s, 2, "value n_boost 6");
    memcpy(s, spans, sizeof s);
    s[0].value_layout.group_size = 12;
    expect_decode(KVMIX_ERR_BAD_SHAPE, &desc, q, s, 2, "value group 12");

    /* corrupt packed bytes in the last kv head of either block (validated before any write) */
    {
        size_t kb = 0, vb = 0;
        uint8_t *keys = (uint8_t *)test_alloc(spans[0].keys_bytes);
        uint8_t *values = (uint8_t *)test_alloc(spans[1].values_bytes);
        kvmix_layout_bytes(&spans[0].key_layout, &kb);
        kvmix_layout_bytes(&spans[1].value_layout, &vb);
        memcpy(keys, spans[0].keys, spans[0].keys_bytes);
        memcpy(values, spans[1].values, spans[1].values_bytes);
        meta = (size_t)16 * 64 / 4; /* INT2_CHANNEL meta follows n*D/4 data bytes */
        memcpy(s, spans, sizeof s);
        s[0].keys = keys;
        keys[spans[0].keys_bytes - kb + meta + 4 * 63 + 1] = 0x7e; /* channel 63's scale: NaN */
        expect_decode(KVMIX_ERR_CORRUPT_DATA, &desc, q, s, 2, "a NaN key scale in kv head 1");
        memcpy(s, spans, sizeof s);
        s[1].values = values;
        values[spans[1].values_bytes - 1] = 0x03; /* last index entry: slot 3 twice */
        values[spans[1].values_bytes - 2] = 0x03;
        expect_decode(KVMIX_ERR_CORRUPT_DATA, &desc, q, s, 2,
                      "a duplicate boost slot in kv head 1");
        (void)vb;
        free(keys);
        free(values);
    }

    /* head stride overflow: key_head_bytes * (n_kv_heads - 1) wraps around size_t. With 3 kv
       heads and key_head_bytes = 2^63 the extent 2^64 + block wraps to the block size, which
       keys_bytes covers; kvmix must still see that kv heads 1 and 2 lie outside keys_bytes.
       Head 0 is made corrupt so that an implementation with the wrap-around returns
       CORRUPT_DATA before it reads head 1 (2^63 bytes away), instead of crashing here. */
    {
        kvmix_attention_desc d3 = make_desc(3, 3, d, 0.0f);
        size_t kb = 0;
        uint8_t *one_block;
        kvmix_layout_bytes(&spans[0].key_layout, &kb);
        one_block = (uint8_t *)test_alloc(kb);
        memcpy(one_block, spans[0].keys, kb);
        one_block[meta + 1] = 0x7e; /* channel 0's scale: NaN */
        memcpy(s, spans, sizeof s);
        s[0].keys = one_block;
        s[0].keys_bytes = kb;
        s[0].key_head_bytes = (SIZE_MAX >> 1) + 1;
        expect_decode(KVMIX_ERR_BUFFER_TOO_SMALL, &d3, q, s, 1,
                      "key_head_bytes 2^63 with 3 kv heads (extent wraps around)");
        d3 = make_desc(5, 5, d, 0.0f); /* 4 * 2^62 wraps to 0 */
        s[0].key_head_bytes = (SIZE_MAX >> 2) + 1;
        expect_decode(KVMIX_ERR_BUFFER_TOO_SMALL, &d3, q, s, 1,
                      "key_head_bytes 2^62 with 5 kv heads (extent wraps around)");
        free(one_block);
    }
    for (i = 0; i < 2; i++) free_span(&b[i]);
    test_context(NULL);
}

void unit_attention(void) {
    test_mixed_sequences();
    test_each_format_pair();
    test_head_dims_of_8();
    test_empty_and_dead();
    test_head_strides();
    test_scale();
    test_merge();
    test_lse_not_wanted();
    test_decode_bad_input();
    CHECK_MSG(worst_nmse < NMSE_BOUND, "largest output NMSE seen %.3g", worst_nmse);
    printf("unit_attention: largest output NMSE against the double reference %.3g (bound %.0e)\n",
           worst_nmse, NMSE_BOUND);
}
