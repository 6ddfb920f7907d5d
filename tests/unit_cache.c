/* unit_cache: the paged mixed-precision cache. Random operation sequences (ingest, append,
   reserve, per-layer write, append by layers, evict, fork, finish, demote, upgrade, free) checked
   after every step against a plain model of what each sequence holds, rows written per layer
   included; failed calls compared byte for byte with the state before them; views and the
   reference decode of every layer against attention over the read-back rows; bad inputs. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CT_MAX_SEQS   6
#define CT_MAX_LAYERS 4

static const uint8_t ct_formats[6] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                      KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
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
    int32_t *tok;                   /* [max_tokens] pool index of each position */
    uint8_t *alive;                 /* [max_tokens] */
    kvmix_cache_precision *req;     /* [max_tokens] requested formats */
    float *debt_k, *debt_v;         /* [max_tokens] error carried over from earlier quantizations */
    uint8_t *retiered;              /* [max_tokens] its page was re-tiered: no format promise */
    uint8_t *exempt;                /* [max_tokens] no window promise (finished, shared) */
    int32_t written[CT_MAX_LAYERS]; /* positions with rows, per layer */
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
    CHECK_RESULT(kvmix_cache_memory_bytes(&m->desc, &m->memory_bytes, NULL), KVMIX_SUCCESS);
    m->memory = test_alloc(m->memory_bytes);
    m->arena_bytes = desc->arena_bytes;
    m->arena = test_alloc(m->arena_bytes);
    test_poison(m->memory, m->memory_bytes, 1);
    test_poison(m->arena, m->arena_bytes, 2);
    CHECK_RESULT(kvmix_cache_init(&m->cache, &m->desc, m->memory, m->memory_bytes, m->arena, NULL),
                 KVMIX_SUCCESS);
    m->snap_struct = (uint8_t *)test_alloc(sizeof m->cache);
    m->snap_memory = (uint8_t *)test_alloc(m->memory_bytes);
    m->snap_arena = (uint8_t *)test_alloc(m->arena_bytes);
    m->token_floats = m->desc.n_layers * m->desc.n_kv_heads * m->desc.head_dim;
    if (m->desc.n_layers > CT_MAX_LAYERS) {
        printf("ct_open: at most %d layers\n", CT_MAX_LAYERS);
        exit(2);
    }
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

/* Every byte as at the snapshot but the last-error message, which every call that records
   rewrites. */
static int ct_unchanged(ct_model *m) {
    kvmix_cache before;
    memcpy(&before, m->snap_struct, sizeof before);
    memcpy(before.priv.error, m->cache.priv.error, sizeof before.priv.error);
    return CHECK_MEM_EQ(&before, &m->cache, sizeof m->cache) &&
           CHECK_MEM_EQ(m->snap_memory, m->memory, m->memory_bytes) &&
           CHECK_MEM_EQ(m->snap_arena, m->arena, m->arena_bytes);
}

/* A refused call: nothing changed, and the cache says why. */
static void ct_refused(ct_model *m) {
    const char *why = kvmix_cache_last_error(&m->cache);
    CHECK_MSG(why[0] != '\0' && strchr(why, ':') != NULL,
              "a refused call names no argument: \"%s\"", why);
    ct_unchanged(m);
}

/* A new token of random FP16-exact values in [-1, 1]; returns its pool index. */
static int32_t ct_new_token(ct_model *m) {
    int32_t i;
    float *k, *v;
    if (m->n_pool == m->pool_capacity) {
        m->pool_capacity = m->pool_capacity ? 2 * m->pool_capacity : 256;
        m->pool_k =
            (float *)realloc(m->pool_k, (size_t)m->pool_capacity * m->token_floats * sizeof(float));
        m->pool_v =
            (float *)realloc(m->pool_v, (size_t)m->pool_capacity * m->token_floats * sizeof(float));
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

/* Positions written on every layer (the model's n_written). */
static int32_t ct_n_written(const ct_model *m, int32_t s) {
    int32_t layer, least = m->seqs[s].written[0];
    for (layer = 1; layer < m->desc.n_layers; layer++)
        if (m->seqs[s].written[layer] < least) least = m->seqs[s].written[layer];
    return least;
}

static void ct_set_written(ct_model *m, int32_t s, int32_t n) {
    int32_t layer;
    for (layer = 0; layer < CT_MAX_LAYERS; layer++) m->seqs[s].written[layer] = n;
}

/* Every position of a sequence against the model; a row not written yet cannot be read. */
static void ct_verify_seq(ct_model *m, int32_t s) {
    const ct_seq *q = &m->seqs[s];
    const kvmix_cache *c = &m->cache;
    int32_t d = c->desc.head_dim, nh = c->desc.n_kv_heads, pos, layer, h, i, n_alive = 0;
    int32_t n_written = ct_n_written(m, s);
    float keys[4 * 64], values[4 * 64];
    test_context("sequence %d of length %d", (int)s, (int)q->len);
    CHECK_EQ_INT(c->seqs[s].in_use, 1);
    CHECK_EQ_INT(c->seqs[s].n_tokens, q->len);
    CHECK_EQ_INT(c->seqs[s].n_written, n_written);
    for (layer = 0; layer < c->desc.n_layers; layer++)
        CHECK_EQ_INT(c->written[(size_t)s * c->desc.n_layers + layer], q->written[layer]);
    for (pos = 0; pos < q->len; pos++) {
        uint32_t slot = 0xffffffffu;
        kvmix_cache_precision f;
        CHECK_RESULT(kvmix_cache_locate(c, s, pos, &slot), KVMIX_SUCCESS);
        if (!q->alive[pos]) {
            CHECK_EQ_UINT(slot, KVMIX_CACHE_DEAD_SLOT);
            CHECK_RESULT(kvmix_cache_read(c, s, 0, pos, keys, values, &f), KVMIX_ERR_NOT_FOUND);
            continue;
        }
        n_alive++;
        if (!CHECK(slot != KVMIX_CACHE_DEAD_SLOT)) continue;
        for (layer = 0; layer < c->desc.n_layers; layer++) {
            double bk, bv, worst_k = 0.0, worst_v = 0.0;
            if (pos >= q->written[layer]) {
                CHECK_RESULT(kvmix_cache_read(c, s, layer, pos, keys, values, &f),
                             KVMIX_ERR_INVALID_ARGUMENT);
                /* seals, of keys too, wait for the rows */
                CHECK(!c->pages[ct_page_of(m, slot)].sealed &&
                      c->pages[ct_page_of(m, slot)].key_format == KVMIX_FORMAT_FP16);
                continue;
            }
            if (!CHECK_RESULT(kvmix_cache_read(c, s, layer, pos, keys, values, &f), KVMIX_SUCCESS))
                break;
            bk = ct_bound(f.key_format) + q->debt_k[pos];
            bv = ct_bound(f.value_format) + q->debt_v[pos];
            for (h = 0; h < nh; h++) {
                const float *k = ct_key(m, q->tok[pos], layer, h),
                            *v = ct_value(m, q->tok[pos], layer, h);
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
        if (q->retiered[pos] || pos >= n_written) continue;
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
            CHECK_MSG((c->desc.window_values_only || f.key_format == KVMIX_FORMAT_FP16) &&
                          f.value_format == KVMIX_FORMAT_FP16,
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
                    refs +=
                        c->entries[(size_t)s * c->desc.max_pages_per_seq + j].page == (uint32_t)i;
        CHECK_EQ_INT(c->pages[i].refcount, refs);
    }
    CHECK_EQ_INT(c->pages[0].refcount, 1); /* the sentinel */
    for (s = 0; s < CT_MAX_SEQS; s++) {
        CHECK_EQ_INT(c->seqs[s].in_use, m->seqs[s].in_use);
        if (!m->seqs[s].in_use) continue;
        seqs[n_live_seqs++] = s;
        ct_verify_seq(m, s);
    }
    /* a view of each layer flags exactly the dead rows and holds the rows written on that layer:
       live flags per sequence = live positions written on the layer */
    if (n_live_seqs > 0) {
        int32_t n_spans = 0, n_dead = 0, k, layer, pos;
        kvmix_view view;
        kvmix_view_span *spans;
        int32_t first[CT_MAX_SEQS + 1];
        uint8_t *dead;
        CHECK_RESULT(kvmix_cache_view_counts(c, seqs, n_live_seqs, &n_spans, &n_dead),
                     KVMIX_SUCCESS);
        spans = (kvmix_view_span *)test_alloc((size_t)(n_spans + 1) * sizeof *spans);
        dead = (uint8_t *)test_alloc((size_t)n_dead + 1);
        for (layer = 0; layer < c->desc.n_layers; layer++) {
            CHECK_RESULT(kvmix_cache_view(c, seqs, n_live_seqs, layer, spans, n_spans, first, dead,
                                          n_dead, &view),
                         KVMIX_SUCCESS);
            CHECK_RESULT(kvmix_view_check(&view, NULL), KVMIX_SUCCESS);
            for (i = 0; i < n_live_seqs; i++) {
                const ct_seq *q = &m->seqs[seqs[i]];
                int64_t live = 0, want = 0;
                for (k = first[i]; k < first[i + 1]; k++) {
                    int32_t t;
                    for (t = 0; t < spans[k].n_tokens; t++)
                        live += spans[k].dead_index < 0 || !dead[spans[k].dead_index + t];
                }
                for (pos = 0; pos < q->written[layer]; pos++) want += q->alive[pos];
                CHECK_MSG(live == want, "layer %d seq %d: %lld live rows in the view, %lld written",
                          (int)layer, (int)seqs[i], (long long)live, (long long)want);
            }
        }
        free(spans);
        free(dead);
    }
}

/* kvmix_cache_decode and its sizing calls refuse bad arguments, name them, and write nothing. */
static void ct_verify_fast_decode_refusals(ct_model *m, const int32_t *seqs, int32_t n,
                                           int32_t layer, const float *q, void *ws,
                                           size_t ws_bytes) {
    const kvmix_cache *c = &m->cache;
    int32_t nq = 2 * c->desc.n_kv_heads;
    size_t out_bytes = (size_t)n * nq * c->desc.head_dim * sizeof(float), bytes = 7;
    float *out = (float *)test_alloc(out_bytes);
    kvmix_parallel negative;
    kvmix_error why = {NULL, NULL};
    memset(&negative, 0, sizeof negative);
    negative.n_threads = -1;
    test_poison(out, out_bytes, 11);
    CHECK_RESULT(kvmix_cache_decode(&m->cache, seqs, n, layer, nq, 0.0f, NULL, out, NULL, ws,
                                    ws_bytes, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK(strstr(kvmix_cache_last_error(c), "q") != NULL);
    CHECK_RESULT(
        kvmix_cache_decode(&m->cache, seqs, n, layer, 0, 0.0f, q, out, NULL, ws, ws_bytes, NULL),
        KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(strstr(kvmix_cache_last_error(c), "n_q_heads") != NULL);
    CHECK_RESULT(kvmix_cache_decode(&m->cache, seqs, n, c->desc.n_layers, nq, 0.0f, q, out, NULL,
                                    ws, ws_bytes, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(strstr(kvmix_cache_last_error(c), "layer") != NULL);
    CHECK_RESULT(kvmix_cache_decode(&m->cache, seqs, n, layer, nq, 0.0f, q, out, NULL, ws, ws_bytes,
                                    &negative),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(strstr(kvmix_cache_last_error(c), "parallel") != NULL);
    CHECK(test_is_poisoned(out, out_bytes, 11));
    CHECK_RESULT(kvmix_cache_decode_workspace(c, seqs, n, 0, &bytes), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_decode_workspace(c, seqs, n, nq, NULL), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_decode_workspace_max(&c->desc, -1, nq, &bytes, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "n_seqs");
    CHECK_RESULT(kvmix_cache_decode_workspace_max(&c->desc, n, 0, &bytes, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "n_q_heads");
    CHECK_RESULT(kvmix_cache_decode_workspace_max(NULL, n, nq, &bytes, &why),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "desc");
    CHECK(bytes == 7);
    free(out);
}

/* kvmix_cache_decode against the reference's out and lse (want_*): float rounding apart, the
   same numbers, and the same bits on one thread or two. */
static void ct_verify_fast_decode(ct_model *m, const int32_t *seqs, int32_t n, int32_t layer,
                                  const float *q, const float *want, const float *want_lse) {
    const kvmix_cache *c = &m->cache;
    int32_t nq = 2 * c->desc.n_kv_heads, d = c->desc.head_dim, r, i;
    size_t rows = (size_t)n * nq, ws_bytes = 0, max_bytes = 0;
    float *out = (float *)test_alloc(rows * d * sizeof(float));
    float *again = (float *)test_alloc(rows * d * sizeof(float));
    float *lse = (float *)test_alloc(rows * sizeof(float));
    kvmix_parallel two;
    void *ws;
    CHECK_RESULT(kvmix_cache_decode_workspace(c, seqs, n, nq, &ws_bytes), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_decode_workspace_max(&c->desc, n, nq, &max_bytes, NULL),
                 KVMIX_SUCCESS);
    CHECK_MSG(ws_bytes <= max_bytes, "fast decode workspace %zu above its bound %zu", ws_bytes,
              max_bytes);
    ws = test_alloc(ws_bytes);
    CHECK_RESULT(kvmix_cache_decode(&m->cache, seqs, n, layer, nq, 0.0f, q, out, lse, ws,
                                    ws_bytes - 1, NULL),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    ct_verify_fast_decode_refusals(m, seqs, n, layer, q, ws, ws_bytes);
    CHECK_RESULT(
        kvmix_cache_decode(&m->cache, seqs, n, layer, nq, 0.0f, q, out, lse, ws, ws_bytes, NULL),
        KVMIX_SUCCESS);
    for (r = 0; r < (int32_t)rows; r++) {
        double err = 0.0, ref = 0.0;
        for (i = 0; i < d; i++) {
            double x = out[(size_t)r * d + i], y = want[(size_t)r * d + i];
            err += (x - y) * (x - y);
            ref += y * y;
        }
        CHECK_MSG(err <= 1e-10 * ref + 1e-20, "fast decode row %d: NMSE %.3g", (int)r,
                  ref > 0 ? err / ref : err);
        if (isinf(want_lse[r]))
            CHECK(isinf(lse[r]) && lse[r] < 0);
        else
            CHECK_NEAR(lse[r], want_lse[r], 1e-5 * (1.0 + fabs(want_lse[r])));
    }
    memset(&two, 0, sizeof two);
    two.n_threads = 2;
    CHECK_RESULT(
        kvmix_cache_decode(&m->cache, seqs, n, layer, nq, 0.0f, q, again, NULL, ws, ws_bytes, &two),
        KVMIX_SUCCESS);
    CHECK_MEM_EQ(again, out, rows * d * sizeof(float));
    free(out);
    free(again);
    free(lse);
    free(ws);
}

/* Decode attention of a layer through the cache's view against attention over the rows read
   back: the positions written on that layer, the newest included. */
static void ct_verify_decode(ct_model *m, int32_t layer) {
    const kvmix_cache *c = &m->cache;
    int32_t seqs[CT_MAX_SEQS], n = 0, s, i, h, t;
    int32_t nq = 2 * c->desc.n_kv_heads, d = c->desc.head_dim;
    float *q, *out, *lse, *keys, *values;
    size_t ws_bytes = 0, max_bytes = 0;
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
    CHECK_RESULT(kvmix_cache_ref_decode_workspace_max(&c->desc, n, &max_bytes, NULL),
                 KVMIX_SUCCESS);
    CHECK_MSG(ws_bytes <= max_bytes, "decode workspace %zu above its bound %zu", ws_bytes,
              max_bytes);
    ws = test_alloc(ws_bytes + 8);
    CHECK_RESULT(
        kvmix_cache_ref_decode(&m->cache, seqs, n, layer, nq, 0.0f, q, out, lse, ws, ws_bytes),
        KVMIX_SUCCESS);
    { /* an lse not wanted (NULL): the same out, bit for bit */
        size_t out_bytes = (size_t)n * nq * d * sizeof(float);
        float *out_no = (float *)test_alloc(out_bytes);
        test_poison(out_no, out_bytes, 5);
        CHECK_RESULT(kvmix_cache_ref_decode(&m->cache, seqs, n, layer, nq, 0.0f, q, out_no, NULL,
                                            ws, ws_bytes),
                     KVMIX_SUCCESS);
        CHECK_MEM_EQ(out_no, out, out_bytes);
        free(out_no);
    }
    ct_verify_fast_decode(m, seqs, n, layer, q, out, lse);
    for (i = 0; i < n; i++) {
        const ct_seq *cs = &m->seqs[seqs[i]];
        for (h = 0; h < nq; h++) {
            const float *qh = q + ((size_t)i * nq + h) * d;
            double mx = -INFINITY, sum = 0.0, acc[64], scale = 1.0 / sqrt((double)d);
            int32_t kvh = h / 2, c2, n_live = 0;
            for (c2 = 0; c2 < d; c2++) acc[c2] = 0.0;
            for (t = 0; t < cs->written[layer]; t++) { /* pass 1: max logit */
                double dot = 0.0;
                if (!cs->alive[t]) continue;
                kvmix_cache_read(c, seqs[i], layer, t, keys, values, NULL);
                for (c2 = 0; c2 < d; c2++) dot += (double)qh[c2] * keys[kvh * d + c2];
                if (dot * scale > mx) mx = dot * scale;
                n_live++;
            }
            for (t = 0; t < cs->written[layer]; t++) {
                double dot = 0.0, w;
                if (!cs->alive[t]) continue;
                kvmix_cache_read(c, seqs[i], layer, t, keys, values, NULL);
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
#define CT_CALL(m, expr, result)                                                                   \
    do {                                                                                           \
        ct_snapshot(m);                                                                            \
        result = (expr);                                                                           \
        if (result != KVMIX_SUCCESS) {                                                             \
            ct_refused(m);                                                                         \
            CHECK_MSG(result == KVMIX_ERR_OUT_OF_MEMORY, "%s: %s", #expr,                          \
                      kvmix_result_string(result));                                                \
            (m)->n_oom++;                                                                          \
        } else {                                                                                   \
            (m)->n_ops_ok++;                                                                       \
        }                                                                                          \
    } while (0)

static void ct_op_create(ct_model *m) {
    int32_t s = -1;
    kvmix_result r;
    CT_CALL(m, kvmix_cache_seq_create(&m->cache, &s), r);
    if (r != KVMIX_SUCCESS) return;
    if (!CHECK(s >= 0 && s < CT_MAX_SEQS && !m->seqs[s].in_use)) return;
    m->seqs[s].in_use = 1;
    m->seqs[s].len = 0;
    ct_set_written(m, s, 0);
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
    keys = (float *)test_alloc((size_t)n * m->token_floats * sizeof(float));
    prec = (kvmix_cache_precision *)test_alloc((size_t)n * sizeof *prec);
    values = (float *)test_alloc((size_t)n * m->token_floats * sizeof(float));
    for (t = 0; t < n; t++) {
        toks[t] = ct_new_token(m);
        prec[t] = ct_random_precision(m);
    }
    for (layer = 0; layer < m->desc.n_layers; layer++)
        for (t = 0; t < n; t++) {
            memcpy(keys + ((size_t)layer * n + t) * hd, ct_key(m, toks[t], layer, 0),
                   (size_t)hd * sizeof(float));
            memcpy(values + ((size_t)layer * n + t) * hd, ct_value(m, toks[t], layer, 0),
                   (size_t)hd * sizeof(float));
        }
    if (ct_n_written(m, s) < q->len) {
        /* reserved positions without all their rows: no ingest until they are written */
        ct_snapshot(m);
        if (n == 1)
            CHECK_RESULT(kvmix_cache_append(&m->cache, s, keys, values, prec[0]),
                         KVMIX_ERR_INVALID_ARGUMENT);
        else
            CHECK_RESULT(kvmix_cache_ingest(&m->cache, s, n, keys, values, prec),
                         KVMIX_ERR_INVALID_ARGUMENT);
        ct_refused(m);
        r = KVMIX_ERR_INVALID_ARGUMENT;
    } else if (n == 1 && test_rng_range(&m->rng, 0, 1)) {
        CT_CALL(m, kvmix_cache_append(&m->cache, s, keys, values, prec[0]), r);
    } else {
        CT_CALL(m, kvmix_cache_ingest(&m->cache, s, n, keys, values, prec), r);
    }
    if (r == KVMIX_SUCCESS) {
        ct_set_written(m, s, q->len + n);
        for (t = 0; t < n; t++) {
            int32_t pos = q->len++;
            q->tok[pos] = toks[t];
            q->alive[pos] = 1;
            q->req[pos] = prec[t];
            q->debt_k[pos] = q->debt_v[pos] = 0.0f;
            q->retiered[pos] = 0;
            q->exempt[pos] = 0;
        }
    }
    free(toks);
    free(prec);
    free(keys);
    free(values);
}

static void ct_op_evict(ct_model *m, int32_t s) {
    ct_seq *q = &m->seqs[s];
    int32_t positions[16], n, i, n_written = ct_n_written(m, s);
    if (n_written < q->len && test_rng_range(&m->rng, 0, 3) == 0) {
        /* a position not written on every layer cannot be evicted */
        positions[0] = n_written > 0 ? test_rng_range(&m->rng, 0, n_written - 1) : 0;
        positions[1] = test_rng_range(&m->rng, n_written, q->len - 1);
        ct_snapshot(m);
        CHECK_RESULT(kvmix_cache_evict(&m->cache, s, positions, 2), KVMIX_ERR_INVALID_ARGUMENT);
        ct_refused(m);
        return;
    }
    if (n_written == 0) return;
    n = test_rng_range(&m->rng, 1, 16);
    for (i = 0; i < n; i++) positions[i] = test_rng_range(&m->rng, 0, n_written - 1);
    if (!CHECK_RESULT(kvmix_cache_evict(&m->cache, s, positions, n), KVMIX_SUCCESS)) return;
    for (i = 0; i < n; i++) q->alive[positions[i]] = 0;
}

static int32_t ct_fork_at(ct_model *m, int32_t s, int32_t n_prefix);

static void ct_op_fork(ct_model *m, int32_t s) {
    ct_seq *q = &m->seqs[s];
    int32_t child = -1, n_written = ct_n_written(m, s);
    int32_t n_prefix = test_rng_range(&m->rng, 0, n_written);
    if (n_written < q->len && test_rng_range(&m->rng, 0, 3) == 0) {
        /* a prefix with positions not written on every layer cannot be forked */
        ct_snapshot(m);
        CHECK_RESULT(kvmix_cache_seq_fork(&m->cache, s,
                                          test_rng_range(&m->rng, n_written + 1, q->len), &child),
                     KVMIX_ERR_INVALID_ARGUMENT);
        ct_refused(m);
        return;
    }
    ct_fork_at(m, s, n_prefix);
}

/* Forks s at n_prefix (an out-of-memory failure is checked to change nothing); returns the child
   or -1. */
static int32_t ct_fork_at(ct_model *m, int32_t s, int32_t n_prefix) {
    ct_seq *q = &m->seqs[s], *cq;
    int32_t child = -1, i;
    kvmix_result r;
    CT_CALL(m, kvmix_cache_seq_fork(&m->cache, s, n_prefix, &child), r);
    if (r != KVMIX_SUCCESS) return -1;
    if (!CHECK(child >= 0 && child < CT_MAX_SEQS && !m->seqs[child].in_use)) return -1;
    cq = &m->seqs[child];
    cq->in_use = 1;
    cq->len = n_prefix;
    ct_set_written(m, child, n_prefix);
    memcpy(cq->tok, q->tok, (size_t)n_prefix * sizeof *q->tok);
    memcpy(cq->alive, q->alive, (size_t)n_prefix);
    memcpy(cq->req, q->req, (size_t)n_prefix * sizeof *q->req);
    memcpy(cq->debt_k, q->debt_k, (size_t)n_prefix * sizeof(float));
    memcpy(cq->debt_v, q->debt_v, (size_t)n_prefix * sizeof(float));
    memcpy(cq->retiered, q->retiered, (size_t)n_prefix);
    /* a shared page is sealed by whichever sharer's window passes it first */
    for (i = 0; i < n_prefix; i++) q->exempt[i] = cq->exempt[i] = 1;
    return child;
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
    ct_set_written(m, s, 0);
}

/* Keeps a sequence's first n positions (the model forgets the rest). Sealed pages stay sealed,
   so the kept positions lose the window promise. */
static void ct_truncate(ct_model *m, int32_t s, int32_t n) {
    ct_seq *q = &m->seqs[s];
    int32_t layer, i;
    if (!CHECK_RESULT(kvmix_cache_seq_truncate(&m->cache, s, n), KVMIX_SUCCESS)) return;
    q->len = n;
    for (layer = 0; layer < CT_MAX_LAYERS; layer++)
        if (q->written[layer] > n) q->written[layer] = n;
    for (i = 0; i < n; i++) q->exempt[i] = 1;
}

/* A truncation to a random length, or (one time in six) past it or below 0: refused, nothing
   changed. */
static void ct_op_truncate(ct_model *m, int32_t s) {
    int32_t len = m->seqs[s].len;
    if (test_rng_range(&m->rng, 0, 5) == 0) {
        ct_snapshot(m);
        CHECK_RESULT(
            kvmix_cache_seq_truncate(&m->cache, s, test_rng_range(&m->rng, 0, 1) ? -1 : len + 1),
            KVMIX_ERR_INVALID_ARGUMENT);
        ct_refused(m);
        return;
    }
    ct_truncate(m, s, test_rng_range(&m->rng, 0, len));
}

/* Reserves n positions with new pool tokens for their rows, all asking for *as, or (as NULL)
   for random or default precisions. */
static kvmix_result ct_reserve(ct_model *m, int32_t s, int32_t n, const kvmix_cache_precision *as) {
    ct_seq *q = &m->seqs[s];
    kvmix_cache_precision *prec;
    int use_default = !as && test_rng_range(&m->rng, 0, 3) == 0;
    int32_t t, first = -1;
    kvmix_result r;
    if (n > m->desc.max_tokens_per_seq - q->len) n = m->desc.max_tokens_per_seq - q->len;
    if (n <= 0) return KVMIX_ERR_INVALID_ARGUMENT;
    prec = (kvmix_cache_precision *)test_alloc((size_t)n * sizeof *prec);
    for (t = 0; t < n; t++)
        prec[t] = as ? *as : use_default ? m->cache.desc.default_precision : ct_random_precision(m);
    CT_CALL(m, kvmix_cache_reserve(&m->cache, s, n, use_default ? NULL : prec, &first), r);
    if (r == KVMIX_SUCCESS) {
        CHECK_EQ_INT(first, q->len);
        for (t = 0; t < n; t++) {
            int32_t pos = q->len++;
            q->tok[pos] = ct_new_token(m);
            q->alive[pos] = 1;
            q->req[pos] = prec[t];
            q->debt_k[pos] = q->debt_v[pos] = 0.0f;
            q->retiered[pos] = 0;
            q->exempt[pos] = 0;
        }
    }
    free(prec);
    return r;
}

/* A new pool token equal to `base` except on `layer`, which gets fresh values. */
static int32_t ct_new_token_from(ct_model *m, int32_t base, int32_t layer) {
    int32_t tok = ct_new_token(m), l;
    size_t hd = (size_t)m->desc.n_kv_heads * m->desc.head_dim;
    for (l = 0; l < m->desc.n_layers; l++) {
        if (l == layer) continue;
        memcpy((float *)ct_key(m, tok, l, 0), ct_key(m, base, l, 0), hd * sizeof(float));
        memcpy((float *)ct_value(m, tok, l, 0), ct_value(m, base, l, 0), hd * sizeof(float));
    }
    return tok;
}

/* kvmix_cache_write of one layer's rows of positions [first, first + n) from the model's
   tokens; updates the model's written count on success. */
static kvmix_result ct_write_layer(ct_model *m, int32_t s, int32_t layer, int32_t first,
                                   int32_t n) {
    ct_seq *q = &m->seqs[s];
    size_t hd = (size_t)m->desc.n_kv_heads * m->desc.head_dim;
    float *keys = (float *)test_alloc((size_t)n * hd * sizeof(float) + 1);
    float *values = (float *)test_alloc((size_t)n * hd * sizeof(float) + 1);
    kvmix_result r;
    int32_t t;
    for (t = 0; t < n; t++) {
        memcpy(keys + (size_t)t * hd, ct_key(m, q->tok[first + t], layer, 0), hd * sizeof(float));
        memcpy(values + (size_t)t * hd, ct_value(m, q->tok[first + t], layer, 0),
               hd * sizeof(float));
    }
    r = kvmix_cache_write(&m->cache, s, layer, first, n, keys, values);
    if (r == KVMIX_SUCCESS && first + n > q->written[layer]) q->written[layer] = first + n;
    free(keys);
    free(values);
    return r;
}

/* One random write: the next rows of a layer, or a rewrite of rows written before (accepted
   exactly when they are live rows of an FP16 buffer page, keys not sealed either, that only this
   sequence uses). */
static void ct_op_write(ct_model *m, int32_t s) {
    ct_seq *q = &m->seqs[s];
    const kvmix_cache *c = &m->cache;
    int32_t layer = test_rng_range(&m->rng, 0, m->desc.n_layers - 1), first, n, t, end;
    int valid = 1;
    kvmix_result r;
    for (t = 0; t < m->desc.n_layers && q->written[layer] == q->len; t++)
        layer = (layer + 1) % m->desc.n_layers; /* prefer a layer with rows to write */
    first = q->written[layer];
    if (q->written[layer] > 0 && test_rng_range(&m->rng, 0, 3) == 0)
        first = test_rng_range(&m->rng, q->written[layer] > 4 ? q->written[layer] - 4 : 0,
                               q->written[layer] - 1);
    if (first >= q->len) return;
    n = test_rng_range(&m->rng, 1, q->len - first);
    end = first + n < q->written[layer] ? first + n : q->written[layer];
    for (t = first; t < end; t++) {
        uint32_t slot = 0;
        const kvmix_cache_page *p;
        kvmix_cache_locate(c, s, t, &slot);
        p = &c->pages[ct_page_of(m, slot)];
        valid &= slot != KVMIX_CACHE_DEAD_SLOT && !p->sealed &&
                 p->key_format == KVMIX_FORMAT_FP16 && p->refcount == 1;
    }
    if (valid)
        for (t = first; t < end; t++) q->tok[t] = ct_new_token_from(m, q->tok[t], layer);
    ct_snapshot(m);
    r = ct_write_layer(m, s, layer, first, n);
    CHECK_RESULT(r, valid ? KVMIX_SUCCESS : KVMIX_ERR_INVALID_ARGUMENT);
    if (r != KVMIX_SUCCESS) ct_refused(m);
}

/* A decode step as an inference loop runs it: reserve, then per layer write the rows and check
   that the layer's reads, view and decode see the new positions while the next layer's do not. */
static void ct_op_append_layers(ct_model *m, int32_t s, int32_t n) {
    ct_seq *q = &m->seqs[s];
    const kvmix_cache *c = &m->cache;
    float keys[4 * 64], values[4 * 64];
    int32_t layer, last, hd = m->desc.n_kv_heads * m->desc.head_dim, i;
    if (ct_reserve(m, s, n, NULL) != KVMIX_SUCCESS) return;
    last = q->len - 1;
    for (layer = 0; layer < c->desc.n_layers; layer++) {
        int32_t from = q->written[layer], split;
        CHECK_RESULT(kvmix_cache_read(c, s, layer, last, keys, values, NULL),
                     KVMIX_ERR_INVALID_ARGUMENT);
        split = test_rng_range(&m->rng, from, q->len);
        if (split > from)
            CHECK_RESULT(ct_write_layer(m, s, layer, from, split - from), KVMIX_SUCCESS);
        if (q->len > split)
            CHECK_RESULT(ct_write_layer(m, s, layer, split, q->len - split), KVMIX_SUCCESS);
        /* the new rows are FP16 buffer rows: read back exactly */
        if (CHECK_RESULT(kvmix_cache_read(c, s, layer, last, keys, values, NULL), KVMIX_SUCCESS))
            for (i = 0; i < hd; i++) {
                CHECK_EQ_FLOAT_BITS(keys[i], ct_key(m, q->tok[last], layer, 0)[i]);
                CHECK_EQ_FLOAT_BITS(values[i], ct_value(m, q->tok[last], layer, 0)[i]);
            }
        if (layer + 1 < c->desc.n_layers && q->written[layer + 1] <= last)
            CHECK_RESULT(kvmix_cache_read(c, s, layer + 1, last, keys, values, NULL),
                         KVMIX_ERR_INVALID_ARGUMENT);
        ct_verify(m); /* views of every layer: this one holds the new rows, later ones do not */
        ct_verify_decode(m, layer);
    }
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
        CHECK_RESULT(
            kvmix_cache_retier(&m->cache, s, pos, p16, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
            KVMIX_ERR_INVALID_ARGUMENT);
        ct_refused(m);
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
                    kvmix_cache_read(c, s2, layer, p2, keys, values, NULL);
                    for (h = 0; h < c->desc.n_kv_heads; h++)
                        for (i = 0; i < d; i++) {
                            size_t at =
                                (((size_t)layer * n_rows + row) * c->desc.n_kv_heads + h) * d + i;
                            float ok = ct_key(m, q2->tok[p2], layer, h)[i];
                            float ov = ct_value(m, q2->tok[p2], layer, h)[i];
                            rk[at] = mode == KVMIX_CACHE_ROWS_ORIGINAL ? ok : ok - keys[h * d + i];
                            rv[at] =
                                mode == KVMIX_CACHE_ROWS_ORIGINAL ? ov : ov - values[h * d + i];
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

/* ---- incremental views ---------------------------------------------------------------------- */

/* What a loop keeps of layer 0's view from step to step: each sequence's spans (and the dead
   flags of each span), brought up to date with kvmix_cache_view_changes and
   kvmix_cache_view_seq. */
typedef struct ct_kept_view {
    int32_t stride;         /* spans a sequence can have */
    int32_t n[CT_MAX_SEQS]; /* spans kept */
    kvmix_view_span *spans; /* [CT_MAX_SEQS][stride] */
    uint8_t *flags;         /* [CT_MAX_SEQS][stride][page_tokens] */
    uint8_t *scratch;       /* [stride * page_tokens] */
} ct_kept_view;

static void ct_kept_open(ct_kept_view *k, const kvmix_cache *c) {
    size_t rows = (size_t)c->desc.max_pages_per_seq * (size_t)c->desc.page_tokens;
    memset(k, 0, sizeof *k);
    k->stride = c->desc.max_pages_per_seq;
    k->spans = (kvmix_view_span *)test_alloc((size_t)CT_MAX_SEQS * k->stride * sizeof *k->spans);
    k->flags = (uint8_t *)test_alloc((size_t)CT_MAX_SEQS * rows);
    k->scratch = (uint8_t *)test_alloc(rows);
}

static void ct_kept_close(ct_kept_view *k) {
    free(k->spans);
    free(k->flags);
    free(k->scratch);
}

/* Spans of seq from entry `from` into spans, each span's dead flags to flags[span]. */
static int32_t ct_view_from(const kvmix_cache *c, int32_t seq, int32_t from, int32_t stride,
                            kvmix_view_span *spans, uint8_t *flags, uint8_t *scratch) {
    int32_t n = 0, nd = 0, j, pt = c->desc.page_tokens;
    if (!CHECK_RESULT(kvmix_cache_view_seq(c, seq, 0, from, spans, stride - from, scratch,
                                           stride * pt, 0, &n, &nd),
                      KVMIX_SUCCESS))
        return 0;
    for (j = 0; j < n; j++)
        if (spans[j].dead_index >= 0)
            memcpy(flags + (size_t)j * pt, scratch + spans[j].dead_index,
                   (size_t)spans[j].n_tokens);
    return n;
}

/* Brings seq's kept spans up to date (rebuilding from the first changed entry), then checks them
   against its spans built whole. */
static void ct_kept_step(ct_model *m, ct_kept_view *k, int32_t seq) {
    const kvmix_cache *c = &m->cache;
    int32_t from = -1, n, j, pt = c->desc.page_tokens;
    kvmix_view_span *kept = k->spans + (size_t)seq * k->stride, *whole;
    uint8_t *kept_flags = k->flags + (size_t)seq * k->stride * pt, *whole_flags;
    if (!CHECK_RESULT(kvmix_cache_view_changes(&m->cache, seq, &from), KVMIX_SUCCESS)) return;
    if (from > k->n[seq]) from = k->n[seq];
    k->n[seq] = from + ct_view_from(c, seq, from, k->stride, kept + from,
                                    kept_flags + (size_t)from * pt, k->scratch);
    whole = (kvmix_view_span *)test_alloc((size_t)k->stride * sizeof *whole);
    whole_flags = (uint8_t *)test_alloc((size_t)k->stride * pt);
    n = ct_view_from(c, seq, 0, k->stride, whole, whole_flags, k->scratch);
    CHECK_EQ_INT(k->n[seq], n);
    for (j = 0; j < n && j < k->n[seq]; j++) {
        const kvmix_view_span *a = &kept[j], *b = &whole[j];
        CHECK_MSG(a->key_offset == b->key_offset && a->value_offset == b->value_offset &&
                      a->key_head_bytes == b->key_head_bytes &&
                      a->value_head_bytes == b->value_head_bytes && a->n_tokens == b->n_tokens &&
                      a->key_format == b->key_format && a->value_format == b->value_format &&
                      (a->dead_index >= 0) == (b->dead_index >= 0),
                  "seq %d: kept span %d is not the span built whole (entry changed unseen)",
                  (int)seq, (int)j);
        if (a->dead_index >= 0 && b->dead_index >= 0)
            CHECK(memcmp(kept_flags + (size_t)j * pt, whole_flags + (size_t)j * pt,
                         (size_t)b->n_tokens) == 0);
    }
    free(whole);
    free(whole_flags);
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
    d->window_values_only = test_rng_range(rng, 0, 1);
    /* keys and values in groups of their own: 16 or 32 channels, or the default */
    d->group_size = 16 * test_rng_range(rng, 0, 2);
    d->value_group_size = 16 * test_rng_range(rng, 0, 2);
    d->n_boost = 4 * test_rng_range(rng, 1, 4);
    d->partial = (kvmix_cache_partial)test_rng_range(rng, 1, 2);
    d->granule_bytes = test_rng_range(rng, 0, 1) ? 64 : 256;
    /* room for a few buffer pages: arena exhaustion happens often */
    d->arena_bytes = (size_t)(4 * d->n_layers * d->n_kv_heads * d->page_tokens * d->head_dim) *
                     (size_t)test_rng_range(rng, 3, 14);
}

static void ct_random_run(int32_t config, int32_t n_ops) {
    ct_model m;
    ct_kept_view kept;
    kvmix_cache_desc desc;
    test_rng cfg;
    char stream[64];
    int32_t op, s;
    snprintf(stream, sizeof stream, "cache random %d", (int)config);
    test_rng_init(&cfg, stream);
    ct_random_desc(&cfg, &desc);
    ct_open(&m, &desc, stream);
    ct_kept_open(&kept, &m.cache);
    for (op = 0; op < n_ops; op++) {
        int32_t kind = test_rng_range(&m.rng, 0, 131);
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
        else if (kind < 96)
            ct_op_free(&m, s);
        else if (kind < 100) /* runs: a page holds one, a change closes the page being filled */
            CHECK_RESULT(
                kvmix_cache_seq_set_run(&m.cache, s, (uint32_t)test_rng_range(&m.rng, 0, 3)),
                KVMIX_SUCCESS);
        else if (kind < 106)
            ct_reserve(&m, s, test_rng_range(&m.rng, 1, 16), NULL);
        else if (kind < 112)
            ct_op_write(&m, s);
        else if (kind < 124)
            ct_op_append_layers(&m, s, test_rng_range(&m.rng, 1, 3));
        else
            ct_op_truncate(&m, s);
        ct_verify(&m);
        for (s = 0; s < CT_MAX_SEQS; s++) /* a loop's kept views, some steps apart */
            if (m.seqs[s].in_use && test_rng_range(&m.rng, 0, 2) == 0) ct_kept_step(&m, &kept, s);
        if (op % 16 == 0) ct_verify_decode(&m, test_rng_range(&m.rng, 0, m.desc.n_layers - 1));
        if (test_failed_count() > 0) break;
    }
    test_context("config %d: freeing everything", (int)config);
    for (s = 0; s < CT_MAX_SEQS; s++)
        if (m.seqs[s].in_use) ct_op_free(&m, s);
    ct_verify(&m);
    /* no leak: every granule and descriptor is back, the sentinel is still there */
    CHECK_EQ_INT(m.cache.priv.n_free_granules, m.cache.priv.n_granules);
    CHECK_EQ_INT(m.cache.priv.n_free_pages, m.cache.max_pages - 1);
    CHECK_EQ_INT(m.cache.pages[0].refcount, 1);
    CHECK_MSG(m.n_oom > 0 || n_ops < 200, "config %d reached arena exhaustion (%lld times)",
              (int)config, (long long)m.n_oom);
    test_context(NULL);
    ct_kept_close(&kept);
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
    d->n_boost = 16; /* for the BOOSTED keys some tests ask for */
    d->arena_bytes = 1 << 20;
}

/* Appends pool tokens toks[0 .. n - 1] to s, each asking for (kf, vf). */
static void ct_feed(ct_model *m, int32_t s, const int32_t *toks, int32_t n, uint8_t kf,
                    uint8_t vf) {
    int32_t t, hd = m->desc.n_kv_heads * m->desc.head_dim, layer;
    for (t = 0; t < n; t++) {
        int32_t tok = toks[t], pos = m->seqs[s].len;
        kvmix_cache_precision p;
        float *keys = (float *)test_alloc((size_t)m->token_floats * sizeof(float));
        float *values = (float *)test_alloc((size_t)m->token_floats * sizeof(float));
        for (layer = 0; layer < m->desc.n_layers; layer++) {
            memcpy(keys + (size_t)layer * hd, ct_key(m, tok, layer, 0), (size_t)hd * sizeof(float));
            memcpy(values + (size_t)layer * hd, ct_value(m, tok, layer, 0),
                   (size_t)hd * sizeof(float));
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
        ct_set_written(m, s, m->seqs[s].len);
        free(keys);
        free(values);
    }
}

static void ct_fill(ct_model *m, int32_t s, int32_t n, uint8_t kf, uint8_t vf) {
    int32_t t;
    for (t = 0; t < n; t++) {
        int32_t tok = ct_new_token(m);
        ct_feed(m, s, &tok, 1, kf, vf);
    }
}

static kvmix_cache_precision ct_format_at(ct_model *m, int32_t s, int32_t pos) {
    kvmix_cache_precision f;
    f.key_format = f.value_format = 0;
    kvmix_cache_read(&m->cache, s, 0, pos, NULL, NULL, &f);
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
    ct_verify_decode(&m, m.desc.n_layers - 1);
    {
        kvmix_cache_stats st;
        kvmix_cache_seq_stats ss;
        CHECK_RESULT(kvmix_cache_stats_get(&m.cache, &st), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_seq_stats_get(&m.cache, s, &ss), KVMIX_SUCCESS);
        CHECK(st.format_bytes[KVMIX_FORMAT_INT2_CHANNEL] > 0 &&
              st.format_bytes[KVMIX_FORMAT_INT8] > 0);
        CHECK(st.bits_per_element > st.arena_bits_per_element && st.arena_bits_per_element > 2.0);
        CHECK_EQ_INT(ss.n_fp16_rows, 4 + 16); /* sinks and the full window page [84, 100) */
        CHECK_EQ_INT(st.n_buffer_pages, 1);
        CHECK_NEAR(ss.attributed_bytes - (double)ss.metadata_bytes, (double)st.arena_used_bytes,
                   0.5);
    }
    ct_close(&m);
}

/* Fork inside a buffer page (copy on write) and inside a sealed page (a new page, dead rows). */
/* A values-only window (Kitty): keys are sealed once their page is full and written, values
   stay FP16 until their page leaves the window; then the page is sealed whole, its keys copied as
   they are. Sinks and the page being filled stay FP16. */
static void test_values_only_window(void) {
    ct_model m;
    kvmix_cache_desc d;
    int32_t s = -1, pos, row;
    uint8_t *before;
    size_t key_bytes;
    ct_small_desc(&d);
    d.n_sink = 4;
    d.n_window = 32;
    d.window_values_only = 1;
    d.max_tokens_per_seq = 128;
    ct_open(&m, &d, "cache values-only window");
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    ct_fill(&m, s, 4 + 16 * 4 + 5, KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2);
    /* pages: sink [0,4), [4,20), [20,36), [36,52), [52,68), the page being filled [68,73); the
       window is the last 32 positions, so [36,52) and [52,68) hold FP16 values */
    for (pos = 0; pos < 73; pos++) {
        kvmix_cache_precision f = ct_format_at(&m, s, pos);
        int sink_or_tail = pos < 4 || pos >= 68, window = pos >= 36;
        test_context("position %d", (int)pos);
        CHECK_EQ_INT(f.key_format, sink_or_tail ? KVMIX_FORMAT_FP16 : KVMIX_FORMAT_BOOSTED);
        CHECK_EQ_INT(f.value_format,
                     sink_or_tail || window ? KVMIX_FORMAT_FP16 : KVMIX_FORMAT_INT2);
    }
    test_context(NULL);
    {
        kvmix_cache_seq_stats ss;
        CHECK_RESULT(kvmix_cache_seq_stats_get(&m.cache, s, &ss), KVMIX_SUCCESS);
        CHECK_EQ_INT(ss.n_fp16_rows, 4 + 5);
        CHECK_EQ_INT(ss.n_fp16_key_rows, 4 + 5);
        CHECK_EQ_INT(ss.n_fp16_value_rows, 4 + 32 + 5);
    }
    ct_verify(&m);
    ct_verify_decode(&m, m.desc.n_layers - 1);
    /* the keys of [36,52) are sealed once: leaving the window copies them, bytes unchanged */
    {
        const kvmix_cache_page *p = &m.cache.pages[ct_page_of(&m, m.cache.slots[s * 128 + 36])];
        kvmix_layout l = test_layout(KVMIX_FORMAT_BOOSTED, 16, 64, 0, m.cache.desc.n_boost);
        CHECK_RESULT(kvmix_layout_bytes(&l, &key_bytes), KVMIX_SUCCESS);
        CHECK(!p->sealed);
        before = (uint8_t *)test_alloc(key_bytes);
        memcpy(before, m.cache.arena + p->offset, key_bytes); /* layer 0, head 0 */
    }
    ct_fill(&m, s, 16, KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2);
    {
        const kvmix_cache_page *p = &m.cache.pages[ct_page_of(&m, m.cache.slots[s * 128 + 36])];
        CHECK(p->sealed && p->value_format == KVMIX_FORMAT_INT2);
        CHECK_MEM_EQ(m.cache.arena + p->offset, before, key_bytes);
    }
    for (row = 36; row < 52; row++)
        CHECK_EQ_INT(ct_format_at(&m, s, row).value_format, KVMIX_FORMAT_INT2);
    /* a rewrite of a row whose keys are sealed is refused */
    {
        float *k = (float *)test_alloc(2 * 64 * sizeof(float));
        float *v = (float *)test_alloc(2 * 64 * sizeof(float));
        memset(k, 0, 2 * 64 * sizeof(float));
        memset(v, 0, 2 * 64 * sizeof(float));
        CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 60, 1, k, v), KVMIX_ERR_INVALID_ARGUMENT);
        free(k);
        free(v);
    }
    ct_verify(&m);
    ct_verify_decode(&m, 0);
    free(before);
    ct_close(&m);
}

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
        ct_set_written(&m, b, 21);
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
        ct_set_written(&m, c2, 5);
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
    ct_verify_decode(&m, m.desc.n_layers - 1);
    ct_op_free(&m, a);
    ct_verify(&m);
    ct_verify_decode(&m, m.desc.n_layers - 1);
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
    CHECK(m.cache.priv.n_free_granules > 0);
    ct_close(&m);
}

static int ct_sealed_at(ct_model *m, int32_t s, int32_t pos) {
    uint32_t slot = 0;
    kvmix_cache_locate(&m->cache, s, pos, &slot);
    return m->cache.pages[ct_page_of(m, slot)].sealed;
}

/* One decode query per kv head against layer `layer` of sequence s: out [H][D], lse [H]. */
static void ct_decode_one(ct_model *m, int32_t s, int32_t layer, const float *q, float *out,
                          float *lse) {
    size_t ws_bytes = 0;
    void *ws;
    CHECK_RESULT(kvmix_cache_ref_decode_workspace(&m->cache, &s, 1, &ws_bytes), KVMIX_SUCCESS);
    ws = test_alloc(ws_bytes + 8);
    CHECK_RESULT(kvmix_cache_ref_decode(&m->cache, &s, 1, layer, m->desc.n_kv_heads, 0.0f, q, out,
                                        lse, ws, ws_bytes),
                 KVMIX_SUCCESS);
    free(ws);
}

/* Reserve, then write by layer: pages are sealed only once all their rows are written on every
   layer (by the next reserve or finish), and the decode of each layer sees a new token as soon
   as that layer's rows are written, and not before. */
static void test_reserve_write(void) {
    ct_model m;
    kvmix_cache_desc d;
    kvmix_cache_precision p4;
    int32_t s = -1, pos, layer, h, i, tok, nh, dim;
    float q[2 * 64], out[2 * 64], lse[2];
    ct_small_desc(&d); /* 2 layers, 2 kv heads, head_dim 64, pages of 16, no window */
    ct_open(&m, &d, "cache reserve write");
    nh = m.desc.n_kv_heads;
    dim = m.desc.head_dim;
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    p4.key_format = p4.value_format = KVMIX_FORMAT_INT4;
    /* 16 decode steps fill the first page; the next reserve seals it */
    for (pos = 0; pos < 16; pos++) {
        CHECK_RESULT(ct_reserve(&m, s, 1, &p4), KVMIX_SUCCESS);
        for (layer = 0; layer < 2; layer++)
            CHECK_RESULT(ct_write_layer(&m, s, layer, pos, 1), KVMIX_SUCCESS);
    }
    CHECK(!ct_sealed_at(&m, s, 0));
    CHECK_RESULT(ct_reserve(&m, s, 1, &p4), KVMIX_SUCCESS);
    CHECK(ct_sealed_at(&m, s, 0));
    CHECK_EQ_INT(ct_format_at(&m, s, 0).key_format, KVMIX_FORMAT_INT4);
    for (layer = 0; layer < 2; layer++)
        CHECK_RESULT(ct_write_layer(&m, s, layer, 16, 1), KVMIX_SUCCESS);
    ct_verify(&m);
    /* a full page with a layer not written stays FP16 through reserves and finish */
    CHECK_RESULT(ct_reserve(&m, s, 15, &p4), KVMIX_SUCCESS); /* [17, 32): the second page is full */
    CHECK_RESULT(ct_write_layer(&m, s, 0, 17, 15), KVMIX_SUCCESS);
    CHECK_RESULT(ct_reserve(&m, s, 16, &p4), KVMIX_SUCCESS); /* [32, 48) */
    CHECK(!ct_sealed_at(&m, s, 16));
    CHECK_RESULT(kvmix_cache_seq_finish(&m.cache, s), KVMIX_SUCCESS);
    CHECK(!ct_sealed_at(&m, s, 16) && !ct_sealed_at(&m, s, 32));
    CHECK_EQ_INT(m.cache.seqs[s].n_written, 17);
    ct_verify(&m);
    for (layer = 0; layer < 2; layer++) ct_verify_decode(&m, layer);
    CHECK_RESULT(ct_write_layer(&m, s, 1, 17, 31), KVMIX_SUCCESS);
    CHECK_RESULT(ct_write_layer(&m, s, 0, 32, 16), KVMIX_SUCCESS);
    CHECK(!ct_sealed_at(&m, s, 16)); /* write never seals */
    CHECK_RESULT(kvmix_cache_seq_finish(&m.cache, s), KVMIX_SUCCESS);
    for (i = 0; i < m.seqs[s].len; i++) m.seqs[s].exempt[i] = 1;
    CHECK(ct_sealed_at(&m, s, 16) && ct_sealed_at(&m, s, 32));
    CHECK_EQ_INT(ct_format_at(&m, s, 40).value_format, KVMIX_FORMAT_INT4);
    ct_verify(&m);
    /* a new token whose key dominates a query: each layer's decode weighs it once written */
    CHECK_RESULT(ct_reserve(&m, s, 1, &p4), KVMIX_SUCCESS); /* position 48 */
    tok = m.seqs[s].tok[48];
    for (layer = 0; layer < 2; layer++)
        for (h = 0; h < nh; h++) {
            float *k = (float *)ct_key(&m, tok, layer, h);
            for (i = 0; i < dim; i++) k[i] = 0.0f;
            k[0] = 64.0f;
        }
    for (i = 0; i < nh * dim; i++) q[i] = i % dim == 0 ? 1.0f : 0.0f;
    for (layer = 0; layer < 2; layer++) {
        /* logits of the other tokens are at most 1/8: lse <= 1/8 + log 48 */
        ct_decode_one(&m, s, layer, q, out, lse);
        for (h = 0; h < nh; h++)
            CHECK_MSG(lse[h] < 4.5f, "layer %d before its write: lse %g", (int)layer, lse[h]);
        CHECK_RESULT(ct_write_layer(&m, s, layer, 48, 1), KVMIX_SUCCESS);
        ct_decode_one(&m, s, layer, q, out, lse);
        for (h = 0; h < nh; h++) {
            const float *v = ct_value(&m, tok, layer, h);
            CHECK_MSG(lse[h] > 7.9f, "layer %d after its write: lse %g", (int)layer, lse[h]);
            for (i = 0; i < dim; i++) CHECK_NEAR(out[h * dim + i], v[i], 0.05);
        }
        if (layer + 1 < 2) {
            ct_decode_one(&m, s, layer + 1, q, out, lse);
            for (h = 0; h < nh; h++) CHECK(lse[h] < 4.5f);
        }
        ct_verify(&m);
        ct_verify_decode(&m, layer);
    }
    ct_close(&m);
}

/* Bad reserves and writes are rejected and change nothing; so are the calls that need every
   layer written (ingest, append, evict, fork) and reads of rows not written. */
static void test_reserve_write_bad_inputs(void) {
    ct_model m;
    kvmix_cache_desc d;
    kvmix_cache_precision p4, wrong;
    int32_t s = -1, child, first = -7, evicted = 17, pos, hd, i;
    float *rows, *bad;
    float one[2 * 2 * 64];
    uint32_t slot;
    ct_small_desc(&d);
    ct_open(&m, &d, "cache reserve write bad");
    hd = m.desc.n_kv_heads * m.desc.head_dim;
    rows = (float *)test_alloc((size_t)3 * hd * sizeof(float));
    bad = (float *)test_alloc((size_t)3 * hd * sizeof(float));
    for (i = 0; i < 3 * hd; i++) rows[i] = bad[i] = 0.25f;
    for (i = 0; i < 2 * hd; i++) one[i] = 0.5f;
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    ct_fill(&m, s, 20, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4); /* [0, 16) sealed, [16, 20) buffer */
    CHECK_RESULT(kvmix_cache_evict(&m.cache, s, &evicted, 1), KVMIX_SUCCESS);
    m.seqs[s].alive[evicted] = 0;
    p4.key_format = p4.value_format = KVMIX_FORMAT_INT4;
    wrong.key_format = KVMIX_FORMAT_INT4;
    wrong.value_format = 7; /* not a kvmix_format (0 is the default) */
    ct_snapshot(&m);
    CHECK_RESULT(kvmix_cache_reserve(NULL, s, 1, NULL, &first), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_reserve(&m.cache, -1, 1, NULL, &first), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_reserve(&m.cache, 4, 1, NULL, &first), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_reserve(&m.cache, s, -1, NULL, &first), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_reserve(&m.cache, s, 77, NULL, &first), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_reserve(&m.cache, s, 1, &wrong, &first), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK_EQ_INT(first, -7);
    ct_unchanged(&m);
    CHECK_RESULT(kvmix_cache_reserve(&m.cache, s, 0, NULL, &first), KVMIX_SUCCESS);
    CHECK_EQ_INT(first, 20);
    ct_unchanged(&m);
    CHECK_RESULT(ct_reserve(&m, s, 2, &p4), KVMIX_SUCCESS); /* positions 20, 21 */
    ct_snapshot(&m);
    /* writes */
    CHECK_RESULT(kvmix_cache_write(NULL, s, 0, 20, 2, rows, rows), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_write(&m.cache, 3, 0, 20, 2, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, -1, 20, 2, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 2, 20, 2, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, 3, rows, rows),
                 KVMIX_ERR_INVALID_ARGUMENT); /* 22 not reserved */
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 22, 1, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 21, 1, rows, rows),
                 KVMIX_ERR_INVALID_ARGUMENT); /* a gap */
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, -1, 1, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, -1, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 1, 3, 1, rows, rows),
                 KVMIX_ERR_INVALID_ARGUMENT); /* sealed */
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 16, 3, rows, rows),
                 KVMIX_ERR_INVALID_ARGUMENT); /* 17 evicted */
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, 2, NULL, rows), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, 2, rows, NULL), KVMIX_ERR_NULL_POINTER);
    bad[2 * hd - 1] = NAN; /* the last row of position 21 */
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, 2, rows, bad), KVMIX_ERR_BAD_VALUE);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 1, 19, 3, bad, rows),
                 KVMIX_ERR_BAD_VALUE); /* a rewrite of 19 too */
    bad[2 * hd - 1] = -INFINITY;
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, 2, bad, rows), KVMIX_ERR_BAD_VALUE);
    bad[2 * hd - 1] = 70000.0f;
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, 2, bad, rows), KVMIX_ERR_BAD_VALUE);
    /* calls that need every layer written; reads of rows not written */
    CHECK_RESULT(kvmix_cache_read(&m.cache, s, 0, 20, rows, rows, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_read(&m.cache, s, 1, 21, rows, rows, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    pos = 20;
    CHECK_RESULT(kvmix_cache_evict(&m.cache, s, &pos, 1), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_seq_fork(&m.cache, s, 21, &child), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_append(&m.cache, s, one, one, p4), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_ingest(&m.cache, s, 1, one, one, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 0, 20, 0, NULL, NULL), KVMIX_SUCCESS);
    ct_unchanged(&m);
    /* layer 0 written: its rows read, layer 1's still refused, still no fork past them */
    CHECK_RESULT(ct_write_layer(&m, s, 0, 20, 2), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&m.cache, s, 0, 21, rows, rows, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&m.cache, s, 1, 21, rows, rows, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_seq_fork(&m.cache, s, 21, &child), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(ct_write_layer(&m, s, 1, 20, 2), KVMIX_SUCCESS);
    ct_verify(&m);
    /* a rewrite of a written row of the own buffer page; refused while the page is shared */
    m.seqs[s].tok[18] = ct_new_token_from(&m, m.seqs[s].tok[18], 1);
    CHECK_RESULT(ct_write_layer(&m, s, 1, 18, 1), KVMIX_SUCCESS);
    ct_verify(&m);
    child = ct_fork_at(&m, s, 22);
    CHECK(child >= 0);
    kvmix_cache_locate(&m.cache, child, 18, &slot);
    CHECK(m.cache.pages[ct_page_of(&m, slot)].refcount == 2);
    ct_snapshot(&m);
    CHECK_RESULT(kvmix_cache_write(&m.cache, s, 1, 18, 1, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write(&m.cache, child, 0, 21, 1, rows, rows),
                 KVMIX_ERR_INVALID_ARGUMENT);
    ct_unchanged(&m);
    CHECK_RESULT(ct_reserve(&m, s, 1, &p4), KVMIX_SUCCESS); /* copies the page on write */
    m.seqs[s].tok[18] = ct_new_token_from(&m, m.seqs[s].tok[18], 0);
    CHECK_RESULT(ct_write_layer(&m, s, 0, 18, 1), KVMIX_SUCCESS);
    for (i = 0; i < 2; i++) CHECK_RESULT(ct_write_layer(&m, s, i, 22, 1), KVMIX_SUCCESS);
    ct_verify(&m);
    for (i = 0; i < 2; i++) ct_verify_decode(&m, i);
    free(rows);
    free(bad);
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
    CHECK_RESULT(kvmix_cache_desc_resolve(NULL, NULL), KVMIX_ERR_NULL_POINTER);
    bad = d;
    bad.n_layers = 0;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.head_dim = 44;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_BAD_SHAPE);
    bad = d;
    bad.page_tokens = 12;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.n_sink = 17;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.group_size = 24;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_BAD_SHAPE);
    bad = d;
    bad.n_boost = 6;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_BAD_SHAPE);
    bad = d;
    bad.granule_bytes = 100;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.arena_bytes = 100; /* under a granule; 0 is a size query (test_desc_arena_sizing) */
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.partial = (kvmix_cache_partial)7;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.default_precision.key_format = 9;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_ERR_UNKNOWN_FORMAT);
    bad = d;
    bad.max_seqs = 1 << 20;
    bad.max_tokens_per_seq = 1 << 26;
    CHECK_RESULT(kvmix_cache_memory_bytes(&bad, &bytes, NULL),
                 sizeof(size_t) >= 8 ? KVMIX_ERR_INVALID_ARGUMENT : KVMIX_ERR_INVALID_ARGUMENT);
    bad = d;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, NULL), KVMIX_SUCCESS);
    CHECK_EQ_INT(bad.max_pages_per_seq, 96 / 16 + 8);
    CHECK_EQ_INT(bad.default_precision.key_format, KVMIX_FORMAT_INT4);
    CHECK_EQ_UINT(bad.granule_bytes, 256);
    ct_open(&m, &d, "cache bad inputs");
    {
        kvmix_cache other;
        CHECK_RESULT(kvmix_cache_init(&other, &bad, m.memory, m.memory_bytes - 1, m.arena, NULL),
                     KVMIX_ERR_BUFFER_TOO_SMALL);
        CHECK_RESULT(
            kvmix_cache_init(&other, &bad, (uint8_t *)m.memory + 1, m.memory_bytes, m.arena, NULL),
            KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_init(&other, &bad, NULL, m.memory_bytes, m.arena, NULL),
                     KVMIX_ERR_NULL_POINTER);
    }
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    ct_fill(&m, s, 20, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4);
    for (i = 0; i < 2 * 2 * 64; i++) rows[i] = nan_rows[i] = 0.25f;
    nan_rows[77] = NAN;
    p.key_format = p.value_format = KVMIX_FORMAT_INT4;
    wrong.key_format = 9; /* not a kvmix_format (0 is the default) */
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
    CHECK_RESULT(kvmix_cache_read(&m.cache, s, 2, 0, rows, rows, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_view_counts(&m.cache, &s, 1, &n_spans, &n_dead), KVMIX_SUCCESS);
    CHECK_EQ_INT(n_spans, 2);
    CHECK_RESULT(kvmix_cache_view(&m.cache, &s, 1, 0, spans, 1, first, dead, 64, &view),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_RESULT(kvmix_cache_view(&m.cache, &s, 1, 2, spans, 4, first, dead, 64, &view),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_view(&m.cache, &out, 1, 0, spans, 4, first, dead, 64, &view),
                 KVMIX_ERR_INVALID_ARGUMENT);
    {
        int32_t from = -1, n = -1, nd = -1;
        CHECK_RESULT(kvmix_cache_view_changes(NULL, s, &from), KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, NULL), KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_cache_view_changes(&m.cache, out, &from), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_EQ_INT(from, -1);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 0, 0, spans, 1, dead, 64, 0, &n, &nd),
                     KVMIX_ERR_BUFFER_TOO_SMALL);
        CHECK_EQ_INT(n, -1);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 0, 3, spans, 4, dead, 64, 0, &n, &nd),
                     KVMIX_ERR_INVALID_ARGUMENT); /* past n_entries */
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 0, -1, spans, 4, dead, 64, 0, &n, &nd),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 2, 0, spans, 4, dead, 64, 0, &n, &nd),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 0, 0, spans, 4, dead, 64, -1, &n, &nd),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, out, 0, 0, spans, 4, dead, 64, 0, &n, &nd),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 0, 0, NULL, 4, dead, 64, 0, &n, &nd),
                     KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 0, 0, spans, 4, dead, 64, 0, NULL, &nd),
                     KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_cache_view_seq(&m.cache, s, 0, 2, NULL, 0, NULL, 0, 0, &n, &nd),
                     KVMIX_SUCCESS); /* from n_entries: nothing */
        CHECK_EQ_INT(n, 0);
        CHECK_EQ_INT(nd, 0);
    }
    {
        uint64_t ws[64];
        float q[4 * 64], o[4 * 64], l[4];
        CHECK_RESULT(kvmix_cache_ref_decode(&m.cache, &s, 1, 0, 4, 0.0f, q, o, l, ws, 8),
                     KVMIX_ERR_BUFFER_TOO_SMALL);
        CHECK_RESULT(kvmix_cache_ref_decode(&m.cache, &s, 1, 0, 3, 0.0f, q, o, l, ws, sizeof ws),
                     KVMIX_ERR_INVALID_ARGUMENT);
        /* an lse not wanted (NULL): the rest is still checked */
        CHECK_RESULT(kvmix_cache_ref_decode(&m.cache, &s, 1, 0, 3, 0.0f, q, o, NULL, ws, sizeof ws),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_ref_decode(&m.cache, &s, 1, 0, 4, 0.0f, q, o, NULL, ws, 8),
                     KVMIX_ERR_BUFFER_TOO_SMALL);
    }
    ct_unchanged(&m);
    /* sequences run out */
    for (i = 0; i < CT_MAX_SEQS - 1; i++)
        CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &out), KVMIX_SUCCESS);
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
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, &a, NULL), KVMIX_SUCCESS);
    CHECK_EQ_INT(count.live, 2);
    CHECK_EQ_INT(d.page_tokens, 16); /* resolved values written back */
    CHECK_EQ_INT(d.group_size, 32);
    for (i = 0; i < 2 * 2 * 64; i++) rows[i] = (float)i / 256.0f;
    p.key_format = KVMIX_FORMAT_BOOSTED;
    p.value_format = KVMIX_FORMAT_INT2;
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &s), KVMIX_SUCCESS);
    for (i = 0; i < 40; i++)
        CHECK_RESULT(kvmix_cache_append(&cache, s, rows, rows, p), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    CHECK_EQ_INT(count.live, 0);
    kvmix_cache_deinit(NULL);
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS);
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
    free_before = m.cache.priv.n_free_granules;
    for (i = 0; i < 16; i++) positions[i] = 16 + i; /* the whole second page */
    CHECK_RESULT(kvmix_cache_evict(&m.cache, s, positions, 16), KVMIX_SUCCESS);
    for (i = 0; i < 16; i++) m.seqs[s].alive[16 + i] = 0;
    CHECK(m.cache.priv.n_free_granules > free_before); /* returned to the arena */
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
    m.cache.priv.bitmap[0] ^= 1u;
    CHECK_RESULT(kvmix_cache_check(&m.cache), KVMIX_ERR_CORRUPT_DATA);
    m.cache.priv.bitmap[0] ^= 1u;
    m.cache.slots[5] = KVMIX_CACHE_DEAD_SLOT + 1u;
    CHECK_RESULT(kvmix_cache_check(&m.cache), KVMIX_ERR_CORRUPT_DATA);
    m.cache.slots[5] = (uint32_t)m.cache.desc.page_tokens * m.cache.entries[0].page + 5u;
    CHECK_RESULT(kvmix_cache_check(&m.cache), KVMIX_SUCCESS);
    ct_close(&m);
}

/* The cache's last-error message starts with "argument:". */
static int ct_says(const kvmix_cache *cache, const char *argument) {
    const char *why = kvmix_cache_last_error(cache);
    size_t n = strlen(argument);
    return CHECK_MSG(strncmp(why, argument, n) == 0 && why[n] == ':',
                     "the message \"%s\" does not name %s", why, argument);
}

/* A desc of zeros (but the required fields) is the built-in "int4" policy for one sequence; a
   zero count of things kept means none (n_boost 0: BOOSTED refused, not 16 channels); a short
   sequence holds one whole FP16 page until the page fills. */
static void test_desc_defaults(void) {
    kvmix_cache_desc zero, int4;
    kvmix_error why = {NULL, NULL};
    kvmix_cache cache;
    kvmix_cache_seq_stats st;
    kvmix_cache_precision boosted = {KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2};
    float rows[2 * 2 * 64];
    int32_t s = -1, pos = -1, i;
    memset(&zero, 0, sizeof zero);
    zero.n_layers = 2;
    zero.n_kv_heads = 2;
    zero.head_dim = 64;
    zero.arena_bytes = 1 << 20;
    int4 = zero;
    CHECK_RESULT(kvmix_policy_apply(kvmix_policy_find("int4"), &int4, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_desc_resolve(&zero, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_desc_resolve(&int4, NULL), KVMIX_SUCCESS);
    CHECK_MEM_EQ(&zero, &int4, sizeof zero);
    CHECK_EQ_INT(zero.page_tokens, 32);
    CHECK_EQ_INT(zero.max_seqs, 1);
    CHECK_EQ_INT(zero.max_tokens_per_seq, 4096);
    CHECK_EQ_INT(zero.max_pages_per_seq, 4096 / 32 + 8);
    CHECK_EQ_INT(zero.n_sink + zero.n_window + zero.n_boost, 0);
    CHECK_EQ_INT(zero.group_size, 32);
    CHECK_EQ_INT(zero.value_group_size, 32);
    CHECK_EQ_UINT(zero.granule_bytes, 256);
    CHECK(zero.default_precision.key_format == KVMIX_FORMAT_INT4 &&
          zero.default_precision.value_format == KVMIX_FORMAT_INT4);
    /* no boosted channels: BOOSTED is refused wherever it is asked for */
    int4 = zero;
    int4.default_precision = boosted;
    CHECK_RESULT(kvmix_cache_desc_resolve(&int4, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(why.field != NULL && strcmp(why.field, "n_boost") == 0);
    for (i = 0; i < 2 * 2 * 64; i++) rows[i] = (float)(i % 9) / 8.0f;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &zero, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &s), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &pos), KVMIX_ERR_OUT_OF_MEMORY); /* one sequence */
    CHECK_RESULT(kvmix_cache_reserve(&cache, s, 1, &boosted, &pos), KVMIX_ERR_BAD_SHAPE);
    ct_says(&cache, "precisions");
    CHECK_RESULT(kvmix_cache_append(&cache, s, rows, rows, boosted), KVMIX_ERR_BAD_SHAPE);
    /* a sequence shorter than a page: all FP16, a whole page of bytes; full, it is INT4 */
    for (i = 0; i < 10; i++)
        CHECK_RESULT(kvmix_cache_append(&cache, s, rows, rows, zero.default_precision),
                     KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_stats_get(&cache, s, &st), KVMIX_SUCCESS);
    CHECK_EQ_INT(st.n_fp16_rows, 10);
    CHECK_EQ_UINT(st.referenced_bytes, 2 * 2 * 2 * 32 * 64 * 2); /* L * H * (K, V) * P * D * 2 */
    CHECK(st.n_packed_rows == 0 && st.packed_bytes == 0.0 && st.packed_bits_per_element == 0.0);
    for (; i < 33; i++)
        CHECK_RESULT(kvmix_cache_append(&cache, s, rows, rows, zero.default_precision),
                     KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_stats_get(&cache, s, &st), KVMIX_SUCCESS);
    CHECK_EQ_INT(st.n_fp16_rows, 1); /* 32 sealed to INT4, the 33rd in a new buffer page */
    CHECK(st.format_bytes[KVMIX_FORMAT_INT4] > 0);
    /* the sealed page alone: INT4 codes and a (scale, min) pair per group of 32 per row, 5 bits */
    CHECK_EQ_INT(st.n_packed_rows, 32);
    CHECK(st.packed_bytes == 2 * 2 * 2 * 32 * (64 / 2 + 2 * 4) &&
          st.packed_bits_per_element == 5.0);
    { /* what a token of a precision costs in a full page: here the packed bits */
        double bits = 0;
        kvmix_cache_precision fp16 = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16}, bad = {9, 0};
        CHECK_RESULT(kvmix_cache_precision_bits(&cache, zero.default_precision, &bits),
                     KVMIX_SUCCESS);
        CHECK(bits == st.packed_bits_per_element);
        CHECK_RESULT(kvmix_cache_precision_bits(&cache, fp16, &bits), KVMIX_SUCCESS);
        CHECK(bits == 16.0);
        CHECK_RESULT(kvmix_cache_precision_bits(&cache, boosted, &bits), KVMIX_ERR_BAD_SHAPE);
        CHECK_RESULT(kvmix_cache_precision_bits(&cache, bad, &bits), KVMIX_ERR_UNKNOWN_FORMAT);
        CHECK_RESULT(kvmix_cache_precision_bits(NULL, fp16, &bits), KVMIX_ERR_NULL_POINTER);
    }
    kvmix_cache_deinit(&cache);
}

/* How sequences take their tokens in a sizing workload. */
typedef enum ct_order { CT_TURNS, CT_ONE_AFTER_ANOTHER, CT_RANDOM } ct_order;

/* n_seqs sequences of n tokens each, one token per call (reserve + write of every layer, or
   append), in the given order, on an arena of arena_bytes; 1 when every call succeeds, and then
   *out_used (may be NULL) receives the arena bytes the sequences hold at the end. */
static int ct_sized_run(kvmix_cache_desc d, size_t arena_bytes, int32_t n_seqs, int32_t n,
                        ct_order order, int append, test_rng *rng, size_t *out_used) {
    kvmix_cache cache;
    kvmix_cache_stats stats;
    kvmix_cache_precision zero = {0, 0};
    static float rows[2 * 2 * 64 * 2];
    int32_t seqs[4], done[4] = {0, 0, 0, 0}, total, layer, pos, i, s = 0;
    int ok = 1;
    for (i = 0; i < 2 * 2 * 64 * 2; i++) rows[i] = (float)(i % 11) / 16.0f - 0.25f;
    d.arena_bytes = arena_bytes;
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS)) return 0;
    for (i = 0; i < n_seqs; i++)
        CHECK_RESULT(kvmix_cache_seq_create(&cache, &seqs[i]), KVMIX_SUCCESS);
    for (total = 0; ok && total < n_seqs * n; total++) {
        if (order == CT_TURNS) s = total % n_seqs;
        if (order == CT_ONE_AFTER_ANOTHER) s = total / n;
        while (order == CT_RANDOM && done[s = test_rng_range(rng, 0, n_seqs - 1)] == n) {
        }
        done[s]++;
        if (append) {
            ok = kvmix_cache_append(&cache, seqs[s], rows, rows, zero) == KVMIX_SUCCESS;
            continue;
        }
        ok = kvmix_cache_reserve(&cache, seqs[s], 1, NULL, &pos) == KVMIX_SUCCESS;
        for (layer = 0; ok && layer < d.n_layers; layer++)
            CHECK_RESULT(kvmix_cache_write(&cache, seqs[s], layer, pos, 1, rows, rows),
                         KVMIX_SUCCESS);
    }
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_stats_get(&cache, &stats), KVMIX_SUCCESS);
    if (out_used) *out_used = stats.arena_used_bytes;
    kvmix_cache_deinit(&cache);
    return ok;
}

/* kvmix_cache_arena_bytes_for: an arena of its size holds the sequences to their last token
   under the zero desc and every built-in policy, in turns or one after another, by reserve and
   write or by append (at random too, but with a values-only window); one granule less fails
   some of those workloads, and an arena of what a sequence holds at its end fails at the peak
   of a page boundary. */
static void test_arena_bytes_for(void) {
    static const int32_t lengths[] = {1, 31, 32, 33, 100, 161, 300};
    test_rng rng;
    int32_t policy, li, n_seqs, order, append;
    size_t bytes = 0, steady = 0;
    kvmix_cache_desc int4;
    test_rng_init(&rng, "arena bytes for");
    memset(&int4, 0, sizeof int4);
    int4.n_layers = 2;
    int4.n_kv_heads = 2;
    int4.head_dim = 64; /* the defaults: int4, pages of 32 */
    CHECK_RESULT(kvmix_cache_arena_bytes_for(&int4, 1, 65, &bytes, NULL), KVMIX_SUCCESS);
    CHECK(ct_sized_run(int4, bytes, 1, 65, CT_TURNS, 0, &rng, &steady));
    CHECK(steady < bytes); /* two sealed pages and a buffer, held before the last seal with two */
    CHECK(!ct_sized_run(int4, steady, 1, 65, CT_TURNS, 0, &rng, NULL));
    for (policy = -1; policy < kvmix_policy_count(); policy++) {
        kvmix_cache_desc d;
        memset(&d, 0, sizeof d);
        d.n_layers = 2;
        d.n_kv_heads = 2;
        d.head_dim = 64;
        d.max_seqs = 4;
        d.max_tokens_per_seq = 512;
        d.granule_bytes = 256;
        if (policy >= 0)
            CHECK_RESULT(kvmix_policy_apply(kvmix_policy_at(policy), &d, NULL), KVMIX_SUCCESS);
        test_context("arena_bytes_for, policy %s",
                     policy < 0 ? "none" : kvmix_policy_at(policy)->name);
        for (n_seqs = 1; n_seqs <= 3; n_seqs += 2)
            for (li = 0; li < (int32_t)(sizeof lengths / sizeof lengths[0]); li++) {
                int32_t n = lengths[li], tight = 0;
                if (!CHECK_RESULT(kvmix_cache_arena_bytes_for(&d, n_seqs, n, &bytes, NULL),
                                  KVMIX_SUCCESS))
                    continue;
                for (order = CT_TURNS; order <= CT_RANDOM; order++)
                    for (append = 0; append <= 1; append++) {
                        if (order == CT_RANDOM && d.window_values_only) continue;
                        CHECK_MSG(
                            ct_sized_run(d, bytes, n_seqs, n, (ct_order)order, append, &rng, NULL),
                            "%d sequences of %d tokens (order %d, append %d) do not fit "
                            "in %zu bytes",
                            (int)n_seqs, (int)n, (int)order, (int)append, bytes);
                        tight |= !ct_sized_run(d, bytes - d.granule_bytes, n_seqs, n,
                                               (ct_order)order, append, &rng, NULL);
                    }
                CHECK_MSG(tight, "%d sequences of %d tokens fit one granule less than %zu bytes",
                          (int)n_seqs, (int)n, bytes);
            }
    }
    test_context(NULL);
}

/* arena_bytes 0 is a size query: kvmix_cache_desc_resolve writes what
   kvmix_cache_arena_bytes_for gives for max_seqs sequences of max_tokens_per_seq positions,
   kvmix_cache_init_allocator allocates it, and those sequences fit it to their last position. */
static void test_desc_arena_sizing(void) {
    kvmix_cache_desc d, sized;
    kvmix_cache cache;
    kvmix_error why = {NULL, NULL};
    size_t bytes = 0, memory_zero = 0, memory_sized = 0;
    int32_t head_dim;
    test_rng rng;
    test_rng_init(&rng, "desc arena sizing");
    memset(&d, 0, sizeof d);
    d.n_layers = 2;
    d.n_kv_heads = 2;
    d.head_dim = 64;
    d.max_seqs = 3;
    d.max_tokens_per_seq = 161;
    CHECK_RESULT(kvmix_policy_apply(kvmix_policy_find("kivi2-sink"), &d, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_arena_bytes_for(&d, 3, 161, &bytes, &why), KVMIX_SUCCESS);
    sized = d;
    CHECK_RESULT(kvmix_cache_desc_resolve(&sized, &why), KVMIX_SUCCESS);
    CHECK(strcmp(why.field, "") == 0 && strcmp(why.reason, "") == 0);
    CHECK(sized.arena_bytes == bytes && bytes > 0);
    CHECK_RESULT(kvmix_cache_memory_bytes(&d, &memory_zero, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_memory_bytes(&sized, &memory_sized, NULL), KVMIX_SUCCESS);
    CHECK(memory_zero == memory_sized); /* the bitmap of the arena it resolves to */
    CHECK(ct_sized_run(d, 0, 3, 161, CT_TURNS, 0, &rng, NULL));
    CHECK(ct_sized_run(d, 0, 3, 161, CT_ONE_AFTER_ANOTHER, 1, &rng, NULL));
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, &why), KVMIX_SUCCESS);
    CHECK(cache.desc.arena_bytes == bytes && d.arena_bytes == bytes);
    kvmix_cache_deinit(&cache);
    /* head_dim 48 and 80 with groups that divide them: INT8 and FP16 pages, and the sizing */
    for (head_dim = 48; head_dim <= 80; head_dim += 32) {
        memset(&d, 0, sizeof d);
        d.n_layers = d.n_kv_heads = 2;
        d.head_dim = head_dim;
        d.max_seqs = 3;
        d.max_tokens_per_seq = 161;
        d.group_size = 16;
        d.default_precision.key_format = d.default_precision.value_format = KVMIX_FORMAT_INT8;
        CHECK(ct_sized_run(d, 0, 3, 161, CT_TURNS, 0, &rng, NULL));
        d.default_precision.key_format = d.default_precision.value_format = KVMIX_FORMAT_FP16;
        CHECK(ct_sized_run(d, 0, 2, 100, CT_RANDOM, 1, &rng, NULL));
    }
    /* an arena too large to count: refused, naming arena_bytes */
    d.arena_bytes = 0;
    d.max_seqs = 1 << 20;
    d.max_tokens_per_seq = 1 << 26;
    d.n_layers = d.n_kv_heads = 4096;
    sized = d;
    if (CHECK_RESULT(kvmix_cache_desc_resolve(&sized, &why), KVMIX_ERR_INVALID_ARGUMENT)) {
        CHECK(strcmp(why.field, "arena_bytes") == 0);
        CHECK_MEM_EQ(&sized, &d, sizeof d);
    }
}

/* Every call that checks a desc or sizes from one says which field or argument is wrong, and
   "" when nothing is. */
static void test_desc_error_fields(void) {
    kvmix_cache_desc d, bad;
    kvmix_cache cache;
    kvmix_error why;
    size_t bytes = 0, memory_bytes = 0;
    uint64_t *memory;
    uint8_t arena[4096];
    ct_small_desc(&d);
    d.arena_bytes = sizeof arena;
#define EXPECT_FIELD(call, want, name)                                                             \
    do {                                                                                           \
        why.field = why.reason = NULL;                                                             \
        CHECK_RESULT(call, want);                                                                  \
        CHECK_MSG(why.field != NULL && strcmp(why.field, name) == 0,                               \
                  "%s: field \"%s\", expected \"%s\"", #call, why.field ? why.field : "(null)",    \
                  name);                                                                           \
        CHECK(why.reason != NULL && (want == KVMIX_SUCCESS) == (why.reason[0] == '\0'));           \
    } while (0)
    bad = d;
    bad.head_dim = 44;
    EXPECT_FIELD(kvmix_cache_desc_resolve(&bad, &why), KVMIX_ERR_BAD_SHAPE, "head_dim");
    bad.head_dim = 48; /* a multiple of 8, but the default group of 32 does not divide it */
    EXPECT_FIELD(kvmix_cache_desc_resolve(&bad, &why), KVMIX_ERR_BAD_SHAPE, "group_size");
    bad.group_size = 16;
    bad.n_boost = 0;
    EXPECT_FIELD(kvmix_cache_desc_resolve(&bad, &why), KVMIX_SUCCESS, "");
    EXPECT_FIELD(kvmix_cache_desc_resolve(NULL, &why), KVMIX_ERR_NULL_POINTER, "desc");
    bad = d;
    bad.granule_bytes = 100;
    EXPECT_FIELD(kvmix_cache_memory_bytes(&bad, &bytes, &why), KVMIX_ERR_INVALID_ARGUMENT,
                 "granule_bytes");
    EXPECT_FIELD(kvmix_cache_memory_bytes(&d, NULL, &why), KVMIX_ERR_NULL_POINTER, "out_bytes");
    EXPECT_FIELD(kvmix_cache_memory_bytes(&d, &memory_bytes, &why), KVMIX_SUCCESS, "");
    EXPECT_FIELD(kvmix_cache_arena_bytes_for(&d, d.max_seqs + 1, 1, &bytes, &why),
                 KVMIX_ERR_INVALID_ARGUMENT, "n_seqs");
    EXPECT_FIELD(kvmix_cache_arena_bytes_for(&d, 1, -1, &bytes, &why), KVMIX_ERR_INVALID_ARGUMENT,
                 "n_tokens_per_seq");
    EXPECT_FIELD(kvmix_cache_arena_bytes_for(&bad, 1, 1, &bytes, &why), KVMIX_ERR_INVALID_ARGUMENT,
                 "granule_bytes");
    EXPECT_FIELD(kvmix_cache_arena_bytes_for(&d, 1, 1, &bytes, &why), KVMIX_SUCCESS, "");
    EXPECT_FIELD(kvmix_cache_ref_decode_workspace_max(&d, -1, &bytes, &why),
                 KVMIX_ERR_INVALID_ARGUMENT, "n_seqs");
    EXPECT_FIELD(kvmix_cache_ref_decode_workspace_max(&d, 1, &bytes, &why), KVMIX_SUCCESS, "");
    /* the inits name a desc field as the desc spells it, and their own arguments */
    memory = (uint64_t *)test_alloc(memory_bytes + 8);
    bad = d;
    bad.n_sink = bad.page_tokens + 1;
    EXPECT_FIELD(kvmix_cache_init(&cache, &bad, memory, memory_bytes, arena, &why),
                 KVMIX_ERR_INVALID_ARGUMENT, "n_sink");
    ct_says(&cache, "desc.n_sink");
    EXPECT_FIELD(kvmix_cache_init(&cache, &d, (uint8_t *)memory + 4, memory_bytes, arena, &why),
                 KVMIX_ERR_INVALID_ARGUMENT, "memory");
    EXPECT_FIELD(kvmix_cache_init(&cache, &d, memory, memory_bytes - 8, arena, &why),
                 KVMIX_ERR_BUFFER_TOO_SMALL, "memory_bytes");
    EXPECT_FIELD(kvmix_cache_init(&cache, &d, memory, memory_bytes, NULL, &why),
                 KVMIX_ERR_NULL_POINTER, "arena");
    EXPECT_FIELD(kvmix_cache_init(&cache, &d, memory, memory_bytes, arena, &why), KVMIX_SUCCESS,
                 "");
    kvmix_cache_deinit(&cache);
    EXPECT_FIELD(kvmix_cache_init_allocator(&cache, &bad, NULL, &why), KVMIX_ERR_INVALID_ARGUMENT,
                 "n_sink");
    bad = d;
    bad.device_arena = 1;
    EXPECT_FIELD(kvmix_cache_init_allocator(&cache, &bad, NULL, &why), KVMIX_ERR_INVALID_ARGUMENT,
                 "device_arena");
    EXPECT_FIELD(kvmix_cache_init_allocator(&cache, &d, NULL, &why), KVMIX_SUCCESS, "");
    kvmix_cache_deinit(&cache);
#undef EXPECT_FIELD
    free(memory);
}

/* Row value of token t, layer l, channel i (FP16-exact, varied per channel). */
static float ct_row_value(int32_t t, int32_t l, int32_t i) {
    return (float)((t * 7 + l * 3 + i * 5) % 33 - 16) / 16.0f;
}

/* A precision of {0, 0}, or a zero on one side, is the desc's default precision (that side)
   wherever a cache call takes one: reserve, ingest, append, retier store exactly what NULL
   precisions store. */
static void test_zero_precision_is_default(void) {
    enum { N = 32 };
    kvmix_cache cache;
    kvmix_cache_desc d;
    kvmix_cache_precision zero = {0, 0}, zero_keys = {0, KVMIX_FORMAT_INT4}, got, want;
    kvmix_cache_precision zeros[N];
    int32_t hd, per_token, seq[4], t, l, i, first;
    float *prompt_k, *prompt_v, *one_k, *one_v, *row_k, *row_v, *ref_k, *ref_v;
    ct_small_desc(&d);
    d.default_precision.key_format = KVMIX_FORMAT_INT2_CHANNEL;
    d.default_precision.value_format = KVMIX_FORMAT_INT8;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS);
    hd = d.n_kv_heads * d.head_dim;
    per_token = d.n_layers * hd;
    prompt_k = (float *)test_alloc((size_t)N * per_token * sizeof(float));
    prompt_v = (float *)test_alloc((size_t)N * per_token * sizeof(float));
    one_k = (float *)test_alloc((size_t)per_token * sizeof(float));
    one_v = (float *)test_alloc((size_t)per_token * sizeof(float));
    row_k = (float *)test_alloc((size_t)hd * sizeof(float));
    row_v = (float *)test_alloc((size_t)hd * sizeof(float));
    ref_k = (float *)test_alloc((size_t)hd * sizeof(float));
    ref_v = (float *)test_alloc((size_t)hd * sizeof(float));
    for (l = 0; l < d.n_layers; l++)
        for (t = 0; t < N; t++)
            for (i = 0; i < hd; i++) {
                prompt_k[((size_t)l * N + t) * hd + i] = ct_row_value(t, l, i);
                prompt_v[((size_t)l * N + t) * hd + i] = -ct_row_value(t, l, i + 1);
            }
    for (t = 0; t < N; t++) zeros[t] = zero;
    for (i = 0; i < 4; i++) CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq[i]), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_ingest(&cache, seq[0], N, prompt_k, prompt_v, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_ingest(&cache, seq[1], N, prompt_k, prompt_v, zeros), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, seq[2], N, zeros, &first), KVMIX_SUCCESS);
    for (l = 0; l < d.n_layers; l++)
        CHECK_RESULT(kvmix_cache_write(&cache, seq[2], l, 0, N, prompt_k + (size_t)l * N * hd,
                                       prompt_v + (size_t)l * N * hd),
                     KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seal_ready(&cache, seq[2]), KVMIX_SUCCESS);
    for (t = 0; t < N; t++) {
        for (l = 0; l < d.n_layers; l++) {
            memcpy(one_k + (size_t)l * hd, prompt_k + ((size_t)l * N + t) * hd,
                   (size_t)hd * sizeof(float));
            memcpy(one_v + (size_t)l * hd, prompt_v + ((size_t)l * N + t) * hd,
                   (size_t)hd * sizeof(float));
        }
        CHECK_RESULT(kvmix_cache_append(&cache, seq[3], one_k, one_v, zero), KVMIX_SUCCESS);
    }
    /* every position of every sequence: the default formats, the same rows as NULL gave */
    for (t = 0; t < N; t++)
        for (l = 0; l < d.n_layers; l++) {
            CHECK_RESULT(kvmix_cache_read(&cache, seq[0], l, t, ref_k, ref_v, &want),
                         KVMIX_SUCCESS);
            CHECK(want.key_format == KVMIX_FORMAT_INT2_CHANNEL &&
                  want.value_format == KVMIX_FORMAT_INT8);
            for (i = 1; i < 4; i++) {
                CHECK_RESULT(kvmix_cache_read(&cache, seq[i], l, t, row_k, row_v, &got),
                             KVMIX_SUCCESS);
                CHECK(got.key_format == want.key_format && got.value_format == want.value_format);
                CHECK_MEM_EQ(row_k, ref_k, (size_t)hd * sizeof(float));
                CHECK_MEM_EQ(row_v, ref_v, (size_t)hd * sizeof(float));
            }
        }
    /* a zero on one side: that side's default, the other as asked; retier {0, 0}: the default */
    CHECK_RESULT(kvmix_cache_seq_free(&cache, seq[1]), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq[1]), KVMIX_SUCCESS);
    for (t = 0; t < N; t++) zeros[t] = zero_keys;
    CHECK_RESULT(kvmix_cache_ingest(&cache, seq[1], N, prompt_k, prompt_v, zeros), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&cache, seq[1], 0, 3, NULL, NULL, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_INT2_CHANNEL && got.value_format == KVMIX_FORMAT_INT4);
    CHECK_RESULT(kvmix_cache_retier(&cache, seq[1], 3, zero, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
                 KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&cache, seq[1], 0, 3, NULL, NULL, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_INT2_CHANNEL && got.value_format == KVMIX_FORMAT_INT8);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    free(prompt_k);
    free(prompt_v);
    free(one_k);
    free(one_v);
    free(row_k);
    free(row_v);
    free(ref_k);
    free(ref_v);
}

/* Refused calls say which argument and why; a successful call clears the message, a const call
   leaves it; desc errors before a cache exists name the field. */
static void test_error_messages(void) {
    kvmix_cache cache;
    kvmix_cache_desc d, bad;
    kvmix_error why = {NULL, NULL};
    float rows[2 * 64], q[3 * 64], out[3 * 64], lse[3];
    uint64_t ws[256];
    uint32_t slot;
    int32_t s = -1, pos = -1, layer, i;
    for (i = 0; i < 2 * 64; i++) rows[i] = 0.5f - (float)i / 128.0f;
    for (i = 0; i < 3 * 64; i++) q[i] = (float)(i % 5) - 2.0f;
    ct_small_desc(&d);
    d.n_kv_heads = 1;
    /* too many sinks: refused by the desc's check and by the init, both naming n_sink */
    bad = d;
    bad.n_sink = bad.page_tokens + 1;
    CHECK_RESULT(kvmix_cache_desc_resolve(&bad, &why), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(why.field != NULL && strcmp(why.field, "n_sink") == 0);
    CHECK(why.reason != NULL && why.reason[0] != '\0');
    CHECK_EQ_INT(bad.n_sink, d.page_tokens + 1); /* unchanged */
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &bad, NULL, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "desc.n_sink");
    d.n_kv_heads = 2;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS);
    CHECK_EQ_INT(kvmix_cache_last_error(&cache)[0], '\0');
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &s), KVMIX_SUCCESS);
    /* a write before its positions are reserved */
    CHECK_RESULT(kvmix_cache_write(&cache, s, 0, 0, 1, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "first_position");
    /* a const call that fails leaves the message as it was */
    CHECK_RESULT(kvmix_cache_locate(&cache, s, 7, &slot), KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "first_position");
    CHECK_RESULT(kvmix_cache_reserve(&cache, s, 1, NULL, &pos), KVMIX_SUCCESS);
    CHECK_EQ_INT(kvmix_cache_last_error(&cache)[0], '\0');
    for (layer = 0; layer < d.n_layers; layer++)
        CHECK_RESULT(kvmix_cache_write(&cache, s, layer, pos, 1, rows, rows), KVMIX_SUCCESS);
    /* 3 query heads for 2 kv heads */
    CHECK_RESULT(kvmix_cache_ref_decode(&cache, &s, 1, 0, 3, 0.0f, q, out, lse, ws, sizeof ws),
                 KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "n_q_heads");
    CHECK_RESULT(kvmix_cache_ref_decode(&cache, &s, 1, 0, 2, 0.0f, q, out, lse, ws, sizeof ws),
                 KVMIX_SUCCESS);
    CHECK_EQ_INT(kvmix_cache_last_error(&cache)[0], '\0');
    /* a few more, each naming its argument */
    CHECK_RESULT(kvmix_cache_write(&cache, s, 2, pos, 1, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "layer");
    CHECK_RESULT(kvmix_cache_reserve(&cache, 5, 1, NULL, &pos), KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "seq");
    CHECK_RESULT(kvmix_cache_reserve(&cache, s, d.max_tokens_per_seq, NULL, &pos),
                 KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "n_tokens");
    rows[3] = NAN;
    CHECK_RESULT(kvmix_cache_append(&cache, s, rows, rows, cache.desc.default_precision),
                 KVMIX_ERR_BAD_VALUE);
    ct_says(&cache, "keys");
    CHECK_RESULT(kvmix_cache_seq_fork(&cache, s, 2, &pos), KVMIX_ERR_INVALID_ARGUMENT);
    ct_says(&cache, "n_prefix");
    for (i = 1; i < CT_MAX_SEQS; i++)
        CHECK_RESULT(kvmix_cache_seq_create(&cache, &pos), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &pos), KVMIX_ERR_OUT_OF_MEMORY);
    ct_says(&cache, "desc.max_seqs");
    CHECK(strlen(kvmix_cache_last_error(&cache)) < KVMIX_CACHE_ERROR_BYTES);
    CHECK(kvmix_cache_last_error(NULL) != NULL);
    kvmix_cache_deinit(&cache);
}

/* Runs: a page holds one run. The first position of a new run closes the page being filled at its
   rows (FP16 bytes of just them, to a multiple of 8) and it seals in its own rows' formats, where one run throughout
   seals the whole page in the highest precision any row asked for. */
static void test_runs(void) {
    kvmix_cache_desc d;
    kvmix_cache with, without;
    kvmix_cache_seq_stats st;
    kvmix_cache_precision int8 = {KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8},
                          int4 = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4}, got;
    float rows[2 * 2 * 64];
    int32_t s = -1, t = -1, i, pos;
    uint32_t a = 0, b = 0;
    test_context("runs");
    ct_small_desc(&d);
    d.n_window = 32;
    for (i = 0; i < 2 * 2 * 64; i++) rows[i] = (float)(i % 13) / 8.0f - 0.75f;
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&with, &d, NULL, NULL), KVMIX_SUCCESS)) return;
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&without, &d, NULL, NULL), KVMIX_SUCCESS)) return;
    CHECK_RESULT(kvmix_cache_seq_create(&with, &s), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&without, &t), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_set_run(&with, 3, 1), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_seq_set_run(NULL, s, 1), KVMIX_ERR_NULL_POINTER);
    /* 5 INT8 positions of run 1, then 60 INT4 positions of run 2 (set twice: no second close) */
    CHECK_RESULT(kvmix_cache_seq_set_run(&with, s, 1), KVMIX_SUCCESS);
    for (pos = 0; pos < 65; pos++) {
        kvmix_cache_precision want = pos < 5 ? int8 : int4;
        if (pos == 5 || pos == 9) CHECK_RESULT(kvmix_cache_seq_set_run(&with, s, 2), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_append(&with, s, rows, rows, want), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_append(&without, t, rows, rows, want), KVMIX_SUCCESS);
        if (pos == 5) { /* the closed page holds its 5 FP16 rows in 8, the new one a page */
            CHECK_RESULT(kvmix_cache_seq_stats_get(&with, s, &st), KVMIX_SUCCESS);
            CHECK_EQ_UINT(st.referenced_bytes, (8 + 16) * 2 * 2 * 2 * 64 * 2);
        }
    }
    CHECK_RESULT(kvmix_cache_locate(&with, s, 4, &a), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_locate(&with, s, 5, &b), KVMIX_SUCCESS);
    CHECK(a / 16 != b / 16); /* the run's first position opened a page */
    CHECK_RESULT(kvmix_cache_locate(&with, s, 9, &a), KVMIX_SUCCESS);
    CHECK(a / 16 == b / 16);         /* the same run again: the same page */
    for (pos = 0; pos < 21; pos++) { /* sealed: 0..4 and 5..20 left the window of 32 */
        CHECK_RESULT(kvmix_cache_read(&with, s, 1, pos, NULL, NULL, &got), KVMIX_SUCCESS);
        CHECK(got.key_format == (pos < 5 ? int8 : int4).key_format);
        CHECK_RESULT(kvmix_cache_read(&without, t, 1, pos, NULL, NULL, &got), KVMIX_SUCCESS);
        CHECK(got.key_format == (pos < 16 ? int8 : int4).key_format); /* the page's highest */
    }
    CHECK_RESULT(kvmix_cache_seq_stats_get(&with, s, &st), KVMIX_SUCCESS);
    CHECK_EQ_INT(st.n_packed_rows, 21);
    { /* the closed page costs what kvmix_cache_page_bits prices 5 rows at, dearer than a page */
        double closed = 0, full = 0, element_rows = 2 * 2 * 64 * 2; /* L * H * D * (K, V) */
        CHECK_RESULT(kvmix_cache_page_bits(&with, int8, 5, &closed), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_page_bits(&with, int4, 16, &full), KVMIX_SUCCESS);
        CHECK(st.packed_bytes * 8 == closed * 5 * element_rows + full * 16 * element_rows);
        CHECK_RESULT(kvmix_cache_page_bits(&with, int8, 16, &full), KVMIX_SUCCESS);
        CHECK(closed > full);
        CHECK_RESULT(kvmix_cache_page_bits(&with, int8, 0, &full), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_cache_page_bits(&with, int8, 17, &full), KVMIX_ERR_INVALID_ARGUMENT);
    }
    CHECK_RESULT(kvmix_cache_check(&with), KVMIX_SUCCESS);
    /* a child forked inside the run's page shares it; its own new run closes its copy */
    CHECK_RESULT(kvmix_cache_seq_fork(&with, s, 60, &t), KVMIX_SUCCESS);
    CHECK_EQ_INT(with.seqs[t].run, 2);
    CHECK_RESULT(kvmix_cache_seq_set_run(&with, t, 7), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_append(&with, t, rows, rows, int8), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_locate(&with, t, 59, &a), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_locate(&with, t, 60, &b), KVMIX_SUCCESS);
    CHECK(a / 16 != b / 16);
    CHECK_RESULT(kvmix_cache_locate(&with, s, 59, &b), KVMIX_SUCCESS);
    CHECK(a / 16 != b / 16); /* the child's closed copy, not the parent's page */
    CHECK_RESULT(kvmix_cache_check(&with), KVMIX_SUCCESS);
    kvmix_cache_deinit(&with);
    kvmix_cache_deinit(&without);
    test_context(NULL);
}

/* A child forked inside a closed page whose writer has not written all its rows yet does not seal
   it: the rows past the fork point are the writer's and still empty. The writer seals it once
   they are written. */
static void test_runs_fork_unwritten(void) {
    kvmix_cache_desc d;
    kvmix_cache cache;
    kvmix_cache_precision int4 = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4}, got;
    float rows[9 * 2 * 64];
    int32_t s = -1, t = -1, layer, pos, i;
    test_context("runs: fork inside a closed page");
    ct_small_desc(&d);
    for (i = 0; i < 9 * 2 * 64; i++) rows[i] = (float)(i % 11) / 8.0f - 0.5f;
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS)) return;
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &s), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_set_run(&cache, s, 1), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, s, 9, NULL, &pos), KVMIX_SUCCESS);
    for (layer = 0; layer < 2; layer++) /* 6 of the run's 9 rows written */
        CHECK_RESULT(kvmix_cache_write(&cache, s, layer, 0, 6, rows, rows), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_set_run(&cache, s, 2), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, s, 1, &int4, &pos), KVMIX_SUCCESS); /* closes it */
    CHECK_RESULT(kvmix_cache_seq_fork(&cache, s, 5, &t), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_set_run(&cache, t, 3), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, t, 1, &int4, &pos), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&cache, s, 1, 0, NULL, NULL, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_FP16); /* the child did not seal the writer's page */
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    for (layer = 0; layer < 2; layer++)
        CHECK_RESULT(kvmix_cache_write(&cache, s, layer, 6, 4, rows, rows), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, s, 1, &int4, &pos), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&cache, s, 1, 0, NULL, NULL, &got), KVMIX_SUCCESS);
    CHECK(got.key_format != KVMIX_FORMAT_FP16); /* written, out of the (empty) window: sealed */
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    test_context(NULL);
}

/* Pages closed by runs seal like full pages under a values-only window (their keys first, then
   their values once out of the window), and so do those a child forked inside shares: positions
   older than the window and a page hold no FP16 values. */
static void test_runs_values_window(void) {
    kvmix_cache_desc d;
    kvmix_cache c;
    kvmix_cache_precision int4 = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4}, got;
    float rows[2 * 2 * 64];
    int32_t seq[2] = {-1, -1}, i, pos, k;
    test_context("runs, values-only window");
    ct_small_desc(&d);
    d.max_tokens_per_seq = 0; /* the default: room for a page table of runs of 5 */
    d.n_window = 32;
    d.window_values_only = 1;
    for (i = 0; i < 2 * 2 * 64; i++) rows[i] = (float)(i % 11) / 8.0f - 0.5f;
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&c, &d, NULL, NULL), KVMIX_SUCCESS)) return;
    CHECK_RESULT(kvmix_cache_seq_create(&c, &seq[0]), KVMIX_SUCCESS);
    for (pos = 0; pos < 45; pos++) { /* runs of 5: every page closes at 5 rows */
        CHECK_RESULT(kvmix_cache_seq_set_run(&c, seq[0], (uint32_t)(pos / 5)), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_append(&c, seq[0], rows, rows, int4), KVMIX_SUCCESS);
    }
    CHECK_RESULT(kvmix_cache_seq_fork(&c, seq[0], 43, &seq[1]), KVMIX_SUCCESS); /* inside a run */
    for (k = 0; k < 2; k++)
        for (pos = 43; pos < 120; pos++) {
            CHECK_RESULT(kvmix_cache_seq_set_run(&c, seq[k], (uint32_t)(100 * k + pos / 5)),
                         KVMIX_SUCCESS);
            CHECK_RESULT(kvmix_cache_append(&c, seq[k], rows, rows, int4), KVMIX_SUCCESS);
        }
    for (k = 0; k < 2; k++)
        for (pos = 0; pos < 120 - 32 - 16; pos++) {
            CHECK_RESULT(kvmix_cache_read(&c, seq[k], 0, pos, NULL, NULL, &got), KVMIX_SUCCESS);
            CHECK(got.key_format == KVMIX_FORMAT_INT4 && got.value_format == KVMIX_FORMAT_INT4);
        }
    CHECK_RESULT(kvmix_cache_check(&c), KVMIX_SUCCESS);
    kvmix_cache_deinit(&c);
    test_context(NULL);
}

/* A child forked inside a page whose keys are sealed (a values-only window) holds fewer rows than
   the page. Once it is alone there, its finish seals the page whole: a partial seal over its rows
   would read the packed keys with the geometry of fewer rows (per-token keys) or quantize them
   again (per-channel keys). */
static void test_fork_keys_sealed(void) {
    static const uint8_t key_formats[2] = {KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT2_CHANNEL};
    int32_t k;
    for (k = 0; k < 2; k++) {
        ct_model m;
        kvmix_cache_desc d;
        int32_t s = -1, child, pos;
        test_context("fork inside a page with sealed keys, key format %d", key_formats[k]);
        ct_small_desc(&d);
        d.n_window = 20;
        d.window_values_only = 1;
        d.partial = KVMIX_CACHE_PARTIAL_QUANTIZE;
        ct_open(&m, &d, "cache fork keys sealed");
        CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
        m.seqs[s].in_use = 1;
        ct_fill(&m, s, 20, key_formats[k], KVMIX_FORMAT_INT4);
        CHECK_EQ_INT(ct_format_at(&m, s, 3).key_format, key_formats[k]); /* keys sealed */
        CHECK_EQ_INT(ct_format_at(&m, s, 3).value_format, KVMIX_FORMAT_FP16);
        child = ct_fork_at(&m, s, 4);
        if (!CHECK(child >= 0)) {
            ct_close(&m);
            continue;
        }
        ct_op_free(&m, s);
        ct_op_finish(&m, child);
        ct_verify(&m);
        for (pos = 0; pos < 4; pos++) {
            CHECK_EQ_INT(ct_format_at(&m, child, pos).key_format, key_formats[k]);
            CHECK_EQ_INT(ct_format_at(&m, child, pos).value_format, KVMIX_FORMAT_INT4);
        }
        ct_verify_decode(&m, 1);
        ct_close(&m);
    }
    test_context(NULL);
}

/* kvmix_cache_view_changes reports what changed, not everything: a decode step into the page
   being filled changes only the last entry; a seal of a shared page reaches the other sharer. */
static void test_view_changes(void) {
    ct_model m;
    kvmix_cache_desc d;
    int32_t s = -1, child, from = -1;
    test_context("view changes");
    ct_small_desc(&d);
    ct_open(&m, &d, "cache view changes");
    CHECK_RESULT(kvmix_cache_seq_create(&m.cache, &s), KVMIX_SUCCESS);
    m.seqs[s].in_use = 1;
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 0);
    ct_fill(&m, s, 40, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4); /* pages [0,16) [16,32) [32,40) */
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 0);
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 3); /* nothing since: n_entries */
    ct_fill(&m, s, 1, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4);
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 2);
    child = ct_fork_at(&m, s, 41); /* shares the buffer page [32, 41) */
    CHECK(child >= 0);
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 3); /* a fork changes no span of the parent */
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, child, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 0);
    ct_fill(&m, child, 7, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4); /* the child's copy, full */
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 3);
    ct_fill(&m, s, 8, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4); /* the parent's copy, full: sealed */
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 2);
    ct_verify(&m);
    ct_close(&m);
    test_context(NULL);
}

/* ---- truncation ---------------------------------------------------------------------------- */

/* Every byte that sequence s is: its record, page table, slot map, written counts, and each
   referenced page's descriptor and arena bytes; *out_bytes its size. Left out: what other
   sequences change by design (reference counts) and the view tracking a loop's calls move. */
static uint8_t *ct_seq_image(const ct_model *m, int32_t s, size_t *out_bytes) {
    const kvmix_cache *c = &m->cache;
    const kvmix_cache_entry *e = c->entries + (size_t)s * c->desc.max_pages_per_seq;
    int32_t n = c->seqs[s].n_entries, j;
    size_t at = 0, bytes = sizeof c->seqs[s] + (size_t)n * sizeof *e +
                           (size_t)c->seqs[s].n_tokens * sizeof(uint32_t) +
                           (size_t)c->desc.n_layers * sizeof(int32_t);
    uint8_t *img;
    for (j = 0; j < n; j++)
        bytes += sizeof(kvmix_cache_page) +
                 (size_t)c->pages[e[j].page].n_granules * c->desc.granule_bytes;
    img = (uint8_t *)test_alloc(bytes);
#define CT_PUT(p, n)                                                                               \
    do {                                                                                           \
        memcpy(img + at, (p), (n));                                                                \
        at += (n);                                                                                 \
    } while (0)
    {
        kvmix_cache_seq record = c->seqs[s];
        record.view_from = 0;
        record.view_epoch = 0;
        CT_PUT(&record, sizeof record);
    }
    CT_PUT(e, (size_t)n * sizeof *e);
    CT_PUT(c->slots + (size_t)s * c->desc.max_tokens_per_seq,
           (size_t)c->seqs[s].n_tokens * sizeof(uint32_t));
    CT_PUT(c->written + (size_t)s * c->desc.n_layers, (size_t)c->desc.n_layers * sizeof(int32_t));
    for (j = 0; j < n; j++) {
        kvmix_cache_page p = c->pages[e[j].page];
        CT_PUT(c->arena + p.offset, (size_t)p.n_granules * c->desc.granule_bytes);
        p.refcount = 0;
        CT_PUT(&p, sizeof p);
    }
#undef CT_PUT
    *out_bytes = bytes;
    return img;
}

/* Decode of sequence a alone and of b alone on every layer: the same bits, lse included. */
static void ct_same_decode(ct_model *m, int32_t a, int32_t b) {
    int32_t nh = m->desc.n_kv_heads, d = m->desc.head_dim, layer, i;
    float q[4 * 64], oa[4 * 64], ob[4 * 64], la[4], lb[4];
    for (i = 0; i < nh * d; i++) q[i] = (float)(2.0 * test_rng_unit(&m->rng) - 1.0);
    for (layer = 0; layer < m->desc.n_layers; layer++) {
        ct_decode_one(m, a, layer, q, oa, la);
        ct_decode_one(m, b, layer, q, ob, lb);
        CHECK_MEM_EQ(oa, ob, (size_t)nh * d * sizeof(float));
        CHECK_MEM_EQ(la, lb, (size_t)nh * sizeof(float));
    }
}

/* Every position of a and b reads back the same bits in the same formats (evicted in both). */
static void ct_same_rows(ct_model *m, int32_t a, int32_t b) {
    const kvmix_cache *c = &m->cache;
    int32_t layer, pos, hd = c->desc.n_kv_heads * c->desc.head_dim;
    float ka[4 * 64], va[4 * 64], kb[4 * 64], vb[4 * 64];
    kvmix_cache_precision fa, fb;
    CHECK_EQ_INT(c->seqs[a].n_tokens, c->seqs[b].n_tokens);
    for (layer = 0; layer < c->desc.n_layers; layer++)
        for (pos = 0; pos < c->seqs[a].n_tokens; pos++) {
            kvmix_result ra = kvmix_cache_read(c, a, layer, pos, ka, va, &fa);
            kvmix_result rb = kvmix_cache_read(c, b, layer, pos, kb, vb, &fb);
            CHECK_EQ_INT(ra, rb);
            if (ra != KVMIX_SUCCESS) continue;
            CHECK_EQ_INT(fa.key_format, fb.key_format);
            CHECK_EQ_INT(fa.value_format, fb.value_format);
            CHECK_MEM_EQ(ka, kb, (size_t)hd * sizeof(float));
            CHECK_MEM_EQ(va, vb, (size_t)hd * sizeof(float));
        }
}

/* Opens a cache of the small desc with sinks and partial pages sealed at finish, and a sequence
   in it. */
static int32_t ct_truncate_open(ct_model *m, const char *stream) {
    kvmix_cache_desc d;
    int32_t s = -1;
    ct_small_desc(&d);
    d.n_sink = 4;
    d.partial = KVMIX_CACHE_PARTIAL_QUANTIZE;
    ct_open(m, &d, stream);
    CHECK_RESULT(kvmix_cache_seq_create(&m->cache, &s), KVMIX_SUCCESS);
    m->seqs[s].in_use = 1;
    return s;
}

static int32_t ct_create(ct_model *m) {
    int32_t s = -1;
    CHECK_RESULT(kvmix_cache_seq_create(&m->cache, &s), KVMIX_SUCCESS);
    m->seqs[s].in_use = 1;
    return s;
}

/* Truncated, then fed more tokens, a sequence is a fresh one fed the kept and the new tokens:
   to 0, inside the sink page, inside the page being filled, at a page boundary, inside a sealed
   page. FP16 and per-token formats read and decode the same bits (once both sealed their pages:
   finish); per-channel keys keep the scales they were sealed with, and hold what every format
   holds (reads within bounds, decode equal to attention over the rows read back). */
static void test_truncate_matches_fresh(void) {
    static const uint8_t formats[3][2] = {{KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16},
                                          {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT8},
                                          {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2}};
    /* pages: sink [0,4), [4,20), [20,36), [36,44) filling */
    static const int32_t cuts[6] = {0, 2, 4, 41, 20, 27};
    int32_t f, k;
    for (f = 0; f < 3; f++)
        for (k = 0; k < 6; k++) {
            ct_model m;
            int32_t a, b, more[13], t;
            uint8_t kf = formats[f][0], vf = formats[f][1];
            a = ct_truncate_open(&m, "cache truncate fresh");
            test_context("truncate: formats %d/%d, to %d", kf, vf, (int)cuts[k]);
            ct_fill(&m, a, 44, kf, vf);
            ct_truncate(&m, a, cuts[k]);
            ct_verify(&m);
            CHECK_EQ_INT(m.cache.seqs[a].n_tokens, cuts[k]);
            for (t = 0; t < 13; t++) more[t] = ct_new_token(&m);
            ct_feed(&m, a, more, 13, kf, vf);
            b = ct_create(&m);
            ct_feed(&m, b, m.seqs[a].tok, cuts[k], kf, vf);
            ct_feed(&m, b, more, 13, kf, vf);
            CHECK_RESULT(kvmix_cache_seq_finish(&m.cache, a), KVMIX_SUCCESS);
            CHECK_RESULT(kvmix_cache_seq_finish(&m.cache, b), KVMIX_SUCCESS);
            memset(m.seqs[a].exempt, 1, (size_t)m.seqs[a].len);
            memset(m.seqs[b].exempt, 1, (size_t)m.seqs[b].len);
            ct_verify(&m);
            ct_verify_decode(&m, 1);
            if (kf != KVMIX_FORMAT_INT2_CHANNEL) {
                ct_same_rows(&m, a, b);
                ct_same_decode(&m, a, b);
            }
            ct_close(&m);
        }
    test_context(NULL);
}

/* Sequence `cut` is truncated to `at` positions and grows by `grow` in `format`: its sharer
   `other` keeps its image byte for byte and decodes layer `layer` to the same bits, and the kept
   views see every step. */
static void truncate_leaves_sharer(ct_model *m, ct_kept_view *kept, int32_t cut, int32_t at,
                                   int32_t grow, uint8_t format, int32_t other, int32_t layer,
                                   const float *q) {
    float o0[2 * 64], l0[2], o1[2 * 64], l1[2];
    size_t n_before, n_after;
    uint8_t *before, *after;
    ct_decode_one(m, other, layer, q, o0, l0);
    before = ct_seq_image(m, other, &n_before);
    ct_truncate(m, cut, at);
    ct_verify(m);
    ct_kept_step(m, kept, cut);
    ct_fill(m, cut, grow, format, format);
    ct_verify(m);
    ct_kept_step(m, kept, cut);
    ct_kept_step(m, kept, other);
    after = ct_seq_image(m, other, &n_after);
    if (CHECK_EQ_INT((int)n_after, (int)n_before)) CHECK_MEM_EQ(after, before, n_before);
    free(after);
    ct_decode_one(m, other, layer, q, o1, l1);
    CHECK_MEM_EQ(o1, o0, sizeof o0);
    CHECK_MEM_EQ(l1, l0, sizeof l0);
    free(before);
}

/* A fork and its parent share pages: truncating either, inside a shared sealed page or the
   shared buffer page, and growing again leaves the other byte for byte as it was (its page
   table, slot map and every byte of its pages) and decoding the same bits. Kept views see each
   change. */
static void test_truncate_forks(void) {
    ct_model m;
    ct_kept_view kept;
    int32_t p, c, i;
    float q[2 * 64];
    p = ct_truncate_open(&m, "cache truncate forks");
    ct_kept_open(&kept, &m.cache);
    for (i = 0; i < 2 * 64; i++) q[i] = (float)(2.0 * test_rng_unit(&m.rng) - 1.0);
    ct_fill(&m, p, 40, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4); /* [0,4) [4,20) [20,36) [36,40) */
    c = ct_fork_at(&m, p, 38);
    ct_kept_step(&m, &kept, p);
    ct_kept_step(&m, &kept, c);
    /* the child cuts inside a shared sealed page, then grows: the parent stays */
    test_context("truncate the child");
    truncate_leaves_sharer(&m, &kept, c, 25, 30, KVMIX_FORMAT_INT8, p, 1, q);
    /* a second child shares the parent's buffer page; the parent cuts inside it and grows: the
       child stays */
    test_context("truncate the parent");
    c = ct_fork_at(&m, p, 40);
    ct_kept_step(&m, &kept, p);
    truncate_leaves_sharer(&m, &kept, p, 37, 20, KVMIX_FORMAT_INT4, c, 0, q);
    /* to 0: every page released or left to its sharers; the sequence grows from position 0 */
    test_context("truncate to 0");
    ct_truncate(&m, p, 0);
    ct_verify(&m);
    CHECK_EQ_INT(m.cache.seqs[p].n_entries, 0);
    CHECK_EQ_INT(m.cache.seqs[p].n_live, 0);
    ct_kept_step(&m, &kept, p);
    ct_fill(&m, p, 5, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4);
    ct_verify(&m);
    ct_verify_decode(&m, 1);
    ct_kept_step(&m, &kept, p);
    ct_kept_step(&m, &kept, c);
    test_context(NULL);
    ct_kept_close(&kept);
    ct_close(&m);
}

/* Truncation after eviction and compaction: inside a compacted page, the survivors past the cut
   leave; a page whose kept positions are all evicted is released. Then the sequence reads and
   decodes as a fresh one fed the kept tokens, the same evictions and the new tokens. */
static void test_truncate_evicted(void) {
    ct_model m;
    int32_t a, b, pos, n_gone = 0, gone[64], more[10], t, cut = 30;
    size_t freed = 0;
    int compacted = 0;
    a = ct_truncate_open(&m, "cache truncate evicted");
    ct_fill(&m, a, 60, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4); /* [0,4) [4,20) [20,36) ... */
    for (pos = 4; pos < 52; pos++)
        if (pos % 3 != 0) gone[n_gone++] = pos;
    CHECK_RESULT(kvmix_cache_evict(&m.cache, a, gone, n_gone), KVMIX_SUCCESS);
    for (t = 0; t < n_gone; t++) m.seqs[a].alive[gone[t]] = 0;
    CHECK_RESULT(kvmix_cache_compact(&m.cache, a, 0.5, &freed), KVMIX_SUCCESS);
    for (t = 0; t < m.cache.seqs[a].n_entries; t++)
        compacted +=
            m.cache.entries[(size_t)a * m.cache.desc.max_pages_per_seq + t].n_positions > 0;
    CHECK(compacted > 0 && freed > 0);
    ct_verify(&m);
    ct_truncate(&m, a, cut);
    ct_verify(&m);
    for (t = 0; t < 10; t++) more[t] = ct_new_token(&m);
    ct_feed(&m, a, more, 10, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4);
    b = ct_create(&m);
    ct_feed(&m, b, m.seqs[a].tok, cut, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4);
    for (n_gone = 0, pos = 4; pos < cut; pos++)
        if (pos % 3 != 0) gone[n_gone++] = pos;
    CHECK_RESULT(kvmix_cache_evict(&m.cache, b, gone, n_gone), KVMIX_SUCCESS);
    for (t = 0; t < n_gone; t++) m.seqs[b].alive[gone[t]] = 0;
    ct_feed(&m, b, more, 10, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4);
    CHECK_RESULT(kvmix_cache_seq_finish(&m.cache, a), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_finish(&m.cache, b), KVMIX_SUCCESS);
    memset(m.seqs[a].exempt, 1, (size_t)m.seqs[a].len);
    memset(m.seqs[b].exempt, 1, (size_t)m.seqs[b].len);
    ct_verify(&m);
    ct_same_rows(&m, a, b);
    ct_same_decode(&m, a, b);
    /* a cut that leaves a page only evicted positions releases it */
    ct_truncate(&m, a, 6); /* positions 4 and 5 are evicted: the page after the sinks goes */
    ct_verify(&m);
    CHECK_EQ_INT(m.cache.seqs[a].n_entries, 1); /* the sink page alone */
    ct_close(&m);
}

/* Refused truncations name their argument and change nothing; a truncation to the length does
   nothing, and kvmix_cache_view_changes reports the entry a cut changes. */
static void test_truncate_bad_inputs(void) {
    ct_model m;
    int32_t s, from = -1;
    s = ct_truncate_open(&m, "cache truncate bad");
    ct_fill(&m, s, 40, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4); /* [0,4) [4,20) [20,36) [36,40) */
    CHECK_RESULT(kvmix_cache_seq_truncate(NULL, s, 0), KVMIX_ERR_NULL_POINTER);
    ct_snapshot(&m);
    CHECK_RESULT(kvmix_cache_seq_truncate(&m.cache, s, 41), KVMIX_ERR_INVALID_ARGUMENT);
    ct_refused(&m);
    CHECK(strstr(kvmix_cache_last_error(&m.cache), "n_tokens") != NULL);
    CHECK_RESULT(kvmix_cache_seq_truncate(&m.cache, s, -1), KVMIX_ERR_INVALID_ARGUMENT);
    ct_refused(&m);
    CHECK_RESULT(kvmix_cache_seq_truncate(&m.cache, s + 1, 0), KVMIX_ERR_INVALID_ARGUMENT);
    ct_refused(&m);
    CHECK(strstr(kvmix_cache_last_error(&m.cache), "seq") != NULL);
    CHECK_RESULT(kvmix_cache_seq_truncate(&m.cache, -1, 0), KVMIX_ERR_INVALID_ARGUMENT);
    ct_refused(&m);
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    ct_snapshot(&m);
    CHECK_RESULT(kvmix_cache_seq_truncate(&m.cache, s, 40), KVMIX_SUCCESS);
    ct_unchanged(&m);
    ct_truncate(&m, s, 20); /* at a page boundary: entries from 2 go */
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 2);
    ct_truncate(&m, s, 10); /* inside entry 1 */
    CHECK_RESULT(kvmix_cache_view_changes(&m.cache, s, &from), KVMIX_SUCCESS);
    CHECK_EQ_INT(from, 1);
    ct_verify(&m);
    ct_close(&m);
}

void unit_cache(void) {
    int32_t config;
    test_bad_inputs();
    test_error_messages();
    test_zero_precision_is_default();
    test_desc_defaults();
    test_arena_bytes_for();
    test_desc_arena_sizing();
    test_desc_error_fields();
    test_allocator_init();
    test_decode_reaches_2bit();
    test_values_only_window();
    test_fork_sharing();
    test_demote_full_arena();
    test_release_and_check();
    test_reserve_write();
    test_reserve_write_bad_inputs();
    test_runs();
    test_runs_values_window();
    test_runs_fork_unwritten();
    test_fork_keys_sealed();
    test_view_changes();
    test_truncate_bad_inputs();
    test_truncate_matches_fresh();
    test_truncate_forks();
    test_truncate_evicted();
    for (config = 0; config < 24 && test_failed_count() == 0; config++) ct_random_run(config, 480);
}
