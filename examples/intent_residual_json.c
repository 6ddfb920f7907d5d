/* intent_residual_json.c - reader and writer of the intent residual's weight documents; see
 * intent_residual_json.h. */
#include "intent_residual_json.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { F = KVMIX_INTENT_RESIDUAL_N_FEATURES };

/* The fields, in the order intent_residual_json writes them. */
static const char *const FIELDS[] = {"version", "description", "features", "hidden", "w1",
                                     "b1",      "w2",          "b2",       "alpha",  "alpha_max"};
enum {
    F_VERSION,
    F_DESCRIPTION,
    F_FEATURES,
    F_HIDDEN,
    F_W1,
    F_B1,
    F_W2,
    F_B2,
    F_ALPHA,
    F_ALPHA_MAX,
    N_FIELDS
};

/* A number within the float range, rounded to the nearest float. */
static kvmix_result take_float(const cJSON *item, const char *field, float *out, char *err,
                               size_t err_bytes) {
    /* the range first: converting a double beyond it to float is undefined */
    if (!cJSON_IsNumber(item) || !(fabs(item->valuedouble) <= FLT_MAX))
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "residual field \"%s\": must be a finite number within the float "
                             "range",
                             field);
    *out = (float)item->valuedouble;
    return KVMIX_SUCCESS;
}

/* An array of exactly n numbers. */
static kvmix_result take_floats(const cJSON *item, const char *field, int32_t n, float *out,
                                char *err, size_t err_bytes) {
    int32_t i = 0;
    if (!cJSON_IsArray(item) || cJSON_GetArraySize(item) != n)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "residual field \"%s\": must be an array of %d numbers", field,
                             (int)n);
    for (const cJSON *x = item->child; x != NULL; x = x->next, i++) {
        char where[48];
        snprintf(where, sizeof where, "%s[%d]", field, (int)i);
        kvmix_result r = take_float(x, where, &out[i], err, err_bytes);
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

/* An integer in [lo, hi]. */
static kvmix_result take_int(const cJSON *item, const char *field, int32_t lo, int32_t hi,
                             int32_t *out, char *err, size_t err_bytes) {
    if (!cJSON_IsNumber(item) || !(item->valuedouble >= lo && item->valuedouble <= hi) ||
        item->valuedouble != floor(item->valuedouble))
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "residual field \"%s\": must be an integer in %d .. %d", field,
                             (int)lo, (int)hi);
    *out = (int32_t)item->valuedouble;
    return KVMIX_SUCCESS;
}

/* "features": this build's feature names, all of them, in order. */
static kvmix_result take_features(const cJSON *item, char *err, size_t err_bytes) {
    int32_t i = 0;
    if (!cJSON_IsArray(item) || cJSON_GetArraySize(item) != F)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "residual field \"features\": must be an array of the %d feature "
                             "names this build computes, in order",
                             F);
    for (const cJSON *x = item->child; x != NULL; x = x->next, i++) {
        const char *want = kvmix_intent_residual_feature_name(i);
        if (!cJSON_IsString(x) || x->valuestring == NULL || strcmp(x->valuestring, want) != 0)
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "residual field \"features[%d]\": must be \"%s\"", (int)i, want);
    }
    return KVMIX_SUCCESS;
}

/* The members of root by field; unknown, repeated and missing required ones refused. */
static kvmix_result take_items(const cJSON *root, const cJSON *items[N_FIELDS], char *err,
                               size_t err_bytes) {
    for (const cJSON *item = root->child; item != NULL; item = item->next) {
        int f = 0;
        while (f < N_FIELDS && (item->string == NULL || strcmp(item->string, FIELDS[f]) != 0)) f++;
        if (f == N_FIELDS || items[f] != NULL)
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "residual field \"%.64s\": %s",
                                 item->string != NULL ? item->string : "",
                                 f == N_FIELDS ? "unknown" : "given twice");
        items[f] = item;
    }
    for (int f = 0; f < N_FIELDS; f++)
        if (items[f] == NULL && f != F_DESCRIPTION)
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "residual field \"%s\": required", FIELDS[f]);
    return KVMIX_SUCCESS;
}

static kvmix_result take_version(const cJSON *item, char *err, size_t err_bytes) {
    int32_t version = 0;
    kvmix_result r = take_int(item, "version", INT32_MIN, INT32_MAX, &version, err, err_bytes);
    if (r == KVMIX_SUCCESS && version != INTENT_RESIDUAL_VERSION)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_VERSION,
                             "residual field \"version\": %d is not supported (this build reads "
                             "%d)",
                             (int)version, INTENT_RESIDUAL_VERSION);
    return r;
}

static kvmix_result take_description(const cJSON *item, char *out, size_t out_bytes, char *err,
                                     size_t err_bytes) {
    if (item == NULL) return KVMIX_SUCCESS;
    if (!cJSON_IsString(item) || item->valuestring == NULL ||
        strlen(item->valuestring) >= out_bytes)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "residual field \"description\": must be a string of 0 to %zu bytes",
                             out_bytes - 1);
    memcpy(out, item->valuestring, strlen(item->valuestring) + 1);
    return KVMIX_SUCCESS;
}

/* "w1": hidden rows of F numbers into w1. */
static kvmix_result take_w1(const cJSON *item, int32_t hidden, float *w1, char *err,
                            size_t err_bytes) {
    int32_t j = 0;
    if (!cJSON_IsArray(item) || cJSON_GetArraySize(item) != hidden)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "residual field \"w1\": must be an array of hidden (%d) rows",
                             (int)hidden);
    for (const cJSON *row = item->child; row != NULL; row = row->next, j++) {
        char where[32];
        snprintf(where, sizeof where, "w1[%d]", (int)j);
        kvmix_result r = take_floats(row, where, F, w1 + (size_t)j * F, err, err_bytes);
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

/* The doc from its members; d->params is allocated here (freed by the caller on failure). */
static kvmix_result take_doc(const cJSON *const items[N_FIELDS], intent_residual_doc *d, char *err,
                             size_t err_bytes) {
    kvmix_intent_residual *w = &d->weights;
    int32_t hidden = 0;
    kvmix_result r;
    if ((r = take_version(items[F_VERSION], err, err_bytes)) != KVMIX_SUCCESS ||
        (r = take_description(items[F_DESCRIPTION], d->description, sizeof d->description, err,
                              err_bytes)) != KVMIX_SUCCESS ||
        (r = take_features(items[F_FEATURES], err, err_bytes)) != KVMIX_SUCCESS ||
        (r = take_int(items[F_HIDDEN], "hidden", 1, KVMIX_INTENT_RESIDUAL_MAX_HIDDEN, &hidden, err,
                      err_bytes)) != KVMIX_SUCCESS)
        return r;
    d->params = (float *)malloc((size_t)hidden * (F + 2) * sizeof(float));
    if (d->params == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_OUT_OF_MEMORY, "residual: out of memory");
    w->n_features = F;
    w->hidden = hidden;
    w->w1 = d->params;
    w->b1 = d->params + (size_t)hidden * F;
    w->w2 = w->b1 + hidden;
    if ((r = take_w1(items[F_W1], hidden, d->params, err, err_bytes)) != KVMIX_SUCCESS ||
        (r = take_floats(items[F_B1], "b1", hidden, d->params + (size_t)hidden * F, err,
                         err_bytes)) != KVMIX_SUCCESS ||
        (r = take_floats(items[F_W2], "w2", hidden, d->params + (size_t)hidden * (F + 1), err,
                         err_bytes)) != KVMIX_SUCCESS ||
        (r = take_float(items[F_B2], "b2", &w->b2, err, err_bytes)) != KVMIX_SUCCESS ||
        (r = take_float(items[F_ALPHA], "alpha", &w->alpha, err, err_bytes)) != KVMIX_SUCCESS ||
        (r = take_float(items[F_ALPHA_MAX], "alpha_max", &w->alpha_max, err, err_bytes)) !=
            KVMIX_SUCCESS)
        return r;
    if (w->alpha_max < 0.0f)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "residual field \"alpha_max\": must be at least 0");
    kvmix_error why;
    if ((r = kvmix_intent_residual_check(w, &why)) != KVMIX_SUCCESS)
        return tag_spec_fail(err, err_bytes, r,
                             "residual: refused by kvmix_intent_residual_check: %s %s", why.field,
                             why.reason);
    return KVMIX_SUCCESS;
}

kvmix_result intent_residual_parse(const char *json, size_t json_bytes, intent_residual_doc *out,
                                   char *err, size_t err_bytes) {
    if (json == NULL || out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "residual: NULL argument");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, json_bytes, &end, 0);
    const cJSON *items[N_FIELDS] = {NULL};
    intent_residual_doc d;
    kvmix_result r;
    int trailing = 0;
    memset(&d, 0, sizeof d);
    if (root != NULL && end >= json && end <= json + json_bytes)
        for (const char *p = end; p < json + json_bytes; p++)
            trailing |= *p != ' ' && *p != '\t' && *p != '\n' && *p != '\r';
    if (root == NULL)
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                          "residual: malformed JSON near byte %zu",
                          end != NULL && end >= json ? (size_t)(end - json) : (size_t)0);
    else if (trailing)
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                          "residual: bytes after the JSON object");
    else if (!cJSON_IsObject(root))
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                          "residual: the document must be a JSON object");
    else if ((r = take_items(root, items, err, err_bytes)) == KVMIX_SUCCESS)
        r = take_doc(items, &d, err, err_bytes);
    cJSON_Delete(root);
    if (r == KVMIX_SUCCESS)
        *out = d;
    else
        free(d.params);
    return r;
}

kvmix_result intent_residual_load(const char *path, intent_residual_doc *out, char *err,
                                  size_t err_bytes) {
    if (path == NULL || out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "residual: NULL argument");
    size_t n = 0;
    kvmix_result why;
    char *buf = tag_spec_read_file(path, &n, &why);
    if (buf == NULL)
        return tag_spec_fail(err, err_bytes, why,
                             why == KVMIX_ERR_NOT_FOUND ? "residual: cannot open %s"
                                                        : "residual: %s is too large",
                             path);
    kvmix_result r = intent_residual_parse(buf, n, out, err, err_bytes);
    free(buf);
    return r;
}

void intent_residual_free(intent_residual_doc *doc) {
    if (doc == NULL) return;
    free(doc->params);
    memset(doc, 0, sizeof *doc);
}

/* ---- writer -------------------------------------------------------------------------------- */

/* A text of known bound: every put fits (the bound is computed first); failed on a surprise. */
typedef struct text {
    char *p;
    size_t n, cap;
    bool failed;
} text;

static void put(text *t, const char *s) {
    size_t k = strlen(s);
    if (t->failed || k >= t->cap - t->n) {
        t->failed = true;
        return;
    }
    memcpy(t->p + t->n, s, k + 1);
    t->n += k;
}

/* The shortest of 6 to 9 significant digits that reads back to v, else 17 (exact as a double,
   which is within the float range: FLT_MAX's 9 digits read back beyond it). */
static void put_float(text *t, float v) {
    char s[40];
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(s, sizeof s, "%.*g", digits, (double)v);
        double back = strtod(s, NULL);
        if (fabs(back) <= FLT_MAX && (float)back == v) {
            put(t, s);
            return;
        }
    }
    snprintf(s, sizeof s, "%.17g", (double)v);
    put(t, s);
}

static void put_floats(text *t, const float *x, int32_t n) {
    put(t, "[");
    for (int32_t i = 0; i < n; i++) {
        if (i > 0) put(t, ", ");
        put_float(t, x[i]);
    }
    put(t, "]");
}

static void put_string(text *t, const char *s) {
    char c[8];
    put(t, "\"");
    for (; *s; s++) {
        unsigned char u = (unsigned char)*s;
        if (u == '"' || u == '\\')
            snprintf(c, sizeof c, "\\%c", u);
        else if (u < 0x20)
            snprintf(c, sizeof c, "\\u%04x", u);
        else
            c[0] = (char)u, c[1] = 0;
        put(t, c);
    }
    put(t, "\"");
}

char *intent_residual_json(const kvmix_intent_residual *w, const char *description) {
    if (description == NULL) description = "";
    if (kvmix_intent_residual_check(w, NULL) != KVMIX_SUCCESS || strlen(description) >= 256)
        return NULL;
    size_t numbers = (size_t)w->hidden * (F + 2) + 3;
    text t = {NULL, 0, numbers * 32 + strlen(description) * 6 + (size_t)F * 32 + 512, false};
    t.p = (char *)malloc(t.cap);
    if (t.p == NULL) return NULL;
    t.p[0] = 0;
    char line[64];
    snprintf(line, sizeof line,
             "{\n  \"version\": %d,\n  \"description\": ", INTENT_RESIDUAL_VERSION);
    put(&t, line);
    put_string(&t, description);
    put(&t, ",\n  \"features\": [");
    for (int32_t k = 0; k < F; k++) {
        if (k > 0) put(&t, ", ");
        put_string(&t, kvmix_intent_residual_feature_name(k));
    }
    snprintf(line, sizeof line, "],\n  \"hidden\": %d,\n  \"w1\": [", (int)w->hidden);
    put(&t, line);
    for (int32_t j = 0; j < w->hidden; j++) {
        put(&t, j > 0 ? ",\n    " : "\n    ");
        put_floats(&t, w->w1 + (size_t)j * F, F);
    }
    put(&t, "],\n  \"b1\": ");
    put_floats(&t, w->b1, w->hidden);
    put(&t, ",\n  \"w2\": ");
    put_floats(&t, w->w2, w->hidden);
    put(&t, ",\n  \"b2\": ");
    put_float(&t, w->b2);
    put(&t, ",\n  \"alpha\": ");
    put_float(&t, w->alpha);
    put(&t, ",\n  \"alpha_max\": ");
    put_float(&t, w->alpha_max);
    put(&t, "\n}\n");
    if (t.failed) {
        free(t.p);
        return NULL;
    }
    return t.p;
}

static bool same_floats(const float *a, const float *b, size_t n) {
    return memcmp(a, b, n * sizeof(float)) == 0;
}

int intent_residual_equal(const intent_residual_doc *a, const intent_residual_doc *b) {
    const kvmix_intent_residual *x = &a->weights, *y = &b->weights;
    if (strcmp(a->description, b->description) != 0 || x->n_features != y->n_features ||
        x->hidden != y->hidden || x->n_features != F)
        return 0;
    size_t h = (size_t)x->hidden;
    return same_floats(x->w1, y->w1, h * F) && same_floats(x->b1, y->b1, h) &&
           same_floats(x->w2, y->w2, h) && same_floats(&x->b2, &y->b2, 1) &&
           same_floats(&x->alpha, &y->alpha, 1) && same_floats(&x->alpha_max, &y->alpha_max, 1);
}
