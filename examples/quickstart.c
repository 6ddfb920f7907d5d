/* quickstart: stores one synthetic attention head group in every kvmix format and prints the
   memory each takes and the decode-attention error against FP32.

   The keys and values are generated with the structure real models show: a few key channels of
   high magnitude (and an offset), RoPE-rotated keys, and attention-sink tokens at the start that
   draw much of the attention. Build and run: make demo */
#define KVMIX_IMPLEMENTATION
#include "../kvmix.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    N_TOKENS = 1000, /* not a multiple of the page: the last page is partial and stays FP16 */
    N_KV_HEADS = 2,
    N_Q_HEADS = 8,
    HEAD_DIM = 128,
    PAGE_TOKENS = 128,
    N_QUERIES = 16,
    N_OUTLIER_CHANNELS = 6,
    N_SINKS = 4
};

typedef struct policy {
    const char *name;
    kvmix_format key_format;
    kvmix_format value_format;
    int32_t n_boost;      /* boosted keys: channels kept at 4 bits */
    int32_t n_fp16_start; /* leading tokens kept in FP16 (attention sinks) */
} policy;

static const policy POLICIES[] = {
    {"fp16", KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 0, 0},
    {"int8", KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8, 0, 0},
    {"int4", KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, 0, 0},
    {"int2 per-token keys", KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, 0, 0},
    {"kivi2", KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2, 0, 0},
    {"kivi2 + 32 sinks", KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2, 0, 32},
    {"boosted 12.5%", KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, HEAD_DIM / 8, 0},
    {"boosted 25%", KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, HEAD_DIM / 4, 0},
};

/* Deterministic generator so every run prints the same table. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double uniform(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}

static double gaussian(void) {
    return sqrt(-2.0 * log(uniform())) * cos(6.283185307179586 * uniform());
}

/* Rotate-half RoPE at `position`: pairs (i, i + D/2), theta 10000. */
static void apply_rope(float *x, int32_t position) {
    int32_t i;
    for (i = 0; i < HEAD_DIM / 2; i++) {
        double angle = position * pow(10000.0, -2.0 * i / HEAD_DIM);
        double a = x[i], b = x[i + HEAD_DIM / 2];
        x[i] = (float)(a * cos(angle) - b * sin(angle));
        x[i + HEAD_DIM / 2] = (float)(a * sin(angle) + b * cos(angle));
    }
}

/* keys, values: [N_TOKENS][N_KV_HEADS][HEAD_DIM]; queries: [N_QUERIES][N_Q_HEADS][HEAD_DIM]. */
static void make_data(float *keys, float *values, float *queries) {
    /* massive key channels sit in RoPE's slow (low-frequency) pairs, as in trained models */
    int32_t outlier[N_OUTLIER_CHANNELS] = {52, 58, 61, 64 + 55, 64 + 60, 64 + 63};
    float sink_direction[HEAD_DIM], value_mean[HEAD_DIM];
    int32_t t, h, c, i;
    for (c = 0; c < HEAD_DIM; c++) {
        sink_direction[c] = (float)gaussian();
        value_mean[c] = (float)(0.3 * gaussian()); /* values are not zero-mean in trained models */
    }
    for (t = 0; t < N_TOKENS; t++)
        for (h = 0; h < N_KV_HEADS; h++) {
            float *k = keys + ((size_t)t * N_KV_HEADS + h) * HEAD_DIM;
            float *v = values + ((size_t)t * N_KV_HEADS + h) * HEAD_DIM;
            for (c = 0; c < HEAD_DIM; c++) {
                k[c] = (float)gaussian();
                v[c] = value_mean[c] + (float)(0.5 * gaussian());
            }
            for (i = 0; i < N_OUTLIER_CHANNELS; i++)
                k[outlier[i]] = (float)(8.0 + 3.0 * gaussian());
            if (t < N_SINKS)
                for (c = 0; c < HEAD_DIM; c++) k[c] += 1.7f * sink_direction[c];
            apply_rope(k, t);
        }
    for (i = 0; i < N_QUERIES; i++)
        for (h = 0; h < N_Q_HEADS; h++) {
            float *q = queries + ((size_t)i * N_Q_HEADS + h) * HEAD_DIM;
            for (c = 0; c < HEAD_DIM; c++) q[c] = (float)gaussian() + 0.3f * sink_direction[c];
            for (c = 0; c < N_OUTLIER_CHANNELS; c++) q[outlier[c]] += 1.0f;
            apply_rope(q, N_TOKENS);
        }
}

/* FP32 attention of every query head, the reference every format is compared with. */
static void attention_fp32(const float *keys, const float *values, const float *q, float *out) {
    static double logits[N_TOKENS];
    int32_t qh, t, c, group = N_Q_HEADS / N_KV_HEADS;
    for (qh = 0; qh < N_Q_HEADS; qh++) {
        const float *qrow = q + (size_t)qh * HEAD_DIM;
        int32_t h = qh / group;
        double max = -INFINITY, sum = 0.0;
        for (t = 0; t < N_TOKENS; t++) {
            const float *k = keys + ((size_t)t * N_KV_HEADS + h) * HEAD_DIM;
            double dot = 0.0;
            for (c = 0; c < HEAD_DIM; c++) dot += (double)qrow[c] * k[c];
            logits[t] = dot / sqrt((double)HEAD_DIM);
            if (logits[t] > max) max = logits[t];
        }
        for (c = 0; c < HEAD_DIM; c++) out[(size_t)qh * HEAD_DIM + c] = 0.0f;
        for (t = 0; t < N_TOKENS; t++) sum += exp(logits[t] - max);
        for (t = 0; t < N_TOKENS; t++) {
            const float *v = values + ((size_t)t * N_KV_HEADS + h) * HEAD_DIM;
            double w = exp(logits[t] - max) / sum;
            for (c = 0; c < HEAD_DIM; c++) out[(size_t)qh * HEAD_DIM + c] += (float)(w * v[c]);
        }
    }
}

/* Packs tokens [first, first + n) of every kv head into one block per head, heads back to back. */
static kvmix_result pack_blocks(const kvmix_layout *layout, const float *rows, int32_t first,
                                void **out, size_t *out_bytes) {
    size_t head_bytes;
    uint8_t *blocks;
    int32_t h;
    kvmix_result r = kvmix_layout_bytes(layout, &head_bytes);
    if (r != KVMIX_SUCCESS) return r;
    blocks = (uint8_t *)malloc(head_bytes * N_KV_HEADS);
    if (!blocks) return KVMIX_ERR_OUT_OF_MEMORY;
    for (h = 0; h < N_KV_HEADS; h++) {
        const float *src = rows + ((size_t)first * N_KV_HEADS + h) * HEAD_DIM;
        r = kvmix_ref_quantize(layout, src, N_KV_HEADS * HEAD_DIM, blocks + head_bytes * h,
                               head_bytes);
        if (r != KVMIX_SUCCESS) {
            free(blocks);
            return r;
        }
    }
    *out = blocks;
    *out_bytes = head_bytes * N_KV_HEADS;
    return KVMIX_SUCCESS;
}

static kvmix_layout make_layout(kvmix_format format, int32_t n_tokens, int32_t n_boost) {
    kvmix_layout layout;
    memset(&layout, 0, sizeof layout);
    layout.format = format;
    layout.n_tokens = n_tokens;
    layout.head_dim = HEAD_DIM;
    layout.n_boost = format == KVMIX_FORMAT_BOOSTED ? n_boost : 0;
    return layout;
}

/* Adds a span of tokens [first, first + n) in the given formats; sums its bytes into *bytes. */
static kvmix_result add_span(kvmix_span *span, const float *keys, const float *values,
                             int32_t first, int32_t n, kvmix_format key_format,
                             kvmix_format value_format, int32_t n_boost, size_t *bytes) {
    void *k = NULL, *v = NULL;
    kvmix_result r;
    memset(span, 0, sizeof *span);
    span->key_layout = make_layout(key_format, n, n_boost);
    span->value_layout = make_layout(value_format, n, n_boost);
    r = pack_blocks(&span->key_layout, keys, first, &k, &span->keys_bytes);
    if (r == KVMIX_SUCCESS)
        r = pack_blocks(&span->value_layout, values, first, &v, &span->values_bytes);
    if (r != KVMIX_SUCCESS) {
        free(k);
        return r;
    }
    span->keys = k;
    span->values = v;
    *bytes += span->keys_bytes + span->values_bytes;
    return KVMIX_SUCCESS;
}

/* Sinks in FP16, full pages in the policy's formats, the partial last page in FP16. */
static kvmix_result build_spans(const policy *p, const float *keys, const float *values,
                                kvmix_span *spans, int32_t *n_spans, size_t *bytes) {
    int32_t first = 0, n = 0;
    kvmix_result r = KVMIX_SUCCESS;
    *bytes = 0;
    if (p->n_fp16_start > 0) {
        r = add_span(&spans[n++], keys, values, 0, p->n_fp16_start, KVMIX_FORMAT_FP16,
                     KVMIX_FORMAT_FP16, 0, bytes);
        first = p->n_fp16_start;
    }
    for (; r == KVMIX_SUCCESS && first < N_TOKENS; first += PAGE_TOKENS) {
        int32_t count = N_TOKENS - first < PAGE_TOKENS ? N_TOKENS - first : PAGE_TOKENS;
        int full = count == PAGE_TOKENS;
        r = add_span(&spans[n++], keys, values, first, count,
                     full ? p->key_format : KVMIX_FORMAT_FP16,
                     full ? p->value_format : KVMIX_FORMAT_FP16, p->n_boost, bytes);
    }
    *n_spans = n;
    return r;
}

static void free_spans(kvmix_span *spans, int32_t n) {
    int32_t i;
    for (i = 0; i < n; i++) {
        free((void *)spans[i].keys);
        free((void *)spans[i].values);
    }
}

/* Normalized mean squared error of `out` against `ref` over n floats. */
static double nmse(const float *out, const float *ref, size_t n) {
    double err = 0.0, norm = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        err += ((double)out[i] - ref[i]) * ((double)out[i] - ref[i]);
        norm += (double)ref[i] * ref[i];
    }
    return err / norm;
}

/* Bits per K/V element of one full page in the policy's formats, metadata included. */
static double full_page_bits(const policy *p) {
    kvmix_layout key = make_layout(p->key_format, PAGE_TOKENS, p->n_boost);
    kvmix_layout value = make_layout(p->value_format, PAGE_TOKENS, p->n_boost);
    double key_bits = 0.0, value_bits = 0.0;
    kvmix_layout_bits(&key, &key_bits);
    kvmix_layout_bits(&value, &value_bits);
    return (key_bits + value_bits) / 2.0;
}

static int run_policy(const policy *p, const float *keys, const float *values, const float *queries,
                      const float *reference) {
    enum { MAX_SPANS = N_TOKENS / PAGE_TOKENS + 3 };
    static float out[N_Q_HEADS * HEAD_DIM];
    float lse[N_Q_HEADS];
    kvmix_span spans[MAX_SPANS];
    kvmix_attention_desc desc;
    int32_t n_spans = 0, i;
    size_t bytes;
    double error = 0.0;
    kvmix_result r = build_spans(p, keys, values, spans, &n_spans, &bytes);
    memset(&desc, 0, sizeof desc);
    desc.n_q_heads = N_Q_HEADS;
    desc.n_kv_heads = N_KV_HEADS;
    desc.head_dim = HEAD_DIM;
    for (i = 0; r == KVMIX_SUCCESS && i < N_QUERIES; i++) {
        size_t q_offset = (size_t)i * N_Q_HEADS * HEAD_DIM;
        r = kvmix_ref_attention_decode(&desc, queries + q_offset, spans, n_spans, out, lse);
        error += nmse(out, reference + q_offset, N_Q_HEADS * HEAD_DIM) / N_QUERIES;
    }
    free_spans(spans, n_spans);
    if (r != KVMIX_SUCCESS) {
        fprintf(stderr, "quickstart: %s: %s\n", p->name, kvmix_result_string(r));
        return 1;
    }
    printf("%-22s %10zu %10.3f %10.3f %12.3e\n", p->name, bytes, full_page_bits(p),
           bytes * 8.0 / ((double)N_TOKENS * N_KV_HEADS * HEAD_DIM * 2), error);
    return 0;
}

int main(void) {
    size_t kv_floats = (size_t)N_TOKENS * N_KV_HEADS * HEAD_DIM;
    size_t q_floats = (size_t)N_QUERIES * N_Q_HEADS * HEAD_DIM;
    float *keys = (float *)malloc(kv_floats * sizeof(float));
    float *values = (float *)malloc(kv_floats * sizeof(float));
    float *queries = (float *)malloc(q_floats * sizeof(float));
    float *reference = (float *)malloc(q_floats * sizeof(float));
    size_t i;
    int failed = 0;
    if (!keys || !values || !queries || !reference) {
        fprintf(stderr, "quickstart: out of memory\n");
        return 1;
    }
    make_data(keys, values, queries);
    for (i = 0; i < N_QUERIES; i++)
        attention_fp32(keys, values, queries + i * N_Q_HEADS * HEAD_DIM,
                       reference + i * N_Q_HEADS * HEAD_DIM);
    printf("kvmix %s quickstart: %d tokens, %d kv heads, %d query heads, head_dim %d, page %d\n",
           kvmix_version_string(), N_TOKENS, N_KV_HEADS, N_Q_HEADS, HEAD_DIM, PAGE_TOKENS);
    printf("FP32 K+V would take %zu bytes. 'page bits': K/V bits per element of a full page;\n"
           "'all bits': of all %d tokens, where the partial last page stays FP16.\n",
           kv_floats * 2 * sizeof(float), N_TOKENS);
    printf("%-22s %10s %10s %10s %12s\n", "format", "bytes", "page bits", "all bits", "attn NMSE");
    for (i = 0; i < sizeof POLICIES / sizeof POLICIES[0]; i++)
        failed |= run_policy(&POLICIES[i], keys, values, queries, reference);
    free(keys);
    free(values);
    free(queries);
    free(reference);
    return failed;
}
