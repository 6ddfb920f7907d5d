/* tier_probe.c - see tier_probe.h. */
#include "tier_probe.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json_number.h" /* after cJSON.h */

enum { PROBE_VERSION = 1 };
static const char KIND[] = "kvmix-int4-probe";

/* The fields of a document, in the order tier_probe_json writes them. */
static const char *const FIELDS[] = {"version", "kind", "model",  "budget",
                                     "trials",  "pass", "passed", "allow_int4"};
enum { N_FIELDS = sizeof FIELDS / sizeof FIELDS[0] };

static int model_ok(const char *model) {
    size_t n = model ? strlen(model) : 0;
    if (n == 0 || n >= TIER_PROBE_MODEL_BYTES) return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)model[i] < 0x20) return 0;
    return 1;
}

/* Why a record's values cannot be a probe's, or NULL. */
static const char *record_problem(const tier_probe_record *r) {
    if (!model_ok(r->model)) return "model: must be 1-63 bytes without control characters";
    if (!(r->budget > 0.0 && r->budget <= 1.0)) return "budget: must be in (0, 1]";
    if (r->n_trials < 1 || r->n_trials > 1000000) return "trials: must be in 1 .. 10^6";
    if (r->n_pass < 1 || r->n_pass > r->n_trials) return "pass: must be in 1 .. trials";
    if (r->n_passed < 0 || r->n_passed > r->n_trials) return "passed: must be in 0 .. trials";
    if (r->allow_int4 != (r->n_passed >= r->n_pass)) return "allow_int4: must be passed >= pass";
    return NULL;
}

kvmix_result tier_probe_record_make(const char *model, double budget, int32_t n_trials,
                                    int32_t n_pass, int32_t n_passed, tier_probe_record *out) {
    tier_probe_record r;
    if (!model || !out) return KVMIX_ERR_NULL_POINTER;
    if (!model_ok(model)) return KVMIX_ERR_INVALID_ARGUMENT;
    memset(&r, 0, sizeof r);
    memcpy(r.model, model, strlen(model) + 1);
    r.budget = budget, r.n_trials = n_trials, r.n_pass = n_pass, r.n_passed = n_passed;
    r.allow_int4 = n_passed >= n_pass;
    if (record_problem(&r)) return KVMIX_ERR_INVALID_ARGUMENT;
    *out = r;
    return KVMIX_SUCCESS;
}

char *tier_probe_json(const tier_probe_record *r) {
    if (!r || record_problem(r)) return NULL;
    cJSON *obj = cJSON_CreateObject();
    if (!obj) return NULL;
    cJSON_AddNumberToObject(obj, "version", PROBE_VERSION);
    cJSON_AddStringToObject(obj, "kind", KIND);
    cJSON_AddStringToObject(obj, "model", r->model);
    json_add_exact_number(obj, "budget", r->budget);
    cJSON_AddNumberToObject(obj, "trials", r->n_trials);
    cJSON_AddNumberToObject(obj, "pass", r->n_pass);
    cJSON_AddNumberToObject(obj, "passed", r->n_passed);
    cJSON_AddBoolToObject(obj, "allow_int4", r->allow_int4 != 0);
    char *text = cJSON_PrintUnformatted(obj);
    cJSON_Delete(obj);
    return text;
}

/* An integer field in [lo, hi]. */
static int take_count(const cJSON *item, int32_t lo, int32_t hi, int32_t *out) {
    if (!cJSON_IsNumber(item) || !(item->valuedouble >= lo && item->valuedouble <= hi) ||
        item->valuedouble != floor(item->valuedouble))
        return 0;
    *out = (int32_t)item->valuedouble;
    return 1;
}

/* One member into r; 0 when its type or range is wrong. */
static int take_field(const cJSON *item, int f, tier_probe_record *r) {
    int32_t version = 0;
    switch (f) {
    case 0: return take_count(item, 0, 1 << 30, &version) && version == PROBE_VERSION;
    case 1: return cJSON_IsString(item) && strcmp(item->valuestring, KIND) == 0;
    case 2:
        if (!cJSON_IsString(item) || !model_ok(item->valuestring)) return 0;
        memcpy(r->model, item->valuestring, strlen(item->valuestring) + 1);
        return 1;
    case 3:
        r->budget = cJSON_IsNumber(item) ? item->valuedouble : NAN;
        return r->budget > 0.0 && r->budget <= 1.0;
    case 4: return take_count(item, 1, 1000000, &r->n_trials);
    case 5: return take_count(item, 1, 1000000, &r->n_pass);
    case 6: return take_count(item, 0, 1000000, &r->n_passed);
    default: r->allow_int4 = cJSON_IsTrue(item); return cJSON_IsBool(item);
    }
}

static kvmix_result take_fields(const cJSON *root, tier_probe_record *r, char *err,
                                size_t err_bytes) {
    int seen[N_FIELDS] = {0};
    for (const cJSON *item = root->child; item; item = item->next) {
        int f = 0;
        while (f < N_FIELDS && (!item->string || strcmp(item->string, FIELDS[f]) != 0)) f++;
        if (f == N_FIELDS || seen[f])
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED, "probe field \"%.64s\": %s",
                                 item->string ? item->string : "",
                                 f == N_FIELDS ? "unknown" : "given twice");
        seen[f] = 1;
        if (!take_field(item, f, r))
            return tag_spec_fail(err, err_bytes,
                                 f == 0 && cJSON_IsNumber(item) ? KVMIX_ERR_VERSION
                                                                : KVMIX_ERR_MALFORMED,
                                 "probe field \"%s\": wrong type or value", FIELDS[f]);
    }
    for (int f = 0; f < N_FIELDS; f++)
        if (!seen[f])
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "probe field \"%s\": required", FIELDS[f]);
    const char *problem = record_problem(r);
    if (problem)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED, "probe field %s", problem);
    return KVMIX_SUCCESS;
}

kvmix_result tier_probe_parse(const char *json, size_t json_bytes, tier_probe_record *out,
                              char *err, size_t err_bytes) {
    if (!json || !out) return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "probe: NULL");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, json_bytes, &end, 0);
    tier_probe_record r;
    memset(&r, 0, sizeof r);
    kvmix_result result = KVMIX_SUCCESS;
    int trailing = 0;
    if (root && end >= json && end <= json + json_bytes)
        for (const char *p = end; p < json + json_bytes; p++)
            trailing |= *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r';
    if (!root || !cJSON_IsObject(root) || trailing)
        result = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED, "probe: not one JSON object");
    else
        result = take_fields(root, &r, err, err_bytes);
    cJSON_Delete(root);
    if (result == KVMIX_SUCCESS) *out = r;
    return result;
}
