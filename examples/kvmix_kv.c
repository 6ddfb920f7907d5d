/* kvmix_kv.c - KV-cache policies (built-ins, JSON documents) and the kvmix-backed llama_kv_cache.
 * See kvmix_kv.h for the interface and README.md ("Policies") for the JSON schema. */
#include "kvmix_kv.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_number.h" /* after cJSON.h */

// >>policies

/* The runner's own fp32 cache, listed first among the built-ins; the others are kvmix.h's. */
static const kvmix_policy FP32_POLICY = {
    "fp32",
    "keys and values kept as fp32 in the runner's own cache (the reference)",
    KVMIX_KV_FORMAT_FP32,
    KVMIX_KV_FORMAT_FP32,
    32,
    0,
    0,
    0.0,
    32,
    0,
    0,
    0,
    KVMIX_CACHE_PARTIAL_KEEP_FP16,
    KVMIX_POLICY_BOUNDARY_FINISH,
    NULL,
    {0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0}};

int32_t kvmix_kv_policy_count(void) { return 1 + kvmix_policy_count(); }

const kvmix_policy *kvmix_kv_policy_at(int32_t index) {
    return index == 0 ? &FP32_POLICY : kvmix_policy_at(index - 1);
}

const kvmix_policy *kvmix_kv_policy_builtin(const char *name) {
    if (name != NULL && strcmp(name, FP32_POLICY.name) == 0) return &FP32_POLICY;
    return kvmix_policy_find(name);
}

static const char *format_name(int32_t format) {
    return format == KVMIX_KV_FORMAT_FP32 ? "fp32" : kvmix_format_name((kvmix_format)format);
}

static const char *partial_name(int32_t partial) {
    return partial == KVMIX_CACHE_PARTIAL_QUANTIZE ? "quantize" : "keep_fp16";
}

/* The fields of a policy document, in the order kvmix_kv_policy_json writes them. */
static const char *const FIELDS[] = {"version",
                                     "name",
                                     "description",
                                     "key_format",
                                     "value_format",
                                     "group_size",
                                     "value_group_size",
                                     "n_boost",
                                     "boost_fraction",
                                     "page_tokens",
                                     "sink_tokens",
                                     "window_tokens",
                                     "window_values_only",
                                     "partial_page",
                                     "request_boundary",
                                     "evict"};
enum { N_FIELDS = sizeof FIELDS / sizeof FIELDS[0] };

/* An integer field in [lo, hi]; false with a message otherwise. */
static bool take_int(const cJSON *item, const char *field, int64_t lo, int64_t hi, int32_t *out,
                     char *err, size_t err_bytes) {
    if (!cJSON_IsNumber(item)) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"%s\": must be a number",
                   field);
        return false;
    }
    double v = item->valuedouble;
    if (!(v >= (double)lo && v <= (double)hi) || v != floor(v)) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                   "policy field \"%s\": must be an integer in %lld .. %lld", field, (long long)lo,
                   (long long)hi);
        return false;
    }
    *out = (int32_t)v;
    return true;
}

/* A group size: "head_dim" (KVMIX_GROUP_HEAD_DIM) or an integer in [lo, 512]. */
static bool take_group(const cJSON *item, const char *field, int64_t lo, int32_t *out, char *err,
                       size_t err_bytes) {
    if (cJSON_IsString(item) && item->valuestring != NULL &&
        strcmp(item->valuestring, "head_dim") == 0) {
        *out = KVMIX_GROUP_HEAD_DIM;
        return true;
    }
    if (cJSON_IsNumber(item)) return take_int(item, field, lo, 512, out, err, err_bytes);
    llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
               "policy field \"%s\": must be an integer or \"head_dim\"", field);
    return false;
}

static bool take_text(const cJSON *item, const char *field, char *out, size_t out_bytes, char *err,
                      size_t err_bytes) {
    if (!cJSON_IsString(item) || item->valuestring == NULL) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"%s\": must be a string",
                   field);
        return false;
    }
    size_t len = strlen(item->valuestring);
    bool printable = len > 0 || out_bytes == KVMIX_POLICY_DESCRIPTION_BYTES;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)item->valuestring[i] < 0x20) printable = false;
    if (len >= out_bytes || !printable) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                   "policy field \"%s\": must be %sat most %zu bytes without control characters",
                   field, out_bytes == KVMIX_POLICY_NAME_BYTES ? "non-empty, " : "", out_bytes - 1);
        return false;
    }
    memcpy(out, item->valuestring, len + 1);
    return true;
}

static bool take_format(const cJSON *item, const char *field, int32_t *out, char *err,
                        size_t err_bytes) {
    if (cJSON_IsString(item) && item->valuestring != NULL)
        for (int32_t f = KVMIX_KV_FORMAT_FP32; f <= KVMIX_FORMAT_BOOSTED; f++)
            if (strcmp(item->valuestring, format_name(f)) == 0) {
                *out = f;
                return true;
            }
    llama_fail(
        err, err_bytes, LLAMA_ERR_FORMAT,
        "policy field \"%s\": must be one of \"fp32\", \"fp16\", \"int8\", \"int4\", \"int2\", "
        "\"int2_channel\", \"boosted\"",
        field);
    return false;
}

/* Checks the rules of a policy whatever the model: kvmix_policy_check's, and for the fp32
 * reference, formats fp32 for both and no sinks, window or boost. */
static llama_result policy_check(const kvmix_policy *p, char *err, size_t err_bytes) {
    bool fp32_key = p->key_format == KVMIX_KV_FORMAT_FP32;
    bool fp32_value = p->value_format == KVMIX_KV_FORMAT_FP32;
    if (fp32_key != fp32_value)
        return llama_fail(
            err, err_bytes, LLAMA_ERR_FORMAT,
            "policy field \"%s\": \"fp32\" is the reference cache, for both keys and values",
            fp32_key ? "value_format" : "key_format");
    if (fp32_key && (p->sink_tokens != 0 || p->window_tokens != 0 || p->window_values_only ||
                     p->n_boost != 0 || p->boost_fraction != 0.0))
        return llama_fail(
            err, err_bytes, LLAMA_ERR_FORMAT,
            "policy field \"%s\": the fp32 reference cache takes no sinks, window or boost",
            p->sink_tokens != 0     ? "sink_tokens"
            : p->window_tokens != 0 ? "window_tokens"
            : p->window_values_only ? "window_values_only"
            : p->n_boost != 0       ? "n_boost"
                                    : "boost_fraction");
    kvmix_policy stored = *p; /* fp32's other fields obey the rules of a stored policy */
    if (fp32_key) stored.key_format = stored.value_format = KVMIX_FORMAT_FP16;
    kvmix_error why;
    if (kvmix_policy_check(&stored, &why) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"%s\": %s", why.field,
                          why.reason);
    return LLAMA_OK;
}

static bool only_space(const char *p, const char *end) {
    for (; p < end; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') return false;
    return true;
}

/* The members of an "evict" object, in the order kvmix_kv_policy_json writes them. */
static const char *const EVICT_FIELDS[] = {"scorer",         "budget_tokens", "budget_fraction",
                                           "decay",          "prefix_tokens", "recent_tokens",
                                           "observe_tokens", "pool_tokens",   "recent_fraction"};
enum { N_EVICT_FIELDS = sizeof EVICT_FIELDS / sizeof EVICT_FIELDS[0] };

/* A number field of "evict" in [lo, hi] (hi_open: below hi). */
static bool take_share(const cJSON *item, const char *field, double lo, double hi, bool lo_open,
                       bool hi_open, double *out, char *err, size_t err_bytes) {
    double v = cJSON_IsNumber(item) ? item->valuedouble : NAN;
    if (!(v >= lo && v <= hi) || (lo_open && v == lo) || (hi_open && v == hi)) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                   "policy field \"evict.%s\": must be in %s%g, %g%s", field, lo_open ? "(" : "[",
                   lo, hi, hi_open ? ")" : "]");
        return false;
    }
    *out = v == 0.0 ? 0.0 : v; /* -0 as 0: the writer leaves out a zero recent_fraction */
    return true;
}

static bool take_scorer(const cJSON *item, int32_t *out, char *err, size_t err_bytes) {
    for (int32_t s = KVMIX_EVICT_INTENT; s <= KVMIX_EVICT_SNAPKV; s++)
        if (cJSON_IsString(item) && item->valuestring != NULL &&
            strcmp(item->valuestring, kvmix_evict_scorer_name(s)) == 0) {
            *out = s;
            return true;
        }
    llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
               "policy field \"evict.scorer\": must be one of \"intent\", \"query\", "
               "\"streaming\", \"h2o\", \"snapkv\"");
    return false;
}

/* "evict": budgeted eviction (kvmix_evict_policy); its checks across fields come with the
 * policy's (kvmix_policy_check). */
static bool take_evict(const cJSON *obj, kvmix_evict_policy *ev, char *err, size_t err_bytes) {
    bool seen[N_EVICT_FIELDS] = {false};
    if (!cJSON_IsObject(obj)) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"evict\": must be an object");
        return false;
    }
    for (const cJSON *item = obj->child; item != NULL; item = item->next) {
        int32_t f = 0;
        while (f < N_EVICT_FIELDS &&
               (item->string == NULL || strcmp(item->string, EVICT_FIELDS[f]) != 0))
            f++;
        if (f == N_EVICT_FIELDS || seen[f]) {
            llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"evict.%.64s\": %s",
                       item->string != NULL ? item->string : "",
                       f == N_EVICT_FIELDS ? "unknown" : "given twice");
            return false;
        }
        seen[f] = true;
        int32_t *counts[] = {NULL,
                             &ev->budget_tokens,
                             NULL,
                             NULL,
                             &ev->prefix_tokens,
                             &ev->recent_tokens,
                             &ev->observe_tokens,
                             &ev->pool_tokens,
                             NULL};
        bool ok = f == 0   ? take_scorer(item, &ev->scorer, err, err_bytes)
                  : f == 2 ? take_share(item, EVICT_FIELDS[f], 0.0, 1.0, true, false,
                                        &ev->budget_fraction, err, err_bytes)
                  : f == 3 ? take_share(item, EVICT_FIELDS[f], 0.0, 1.0, false, true, &ev->decay,
                                        err, err_bytes)
                  : f == 8 ? take_share(item, EVICT_FIELDS[f], 0.0, 1.0, false, false,
                                        &ev->recent_fraction, err, err_bytes)
                           : take_int(item, EVICT_FIELDS[f], 0, 1 << 26, counts[f], err, err_bytes);
        if (!ok) return false;
    }
    if (!seen[0]) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"evict.scorer\": required");
        return false;
    }
    return true;
}

/* Reads every member of the document into p; false with a message on the first bad one. */
static bool take_fields(const cJSON *root, kvmix_policy *p, bool *seen, char *err,
                        size_t err_bytes) {
    for (const cJSON *item = root->child; item != NULL; item = item->next) {
        int32_t f = 0, version = 0;
        while (f < N_FIELDS && (item->string == NULL || strcmp(item->string, FIELDS[f]) != 0)) f++;
        if (f == N_FIELDS) {
            llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"%.64s\": unknown",
                       item->string != NULL ? item->string : "");
            return false;
        }
        if (seen[f]) {
            llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"%s\": given twice",
                       FIELDS[f]);
            return false;
        }
        seen[f] = true;
        bool ok = true;
        switch (f) {
        case 0:
            ok = take_int(item, "version", 0, 1 << 30, &version, err, err_bytes);
            if (ok && version != KVMIX_KV_POLICY_VERSION) {
                llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                           "policy field \"version\": %d is not supported (this reader knows %d)",
                           version, KVMIX_KV_POLICY_VERSION);
                seen[N_FIELDS] = true; /* marks a version error */
                ok = false;
            }
            break;
        case 1: ok = take_text(item, "name", p->name, sizeof p->name, err, err_bytes); break;
        case 2:
            ok = take_text(item, "description", p->description, sizeof p->description, err,
                           err_bytes);
            break;
        case 3: ok = take_format(item, "key_format", &p->key_format, err, err_bytes); break;
        case 4: ok = take_format(item, "value_format", &p->value_format, err, err_bytes); break;
        case 5: ok = take_group(item, "group_size", 8, &p->group_size, err, err_bytes); break;
        case 6:
            ok = take_group(item, "value_group_size", 0, &p->value_group_size, err, err_bytes);
            break;
        case 7: ok = take_int(item, "n_boost", 0, 252, &p->n_boost, err, err_bytes); break;
        case 8:
            ok = cJSON_IsNumber(item) && item->valuedouble >= 0.0 && item->valuedouble <= 1.0;
            if (ok)
                p->boost_fraction = item->valuedouble;
            else
                llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                           "policy field \"boost_fraction\": must be a number in 0 .. 1");
            break;
        case 9: ok = take_int(item, "page_tokens", 8, 1024, &p->page_tokens, err, err_bytes); break;
        case 10:
            ok = take_int(item, "sink_tokens", 0, 1024, &p->sink_tokens, err, err_bytes);
            break;
        case 11:
            ok = take_int(item, "window_tokens", 0, 1 << 26, &p->window_tokens, err, err_bytes);
            break;
        case 12:
            ok = cJSON_IsBool(item);
            if (ok)
                p->window_values_only = cJSON_IsTrue(item);
            else
                llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                           "policy field \"window_values_only\": must be true or false");
            break;
        case 13:
            ok = cJSON_IsString(item) && item->valuestring != NULL &&
                 (strcmp(item->valuestring, "keep_fp16") == 0 ||
                  strcmp(item->valuestring, "quantize") == 0);
            if (ok)
                p->partial_page = strcmp(item->valuestring, "quantize") == 0
                                      ? KVMIX_CACHE_PARTIAL_QUANTIZE
                                      : KVMIX_CACHE_PARTIAL_KEEP_FP16;
            else
                llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                           "policy field \"partial_page\": must be \"keep_fp16\" or \"quantize\"");
            break;
        case 14:
            ok = cJSON_IsString(item) && item->valuestring != NULL &&
                 (strcmp(item->valuestring, "finish") == 0 ||
                  strcmp(item->valuestring, "continue") == 0);
            if (ok)
                p->request_boundary = strcmp(item->valuestring, "continue") == 0
                                          ? KVMIX_POLICY_BOUNDARY_CONTINUE
                                          : KVMIX_POLICY_BOUNDARY_FINISH;
            else
                llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                           "policy field \"request_boundary\": must be \"finish\" or \"continue\"");
            break;
        default: ok = take_evict(item, &p->evict, err, err_bytes); break;
        }
        if (!ok) return false;
    }
    return true;
}

llama_result kvmix_kv_policy_parse(const char *json, size_t json_bytes, kvmix_policy *out,
                                   char *err, size_t err_bytes) {
    if (json == NULL || out == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "policy: NULL argument");
    const char *end = json;
    cJSON *root = cJSON_ParseWithLengthOpts(json, json_bytes, &end, 0);
    if (root == NULL) {
        size_t at = end >= json && end <= json + json_bytes ? (size_t)(end - json) : 0;
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy: malformed JSON near byte %zu",
                          at);
    }
    llama_result r = LLAMA_OK;
    kvmix_policy p = {"custom",
                      "",
                      -1,
                      -1,
                      32,
                      0,
                      0,
                      0.0,
                      32,
                      0,
                      0,
                      0,
                      KVMIX_CACHE_PARTIAL_KEEP_FP16,
                      0,
                      NULL,
                      {0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0}};
    bool seen[N_FIELDS + 1] = {false};
    if (end < json || end > json + json_bytes || !only_space(end, json + json_bytes))
        r = llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy: bytes after the JSON object");
    else if (!cJSON_IsObject(root))
        r = llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                       "policy: the document must be a JSON object");
    else if (!take_fields(root, &p, seen, err, err_bytes))
        r = seen[N_FIELDS] ? LLAMA_ERR_UNSUPPORTED : LLAMA_ERR_FORMAT;
    else if (!seen[0] || !seen[3] || !seen[4])
        r = llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"%s\": required",
                       !seen[0]   ? "version"
                       : !seen[3] ? "key_format"
                                  : "value_format");
    else
        r = policy_check(&p, err, err_bytes);
    cJSON_Delete(root);
    if (r == LLAMA_OK) *out = p;
    return r;
}

llama_result kvmix_kv_policy_resolve(const kvmix_policy *policy, int32_t head_dim,
                                     kvmix_policy *out, char *err, size_t err_bytes) {
    if (policy == NULL || out == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "policy: NULL argument");
    if (policy_check(policy, err, err_bytes) != LLAMA_OK) return LLAMA_ERR_ARGUMENT;
    if (policy->key_format == KVMIX_KV_FORMAT_FP32) {
        *out = *policy;
        return LLAMA_OK;
    }
    kvmix_error why;
    if (kvmix_policy_resolve(policy, head_dim, out, &why) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "policy %s, field \"%s\": %s (the model's head_dim is %d)", policy->name,
                          why.field, why.reason, head_dim);
    return LLAMA_OK;
}

static void add_group(cJSON *obj, const char *field, int32_t group) {
    if (group == KVMIX_GROUP_HEAD_DIM)
        cJSON_AddStringToObject(obj, field, "head_dim");
    else
        cJSON_AddNumberToObject(obj, field, group);
}

char *kvmix_kv_policy_json(const kvmix_policy *p) {
    cJSON *obj = cJSON_CreateObject();
    if (obj == NULL || p == NULL) {
        cJSON_Delete(obj);
        return NULL;
    }
    cJSON_AddNumberToObject(obj, "version", KVMIX_KV_POLICY_VERSION);
    cJSON_AddStringToObject(obj, "name", p->name);
    cJSON_AddStringToObject(obj, "description", p->description);
    cJSON_AddStringToObject(obj, "key_format", format_name(p->key_format));
    cJSON_AddStringToObject(obj, "value_format", format_name(p->value_format));
    add_group(obj, "group_size", p->group_size);
    add_group(obj, "value_group_size", p->value_group_size);
    cJSON_AddNumberToObject(obj, "n_boost", p->n_boost);
    json_add_exact_number(obj, "boost_fraction", p->boost_fraction);
    cJSON_AddNumberToObject(obj, "page_tokens", p->page_tokens);
    cJSON_AddNumberToObject(obj, "sink_tokens", p->sink_tokens);
    cJSON_AddNumberToObject(obj, "window_tokens", p->window_tokens);
    cJSON_AddBoolToObject(obj, "window_values_only", p->window_values_only != 0);
    cJSON_AddStringToObject(obj, "partial_page", partial_name(p->partial_page));
    cJSON_AddStringToObject(obj, "request_boundary",
                            p->request_boundary == KVMIX_POLICY_BOUNDARY_CONTINUE ? "continue"
                                                                                  : "finish");
    if (p->evict.scorer != 0) {
        const kvmix_evict_policy *ev = &p->evict;
        cJSON *e = cJSON_AddObjectToObject(obj, "evict");
        double values[] = {0.0,
                           ev->budget_tokens,
                           ev->budget_fraction,
                           ev->decay,
                           ev->prefix_tokens,
                           ev->recent_tokens,
                           ev->observe_tokens,
                           ev->pool_tokens,
                           ev->recent_fraction};
        cJSON_AddStringToObject(e, "scorer", kvmix_evict_scorer_name(ev->scorer));
        for (int32_t f = 1; f < N_EVICT_FIELDS; f++) {
            /* budget_fraction 0 is no fraction (budget_tokens rules); the reader takes (0, 1] */
            if (f == 2 && ev->budget_fraction == 0.0) continue;
            if (f == 8 && ev->recent_fraction == 0.0) continue; /* absent: recent_tokens alone */
            json_add_exact_number(e, EVICT_FIELDS[f], values[f]);
        }
    }
    char *text = cJSON_PrintUnformatted(obj);
    cJSON_Delete(obj);
    return text;
}

bool kvmix_kv_policy_equal(const kvmix_policy *a, const kvmix_policy *b) {
    return strcmp(a->name, b->name) == 0 && strcmp(a->description, b->description) == 0 &&
           a->key_format == b->key_format && a->value_format == b->value_format &&
           a->group_size == b->group_size && a->value_group_size == b->value_group_size &&
           a->n_boost == b->n_boost && a->boost_fraction == b->boost_fraction &&
           a->page_tokens == b->page_tokens && a->sink_tokens == b->sink_tokens &&
           a->window_tokens == b->window_tokens && a->window_values_only == b->window_values_only &&
           a->partial_page == b->partial_page && a->request_boundary == b->request_boundary &&
           a->tag_precision == b->tag_precision &&
           memcmp(&a->evict, &b->evict, sizeof a->evict) == 0;
}

// >>kvcache

/* One kv head's view arrays: attend() calls for different kv heads run concurrently, so each
 * builds its view in arrays of its own. */
typedef struct head_view {
    kvmix_view_span *spans; /* [max_spans] */
    int32_t first[2];       /* seq_first_span of a one-sequence view */
    uint8_t *dead;          /* [max_dead] */
    float *lse;             /* [n_heads]: the decode's log-sum-exp, unused here */
    void *decode_ws;        /* kvmix_view_decode's workspace, grown to what a view asks */
    size_t decode_ws_bytes; /* its size */
    float *scores;          /* [max_dead]: a recorded step's attention by view token */
    int32_t *positions;     /* [max_dead]: each view token's position (-1: none) */
} head_view;

typedef struct kv_kvmix {
    kvmix_cache cache;
    int32_t seq;
    int32_t request_boundary; /* the policy's kvmix_policy_boundary */
    int32_t n_layers, n_heads, n_kv_heads;
    int64_t capacity;
    int32_t max_spans, max_dead;
    head_view *heads; /* [n_kv_heads] */
    /* by tag (kvmix_kv_tag): the policy with the table, the stream's tagger, the formats the
     * token announced at next_pos asks for */
    bool tagged;
    kvmix_policy policy;
    kvmix_tag_precision table;
    kvmix_tagger tagger;
    kvmix_cache_precision next;
    uint32_t next_run; /* its run (kvmix_policy_token_run): tokens that age alike share pages */
    int64_t next_pos;
    kvmix_tag *tags; /* [capacity]: each position's tag */
    int32_t turn;    /* the turn the cache was aged to (kvmix_policy_retier_turn) */
    bool priced;     /* prices holds the allocation's (kvmix_kv_tag) */
    tag_prices prices;
    /* recording for eviction (kvmix_kv_observe), allocated on first use */
    int32_t observe;   /* KVMIX_KV_OBSERVE_* flags of the steps from now on */
    int32_t n_queries; /* steps whose queries query_sum holds */
    float *query_sum;  /* [n_layers][n_heads][head_dim] */
    float *mass;       /* [n_kv_heads][capacity]: attention by position, a row per kv head, as
                          attend() runs the kv heads on threads of their own */
} kv_kvmix;

/* Positions of `layer` that have rows. */
static int64_t written_on(const kv_kvmix *kv, int32_t layer) {
    return kv->cache.written[(size_t)kv->seq * (size_t)kv->n_layers + (size_t)layer];
}

static llama_result kv_kvmix_store(void *state, int32_t layer, int64_t pos, const float *k,
                                   const float *v) {
    kv_kvmix *kv = state;
    if (layer < 0 || layer >= kv->n_layers || pos != written_on(kv, layer) ||
        (layer > 0 && pos >= written_on(kv, layer - 1)))
        return LLAMA_ERR_ARGUMENT;
    if (pos >= kv->capacity) return LLAMA_ERR_CAPACITY;
    /* Layer 0 reserves the position, unless an earlier store that failed after reserving it did.
     * The cache stores it as the policy says (kvmix_policy_apply made it the default). */
    if (layer == 0 && kv->cache.seqs[kv->seq].n_tokens == pos) {
        const kvmix_cache_precision *by_tag = kv->tagged && kv->next_pos == pos ? &kv->next : NULL;
        kvmix_result r =
            by_tag ? kvmix_cache_seq_set_run(&kv->cache, kv->seq, kv->next_run) : KVMIX_SUCCESS;
        if (r == KVMIX_SUCCESS) r = kvmix_cache_reserve(&kv->cache, kv->seq, 1, by_tag, NULL);
        if (r == KVMIX_ERR_OUT_OF_MEMORY) return LLAMA_ERR_CAPACITY;
        if (r != KVMIX_SUCCESS) return LLAMA_ERR_ARGUMENT;
    }
    if (kvmix_cache_write(&kv->cache, kv->seq, layer, (int32_t)pos, 1, k, v) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    if (layer == 0 && (kv->observe & KVMIX_KV_OBSERVE_QUERIES)) kv->n_queries++;
    return LLAMA_OK;
}

/* Narrows a view of every kv head, built in `spans`, to kv head h: its blocks start h head
 * strides further. */
static void view_select_head(kvmix_view *view, kvmix_view_span *spans, int32_t h) {
    for (int32_t i = 0; i < view->n_spans; i++) {
        spans[i].key_offset += (uint64_t)h * spans[i].key_head_bytes;
        spans[i].value_offset += (uint64_t)h * spans[i].value_head_bytes;
    }
    view->n_kv_heads = 1;
}

/* What a step records for eviction (kvmix_kv_observe) on kv head h's view of the layer: its q
 * heads' queries added to the layer's sums; the attention each gives the view's tokens (a softmax
 * over the live ones, read from the keys as stored: kvmix_ref_view_intent_score, as the GPU loop
 * reads it) added to the head's row by position. */
static llama_result record_attend(kv_kvmix *kv, head_view *hv, const kvmix_view *view,
                                  int32_t layer, int32_t h, const float *q, int32_t n_q) {
    int32_t dim = kv->cache.desc.head_dim, n = 0;
    if (kv->observe & KVMIX_KV_OBSERVE_QUERIES) {
        float *sum = kv->query_sum + ((size_t)layer * kv->n_heads + (size_t)h * n_q) * dim;
        for (int32_t i = 0; i < n_q * dim; i++) sum[i] += q[i];
    }
    if (!(kv->observe & KVMIX_KV_OBSERVE_ATTENTION)) return LLAMA_OK;
    if (kvmix_ref_view_intent_score(view, 0, n_q, 0.0f, q, hv->scores, kv->max_dead) !=
            KVMIX_SUCCESS ||
        kvmix_cache_view_positions(&kv->cache, kv->seq, layer, hv->positions, kv->max_dead, &n) !=
            KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    float *mass = kv->mass + (size_t)h * (size_t)kv->capacity;
    for (int32_t k = 0; k < n; k++)
        if (hv->positions[k] >= 0 && isfinite(hv->scores[k]))
            mass[hv->positions[k]] += hv->scores[k];
    return LLAMA_OK;
}

/* Grows kv head hv's decode workspace to what kvmix_view_decode asks for `view` (malloc's
 * alignment covers the 8 bytes it needs): LLAMA_ERR_ARGUMENT on a bad view, LLAMA_ERR_MEMORY. */
static llama_result decode_workspace(head_view *hv, const kvmix_view *view, int32_t n_q) {
    size_t need;
    if (kvmix_view_decode_workspace(view, n_q, &need) != KVMIX_SUCCESS) return LLAMA_ERR_ARGUMENT;
    if (need <= hv->decode_ws_bytes) return LLAMA_OK;
    void *grown = realloc(hv->decode_ws, need);
    if (grown == NULL) return LLAMA_ERR_MEMORY;
    hv->decode_ws = grown;
    hv->decode_ws_bytes = need;
    return LLAMA_OK;
}

/* Attention over exactly what the cache holds for the layer: its view (every page in its own
 * formats, evicted rows flagged dead), decoded by kvmix's fast CPU decode on this thread (the
 * runner already runs the kv heads on threads of their own). */
static llama_result kv_kvmix_attend(void *state, int32_t layer, int32_t kv_head, const float *q,
                                    int32_t n_q, float scale, float *out) {
    kv_kvmix *kv = state;
    if (layer < 0 || layer >= kv->n_layers || kv_head < 0 || kv_head >= kv->n_kv_heads || n_q < 1 ||
        n_q > kv->n_heads || written_on(kv, layer) == 0)
        return LLAMA_ERR_ARGUMENT;
    head_view *hv = &kv->heads[kv_head];
    kvmix_view view;
    if (kvmix_cache_view(&kv->cache, &kv->seq, 1, layer, hv->spans, kv->max_spans, hv->first,
                         hv->dead, kv->max_dead, &view) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    view_select_head(&view, hv->spans, kv_head);
    llama_result r = decode_workspace(hv, &view, n_q);
    if (r != LLAMA_OK) return r;
    if (kvmix_view_decode(&view, n_q, scale, q, out, hv->lse, hv->decode_ws, hv->decode_ws_bytes,
                          NULL) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    return kv->observe ? record_attend(kv, hv, &view, layer, kv_head, q, n_q) : LLAMA_OK;
}

/* A request boundary, as the policy says: with FINISH, kvmix_cache_seq_finish seals the full
 * pages and applies the partial-page policy (a failure, which the arena's size rules out, leaves
 * the cache as it was, a valid state to go on from); with CONTINUE the session keeps its window. */
static void kv_kvmix_begin_request(void *state, int64_t pos) {
    kv_kvmix *kv = state;
    (void)pos;
    if (kv->request_boundary == KVMIX_POLICY_BOUNDARY_FINISH)
        kvmix_cache_seq_finish(&kv->cache, kv->seq);
}

/* Tags the token about to run and keeps the formats its tag gets (a new token is always of the
 * current turn). A token that opens a new user turn first ages the cache to it: pages whose
 * positions now ask for less are re-tiered down (in their own bytes: it cannot fail). */
static void kv_kvmix_on_token(void *state, int64_t pos, int32_t id) {
    kv_kvmix *kv = state;
    kvmix_tag tag;
    kv->next_pos = -1;
    if (pos < 0 || pos >= kv->capacity ||
        kvmix_tagger_feed(&kv->tagger, &id, 1, &tag) != KVMIX_SUCCESS ||
        kvmix_policy_token_precision(&kv->policy, tag, tag.turn, &kv->next) != KVMIX_SUCCESS ||
        kvmix_policy_token_run(&kv->policy, tag, &kv->next_run) != KVMIX_SUCCESS)
        return;
    kv->next_pos = pos;
    kv->tags[pos] = tag;
    if (tag.turn > kv->turn) {
        kv->turn = tag.turn;
        kvmix_policy_retier_turn(&kv->policy, &kv->cache, kv->seq, kv->tags, (int32_t)pos, kv->turn,
                                 NULL);
    }
}

/* Nothing recorded, nothing recording (kvmix_kv_observe). */
static void observation_clear(kv_kvmix *kv) {
    kv->observe = kv->n_queries = 0;
    if (kv->query_sum == NULL) return;
    memset(kv->query_sum, 0,
           (size_t)kv->n_layers * kv->n_heads * kv->cache.desc.head_dim * sizeof(float));
    memset(kv->mass, 0, (size_t)kv->n_kv_heads * (size_t)kv->capacity * sizeof(float));
}

static void kv_kvmix_reset(void *state) {
    kv_kvmix *kv = state;
    observation_clear(kv);
    if (kv->tagged) kvmix_tagger_reset(&kv->tagger);
    kv->turn = 0;
    kvmix_cache_seq_free(&kv->cache, kv->seq);
    kvmix_cache_seq_create(&kv->cache, &kv->seq); /* cannot fail: the only sequence was freed */
}

/* Counted: kvmix_cache_seq_stats_get's attributed bytes of the sequence, that is every arena
 * allocation of the pages it references (sealed pages, the sink page, the FP16 buffer pages of
 * the window and of the page being filled, counted at their whole capacity, granule padding
 * included) plus its slot map, page table and sequence record. Not counted: the cache-wide
 * bookkeeping sized for the arena (page descriptors, granule bitmap, scratch). */
double kvmix_kv_assigned_bits(const kvmix_cache *cache, int32_t seq, const kvmix_policy *policy,
                              const kvmix_tag *tags, int32_t current_turn,
                              const tag_prices *prices) {
    double sum = 0;
    int64_t n = 0;
    for (int32_t pos = 0; pos < cache->seqs[seq].n_tokens; pos++) {
        uint32_t slot = 0;
        kvmix_cache_precision want;
        double bits = 0;
        if (kvmix_cache_locate(cache, seq, pos, &slot) != KVMIX_SUCCESS ||
            slot == KVMIX_CACHE_DEAD_SLOT)
            continue;
        const kvmix_cache_page *p = &cache->pages[slot / (uint32_t)cache->desc.page_tokens];
        if (!p->sealed || p->sink ||
            kvmix_policy_token_precision(policy, tags[pos], current_turn, &want) != KVMIX_SUCCESS)
            continue;
        if (prices != NULL) /* the tag is checked: its indices are in range */
            bits = prices->bits[kvmix_tag_bucket_of(tags[pos].turn, current_turn)][tags[pos].role]
                               [tags[pos].modality];
        if (bits <= 0 && kvmix_cache_precision_bits(cache, want, &bits) != KVMIX_SUCCESS) continue;
        sum += bits;
        n++;
    }
    return n > 0 ? sum / (double)n : 0.0;
}

static void kv_kvmix_stats(const void *state, llama_kv_stats *out) {
    const kv_kvmix *kv = state;
    kvmix_cache_seq_stats st;
    memset(out, 0, sizeof *out);
    if (kvmix_cache_seq_stats_get(&kv->cache, kv->seq, &st) != KVMIX_SUCCESS) return;
    out->n_tokens = st.n_live_tokens;
    out->bytes = (size_t)ceil(st.attributed_bytes);
    out->avg_bits = st.n_live_tokens > 0 ? st.bits_per_element : 0.0;
    out->packed_bits = st.packed_bits_per_element;
    out->n_packed_tokens = st.n_packed_rows;
    if (kv->tagged)
        out->assigned_bits = kvmix_kv_assigned_bits(&kv->cache, kv->seq, &kv->policy, kv->tags,
                                                    kv->turn, kv->priced ? &kv->prices : NULL);
}

static void kv_kvmix_destroy(void *state) {
    kv_kvmix *kv = state;
    if (kv == NULL) return;
    kvmix_cache_deinit(&kv->cache);
    for (int32_t h = 0; kv->heads != NULL && h < kv->n_kv_heads; h++) {
        free(kv->heads[h].spans);
        free(kv->heads[h].dead);
        free(kv->heads[h].lse);
        free(kv->heads[h].decode_ws);
        free(kv->heads[h].scores);
        free(kv->heads[h].positions);
    }
    free(kv->query_sum);
    free(kv->mass);
    free(kv->heads);
    free(kv->tags);
    free(kv);
}

/* The cache of a resolved kvmix policy, one sequence of `capacity` positions. The arena holds
 * every page at FP16 (the widest format), plus room for the seal in flight and the sink and
 * buffer pages that a page boundary adds. */
static kvmix_result init_cache(kv_kvmix *kv, const kvmix_policy *p, const llama_config *config) {
    kvmix_cache_desc desc = {0};
    desc.n_layers = config->n_layers;
    desc.n_kv_heads = config->n_kv_heads;
    desc.head_dim = config->head_dim;
    desc.max_seqs = 1;
    desc.max_tokens_per_seq = (int32_t)kv->capacity;
    kvmix_result r = kvmix_policy_apply(p, &desc, NULL);
    if (r != KVMIX_SUCCESS) return r;
    /* BOOSTED keys that a tag allocation asks of a policy without them get kvmix-calibrate's
     * boost, head_dim / 8 channels (a desc's n_boost of 0 refuses BOOSTED) */
    if (desc.n_boost == 0) desc.n_boost = desc.head_dim / 8;
    /* tagged tokens close a page at each new run (kvmix_cache_seq_set_run): room for runs of 4
     * tokens on average (the traces' average 60); 16 bytes of page table a page */
    desc.max_pages_per_seq = desc.max_tokens_per_seq / 4 + 8;
    size_t page_bytes = (size_t)config->n_layers * (size_t)config->n_kv_heads * 2 *
                        (size_t)desc.page_tokens * (size_t)config->head_dim * 2;
    size_t granule = 256, n_pages = (size_t)(kv->capacity / desc.page_tokens) + 4;
    desc.arena_bytes = n_pages * ((page_bytes + granule - 1) / granule * granule);
    desc.granule_bytes = granule;
    r = kvmix_cache_init_allocator(&kv->cache, &desc, NULL, NULL);
    if (r == KVMIX_SUCCESS) r = kvmix_cache_seq_create(&kv->cache, &kv->seq);
    return r;
}

static bool alloc_heads(kv_kvmix *kv) {
    const kvmix_cache_desc *d = &kv->cache.desc;
    kv->max_spans = d->max_pages_per_seq;
    kv->max_dead = d->max_pages_per_seq * d->page_tokens;
    kv->heads = calloc((size_t)kv->n_kv_heads, sizeof *kv->heads);
    if (kv->heads == NULL) return false;
    for (int32_t h = 0; h < kv->n_kv_heads; h++) {
        head_view *hv = &kv->heads[h];
        hv->spans = malloc((size_t)kv->max_spans * sizeof *hv->spans);
        hv->dead = malloc((size_t)kv->max_dead);
        hv->lse = malloc((size_t)kv->n_heads * sizeof *hv->lse);
        if (hv->spans == NULL || hv->dead == NULL || hv->lse == NULL) return false;
    }
    return true;
}

llama_result kvmix_kv_create(const kvmix_policy *policy, const llama_config *config,
                             int64_t capacity, llama_kv_cache *out, char *err, size_t err_bytes) {
    if (policy == NULL || config == NULL || out == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "kv cache: NULL argument");
    kvmix_policy p;
    llama_result r = kvmix_kv_policy_resolve(policy, config->head_dim, &p, err, err_bytes);
    if (r != LLAMA_OK) return r;
    if (p.key_format == KVMIX_KV_FORMAT_FP32) {
        r = llama_kv_fp32_create(config, capacity, out);
        return r == LLAMA_OK ? r : llama_fail(err, err_bytes, r, "cannot create the fp32 cache");
    }
    if (capacity < 1 || capacity > (1 << 26))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "kv cache: capacity %lld out of range", (long long)capacity);
    kv_kvmix *kv = calloc(1, sizeof *kv);
    if (kv == NULL) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "kv cache: out of memory");
    kv->n_layers = config->n_layers;
    kv->n_heads = config->n_heads;
    kv->n_kv_heads = config->n_kv_heads;
    kv->capacity = capacity;
    kv->request_boundary = p.request_boundary;
    kv->policy = p;
    kvmix_result kr = init_cache(kv, &p, config);
    if (kr != KVMIX_SUCCESS) {
        kv_kvmix_destroy(kv);
        return llama_fail(
            err, err_bytes, kr == KVMIX_ERR_OUT_OF_MEMORY ? LLAMA_ERR_MEMORY : LLAMA_ERR_ARGUMENT,
            "cannot create the kvmix cache for policy %s: %s", p.name, kvmix_result_string(kr));
    }
    if (!alloc_heads(kv)) {
        kv_kvmix_destroy(kv);
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "kv cache: out of memory");
    }
    *out = (llama_kv_cache){kv,
                            kv_kvmix_store,
                            kv_kvmix_attend,
                            kv_kvmix_begin_request,
                            kv_kvmix_reset,
                            kv_kvmix_stats,
                            kv_kvmix_destroy,
                            NULL};
    return LLAMA_OK;
}

llama_result kvmix_kv_policy_tagged(const kvmix_policy *policy, const kvmix_tag_precision *table,
                                    kvmix_tag_precision *table_copy, kvmix_policy *out_policy,
                                    const char *who, char *err, size_t err_bytes) {
    kvmix_error why;
    kvmix_policy p = *policy;
    p.tag_precision = table;
    if (kvmix_policy_check(&p, &why) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "%s: %s: %s", who, why.field,
                          why.reason);
    *table_copy = *table;
    p.tag_precision = table_copy;
    *out_policy = p;
    return LLAMA_OK;
}

llama_result kvmix_kv_tag(llama_kv_cache *cache, const kvmix_tag_spec *spec,
                          const kvmix_tag_precision *table, const tag_prices *prices, char *err,
                          size_t err_bytes) {
    if (cache == NULL || spec == NULL || table == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "kv tags: NULL argument");
    if (cache->store != kv_kvmix_store)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "kv tags: the fp32 cache keeps every token in fp32");
    kv_kvmix *kv = cache->state;
    kvmix_tagger tagger;
    if (kvmix_tagger_init(&tagger, spec, NULL) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "kv tags: the spec does not check");
    llama_result r = kvmix_kv_policy_tagged(&kv->policy, table, &kv->table, &kv->policy, "kv tags",
                                            err, err_bytes);
    if (r != LLAMA_OK) return r;
    kvmix_tag *tags = calloc((size_t)kv->capacity, sizeof *tags);
    if (tags == NULL) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "kv tags: out of memory");
    free(kv->tags);
    kv->tags = tags;
    kv->turn = 0;
    kv->tagger = tagger;
    kv->tagged = true;
    kv->priced = prices != NULL;
    if (prices != NULL) kv->prices = *prices;
    kv->next_pos = -1;
    cache->on_token = kv_kvmix_on_token;
    return LLAMA_OK;
}

const kvmix_cache *kvmix_kv_inner(const llama_kv_cache *cache, int32_t *out_seq) {
    if (cache == NULL || cache->store != kv_kvmix_store) {
        if (out_seq != NULL) *out_seq = -1;
        return NULL;
    }
    const kv_kvmix *kv = cache->state;
    if (out_seq != NULL) *out_seq = kv->seq;
    return &kv->cache;
}

llama_result kvmix_kv_evict(llama_kv_cache *cache, const int32_t *positions, int32_t n_positions) {
    if (cache == NULL || cache->store != kv_kvmix_store) return LLAMA_ERR_ARGUMENT;
    kv_kvmix *kv = cache->state;
    if (kvmix_cache_evict(&kv->cache, kv->seq, positions, n_positions) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    kvmix_cache_compact(&kv->cache, kv->seq, KVMIX_KV_COMPACT_LIVE_FRACTION, NULL);
    return LLAMA_OK;
}

llama_result kvmix_kv_ingest(llama_kv_cache *cache, int32_t layer, int64_t first_position,
                             int64_t n_tokens, const float *keys, const float *values) {
    if (cache == NULL || cache->store != kv_kvmix_store || !keys || !values)
        return LLAMA_ERR_ARGUMENT;
    kv_kvmix *kv = cache->state;
    if (layer < 0 || layer >= kv->n_layers || n_tokens < 1 ||
        first_position != written_on(kv, layer) ||
        (layer > 0 && first_position + n_tokens > written_on(kv, layer - 1)))
        return LLAMA_ERR_ARGUMENT;
    if (first_position + n_tokens > kv->capacity) return LLAMA_ERR_CAPACITY;
    if (layer == 0 && kv->cache.seqs[kv->seq].n_tokens == first_position) {
        kvmix_result r = kvmix_cache_reserve(&kv->cache, kv->seq, (int32_t)n_tokens, NULL, NULL);
        if (r == KVMIX_ERR_OUT_OF_MEMORY) return LLAMA_ERR_CAPACITY;
        if (r != KVMIX_SUCCESS) return LLAMA_ERR_ARGUMENT;
    }
    if (kvmix_cache_write(&kv->cache, kv->seq, layer, (int32_t)first_position, (int32_t)n_tokens,
                          keys, values) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    return LLAMA_OK;
}

llama_result kvmix_kv_upgrade(llama_kv_cache *cache, int64_t position, const float *keys,
                              const float *values) {
    if (cache == NULL || cache->store != kv_kvmix_store || position < 0 || position > INT32_MAX)
        return LLAMA_ERR_ARGUMENT;
    kv_kvmix *kv = cache->state;
    kvmix_cache_precision keep = {0, 0};
    return kvmix_cache_retier(&kv->cache, kv->seq, (int32_t)position, keep, keys, values,
                              KVMIX_CACHE_ROWS_RESIDUAL) == KVMIX_SUCCESS
               ? LLAMA_OK
               : LLAMA_ERR_ARGUMENT;
}

llama_result kvmix_kv_rows_read(const llama_kv_cache *cache, int64_t n_positions, float *keys,
                                float *values) {
    if (cache == NULL || cache->store != kv_kvmix_store || !keys || !values || n_positions < 0)
        return LLAMA_ERR_ARGUMENT;
    const kv_kvmix *kv = cache->state;
    size_t row = (size_t)kv->n_kv_heads * (size_t)kv->cache.desc.head_dim;
    for (int32_t l = 0; l < kv->n_layers; l++)
        for (int64_t p = 0; p < n_positions; p++) {
            size_t at = ((size_t)l * (size_t)n_positions + (size_t)p) * row;
            if (p > INT32_MAX || kvmix_cache_read(&kv->cache, kv->seq, l, (int32_t)p, keys + at,
                                                  values + at, NULL) != KVMIX_SUCCESS)
                return LLAMA_ERR_ARGUMENT;
        }
    return LLAMA_OK;
}

/* The recording buffers (kvmix_kv_observe), allocated on first use; false when out of memory. */
static bool observation_ready(kv_kvmix *kv) {
    size_t q_floats = (size_t)kv->n_layers * kv->n_heads * kv->cache.desc.head_dim;
    for (int32_t h = 0; h < kv->n_kv_heads; h++) {
        head_view *hv = &kv->heads[h];
        if (hv->scores == NULL) hv->scores = malloc((size_t)kv->max_dead * sizeof *hv->scores);
        if (hv->positions == NULL)
            hv->positions = malloc((size_t)kv->max_dead * sizeof *hv->positions);
        if (hv->scores == NULL || hv->positions == NULL) return false;
    }
    if (kv->query_sum == NULL) kv->query_sum = calloc(q_floats, sizeof *kv->query_sum);
    if (kv->mass == NULL)
        kv->mass = calloc((size_t)kv->n_kv_heads * (size_t)kv->capacity, sizeof *kv->mass);
    return kv->query_sum != NULL && kv->mass != NULL;
}

llama_result kvmix_kv_observe(llama_kv_cache *cache, int32_t flags) {
    if (cache == NULL || cache->store != kv_kvmix_store ||
        (flags & ~(KVMIX_KV_OBSERVE_QUERIES | KVMIX_KV_OBSERVE_ATTENTION)) != 0)
        return LLAMA_ERR_ARGUMENT;
    kv_kvmix *kv = cache->state;
    if (!observation_ready(kv)) return LLAMA_ERR_MEMORY;
    kv->observe = flags;
    return LLAMA_OK;
}

llama_result kvmix_kv_observed_take(llama_kv_cache *cache, float *query_sum, int32_t *out_n_queries,
                                    float *attention) {
    if (cache == NULL || cache->store != kv_kvmix_store) return LLAMA_ERR_ARGUMENT;
    kv_kvmix *kv = cache->state;
    if (!observation_ready(kv)) return LLAMA_ERR_MEMORY;
    size_t q_floats = (size_t)kv->n_layers * kv->n_heads * kv->cache.desc.head_dim;
    int32_t n_pos = kv->cache.seqs[kv->seq].n_tokens;
    if (query_sum != NULL) {
        memcpy(query_sum, kv->query_sum, q_floats * sizeof *query_sum);
        memset(kv->query_sum, 0, q_floats * sizeof *query_sum);
        if (out_n_queries != NULL) *out_n_queries = kv->n_queries;
        kv->n_queries = 0;
    }
    if (attention == NULL) return LLAMA_OK;
    for (int32_t t = 0; t < n_pos; t++) attention[t] = 0.0f;
    for (int32_t h = 0; h < kv->n_kv_heads; h++) {
        float *mass = kv->mass + (size_t)h * (size_t)kv->capacity;
        for (int32_t t = 0; t < n_pos; t++) attention[t] += mass[t];
        memset(mass, 0, (size_t)kv->capacity * sizeof *mass);
    }
    return LLAMA_OK;
}

/* Layer l's intent scores by view token into hv->scores, their positions into hv->positions
 * (*out_n of them). */
static bool layer_intent_scores(kv_kvmix *kv, head_view *hv, int32_t l, const float *memory,
                                int32_t *out_n) {
    kvmix_view view;
    return kvmix_cache_view(&kv->cache, &kv->seq, 1, l, hv->spans, kv->max_spans, hv->first,
                            hv->dead, kv->max_dead, &view) == KVMIX_SUCCESS &&
           kvmix_ref_view_intent_score(&view, 0, kv->n_heads, 0.0f, memory, hv->scores,
                                       kv->max_dead) == KVMIX_SUCCESS &&
           kvmix_cache_view_positions(&kv->cache, kv->seq, l, hv->positions, kv->max_dead, out_n) ==
               KVMIX_SUCCESS;
}

llama_result kvmix_kv_intent_scores(llama_kv_cache *cache, const float *memory, float *scores) {
    if (cache == NULL || cache->store != kv_kvmix_store || memory == NULL || scores == NULL)
        return LLAMA_ERR_ARGUMENT;
    kv_kvmix *kv = cache->state;
    if (!observation_ready(kv)) return LLAMA_ERR_MEMORY;
    head_view *hv = &kv->heads[0]; /* between steps: no attend() uses it */
    size_t row = (size_t)kv->n_heads * kv->cache.desc.head_dim;
    for (int32_t t = 0; t < kv->cache.seqs[kv->seq].n_tokens; t++) scores[t] = -INFINITY;
    for (int32_t l = 0; l < kv->n_layers; l++) {
        int32_t n = 0;
        if (!layer_intent_scores(kv, hv, l, memory + (size_t)l * row, &n))
            return LLAMA_ERR_ARGUMENT;
        for (int32_t k = 0; k < n; k++) {
            int32_t pos = hv->positions[k];
            if (pos >= 0) scores[pos] = l == 0 ? hv->scores[k] : scores[pos] + hv->scores[k];
        }
    }
    return LLAMA_OK;
}

/* Layer l's key features by view token into norm and readout, their positions into
 * hv->positions (*out_n of them). */
static bool layer_key_features(kv_kvmix *kv, head_view *hv, int32_t l, const float *memory,
                               float *norm, float *readout, int32_t *out_n) {
    kvmix_view view;
    return kvmix_cache_view(&kv->cache, &kv->seq, 1, l, hv->spans, kv->max_spans, hv->first,
                            hv->dead, kv->max_dead, &view) == KVMIX_SUCCESS &&
           kvmix_ref_view_key_features(&view, 0, kv->n_heads, 0.0f, memory, norm, readout,
                                       kv->max_dead) == KVMIX_SUCCESS &&
           kvmix_cache_view_positions(&kv->cache, kv->seq, l, hv->positions, kv->max_dead, out_n) ==
               KVMIX_SUCCESS;
}

llama_result kvmix_kv_key_features(llama_kv_cache *cache, const float *memory, float *key_norm,
                                   float *readout) {
    if (cache == NULL || cache->store != kv_kvmix_store || memory == NULL || key_norm == NULL ||
        readout == NULL)
        return LLAMA_ERR_ARGUMENT;
    kv_kvmix *kv = cache->state;
    if (!observation_ready(kv)) return LLAMA_ERR_MEMORY;
    head_view *hv = &kv->heads[0]; /* between steps: no attend() uses it */
    size_t row = (size_t)kv->n_heads * kv->cache.desc.head_dim;
    int32_t n_tokens = kv->cache.seqs[kv->seq].n_tokens;
    float *norm = malloc(2 * (size_t)kv->max_dead * sizeof *norm);
    if (!norm) return LLAMA_ERR_MEMORY;
    float *out = norm + kv->max_dead;
    llama_result r = LLAMA_OK;
    for (int32_t t = 0; t < n_tokens; t++) key_norm[t] = readout[t] = 0.0f;
    for (int32_t l = 0; l < kv->n_layers; l++) {
        int32_t n = 0;
        if (!layer_key_features(kv, hv, l, memory + (size_t)l * row, norm, out, &n)) {
            r = LLAMA_ERR_ARGUMENT;
            break;
        }
        for (int32_t k = 0; k < n; k++) {
            int32_t pos = hv->positions[k];
            if (pos < 0) continue;
            key_norm[pos] += norm[k] / (float)kv->n_layers;
            readout[pos] += out[k] / (float)kv->n_layers;
        }
    }
    free(norm);
    return r;
}
