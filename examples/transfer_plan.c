/* transfer_plan.c - tiers of a transfer and the round trip of its rows (transfer_plan.h). */
#include "transfer_plan.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const MODE_NAMES[] = {NULL,   "tiered", "norms", "int8",
                                         "int4", "random", "sinks", "ends"};
enum { N_MODES = sizeof MODE_NAMES / sizeof MODE_NAMES[0] };

const char *transfer_mode_name(int32_t mode) {
    return mode > 0 && mode < N_MODES ? MODE_NAMES[mode] : NULL;
}

static kvmix_result fail(char *err, size_t err_bytes, kvmix_result result, const char *why) {
    if (err && err_bytes > 0) snprintf(err, err_bytes, "%s", why);
    return result;
}

kvmix_result transfer_parse(const char *text, transfer_setup *out, char *err, size_t err_bytes) {
    char name[16];
    double budget = 0.0, lambda = 0.0;
    int n = 0, used = 0;
    if (!text || !out) return fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "NULL argument");
    n = sscanf(text, "%15[a-z0-9]:%lf%n:%lf%n", name, &budget, &used, &lambda, &used);
    if (n < 2 || text[used] != '\0')
        return fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT,
                    "a transfer is MODE:BUDGET[:LAMBDA], e.g. tiered:0.46:0.005");
    for (int32_t mode = 1; mode < N_MODES; mode++) {
        if (strcmp(name, MODE_NAMES[mode]) != 0) continue;
        if (!(budget > 0.0 && budget <= 1.0))
            return fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT, "the budget is in (0, 1]");
        if (!(lambda >= 0.0 && lambda < INFINITY))
            return fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT, "lambda is finite, >= 0");
        if (n == 3 && mode != TRANSFER_TIERED && mode != TRANSFER_NORMS)
            return fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT,
                        "only tiered and norms take a lambda");
        out->mode = mode, out->budget = budget, out->lambda = lambda;
        return KVMIX_SUCCESS;
    }
    return fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT,
                "modes: tiered, norms, int8, int4, random, sinks, ends");
}

/* The key/value-norm statistic over every layer: the root of the layers' squared norms. */
static kvmix_result norms_over_layers(const float *keys, const float *values, int32_t n_layers,
                                      int32_t n_tokens, int32_t row_floats, float *stat,
                                      float *layer_norms) {
    size_t layer_floats = (size_t)n_tokens * (size_t)row_floats;
    memset(stat, 0, (size_t)n_tokens * sizeof *stat);
    for (int32_t l = 0; l < n_layers; l++) {
        kvmix_result r = kvmix_tier_norms(keys + l * layer_floats, values + l * layer_floats,
                                          n_tokens, row_floats, layer_norms);
        if (r != KVMIX_SUCCESS) return r;
        for (int32_t j = 0; j < n_tokens; j++) stat[j] += layer_norms[j] * layer_norms[j];
    }
    for (int32_t j = 0; j < n_tokens; j++) stat[j] = sqrtf(stat[j]);
    return KVMIX_SUCCESS;
}

/* Importance a random draw: splitmix64 of the seed and the token. */
static void random_importance(uint64_t seed, int32_t n_tokens, float *importance) {
    for (int32_t j = 0; j < n_tokens; j++) {
        uint64_t z = seed + 0x9e3779b97f4a7c15ull * (uint64_t)(j + 1);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        importance[j] = (float)((z ^ (z >> 31)) >> 40) / 16777216.0f;
    }
}

/* INT8, INT4, ENDS: tiers without kvmix_tier_choose. */
static void fixed_tiers(const transfer_setup *s, int32_t n_tokens, const double cost[3],
                        uint8_t *tiers, kvmix_tier_plan *plan) {
    memset(plan, 0, sizeof *plan);
    if (s->mode != TRANSFER_ENDS) {
        uint8_t tier = s->mode == TRANSFER_INT8 ? KVMIX_FORMAT_INT8 : KVMIX_FORMAT_INT4;
        memset(tiers, tier, (size_t)n_tokens);
        *(tier == KVMIX_FORMAT_INT8 ? &plan->n_int8 : &plan->n_int4) = n_tokens;
        plan->cost = cost[tier == KVMIX_FORMAT_INT8 ? 1 : 2];
        return;
    }
    int32_t keep = (int32_t)floor(s->budget * n_tokens + 1e-9);
    int32_t sinks = s->n_sink < keep ? s->n_sink : keep;
    for (int32_t j = 0; j < n_tokens; j++)
        tiers[j] =
            j < sinks || j >= n_tokens - (keep - sinks) ? KVMIX_FORMAT_FP16 : KVMIX_PAYLOAD_NO_ROW;
    plan->n_fp16 = keep > n_tokens ? n_tokens : keep;
    plan->n_dropped = n_tokens - plan->n_fp16;
    plan->cost = n_tokens > 0 ? (double)plan->n_fp16 / n_tokens : 0.0;
}

kvmix_result transfer_choose(const transfer_setup *s, const float *attention, const float *keys,
                             const float *values, int32_t n_layers, int32_t n_tokens,
                             int32_t n_kv_heads, int32_t head_dim, uint8_t *tiers,
                             kvmix_tier_plan *out_plan, char *err, size_t err_bytes) {
    double cost[3];
    if (!s || !tiers || !out_plan || (s->mode == TRANSFER_NORMS && (!keys || !values)))
        return fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "NULL argument");
    if (s->mode == TRANSFER_TIERED && !attention)
        return fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "tiered needs the attention");
    if (!transfer_mode_name(s->mode) || n_layers < 1 || n_tokens < 0 || n_kv_heads < 1 ||
        s->n_sink < 0 || s->n_sink > n_tokens)
        return fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT, "bad mode, counts or sinks");
    kvmix_result r = kvmix_tier_costs(head_dim, s->group_size, cost);
    if (r != KVMIX_SUCCESS) return fail(err, err_bytes, r, "bad head_dim or group_size");
    if (s->mode == TRANSFER_INT8 || s->mode == TRANSFER_INT4 || s->mode == TRANSFER_ENDS) {
        fixed_tiers(s, n_tokens, cost, tiers, out_plan);
        return KVMIX_SUCCESS;
    }
    float *importance = malloc((size_t)(n_tokens > 0 ? 2 * n_tokens : 1) * sizeof *importance);
    if (!importance) return fail(err, err_bytes, KVMIX_ERR_OUT_OF_MEMORY, "out of memory");
    float *stat = importance + n_tokens;
    if (s->mode == TRANSFER_TIERED)
        r = kvmix_tier_importance(attention, n_tokens, s->lambda, importance);
    else if (s->mode == TRANSFER_NORMS) {
        r = norms_over_layers(keys, values, n_layers, n_tokens, n_kv_heads * head_dim, stat,
                              importance);
        if (r == KVMIX_SUCCESS) r = kvmix_tier_importance(stat, n_tokens, s->lambda, importance);
    } else
        random_importance(s->seed, n_tokens, importance);
    if (r == KVMIX_SUCCESS) {
        kvmix_tier_desc d = {n_tokens,
                             head_dim,
                             s->group_size,
                             s->mode == TRANSFER_RANDOM ? 0 : s->n_sink,
                             s->budget,
                             s->allow_int4,
                             0};
        r = kvmix_tier_choose(&d, importance, tiers, out_plan, NULL);
    }
    free(importance);
    return r == KVMIX_SUCCESS ? r : fail(err, err_bytes, r, kvmix_result_string(r));
}

/* One layer's run of tokens [first, first + n) through a ROWS payload and back. */
static kvmix_result round_trip_run(const uint8_t *tiers, int32_t group_size, float *keys,
                                   float *values, int32_t layer, int32_t first, int32_t n,
                                   int32_t n_kv_heads, int32_t head_dim, size_t *bytes) {
    kvmix_payload_desc d = {
        KVMIX_PAYLOAD_ROWS,  head_dim, n_kv_heads, group_size, layer, 1, n, first,
        (uint64_t)layer + 1, 0};
    kvmix_payload_info info;
    kvmix_result r = kvmix_payload_describe(&d, tiers + first, &info, NULL);
    if (r != KVMIX_SUCCESS) return r;
    void *payload = malloc(info.total_bytes);
    if (!payload) return KVMIX_ERR_OUT_OF_MEMORY;
    r = kvmix_payload_pack(&d, tiers + first, keys, values, payload, info.total_bytes, NULL, NULL);
    if (r == KVMIX_SUCCESS)
        r = kvmix_payload_unpack(payload, info.total_bytes, layer, keys, values, NULL);
    free(payload);
    *bytes += info.total_bytes;
    return r;
}

/* Bytes of n_tokens rows of every layer as all-FP16 payloads. */
static kvmix_result fp16_payload_bytes(int32_t group_size, int32_t n_layers, int32_t n_tokens,
                                       int32_t n_kv_heads, int32_t head_dim, size_t *out) {
    kvmix_payload_desc d = {KVMIX_PAYLOAD_ROWS, head_dim, n_kv_heads, group_size, 0, 1, 0, 0, 1, 0};
    kvmix_payload_info info;
    uint8_t *fp16 = malloc((size_t)(n_tokens > 0 ? n_tokens : 1));
    if (!fp16) return KVMIX_ERR_OUT_OF_MEMORY;
    memset(fp16, KVMIX_FORMAT_FP16, (size_t)(n_tokens > 0 ? n_tokens : 1));
    d.n_tokens = n_tokens;
    kvmix_result r = kvmix_payload_describe(&d, fp16, &info, NULL);
    free(fp16);
    if (r == KVMIX_SUCCESS) *out = info.total_bytes * (size_t)n_layers;
    return r;
}

kvmix_result transfer_round_trip(const uint8_t *tiers, int32_t group_size, float *keys,
                                 float *values, int32_t n_layers, int32_t n_tokens,
                                 int32_t n_kv_heads, int32_t head_dim, size_t *out_bytes,
                                 size_t *out_fp16_bytes, char *err, size_t err_bytes) {
    size_t row = (size_t)n_kv_heads * (size_t)head_dim, bytes = 0;
    kvmix_result r = KVMIX_SUCCESS;
    if (!tiers || !keys || !values || !out_bytes)
        return fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "NULL argument");
    if (n_layers < 1 || n_tokens < 0 || n_kv_heads < 1)
        return fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT, "bad counts");
    for (int32_t l = 0; l < n_layers && r == KVMIX_SUCCESS; l++) {
        float *k = keys + (size_t)l * n_tokens * row, *v = values + (size_t)l * n_tokens * row;
        for (int32_t j = 0; j < n_tokens && r == KVMIX_SUCCESS;) {
            int32_t end = j;
            if (tiers[j] == KVMIX_PAYLOAD_NO_ROW) {
                memset(k + j * row, 0, row * sizeof *k);
                memset(v + j * row, 0, row * sizeof *v);
                j++;
                continue;
            }
            while (end < n_tokens && tiers[end] != KVMIX_PAYLOAD_NO_ROW) end++;
            r = round_trip_run(tiers, group_size, k + j * row, v + j * row, l, j, end - j,
                               n_kv_heads, head_dim, &bytes);
            j = end;
        }
    }
    if (r == KVMIX_SUCCESS && out_fp16_bytes)
        r = fp16_payload_bytes(group_size, n_layers, n_tokens, n_kv_heads, head_dim,
                               out_fp16_bytes);
    if (r != KVMIX_SUCCESS) return fail(err, err_bytes, r, kvmix_result_string(r));
    *out_bytes = bytes;
    return KVMIX_SUCCESS;
}
