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
    size_t bytes = 0;
    memset(&f, 0, sizeof f);
    d.capacity = capacity;
    d.memory_floats = memory_floats;
    d.max_key_ids = 0; /* 256 */
    CHECK_RESULT(kvmix_session_store_memory_bytes(&d, &bytes), KVMIX_SUCCESS);
    f.memory = test_alloc(bytes);
    CHECK_RESULT(kvmix_session_store_init(&f.store, &d, f.memory, bytes - 16),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_RESULT(kvmix_session_store_init(&f.store, &d, f.memory, bytes), KVMIX_SUCCESS);
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
    CHECK_RESULT(kvmix_session_store_memory_bytes(&d, &bytes), KVMIX_ERR_INVALID_ARGUMENT);
    d.capacity = 2, d.max_key_ids = (1 << 16) + 1;
    CHECK_RESULT(kvmix_session_store_memory_bytes(&d, &bytes), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_session_store_init(&f.store, &d, (char *)f.memory + 4, 1024),
                 KVMIX_ERR_INVALID_ARGUMENT);
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
   which 3 and 17 are evicted; 4 query heads. */
static void test_intent_scores(void) {
    enum { N = 40, KV = 2, QH = 4, D = 32 };
    kvmix_cache cache;
    kvmix_cache_desc d;
    kvmix_view view;
    kvmix_view_span spans[8];
    uint8_t dead[64];
    int32_t first[2], seq, n_spans, n_dead, evicted[2] = {3, 17}, t, h, c;
    static float keys[N * KV * D], memory[QH * D];
    float scores[N + 4], *values = keys;
    double total = 0.0;
    memset(&d, 0, sizeof d);
    d.n_layers = 1, d.n_kv_heads = KV, d.head_dim = D, d.page_tokens = 16;
    d.max_tokens_per_seq = 64, d.arena_bytes = 1 << 20;
    d.default_precision.key_format = KVMIX_FORMAT_FP16;
    d.default_precision.value_format = KVMIX_FORMAT_FP16;
    for (t = 0; t < N * KV * D; t++) keys[t] = (float)((t * 7) % 13 - 6) / 8.0f;
    for (t = 0; t < QH * D; t++) memory[t] = (float)((t * 5) % 11 - 5) / 16.0f;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, seq, N, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_write(&cache, seq, 0, 0, N, keys, values), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_evict(&cache, seq, evicted, 2), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_view_counts(&cache, &seq, 1, &n_spans, &n_dead), KVMIX_SUCCESS);
    CHECK(n_spans <= 8 && n_dead <= 64);
    CHECK_RESULT(kvmix_cache_view(&cache, &seq, 1, 0, spans, 8, first, dead, 64, &view),
                 KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_ref_view_intent_score(&view, 0, 3, 0.0f, memory, scores, N),
                 KVMIX_ERR_INVALID_ARGUMENT); /* 3 q heads for 2 kv heads */
    scores[N] = 7.0f;
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
}
