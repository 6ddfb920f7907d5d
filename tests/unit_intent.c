/* unit_intent: the session store of the intent policy. A request's key resolves in order
   (explicit id, session span, input prefix, request-local); the store finds a session by its
   key's ids, not its hash alone (forced collisions stay apart), keeps a memory per session across
   requests, replaces the least recently used when full and never stores a local key.
   QueryMemory: rows become the normalized mean of the queries, then blend with the decay, unit
   norm each; no query leaves a row; bad input changes nothing. Intent scores: per query head a
   softmax over the live tokens of a cache view, summed over heads, against the same sums in
   double over the stored keys. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const int32_t SPAN[] = {5, 6, 7, 8};
static const int32_t INPUT[] = {1, 2, 3, 4, 5, 6};

static kvmix_session_key resolve(const uint64_t *id, int32_t n_span, int32_t n_input,
                                 int32_t n_prefix, uint64_t serial) {
    kvmix_session_key k;
    memset(&k, 0, sizeof k);
    CHECK_RESULT(
        kvmix_session_key_resolve(id, SPAN, n_span, INPUT, n_input, n_prefix, 3, serial, &k),
        KVMIX_SUCCESS);
    return k;
}

static void test_key_resolution(void) {
    uint64_t id = 42;
    kvmix_session_key k = resolve(&id, 4, 6, 2, 9);
    CHECK_EQ_INT(k.kind, KVMIX_SESSION_KEY_ID);
    CHECK(k.id == 42 && k.n_ids == 0);
    k = resolve(NULL, 4, 6, 2, 9);
    CHECK_EQ_INT(k.kind, KVMIX_SESSION_KEY_SPAN);
    CHECK_EQ_INT(k.n_ids, 3); /* at most max_key_ids (3): the span's first ids */
    CHECK(k.ids == SPAN);
    k = resolve(NULL, 0, 6, 2, 9);
    CHECK_EQ_INT(k.kind, KVMIX_SESSION_KEY_PREFIX);
    CHECK_EQ_INT(k.n_ids, 2);
    CHECK(k.ids == INPUT);
    k = resolve(NULL, 0, 1, 2, 9); /* fewer input ids than the prefix: this request alone */
    CHECK_EQ_INT(k.kind, KVMIX_SESSION_KEY_LOCAL);
    CHECK(k.id == 9 && k.n_ids == 0);
    k = resolve(NULL, 0, 6, 0, 10);
    CHECK_EQ_INT(k.kind, KVMIX_SESSION_KEY_LOCAL);
    CHECK(resolve(NULL, 4, 6, 2, 9).hash != resolve(NULL, 0, 6, 2, 9).hash);
    CHECK_RESULT(kvmix_session_key_resolve(NULL, SPAN, -1, INPUT, 6, 2, 3, 0, &k),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_session_key_resolve(NULL, SPAN, 4, INPUT, 6, 2, 0, 0, &k),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_session_key_resolve(NULL, NULL, 4, INPUT, 6, 2, 3, 0, &k),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_session_key_resolve(NULL, SPAN, 4, INPUT, 6, 2, 3, 0, NULL),
                 KVMIX_ERR_NULL_POINTER);
}

typedef struct store_fixture {
    kvmix_session_store store;
    void *memory;
} store_fixture;

static store_fixture make_store(int32_t capacity, int32_t memory_floats) {
    store_fixture f;
    kvmix_session_store_desc d;
    kvmix_error why = {NULL, NULL};
    size_t bytes = 0;
    memset(&f, 0, sizeof f);
    d.capacity = capacity;
    d.memory_floats = memory_floats;
    d.max_key_ids = 0; /* 256 */
    CHECK_RESULT(kvmix_session_store_memory_bytes(&d, &bytes, NULL), KVMIX_SUCCESS);
    f.memory = test_alloc(bytes);
    CHECK_RESULT(kvmix_session_store_init(&f.store, &d, f.memory, bytes - 16, &why),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK(strcmp(why.field, "memory_bytes") == 0);
    CHECK_RESULT(kvmix_session_store_init(&f.store, &d, f.memory, bytes, &why), KVMIX_SUCCESS);
    CHECK(strcmp(why.field, "") == 0 && strcmp(why.reason, "") == 0);
    CHECK_EQ_INT(f.store.desc.max_key_ids, 256);
    return f;
}

static kvmix_session_key id_key(uint64_t id) {
    kvmix_session_key k;
    memset(&k, 0, sizeof k);
    CHECK_RESULT(kvmix_session_key_resolve(&id, NULL, 0, NULL, 0, 0, 256, 0, &k), KVMIX_SUCCESS);
    return k;
}

/* Acquires key; returns whether it was held, and its memory in *memory. */
static int32_t acquire(store_fixture *f, const kvmix_session_key *key, float **memory) {
    int32_t found = -1;
    CHECK_RESULT(kvmix_session_store_acquire(&f->store, key, memory, &found), KVMIX_SUCCESS);
    return found;
}

/* A memory written under a key comes back under the same key, and only under it. */
static void test_memory_kept(void) {
    store_fixture f = make_store(4, 8);
    kvmix_session_key a = id_key(1), b = id_key(2);
    float *m, *again;
    CHECK_EQ_INT(acquire(&f, &a, &m), 0);
    m[0] = 0.5f, m[7] = -2.0f;
    CHECK_EQ_INT(acquire(&f, &b, &again), 0);
    CHECK(again != m && again[0] == 0.0f);
    CHECK_EQ_INT(acquire(&f, &a, &again), 1);
    CHECK(again == m && again[0] == 0.5f && again[7] == -2.0f);
    CHECK_EQ_INT(f.store.n_used, 2);
    free(f.memory);
}

/* Full: the least recently used session goes, its memory is zeroed for the newcomer. */
static void test_lru(void) {
    store_fixture f = make_store(3, 4);
    kvmix_session_key k[4];
    float *m[4], *x;
    int i;
    for (i = 0; i < 4; i++) k[i] = id_key((uint64_t)(100 + i));
    for (i = 0; i < 3; i++) {
        CHECK_EQ_INT(acquire(&f, &k[i], &m[i]), 0);
        m[i][0] = (float)(i + 1);
    }
    CHECK_EQ_INT(acquire(&f, &k[0], &x), 1); /* 1 is now the least recently used */
    CHECK_EQ_INT(acquire(&f, &k[3], &m[3]), 0);
    CHECK(m[3] == m[1] && m[3][0] == 0.0f);
    CHECK_EQ_INT(f.store.n_used, 3);
    CHECK_EQ_INT(acquire(&f, &k[0], &x), 1);
    CHECK(x[0] == 1.0f);
    CHECK_EQ_INT(acquire(&f, &k[2], &x), 1);
    CHECK(x[0] == 3.0f);
    CHECK_EQ_INT(acquire(&f, &k[1], &x), 0); /* gone: it comes back empty, 3 goes */
    CHECK(x[0] == 0.0f);
    CHECK_EQ_INT(acquire(&f, &k[3], &x), 0);
    free(f.memory);
    f = make_store(1, 1); /* a capacity of one: every other session replaces it */
    CHECK_EQ_INT(acquire(&f, &k[0], &x), 0);
    CHECK_EQ_INT(acquire(&f, &k[0], &x), 1);
    CHECK_EQ_INT(acquire(&f, &k[1], &x), 0);
    CHECK_EQ_INT(acquire(&f, &k[0], &x), 0);
    free(f.memory);
}

/* Keys whose hashes collide, or whose ids agree under another kind, are different sessions. */
static void test_collisions(void) {
    store_fixture f = make_store(8, 2);
    static const int32_t ids_a[] = {7, 8, 9}, ids_b[] = {7, 8, 10};
    kvmix_session_key a, b, c;
    float *ma, *mb, *mc, *x;
    CHECK_RESULT(kvmix_session_key_resolve(NULL, ids_a, 3, NULL, 0, 0, 256, 0, &a), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_session_key_resolve(NULL, ids_b, 3, NULL, 0, 0, 256, 0, &b), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_session_key_resolve(NULL, NULL, 0, ids_a, 3, 3, 256, 0, &c), KVMIX_SUCCESS);
    b.hash = a.hash; /* forced: the same hash, other ids */
    c.hash = a.hash; /* the same ids and hash, a prefix key */
    CHECK_EQ_INT(acquire(&f, &a, &ma), 0);
    CHECK_EQ_INT(acquire(&f, &b, &mb), 0);
    CHECK_EQ_INT(acquire(&f, &c, &mc), 0);
    CHECK(ma != mb && mb != mc && ma != mc);
    ma[0] = 1.0f, mb[0] = 2.0f, mc[0] = 3.0f;
    CHECK_EQ_INT(acquire(&f, &b, &x), 1);
    CHECK(x == mb && x[0] == 2.0f);
    CHECK_EQ_INT(acquire(&f, &a, &x), 1);
    CHECK(x == ma && x[0] == 1.0f);
    free(f.memory);
}

/* A local key gets no memory and changes nothing; bad keys and descs are refused. */
static void test_local_and_bad(void) {
    store_fixture f = make_store(2, 2);
    kvmix_session_key local, bad;
    kvmix_session_store_desc d = {0, 4, 0};
    kvmix_error why = {NULL, NULL};
    float *m = (float *)&f;
    int32_t found = 7;
    size_t bytes;
    CHECK_RESULT(kvmix_session_key_resolve(NULL, NULL, 0, NULL, 0, 4, 256, 5, &local),
                 KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_session_store_acquire(&f.store, &local, &m, &found), KVMIX_SUCCESS);
    CHECK(m == NULL && found == 0 && f.store.n_used == 0 && f.store.clock == 0);
    bad = id_key(1);
    bad.kind = 9;
    CHECK_RESULT(kvmix_session_store_acquire(&f.store, &bad, &m, &found),
                 KVMIX_ERR_INVALID_ARGUMENT);
    bad = id_key(1);
    bad.n_ids = 257;
    bad.ids = SPAN;
    CHECK_RESULT(kvmix_session_store_acquire(&f.store, &bad, &m, &found),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_EQ_INT(f.store.n_used, 0);
    CHECK_RESULT(kvmix_session_store_memory_bytes(&d, &bytes, &why), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(why.field, "capacity") == 0);
    d.capacity = 2, d.max_key_ids = (1 << 16) + 1;
    CHECK_RESULT(kvmix_session_store_memory_bytes(&d, &bytes, &why), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(why.field, "max_key_ids") == 0);
    CHECK_RESULT(kvmix_session_store_init(&f.store, &d, (char *)f.memory + 4, 1024, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(why.field, "max_key_ids") == 0);
    d.max_key_ids = 0;
    CHECK_RESULT(kvmix_session_store_init(&f.store, &d, (char *)f.memory + 4, 1024, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(strcmp(why.field, "memory") == 0);
    free(f.memory);
}

static double row_norm(const float *x, int n) {
    double s = 0.0;
    int i;
    for (i = 0; i < n; i++) s += (double)x[i] * x[i];
    return sqrt(s);
}

/* 2 layers x 2 heads x 4 dims; queries of 3 tokens. */
static void test_query_memory(void) {
    float memory[16], q[3 * 16], before[16], want[4];
    int t, i, r;
    double n;
    memset(memory, 0, sizeof memory);
    for (t = 0; t < 3; t++)
        for (i = 0; i < 16; i++) q[t * 16 + i] = (float)((i % 5) + t) - 2.0f;
    CHECK_RESULT(kvmix_query_memory_update(memory, 2, 2, 4, q, 3, 0.75f), KVMIX_SUCCESS);
    for (r = 0; r < 4; r++) { /* a new row: the normalized mean */
        double mean[4], norm = 0.0;
        for (i = 0; i < 4; i++) {
            mean[i] = (q[r * 4 + i] + q[16 + r * 4 + i] + q[32 + r * 4 + i]) / 3.0;
            norm += mean[i] * mean[i];
        }
        for (i = 0; i < 4; i++) CHECK_NEAR(memory[r * 4 + i], mean[i] / sqrt(norm), 1e-6);
        CHECK_NEAR(row_norm(memory + r * 4, 4), 1.0, 1e-6);
    }
    /* one more request asking along the first axis: the decayed blend, renormalized */
    memcpy(before, memory, sizeof before);
    memset(q, 0, sizeof q);
    for (r = 0; r < 4; r++) q[r * 4] = 3.0f;
    CHECK_RESULT(kvmix_query_memory_update(memory, 2, 2, 4, q, 1, 0.75f), KVMIX_SUCCESS);
    for (r = 0; r < 4; r++) {
        for (i = 0; i < 4; i++) want[i] = 0.75f * before[r * 4 + i] + (i == 0 ? 0.25f : 0.0f);
        n = row_norm(want, 4);
        for (i = 0; i < 4; i++) CHECK_NEAR(memory[r * 4 + i], want[i] / n, 1e-6);
    }
    memcpy(before, memory, sizeof before);
    CHECK_RESULT(kvmix_query_memory_update(memory, 2, 2, 4, NULL, 0, 0.5f), KVMIX_SUCCESS);
    CHECK(memcmp(before, memory, sizeof before) == 0); /* nothing asked */
    q[5] = NAN;
    CHECK_RESULT(kvmix_query_memory_update(memory, 2, 2, 4, q, 1, 0.5f), KVMIX_ERR_BAD_VALUE);
    CHECK_RESULT(kvmix_query_memory_update(memory, 2, 2, 4, q, 1, 1.0f),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_query_memory_update(memory, 0, 2, 4, q, 1, 0.5f),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_query_memory_update(NULL, 2, 2, 4, q, 1, 0.5f), KVMIX_ERR_NULL_POINTER);
    CHECK(memcmp(before, memory, sizeof before) == 0);
}

/* A cache of one layer, 2 kv heads of 32, FP16 rows (exact for these keys), 40 positions of
   which 3 and 17 are evicted, its view, and 4 query heads' memory. */
enum { FIX_N = 40, FIX_KV = 2, FIX_QH = 4, FIX_D = 32 };
typedef struct intent_fixture {
    kvmix_cache cache;
    kvmix_view view;
    kvmix_view_span spans[8];
    uint8_t dead[64];
    int32_t first[2];
    float keys[FIX_N * FIX_KV * FIX_D], memory[FIX_QH * FIX_D];
} intent_fixture;

static int intent_fixture_init(intent_fixture *f) {
    kvmix_cache_desc d;
    int32_t seq, n_spans, n_dead, evicted[2] = {3, 17}, t;
    memset(&d, 0, sizeof d);
    d.n_layers = 1, d.n_kv_heads = FIX_KV, d.head_dim = FIX_D, d.page_tokens = 16;
    d.max_tokens_per_seq = 64, d.arena_bytes = 1 << 20;
    d.default_precision.key_format = KVMIX_FORMAT_FP16;
    d.default_precision.value_format = KVMIX_FORMAT_FP16;
    for (t = 0; t < FIX_N * FIX_KV * FIX_D; t++) f->keys[t] = (float)((t * 7) % 13 - 6) / 8.0f;
    for (t = 0; t < FIX_QH * FIX_D; t++) f->memory[t] = (float)((t * 5) % 11 - 5) / 16.0f;
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&f->cache, &d, NULL, NULL), KVMIX_SUCCESS))
        return 0;
    CHECK_RESULT(kvmix_cache_seq_create(&f->cache, &seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&f->cache, seq, FIX_N, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_write(&f->cache, seq, 0, 0, FIX_N, f->keys, f->keys), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_evict(&f->cache, seq, evicted, 2), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_view_counts(&f->cache, &seq, 1, &n_spans, &n_dead), KVMIX_SUCCESS);
    if (CHECK(n_spans <= 8 && n_dead <= 64) &&
        CHECK_RESULT(
            kvmix_cache_view(&f->cache, &seq, 1, 0, f->spans, 8, f->first, f->dead, 64, &f->view),
            KVMIX_SUCCESS))
        return 1;
    kvmix_cache_deinit(&f->cache); /* a failed check: nothing left for the caller to free */
    return 0;
}

static void test_intent_scores(void) {
    enum { N = FIX_N, KV = FIX_KV, QH = FIX_QH, D = FIX_D };
    static intent_fixture f;
    kvmix_view view;
    const float *keys = f.keys, *memory = f.memory;
    int32_t t, h, c;
    float scores[N + 4];
    double total = 0.0;
    if (!intent_fixture_init(&f)) return;
    view = f.view;
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 0, 3, 0.0f, memory, scores, N),
                 KVMIX_ERR_INVALID_ARGUMENT); /* 3 q heads for 2 kv heads */
    scores[N] = 7.0f;
    scores[0] = 5.0f; /* bad arguments: errors, nothing written */
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 1, QH, 0.0f, memory, scores, N),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 0, QH, -1.0f, memory, scores, N),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 0, QH, NAN, memory, scores, N),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 0, QH, 0.0f, memory, scores, -1),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 0, QH, 0.0f, NULL, scores, N),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_view_intent_score(NULL, 0, QH, 0.0f, memory, scores, N),
                 KVMIX_ERR_NULL_POINTER);
    CHECK(scores[0] == 5.0f);
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 0, QH, 0.0f, memory, scores, N), KVMIX_SUCCESS);
    CHECK(scores[N] == 7.0f); /* nothing past capacity */
    for (t = 0; t < N; t++) {
        double want = 0.0;
        if (t == 3 || t == 17) {
            CHECK(scores[t] == -INFINITY);
            continue;
        }
        for (h = 0; h < QH; h++) { /* softmax of head h at t, in double */
            double logit[N], m = -1e300, l = 0.0;
            int32_t u;
            for (u = 0; u < N; u++) {
                double x = 0.0;
                for (c = 0; c < D; c++)
                    x += (double)memory[h * D + c] * keys[(u * KV + h / 2) * D + c];
                logit[u] = x / sqrt((double)D);
                if (u != 3 && u != 17 && logit[u] > m) m = logit[u];
            }
            for (u = 0; u < N; u++)
                if (u != 3 && u != 17) l += exp(logit[u] - m);
            want += exp(logit[t] - m) / l;
        }
        CHECK_NEAR(scores[t], want, 1e-5);
        total += scores[t];
    }
    CHECK_NEAR(total, QH, 1e-4); /* each head's mass is one */
    kvmix_cache_deinit(&f.cache);
}

/* The residual's key features over the fixture: each live token's mean key norm over the kv
   heads and mean scaled logit over the query heads, against double; evicted tokens 0; bad
   arguments write nothing; capacity bounds what is written. */
static void test_key_features(void) {
    enum { N = FIX_N, KV = FIX_KV, QH = FIX_QH, D = FIX_D };
    static intent_fixture f;
    float norm[N + 1], readout[N + 1];
    int32_t t, h, c;
    if (!intent_fixture_init(&f)) return;
    norm[0] = readout[0] = 5.0f;
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, 3, 0.0f, f.memory, norm, readout, N),
                 KVMIX_ERR_INVALID_ARGUMENT); /* 3 q heads for 2 kv heads */
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 1, QH, 0.0f, f.memory, norm, readout, N),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, -1.0f, f.memory, norm, readout, N),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 0.0f, f.memory, norm, readout, -1),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 0.0f, f.memory, NULL, readout, N),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 0.0f, f.memory, norm, NULL, N),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 0.0f, NULL, norm, readout, N),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_ref_view_key_features(NULL, 0, QH, 0.0f, f.memory, norm, readout, N),
                 KVMIX_ERR_NULL_POINTER);
    CHECK(norm[0] == 5.0f && readout[0] == 5.0f);
    norm[N - 1] = readout[N - 1] = 7.0f;
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 0.0f, f.memory, norm, readout, N - 1),
                 KVMIX_SUCCESS);
    CHECK(norm[N - 1] == 7.0f && readout[N - 1] == 7.0f); /* past capacity: left as it was */
    { /* scale 0: the bits of 1/sqrt(head_dim) */
        float norm2[N], readout2[N];
        CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 0.0f, f.memory, norm, readout, N),
                     KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 1.0f / sqrtf((float)D), f.memory,
                                                 norm2, readout2, N),
                     KVMIX_SUCCESS);
        CHECK_MEM_EQ(norm, norm2, sizeof norm2);
        CHECK_MEM_EQ(readout, readout2, sizeof readout2);
    }
    CHECK_RESULT(kvmix_ref_view_key_features(&f.view, 0, QH, 0.5f, f.memory, norm, readout, N),
                 KVMIX_SUCCESS);
    for (t = 0; t < N; t++) {
        double want_norm = 0.0, want_readout = 0.0;
        if (t == 3 || t == 17) {
            CHECK(norm[t] == 0.0f && readout[t] == 0.0f);
            continue;
        }
        for (h = 0; h < KV; h++) {
            double squares = 0.0;
            for (c = 0; c < D; c++)
                squares += (double)f.keys[(t * KV + h) * D + c] * f.keys[(t * KV + h) * D + c];
            want_norm += sqrt(squares) / KV;
        }
        for (h = 0; h < QH; h++)
            for (c = 0; c < D; c++)
                want_readout += 0.5 * f.memory[h * D + c] * f.keys[(t * KV + h / 2) * D + c] / QH;
        CHECK_NEAR(norm[t], want_norm, 1e-5 * (1.0 + want_norm));
        CHECK_NEAR(readout[t], want_readout, 1e-5 * (1.0 + fabs(want_readout)));
    }
    kvmix_cache_deinit(&f.cache);
}

static kvmix_evict_policy evict_policy(int32_t scorer, double fraction) {
    kvmix_evict_policy p;
    memset(&p, 0, sizeof p);
    p.scorer = scorer;
    p.budget_fraction = fraction;
    p.prefix_tokens = 2;
    return p;
}

/* Budget and forced set: the fraction rounds up, tokens win over it; prefix and span forced. */
static void test_evict_budget_and_forced(void) {
    kvmix_evict_policy p = evict_policy(KVMIX_EVICT_INTENT, 0.25);
    kvmix_error why = {NULL, NULL};
    uint8_t forced[10];
    int32_t keep = -1, t;
    CHECK_RESULT(kvmix_evict_policy_resolve(&p, &why), KVMIX_SUCCESS);
    CHECK(why.field != NULL && strcmp(why.field, "") == 0 && strcmp(why.reason, "") == 0);
    CHECK_EQ_INT(p.observe_tokens, 32);
    CHECK_EQ_INT(p.pool_tokens, 1); /* pooling is SnapKV's by default */
    {
        kvmix_evict_policy snap = evict_policy(KVMIX_EVICT_SNAPKV, 0.25);
        CHECK_RESULT(kvmix_evict_policy_resolve(&snap, &why), KVMIX_SUCCESS);
        CHECK_EQ_INT(snap.pool_tokens, 7);
    }
    CHECK_RESULT(kvmix_evict_budget(&p, 10, &keep), KVMIX_SUCCESS);
    CHECK_EQ_INT(keep, 3); /* ceil(2.5) */
    CHECK_RESULT(kvmix_evict_budget(&p, 0, &keep), KVMIX_SUCCESS);
    CHECK_EQ_INT(keep, 1);
    p.budget_tokens = 6;
    CHECK_RESULT(kvmix_evict_budget(&p, 10, &keep), KVMIX_SUCCESS);
    CHECK_EQ_INT(keep, 6);
    CHECK_RESULT(kvmix_evict_forced(&p, 10, 6, 8, forced), KVMIX_SUCCESS);
    for (t = 0; t < 10; t++) CHECK_EQ_INT(forced[t], t < 2 || t == 6 || t == 7);
    CHECK_RESULT(kvmix_evict_forced(&p, 10, 8, 11, forced), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_evict_forced(&p, 10, 8, 7, forced), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_evict_budget(&p, -1, &keep), KVMIX_ERR_INVALID_ARGUMENT);
}

/* Bad policies are refused with the field named, and resolve writes nothing then. */
static void test_evict_bad_policy(void) {
    static const struct {
        int32_t scorer, budget_tokens, pool;
        double fraction, decay, recent_fraction;
        const char *field;
    } bad[] = {{0, 0, 0, 0.5, 0.0, 0.0, "scorer"},
               {6, 0, 0, 0.5, 0.0, 0.0, "scorer"},
               {1, -1, 0, 0.5, 0.0, 0.0, "budget_tokens"},
               {1, 0, 0, 0.0, 0.0, 0.0, "budget_fraction"},
               {1, 0, 0, 1.5, 0.0, 0.0, "budget_fraction"},
               {1, 0, 0, 0.5, 1.0, 0.0, "decay"},
               {1, 0, 0, 0.5, -0.1, 0.0, "decay"},
               {5, 0, 4, 0.5, 0.0, 0.0, "pool_tokens"},
               {1, 0, KVMIX_EVICT_MAX_POOL + 2, 0.5, 0.0, 0.0, "pool_tokens"},
               {4, 0, 0, 0.5, 0.0, -0.25, "recent_fraction"},
               {4, 0, 0, 0.5, 0.0, 1.5, "recent_fraction"},
               {4, 0, 0, 0.5, 0.0, NAN, "recent_fraction"}};
    size_t i;
    for (i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvmix_evict_policy p = evict_policy(bad[i].scorer, bad[i].fraction), before;
        kvmix_error why = {NULL, NULL};
        int32_t keep = 77;
        p.budget_tokens = bad[i].budget_tokens;
        p.pool_tokens = bad[i].pool;
        p.decay = bad[i].decay;
        p.recent_fraction = bad[i].recent_fraction;
        before = p;
        CHECK_RESULT(kvmix_evict_policy_resolve(&p, &why), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK(why.field && strcmp(why.field, bad[i].field) == 0);
        CHECK(memcmp(&p, &before, sizeof p) == 0);
        CHECK_RESULT(kvmix_evict_budget(&p, 10, &keep), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_EQ_INT(keep, 77);
    }
    CHECK_RESULT(kvmix_evict_policy_resolve(NULL, NULL), KVMIX_ERR_NULL_POINTER);
}

/* Selection: forced kept whatever their score, the top unforced fill the rest, ties keep the
   later position, dead positions neither count nor come back, output in increasing order. */
static void test_evict_select(void) {
    enum { N = 12 };
    float scores[N] = {0, 0, 5, 1, 7, 3, 3, 9, 2, 0, -1, 4};
    uint8_t live[N], forced[N];
    int32_t out[N], n = -1, t, kept = 0;
    memset(live, 1, sizeof live);
    memset(forced, 0, sizeof forced);
    forced[0] = forced[1] = forced[10] = 1; /* low scores, forced anyway */
    live[7] = 0;                            /* the best score, already gone */
    CHECK_RESULT(kvmix_evict_select(scores, live, forced, N, 7, out, &n), KVMIX_SUCCESS);
    /* live 11, forced 3: room 4 of 8 candidates {2:5, 3:1, 4:7, 5:3, 6:3, 8:2, 9:0, 11:4};
       keep 4:7, 2:5, 11:4, 6:3 (the later of the tie at 3) */
    CHECK_EQ_INT(n, 4);
    CHECK_EQ_INT(out[0], 3);
    CHECK_EQ_INT(out[1], 5);
    CHECK_EQ_INT(out[2], 8);
    CHECK_EQ_INT(out[3], 9);
    for (t = 0; t < n; t++) CHECK(!forced[out[t]] && live[out[t]]);
    for (t = 0; t < N; t++) kept += live[t];
    CHECK_EQ_INT(kept - n, 7);
    CHECK_RESULT(kvmix_evict_select(scores, live, forced, N, 11, out, &n), KVMIX_SUCCESS);
    CHECK_EQ_INT(n, 0); /* fits */
    CHECK_RESULT(kvmix_evict_select(scores, live, forced, N, 1, out, &n), KVMIX_SUCCESS);
    CHECK_EQ_INT(n, 8); /* the forced alone exceed it: every unforced goes */
    scores[5] = NAN;
    n = 99;
    CHECK_RESULT(kvmix_evict_select(scores, live, forced, N, 7, out, &n), KVMIX_ERR_BAD_VALUE);
    CHECK_EQ_INT(n, 99);
    scores[5] = 3;
    scores[7] = NAN; /* a dead position's score is not read */
    CHECK_RESULT(kvmix_evict_select(scores, live, forced, N, 7, out, &n), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_evict_select(scores, live, forced, N, -1, out, &n),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_evict_select(NULL, live, forced, N, 1, out, &n), KVMIX_ERR_NULL_POINTER);
}

/* A large random selection agrees with a count of what ranks above each kept position. */
static void test_evict_select_random(void) {
    enum { N = 3000 };
    static float scores[N];
    static uint8_t forced[N];
    static int32_t out[N];
    static uint8_t evicted[N];
    int32_t n = 0, t, keep = 900, worst_kept = -1;
    srand(7);
    for (t = 0; t < N; t++) {
        scores[t] = (float)(rand() % 500);
        forced[t] = rand() % 10 == 0;
    }
    CHECK_RESULT(kvmix_evict_select(scores, NULL, forced, N, keep, out, &n), KVMIX_SUCCESS);
    memset(evicted, 0, sizeof evicted);
    for (t = 0; t < n; t++) {
        CHECK(!forced[out[t]]);
        if (t > 0) CHECK(out[t] > out[t - 1]);
        evicted[out[t]] = 1;
    }
    CHECK_EQ_INT(N - n, keep);
    for (t = 0; t < N; t++) /* the lowest-ranked kept candidate */
        if (!evicted[t] && !forced[t] &&
            (worst_kept < 0 || scores[t] < scores[worst_kept] ||
             (scores[t] == scores[worst_kept] && t < worst_kept)))
            worst_kept = t;
    for (t = 0; t < n; t++) /* every evicted ranks below it */
        CHECK(scores[out[t]] < scores[worst_kept] ||
              (scores[out[t]] == scores[worst_kept] && out[t] < worst_kept));
}

/* Scorer shapes: recency (no floor), the recent floor under the other scorers, the max-pool
   before the floor (SnapKV's by default, any attention scorer's when asked; never
   StreamingLLM's); evicted stay -inf. */
static void test_evict_shape(void) {
    kvmix_evict_policy p = evict_policy(KVMIX_EVICT_STREAMING, 0.5);
    float s[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2}, scratch[8];
    int32_t t, scorer;
    p.recent_tokens = 3;
    CHECK_RESULT(kvmix_evict_shape_scores(&p, s, 8, NULL), KVMIX_SUCCESS);
    for (t = 0; t < 8; t++) CHECK(t == 2 ? s[t] == -INFINITY : s[t] == (float)t);
    for (scorer = KVMIX_EVICT_INTENT; scorer <= KVMIX_EVICT_H2O; scorer++) {
        float h[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2};
        if (scorer == KVMIX_EVICT_STREAMING) continue;
        p.scorer = scorer;
        CHECK_RESULT(kvmix_evict_shape_scores(&p, h, 8, NULL), KVMIX_SUCCESS);
        CHECK(h[0] == 4 && h[2] == -INFINITY && h[4] == 0);
        for (t = 5; t < 8; t++) CHECK(h[t] == INFINITY);
    }
    p.recent_tokens = 0;
    {
        float h[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2};
        p.scorer = KVMIX_EVICT_H2O;
        CHECK_RESULT(kvmix_evict_shape_scores(&p, h, 8, NULL), KVMIX_SUCCESS);
        CHECK(h[5] == 9 && h[7] == 2);
    }
    { /* the floor as a share of the budget: keep ceil(0.5 * 8) = 4, half of it recent */
        float h[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2};
        p.recent_fraction = 0.5;
        CHECK_RESULT(kvmix_evict_shape_scores(&p, h, 8, NULL), KVMIX_SUCCESS);
        CHECK(h[5] == 9 && h[6] == INFINITY && h[7] == INFINITY);
        {
            float g[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2};
            p.recent_tokens = 3; /* the larger floor holds */
            CHECK_RESULT(kvmix_evict_shape_scores(&p, g, 8, NULL), KVMIX_SUCCESS);
            CHECK(g[4] == 0 && g[5] == INFINITY);
        }
        {
            float g[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2};
            p.recent_tokens = 0, p.recent_fraction = 1.0, p.budget_tokens = 3; /* of its tokens */
            CHECK_RESULT(kvmix_evict_shape_scores(&p, g, 8, NULL), KVMIX_SUCCESS);
            CHECK(g[4] == 0 && g[5] == INFINITY && g[6] == INFINITY && g[7] == INFINITY);
        }
        p.recent_fraction = 0.0, p.budget_tokens = 0;
    }
    {
        float k[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2};
        float want[8] = {4, 4, -INFINITY, 0, 9, 9, 9, 2};
        float floored[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2};
        p.scorer = KVMIX_EVICT_SNAPKV;
        p.pool_tokens = 3;
        p.recent_tokens = 2; /* pooled first: the floor's +inf spreads nowhere */
        CHECK_RESULT(kvmix_evict_shape_scores(&p, floored, 8, scratch), KVMIX_SUCCESS);
        CHECK(floored[4] == 9 && floored[5] == 9 && floored[6] == INFINITY);
        p.recent_tokens = 0;
        CHECK_RESULT(kvmix_evict_shape_scores(&p, k, 8, NULL), KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_evict_shape_scores(&p, k, 8, scratch), KVMIX_SUCCESS);
        for (t = 0; t < 8; t++) CHECK(k[t] == want[t]);
        k[0] = NAN;
        k[1] = 5;
        CHECK_RESULT(kvmix_evict_shape_scores(&p, k, 8, scratch), KVMIX_ERR_BAD_VALUE);
        CHECK(k[1] == 5);
    }
    for (scorer = KVMIX_EVICT_INTENT; scorer <= KVMIX_EVICT_H2O; scorer++) {
        float k[8] = {4, 1, -INFINITY, 0, 0, 9, 0, 2}, wide[8];
        float want[8] = {4, 4, -INFINITY, 0, 9, 9, 9, 2};
        p.scorer = scorer;
        p.pool_tokens = KVMIX_EVICT_MAX_POOL; /* the widest: every position takes the max */
        memcpy(wide, k, sizeof wide);
        CHECK_RESULT(kvmix_evict_shape_scores(&p, wide, 8, scratch), KVMIX_SUCCESS);
        for (t = 0; t < 8; t++)
            CHECK(scorer == KVMIX_EVICT_STREAMING || wide[t] == (t == 2 ? -INFINITY : 9.0f));
        p.pool_tokens = 3;
        CHECK_RESULT(kvmix_evict_shape_scores(&p, k, 8, scratch), KVMIX_SUCCESS);
        for (t = 0; t < 8; t++)
            CHECK(scorer == KVMIX_EVICT_STREAMING ? t == 2 || k[t] == (float)t : k[t] == want[t]);
        p.pool_tokens = 1;
        CHECK_RESULT(kvmix_evict_shape_scores(&p, k, 8, NULL), KVMIX_SUCCESS);
    }
}

/* View positions: the view's token order mapped back to positions; a released page's positions
   leave the view, evicted rows of a kept page stay listed, a fork's rows of a sealed shared page
   past its fork point are -1; too small a buffer writes nothing. */
static void test_view_positions(void) {
    enum { N = 40, KV = 1, D = 32 };
    kvmix_cache cache;
    kvmix_cache_desc d;
    static float rows[N * KV * D];
    int32_t seq, child, t, n = -1, gone[17], pos[64], layer;
    memset(&d, 0, sizeof d);
    d.n_layers = 2, d.n_kv_heads = KV, d.head_dim = D, d.page_tokens = 16;
    d.max_tokens_per_seq = 64, d.arena_bytes = 1 << 20, d.max_seqs = 2;
    d.default_precision.key_format = KVMIX_FORMAT_INT8;
    d.default_precision.value_format = KVMIX_FORMAT_INT8;
    for (t = 0; t < N * KV * D; t++) rows[t] = (float)(t % 9) / 8.0f;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, seq, N, NULL, NULL), KVMIX_SUCCESS);
    for (layer = 0; layer < 2; layer++)
        CHECK_RESULT(kvmix_cache_write(&cache, seq, layer, 0, N, rows, rows), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seal_ready(&cache, seq), KVMIX_SUCCESS);
    for (t = 0; t < 16; t++) gone[t] = 16 + t; /* the whole second page */
    gone[16] = 5;
    CHECK_RESULT(kvmix_cache_evict(&cache, seq, gone, 17), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_view_positions(&cache, seq, 0, pos, 23, &n),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_EQ_INT(n, -1);
    for (layer = 0; layer < 2; layer++) {
        CHECK_RESULT(kvmix_cache_view_positions(&cache, seq, layer, pos, 64, &n), KVMIX_SUCCESS);
        CHECK_EQ_INT(n, 24);
        for (t = 0; t < 16; t++) CHECK_EQ_INT(pos[t], t); /* 5 is evicted, still listed */
        for (t = 16; t < 24; t++) CHECK_EQ_INT(pos[t], 16 + t);
    }
    CHECK_RESULT(kvmix_cache_seq_fork(&cache, seq, 10, &child), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_view_positions(&cache, child, 0, pos, 64, &n), KVMIX_SUCCESS);
    CHECK_EQ_INT(n, 16);
    for (t = 0; t < 16; t++) CHECK_EQ_INT(pos[t], t < 10 ? t : -1);
    CHECK_RESULT(kvmix_cache_view_positions(&cache, seq, 2, pos, 64, &n),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_view_positions(&cache, 5, 0, pos, 64, &n), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_view_positions(&cache, seq, 0, NULL, 64, &n), KVMIX_ERR_NULL_POINTER);
    kvmix_cache_deinit(&cache);
}

/* ---- compaction ---- */

enum { CL = 2, CKV = 2, CD = 64, CN = 200, CP = 16 };

static void compaction_cache(kvmix_cache *cache, kvmix_format key, kvmix_format value,
                             int32_t seqs) {
    kvmix_cache_desc d;
    memset(&d, 0, sizeof d);
    d.n_layers = CL, d.n_kv_heads = CKV, d.head_dim = CD, d.page_tokens = CP;
    d.max_tokens_per_seq = 256, d.arena_bytes = 1 << 22, d.max_seqs = seqs, d.n_boost = 8;
    d.default_precision.key_format = (uint8_t)key;
    d.default_precision.value_format = (uint8_t)value;
    CHECK_RESULT(kvmix_cache_init_allocator(cache, &d, NULL, NULL), KVMIX_SUCCESS);
}

/* Every position's rows on every layer: [CN][CL][CKV * CD] keys then values; NAN when evicted or
   not reserved yet. */
static void read_all(kvmix_cache *cache, int32_t seq, float *keys, float *values) {
    int32_t t, l, i;
    for (t = 0; t < CN; t++)
        for (l = 0; l < CL; l++) {
            float *k = keys + ((size_t)t * CL + (size_t)l) * CKV * CD;
            float *v = values + ((size_t)t * CL + (size_t)l) * CKV * CD;
            kvmix_result r = t < cache->seqs[seq].n_tokens
                                 ? kvmix_cache_read(cache, seq, l, t, k, v, NULL)
                                 : KVMIX_ERR_NOT_FOUND; /* not there yet */
            if (r == KVMIX_ERR_NOT_FOUND)
                for (i = 0; i < CKV * CD; i++) k[i] = v[i] = NAN;
            else
                CHECK_RESULT(r, KVMIX_SUCCESS);
        }
}

/* Attention over the live rows read back, layer 0, in double: q and out [CKV * 2][CD], two q
   heads per kv head that ask the same query. */
static void attention_of_rows(const float *keys, const float *values, const float *q, double *out) {
    int32_t h, t, c;
    for (h = 0; h < CKV; h++) {
        double m = -1e300, l = 0.0, acc[CD] = {0};
        for (t = 0; t < CN; t++) {
            const float *k = keys + (size_t)t * CL * CKV * CD + (size_t)h * CD;
            double x = 0.0;
            if (k[0] != k[0]) continue;
            for (c = 0; c < CD; c++) x += (double)q[2 * h * CD + c] * k[c];
            if (x / 8.0 > m) m = x / 8.0;
        }
        for (t = 0; t < CN; t++) {
            const float *k = keys + (size_t)t * CL * CKV * CD + (size_t)h * CD;
            const float *v = values + (size_t)t * CL * CKV * CD + (size_t)h * CD;
            double x = 0.0, w;
            if (k[0] != k[0]) continue;
            for (c = 0; c < CD; c++) x += (double)q[2 * h * CD + c] * k[c];
            w = exp(x / 8.0 - m);
            l += w;
            for (c = 0; c < CD; c++) acc[c] += w * v[c];
        }
        for (c = 0; c < CD; c++)
            out[(size_t)(2 * h) * CD + c] = out[(size_t)(2 * h + 1) * CD + c] = acc[c] / l;
    }
}

/* Compaction of scattered evictions: memory comes back, positions and values stay (FP16 and
   per-token exactly up to FP16 rounding, per-channel keys within their quantization error),
   evicted positions stay gone and are never attended, later evictions and appends work. */
static void test_compaction_formats(void) {
    static const kvmix_format keys[] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                        KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
                                        KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
    static const kvmix_format values[] = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4,
                                          KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT4};
    static float rows[CN * CL * CKV * CD * 2], before[2][CN * CL * CKV * CD],
        after[2][CN * CL * CKV * CD], q[2 * CKV * CD], out[2 * CKV * CD], lse[2 * CKV];
    static double want[2 * CKV * CD];
    static uint8_t workspace[1 << 16];
    test_rng rng;
    size_t f, i;
    test_rng_init(&rng, "compaction");
    for (i = 0; i < sizeof rows / sizeof rows[0]; i++)
        rows[i] = (float)(test_rng_normal(&rng) * 0.5);
    for (i = 0; i < 2 * CKV * CD; i++) q[i] = (float)(test_rng_normal(&rng) * 0.3);
    for (i = CD; i < 2 * CD; i++) q[i] = q[i - CD]; /* two q heads per kv head, the same query */
    for (i = 3 * CD; i < 4 * CD; i++) q[i] = q[i - CD];
    for (f = 0; f < sizeof keys / sizeof keys[0]; f++) {
        kvmix_cache cache;
        kvmix_cache_stats st0, st1;
        int32_t seq, gone[CN], n_gone = 0, t, c, extra, compacted = 0;
        size_t freed = 0;
        double worst = 0.0,
               tol = keys[f] == KVMIX_FORMAT_INT2_CHANNEL || keys[f] == KVMIX_FORMAT_BOOSTED ? 1.0
                                                                                             : 0.0;
        test_context("keys %s values %s", kvmix_format_name(keys[f]), kvmix_format_name(values[f]));
        compaction_cache(&cache, keys[f], values[f], 1);
        CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_ingest(&cache, seq, CN, rows, rows + CN * CL * CKV * CD, NULL),
                     KVMIX_SUCCESS);
        for (t = 0; t < 176; t++) /* 3 of 4 positions of the sealed pages go */
            if (test_rng_range(&rng, 0, 3) != 0) gone[n_gone++] = t;
        CHECK_RESULT(kvmix_cache_evict(&cache, seq, gone, n_gone), KVMIX_SUCCESS);
        read_all(&cache, seq, before[0], before[1]);
        CHECK_RESULT(kvmix_cache_stats_get(&cache, &st0), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_compact(&cache, seq, 0.5, &freed), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_stats_get(&cache, &st1), KVMIX_SUCCESS);
        CHECK(freed > 0);
        CHECK_EQ_UINT(st0.arena_used_bytes - st1.arena_used_bytes, freed);
        CHECK(st1.n_pages < st0.n_pages);
        CHECK_EQ_INT(st1.n_live_tokens, st0.n_live_tokens);
        for (t = 0; t < cache.seqs[seq].n_entries; t++) { /* compacted pages: rows of 8 */
            const kvmix_cache_entry *e = &cache.entries[t];
            CHECK(e->n_positions == 0 || cache.pages[e->page].n_rows % 8 == 0);
            compacted += e->n_positions > 0;
        }
        CHECK(compacted > 0);
        read_all(&cache, seq, after[0], after[1]);
        for (i = 0; i < 2 * (size_t)CN * CL * CKV * CD; i++) {
            float a = before[i % 2][i / 2], b = after[i % 2][i / 2];
            CHECK((a != a) == (b != b)); /* evicted stay evicted, the rest readable */
            if (a == a && fabs((double)a - b) > worst) worst = fabs((double)a - b);
        }
        /* FP16 and per-token rows move byte for byte; per-channel keys get new channel scales */
        if (tol == 0.0)
            CHECK_MSG(worst == 0.0, "largest change %g", worst);
        else
            CHECK_MSG(worst <= tol, "largest change %g", worst);
        attention_of_rows(after[0], after[1], q, want);
        CHECK_RESULT(kvmix_cache_ref_decode(&cache, &seq, 1, 0, 2 * CKV, 0.0f, q, out, lse,
                                            workspace, sizeof workspace),
                     KVMIX_SUCCESS);
        for (c = 0; c < 2 * CKV * CD; c++) CHECK_NEAR(out[c], want[c], 1e-4);
        /* a survivor of a compacted page can be evicted after, and its row leaves the view */
        for (extra = 0; extra < CN && before[0][(size_t)extra * CL * CKV * CD] !=
                                          before[0][(size_t)extra * CL * CKV * CD];
             extra++) {
        }
        CHECK_RESULT(kvmix_cache_evict(&cache, seq, &extra, 1), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_read(&cache, seq, 0, extra, out, NULL, NULL), KVMIX_ERR_NOT_FOUND);
        CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
        read_all(&cache, seq, before[0], before[1]);
        for (i = 0; i < (size_t)CL * CKV * CD; i++)
            after[0][(size_t)extra * CL * CKV * CD + i] = NAN;
        for (i = 0; i < (size_t)CN * CL * CKV * CD; i++)
            CHECK((before[0][i] != before[0][i]) == (after[0][i] != after[0][i]));
        attention_of_rows(before[0], before[1], q, want);
        CHECK_RESULT(kvmix_cache_ref_decode(&cache, &seq, 1, 0, 2 * CKV, 0.0f, q, out, lse,
                                            workspace, sizeof workspace),
                     KVMIX_SUCCESS);
        for (c = 0; c < 2 * CKV * CD; c++) CHECK_NEAR(out[c], want[c], 1e-4);
        /* the sequence grows on, and compacting again finds what is left */
        CHECK_RESULT(kvmix_cache_ingest(&cache, seq, 40, rows, rows + CN * CL * CKV * CD, NULL),
                     KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_compact(&cache, seq, 1.0, &freed), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
        kvmix_cache_deinit(&cache);
    }
    test_context(NULL);
}

/* Brings a loop's kept spans of seq's layer-0 view up to date (kvmix_cache_view_changes, then
   kvmix_cache_view_seq from the first changed entry) and checks them against the spans built
   whole: a change the cache does not report leaves a stale span. */
static void kept_spans_update(kvmix_cache *c, int32_t seq, kvmix_view_span *kept, int32_t *n_kept) {
    static kvmix_view_span whole[64];
    static uint8_t dead[64 * 64];
    int32_t from = -1, n = 0, nd = 0, j;
    CHECK_RESULT(kvmix_cache_view_changes(c, seq, &from), KVMIX_SUCCESS);
    if (from > *n_kept) from = *n_kept;
    CHECK_RESULT(kvmix_cache_view_seq(c, seq, 0, from, kept + from, 64 - from, dead, sizeof dead, 0,
                                      &n, &nd),
                 KVMIX_SUCCESS);
    *n_kept = from + n;
    CHECK_RESULT(kvmix_cache_view_seq(c, seq, 0, 0, whole, 64, dead, sizeof dead, 0, &n, &nd),
                 KVMIX_SUCCESS);
    CHECK_EQ_INT(*n_kept, n);
    for (j = 0; j < n && j < *n_kept; j++)
        CHECK_MSG(kept[j].key_offset == whole[j].key_offset &&
                      kept[j].value_offset == whole[j].value_offset &&
                      kept[j].n_tokens == whole[j].n_tokens &&
                      kept[j].key_format == whole[j].key_format &&
                      (kept[j].dead_index >= 0) == (whole[j].dead_index >= 0),
                  "kept span %d differs from the span built whole", (int)j);
}

/* Rounds of random evictions, each followed by compaction at a random fraction and more tokens:
   the cache stays consistent, every live position reads back what it held, evicted ones stay
   gone, and decode equals attention over the rows read back. */
static void test_compaction_rounds(void) {
    static float rows[CN * CL * CKV * CD * 2], before[2][CN * CL * CKV * CD],
        after[2][CN * CL * CKV * CD], q[2 * CKV * CD], out[2 * CKV * CD], lse[2 * CKV];
    static double want[2 * CKV * CD];
    static uint8_t workspace[1 << 16];
    static const double fractions[] = {0.25, 0.5, 0.75, 1.0};
    kvmix_cache cache;
    kvmix_view_span kept[64];
    int32_t seq, round, t, c, n_tokens = 0, gone[CN], n_gone, n_kept = 0;
    size_t i, freed, freed_all = 0;
    test_rng rng;
    test_rng_init(&rng, "compaction rounds");
    for (i = 0; i < sizeof rows / sizeof rows[0]; i++)
        rows[i] = (float)(test_rng_normal(&rng) * 0.5);
    for (i = 0; i < 2 * CKV * CD; i++) /* two q heads per kv head ask the same query */
        q[i] = (i / CD) % 2 ? q[i - CD] : (float)(test_rng_normal(&rng) * 0.3);
    compaction_cache(&cache, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT8, 1);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
    for (round = 0; round < 5; round++) {
        int32_t add = 40;
        CHECK_RESULT(kvmix_cache_ingest(&cache, seq, add, rows + (size_t)n_tokens * CL * CKV * CD,
                                        rows + CN * CL * CKV * CD, NULL),
                     KVMIX_SUCCESS);
        n_tokens += add;
        n_gone = 0;
        for (t = 0; t < n_tokens - 16; t++)
            if (test_rng_range(&rng, 0, 2) == 0) gone[n_gone++] = t;
        CHECK_RESULT(kvmix_cache_evict(&cache, seq, gone, n_gone), KVMIX_SUCCESS);
        read_all(&cache, seq, before[0], before[1]);
        kept_spans_update(&cache, seq, kept, &n_kept);
        CHECK_RESULT(
            kvmix_cache_compact(&cache, seq, fractions[test_rng_range(&rng, 0, 3)], &freed),
            KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
        kept_spans_update(&cache, seq, kept, &n_kept); /* compaction merged entries */
        freed_all += freed;
        read_all(&cache, seq, after[0], after[1]);
        for (i = 0; i < (size_t)CN * CL * CKV * CD; i++) {
            CHECK((before[0][i] != before[0][i]) == (after[0][i] != after[0][i]));
            if (before[0][i] == before[0][i])
                CHECK(before[0][i] == after[0][i] && before[1][i] == after[1][i]);
        }
        attention_of_rows(after[0], after[1], q, want);
        CHECK_RESULT(kvmix_cache_ref_decode(&cache, &seq, 1, 0, 2 * CKV, 0.0f, q, out, lse,
                                            workspace, sizeof workspace),
                     KVMIX_SUCCESS);
        for (c = 0; c < 2 * CKV * CD; c++) CHECK_NEAR(out[c], want[c], 1e-4);
    }
    CHECK(freed_all > 0);
    kvmix_cache_deinit(&cache);
}

/* Shared pages never move and are never freed while referenced: a fork evicts and compacts on
   its own, the parent reads as before; bad arguments change nothing. */
static void test_compaction_shared(void) {
    static float rows[CN * CL * CKV * CD * 2], before[2][CN * CL * CKV * CD],
        after[2][CN * CL * CKV * CD];
    kvmix_cache cache;
    kvmix_cache_stats st0, st1;
    int32_t parent, child, gone[CN], n_gone = 0, t, j, shared_before = 0, shared_after = 0;
    size_t freed = 7, i;
    test_rng rng;
    test_rng_init(&rng, "compaction shared");
    for (i = 0; i < sizeof rows / sizeof rows[0]; i++)
        rows[i] = (float)(test_rng_normal(&rng) * 0.5);
    compaction_cache(&cache, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, 2);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &parent), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_ingest(&cache, parent, CN, rows, rows + CN * CL * CKV * CD, NULL),
                 KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_fork(&cache, parent, 96, &child), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_ingest(&cache, child, 100, rows, rows + CN * CL * CKV * CD, NULL),
                 KVMIX_SUCCESS);
    for (t = 0; t < 176; t++)
        if (t % 4 != 0) gone[n_gone++] = t;
    CHECK_RESULT(kvmix_cache_evict(&cache, child, gone, n_gone), KVMIX_SUCCESS);
    read_all(&cache, parent, before[0], before[1]);
    for (j = 0; j < cache.seqs[child].n_entries; j++)
        shared_before +=
            cache
                .pages[cache.entries[(size_t)child * cache.desc.max_pages_per_seq + (size_t)j].page]
                .refcount > 1;
    CHECK_RESULT(kvmix_cache_stats_get(&cache, &st0), KVMIX_SUCCESS);
    /* bad arguments: nothing moves */
    CHECK_RESULT(kvmix_cache_compact(&cache, child, 0.0, &freed), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_compact(&cache, child, 1.5, &freed), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_compact(&cache, child, NAN, &freed), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_compact(&cache, 9, 0.5, &freed), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_compact(NULL, child, 0.5, &freed), KVMIX_ERR_NULL_POINTER);
    CHECK_EQ_UINT(freed, 7);
    CHECK_RESULT(kvmix_cache_stats_get(&cache, &st1), KVMIX_SUCCESS);
    CHECK_EQ_UINT(st1.arena_used_bytes, st0.arena_used_bytes);
    CHECK_RESULT(kvmix_cache_compact(&cache, child, 0.5, &freed), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS); /* reference counts hold */
    for (j = 0; j < cache.seqs[child].n_entries; j++)
        shared_after +=
            cache
                .pages[cache.entries[(size_t)child * cache.desc.max_pages_per_seq + (size_t)j].page]
                .refcount > 1;
    CHECK_EQ_INT(shared_after, shared_before); /* the 6 pages of the first 96 positions */
    CHECK_EQ_INT(shared_before, 6);
    CHECK(freed > 0); /* the child's own pages 96 .. 176 */
    read_all(&cache, parent, after[0], after[1]);
    CHECK_MEM_EQ(before[0], after[0], sizeof before[0]);
    CHECK_MEM_EQ(before[1], after[1], sizeof before[1]);
    CHECK_RESULT(kvmix_cache_seq_free(&cache, parent), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
}

void unit_intent(void) {
    test_key_resolution();
    test_memory_kept();
    test_lru();
    test_collisions();
    test_local_and_bad();
    test_query_memory();
    test_intent_scores();
    test_key_features();
    test_evict_budget_and_forced();
    test_evict_bad_policy();
    test_evict_select();
    test_evict_select_random();
    test_evict_shape();
    test_view_positions();
    test_compaction_formats();
    test_compaction_shared();
    test_compaction_rounds();
}
