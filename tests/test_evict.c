/* Budgeted eviction on the CPU runner (evict_driver.h over the kvmix-backed cache, kvmix_kv.h)
 * with kvm-small on the first eval-dev traces, each cut to TEXT_TOKENS ids, the requests found by
 * examples/specs/kvm-byte.json:
 *   - what the cache records is what the runner computed: the summed queries equal the queries a
 *     capture wrapper saw (bit for bit), and the recorded attention of a step is one softmax per
 *     q head and layer (it sums to n_heads * n_layers per step);
 *   - intent at 50%, on each trace: positions are evicted (evicted_tokens > 0, and exactly as
 *     many positions have no slot at the end), the protected prefix and every request's user
 *     message survive, bits per token is finite and within 2% of the same run without eviction;
 *   - intent at 100% evicts nothing and gives the run without eviction bit for bit;
 *   - query, streaming, h2o and snapkv at 50% on one trace evict, keep the forced set and stay
 *     within 2%;
 *   - the intent residual: zero output weights evict the rule's positions, weights on age evict
 *     others; its training rows (trace 4 whole): one call per request a later one followed, the
 *     positions' features, targets within what the later prompts can give; the run unchanged.
 * Usage: model_test_evict [SHARED_DIR] (default ../shared), run from the repository root.
 * Prints one line per failed check and "N passed, N failed"; exits nonzero on any failure. */
#define _POSIX_C_SOURCE 200809L /* model_check.h's popen */
#include "evict_driver.h"
#include "kvmix_kv.h"
#include "llama.h"
#include "model_check.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

/* Long enough that each trace's first user message (from position ~660) runs and is evicted at,
   short enough for the sanitizers; the residual's rows take a whole trace of 3 user turns (the
   fourth of eval-dev's traces), its first LONG_TOKENS ids. */
enum { TEXT_TOKENS = 1000, N_TRACES = 3, PREFIX_TOKENS = 4, LONG_TOKENS = 2049, LONG_TRACE = 3 };

typedef struct text {
    int32_t *ids;
    int64_t n;
} text;

/* One run of the policy's cache over a text, evicting when d is not NULL; with the residual's
   weights and rows (both NULL: none) given to the driver. */
typedef struct run {
    llama_runner *runner;
    llama_kv_cache cache;
    evict_driver *d;
    evict_seq s;
    evict_request requests[16];
    int32_t n_requests;
    const kvmix_intent_residual *residual;
    evict_rows_fn rows;
    void *rows_user;
} run;

static llama_result before_step(void *user, int64_t pos, char *err, size_t err_bytes) {
    run *r = user;
    evict_backend b = evict_backend_cpu(&r->cache);
    return evict_before_step(r->d, &r->s, &b, (int32_t)pos, err, err_bytes);
}

/* Traces skip .. skip + n - 1 of eval-dev, <|endoftext|> first, cut to max_tokens ids. */
static bool load_traces(const char *path, const llama_tokenizer *tok, int32_t skip,
                        int64_t max_tokens, text *out, int32_t n) {
    FILE *f = fopen(path, "rb");
    static char line[1 << 20];
    int32_t got = 0;
    while (f != NULL && got < n && fgets(line, sizeof line, f) != NULL) {
        cJSON *obj = cJSON_ParseWithLengthOpts(line, strlen(line), NULL, 0);
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(obj, "kind");
        const cJSON *body = cJSON_GetObjectItemCaseSensitive(obj, "text");
        if (cJSON_IsString(kind) && strcmp(kind->valuestring, "trace") == 0 &&
            cJSON_IsString(body) && skip-- <= 0) {
            size_t len = strlen(body->valuestring);
            int64_t m = 0;
            out[got].ids = malloc((len + 1) * sizeof *out[got].ids);
            out[got].ids[0] = llama_special_id(tok, "<|endoftext|>");
            llama_tokenize(tok, body->valuestring, len, out[got].ids + 1, &m);
            out[got++].n = m + 1 < max_tokens ? m + 1 : max_tokens;
        }
        cJSON_Delete(obj);
    }
    if (f != NULL) fclose(f);
    return got == n;
}

/* fp16 with an "evict" of this scorer and budget (scorer 0: none), resolved for the model. */
static kvmix_policy evict_policy(const llama_config *c, int32_t scorer, double budget) {
    kvmix_policy p = *kvmix_kv_policy_builtin("fp16"), out;
    if (scorer != 0) {
        kvmix_evict_policy ev = {scorer, 0, budget, 0.0, PREFIX_TOKENS, 64, 32, 0, 0.0};
        ev.decay = scorer == KVMIX_EVICT_INTENT ? 0.25 : 0.0;
        p.evict = ev;
    }
    char err[256];
    if (!CHECK(kvmix_kv_policy_resolve(&p, c->head_dim, &out, err, sizeof err) == LLAMA_OK))
        printf("  %s\n", err);
    return out;
}

/* Scores t with the policy's cache, evicting as it says; *stats what eviction did, r->cache left
   holding the text (the caller destroys it). False when something failed. */
static bool run_text(run *r, const llama_model *m, const kvmix_tag_spec *spec,
                     const kvmix_policy *p, const text *t, llama_score *score, evict_stats *stats) {
    char err[512] = "";
    float *mass = malloc((size_t)t->n * sizeof *mass);
    llama_step_hook hook = {before_step, r};
    bool evicting = p->evict.scorer != 0;
    memset(stats, 0, sizeof *stats);
    memset(score, 0, sizeof *score);
    r->d = NULL;
    llama_result lr = kvmix_kv_create(p, &m->config, (int32_t)t->n, &r->cache, err, sizeof err);
    if (lr == LLAMA_OK && evicting)
        lr = evict_driver_create(&p->evict, &m->config, 1, (int32_t)t->n, &r->d, err, sizeof err);
    if (lr == LLAMA_OK && evicting && r->residual)
        lr = evict_driver_residual(r->d, r->residual, spec, err, sizeof err);
    if (lr == LLAMA_OK && evicting && r->rows)
        lr = evict_driver_rows(r->d, r->rows, r->rows_user, spec, err, sizeof err);
    if (lr == LLAMA_OK && evicting)
        lr = evict_plan(spec, t->ids, t->n, r->requests, 16, &r->n_requests, err, sizeof err);
    if (lr == LLAMA_OK && evicting) {
        r->s.mass = mass;
        evict_seq_start(r->d, &r->s, t->ids, r->requests, r->n_requests);
    }
    if (lr == LLAMA_OK)
        lr = llama_score_sequence_hooked(r->runner, &r->cache, t->ids, t->n, NULL, NULL, NULL,
                                         evicting ? &hook : NULL, score, err, sizeof err);
    if (lr == LLAMA_OK && evicting) {
        evict_backend b = evict_backend_cpu(&r->cache);
        evict_seq_end(r->d, &r->s, &b);
        evict_driver_stats(r->d, stats);
    }
    if (lr != LLAMA_OK && evicting) evict_seq_release(&r->s);
    evict_driver_free(r->d);
    free(mass);
    if (!CHECK_MSG(lr == LLAMA_OK, err)) return false;
    return true;
}

/* Positions [0, n) of the cache's sequence without a slot (evicted). */
static int64_t dead_positions(const llama_kv_cache *cache, int64_t n, uint8_t *dead) {
    int32_t seq = -1;
    const kvmix_cache *c = kvmix_kv_inner(cache, &seq);
    int64_t n_dead = 0;
    for (int64_t t = 0; t < n; t++) {
        uint32_t slot = KVMIX_CACHE_DEAD_SLOT;
        kvmix_cache_locate(c, seq, (int32_t)t, &slot);
        dead[t] = slot == KVMIX_CACHE_DEAD_SLOT;
        n_dead += dead[t];
    }
    return n_dead;
}

/* The forced set survived: the prefix and every request's user message. */
static bool forced_kept(const run *r, const uint8_t *dead) {
    for (int32_t t = 0; t < PREFIX_TOKENS; t++)
        if (dead[t]) return false;
    for (int32_t i = 0; i < r->n_requests; i++)
        for (int32_t t = r->requests[i].first; t < r->requests[i].end; t++)
            if (dead[t]) return false;
    return true;
}

/* One evicting run against the run without eviction (bits): evicted, forced set kept, close. */
static void check_evicting(run *r, const llama_model *m, const kvmix_tag_spec *spec, int32_t scorer,
                           const text *t, double bits) {
    kvmix_policy p = evict_policy(&m->config, scorer, 0.5);
    llama_score score;
    evict_stats st;
    uint8_t dead[TEXT_TOKENS];
    char what[256];
    if (!run_text(r, m, spec, &p, t, &score, &st)) return;
    double got = score.bits / (double)score.n_scored;
    int64_t n_dead = dead_positions(&r->cache, t->n - 1, dead);
    snprintf(what, sizeof what,
             "%s 50%%: %lld requests, %lld evicted (%lld dead), %.6f bits/token against %.6f",
             kvmix_evict_scorer_name(scorer), (long long)r->n_requests,
             (long long)st.evicted_tokens, (long long)n_dead, got, bits);
    CHECK_MSG(r->n_requests > 0 && st.n_evictions > 0 && st.evicted_tokens > 0, what);
    CHECK_MSG(n_dead == st.evicted_tokens, what);
    CHECK_MSG(forced_kept(r, dead), what);
    CHECK_MSG(isfinite(got) && fabs(got - bits) <= 0.02 * bits, what);
    CHECK_MSG(st.bytes_freed > 0 && st.n_seqs == 1, what);
    r->cache.destroy(r->cache.state);
}

/* Intent at 50% and 100% on each trace, against the run without eviction. */
static void test_intent(run *r, const llama_model *m, const kvmix_tag_spec *spec, const text *t) {
    kvmix_policy none = evict_policy(&m->config, 0, 1.0);
    kvmix_policy all = evict_policy(&m->config, KVMIX_EVICT_INTENT, 1.0);
    llama_score base, kept;
    evict_stats st;
    if (!run_text(r, m, spec, &none, t, &base, &st)) return;
    r->cache.destroy(r->cache.state);
    double bits = base.bits / (double)base.n_scored;
    check_evicting(r, m, spec, KVMIX_EVICT_INTENT, t, bits);
    if (!run_text(r, m, spec, &all, t, &kept, &st)) return;
    CHECK(st.n_evictions == 0 && st.evicted_tokens == 0 && st.n_seqs == 1);
    CHECK(kept.bits == base.bits && kept.n_scored == base.n_scored);
    r->cache.destroy(r->cache.state);
}

/* Every other scorer at 50% on one trace. */
static void test_scorers(run *r, const llama_model *m, const kvmix_tag_spec *spec, const text *t) {
    kvmix_policy none = evict_policy(&m->config, 0, 1.0);
    llama_score base;
    evict_stats st;
    if (!run_text(r, m, spec, &none, t, &base, &st)) return;
    r->cache.destroy(r->cache.state);
    const int32_t scorers[] = {KVMIX_EVICT_QUERY, KVMIX_EVICT_STREAMING, KVMIX_EVICT_H2O,
                               KVMIX_EVICT_SNAPKV};
    for (size_t i = 0; i < sizeof scorers / sizeof scorers[0]; i++)
        check_evicting(r, m, spec, scorers[i], t, base.bits / (double)base.n_scored);
}

/* Records queries and attention from the first step (reset() cleared what was set before). */
static llama_result observe_all(void *user, int64_t pos, char *err, size_t err_bytes) {
    (void)err, (void)err_bytes;
    return pos == 0 ? kvmix_kv_observe(user, KVMIX_KV_OBSERVE_QUERIES | KVMIX_KV_OBSERVE_ATTENTION)
                    : LLAMA_OK;
}

/* The recording against a capture of the same steps: queries summed bit for bit (in the order
   the steps ran), attention one softmax per q head and layer a step. */
static void test_recording(llama_runner *runner, const llama_model *m, const text *t) {
    const llama_config *c = &m->config;
    enum { STEPS = 200 };
    int32_t n_queries = 0;
    size_t q_floats = (size_t)c->n_layers * c->n_heads * c->head_dim;
    kvmix_policy p = evict_policy(c, 0, 1.0);
    llama_kv_cache cache, wrapped;
    llama_capture cap;
    llama_step_hook hook = {observe_all, &cache};
    llama_score score = {0};
    float *sum = calloc(q_floats, sizeof *sum), *want = calloc(q_floats, sizeof *want);
    float attention[STEPS];
    double total = 0;
    char err[256] = "";
    if (!CHECK(kvmix_kv_create(&p, c, TEXT_TOKENS, &cache, err, sizeof err) == LLAMA_OK)) return;
    CHECK(llama_capture_init(&cap, c, STEPS) == LLAMA_OK);
    CHECK(llama_kv_capture_wrap(&cache, &cap, &wrapped) == LLAMA_OK);
    CHECK(llama_score_sequence_hooked(runner, &wrapped, t->ids, STEPS + 1, NULL, NULL, NULL, &hook,
                                      &score, err, sizeof err) == LLAMA_OK);
    CHECK(kvmix_kv_observed_take(&cache, sum, &n_queries, attention) == LLAMA_OK);
    for (int32_t l = 0; l < c->n_layers; l++)
        for (int32_t s = 0; s < STEPS; s++)
            for (size_t i = 0; i < (size_t)c->n_heads * c->head_dim; i++)
                want[(size_t)l * c->n_heads * c->head_dim + i] +=
                    cap.q[((size_t)l * STEPS + s) * c->n_heads * c->head_dim + i];
    for (int32_t s = 0; s < STEPS; s++) total += attention[s];
    CHECK(n_queries == STEPS);
    CHECK(memcmp(sum, want, q_floats * sizeof *sum) == 0);
    CHECK(fabs(total - (double)STEPS * c->n_heads * c->n_layers) <= 1e-3 * STEPS);
    /* taken: nothing recorded is left */
    CHECK(kvmix_kv_observed_take(&cache, sum, &n_queries, attention) == LLAMA_OK);
    CHECK(n_queries == 0 && sum[0] == 0.0f && attention[0] == 0.0f);
    CHECK(kvmix_kv_observe(&cache, 4) == LLAMA_ERR_ARGUMENT);
    wrapped.destroy(wrapped.state);
    llama_capture_free(&cap);
    cache.destroy(cache.state);
    free(sum), free(want);
}

/* One hidden unit reading feature k alone: the residual out = scale * gelu(feature k). */
typedef struct one_unit {
    float w1[KVMIX_INTENT_RESIDUAL_N_FEATURES], b1, w2;
    kvmix_intent_residual w;
} one_unit;

static void one_unit_make(one_unit *u, int32_t feature, float scale) {
    memset(u, 0, sizeof *u);
    u->w1[feature] = 1.0f;
    u->w2 = scale;
    kvmix_intent_residual w = {
        KVMIX_INTENT_RESIDUAL_N_FEATURES, 1, u->w1, &u->b1, &u->w2, 0.0f, 1.0f, 100.0f};
    u->w = w;
}

/* Intent at 50% with the residual: zero output weights evict what the rule evicts, position for
   position; weights that favour old positions, large keys or a high readout evict others. */
static void test_residual(run *r, const llama_model *m, const kvmix_tag_spec *spec, const text *t) {
    kvmix_policy p = evict_policy(&m->config, KVMIX_EVICT_INTENT, 0.5);
    one_unit zero, age, key_norm, readout;
    llama_score score;
    evict_stats st;
    uint8_t rule_dead[TEXT_TOKENS], dead[TEXT_TOKENS];
    int64_t n = t->n - 1, n_rule;
    one_unit_make(&zero, KVMIX_INTENT_FEATURE_LOG_AGE, 0.0f);
    one_unit_make(&age, KVMIX_INTENT_FEATURE_LOG_AGE, 10.0f);
    one_unit_make(&key_norm, KVMIX_INTENT_FEATURE_KEY_NORM, 10.0f);
    one_unit_make(&readout, KVMIX_INTENT_FEATURE_READOUT, 10.0f);
    if (!run_text(r, m, spec, &p, t, &score, &st)) return;
    n_rule = dead_positions(&r->cache, n, rule_dead);
    r->cache.destroy(r->cache.state);
    r->residual = &zero.w;
    if (run_text(r, m, spec, &p, t, &score, &st)) {
        CHECK(dead_positions(&r->cache, n, dead) == n_rule && n_rule > 0);
        CHECK_MSG(memcmp(dead, rule_dead, (size_t)n) == 0, "zero residual: the rule's evictions");
        r->cache.destroy(r->cache.state);
    }
    const one_unit *moved[3] = {&age, &key_norm, &readout};
    const char *names[3] = {"age", "key norm", "readout"};
    for (int32_t i = 0; i < 3; i++) {
        char what[64];
        r->residual = &moved[i]->w;
        if (!run_text(r, m, spec, &p, t, &score, &st)) continue;
        snprintf(what, sizeof what, "%s residual: other evictions", names[i]);
        CHECK(dead_positions(&r->cache, n, dead) == n_rule); /* the same budget */
        CHECK_MSG(memcmp(dead, rule_dead, (size_t)n) != 0, what);
        CHECK(forced_kept(r, dead));
        r->cache.destroy(r->cache.state);
    }
    r->residual = NULL;
    /* refused: weights that do not check, a scorer the residual does not rescore */
    kvmix_policy streaming = evict_policy(&m->config, KVMIX_EVICT_STREAMING, 0.5);
    evict_driver *d = NULL, *s_d = NULL;
    char err[256];
    age.w.alpha_max = -1.0f;
    CHECK(evict_driver_create(&p.evict, &m->config, 1, 64, &d, err, sizeof err) == LLAMA_OK);
    CHECK(evict_driver_residual(d, &age.w, spec, err, sizeof err) == LLAMA_ERR_ARGUMENT);
    age.w.alpha_max = 100.0f;
    CHECK(evict_driver_create(&streaming.evict, &m->config, 1, 64, &s_d, err, sizeof err) ==
          LLAMA_OK);
    CHECK(evict_driver_residual(s_d, &age.w, spec, err, sizeof err) == LLAMA_ERR_ARGUMENT);
    evict_driver_free(d), evict_driver_free(s_d);
}

/* What the rows callback saw. */
typedef struct rows_seen {
    const evict_request *requests;
    int32_t n_calls, last_request;
    int32_t bad_shape, bad_age, bad_role, bad_target, bad_key_norm, bad_readout, negative_readouts;
    int32_t widest;              /* the positions of the widest request's rows */
    float key_norm[LONG_TOKENS]; /* its key norms */
    double target_sum[16];
} rows_seen;

static void rows_check(void *user, const evict_seq *s, int32_t request, const float *features,
                       const float *target, int32_t n) {
    rows_seen *seen = user;
    const int32_t F = KVMIX_INTENT_RESIDUAL_N_FEATURES;
    seen->bad_shape += request != seen->last_request - 1 || n != s->requests[request].end;
    seen->last_request = request;
    seen->n_calls++;
    if (n > seen->widest) memset(seen->key_norm, 0, sizeof seen->key_norm);
    for (int32_t t = 0; t < n; t++) {
        const float *f = features + (size_t)t * F;
        float roles = 0.0f;
        for (int32_t k = 0; k < 7; k++) roles += f[KVMIX_INTENT_FEATURE_ROLE + k];
        seen->bad_age += f[KVMIX_INTENT_FEATURE_LOG_AGE] != (float)log1p((double)(n - 1 - t));
        seen->bad_role += roles != 1.0f;
        seen->bad_target += !(target[t] >= -1e-3f);
        seen->bad_key_norm += !(f[KVMIX_INTENT_FEATURE_KEY_NORM] > 0.0f) ||
                              !isfinite(f[KVMIX_INTENT_FEATURE_KEY_NORM]);
        seen->bad_readout += !isfinite(f[KVMIX_INTENT_FEATURE_READOUT]);
        seen->negative_readouts += f[KVMIX_INTENT_FEATURE_READOUT] < 0.0f; /* attention is not */
        if (n > seen->widest) seen->key_norm[t] = f[KVMIX_INTENT_FEATURE_KEY_NORM];
        if (request < 16) seen->target_sum[request] += target[t];
    }
    if (n > seen->widest) seen->widest = n;
}

/* The largest relative gap between the key norms the rows gave the widest request's positions
   and the mean over layers and kv heads of their keys' norms as the cache holds them (FP16: as
   written, the same at every request); -1 when the rows cannot be read. */
static double key_norm_gap(llama_kv_cache *cache, const llama_config *c, const rows_seen *seen) {
    const int32_t n = seen->widest, heads = c->n_kv_heads, d = c->head_dim;
    size_t floats = (size_t)c->n_layers * n * heads * d;
    float *keys = malloc(floats * sizeof(float)), *values = malloc(floats * sizeof(float));
    double worst = -1.0;
    if (keys && values && kvmix_kv_rows_read(cache, n, keys, values) == LLAMA_OK) {
        worst = 0.0;
        for (int32_t t = 0; t < n; t++) {
            double want = 0.0;
            for (int32_t l = 0; l < c->n_layers; l++)
                for (int32_t h = 0; h < heads; h++) {
                    const float *k = keys + (((size_t)l * n + t) * heads + h) * d;
                    double squares = 0.0;
                    for (int32_t i = 0; i < d; i++) squares += (double)k[i] * k[i];
                    want += sqrt(squares) / (c->n_layers * heads);
                }
            worst = fmax(worst, fabs(seen->key_norm[t] - want) / want);
        }
    }
    free(keys), free(values);
    return worst;
}

/* Intent at 100% (no eviction) with the rows on a trace of 3 user turns: the run gives the bits
   it gives without them; one call per request that a later one followed, in order, with the
   features the positions have (age, one role each) and as target the later prompts' attention,
   which is at most one softmax per q head, layer and later prompt token. */
static void test_rows(run *r, const llama_model *m, const kvmix_tag_spec *spec, const text *t) {
    kvmix_policy p = evict_policy(&m->config, KVMIX_EVICT_INTENT, 1.0);
    rows_seen seen;
    llama_score base, score;
    evict_stats st;
    memset(&seen, 0, sizeof seen);
    if (!run_text(r, m, spec, &p, t, &base, &st)) return;
    r->cache.destroy(r->cache.state);
    r->rows = rows_check, r->rows_user = &seen;
    seen.last_request = r->n_requests - 1; /* newest first: the first call is the one before */
    bool ran = run_text(r, m, spec, &p, t, &score, &st);
    r->rows = NULL, r->rows_user = NULL;
    if (!ran) return;
    double gap = key_norm_gap(&r->cache, &m->config, &seen);
    r->cache.destroy(r->cache.state);
    char what[256];
    snprintf(what, sizeof what, "rows: %d requests, %d calls", (int)r->n_requests, seen.n_calls);
    CHECK_MSG(r->n_requests >= 3 && seen.n_calls == r->n_requests - 1, what);
    CHECK(score.bits == base.bits && score.n_scored == base.n_scored);
    CHECK(seen.bad_shape == 0 && seen.bad_age == 0 && seen.bad_role == 0 && seen.bad_target == 0);
    snprintf(what, sizeof what,
             "rows: key norms positive (%d not) and the cache's keys' mean norm (largest relative "
             "gap %.2e), readouts finite (%d not), some negative (%d)",
             (int)seen.bad_key_norm, gap, (int)seen.bad_readout, (int)seen.negative_readouts);
    CHECK_MSG(seen.bad_key_norm == 0 && gap >= 0.0 && gap <= 1e-4 && seen.bad_readout == 0 &&
                  seen.negative_readouts > 0,
              what);
    for (int32_t i = 0; i + 1 < r->n_requests && i < 16; i++) {
        int64_t later = 0;
        for (int32_t j = i + 1; j < r->n_requests; j++)
            later += r->requests[j].end - r->requests[j].first;
        double most = (double)later * m->config.n_layers * m->config.n_heads;
        snprintf(what, sizeof what, "rows: request %d's target %.3f of at most %.0f", (int)i,
                 seen.target_sum[i], most);
        CHECK_MSG(seen.target_sum[i] > 0.0 && seen.target_sum[i] <= most * (1.0 + 1e-5), what);
    }
    kvmix_policy streaming = evict_policy(&m->config, KVMIX_EVICT_STREAMING, 0.5);
    evict_driver *d = NULL;
    char err[256];
    CHECK(evict_driver_create(&streaming.evict, &m->config, 1, 64, &d, err, sizeof err) ==
          LLAMA_OK);
    CHECK(evict_driver_rows(d, rows_check, &seen, spec, err, sizeof err) == LLAMA_ERR_ARGUMENT);
    evict_driver_free(d);
    kvmix_policy half = evict_policy(&m->config, KVMIX_EVICT_INTENT, 0.5); /* it evicts */
    CHECK(evict_driver_create(&half.evict, &m->config, 1, 64, &d, err, sizeof err) == LLAMA_OK);
    CHECK(evict_driver_rows(d, rows_check, &seen, spec, err, sizeof err) == LLAMA_ERR_ARGUMENT);
    evict_driver_free(d);
}

int main(int argc, char **argv) {

    const char *shared = argc > 1 ? argv[1] : "../shared";
    char model_path[512], data_path[512], err[512] = "";
    snprintf(model_path, sizeof model_path, "%s/models/kvm-small.safetensors", shared);
    snprintf(data_path, sizeof data_path, "%s/data/eval-dev.jsonl", shared);
    static tag_spec_doc spec;
    llama_model model;
    llama_runner runner;
    text traces[N_TRACES], long_trace;
    if (!CHECK_MSG(llama_model_load(model_path, &model, err, sizeof err) == LLAMA_OK, err) ||
        !CHECK(tag_spec_load("examples/specs/kvm-byte.json", &spec, err, sizeof err) ==
               KVMIX_SUCCESS) ||
        !CHECK(load_traces(data_path, &model.tokenizer, 0, TEXT_TOKENS, traces, N_TRACES)) ||
        !CHECK(load_traces(data_path, &model.tokenizer, LONG_TRACE, LONG_TOKENS, &long_trace, 1)) ||
        !CHECK(llama_runner_init(&runner, &model, 2, err, sizeof err) == LLAMA_OK)) {
        printf("%d passed, %d failed\n", n_passed, n_failed);
        return 1;
    }
    run r;
    memset(&r, 0, sizeof r);
    r.runner = &runner;
    test_recording(&runner, &model, &traces[0]);
    for (int32_t i = 0; i < N_TRACES; i++) test_intent(&r, &model, &spec.spec, &traces[i]);
    test_scorers(&r, &model, &spec.spec, &traces[1]);
    test_residual(&r, &model, &spec.spec, &traces[0]);
    test_rows(&r, &model, &spec.spec, &long_trace);
    for (int32_t i = 0; i < N_TRACES; i++) free(traces[i].ids);
    free(long_trace.ids);
    llama_runner_free(&runner);
    llama_model_free(&model);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
