/* Tests of the KV-cache policies and the kvmix-backed llama_kv_cache:
 *   - the policy parser on good and bad documents (every error names its field), the built-ins'
 *     round trip through JSON, examples/policies/kivi2-sink.json equal to the built-in;
 *   - resolution against a head_dim;
 *   - the kvmix-backed cache's attention against the decodes of the layer's view (bit for bit
 *     against the fast kvmix_view_decode of the whole view: it reads the cache itself, no copy;
 *     within 1e-5 relative of the reference kvmix_ref_view_decode), for every built-in and two
 *     custom policies, across request boundaries and a reset; after evictions, against softmax
 *     attention over the rows kvmix_cache_read returns for the positions left (within 1e-5
 *     relative);
 *   - every policy document (examples/policies, bench/triaxial/envelopes) and allocation
 *     (bench/triaxial) the repository ships reads and resolves;
 *   - the allocation reader (good and bad documents), and a cache that stores tokens by their
 *     tags (kvmix_kv_tag): on a trace's first 512 ids (its system prompt), instruction-only
 *     pages sealed at the instruction's INT2, no user token below INT8, no INT2 without the tags;
 *   - kvm-small on 2 texts of eval-dev: int8 within 1% of fp32 bits per token, kivi2 within 5%
 *     of fp32 and at least 0.1% away from it (the compressed path is the one used), and avg_bits
 *     equal, within 0.1%, to what the formats' block sizes predict for the text.
 * Run by the model test binary (test_llama.c calls test_policy_run). */
#include "test_policy.h"

#include "kvmix_kv.h"
#include "tag_allocation.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int passed, failed;

static bool check_at(bool ok, int line, const char *what) {
    if (ok)
        passed++;
    else {
        failed++;
        printf("FAIL test_policy.c line %d: %s\n", line, what);
    }
    return ok;
}
#define CHECK(cond) check_at((cond), __LINE__, #cond)

static uint32_t next_random(uint32_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 17;
    *state ^= *state << 5;
    return *state;
}

/* Uniform in [-1, 1). */
static float uniform(uint32_t *rng) { return (float)(next_random(rng) >> 8) / 8388608.0f - 1.0f; }

/* ------------------------------------------------------------------------------------------------
 * Parser
 */
static const char MINIMAL[] =
    "{\"version\": 1, \"key_format\": \"int4\", \"value_format\": \"int4\"}";

static void test_parse_good(void) {
    char err[256] = "";
    kvmix_policy p;
    for (int32_t i = 0; i < kvmix_kv_policy_count(); i++) {
        const kvmix_policy *builtin = kvmix_kv_policy_at(i);
        char *text = kvmix_kv_policy_json(builtin);
        if (!CHECK(text != NULL)) continue;
        bool ok = kvmix_kv_policy_parse(text, strlen(text), &p, err, sizeof err) == LLAMA_OK;
        if (!check_at(ok && kvmix_kv_policy_equal(&p, builtin), __LINE__, builtin->name))
            printf("  %s\n", err);
        CHECK(kvmix_kv_policy_builtin(builtin->name) == builtin);
        free(text);
    }
    CHECK(kvmix_kv_policy_builtin("kivi3") == NULL && kvmix_kv_policy_at(-1) == NULL);
    const char *names[] = {"fp32",  "fp16",       "int8",     "int4",
                           "kivi2", "kivi2-sink", "kitty-12", "kitty-25"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        check_at(kvmix_kv_policy_builtin(names[i]) != NULL, __LINE__, names[i]);

    /* An eviction with its recent floor as a share of the budget goes through JSON and back;
       absent, the share is 0 (recent_tokens alone). */
    kvmix_policy h2o = *kvmix_kv_policy_builtin("fp16");
    h2o.evict.scorer = KVMIX_EVICT_H2O, h2o.evict.budget_fraction = 0.25;
    h2o.evict.recent_tokens = 64, h2o.evict.recent_fraction = 0.5;
    char *h2o_text = kvmix_kv_policy_json(&h2o);
    if (CHECK(h2o_text != NULL && strstr(h2o_text, "\"recent_fraction\"") != NULL))
        CHECK(kvmix_kv_policy_parse(h2o_text, strlen(h2o_text), &p, err, sizeof err) == LLAMA_OK &&
              kvmix_kv_policy_equal(&p, &h2o));
    free(h2o_text);
    h2o.evict.recent_fraction = 0.0;
    h2o_text = kvmix_kv_policy_json(&h2o);
    if (CHECK(h2o_text != NULL && strstr(h2o_text, "recent_fraction") == NULL))
        CHECK(kvmix_kv_policy_parse(h2o_text, strlen(h2o_text), &p, err, sizeof err) == LLAMA_OK &&
              kvmix_kv_policy_equal(&p, &h2o));
    free(h2o_text);

    /* The documented example file is the built-in. */
    FILE *f = fopen("examples/policies/kivi2-sink.json", "rb");
    char doc[4096];
    size_t n = f != NULL ? fread(doc, 1, sizeof doc, f) : 0;
    if (f != NULL) fclose(f);
    if (CHECK(n > 0 && n < sizeof doc)) {
        CHECK(kvmix_kv_policy_parse(doc, n, &p, err, sizeof err) == LLAMA_OK);
        CHECK(kvmix_kv_policy_equal(&p, kvmix_kv_policy_builtin("kivi2-sink")));
    }

    /* Defaults of the optional fields; trailing whitespace and no NUL terminator are fine. */
    char padded[sizeof MINIMAL + 3];
    memcpy(padded, MINIMAL, sizeof MINIMAL - 1);
    memcpy(padded + sizeof MINIMAL - 1, " \n\t", 3);
    if (CHECK(kvmix_kv_policy_parse(padded, sizeof padded - 1, &p, err, sizeof err) == LLAMA_OK))
        CHECK(strcmp(p.name, "custom") == 0 && p.key_format == KVMIX_FORMAT_INT4 &&
              p.value_format == KVMIX_FORMAT_INT4 && p.group_size == 32 && p.page_tokens == 32 &&
              p.sink_tokens == 0 && p.window_tokens == 0 && p.n_boost == 0 &&
              p.partial_page == KVMIX_CACHE_PARTIAL_KEEP_FP16);
    const char full[] = "{\"version\": 1, \"name\": \"k\", \"description\": \"\", \"key_format\": "
                        "\"boosted\", \"value_format\": \"int8\", \"group_size\": 16, "
                        "\"n_boost\": 12, \"page_tokens\": 1024, \"sink_tokens\": 8, "
                        "\"window_tokens\": 0, \"partial_page\": \"quantize\"}";
    if (CHECK(kvmix_kv_policy_parse(full, strlen(full), &p, err, sizeof err) == LLAMA_OK))
        CHECK(p.key_format == KVMIX_FORMAT_BOOSTED && p.n_boost == 12 && p.group_size == 16 &&
              p.page_tokens == 1024 && p.sink_tokens == 8 &&
              p.partial_page == KVMIX_CACHE_PARTIAL_QUANTIZE);
}

typedef struct bad_case {
    const char *members; /* spliced after MINIMAL's opening brace, or a whole document */
    bool whole;
    llama_result want;
    const char *word; /* the message must mention it */
} bad_case;

static void test_parse_bad(void) {
    const bad_case cases[] = {
        {"not json", true, LLAMA_ERR_FORMAT, "malformed"},
        {"", true, LLAMA_ERR_FORMAT, "malformed"},
        {"[1, 2]", true, LLAMA_ERR_FORMAT, "object"},
        {"{\"version\": 1, \"key_format\": \"int4\", \"value_format\": \"int4\"} {}", true,
         LLAMA_ERR_FORMAT, "after"},
        {"{\"version\": 2, \"key_format\": \"int4\", \"value_format\": \"int4\"}", true,
         LLAMA_ERR_UNSUPPORTED, "\"version\""},
        {"{\"version\": \"1\", \"key_format\": \"int4\", \"value_format\": \"int4\"}", true,
         LLAMA_ERR_FORMAT, "\"version\""},
        {"{\"key_format\": \"int4\", \"value_format\": \"int4\"}", true, LLAMA_ERR_FORMAT,
         "\"version\""},
        {"{\"version\": 1, \"value_format\": \"int4\"}", true, LLAMA_ERR_FORMAT, "\"key_format\""},
        {"{\"version\": 1, \"key_format\": \"int4\"}", true, LLAMA_ERR_FORMAT, "\"value_format\""},
        {"\"colour\": 1,", false, LLAMA_ERR_FORMAT, "\"colour\""},
        {"\"version\": 1,", false, LLAMA_ERR_FORMAT, "twice"},
        {"\"page_tokens\": \"32\",", false, LLAMA_ERR_FORMAT, "\"page_tokens\""},
        {"\"page_tokens\": 12,", false, LLAMA_ERR_FORMAT, "\"page_tokens\""},
        {"\"evict\": {\"scorer\": \"h2o\", \"budget_fraction\": 0.5, \"recent_fraction\": 1.5},",
         false, LLAMA_ERR_FORMAT, "\"evict.recent_fraction\""},
        {"\"page_tokens\": 2048,", false, LLAMA_ERR_FORMAT, "\"page_tokens\""},
        {"\"page_tokens\": 32.5,", false, LLAMA_ERR_FORMAT, "\"page_tokens\""},
        {"\"page_tokens\": null,", false, LLAMA_ERR_FORMAT, "\"page_tokens\""},
        {"\"group_size\": 20,", false, LLAMA_ERR_FORMAT, "\"group_size\""},
        {"\"group_size\": 0,", false, LLAMA_ERR_FORMAT, "\"group_size\""},
        {"\"group_size\": \"head\",", false, LLAMA_ERR_FORMAT, "\"group_size\""},
        {"\"value_group_size\": 12,", false, LLAMA_ERR_FORMAT, "\"value_group_size\""},
        {"\"group_size\": 1e300,", false, LLAMA_ERR_FORMAT, "\"group_size\""},
        {"\"window_tokens\": -1,", false, LLAMA_ERR_FORMAT, "\"window_tokens\""},
        {"\"sink_tokens\": 64,", false, LLAMA_ERR_FORMAT, "\"sink_tokens\""},
        {"\"name\": \"\",", false, LLAMA_ERR_FORMAT, "\"name\""},
        {"\"name\": 5,", false, LLAMA_ERR_FORMAT, "\"name\""},
        {"\"description\": [\"x\"],", false, LLAMA_ERR_FORMAT, "\"description\""},
        {"\"partial_page\": \"drop\",", false, LLAMA_ERR_FORMAT, "\"partial_page\""},
        {"\"request_boundary\": \"keep\",", false, LLAMA_ERR_FORMAT, "\"request_boundary\""},
        {"\"boost_fraction\": 1.5,", false, LLAMA_ERR_FORMAT, "\"boost_fraction\""},
        {"{\"version\": 1, \"key_format\": \"int3\", \"value_format\": \"int4\"}", true,
         LLAMA_ERR_FORMAT, "\"key_format\""},
        {"{\"version\": 1, \"key_format\": \"fp32\", \"value_format\": \"int4\"}", true,
         LLAMA_ERR_FORMAT, "\"value_format\""},
        {"{\"version\": 1, \"key_format\": \"fp32\", \"value_format\": \"fp32\", "
         "\"window_tokens\": 8}",
         true, LLAMA_ERR_FORMAT, "\"window_tokens\""},
        {"{\"version\": 1, \"key_format\": \"boosted\", \"value_format\": \"int2\"}", true,
         LLAMA_ERR_FORMAT, "\"n_boost\""},
        {"{\"version\": 1, \"key_format\": \"boosted\", \"value_format\": \"int2\", "
         "\"n_boost\": 6}",
         true, LLAMA_ERR_FORMAT, "\"n_boost\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char doc[512], err[256] = "";
        if (cases[i].whole)
            snprintf(doc, sizeof doc, "%s", cases[i].members);
        else
            snprintf(doc, sizeof doc, "{%s%s", cases[i].members, MINIMAL + 1);
        kvmix_policy p, before;
        memset(&p, 0x5a, sizeof p);
        before = p;
        llama_result r = kvmix_kv_policy_parse(doc, strlen(doc), &p, err, sizeof err);
        char what[800];
        snprintf(what, sizeof what, "%s: want %s mentioning %s, got %s: %s", doc,
                 llama_result_string(cases[i].want), cases[i].word, llama_result_string(r), err);
        check_at(r == cases[i].want && strstr(err, cases[i].word) != NULL &&
                     memcmp(&p, &before, sizeof p) == 0,
                 __LINE__, what);
    }
}

static void test_resolve(void) {
    char err[256] = "";
    kvmix_policy p, q;
    CHECK(kvmix_kv_policy_resolve(kvmix_kv_policy_builtin("kitty-12"), 64, &p, err, sizeof err) ==
              LLAMA_OK &&
          p.n_boost == 8 && p.boost_fraction == 0.125);
    CHECK(kvmix_kv_policy_resolve(kvmix_kv_policy_builtin("kitty-12"), 128, &p, err, sizeof err) ==
              LLAMA_OK &&
          p.n_boost == 16);
    CHECK(kvmix_kv_policy_resolve(kvmix_kv_policy_builtin("kitty-25"), 64, &p, err, sizeof err) ==
              LLAMA_OK &&
          p.n_boost == 16 && p.boost_fraction == 0.25);
    CHECK(kvmix_kv_policy_resolve(kvmix_kv_policy_builtin("fp32"), 40, &p, err, sizeof err) ==
          LLAMA_OK);
    /* boost settings on INT4 formats: the channels of the BOOSTED keys a tag allocation asks for */
    const char tagged[] = "{\"version\": 1, \"key_format\": \"int4\", \"value_format\": "
                          "\"int4\", \"boost_fraction\": 0.25}";
    CHECK(kvmix_kv_policy_parse(tagged, strlen(tagged), &q, err, sizeof err) == LLAMA_OK &&
          kvmix_kv_policy_resolve(&q, 128, &p, err, sizeof err) == LLAMA_OK && p.n_boost == 32);
    CHECK(kvmix_kv_policy_resolve(kvmix_kv_policy_builtin("int8"), 40, &p, err, sizeof err) ==
              LLAMA_ERR_ARGUMENT &&
          strstr(err, "head_dim") != NULL);
    q = *kvmix_kv_policy_builtin("kitty-12");
    q.boost_fraction = 0.1;
    CHECK(kvmix_kv_policy_resolve(&q, 64, &p, err, sizeof err) == LLAMA_ERR_ARGUMENT &&
          strstr(err, "\"boost_fraction\"") != NULL);
    q.n_boost = 8; /* both given: they must agree */
    q.boost_fraction = 0.25;
    CHECK(kvmix_kv_policy_resolve(&q, 64, &p, err, sizeof err) == LLAMA_ERR_ARGUMENT &&
          strstr(err, "\"boost_fraction\"") != NULL);
    CHECK(kvmix_kv_policy_resolve(&q, 32, &p, err, sizeof err) == LLAMA_OK && p.n_boost == 8);
    /* a resolved policy resolves to itself, so it can be handed on (kvmix_kv_create does) */
    for (int32_t i = 0; i < kvmix_kv_policy_count(); i++) {
        kvmix_policy again;
        bool ok =
            kvmix_kv_policy_resolve(kvmix_kv_policy_at(i), 64, &p, err, sizeof err) == LLAMA_OK &&
            kvmix_kv_policy_resolve(&p, 64, &again, err, sizeof err) == LLAMA_OK &&
            kvmix_kv_policy_equal(&p, &again);
        check_at(ok, __LINE__, kvmix_kv_policy_at(i)->name);
    }
    q = *kvmix_kv_policy_builtin("int4");
    q.group_size = 128;
    CHECK(kvmix_kv_policy_resolve(&q, 64, &p, err, sizeof err) == LLAMA_ERR_ARGUMENT &&
          strstr(err, "\"group_size\"") != NULL);
}

/* ------------------------------------------------------------------------------------------------
 * The kvmix-backed cache against the kvmix reference decode
 */
enum { L = 2, NQ = 4, NKV = 2, D = 64, T = 150, G = NQ / NKV };

/* Attention of layer `layer` through attend() for every kv head, compared with the decodes of the
 * cache's view of that layer: attend() is the fast decode (kvmix_view_decode) on one kv head at a
 * time, so it matches that decode of the whole view exactly (*fast_diff, the largest |out -
 * fast|), and the reference within float rounding. Returns the worst |out - ref| / max |ref|. */
static double attend_vs_reference(llama_kv_cache *cache, int32_t layer, int32_t n_q, int32_t n_kv,
                                  int32_t head_dim, uint32_t *rng, double *fast_diff) {
    int32_t seq, group = n_q / n_kv, n_spans = 0, n_dead = 0, first[2];
    const kvmix_cache *c = kvmix_kv_inner(cache, &seq);
    size_t n = (size_t)n_q * (size_t)head_dim;
    float *q = malloc(n * sizeof(float)), *out = malloc(n * sizeof(float));
    float *ref = malloc(n * sizeof(float)), *lse = malloc((size_t)n_q * sizeof(float));
    float *fast = malloc(n * sizeof(float));
    double worst = INFINITY;
    *fast_diff = INFINITY;
    float scale = 1.0f / sqrtf((float)head_dim);
    if (c != NULL && q != NULL && out != NULL && ref != NULL && lse != NULL && fast != NULL &&
        kvmix_cache_view_counts(c, &seq, 1, &n_spans, &n_dead) == KVMIX_SUCCESS) {
        kvmix_view_span *spans = malloc(((size_t)n_spans + 1) * sizeof *spans);
        uint8_t *dead = malloc((size_t)n_dead + 1);
        kvmix_view view;
        void *ws = NULL;
        size_t ws_bytes = 0;
        for (size_t i = 0; i < n; i++) q[i] = 2.0f * uniform(rng);
        bool ok = spans != NULL && dead != NULL;
        for (int32_t kv = 0; ok && kv < n_kv; kv++) {
            size_t at = (size_t)kv * (size_t)group * (size_t)head_dim;
            ok = cache->attend(cache->state, layer, kv, q + at, group, scale, out + at) == LLAMA_OK;
        }
        ok =
            ok &&
            kvmix_cache_view(c, &seq, 1, layer, spans, n_spans, first, dead, n_dead, &view) ==
                KVMIX_SUCCESS &&
            kvmix_ref_view_decode(&view, n_q, scale, q, ref, lse) == KVMIX_SUCCESS &&
            kvmix_view_decode_workspace(&view, n_q, &ws_bytes) == KVMIX_SUCCESS &&
            (ws = malloc(ws_bytes)) != NULL &&
            kvmix_view_decode(&view, n_q, scale, q, fast, lse, ws, ws_bytes, NULL) == KVMIX_SUCCESS;
        if (ok) {
            double max_ref = 1e-30, max_diff = 0.0;
            *fast_diff = 0.0;
            for (size_t i = 0; i < n; i++) {
                if (fabs(ref[i]) > max_ref) max_ref = fabs(ref[i]);
                if (fabs((double)out[i] - ref[i]) > max_diff)
                    max_diff = fabs((double)out[i] - ref[i]);
                if (fabs((double)out[i] - fast[i]) > *fast_diff)
                    *fast_diff = fabs((double)out[i] - fast[i]);
            }
            worst = max_diff / max_ref;
        }
        free(ws);
        free(spans);
        free(dead);
    }
    free(q);
    free(out);
    free(ref);
    free(fast);
    free(lse);
    return worst;
}

/* Keys with a few large channels (as real keys have), values without. */
static void fill_token(float *k, float *v, uint32_t *rng) {
    for (int32_t i = 0; i < NKV * D; i++) {
        float boost = i % D == 3 || i % D == 17 ? 8.0f : 1.0f;
        k[i] = boost * (uniform(rng) + 0.5f * uniform(rng));
        v[i] = uniform(rng);
    }
}

static bool is_probe(int32_t pos) {
    static const int32_t probes[] = {0,  1,  7,  10, 11, 31, 32,  33,   39,
                                     40, 41, 63, 64, 96, 97, 130, T - 1};
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++)
        if (probes[i] == pos) return true;
    return false;
}

/* Softmax attention of one query row over the rows of `positions`, in double. */
static void attend_rows_double(const float *keys, const float *values, int32_t n, const float *q,
                               float scale, double *out) {
    double max_logit = -INFINITY, sum = 0.0, logits[T];
    for (int32_t t = 0; t < n; t++) {
        double dot = 0.0;
        for (int32_t c = 0; c < D; c++) dot += (double)q[c] * keys[(size_t)t * D + c];
        logits[t] = dot * scale;
        if (logits[t] > max_logit) max_logit = logits[t];
    }
    for (int32_t c = 0; c < D; c++) out[c] = 0.0;
    for (int32_t t = 0; t < n; t++) {
        double w = exp(logits[t] - max_logit);
        sum += w;
        for (int32_t c = 0; c < D; c++) out[c] += w * values[(size_t)t * D + c];
    }
    for (int32_t c = 0; c < D; c++) out[c] /= sum;
}

/* Evicts a sink, rows of sealed pages and a recent row of a text of n positions, then checks
 * attend() of every layer and kv head against attention over what kvmix_cache_read returns for
 * the positions left: evicted positions are gone, the others read as stored. */
static void check_evicted_attention(llama_kv_cache *cache, const char *name, int32_t n,
                                    uint32_t *rng) {
    const int32_t evict[] = {0, 3, 9, 10, 11, 17, 33, n - 2};
    char what[320];
    if (!CHECK(kvmix_kv_evict(cache, evict, (int32_t)(sizeof evict / sizeof evict[0])) == LLAMA_OK))
        return;
    const int32_t bad[] = {1, n};
    CHECK(kvmix_kv_evict(cache, bad, 2) == LLAMA_ERR_ARGUMENT); /* n is past the text */
    int32_t seq;
    const kvmix_cache *c = kvmix_kv_inner(cache, &seq);
    static float keys[L][NKV][T * D], values[L][NKV][T * D], row_k[NKV * D], row_v[NKV * D];
    int32_t n_live = 0;
    for (int32_t pos = 0; pos < n; pos++) {
        kvmix_result r = kvmix_cache_read(c, seq, 0, pos, NULL, NULL, NULL);
        if (r == KVMIX_ERR_NOT_FOUND) continue; /* evicted */
        for (int32_t layer = 0; layer < L; layer++) {
            if (!CHECK(kvmix_cache_read(c, seq, layer, pos, row_k, row_v, NULL) == KVMIX_SUCCESS))
                return;
            for (int32_t h = 0; h < NKV; h++) {
                memcpy(&keys[layer][h][(size_t)n_live * D], &row_k[h * D], D * sizeof(float));
                memcpy(&values[layer][h][(size_t)n_live * D], &row_v[h * D], D * sizeof(float));
            }
        }
        n_live++;
    }
    CHECK(n_live == n - 8);
    double worst = 0.0;
    float scale = 1.0f / sqrtf((float)D), q[G * D], out[G * D];
    for (int32_t layer = 0; layer < L; layer++)
        for (int32_t h = 0; h < NKV; h++) {
            for (int32_t i = 0; i < G * D; i++) q[i] = 2.0f * uniform(rng);
            if (!CHECK(cache->attend(cache->state, layer, h, q, G, scale, out) == LLAMA_OK)) return;
            for (int32_t g = 0; g < G; g++) {
                double want[D], max_want = 1e-30, max_diff = 0.0;
                attend_rows_double(keys[layer][h], values[layer][h], n_live, q + g * D, scale,
                                   want);
                for (int32_t i = 0; i < D; i++) {
                    if (fabs(want[i]) > max_want) max_want = fabs(want[i]);
                    if (fabs(out[g * D + i] - want[i]) > max_diff)
                        max_diff = fabs(out[g * D + i] - want[i]);
                }
                if (!(max_diff / max_want <= worst)) worst = max_diff / max_want;
            }
        }
    snprintf(what, sizeof what, "%s: attention after eviction vs the rows left: %.3g relative",
             name, worst);
    check_at(worst <= 1e-5, __LINE__, what);
}

static void run_against_reference(const kvmix_policy *policy) {
    llama_config config = {.n_layers = L, .n_heads = NQ, .n_kv_heads = NKV, .head_dim = D};
    llama_kv_cache cache;
    char err[256] = "", what[320];
    if (!check_at(kvmix_kv_create(policy, &config, T, &cache, err, sizeof err) == LLAMA_OK,
                  __LINE__, err))
        return;
    uint32_t rng = 12345;
    static float k[NKV * D], v[NKV * D];
    double worst = 0.0, fast_worst = 0.0, fast_diff;
    for (int32_t round = 0; round < 2; round++) {
        int32_t n = round == 0 ? T : 45; /* after the reset, a shorter text */
        for (int32_t pos = 0; pos < n; pos++) {
            if (pos == 40 || pos == 97) cache.begin_request(cache.state, pos);
            fill_token(k, v, &rng);
            for (int32_t layer = 0; layer < L; layer++) {
                if (pos == 10 && layer < 2) { /* a refused row leaves the position to retry */
                    float saved = k[5];
                    k[5] = NAN;
                    CHECK(cache.store(cache.state, layer, pos, k, v) == LLAMA_ERR_ARGUMENT);
                    k[5] = saved;
                }
                if (!CHECK(cache.store(cache.state, layer, pos, k, v) == LLAMA_OK)) goto done;
                if (is_probe(pos)) {
                    double e = attend_vs_reference(&cache, layer, NQ, NKV, D, &rng, &fast_diff);
                    if (!(e <= worst)) worst = e;
                    if (!(fast_diff <= fast_worst)) fast_worst = fast_diff;
                }
            }
        }
        llama_kv_stats stats;
        cache.stats(cache.state, &stats);
        CHECK(stats.n_tokens == n && stats.bytes > 0 && stats.avg_bits > 1.0);
        cache.begin_request(cache.state, n); /* a last request boundary seals what it can */
        double e = attend_vs_reference(&cache, L - 1, NQ, NKV, D, &rng, &fast_diff);
        if (!(e <= worst)) worst = e;
        if (!(fast_diff <= fast_worst)) fast_worst = fast_diff;
        if (round == 1) check_evicted_attention(&cache, policy->name, n, &rng);
        if (round == 0) {
            /* order and capacity errors */
            CHECK(cache.store(cache.state, 1, n, k, v) == LLAMA_ERR_ARGUMENT);
            CHECK(cache.store(cache.state, 0, n + 1, k, v) == LLAMA_ERR_ARGUMENT);
            CHECK(cache.store(cache.state, 0, n, k, v) == LLAMA_ERR_CAPACITY);
            CHECK(cache.attend(cache.state, L, 0, k, 1, 1.0f, v) == LLAMA_ERR_ARGUMENT);
            cache.reset(cache.state);
            cache.stats(cache.state, &stats);
            CHECK(stats.n_tokens == 0);
        }
    }
done:
    snprintf(what, sizeof what, "%s: attend vs the fast decode of the view: %.3g (want 0)",
             policy->name, fast_worst);
    check_at(fast_worst == 0.0, __LINE__, what);
    snprintf(what, sizeof what, "%s: attend vs reference decode %.3g relative (want <= 1e-5)",
             policy->name, worst);
    check_at(worst <= 1e-5, __LINE__, what);
    cache.destroy(cache.state);
}

/* A request boundary seals the window's full pages under FINISH (kvmix_cache_seq_finish) and
 * leaves them FP16 under CONTINUE, so that a continuing session keeps its recent tokens. */
static void test_request_boundary(void) {
    llama_config config = {.n_layers = L, .n_heads = NQ, .n_kv_heads = NKV, .head_dim = D};
    int32_t fp16_rows[2] = {-1, -1};
    for (int32_t way = 0; way < 2; way++) {
        kvmix_policy p = *kvmix_kv_policy_builtin("kivi2");
        p.request_boundary = way ? KVMIX_POLICY_BOUNDARY_CONTINUE : KVMIX_POLICY_BOUNDARY_FINISH;
        llama_kv_cache cache;
        char err[256] = "";
        if (!check_at(kvmix_kv_create(&p, &config, T, &cache, err, sizeof err) == LLAMA_OK,
                      __LINE__, err))
            return;
        uint32_t rng = 99;
        static float k[NKV * D], v[NKV * D];
        for (int32_t pos = 0; pos < 100; pos++) {
            fill_token(k, v, &rng);
            for (int32_t layer = 0; layer < L; layer++)
                CHECK(cache.store(cache.state, layer, pos, k, v) == LLAMA_OK);
        }
        cache.begin_request(cache.state, 100);
        int32_t seq;
        kvmix_cache_seq_stats st;
        if (CHECK(kvmix_cache_seq_stats_get(kvmix_kv_inner(&cache, &seq), seq, &st) ==
                  KVMIX_SUCCESS))
            fp16_rows[way] = st.n_fp16_rows;
        cache.destroy(cache.state);
    }
    /* 100 positions, pages of 32, a window of 128: FINISH seals the three full pages, CONTINUE
     * keeps all 100 in FP16 */
    CHECK(fp16_rows[0] == 4 && fp16_rows[1] == 100);
}

static void test_cache_matches_reference(void) {
    for (int32_t i = 0; i < kvmix_kv_policy_count(); i++)
        if (kvmix_kv_policy_at(i)->key_format != KVMIX_KV_FORMAT_FP32)
            run_against_reference(kvmix_kv_policy_at(i));
    /* small pages, sinks shorter than a page, partial pages quantized at request boundaries */
    kvmix_policy custom = {"custom-a",
                           "",
                           KVMIX_FORMAT_INT2_CHANNEL,
                           KVMIX_FORMAT_INT4,
                           16,
                           0,
                           0,
                           0.0,
                           8,
                           5,
                           20,
                           0,
                           KVMIX_CACHE_PARTIAL_QUANTIZE,
                           KVMIX_POLICY_BOUNDARY_FINISH,
                           NULL,
                           {0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0}};
    run_against_reference(&custom);
    kvmix_policy boosted = {"custom-b",
                            "",
                            KVMIX_FORMAT_BOOSTED,
                            KVMIX_FORMAT_INT8,
                            32,
                            0,
                            12,
                            0.0,
                            16,
                            0,
                            0,
                            1,
                            KVMIX_CACHE_PARTIAL_QUANTIZE,
                            KVMIX_POLICY_BOUNDARY_FINISH,
                            NULL,
                            {0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0}};
    run_against_reference(&boosted);
    /* keys and values in groups of their own: INT4 keys by 16 channels, INT2 values by head */
    kvmix_policy groups = {"custom-c",
                           "",
                           KVMIX_FORMAT_INT4,
                           KVMIX_FORMAT_INT2,
                           16,
                           KVMIX_GROUP_HEAD_DIM,
                           0,
                           0.0,
                           16,
                           4,
                           24,
                           1,
                           KVMIX_CACHE_PARTIAL_QUANTIZE,
                           KVMIX_POLICY_BOUNDARY_FINISH,
                           NULL,
                           {0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0}};
    run_against_reference(&groups);
}

/* ------------------------------------------------------------------------------------------------
 * kvm-small through compressed policies
 */
enum { QUALITY_TOKENS = 512 };

typedef struct texts2 {
    int32_t *ids[2]; /* the first trace and the first code text of eval-dev */
    int64_t n[2];
} texts2;

static bool load_texts(const char *data_path, const llama_tokenizer *tok, texts2 *s) {
    FILE *f = fopen(data_path, "rb");
    if (f == NULL) return false;
    static char line[1 << 20];
    memset(s, 0, sizeof *s);
    while (fgets(line, sizeof line, f) != NULL && (s->ids[0] == NULL || s->ids[1] == NULL)) {
        cJSON *obj = cJSON_ParseWithLengthOpts(line, strlen(line), NULL, 0);
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(obj, "kind");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(obj, "text");
        int32_t k = cJSON_IsString(kind) && strcmp(kind->valuestring, "code") == 0;
        if (cJSON_IsString(text) && s->ids[k] == NULL) {
            size_t len = strlen(text->valuestring);
            int32_t *ids = malloc((len + 1) * sizeof *ids);
            int64_t n = 0;
            if (ids != NULL) {
                ids[0] = llama_special_id(tok, "<|endoftext|>");
                llama_tokenize(tok, text->valuestring, len, ids + 1, &n);
                s->ids[k] = ids;
                s->n[k] = n + 1 < QUALITY_TOKENS ? n + 1 : QUALITY_TOKENS;
            }
        }
        cJSON_Delete(obj);
    }
    fclose(f);
    return s->ids[0] != NULL && s->ids[1] != NULL;
}

/* Bits per token over texts [first, first + count). */
static double texts_bits(llama_runner *runner, llama_kv_cache *cache, const texts2 *s,
                         int32_t first, int32_t count) {
    llama_score score = {0};
    char err[256] = "";
    for (int32_t i = first; i < first + count; i++)
        if (!check_at(llama_score_sequence(runner, cache, s->ids[i], s->n[i], NULL, NULL, NULL,
                                           &score, err, sizeof err) == LLAMA_OK,
                      __LINE__, err))
            return NAN;
    return score.n_scored > 0 ? score.bits / (double)score.n_scored : NAN;
}

static size_t page_bytes(const kvmix_cache *c, int32_t key_format, int32_t value_format,
                         int32_t rows, int32_t capacity) {
    size_t block[2];
    int32_t formats[2] = {key_format, value_format};
    for (int32_t i = 0; i < 2; i++) {
        kvmix_layout l = {(kvmix_format)formats[i], rows, c->desc.head_dim, 0, 0};
        if (formats[i] == KVMIX_FORMAT_INT8 || formats[i] == KVMIX_FORMAT_INT4 ||
            formats[i] == KVMIX_FORMAT_INT2)
            l.group_size = c->desc.group_size;
        if (formats[i] == KVMIX_FORMAT_BOOSTED) l.n_boost = c->desc.n_boost;
        if (formats[i] == KVMIX_FORMAT_FP16) l.n_tokens = capacity; /* buffers hold capacity */
        size_t bytes = 0;
        kvmix_layout_bytes(&l, &bytes);
        block[i] = (bytes + 15) / 16 * 16; /* blocks start 16-byte aligned */
    }
    size_t total = (size_t)c->desc.n_layers * (size_t)c->desc.n_kv_heads * (block[0] + block[1]);
    return (total + c->desc.granule_bytes - 1) / c->desc.granule_bytes * c->desc.granule_bytes;
}

/* After a request boundary every full page is sealed in the policy's formats; the sink page and
 * a partial last page stay FP16 buffers of their capacity; the sequence's slot map, page table and
 * record come on top. The bits per element this predicts from the formats' block sizes. */
static double expected_bits(const kvmix_cache *c, const kvmix_policy *p, int32_t n) {
    int32_t sink = p->sink_tokens < n ? p->sink_tokens : n, rest = n - sink;
    int32_t full = rest / p->page_tokens, partial = rest % p->page_tokens;
    double bytes = (double)c->desc.max_tokens_per_seq * 4.0 +
                   (double)c->desc.max_pages_per_seq * (double)sizeof(kvmix_cache_entry) +
                   (double)sizeof(kvmix_cache_seq);
    if (sink > 0) bytes += (double)page_bytes(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, sink, sink);
    bytes += (double)full *
             (double)page_bytes(c, p->key_format, p->value_format, p->page_tokens, p->page_tokens);
    if (partial > 0)
        bytes +=
            (double)page_bytes(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, partial, p->page_tokens);
    return bytes * 8.0 /
           ((double)n * c->desc.n_layers * c->desc.n_kv_heads * c->desc.head_dim * 2.0);
}

/* Runs one text (already scored into the cache) to a request boundary and checks avg_bits. */
static void check_avg_bits(llama_kv_cache *cache, const kvmix_policy *policy,
                           const llama_config *config) {
    char err[256] = "", what[320];
    kvmix_policy p;
    int32_t seq;
    const kvmix_cache *c = kvmix_kv_inner(cache, &seq);
    if (!CHECK(c != NULL) ||
        !CHECK(kvmix_kv_policy_resolve(policy, config->head_dim, &p, err, sizeof err) == LLAMA_OK))
        return;
    llama_kv_stats before, after;
    cache->stats(cache->state, &before);
    cache->begin_request(cache->state, before.n_tokens);
    cache->stats(cache->state, &after);
    double want = expected_bits(c, &p, (int32_t)after.n_tokens);
    snprintf(what, sizeof what, "%s: avg_bits %.5f over %lld tokens, formats predict %.5f +- 0.1%%",
             p.name, after.avg_bits, (long long)after.n_tokens, want);
    check_at(fabs(after.avg_bits - want) <= 1e-3 * want, __LINE__, what);
    CHECK(after.bytes <= before.bytes && after.avg_bits <= before.avg_bits);
    printf("  %-10s avg_bits %.4f (window and buffer: %.4f before the boundary), %lld tokens\n",
           p.name, after.avg_bits, before.avg_bits, (long long)after.n_tokens);
}

static void test_model_quality(const char *shared_dir) {
    char model_path[512], data_path[512], err[256] = "", what[320];
    snprintf(model_path, sizeof model_path, "%s/models/kvm-small.safetensors", shared_dir);
    snprintf(data_path, sizeof data_path, "%s/data/eval-dev.jsonl", shared_dir);
    llama_model model;
    if (!check_at(llama_model_load(model_path, &model, err, sizeof err) == LLAMA_OK, __LINE__, err))
        return;
    texts2 s;
    llama_runner runner;
    const llama_config *c = &model.config;
    int64_t capacity = c->context + 1;
    if (CHECK(load_texts(data_path, &model.tokenizer, &s)) &&
        CHECK(llama_runner_init(&runner, &model, 2, err, sizeof err) == LLAMA_OK)) {
        const char *names[] = {"fp32", "int8", "kivi2", "kivi2-sink", "kitty-12"};
        double bits[5] = {NAN, NAN, NAN, NAN, NAN};
        for (int32_t i = 0; i < 5; i++) {
            const kvmix_policy *p = kvmix_kv_policy_builtin(names[i]);
            kvmix_policy resolved; /* as kvmix-eval does: resolve, then create */
            llama_kv_cache cache;
            if (!check_at(kvmix_kv_policy_resolve(p, c->head_dim, &resolved, err, sizeof err) ==
                                  LLAMA_OK &&
                              kvmix_kv_create(&resolved, c, capacity, &cache, err, sizeof err) ==
                                  LLAMA_OK,
                          __LINE__, err))
                continue;
            /* fp32, int8, kivi2 over both texts; the others over the code text (avg_bits only) */
            bits[i] = i < 3 ? texts_bits(&runner, &cache, &s, 0, 2)
                            : texts_bits(&runner, &cache, &s, 1, 1);
            if (i > 0) {
                /* what attention read at the end equals the fast decode of the cache's view,
                 * and the reference decode within float rounding */
                uint32_t rng = 7;
                for (int32_t layer = 0; layer < c->n_layers; layer++) {
                    double fast_diff;
                    double e = attend_vs_reference(&cache, layer, c->n_heads, c->n_kv_heads,
                                                   c->head_dim, &rng, &fast_diff);
                    snprintf(what, sizeof what,
                             "%s layer %d: attend vs reference %.3g, vs the fast decode %.3g",
                             names[i], layer, e, fast_diff);
                    check_at(e <= 1e-5 && fast_diff == 0.0, __LINE__, what);
                }
                check_avg_bits(&cache, p, c);
            }
            cache.destroy(cache.state);
        }
        printf("  kvm-small, 2 texts of %d ids: fp32 %.5f, int8 %.5f, kivi2 %.5f bits/token\n",
               QUALITY_TOKENS, bits[0], bits[1], bits[2]);
        snprintf(what, sizeof what, "int8 %.5f bits/token, want within 1%% of fp32 %.5f", bits[1],
                 bits[0]);
        check_at(fabs(bits[1] - bits[0]) <= 0.01 * bits[0], __LINE__, what);
        /* On these 511-token texts the 128-token FP16 window covers much of what attention
         * reads, so kivi2 lands about 1.2% above fp32 (int8: 0.02% below). */
        snprintf(what, sizeof what,
                 "kivi2 %.5f bits/token, want within 5%% of fp32 %.5f and 0.1%% away from it",
                 bits[2], bits[0]);
        check_at(fabs(bits[2] - bits[0]) <= 0.05 * bits[0] &&
                     fabs(bits[2] - bits[0]) >= 0.001 * bits[0],
                 __LINE__, what);
        llama_runner_free(&runner);
    }
    free(s.ids[0]);
    free(s.ids[1]);
    llama_model_free(&model);
}

/* ------------------------------------------------------------------------------------------------
 * Storage by template tag
 */
static const char ALLOCATION[] =
    "{\"version\": 1, \"kind\": \"kvmix-allocation\", \"budget_bits\": 3, \"tags\": ["
    "{\"name\": \"current/instruction/text\", \"bucket\": \"current\", \"role\": \"instruction\","
    " \"modality\": \"text\", \"key_format\": \"int2_channel\", \"value_format\": \"int2\"},"
    "{\"bucket\": \"current\", \"role\": \"user\", \"modality\": \"text\","
    " \"key_format\": \"int8\", \"value_format\": \"int8\"}]}";

static void test_allocation_reader(void) {
    kvmix_tag_precision t;
    kvmix_cache_precision int4 = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4};
    char err[256];
    CHECK(tag_allocation_parse(ALLOCATION, strlen(ALLOCATION), int4, &t, err, sizeof err) ==
          KVMIX_SUCCESS);
    CHECK(t.formats[KVMIX_BUCKET_CURRENT][KVMIX_ROLE_INSTRUCTION][KVMIX_MODALITY_TEXT].key_format ==
          KVMIX_FORMAT_INT2_CHANNEL);
    CHECK(t.formats[KVMIX_BUCKET_CURRENT][KVMIX_ROLE_USER][KVMIX_MODALITY_TEXT].value_format ==
          KVMIX_FORMAT_INT8);
    CHECK(t.formats[KVMIX_BUCKET_OLDER][KVMIX_ROLE_USER][KVMIX_MODALITY_TEXT].key_format ==
          KVMIX_FORMAT_INT4); /* not listed: the fallback */
    static const char *const bad[] = {
        "{\"version\": 2, \"kind\": \"kvmix-allocation\", \"tags\": []}",
        "{\"version\": 1, \"kind\": \"kvmix-calibration-table\", \"tags\": []}",
        "{\"version\": 1, \"kind\": \"kvmix-allocation\", \"tags\": [{\"bucket\": \"now\", "
        "\"role\": \"user\", \"modality\": \"text\", \"key_format\": \"int8\", "
        "\"value_format\": \"int8\"}]}",
        "{\"version\": 1, \"kind\": \"kvmix-allocation\", \"tags\": [{\"bucket\": \"current\", "
        "\"role\": \"user\", \"modality\": \"text\", \"key_format\": \"int3\", "
        "\"value_format\": \"int8\"}]}",
        "{\"version\": 1, \"kind\": \"kvmix-allocation\", \"tags\": [",
    };
    const kvmix_result want[] = {KVMIX_ERR_VERSION, KVMIX_ERR_MALFORMED, KVMIX_ERR_MALFORMED,
                                 KVMIX_ERR_MALFORMED, KVMIX_ERR_MALFORMED};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvmix_tag_precision before = t;
        CHECK(tag_allocation_parse(bad[i], strlen(bad[i]), int4, &t, err, sizeof err) == want[i]);
        CHECK(memcmp(&before, &t, sizeof t) == 0);
    }
}

/* Counts, over a text's positions, those stored with INT2_CHANNEL keys and the user tokens stored
 * below INT8, with the cache tagged by the allocation or not. */
static void stored_formats(llama_runner *runner, const llama_model *m, const texts2 *s, bool tagged,
                           int64_t *n_int2, int64_t *n_user_low) {
    static tag_spec_doc doc;
    kvmix_tag_precision table;
    kvmix_cache_precision int4 = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4};
    llama_kv_cache cache;
    kvmix_tagger tagger;
    llama_score score = {0};
    char err[256];
    *n_int2 = *n_user_low = -1;
    if (!check_at(tag_spec_load("examples/specs/kvm-byte.json", &doc, err, sizeof err) ==
                          KVMIX_SUCCESS &&
                      tag_allocation_parse(ALLOCATION, strlen(ALLOCATION), int4, &table, err,
                                           sizeof err) == KVMIX_SUCCESS &&
                      kvmix_kv_create(kvmix_kv_policy_builtin("int4"), &m->config,
                                      m->config.context + 1, &cache, err, sizeof err) == LLAMA_OK,
                  __LINE__, err))
        return;
    if (tagged) CHECK(kvmix_kv_tag(&cache, &doc.spec, &table, NULL, err, sizeof err) == LLAMA_OK);
    CHECK(llama_score_sequence(runner, &cache, s->ids[0], s->n[0], NULL, NULL, NULL, &score, err,
                               sizeof err) == LLAMA_OK);
    CHECK(kvmix_tagger_init(&tagger, &doc.spec, NULL) == KVMIX_SUCCESS);
    int32_t seq;
    const kvmix_cache *kc = kvmix_kv_inner(&cache, &seq);
    *n_int2 = *n_user_low = 0;
    for (int64_t pos = 0; kc != NULL && pos + 1 < s->n[0]; pos++) {
        kvmix_tag tag;
        kvmix_cache_precision stored;
        kvmix_tagger_feed(&tagger, &s->ids[0][pos], 1, &tag);
        if (kvmix_cache_read(kc, seq, 0, (int32_t)pos, NULL, NULL, &stored) != KVMIX_SUCCESS)
            continue;
        *n_int2 += stored.key_format == KVMIX_FORMAT_INT2_CHANNEL;
        *n_user_low += tag.role == KVMIX_ROLE_USER && stored.key_format != KVMIX_FORMAT_INT8 &&
                       stored.key_format != KVMIX_FORMAT_FP16;
    }
    cache.destroy(cache.state);
}

static void test_tagged_storage(const char *shared_dir) {
    char model_path[512], data_path[512], err[256] = "";
    snprintf(model_path, sizeof model_path, "%s/models/kvm-small.safetensors", shared_dir);
    snprintf(data_path, sizeof data_path, "%s/data/eval-dev.jsonl", shared_dir);
    llama_model model;
    llama_runner runner;
    texts2 s = {{NULL, NULL}, {0, 0}};
    int64_t n_int2 = 0, n_user_low = 0, plain_int2 = 0, plain_user_low = 0;
    if (!check_at(llama_model_load(model_path, &model, err, sizeof err) == LLAMA_OK, __LINE__, err))
        return;
    if (CHECK(load_texts(data_path, &model.tokenizer, &s)) &&
        CHECK(llama_runner_init(&runner, &model, 2, err, sizeof err) == LLAMA_OK)) {
        stored_formats(&runner, &model, &s, true, &n_int2, &n_user_low);
        stored_formats(&runner, &model, &s, false, &plain_int2, &plain_user_low);
        printf("  by tag: %lld positions with INT2 keys, %lld user tokens below INT8 (untagged: "
               "%lld, %lld)\n",
               (long long)n_int2, (long long)n_user_low, (long long)plain_int2,
               (long long)plain_user_low);
        CHECK(n_int2 >= 32);    /* at least a page of the system prompt */
        CHECK(n_user_low == 0); /* user tokens (if sealed here) take their pages to INT8 */
        CHECK(plain_int2 == 0); /* without the tags, the policy's INT4 */
        llama_runner_free(&runner);
    }
    free(s.ids[0]);
    free(s.ids[1]);
    llama_model_free(&model);
}

/* Checks every file of dir whose name ends in suffix (and not in skip, when not NULL) with
 * check(path, err); returns how many it checked. */
static int check_files(const char *dir, const char *suffix, const char *skip,
                       bool (*check)(const char *path, char *err, size_t err_bytes)) {
    DIR *d = opendir(dir);
    int n = 0;
    if (!check_at(d != NULL, __LINE__, dir)) return 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name);
        if (len < strlen(suffix) || strcmp(e->d_name + len - strlen(suffix), suffix) != 0 ||
            (skip != NULL && len >= strlen(skip) &&
             strcmp(e->d_name + len - strlen(skip), skip) == 0))
            continue;
        char path[512], err[256] = "", what[800];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        bool ok = check(path, err, sizeof err);
        snprintf(what, sizeof what, "%s: %s", path, err);
        check_at(ok, __LINE__, what);
        n++;
    }
    closedir(d);
    return n;
}

/* A policy document that parses and resolves for both reference models' head_dim. */
static bool policy_file_ok(const char *path, char *err, size_t err_bytes) {
    size_t n = 0;
    kvmix_result why = KVMIX_SUCCESS;
    char *doc = tag_spec_read_file(path, &n, &why);
    kvmix_policy p, r;
    bool ok = doc != NULL && kvmix_kv_policy_parse(doc, n, &p, err, err_bytes) == LLAMA_OK &&
              kvmix_kv_policy_resolve(&p, 64, &r, err, err_bytes) == LLAMA_OK &&
              kvmix_kv_policy_resolve(&p, 128, &r, err, err_bytes) == LLAMA_OK;
    free(doc);
    return ok;
}

static bool allocation_file_ok(const char *path, char *err, size_t err_bytes) {
    kvmix_cache_precision fp16 = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16};
    kvmix_tag_precision table;
    return tag_allocation_load(path, fp16, &table, err, err_bytes) == KVMIX_SUCCESS;
}

/* The policy documents and allocations the repository ships (README and QUALITY.md name them in
 * their commands) all read. */
static void test_shipped_documents(void) {
    int policies = check_files("examples/policies", ".json", NULL, policy_file_ok) +
                   check_files("bench/triaxial/envelopes", ".json", NULL, policy_file_ok);
    int allocations = check_files("bench/triaxial", ".json", "-table.json", allocation_file_ok);
    CHECK(policies >= 16 && allocations >= 59);
}

void test_policy_run(const char *shared_dir, int *n_passed, int *n_failed) {
    passed = failed = 0;
    test_parse_good();
    test_parse_bad();
    test_resolve();
    test_cache_matches_reference();
    test_request_boundary();
    test_model_quality(shared_dir);
    test_allocation_reader();
    test_shipped_documents();
    test_tagged_storage(shared_dir);
    *n_passed += passed;
    *n_failed += failed;
}
