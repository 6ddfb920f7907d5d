/* unit_cache: the paged mixed-precision cache. Random operation sequences (ingest, append,
   evict, fork, finish, demote, upgrade, free) checked after every step against a plain model of
   what each sequence holds; failed calls compared byte for byte with the state before them;
   views and the reference decode against attention over the read-back rows; bad inputs. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CT_MAX_SEQS 6

static const uint8_t ct_formats[6] = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_INT8,
                                      KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT2,
                                      KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};

/* Precision order the cache promises: FP16 > INT8 > INT4 > BOOSTED > INT2 > INT2_CHANNEL. */
static int ct_rank(uint8_t f) {
    switch (f) {
    case KVMIX_FORMAT_FP16: return 6;
    case KVMIX_FORMAT_INT8: return 5;
    case KVMIX_FORMAT_INT4: return 4;
    case KVMIX_FORMAT_BOOSTED: return 3;
    case KVMIX_FORMAT_INT2: return 2;
    case KVMIX_FORMAT_INT2_CHANNEL: return 1;
    }
    return 0;
}

/* Error bound of one quantization of data within [-1.05, 1.05]: half a step of the format's
   levels over the range, with slack for FP16 rounding of scale and minimum. A BOOSTED channel
   that is not boosted has 2-bit codes, so it shares the 2-bit bound. */
static double ct_bound(uint8_t f) {
    double range = 2.1;
    switch (f) {
    case KVMIX_FORMAT_FP16: return 1e-3;
    case KVMIX_FORMAT_INT8: return range / 255.0 / 2.0 * 1.02 + 1e-3;
    case KVMIX_FORMAT_INT4: return range / 15.0 / 2.0 * 1.02 + 1e-3;
    default: return range / 3.0 / 2.0 * 1.02 + 1e-3;
    }
}

typedef struct ct_seq {
    int in_use;
    int32_t len;
    int32_t *tok;               /* [max_tokens] pool index of each position */
    uint8_t *alive;             /* [max_tokens] */
    kvmix_cache_precision *req; /* [max_tokens] requested formats */
    float *debt_k, *debt_v;     /* [max_tokens] error carried over from earlier quantizations */
    uint8_t *retiered;          /* [max_tokens] its page was re-tiered: no format promise */
    uint8_t *exempt;            /* [max_tokens] no window promise (finished, shared) */
} ct_seq;

typedef struct ct_model {
    kvmix_cache cache;
    kvmix_cache_desc desc;
    void *memory, *arena;
    size_t memory_bytes, arena_bytes;
    uint8_t *snap_struct, *snap_memory, *snap_arena;
    int32_t token_floats; /* L * H * D */
    float *pool_k, *pool_v;
    int32_t n_pool, pool_capacity;
    ct_seq seqs[CT_MAX_SEQS];
    test_rng rng;
    int64_t n_oom, n_ops_ok;
} ct_model;

/* ---- setup ------------------------------------------------------------------------------- */

static void ct_open(ct_model *m, const kvmix_cache_desc *desc, const char *stream) {
    int32_t s;
    memset(m, 0, sizeof *m);
    test_rng_init(&m->rng, stream);
    m->desc = *desc;
    CHECK_RESULT(kvmix_cache_memory_bytes(&m->desc, &m->memory_bytes), KVMIX_SUCCESS);
    m->memory = test_alloc(m->memory_bytes);
    m->arena_bytes = desc->arena_bytes;
    m->arena = test_alloc(m->arena_bytes);
    test_poison(m->memory, m->memory_bytes, 1);
    test_poison(m->arena, m->arena_bytes, 2);
    CHECK_RESULT(kvmix_cache_init(&m->cache, &m->desc, m->memory, m->memory_bytes, m->arena),
                 KVMIX_SUCCESS);
    m->snap_struct = (uint8_t *)test_alloc(sizeof m->cache);
    m->snap_memory = (uint8_t *)test_alloc(m->memory_bytes);
    m->snap_arena = (uint8_t *)test_alloc(m->arena_bytes);
    m->token_floats = m->desc.n_layers * m->desc.n_kv_heads * m->desc.head_dim;
    for (s = 0; s < CT_MAX_SEQS; s++) {
        ct_seq *q = &m->seqs[s];
        size_t n = (size_t)m->desc.max_tokens_per_seq;
        q->tok = (int32_t *)test_alloc(n * sizeof *q->tok);
        q->alive = (uint8_t *)test_alloc(n);
        q->req = (kvmix_cache_precision *)test_alloc(n * sizeof *q->req);
        q->debt_k = (float *)test_alloc(n * sizeof(float));
        q->debt_v = (float *)test_alloc(n * sizeof(float));
        q->retiered = (uint8_t *)test_alloc(n);
        q->exempt = (uint8_t *)test_alloc(n);
    }
}

static void ct_close(ct_model *m) {
    int32_t s;
    kvmix_cache_deinit(&m->cache);
    for (s = 0; s < CT_MAX_SEQS; s++) {
        ct_seq *q = &m->seqs[s];
        free(q->tok);
        free(q->alive);
        free(q->req);
        free(q->debt_k);
        free(q->debt_v);
        free(q->retiered);
        free(q->exempt);
    }
    free(m->memory);
    free(m->arena);
    free(m->snap_struct);
    free(m->snap_memory);
    free(m->snap_arena);
    free(m->pool_k);
    free(m->pool_v);
}

/* Every byte a cache can change: the struct, the metadata memory, the arena. */
static void ct_snapshot(ct_model *m) {
    memcpy(m->snap_struct, &m->cache, sizeof m->cache);
    memcpy(m->snap_memory, m->memory, m->memory_bytes);
    memcpy(m->snap_arena, m->arena, m->arena_bytes);
}

static int ct_unchanged(ct_model *m) {
    return CHECK_MEM_EQ(m->snap_struct, &m->cache, sizeof m->cache) &&
           CHECK_MEM_EQ(m->snap_memory, m->memory, m->memory_bytes) &&
           CHECK_MEM_EQ(m->snap_arena, m->arena, m->arena_bytes);
}

/* A new token of random FP16-exact values in [-1, 1]; returns its pool index. */
static int32_t ct_new_token(ct_model *m) {
    int32_t i;
    float *k, *v;
    if (m->n_pool == m->pool_capacity) {
        m->pool_capacity = m->pool_capacity ? 2 * m->pool_capacity : 256;
        m->pool_k = (float *)realloc(m->pool_k, (size_t)m->pool_capacity * m->token_floats * sizeof(float));
        m->pool_v = (float *)realloc(m->pool_v, (size_t)m->pool_capacity * m->token_floats * sizeof(float));
        if (!m->pool_k || !m->pool_v) {
            printf("out of memory\n");
            exit(2);
        }
    }
    k = m->pool_k + (size_t)m->n_pool * m->token_floats;
    v = m->pool_v + (size_t)m->n_pool * m->token_floats;
    for (i = 0; i < m->token_floats; i++) {
        /* some channels with a bias, so per-channel statistics matter */
        float bias = (i % 7 == 0) ? 0.5f : 0.0f;
        double x = (2.0 * test_rng_unit(&m->rng) - 1.0) * (bias > 0 ? 0.5 : 1.0) + bias;
        double y = 2.0 * test_rng_unit(&m->rng) - 1.0;
        k[i] = kvmix_fp16_to_fp32(kvmix_fp32_to_fp16((float)x));
        v[i] = kvmix_fp16_to_fp32(kvmix_fp32_to_fp16((float)y));
    }
    return m->n_pool++;
}

static const float *ct_key(const ct_model *m, int32_t tok, int32_t layer, int32_t head) {
    return m->pool_k + (size_t)tok * m->token_floats +
           ((size_t)layer * m->desc.n_kv_heads + head) * m->desc.head_dim;
}

static const float *ct_value(const ct_model *m, int32_t tok, int32_t layer, int32_t head) {
    return m->pool_v + (size_t)tok * m->token_floats +
           ((size_t)layer * m->desc.n_kv_heads + head) * m->desc.head_dim;
}

static kvmix_cache_precision ct_random_precision(ct_model *m) {
    kvmix_cache_precision p;
    p.key_format = ct_formats[test_rng_range(&m->rng, 0, 5)];
    p.value_format = ct_formats[test_rng_range(&m->rng, 0, 5)];
    return p;
}

/* ---- verification ----------------------------------------------------------------------- */

static uint32_t ct_page_of(const ct_model *m, uint32_t slot) {
    return slot / (uint32_t)m->cache.desc.page_tokens;
}

/* Every position of a sequence against the model. */
static void ct_verify_seq(ct_model *m, int32_t s) {
    const ct_seq *q = &m->seqs[s];
    const kvmix_cache *c = &m->cache;
    int32_t d = c->desc.head_dim, nh = c->desc.n_kv_heads, pos, layer, h, i, n_alive = 0;
    float keys[4 * 64], values[4 * 64];
    test_context("sequence %d of length %d", (int)s, (int)q->len);
    CHECK_EQ_INT(c->seqs[s].in_use, 1);
    CHECK_EQ_INT(c->seqs[s].n_tokens, q->len);
    for (pos = 0; pos < q->len; pos++) {
        uint32_t slot = 0xffffffffu;
        kvmix_cache_precision f;
        CHECK_RESULT(kvmix_cache_locate(c, s, pos, &slot), KVMIX_SUCCESS);
        if (!q->alive[pos]) {
            CHECK_EQ_UINT(slot, KVMIX_CACHE_DEAD_SLOT);
            CHECK_RESULT(kvmix_cache_read(c, s, pos, 0, keys, values, &f), KVMIX_ERR_NOT_FOUND);
            continue;
        }
        n_alive++;
        if (!CHECK(slot != KVMIX_CACHE_DEAD_SLOT)) continue;
        for (layer = 0; layer < c->desc.n_layers; layer++) {
            double bk, bv, worst_k = 0.0, worst_v = 0.0;
            if (!CHECK_RESULT(kvmix_cache_read(c, s, pos, layer, keys, values, &f), KVMIX_SUCCESS))
                break;
            bk = ct_bound(f.key_format) + q->debt_k[pos];
            bv = ct_bound(f.value_format) + q->debt_v[pos];
            for (h = 0; h < nh; h++) {
                const float *k = ct_key(m, q->tok[pos], layer, h), *v = ct_value(m, q->tok[pos], layer, h);
                for (i = 0; i < d; i++) {
                    double ek = fabs((double)keys[h * d + i] - k[i]);
                    double ev = fabs((double)values[h * d + i] - v[i]);
                    if (!(ek <= worst_k)) worst_k = ek;
                    if (!(ev <= worst_v)) worst_v = ev;
                }
            }
            CHECK_MSG(worst_k <= bk, "seq %d pos %d layer %d key error %g > bound %g (format %d)",
                      (int)s, (int)pos, (int)layer, worst_k, bk, f.key_format);
            CHECK_MSG(worst_v <= bv, "seq %d pos %d layer %d value error %g > bound %g (format %d)",
                      (int)s, (int)pos, (int)layer, worst_v, bv, f.value_format);
        }
        if (q->retiered[pos]) continue;
        if (pos < c->desc.n_sink) {
            CHECK_EQ_INT(f.key_format, KVMIX_FORMAT_FP16);
            CHECK_EQ_INT(f.value_format, KVMIX_FORMAT_FP16);
        }
        CHECK_MSG(ct_rank(f.key_format) >= ct_rank(q->req[pos].key_format),
                  "pos %d key format %d below the requested %d", (int)pos, f.key_format,
                  q->req[pos].key_format);
        CHECK_MSG(ct_rank(f.value_format) >= ct_rank(q->req[pos].value_format),
                  "pos %d value format %d below the requested %d", (int)pos, f.value_format,
                  q->req[pos].value_format);
        if (!q->exempt[pos] && pos >= q->len - c->desc.n_window &&
            c->pages[ct_page_of(m, slot)].refcount == 1)
            CHECK_MSG(f.key_format == KVMIX_FORMAT_FP16 && f.value_format == KVMIX_FORMAT_FP16,
                      "pos %d inside the window of %d is stored as %d/%d", (int)pos,
                      (int)c->desc.n_window, f.key_format, f.value_format);
    }
    CHECK_EQ_INT(c->seqs[s].n_live, n_alive);
    test_context(NULL);
}

/* Structure: invariants, reference counts counted here, views against the model. */
static void ct_verify(ct_model *m) {
    const kvmix_cache *c = &m->cache;
    int32_t s, j, i, n_live_seqs = 0;
    int32_t seqs[CT_MAX_SEQS];
    CHECK_RESULT(kvmix_cache_check(c), KVMIX_SUCCESS);
    for (i = 1; i < c->max_pages; i++) {
        int32_t refs = 0;
        for (s = 0; s < c->desc.max_seqs; s++)
            if (c->seqs[s].in_use)
                for (j = 0; j < c->seqs[s].n_entries; j++)
                    refs += c->entries[(size_t)s * c->desc.max_pages_per_seq + j].page == (uint32_t)i;
        CHECK_EQ_INT(c->pages[i].refcount, refs);
    }
    CHECK_EQ_INT(c->pages[0].refcount, 1); /* the sentinel */
    for (s = 0; s < CT_MAX_SEQS; s++) {
        CHECK_EQ_INT(c->seqs[s].in_use, m->seqs[s].in_use);
        if (!m->seqs[s].in_use) continue;
        seqs[n_live_seqs++] = s;
        ct_verify_seq(m, s);
    }
    /* a view flags exactly the dead rows: live flags per sequence = live positions */
    if (n_live_seqs > 0) {
        int32_t n_spans = 0, n_dead = 0, k;
        kvmix_view view;
        kvmix_view_span *spans;
        int32_t first[CT_MAX_SEQS + 1];
        uint8_t *dead;
        CHECK_RESULT(kvmix_cache_view_counts(c, seqs, n_live_seqs, &n_spans, &n_dead), KVMIX_SUCCESS);
        spans = (kvmix_view_span *)test_alloc((size_t)(n_spans + 1) * sizeof *spans);
        dead = (uint8_t *)test_alloc((size_t)n_dead + 1);
        CHECK_RESULT(kvmix_cache_view(c, c->desc.n_layers - 1, seqs, n_live_seqs, spans, n_spans,
                                      first, dead, n_dead, &view),
                     KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_view_check(&view), KVMIX_SUCCESS);
        for (i = 0; i < n_live_seqs; i++) {
            int64_t live = 0;
            for (k = first[i]; k < first[i + 1]; k++) {
                int32_t t;
                for (t = 0; t < spans[k].n_tokens; t++)
                    live += spans[k].dead_index < 0 || !dead[spans[k].dead_index + t];
            }
            CHECK_EQ_INT(live, c->seqs[seqs[i]].n_live);
        }
        free(spans);
        free(dead);
    }
}

/* Decode attention through the cache's view against attention over the rows read back. */
static void ct_verify_decode(ct_model *m) {
    const kvmix_cache *c = &m->cache;
    int32_t seqs[CT_MAX_SEQS], n = 0, s, i, h, t, layer = c->desc.n_layers - 1;
    int32_t nq = 2 * c->desc.n_kv_heads, d = c->desc.head_dim;
    float *q, *out, *lse, *keys, *values;
    size_t ws_bytes = 0;
    void *ws;
    for (s = 0; s < CT_MAX_SEQS; s++)
        if (m->seqs[s].in_use) seqs[n++] = s;
    if (n == 0) return;
    q = (float *)test_alloc((size_t)n * nq * d * sizeof(float));
    out = (float *)test_alloc((size_t)n * nq * d * sizeof(float));
    lse = (float *)test_alloc((size_t)n * nq * sizeof(float));
    keys = (float *)test_alloc((size_t)c->desc.n_kv_heads * d * sizeof(float));
    values = (float *)test_alloc((size_t)c->desc.n_kv_heads * d * sizeof(float));
    for (i = 0; i < n * nq * d; i++) q[i] = (float)(2.0 * test_rng_unit(&m->rng) - 1.0);
    CHECK_RESULT(kvmix_cache_ref_decode_workspace(c, seqs, n, &ws_bytes), KVMIX_SUCCESS);
    ws = test_alloc(ws_bytes + 8);
    CHECK_RESULT(kvmix_cache_ref_decode(c, layer, seqs, n, nq, 0.0f, q, out, lse, ws, ws_bytes),
                 KVMIX_SUCCESS);
    for (i = 0; i < n; i++) {
        const ct_seq *cs = &m->seqs[seqs[i]];
        for (h = 0; h < nq; h++) {
            const float *qh = q + ((size_t)i * nq + h) * d;
            double mx = -INFINITY, sum = 0.0, acc[64], scale = 1.0 / sqrt((double)d);
            int32_t kvh = h / 2, c2, n_live = 0;
            for (c2 = 0; c2 < d; c2++) acc[c2] = 0.0;
            for (t = 0; t < cs->len; t++) { /* pass 1: max logit */
                double dot = 0.0;
                if (!cs->alive[t]) continue;
                kvmix_cache_read(c, seqs[i], t, layer, keys, values, NULL);
                for (c2 = 0; c2 < d; c2++) dot += (double)qh[c2] * keys[kvh * d + c2];
                if (dot * scale > mx) mx = dot * scale;
                n_live++;
            }
            for (t = 0; t < cs->len; t++) {
                double dot = 0.0, w;
                if (!cs->alive[t]) continue;
                kvmix_cache_read(c, seqs[i], t, layer, keys, values, NULL);
                for (c2 = 0; c2 < d; c2++) dot += (double)qh[c2] * keys[kvh * d + c2];
                w = exp(dot * scale - mx);
                sum += w;
                for (c2 = 0; c2 < d; c2++) acc[c2] += w * values[kvh * d + c2];
            }
            if (n_live == 0) {
                CHECK(isinf(lse[(size_t)i * nq + h]) && lse[(size_t)i * nq + h] < 0);
                continue;
            }
            CHECK_NEAR(lse[(size_t)i * nq + h], mx + log(sum), 1e-3);
            for (c2 = 0; c2 < d; c2++)
                CHECK_NEAR(out[((size_t)i * nq + h) * d + c2], acc[c2] / sum, 1e-4);
        }
    }
    free(ws);
    free(q);
    free(out);
    free(lse);
    free(keys);
    free(values);
}

/* ---- operations, each on the cache and on the model ---------------------------------------- */

static int32_t ct_pick_seq(ct_model *m) {
    int32_t s, n = 0, ids[CT_MAX_SEQS];
    for (s = 0; s < CT_MAX_SEQS; s++)
        if (m->seqs[s].in_use) ids[n++] = s;
    return n ? ids[test_rng_range(&m->rng, 0, n - 1)] : -1;
}

/* Runs a call that may fail: a failure must leave every byte as it was. */
#define CT_CALL(m, expr, result)                                                                 \
    do {                                                                                         \
        ct_snapshot(m);                                                                          \
        result = (expr);                                                                         \
        if (result != KVMIX_SUCCESS) {                                                           \
            ct_unchanged(m);                                                                     \
            CHECK_MSG(result == KVMIX_ERR_OUT_OF_MEMORY, "%s: %s", #expr,                        \
                      kvmix_result_string(result));                                              \
            (m)->n_oom++;                                                                        \
        } else {                                                                                 \
            (m)->n_ops_ok++;                                                                     \
        }                                                                                        \
    } while (0)

static void ct_op_create(ct_model *m) {
    int32_t s = -1;
    kvmix_result r;
    CT_CALL(m, kvmix_cache_seq_create(&m->cache, &s), r);
    if (r != KVMIX_SUCCESS) return;
    if (!CHECK(s >= 0 && s < CT_MAX_SEQS && !m->seqs[s].in_use)) return;
    m->seqs[s].in_use = 1;
    m->seqs[s].len = 0;
}

static void ct_op_ingest(ct_model *m, int32_t s, int32_t n) {
    ct_seq *q = &m->seqs[s];
    int32_t t, layer, hd = m->desc.n_kv_heads * m->desc.head_dim, *toks;
    float *keys, *values;
    kvmix_cache_precision *prec;
    kvmix_result r;
    if (n > m->desc.max_tokens_per_seq - q->len) n = m->desc.max_tokens_per_seq - q->len;
    if (n <= 0) return;
    toks = (int32_t *)test_alloc((size_t)n * sizeof *toks);
    prec = (kvmix_cache_precision *)test_alloc((size_t)n * sizeof *prec);
    keys = (float *)test_alloc((size_t)n * m->token_floats * sizeof(float));
    values = (float *)test_alloc((size_t)n * m->token_floats * sizeof(float));
    for (t = 0; t < n; t++) {
        toks[t] = ct_new_token(m);
        prec[t] = ct_random_precision(m);
    }
    for (layer = 0; layer < m->desc.n_layers; layer++)
        for (t = 0; t < n; t++) {
            memcpy(keys + ((size_t)layer * n + t) * hd, ct_key(m, toks[t], layer, 0), (size_t)hd * sizeof(float));
            memcpy(values + ((size_t)layer * n + t) * hd, ct_value(m, toks[t], layer, 0), (size_t)hd * sizeof(float));
        }
    if (n == 1 && test_rng_range(&m->rng, 0, 1))
        CT_CALL(m, kvmix_cache_append(&m->cache, s, keys, values, prec[0]), r);
    else
        CT_CALL(m, kvmix_cache_ingest(&m->cache, s, n, keys, values, prec), r);
    if (r == KVMIX_SUCCESS)
        for (t = 0; t < n; t++) {
            int32_t pos = q->len++;
            q->tok[pos] = toks[t];
            q->alive[pos] = 1;
            q->req[pos] = prec[t];
            q->debt_k[pos] = q->debt_v[pos] = 0.0f;
            q->retiered[pos] = 0;
            q->exempt[pos] = 0;
        }
    free(toks);
    free(prec);
    free(keys);
    free(values);
}

static void ct_op_evict(ct_model *m, int32_t s) {
    ct_seq *q = &m->seqs[s];
    int32_t positions[16], n, i;
    if (q->len == 0) return;
    n = test_rng_range(&m->rng, 1, 16);
    for (i = 0; i < n; i++) positions[i] = test_rng_range(&m->rng, 0, q->len - 1);
    if (!CHECK_RESULT(kvmix_cache_evict(&m->cache, s, positions, n), KVMIX_SUCCESS)) return;
    for (i = 0; i < n; i++) q->alive[positions[i]] = 0;
}

static void ct_op_fork(ct_model *m, int32_t s) {
    ct_seq *q = &m->seqs[s], *cq;
    int32_t child = -1, n_prefix = test_rng_range(&m->rng, 0, q->len), i;
    kvmix_result r;
    CT_CALL(m, kvmix_cache_seq_fork(&m->cache, s, n_prefix, &child), r);
    if (r != KVMIX_SUCCESS) return;
    if (!CHECK(child >= 0 && child < CT_MAX_SEQS && !m->seqs[child].in_use)) return;
    cq = &m->seqs[child];
    cq->in_use = 1;
    cq->len = n_prefix;
    memcpy(cq->tok, q->tok, (size_t)n_prefix * sizeof *q->tok);
    memcpy(cq->alive, q->alive, (size_t)n_prefix);
    memcpy(cq->req, q->req, (size_t)n_prefix * sizeof *q->req);
    memcpy(cq->debt_k, q->debt_k, (size_t)n_prefix * sizeof(float));
    memcpy(cq->debt_v, q->debt_v, (size_t)n_prefix * sizeof(float));
    memcpy(cq->retiered, q->retiered, (size_t)n_prefix);
    /* a shared page is sealed by whichever sharer's window passes it first */
    for (i = 0; i < n_prefix; i++) q->exempt[i] = cq->exempt[i] = 1;
}

static void ct_op_finish(ct_model *m, int32_t s) {
    kvmix_result r;
    int32_t i;
    CT_CALL(m, kvmix_cache_seq_finish(&m->cache, s), r);
    if (r == KVMIX_SUCCESS)
        for (i = 0; i < m->seqs[s].len; i++) m->seqs[s].exempt[i] = 1;
}

static void ct_op_free(ct_model *m, int32_t s) {
    CHECK_RESULT(kvmix_cache_seq_free(&m->cache, s), KVMIX_SUCCESS);
    m->seqs[s].in_use = 0;
    m->seqs[s].len = 0;
}

static uint8_t ct_format_ranked(ct_model *m, uint8_t current, int up) {
    for (;;) {
        uint8_t f = ct_formats[test_rng_range(&m->rng, 0, 5)];
        if (up ? ct_rank(f) >= ct_rank(current) : ct_rank(f) <= ct_rank(current)) return f;
    }
}

/* Demotion (up = 0) from the dequantized rows, or upgrade (up = 1) from originals or residuals
   of the rows the model knows (rows no live position uses get zeros). */
static void ct_op_retier(ct_model *m, int32_t s, int up) {
    const kvmix_cache *c = &m->cache;
    ct_seq *q = &m->seqs[s];
    int32_t pos, page, n_rows, layer, h, i, s2, p2, hd = c->desc.n_kv_heads * c->desc.head_dim;
    int32_t d = c->desc.head_dim;
    uint32_t slot;
    kvmix_cache_precision want, old;
    kvmix_cache_rows mode = (kvmix_cache_rows)test_rng_range(&m->rng, 0, 1);
    float *rk = NULL, *rv = NULL, *keys, *values;
    kvmix_result r;
    if (q->len == 0) return;
    pos = test_rng_range(&m->rng, 0, q->len - 1);
    if (!q->alive[pos]) return;
    kvmix_cache_locate(c, s, pos, &slot);
    page = (int32_t)ct_page_of(m, slot);
    if (!c->pages[page].sealed) {
        kvmix_cache_precision p16;
        p16.key_format = p16.value_format = KVMIX_FORMAT_FP16;
        ct_snapshot(m);
        CHECK_RESULT(kvmix_cache_retier(&m->cache, s, pos, p16, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
                     KVMIX_ERR_INVALID_ARGUMENT);
        ct_unchanged(m);
        return;
    }
    old.key_format = c->pages[page].key_format;
    old.value_format = c->pages[page].value_format;
    want.key_format = ct_format_ranked(m, old.key_format, up);
    want.value_format = ct_format_ranked(m, old.value_format, up);
    n_rows = c->pages[page].n_rows;
    keys = (float *)test_alloc((size_t)hd * sizeof(float));
    values = (float *)test_alloc((size_t)hd * sizeof(float));
    if (up) {
        size_t n = (size_t)c->desc.n_layers * n_rows * hd;
        rk = (float *)test_alloc(n * sizeof(float));
        rv = (float *)test_alloc(n * sizeof(float));
        for (i = 0; i < (int32_t)n; i++) rk[i] = rv[i] = 0.0f;
        for (s2 = 0; s2 < CT_MAX_SEQS; s2++) {
            ct_seq *q2 = &m->seqs[s2];
            if (!q2->in_use) continue;
            for (p2 = 0; p2 < q2->len; p2++) {
                uint32_t sl;
                int32_t row;
                if (!q2->alive[p2]) continue;
                kvmix_cache_locate(c, s2, p2, &sl);
                if ((int32_t)ct_page_of(m, sl) != page) continue;
                row = (int32_t)(sl % (uint32_t)c->desc.page_tokens);
                for (layer = 0; layer < c->desc.n_layers; layer++) {
                    kvmix_cache_read(c, s2, p2, layer, keys, values, NULL);
                    for (h = 0; h < c->desc.n_kv_heads; h++)
                        for (i = 0; i < d; i++) {
                            size_t at = (((size_t)layer * n_rows + row) * c->desc.n_kv_heads + h) * d + i;
                            float ok = ct_key(m, q2->tok[p2], layer, h)[i];
                            float ov = ct_value(m, q2->tok[p2], layer, h)[i];
                            rk[at] = mode == KVMIX_CACHE_ROWS_ORIGINAL ? ok : ok - keys[h * d + i];
                            rv[at] = mode == KVMIX_CACHE_ROWS_ORIGINAL ? ov : ov - values[h * d + i];
                        }
                }
            }
        }
    }
    CT_CALL(m, kvmix_cache_retier(&m->cache, s, pos, want, rk, rv, mode), r);
    if (r == KVMIX_SUCCESS) {
        CHECK_EQ_INT(c->pages[page].key_format, want.key_format);
        CHECK_EQ_INT(c->pages[page].value_format, want.value_format);
        for (s2 = 0; s2 < CT_MAX_SEQS; s2++) {
            ct_seq *q2 = &m->seqs[s2];
            if (!q2->in_use) continue;
            for (p2 = 0; p2 < q2->len; p2++) {
                uint32_t sl;
                if (!q2->alive[p2]) continue;
                kvmix_cache_locate(c, s2, p2, &sl);
                if ((int32_t)ct_page_of(m, sl) != page) continue;
                q2->retiered[p2] = 1;
                if (up) {
                    q2->debt_k[p2] = q2->debt_v[p2] = 1e-5f;
                } else {
                    q2->debt_k[p2] += (float)ct_bound(old.key_format);
                    q2->debt_v[p2] += (float)ct_bound(old.value_format);
                }
            }
        }
    }
    free(rk);
    free(rv);
    free(keys);
    free(values);
}

/* ---- the random operation test ------------------------------------------------------------- */

static void ct_random_desc(test_rng *rng, kvmix_cache_desc *d) {
    memset(d, 0, sizeof *d);
    d->n_layers = test_rng_range(rng, 1, 2);
    d->n_kv_heads = test_rng_range(rng, 1, 2);
    d->head_dim = 32 * test_rng_range(rng, 1, 2);
    d->page_tokens = 8 * test_rng_range(rng, 1, 2);
    d->max_seqs = CT_MAX_SEQS;
    d->max_tokens_per_seq = 96;
    d->n_sink = test_rng_range(rng, 0, 1) ? 0 : test_rng_range(rng, 1, d->page_tokens);
    d->n_window = test_rng_range(rng, 0, 2) == 0 ? 0 : test_rng_range(rng, 1, 24);
    d->n_boost = 4 * test_rng_range(rng, 1, 4);
    d->partial = (kvmix_cache_partial)test_rng_range(rng, 1, 2);
    d->granule_bytes = test_rng_range(rng, 0, 1) ? 64 : 256;
    /* room for a few buffer pages: arena exhaustion happens often */
    d->arena_bytes = (size_t)(4 * d->n_layers * d->n_kv_heads * d->page_tokens * d->head_dim) *
                     (size_t)test_rng_range(rng, 3, 14);
}

static void ct_random_run(int32_t config, int32_t n_ops) {
    ct_model m;
    kvmix_cache_desc desc;
    test_rng cfg;
    char stream[64];
    int32_t op, s;
    snprintf(stream, sizeof stream, "cache random %d", (int)config);
    test_rng_init(&cfg, stream);
    ct_random_desc(&cfg, &desc);
    ct_open(&m, &desc, stream);
    for (op = 0; op < n_ops; op++) {
        int32_t kind = test_rng_range(&m.rng, 0, 99);
        s = ct_pick_seq(&m);
        test_context("config %d op %d kind %d seq %d", (int)config, (int)op, (int)kind, (int)s);
        if (s < 0 || kind < 6)
            ct_op_create(&m);
        else if (kind < 30)
            ct_op_ingest(&m, s, test_rng_range(&m.rng, 1, 24));
        else if (kind < 55)
            ct_op_ingest(&m, s, 1);
        else if (kind < 65)
            ct_op_evict(&m, s);
        else if (kind < 73)
            ct_op_fork(&m, s);
        else if (kind < 78)
            ct_op_finish(&m, s);
        else if (kind < 85)
            ct_op_retier(&m, s, 0);
        else if (kind < 91)
            ct_op_retier(&m, s, 1);
        else
            ct_op_free(&m, s);
        ct_verify(&m);
        if (op % 16 == 0) ct_verify_decode(&m);
        if (test_failed_count() > 0) break;
    }
    test_context("config %d: freeing everything", (int)config);
    for (s = 0; s < CT_MAX_SEQS; s++)
        if (m.seqs[s].in_use) ct_op_free(&m, s);
    ct_verify(&m);
    /* no leak: every granule and descriptor is back, the sentinel is still there */
    CHECK_EQ_INT(m.cache.n_free_granules, m.cache.n_granules);
    CHECK_EQ_INT(m.cache.n_free_pages, m.cache.max_pages - 1);
    CHECK_EQ_INT(m.cache.pages[0].refcount, 1);
    CHECK_MSG(m.n_oom > 0 || n_ops < 200, "config %d reached arena exhaustion (%lld times)",
              (int)config, (long long)m.n_oom);
    test_context(NULL);
    ct_close(&m);
}

/* ---- targeted tests ------------------------------------------------------------------------ */

static void ct_small_desc(kvmix_cache_desc *d) {
    memset(d, 0, sizeof *d);
    d->n_layers = 2;
    d->n_kv_heads = 2;
    d->head_dim = 64;
    d->page_tokens = 16;
    d->max_seqs = CT_MAX_SEQS;
    d->max_tokens_per_seq = 96;
    d->arena_bytes = 1 << 20;
}

static void ct_fill(ct_model *m, int32_t s, int32_t n, uint8_t kf, uint8_t vf) {
    int32_t t, hd = m->desc.n_kv_heads * m->desc.head_dim, layer;
    for (t = 0; t < n; t++) {
        int32_t tok = ct_new_token(m), pos = m->seqs[s].len;
        kvmix_cache_precision p;
        float *keys = (float *)test_alloc((size_t)m->token_floats * sizeof(float));
        float *values = (float *)test_alloc((size_t)m->token_floats * sizeof(float));
        for (layer = 0; layer < m->desc.n_layers; layer++) {
            memcpy(keys + (size_t)layer * hd, ct_key(m, tok, layer, 0), (size_t)hd * sizeof(float));
            memcpy(values + (size_t)layer * hd, ct_value(m, tok, layer, 0), (size_t)hd * sizeof(float));
        }
        p.key_format = kf;
        p.value_format = vf;
        CHECK_RESULT(kvmix_cache_append(&m->cache, s, keys, values, p), KVMIX_SUCCESS);
        m->seqs[s].tok[pos] = tok;
        m->seqs[s].alive[pos] = 1;
        m->seqs[s].req[pos] = p;
        m->seqs[s].debt_k[pos] = m->seqs[s].debt_v[pos] = 0.0f;
        m->seqs[s].retiered[pos] = m->seqs[s].exempt[pos] = 0;
        m->seqs[s].len++;
        free(keys);
        free(values);
    }
}

static kvmix_cache_precision ct_format_at(ct_model *m, int32_t s, int32_t pos) {
    kvmix_cache_precision f;
    f.key_format = f.value_format = 0;
    kvmix_cache_read(&m->cache, s, pos, 0, NULL, NULL, &f);
    return f;
}

/* Decode tokens reach 2-bit per-channel keys; sinks and window stay FP16. */
static void test_decode_reaches_2bit(void) {
    ct_model m;
    kvmix_cache_desc d;
    int32_t s = -1, pos;
    ct_small_desc(&d);
    d.n_sink = 4;
    d.n_window = 16;
    d.max_tokens_per_seq = 128;
    ct_open(&m, &d, "cache decode 2bit");
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    ct_fill(&m, s, 4 + 16 * 4, KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2);
    /* pages: sink [0,4), [4,20), [20,36), [36,52), [52,68); the window is the last 16 */
    for (pos = 0; pos < 68; pos++) {
        kvmix_cache_precision f = ct_format_at(&m, s, pos);
        if (pos < 4 || pos >= 52) {
            CHECK_EQ_INT(f.key_format, KVMIX_FORMAT_FP16);
            CHECK_EQ_INT(f.value_format, KVMIX_FORMAT_FP16);
        } else {
            CHECK_EQ_INT(f.key_format, KVMIX_FORMAT_INT2_CHANNEL);
            CHECK_EQ_INT(f.value_format, KVMIX_FORMAT_INT2);
        }
    }
    /* a mixed request within one page: the page takes the highest precision */
    ct_fill(&m, s, 1, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT2);
    ct_fill(&m, s, 15, KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT4);
    ct_fill(&m, s, 16, KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2);
    CHECK_EQ_INT(ct_format_at(&m, s, 52).key_format, KVMIX_FORMAT_INT2_CHANNEL);
    CHECK_EQ_INT(ct_format_at(&m, s, 70).key_format, KVMIX_FORMAT_INT8);
    CHECK_EQ_INT(ct_format_at(&m, s, 70).value_format, KVMIX_FORMAT_INT4);
    ct_verify(&m);
    ct_verify_decode(&m);
    {
        kvmix_cache_stats st;
        kvmix_cache_seq_stats ss;
        CHECK_RESULT(kvmix_cache_stats_get(&m.cache, &st), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_seq_stats_get(&m.cache, s, &ss), KVMIX_SUCCESS);
        CHECK(st.format_bytes[KVMIX_FORMAT_INT2_CHANNEL] > 0 && st.format_bytes[KVMIX_FORMAT_INT8] > 0);
        CHECK(st.bits_per_element > st.arena_bits_per_element && st.arena_bits_per_element > 2.0);
        CHECK_EQ_INT(ss.n_fp16_rows, 4 + 16); /* sinks and the full window page [84, 100) */
        CHECK_EQ_INT(st.n_buffer_pages, 1);
        CHECK_NEAR(ss.attributed_bytes - (double)ss.metadata_bytes, (double)st.arena_used_bytes, 0.5);
    }
    ct_close(&m);
}

/* Fork inside a buffer page (copy on write) and inside a sealed page (a new page, dead rows). */
static void test_fork_sharing(void) {
    ct_model m;
    kvmix_cache_desc d;
    int32_t a = -1, b = -1, c2 = -1;
    uint32_t slot_a, slot_b;
    ct_small_desc(&d);
    ct_open(&m, &d, "cache fork");
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &a), KVMIX_SUCCESS);
    m.seqs[a].in_use = 1;
    ct_fill(&m, a, 16 + 10, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT2);
    ct_op_fork(&m, a); /* random prefix */
    CHECK_RESULT(kvmix_cache_seq_fork(&m.cache, a, 21, &b), KVMIX_SUCCESS);
    {
        ct_seq *qa = &m.seqs[a], *qb = &m.seqs[b];
        qb->in_use = 1;
        qb->len = 21;
        memcpy(qb->tok, qa->tok, 21 * sizeof(int32_t));
        memcpy(qb->alive, qa->alive, 21);
        memcpy(qb->req, qa->req, 21 * sizeof(kvmix_cache_precision));
        memset(qb->debt_k, 0, 21 * sizeof(float));
        memset(qb->debt_v, 0, 21 * sizeof(float));
        memset(qb->retiered, 0, 21);
        memset(qb->exempt, 1, 21);
        memset(qa->exempt, 1, 26);
    }
    kvmix_cache_locate(&m.cache, a, 18, &slot_a);
    kvmix_cache_locate(&m.cache, b, 18, &slot_b);
    CHECK_EQ_UINT(slot_a, slot_b); /* shared buffer page */
    ct_fill(&m, b, 3, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4);
    kvmix_cache_locate(&m.cache, b, 18, &slot_b);
    CHECK(slot_a != slot_b); /* copied on write */
    ct_verify(&m);
    /* a fork inside the sealed first page */
    CHECK_RESULT(kvmix_cache_seq_fork(&m.cache, a, 5, &c2), KVMIX_SUCCESS);
    {
        ct_seq *qa = &m.seqs[a], *qc = &m.seqs[c2];
        qc->in_use = 1;
        qc->len = 5;
        memcpy(qc->tok, qa->tok, 5 * sizeof(int32_t));
        memcpy(qc->alive, qa->alive, 5);
        memcpy(qc->req, qa->req, 5 * sizeof(kvmix_cache_precision));
        memset(qc->debt_k, 0, 5 * sizeof(float));
        memset(qc->debt_v, 0, 5 * sizeof(float));
        memset(qc->retiered, 0, 5);
        memset(qc->exempt, 1, 5);
    }
    ct_fill(&m, c2, 20, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8);
    CHECK_EQ_INT(ct_format_at(&m, c2, 3).key_format, KVMIX_FORMAT_INT4);
    CHECK_EQ_INT(ct_format_at(&m, c2, 6).key_format, KVMIX_FORMAT_INT8);
    ct_verify(&m);
    ct_verify_decode(&m);
    ct_op_free(&m, a);
    ct_verify(&m);
    ct_verify_decode(&m);
    ct_close(&m);
}

/* Demotion rewrites in place: it works with no free byte left. */
static void test_demote_full_arena(void) {
    ct_model m;
    kvmix_cache_desc d;
    int32_t s = -1, t = -1, i;
    kvmix_cache_precision p2;
    kvmix_result r = KVMIX_SUCCESS;
    ct_small_desc(&d);
    d.arena_bytes = 64 * 1024;
    d.granule_bytes = 64;
    ct_open(&m, &d, "cache demote full");
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    ct_fill(&m, s, 32, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8);
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &t), KVMIX_SUCCESS);
    m.seqs[t].in_use = 1;
    for (i = 0; i < 200 && r == KVMIX_SUCCESS; i++) { /* fill until the arena refuses */
        int32_t before = m.seqs[t].len;
        ct_op_ingest(&m, t, 1);
        if (m.seqs[t].len == before) r = KVMIX_ERR_OUT_OF_MEMORY;
    }
    CHECK_RESULT(r, KVMIX_ERR_OUT_OF_MEMORY);
    p2.key_format = KVMIX_FORMAT_INT2_CHANNEL;
    p2.value_format = KVMIX_FORMAT_INT2;
    CHECK_RESULT(kvmix_cache_retier(&m.cache, s, 3, p2, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
                 KVMIX_SUCCESS);
    for (i = 0; i < 16; i++) {
        m.seqs[s].retiered[i] = 1;
        m.seqs[s].debt_k[i] = m.seqs[s].debt_v[i] = (float)ct_bound(KVMIX_FORMAT_INT8);
    }
    CHECK_EQ_INT(ct_format_at(&m, s, 3).key_format, KVMIX_FORMAT_INT2_CHANNEL);
    ct_verify(&m);
    CHECK(m.cache.n_free_granules > 0);
    ct_close(&m);
}

/* Bad inputs are rejected and change nothing. */
static void test_bad_inputs(void) {
    ct_model m;
    kvmix_cache_desc d, bad;
    int32_t s = -1, out = -1, pos[2] = {0, 1000}, n_spans = 0, n_dead = 0;
    float rows[2 * 2 * 64], nan_rows[2 * 2 * 64];
    kvmix_cache_precision p, wrong;
    uint32_t slot;
    size_t bytes;
    kvmix_view view;
    kvmix_view_span spans[4];
    int32_t first[3];
    uint8_t dead[64];
    int i;
    ct_small_desc(&d);
    /* descs */
    CHECK_RESULT(kvmix_cache_desc_resolve(NULL), KVMIX_ERR_NULL_POINTER);
    bad = d; bad.n_layers = 0;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d; bad.head_dim = 48;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_BAD_SHAPE);
    bad = d; bad.page_tokens = 12;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d; bad.n_sink = 17;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d; bad.group_size = 24;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_BAD_SHAPE);
    bad = d; bad.n_boost = 6;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_BAD_SHAPE);
    bad = d; bad.granule_bytes = 100;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d; bad.arena_bytes = 0;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d; bad.partial = (kvmix_cache_partial)7;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d; bad.default_precision.key_format = 9;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_ERR_UNKNOWN_FORMAT);
    bad = d; bad.max_seqs = 1 << 20; bad.max_tokens_per_seq = 1 << 26;
    CHECK_RESULT(kvmix_cache_memory_bytes(&bad, &bytes),
                 sizeof(size_t) >= 8 ? KVMIX_ERR_INVALID_ARGUMENT : KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad), KVMIX_SUCCESS);
    CHECK_EQ_INT(bad.max_pages_per_seq, 96 / 16 + 8);
    CHECK_EQ_INT(bad.default_precision.key_format, KVMIX_FORMAT_INT4);
    CHECK_EQ_UINT(bad.granule_bytes, 256);
    ct_open(&m, &d, "cache bad inputs");
    {
        kvmix_cache other;
        CHECK_RESULT(kvmix_cache_init(&other, &bad, m.memory, m.memory_bytes - 1, m.arena),
                     KVMIX_ERR_BUFFER_TOO_SMALL);
        CHECK_RESULT(kvmix_cache_init(&other, &bad, (uint8_t *)m.memory + 1, m.memory_bytes, m.arena),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_init(&other, &bad, NULL, m.memory_bytes, m.arena),
                     KVMIX_ERR_NULL_POINTER);
    }
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    ct_fill(&m, s, 20, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4);
    for (i = 0; i < 2 * 2 * 64; i++) rows[i] = nan_rows[i] = 0.25f;
    nan_rows[77] = NAN;
    p.key_format = p.value_format = KVMIX_FORMAT_INT4;
    wrong.key_format = 0;
    wrong.value_format = KVMIX_FORMAT_INT4;
    ct_snapshot(&m);
    CHECK_RESULT(kvmix_cache_append(NULL, s, rows, rows, p), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_append(&m.cache, s, NULL, rows, p), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_append(&m.cache, -1, rows, rows, p), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_append(&m.cache, 5, rows, rows, p), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_append(&m.cache, s, rows, rows, wrong), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK_RESULT(kvmix_cache_append(&m.cache, s, nan_rows, rows, p), KVMIX_ERR_BAD_VALUE);
    rows[3] = 70000.0f;
    CHECK_RESULT(kvmix_cache_append(&m.cache, s, rows, rows, p), KVMIX_ERR_BAD_VALUE);
    rows[3] = 0.25f;
    CHECK_RESULT(kvmix_cache_ingest(&m.cache, s, -1, rows, rows, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_ingest(&m.cache, s, 77, rows, rows, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_evict(&m.cache, s, pos, 2), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_evict(&m.cache, s, NULL, 2), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_evict(&m.cache, s, pos, -1), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_seq_fork(&m.cache, s, 21, &out), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_seq_fork(&m.cache, 3, 0, &out), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_seq_free(&m.cache, 3), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_seq_finish(&m.cache, 3), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_retier(&m.cache, s, 18, p, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
                 KVMIX_ERR_INVALID_ARGUMENT); /* the buffer page is not sealed */
    CHECK_RESULT(kvmix_cache_retier(&m.cache, s, 2, wrong, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
                 KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK_RESULT(kvmix_cache_retier(&m.cache, s, 2, p, NULL, NULL, (kvmix_cache_rows)5),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_retier(&m.cache, s, 20, p, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    {
        float *big = (float *)test_alloc(2 * 16 * 2 * 64 * sizeof(float));
        for (i = 0; i < 2 * 16 * 2 * 64; i++) big[i] = 65504.0f;
        kvmix_cache_precision p8;
        p8.key_format = p8.value_format = KVMIX_FORMAT_INT8;
        CHECK_RESULT(kvmix_cache_retier(&m.cache, s, 2, p8, NULL, big, KVMIX_CACHE_ROWS_RESIDUAL),
                     KVMIX_ERR_BAD_VALUE);
        free(big);
    }
    CHECK_RESULT(kvmix_cache_locate(&m.cache, s, 20, &slot), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_read(&m.cache, s, 0, 2, rows, rows, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_view_counts(&m.cache, &s, 1, &n_spans, &n_dead), KVMIX_SUCCESS);
    CHECK_EQ_INT(n_spans, 2);
    CHECK_RESULT(kvmix_cache_view(&m.cache, 0, &s, 1, spans, 1, first, dead, 64, &view),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_RESULT(kvmix_cache_view(&m.cache, 2, &s, 1, spans, 4, first, dead, 64, &view),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_view(&m.cache, 0, &out, 1, spans, 4, first, dead, 64, &view),
                 KVMIX_ERR_INVALID_ARGUMENT);
    {
        uint64_t ws[64];
        float q[4 * 64], o[4 * 64], l[4];
        CHECK_RESULT(kvmix_cache_ref_decode(&m.cache, 0, &s, 1, 4, 0.0f, q, o, l, ws, 8),
                     KVMIX_ERR_BUFFER_TOO_SMALL);
        CHECK_RESULT(kvmix_cache_ref_decode(&m.cache, 0, &s, 1, 3, 0.0f, q, o, l, ws, sizeof ws),
                     KVMIX_ERR_INVALID_ARGUMENT);
    }
    ct_unchanged(&m);
    /* sequences run out */
    for (i = 0; i < CT_MAX_SEQS - 1; i++) CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &out), KVMIX_SUCCESS);
    ct_snapshot(&m);
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &out), KVMIX_ERR_OUT_OF_MEMORY);
    CHECK_RESULT(kvmix_cache_seq_fork(&m.cache, s, 3, &out), KVMIX_ERR_OUT_OF_MEMORY);
    ct_unchanged(&m);
    ct_close(&m);
}

/* The allocator init: everything through the hooks, and back. */
typedef struct ct_counting {
    int64_t live;
} ct_counting;

static void *ct_alloc(size_t bytes, void *user) {
    ((ct_counting *)user)->live++;
    return malloc(bytes);
}

static void ct_free(void *p, void *user) {
    ((ct_counting *)user)->live--;
    free(p);
}

static void test_allocator_init(void) {
    kvmix_cache cache;
    kvmix_cache_desc d;
    kvmix_allocator a;
    ct_counting count;
    int32_t s;
    float rows[2 * 2 * 64];
    kvmix_cache_precision p;
    int i;
    ct_small_desc(&d);
    count.live = 0;
    a.alloc_fn = ct_alloc;
    a.free_fn = ct_free;
    a.user = &count;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, &a), KVMIX_SUCCESS);
    CHECK_EQ_INT(count.live, 2);
    CHECK_EQ_INT(d.page_tokens, 16); /* resolved values written back */
    CHECK_EQ_INT(d.group_size, 32);
    for (i = 0; i < 2 * 2 * 64; i++) rows[i] = (float)i / 256.0f;
    p.key_format = KVMIX_FORMAT_BOOSTED;
    p.value_format = KVMIX_FORMAT_INT2;
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &s), KVMIX_SUCCESS);
    for (i = 0; i < 40; i++) CHECK_RESULT(kvmix_cache_append(&cache, s, rows, rows, p), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    CHECK_EQ_INT(count.live, 0);
    kvmix_cache_deinit(NULL);
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
}

/* Released pages, the not-found case, and the invariant checker seeing damage. */
static void test_release_and_check(void) {
    ct_model m;
    kvmix_cache_desc d;
    int32_t s = -1, positions[16], i;
    kvmix_cache_precision p;
    int64_t free_before;
    ct_small_desc(&d);
    ct_open(&m, &d, "cache release");
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    ct_fill(&m, s, 40, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4);
    free_before = m.cache.n_free_granules;
    for (i = 0; i < 16; i++) positions[i] = 16 + i; /* the whole second page */
    CHECK_RESULT(kvmix_cache_evict(&m.cache, s, positions, 16), KVMIX_SUCCESS);
    for (i = 0; i < 16; i++) m.seqs[s].alive[16 + i] = 0;
    CHECK(m.cache.n_free_granules > free_before); /* returned to the arena */
    CHECK_EQ_INT(m.cache.seqs[s].n_entries, 2);
    p.key_format = p.value_format = KVMIX_FORMAT_INT2;
    ct_snapshot(&m);
    CHECK_RESULT(kvmix_cache_retier(&m.cache, s, 20, p, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
                 KVMIX_ERR_NOT_FOUND);
    ct_unchanged(&m);
    ct_verify(&m);
    m.cache.pages[1].refcount++;
    CHECK_RESULT(kvmix_cache_check(&m.cache), KVMIX_ERR_CORRUPT_DATA);
    m.cache.pages[1].refcount--;
    m.cache.bitmap[0] ^= 1u;
    CHECK_RESULT(kvmix_cache_check(&m.cache), KVMIX_ERR_CORRUPT_DATA);
    m.cache.bitmap[0] ^= 1u;
    m.cache.slots[5] = KVMIX_CACHE_DEAD_SLOT + 1u;
    CHECK_RESULT(kvmix_cache_check(&m.cache), KVMIX_ERR_CORRUPT_DATA);
    m.cache.slots[5] = (uint32_t)m.cache.desc.page_tokens * m.cache.entries[0].page + 5u;
    CHECK_RESULT(kvmix_cache_check(&m.cache), KVMIX_SUCCESS);
    ct_close(&m);
}

void unit_cache(void) {
    int32_t config;
    test_bad_inputs();
    test_allocator_init();
    test_decode_reaches_2bit();
    test_fork_sharing();
    test_demote_full_arena();
    test_release_and_check();
    for (config = 0; config < 24 && test_failed_count() == 0; config++) ct_random_run(config, 400);
}
