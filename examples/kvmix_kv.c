/* kvmix_kv.c - KV-cache policies (built-ins, JSON documents) and the kvmix-backed llama_kv_cache.
 * See kvmix_kv.h for the interface and README.md ("Policies") for the JSON schema. */
#include "kvmix_kv.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// >>policies

#define KEEP KVMIX_CACHE_PARTIAL_KEEP_FP16

static const kvmix_kv_policy BUILTINS[] = {
    {"fp32", "keys and values kept as fp32 in the runner's own cache (the reference)",
     KVMIX_KV_FORMAT_FP32, KVMIX_KV_FORMAT_FP32, 32, 0, 0.0, 32, 0, 0, KEEP},
    {"fp16", "keys and values FP16 in the kvmix cache", KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 32, 0,
     0.0, 32, 0, 0, KEEP},
    {"int8", "INT8 keys and values, per token, groups of 32 channels", KVMIX_FORMAT_INT8,
     KVMIX_FORMAT_INT8, 32, 0, 0.0, 32, 0, 0, KEEP},
    {"int4", "INT4 keys and values, per token, groups of 32 channels", KVMIX_FORMAT_INT4,
     KVMIX_FORMAT_INT4, 32, 0, 0.0, 32, 0, 0, KEEP},
    {"kivi2",
     "KIVI-2: INT2 per-channel keys over pages of 32 tokens, INT2 per-token values (groups of "
     "32), the 128 most recent tokens FP16 (the residual)",
     KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2, 32, 0, 0.0, 32, 0, 128, KEEP},
    {"kivi2-sink",
     "kivi2 (INT2 per-channel keys over pages of 32 tokens, INT2 per-token values, the 128 most "
     "recent tokens FP16) plus the first 32 tokens kept FP16 (attention sinks)",
     KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2, 32, 0, 0.0, 32, 32, 128, KEEP},
    {"kitty-12",
     "Kitty: 2-bit per-channel keys over pages of 32 tokens with the head_dim/8 channels of "
     "largest mean |k| boosted to 4 bits, INT2 per-token values (groups of 32), 32 FP16 sinks, "
     "the 128 most recent tokens FP16",
     KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, 32, 0, 0.125, 32, 32, 128, KEEP},
    {"kitty-25",
     "Kitty: 2-bit per-channel keys over pages of 32 tokens with the head_dim/4 channels of "
     "largest mean |k| boosted to 4 bits, INT2 per-token values (groups of 32), 32 FP16 sinks, "
     "the 128 most recent tokens FP16",
     KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, 32, 0, 0.25, 32, 32, 128, KEEP},
};

int32_t kvmix_kv_policy_count(void) { return (int32_t)(sizeof BUILTINS / sizeof BUILTINS[0]); }

const kvmix_kv_policy *kvmix_kv_policy_at(int32_t index) {
    return index >= 0 && index < kvmix_kv_policy_count() ? &BUILTINS[index] : NULL;
}

const kvmix_kv_policy *kvmix_kv_policy_builtin(const char *name) {
    for (int32_t i = 0; name != NULL && i < kvmix_kv_policy_count(); i++)
        if (strcmp(BUILTINS[i].name, name) == 0) return &BUILTINS[i];
    return NULL;
}

static const struct {
    const char *name;
    int32_t format;
} FORMAT_NAMES[] = {{"fp32", KVMIX_KV_FORMAT_FP32},   {"fp16", KVMIX_FORMAT_FP16},
                    {"int8", KVMIX_FORMAT_INT8},      {"int4", KVMIX_FORMAT_INT4},
                    {"int2", KVMIX_FORMAT_INT2},      {"int2_channel", KVMIX_FORMAT_INT2_CHANNEL},
                    {"boosted", KVMIX_FORMAT_BOOSTED}};
enum { N_FORMAT_NAMES = sizeof FORMAT_NAMES / sizeof FORMAT_NAMES[0] };

static const char *format_name(int32_t format) {
    for (int32_t i = 0; i < N_FORMAT_NAMES; i++)
        if (FORMAT_NAMES[i].format == format) return FORMAT_NAMES[i].name;
    return "unknown";
}

static const char *partial_name(int32_t partial) {
    return partial == KVMIX_CACHE_PARTIAL_QUANTIZE ? "quantize" : "keep_fp16";
}

/* The fields of a policy document, in the order kvmix_kv_policy_json writes them. */
static const char *const FIELDS[] = {
    "version", "name",           "description", "key_format",  "value_format",  "group_size",
    "n_boost", "boost_fraction", "page_tokens", "sink_tokens", "window_tokens", "partial_page"};
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

static bool take_text(const cJSON *item, const char *field, char *out, size_t out_bytes, char *err,
                      size_t err_bytes) {
    if (!cJSON_IsString(item) || item->valuestring == NULL) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "policy field \"%s\": must be a string",
                   field);
        return false;
    }
    size_t len = strlen(item->valuestring);
    bool printable = len > 0 || out_bytes == KVMIX_KV_MAX_DESCRIPTION;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)item->valuestring[i] < 0x20) printable = false;
    if (len >= out_bytes || !printable) {
        llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                   "policy field \"%s\": must be %sat most %zu bytes without control characters",
                   field, out_bytes == KVMIX_KV_MAX_NAME ? "non-empty, " : "", out_bytes - 1);
        return false;
    }
    memcpy(out, item->valuestring, len + 1);
    return true;
}

static bool take_format(const cJSON *item, const char *field, int32_t *out, char *err,
                        size_t err_bytes) {
    if (cJSON_IsString(item) && item->valuestring != NULL)
        for (int32_t i = 0; i < N_FORMAT_NAMES; i++)
            if (strcmp(item->valuestring, FORMAT_NAMES[i].name) == 0) {
                *out = FORMAT_NAMES[i].format;
                return true;
            }
    llama_fail(
        err, err_bytes, LLAMA_ERR_FORMAT,
        "policy field \"%s\": must be one of \"fp32\", \"fp16\", \"int8\", \"int4\", \"int2\", "
        "\"int2_channel\", \"boosted\"",
        field);
    return false;
}

/* Checks the cross-field rules of a policy whatever the model. */
static llama_result policy_check(const kvmix_kv_policy *p, char *err, size_t err_bytes) {
    bool fp32_key = p->key_format == KVMIX_KV_FORMAT_FP32;
    bool fp32_value = p->value_format == KVMIX_KV_FORMAT_FP32;
    bool boosted = p->key_format == KVMIX_FORMAT_BOOSTED || p->value_format == KVMIX_FORMAT_BOOSTED;
    if (fp32_key != fp32_value)
        return llama_fail(
            err, err_bytes, LLAMA_ERR_FORMAT,
            "policy field \"%s\": \"fp32\" is the reference cache, for both keys and values",
            fp32_key ? "value_format" : "key_format");
    if (fp32_key && (p->sink_tokens != 0 || p->window_tokens != 0 || p->n_boost != 0 ||
                     p->boost_fraction != 0.0))
        return llama_fail(
            err, err_bytes, LLAMA_ERR_FORMAT,
            "policy field \"%s\": the fp32 reference cache takes no sinks, window or boost",
            p->sink_tokens != 0     ? "sink_tokens"
            : p->window_tokens != 0 ? "window_tokens"
            : p->n_boost != 0       ? "n_boost"
                                    : "boost_fraction");
    if (p->group_size % 8 != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "policy field \"group_size\": must be a multiple of 8 in 8 .. 512");
    if (p->page_tokens % 8 != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "policy field \"page_tokens\": must be a multiple of 8 in 8 .. 1024");
    if (p->sink_tokens > p->page_tokens)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "policy field \"sink_tokens\": must be at most page_tokens (%d)",
                          p->page_tokens);
    if (p->n_boost % 4 != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "policy field \"n_boost\": must be a multiple of 4 in 0 .. 252");
    if (boosted && p->n_boost == 0 && p->boost_fraction == 0.0)
        return llama_fail(
            err, err_bytes, LLAMA_ERR_FORMAT,
            "policy field \"n_boost\": a boosted format needs n_boost or boost_fraction");
    if (!boosted && (p->n_boost != 0 || p->boost_fraction != 0.0))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "policy field \"%s\": only for the \"boosted\" format",
                          p->n_boost != 0 ? "n_boost" : "boost_fraction");
    return LLAMA_OK;
}

static bool only_space(const char *p, const char *end) {
    for (; p < end; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') return false;
    return true;
}

/* Reads every member of the document into p; false with a message on the first bad one. */
static bool take_fields(const cJSON *root, kvmix_kv_policy *p, bool *seen, char *err,
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
        case 5: ok = take_int(item, "group_size", 8, 512, &p->group_size, err, err_bytes); break;
        case 6: ok = take_int(item, "n_boost", 0, 252, &p->n_boost, err, err_bytes); break;
        case 7:
            ok = cJSON_IsNumber(item) && item->valuedouble >= 0.0 && item->valuedouble <= 1.0;
            if (ok)
                p->boost_fraction = item->valuedouble;
            else
                llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                           "policy field \"boost_fraction\": must be a number in 0 .. 1");
            break;
        case 8: ok = take_int(item, "page_tokens", 8, 1024, &p->page_tokens, err, err_bytes); break;
        case 9: ok = take_int(item, "sink_tokens", 0, 1024, &p->sink_tokens, err, err_bytes); break;
        case 10:
            ok = take_int(item, "window_tokens", 0, 1 << 26, &p->window_tokens, err, err_bytes);
            break;
        default:
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
        }
        if (!ok) return false;
    }
    return true;
}

llama_result kvmix_kv_policy_parse(const char *json, size_t json_bytes, kvmix_kv_policy *out,
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
    kvmix_kv_policy p = {"custom", "", -1, -1, 32, 0, 0.0, 32, 0, 0, KVMIX_CACHE_PARTIAL_KEEP_FP16};
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

llama_result kvmix_kv_policy_resolve(const kvmix_kv_policy *policy, int32_t head_dim,
                                     kvmix_kv_policy *out, char *err, size_t err_bytes) {
    if (policy == NULL || out == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "policy: NULL argument");
    kvmix_kv_policy p = *policy;
    llama_result r = policy_check(&p, err, err_bytes);
    if (r != LLAMA_OK) return LLAMA_ERR_ARGUMENT;
    if (p.key_format == KVMIX_KV_FORMAT_FP32) {
        *out = p;
        return LLAMA_OK;
    }
    if (head_dim < 32 || head_dim > KVMIX_MAX_HEAD_DIM || head_dim % 32 != 0)
        return llama_fail(
            err, err_bytes, LLAMA_ERR_ARGUMENT,
            "policy %s: kvmix needs head_dim a multiple of 32 up to %d, the model has %d", p.name,
            KVMIX_MAX_HEAD_DIM, head_dim);
    if (head_dim % p.group_size != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "policy field \"group_size\": %d does not divide the model's head_dim %d",
                          p.group_size, head_dim);
    if (p.key_format == KVMIX_FORMAT_BOOSTED || p.value_format == KVMIX_FORMAT_BOOSTED) {
        if (p.n_boost != 0 && p.boost_fraction != 0.0 &&
            p.boost_fraction * head_dim != (double)p.n_boost)
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                              "policy field \"boost_fraction\": %g of head_dim %d disagrees with "
                              "n_boost %d",
                              p.boost_fraction, head_dim, p.n_boost);
        if (p.n_boost == 0) {
            double n = p.boost_fraction * head_dim;
            if (n != floor(n) || (int32_t)n % 4 != 0 || n < 4 || n > 252)
                return llama_fail(
                    err, err_bytes, LLAMA_ERR_ARGUMENT,
                    "policy field \"boost_fraction\": %g of head_dim %d is not a multiple "
                    "of 4 in 4 .. 252",
                    p.boost_fraction, head_dim);
            p.n_boost = (int32_t)n;
        }
        if (p.n_boost > head_dim)
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                              "policy field \"n_boost\": %d exceeds the model's head_dim %d",
                              p.n_boost, head_dim);
        p.boost_fraction = (double)p.n_boost / head_dim;
    }
    *out = p;
    return LLAMA_OK;
}

char *kvmix_kv_policy_json(const kvmix_kv_policy *p) {
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
    cJSON_AddNumberToObject(obj, "group_size", p->group_size);
    cJSON_AddNumberToObject(obj, "n_boost", p->n_boost);
    cJSON_AddNumberToObject(obj, "boost_fraction", p->boost_fraction);
    cJSON_AddNumberToObject(obj, "page_tokens", p->page_tokens);
    cJSON_AddNumberToObject(obj, "sink_tokens", p->sink_tokens);
    cJSON_AddNumberToObject(obj, "window_tokens", p->window_tokens);
    cJSON_AddStringToObject(obj, "partial_page", partial_name(p->partial_page));
    char *text = cJSON_PrintUnformatted(obj);
    cJSON_Delete(obj);
    return text;
}

bool kvmix_kv_policy_equal(const kvmix_kv_policy *a, const kvmix_kv_policy *b) {
    return strcmp(a->name, b->name) == 0 && strcmp(a->description, b->description) == 0 &&
           a->key_format == b->key_format && a->value_format == b->value_format &&
           a->group_size == b->group_size && a->n_boost == b->n_boost &&
           a->boost_fraction == b->boost_fraction && a->page_tokens == b->page_tokens &&
           a->sink_tokens == b->sink_tokens && a->window_tokens == b->window_tokens &&
           a->partial_page == b->partial_page;
}

// >>kvcache

/* What a page-table entry pointed at when the mirror was last refreshed for its rows. Its row
 * count is left out on purpose: rows added to an entry are mirrored by the store that writes them,
 * and rows already there change only with the page, its formats or its sealed state. */
typedef struct entry_mark {
    uint32_t page;
    int32_t first_pos;
    uint8_t key_format, value_format, sealed, pad;
} entry_mark;

typedef struct kv_kvmix {
    kvmix_cache cache;
    int32_t seq;
    kvmix_cache_precision precision;
    int32_t n_layers, n_kv_heads, head_dim;
    int64_t capacity;
    int64_t *n_stored;    /* [n_layers]: positions stored on each layer */
    float *k, *v;         /* mirror [n_layers][n_kv_heads][capacity][head_dim] */
    float *row_k, *row_v; /* [n_kv_heads * head_dim]: one position read back */
    float *scores;        /* [n_kv_heads][capacity] */
    entry_mark *marks;    /* [max_pages_per_seq] */
    int32_t n_marks;
} kv_kvmix;

static size_t mirror_offset(const kv_kvmix *kv, int32_t layer, int32_t head, int64_t pos) {
    return (((size_t)layer * (size_t)kv->n_kv_heads + (size_t)head) * (size_t)kv->capacity +
            (size_t)pos) *
           (size_t)kv->head_dim;
}

/* Copies what the cache holds for one position of one layer into the mirror. */
static llama_result mirror_row(kv_kvmix *kv, int32_t layer, int32_t pos) {
    if (kvmix_cache_read(&kv->cache, kv->seq, pos, layer, kv->row_k, kv->row_v, NULL) !=
        KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    size_t row_bytes = (size_t)kv->head_dim * sizeof(float);
    for (int32_t h = 0; h < kv->n_kv_heads; h++) {
        memcpy(kv->k + mirror_offset(kv, layer, h, pos), kv->row_k + (size_t)h * kv->head_dim,
               row_bytes);
        memcpy(kv->v + mirror_offset(kv, layer, h, pos), kv->row_v + (size_t)h * kv->head_dim,
               row_bytes);
    }
    return LLAMA_OK;
}

/* After a call that may seal, copy or re-tier pages: refreshes the rows of every page-table entry
 * whose page, formats, sealed state or extent changed, on every layer that has written them. */
static llama_result mirror_sync(kv_kvmix *kv) {
    const kvmix_cache *c = &kv->cache;
    int32_t n_entries = c->seqs[kv->seq].n_entries;
    const kvmix_cache_entry *entries =
        c->entries + (size_t)kv->seq * (size_t)c->desc.max_pages_per_seq;
    for (int32_t j = 0; j < n_entries; j++) {
        const kvmix_cache_entry *e = &entries[j];
        const kvmix_cache_page *p = &c->pages[e->page];
        entry_mark now = {e->page, e->first_pos, p->key_format, p->value_format, p->sealed, 0};
        if (j < kv->n_marks && memcmp(&now, &kv->marks[j], sizeof now) == 0) continue;
        for (int32_t layer = 0; layer < kv->n_layers; layer++)
            for (int32_t pos = e->first_pos;
                 pos < e->first_pos + e->n_rows && pos < kv->n_stored[layer]; pos++) {
                llama_result r = mirror_row(kv, layer, pos);
                if (r != LLAMA_OK) return r;
            }
        kv->marks[j] = now;
    }
    kv->n_marks = n_entries;
    return LLAMA_OK;
}

static llama_result kv_kvmix_store(void *state, int32_t layer, int64_t pos, const float *k,
                                   const float *v) {
    kv_kvmix *kv = state;
    if (layer < 0 || layer >= kv->n_layers || pos != kv->n_stored[layer] ||
        (layer > 0 && pos >= kv->n_stored[layer - 1]))
        return LLAMA_ERR_ARGUMENT;
    if (pos >= kv->capacity) return LLAMA_ERR_CAPACITY;
    /* Layer 0 reserves the position, unless an earlier store that failed after reserving it did. */
    if (layer == 0 && kv->cache.seqs[kv->seq].n_tokens == pos) {
        kvmix_result r = kvmix_cache_reserve(&kv->cache, kv->seq, 1, &kv->precision, NULL);
        if (r == KVMIX_ERR_OUT_OF_MEMORY) return LLAMA_ERR_CAPACITY;
        if (r != KVMIX_SUCCESS) return LLAMA_ERR_ARGUMENT;
        llama_result lr = mirror_sync(kv);
        if (lr != LLAMA_OK) return lr;
    }
    if (kvmix_cache_write(&kv->cache, kv->seq, layer, (int32_t)pos, 1, k, v) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    kv->n_stored[layer]++;
    return mirror_row(kv, layer, (int32_t)pos);
}

static llama_result kv_kvmix_attend(void *state, int32_t layer, int32_t kv_head, const float *q,
                                    int32_t n_q, float scale, float *out) {
    kv_kvmix *kv = state;
    if (layer < 0 || layer >= kv->n_layers || kv_head < 0 || kv_head >= kv->n_kv_heads)
        return LLAMA_ERR_ARGUMENT;
    int64_t n_tokens = kv->n_stored[layer];
    if (n_tokens == 0) return LLAMA_ERR_ARGUMENT;
    const float *keys = kv->k + mirror_offset(kv, layer, kv_head, 0);
    const float *values = kv->v + mirror_offset(kv, layer, kv_head, 0);
    float *scores = kv->scores + (size_t)kv_head * (size_t)kv->capacity;
    for (int32_t h = 0; h < n_q; h++)
        llama_attend_rows(keys, values, n_tokens, kv->head_dim, q + (size_t)h * kv->head_dim, scale,
                          scores, out + (size_t)h * kv->head_dim);
    return LLAMA_OK;
}

/* A request boundary: kvmix_cache_seq_finish seals the full pages and applies the partial-page
 * policy; the mirror follows. A failure here (the arena is sized so that it cannot run out) leaves
 * the cache as it was, which is a valid state to go on from. */
static void kv_kvmix_begin_request(void *state, int64_t pos) {
    kv_kvmix *kv = state;
    (void)pos;
    if (kvmix_cache_seq_finish(&kv->cache, kv->seq) == KVMIX_SUCCESS) mirror_sync(kv);
}

static void kv_kvmix_reset(void *state) {
    kv_kvmix *kv = state;
    kvmix_cache_seq_free(&kv->cache, kv->seq);
    kvmix_cache_seq_create(&kv->cache, &kv->seq); /* cannot fail: the only sequence was freed */
    memset(kv->n_stored, 0, (size_t)kv->n_layers * sizeof *kv->n_stored);
    kv->n_marks = 0;
}

/* Counted: kvmix_cache_seq_stats_get's attributed bytes of the sequence, that is every arena
 * allocation of the pages it references (sealed pages, the sink page, the FP16 buffer pages of
 * the window and of the page being filled, counted at their whole capacity, granule padding
 * included) plus its slot map, page table and sequence record. Not counted: the cache-wide
 * bookkeeping sized for the arena (page descriptors, granule bitmap, scratch) and the runner's
 * float mirror, which is a CPU-speed copy, not storage. */
static void kv_kvmix_stats(const void *state, llama_kv_stats *out) {
    const kv_kvmix *kv = state;
    kvmix_cache_seq_stats st;
    memset(out, 0, sizeof *out);
    if (kvmix_cache_seq_stats_get(&kv->cache, kv->seq, &st) != KVMIX_SUCCESS) return;
    out->n_tokens = st.n_live_tokens;
    out->bytes = (size_t)ceil(st.attributed_bytes);
    out->avg_bits = st.n_live_tokens > 0 ? st.bits_per_element : 0.0;
}

static void kv_kvmix_destroy(void *state) {
    kv_kvmix *kv = state;
    if (kv == NULL) return;
    kvmix_cache_deinit(&kv->cache);
    free(kv->n_stored);
    free(kv->k);
    free(kv->v);
    free(kv->row_k);
    free(kv->row_v);
    free(kv->scores);
    free(kv->marks);
    free(kv);
}

llama_result kvmix_kv_create(const kvmix_kv_policy *policy, const llama_config *config,
                             int64_t capacity, llama_kv_cache *out, char *err, size_t err_bytes) {
    if (policy == NULL || config == NULL || out == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "kv cache: NULL argument");
    kvmix_kv_policy p;
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
    kv->n_kv_heads = config->n_kv_heads;
    kv->head_dim = config->head_dim;
    kv->capacity = capacity;
    kv->precision.key_format = (uint8_t)p.key_format;
    kv->precision.value_format = (uint8_t)p.value_format;
    /* The arena holds every page at FP16 (the widest format), plus room for the seal in flight
     * and the sink and buffer pages that a page boundary adds. */
    size_t page_bytes = (size_t)config->n_layers * (size_t)config->n_kv_heads * 2 *
                        (size_t)p.page_tokens * (size_t)config->head_dim * 2;
    size_t granule = 256, n_pages = (size_t)(capacity / p.page_tokens) + 4;
    kvmix_cache_desc desc = {0};
    desc.n_layers = config->n_layers;
    desc.n_kv_heads = config->n_kv_heads;
    desc.head_dim = config->head_dim;
    desc.page_tokens = p.page_tokens;
    desc.max_seqs = 1;
    desc.max_tokens_per_seq = (int32_t)capacity;
    desc.n_sink = p.sink_tokens;
    desc.n_window = p.window_tokens < capacity ? p.window_tokens : (int32_t)capacity;
    desc.group_size = p.group_size;
    desc.n_boost = p.n_boost > 0 ? p.n_boost : 16;
    desc.partial = (kvmix_cache_partial)p.partial_page;
    desc.default_precision = kv->precision;
    desc.arena_bytes = n_pages * ((page_bytes + granule - 1) / granule * granule);
    desc.granule_bytes = granule;
    kvmix_result kr = kvmix_cache_init_allocator(&kv->cache, &desc, NULL);
    if (kr == KVMIX_SUCCESS) kr = kvmix_cache_seq_create(&kv->cache, &kv->seq);
    if (kr != KVMIX_SUCCESS) {
        kv_kvmix_destroy(kv);
        return llama_fail(
            err, err_bytes, kr == KVMIX_ERR_OUT_OF_MEMORY ? LLAMA_ERR_MEMORY : LLAMA_ERR_ARGUMENT,
            "cannot create the kvmix cache for policy %s: %s", p.name, kvmix_result_string(kr));
    }
    size_t mirror_floats = mirror_offset(kv, kv->n_layers, 0, 0);
    size_t row_floats = (size_t)kv->n_kv_heads * (size_t)kv->head_dim;
    kv->n_stored = calloc((size_t)kv->n_layers, sizeof *kv->n_stored);
    kv->k = malloc(mirror_floats * sizeof(float));
    kv->v = malloc(mirror_floats * sizeof(float));
    kv->row_k = malloc(row_floats * sizeof(float));
    kv->row_v = malloc(row_floats * sizeof(float));
    kv->scores = malloc((size_t)kv->n_kv_heads * (size_t)capacity * sizeof(float));
    kv->marks = malloc((size_t)kv->cache.desc.max_pages_per_seq * sizeof *kv->marks);
    if (!kv->n_stored || !kv->k || !kv->v || !kv->row_k || !kv->row_v || !kv->scores ||
        !kv->marks) {
        kv_kvmix_destroy(kv);
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "kv cache: out of memory");
    }
    *out = (llama_kv_cache){kv,
                            kv_kvmix_store,
                            kv_kvmix_attend,
                            kv_kvmix_begin_request,
                            kv_kvmix_reset,
                            kv_kvmix_stats,
                            kv_kvmix_destroy};
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

int64_t kvmix_kv_mirror_mismatches(const llama_kv_cache *cache) {
    if (cache == NULL || cache->store != kv_kvmix_store) return -1;
    const kv_kvmix *kv = cache->state;
    int64_t n_diff = 0;
    for (int32_t layer = 0; layer < kv->n_layers; layer++)
        for (int64_t pos = 0; pos < kv->n_stored[layer]; pos++) {
            if (kvmix_cache_read(&kv->cache, kv->seq, (int32_t)pos, layer, kv->row_k, kv->row_v,
                                 NULL) != KVMIX_SUCCESS)
                return -1;
            for (int32_t h = 0; h < kv->n_kv_heads; h++) {
                const float *mk = kv->k + mirror_offset(kv, layer, h, pos);
                const float *mv = kv->v + mirror_offset(kv, layer, h, pos);
                const float *rk = kv->row_k + (size_t)h * kv->head_dim;
                const float *rv = kv->row_v + (size_t)h * kv->head_dim;
                for (int32_t d = 0; d < kv->head_dim; d++)
                    n_diff += memcmp(&mk[d], &rk[d], sizeof(float)) != 0 ||
                              memcmp(&mv[d], &rv[d], sizeof(float)) != 0;
            }
        }
    return n_diff;
}
