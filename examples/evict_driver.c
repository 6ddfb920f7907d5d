/* evict_driver.c - budgeted eviction run by a decode loop (evict_driver.h), and its backend over
 * the CPU runner. */
#include "evict_driver.h"
#include "kvmix_kv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_KEY_IDS = 256 };

struct evict_driver {
    kvmix_evict_policy policy; /* resolved */
    llama_config c;
    int32_t max_tokens;
    kvmix_session_store store; /* INTENT: a QueryMemory per session */
    void *store_memory;
    uint64_t serial;          /* requests so far: local keys */
    float *query_sum, *fresh; /* [n_layers][n_heads][head_dim] */
    float *scores, *scratch;  /* [max_tokens] */
    uint8_t *live, *forced;   /* [max_tokens] */
    int32_t *evict;           /* [max_tokens] */
    evict_stats stats;
    evict_log_fn log; /* evict_driver_log */
    void *log_user;
    const kvmix_intent_residual *residual; /* evict_driver_residual */
    evict_rows_fn rows;                    /* evict_driver_rows */
    void *rows_user;
    const kvmix_tag_spec *spec; /* the residual's and the rows' tags */
    kvmix_tag *tags;            /* [max_tokens] */
    float *features;            /* [max_tokens][KVMIX_INTENT_RESIDUAL_N_FEATURES] */
    float *attention;           /* [max_tokens]: a prompt's attention, then a request's target */
    float *key_norm, *readout;  /* [max_tokens]: the request's key features */
    const float *memory;        /* the memory the request scored with (INTENT, QUERY) */
    double *later;              /* [max_tokens]: the later prompts' attention, summed */
};

llama_result evict_plan(const kvmix_tag_spec *spec, const int32_t *ids, int64_t n_ids,
                        evict_request *out, int32_t max_requests, int32_t *out_n, char *err,
                        size_t err_bytes) {
    kvmix_tagger tagger;
    int32_t n = 0, turn = -1;
    *out_n = 0;
    if (kvmix_tagger_init(&tagger, spec, NULL) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction: a bad tag spec");
    for (int64_t t = 0; t < n_ids; t++) {
        kvmix_tag tag;
        if (kvmix_tagger_feed(&tagger, &ids[t], 1, &tag) != KVMIX_SUCCESS)
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction: the tagger failed");
        if (tag.role != KVMIX_ROLE_USER) continue;
        if (tag.turn != turn) { /* a new user message */
            if (n == max_requests) break;
            turn = tag.turn;
            out[n].first = (int32_t)t;
            n++;
        }
        out[n - 1].end = (int32_t)t + 1;
    }
    if (n > 0 && out[n - 1].end >= n_ids) n--; /* its prompt never ends */
    *out_n = n;
    return LLAMA_OK;
}

llama_result evict_driver_create(const kvmix_evict_policy *policy, const llama_config *config,
                                 int32_t max_seqs, int32_t max_tokens, evict_driver **out,
                                 char *err, size_t err_bytes) {
    kvmix_error why = {"", ""};
    evict_driver *d = (evict_driver *)calloc(1, sizeof *d);
    size_t q_floats = (size_t)config->n_layers * config->n_heads * config->head_dim;
    size_t t = (size_t)max_tokens, store_bytes = 0;
    *out = NULL;
    if (!d) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    d->policy = *policy;
    if (kvmix_evict_policy_resolve(&d->policy, &why) != KVMIX_SUCCESS) {
        free(d);
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction policy: %s: %s", why.field,
                          why.reason);
    }
    d->c = *config;
    d->max_tokens = max_tokens;
    kvmix_session_store_desc sd = {max_seqs, (int32_t)q_floats, MAX_KEY_IDS};
    if (kvmix_session_store_memory_bytes(&sd, &store_bytes, NULL) == KVMIX_SUCCESS)
        d->store_memory = aligned_alloc(16, (store_bytes + 15) / 16 * 16);
    d->query_sum = (float *)malloc(q_floats * sizeof(float));
    d->fresh = (float *)malloc(q_floats * sizeof(float));
    d->scores = (float *)malloc(t * sizeof(float));
    d->scratch = (float *)malloc(t * sizeof(float));
    d->live = (uint8_t *)malloc(t);
    d->forced = (uint8_t *)malloc(t);
    d->evict = (int32_t *)malloc(t * sizeof(int32_t));
    if (!d->store_memory || !d->query_sum || !d->fresh || !d->scores || !d->scratch || !d->live ||
        !d->forced || !d->evict ||
        kvmix_session_store_init(&d->store, &sd, d->store_memory, store_bytes, NULL) !=
            KVMIX_SUCCESS) {
        evict_driver_free(d);
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    }
    *out = d;
    return LLAMA_OK;
}

void evict_driver_free(evict_driver *d) {
    if (!d) return;
    free(d->store_memory), free(d->query_sum), free(d->fresh), free(d->scores);
    free(d->scratch), free(d->live), free(d->forced), free(d->evict);
    free(d->tags), free(d->features), free(d->attention), free(d->later);
    free(d->key_norm), free(d->readout);
    free(d);
}

/* The buffers the residual and the rows share, and their spec. */
static llama_result feature_buffers(evict_driver *d, const kvmix_tag_spec *spec, char *err,
                                    size_t err_bytes) {
    size_t t = (size_t)d->max_tokens;
    if (d->policy.scorer != KVMIX_EVICT_INTENT && d->policy.scorer != KVMIX_EVICT_QUERY)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "eviction: the intent residual rescores the intent and query scorers");
    if (kvmix_tag_spec_check(spec, NULL) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction: a bad tag spec");
    d->spec = spec;
    if (!d->tags) d->tags = (kvmix_tag *)malloc(t * sizeof *d->tags);
    if (!d->features)
        d->features = (float *)malloc(t * KVMIX_INTENT_RESIDUAL_N_FEATURES * sizeof(float));
    if (!d->attention) d->attention = (float *)malloc(t * sizeof(float));
    if (!d->key_norm) d->key_norm = (float *)malloc(t * sizeof(float));
    if (!d->readout) d->readout = (float *)malloc(t * sizeof(float));
    if (!d->tags || !d->features || !d->attention || !d->key_norm || !d->readout)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    return LLAMA_OK;
}

llama_result evict_driver_residual(evict_driver *d, const kvmix_intent_residual *w,
                                   const kvmix_tag_spec *spec, char *err, size_t err_bytes) {
    kvmix_error why = {"", ""};
    llama_result r = LLAMA_OK;
    if (w && kvmix_intent_residual_check(w, &why) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "intent residual: %s: %s", why.field,
                          why.reason);
    if (w) r = feature_buffers(d, spec, err, err_bytes);
    if (r == LLAMA_OK) d->residual = w;
    return r;
}

llama_result evict_driver_rows(evict_driver *d, evict_rows_fn rows, void *user,
                               const kvmix_tag_spec *spec, char *err, size_t err_bytes) {
    llama_result r = LLAMA_OK;
    if (rows && (d->policy.budget_tokens > 0 || d->policy.budget_fraction < 1.0))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "eviction rows: the policy must keep every position (budget_fraction "
                          "1): an evicted position gets no later attention for being evicted");
    if (rows) r = feature_buffers(d, spec, err, err_bytes);
    if (r == LLAMA_OK && rows && !d->later &&
        !(d->later = (double *)malloc((size_t)d->max_tokens * sizeof *d->later)))
        r = llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    if (r == LLAMA_OK) d->rows = rows, d->rows_user = user;
    return r;
}

void evict_seq_start(evict_driver *d, evict_seq *s, const int32_t *ids,
                     const evict_request *requests, int32_t n_requests) {
    float *mass = s->mass; /* the caller's buffer stays with the state */
    int64_t floats = 0;
    memset(s, 0, sizeof *s);
    s->ids = ids, s->requests = requests, s->n_requests = n_requests;
    s->mass = mass;
    if (mass) memset(mass, 0, (size_t)d->max_tokens * sizeof *mass);
    if (!d->rows || n_requests == 0) return;
    s->row_at = (int64_t *)malloc((size_t)n_requests * sizeof *s->row_at);
    for (int32_t i = 0; s->row_at && i < n_requests; i++) {
        s->row_at[i] = floats;
        /* the rule, its prompt's attention, the key norms and readouts */
        floats += 4 * (int64_t)requests[i].end;
    }
    if (s->row_at) s->rows = (float *)malloc((size_t)floats * sizeof(float));
    s->rows_failed = !s->rows;
}

/* What the step at pos records for the scorer. */
static int32_t record_flags(const evict_driver *d, const evict_seq *s, int32_t pos) {
    const evict_request *r = s->next < s->n_requests ? &s->requests[s->next] : NULL;
    switch (d->policy.scorer) {
    case KVMIX_EVICT_INTENT:
    case KVMIX_EVICT_QUERY:
        return r && pos >= r->first && pos < r->end
                   ? EVICT_OBSERVE_QUERIES | (d->rows ? EVICT_OBSERVE_ATTENTION : 0)
                   : 0;
    case KVMIX_EVICT_H2O: return EVICT_OBSERVE_ATTENTION;
    case KVMIX_EVICT_SNAPKV:
        return r && pos >= r->end - d->policy.observe_tokens && pos < r->end
                   ? EVICT_OBSERVE_ATTENTION
                   : 0;
    default: return 0;
    }
}

/* The memory the request scores with: the session's QueryMemory with this request's mean query
   blended in (INTENT), or that mean alone (QUERY). */
static llama_result request_memory(evict_driver *d, const evict_seq *s, const evict_backend *b,
                                   float **out, char *err, size_t err_bytes) {
    const llama_config *c = &d->c;
    const evict_request *first = &s->requests[0];
    int32_t n_queries = 0, found = 0;
    float *memory = d->fresh;
    double decay = d->policy.scorer == KVMIX_EVICT_INTENT ? d->policy.decay : 0.0;
    llama_result r =
        b->observed_take(b->runner, b->seq, d->query_sum, &n_queries, NULL, err, err_bytes);
    if (r != LLAMA_OK) return r;
    memset(d->fresh, 0, (size_t)c->n_layers * c->n_heads * c->head_dim * sizeof(float));
    if (d->policy.scorer == KVMIX_EVICT_INTENT) {
        kvmix_session_key key;
        if (kvmix_session_key_resolve(NULL, s->ids + first->first, first->end - first->first,
                                      s->ids, first->end, 0, MAX_KEY_IDS, d->serial++,
                                      &key) != KVMIX_SUCCESS ||
            kvmix_session_store_acquire(&d->store, &key, &memory, &found) != KVMIX_SUCCESS)
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction: session store");
        if (!memory) memory = d->fresh; /* a local key: this request alone */
    }
    if (kvmix_query_memory_update(memory, c->n_layers, c->n_heads, c->head_dim, d->query_sum,
                                  n_queries > 0, (float)decay) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction: queries not finite");
    *out = memory;
    return LLAMA_OK;
}

/* The scorer's raw scores of positions [0, n) into d->scores. */
static llama_result raw_scores(evict_driver *d, evict_seq *s, const evict_backend *b, int32_t n,
                               char *err, size_t err_bytes) {
    float *memory = NULL;
    llama_result r = LLAMA_OK;
    switch (d->policy.scorer) {
    case KVMIX_EVICT_INTENT:
    case KVMIX_EVICT_QUERY:
        r = request_memory(d, s, b, &memory, err, err_bytes);
        d->memory = memory;
        return r == LLAMA_OK
                   ? b->intent_scores(b->runner, b->seq, memory, d->scores, err, err_bytes)
                   : r;
    case KVMIX_EVICT_H2O:
        r = b->observed_take(b->runner, b->seq, NULL, NULL, d->scores, err, err_bytes);
        for (int32_t t = 0; r == LLAMA_OK && t < n; t++) d->scores[t] = s->mass[t] += d->scores[t];
        return r;
    case KVMIX_EVICT_SNAPKV:
        return b->observed_take(b->runner, b->seq, NULL, NULL, d->scores, err, err_bytes);
    default: memset(d->scores, 0, (size_t)n * sizeof(float)); return LLAMA_OK;
    }
}

/* The tags of positions [0, n) of ids into d->tags. */
static llama_result tag_prefix(evict_driver *d, const int32_t *ids, int32_t n, char *err,
                               size_t err_bytes) {
    kvmix_tagger tagger;
    if (kvmix_tagger_init(&tagger, d->spec, NULL) != KVMIX_SUCCESS ||
        kvmix_tagger_feed(&tagger, ids, n, d->tags) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction: the tagger failed");
    return LLAMA_OK;
}

/* The key features of positions [0, n) for the memory the request scored with, where the
   backend has them (else 0). */
static llama_result key_features(evict_driver *d, const evict_backend *b, int32_t n, char *err,
                                 size_t err_bytes) {
    if (b->key_features)
        return b->key_features(b->runner, b->seq, d->memory, d->key_norm, d->readout, err,
                               err_bytes);
    memset(d->key_norm, 0, (size_t)n * sizeof(float));
    memset(d->readout, 0, (size_t)n * sizeof(float));
    return LLAMA_OK;
}

/* The rows' record of request r (index i): its rule scores (d->scores), the attention its prompt
   gave each position, and the positions' key features. */
static llama_result record_rows(evict_driver *d, evict_seq *s, const evict_backend *b, int32_t i,
                                char *err, size_t err_bytes) {
    int32_t n = s->requests[i].end;
    float *rule = s->rows + s->row_at[i];
    memcpy(rule, d->scores, (size_t)n * sizeof(float));
    memcpy(rule + 2 * (size_t)n, d->key_norm, (size_t)n * sizeof(float));
    memcpy(rule + 3 * (size_t)n, d->readout, (size_t)n * sizeof(float));
    return b->observed_take(b->runner, b->seq, NULL, NULL, rule + n, err, err_bytes);
}

/* The residual's features of request r's positions [0, r->end) into d->features, from their
   rule scores, key features and d->tags. */
static kvmix_result request_features(evict_driver *d, const float *rule, const float *key_norm,
                                     const float *readout, const evict_request *r,
                                     kvmix_error *why) {
    return kvmix_intent_residual_features(rule, d->tags, d->tags[r->first].turn, key_norm, readout,
                                          r->end, d->features, why);
}

/* d->scores, the rule of request r's positions [0, n), rescored by the residual. */
static llama_result rescore(evict_driver *d, const evict_seq *s, const evict_request *r, int32_t n,
                            char *err, size_t err_bytes) {
    kvmix_error why = {"", ""};
    llama_result lr = tag_prefix(d, s->ids, n, err, err_bytes);
    if (lr != LLAMA_OK) return lr;
    if (request_features(d, d->scores, d->key_norm, d->readout, r, &why) != KVMIX_SUCCESS ||
        kvmix_intent_residual_scores(d->residual, d->features, d->scores, n, d->scores, &why) !=
            KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "eviction: the residual: %s: %s",
                          why.field, why.reason);
    return LLAMA_OK;
}

/* The eviction of request r: positions [0, r->end) exist, the prompt has run. */
static llama_result evict_request_run(evict_driver *d, evict_seq *s, const evict_backend *b,
                                      const evict_request *r, char *err, size_t err_bytes) {
    int32_t kv_seq = -1, n = r->end, keep = 0, n_live = 0, n_evict = 0;
    const kvmix_cache *cache = b->inner(b->runner, b->seq, &kv_seq);
    llama_kv_stats before, after;
    llama_result lr = raw_scores(d, s, b, n, err, err_bytes);
    if (lr == LLAMA_OK && (s->rows || d->residual)) lr = key_features(d, b, n, err, err_bytes);
    if (lr == LLAMA_OK && s->rows)
        lr = record_rows(d, s, b, (int32_t)(r - s->requests), err, err_bytes);
    if (lr == LLAMA_OK && d->residual) lr = rescore(d, s, r, n, err, err_bytes);
    if (lr != LLAMA_OK) return lr;
    for (int32_t t = 0; t < n; t++) {
        uint32_t slot = KVMIX_CACHE_DEAD_SLOT;
        kvmix_cache_locate(cache, kv_seq, t, &slot);
        d->live[t] = slot != KVMIX_CACHE_DEAD_SLOT;
        n_live += d->live[t];
        if (!d->live[t]) d->scores[t] = -INFINITY;
    }
    if (n_live > s->live_peak) s->live_peak = n_live;
    if (kvmix_evict_shape_scores(&d->policy, d->scores, n, d->scratch) != KVMIX_SUCCESS ||
        kvmix_evict_budget(&d->policy, n, &keep) != KVMIX_SUCCESS ||
        kvmix_evict_forced(&d->policy, n, r->first, r->end, d->forced) != KVMIX_SUCCESS ||
        kvmix_evict_select(d->scores, d->live, d->forced, n, keep, d->evict, &n_evict) !=
            KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "eviction: scores that are not numbers");
    if (n_evict == 0) return LLAMA_OK;
    b->seq_stats(b->runner, b->seq, &before);
    if ((lr = b->evict(b->runner, b->seq, d->evict, n_evict, err, err_bytes)) != LLAMA_OK)
        return lr;
    b->seq_stats(b->runner, b->seq, &after);
    d->stats.n_evictions++;
    d->stats.evicted_tokens += n_evict;
    d->stats.bytes_freed += (double)before.bytes - (double)after.bytes;
    if (d->log) d->log(d->log_user, s, (int32_t)(r - s->requests), d->evict, n_evict);
    return LLAMA_OK;
}

llama_result evict_before_step(evict_driver *d, evict_seq *s, const evict_backend *b, int32_t pos,
                               char *err, size_t err_bytes) {
    if (s->rows_failed)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory (eviction rows)");
    if (s->next < s->n_requests && pos == s->requests[s->next].end) {
        llama_result r = evict_request_run(d, s, b, &s->requests[s->next], err, err_bytes);
        if (r != LLAMA_OK) return r;
        s->next++;
    }
    return b->observe(b->runner, b->seq, record_flags(d, s, pos), err, err_bytes);
}

/* The rows of the requests that ran, but the last, newest first: each one's features and what
   the later prompts gave each of its positions, summed in double. */
static void emit_rows(evict_driver *d, const evict_seq *s) {
    int32_t last = s->next - 1;
    if (last < 1 || tag_prefix(d, s->ids, s->requests[last].end, NULL, 0) != LLAMA_OK) return;
    memset(d->later, 0, (size_t)s->requests[last].end * sizeof *d->later);
    for (int32_t i = last - 1; i >= 0; i--) {
        const evict_request *r = &s->requests[i], *next = &s->requests[i + 1];
        const float *rule = s->rows + s->row_at[i], *given = s->rows + s->row_at[i + 1] + next->end;
        for (int32_t t = 0; t < next->end; t++) d->later[t] += given[t];
        if (request_features(d, rule, rule + 2 * (size_t)r->end, rule + 3 * (size_t)r->end, r,
                             NULL) != KVMIX_SUCCESS)
            continue; /* a NaN rule or key feature: nothing the residual could read */
        for (int32_t t = 0; t < r->end; t++) d->attention[t] = (float)d->later[t];
        d->rows(d->rows_user, s, i, d->features, d->attention, r->end);
    }
}

void evict_seq_end(evict_driver *d, evict_seq *s, const evict_backend *b) {
    llama_kv_stats st;
    b->seq_stats(b->runner, b->seq, &st);
    if (st.n_tokens > s->live_peak) s->live_peak = (int32_t)st.n_tokens;
    d->stats.live_peak_sum += s->live_peak;
    d->stats.n_seqs++;
    if (s->rows) emit_rows(d, s);
    evict_seq_release(s);
}

void evict_seq_release(evict_seq *s) {
    free(s->rows), free(s->row_at);
    s->rows = NULL, s->row_at = NULL;
}

void evict_driver_stats(const evict_driver *d, evict_stats *out) { *out = d->stats; }

void evict_driver_log(evict_driver *d, evict_log_fn log, void *user) {
    d->log = log;
    d->log_user = user;
}

/* ---- the backend over the CPU runner's kvmix-backed cache (kvmix_kv.h) ---- */

/* kvmix_kv's calls return a code alone: the message names the call. */
static llama_result cpu_result(llama_result r, const char *who, char *err, size_t err_bytes) {
    return r == LLAMA_OK ? r : llama_fail(err, err_bytes, r, "%s: %s", who, llama_result_string(r));
}

static llama_result cpu_observe(void *runner, int32_t seq, int32_t flags, char *err,
                                size_t err_bytes) {
    (void)seq;
    return cpu_result(kvmix_kv_observe(runner, flags), "kvmix_kv_observe", err, err_bytes);
}

static llama_result cpu_observed_take(void *runner, int32_t seq, float *query_sum,
                                      int32_t *out_n_queries, float *attention, char *err,
                                      size_t err_bytes) {
    (void)seq;
    return cpu_result(kvmix_kv_observed_take(runner, query_sum, out_n_queries, attention),
                      "kvmix_kv_observed_take", err, err_bytes);
}

static llama_result cpu_intent_scores(void *runner, int32_t seq, const float *memory, float *scores,
                                      char *err, size_t err_bytes) {
    (void)seq;
    return cpu_result(kvmix_kv_intent_scores(runner, memory, scores), "kvmix_kv_intent_scores", err,
                      err_bytes);
}

static llama_result cpu_key_features(void *runner, int32_t seq, const float *memory,
                                     float *key_norm, float *readout, char *err, size_t err_bytes) {
    (void)seq;
    return cpu_result(kvmix_kv_key_features(runner, memory, key_norm, readout),
                      "kvmix_kv_key_features", err, err_bytes);
}

static const kvmix_cache *cpu_inner(const void *runner, int32_t seq, int32_t *out_kv_seq) {
    (void)seq;
    return kvmix_kv_inner(runner, out_kv_seq);
}

static llama_result cpu_evict(void *runner, int32_t seq, const int32_t *positions,
                              int32_t n_positions, char *err, size_t err_bytes) {
    (void)seq;
    return cpu_result(kvmix_kv_evict(runner, positions, n_positions), "kvmix_kv_evict", err,
                      err_bytes);
}

static void cpu_seq_stats(const void *runner, int32_t seq, llama_kv_stats *out) {
    const llama_kv_cache *cache = runner;
    (void)seq;
    cache->stats(cache->state, out);
}

evict_backend evict_backend_cpu(llama_kv_cache *cache) {
    evict_backend b = {cache,     0,         cpu_observe,   cpu_observed_take, cpu_intent_scores,
                       cpu_inner, cpu_evict, cpu_seq_stats, cpu_key_features};
    return b;
}
