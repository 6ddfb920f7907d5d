/* tag_spec_json.c - reader and writer of template spec documents; see tag_spec_json.h.
 * It compiles the kvmix implementation for the tag tools (as llama.c does for the runner), unless
 * TAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION is defined: a program that links llama.c too (the
 * calibration tool) builds this file with it. */
#ifndef TAG_SPEC_JSON_NO_KVMIX_IMPLEMENTATION
#define KVMIX_IMPLEMENTATION
#endif
#include "kvmix.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

kvmix_result tag_spec_fail(char *err, size_t err_bytes, kvmix_result r, const char *fmt, ...) {
    if (err != NULL && err_bytes > 0) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(err, err_bytes, fmt, args);
        va_end(args);
    }
    return r;
}

/* The markers in document order, with where each lives in the spec. */
typedef struct marker_field {
    const char *name;
    size_t offset;
} marker_field;

#define MARKER(f)                                                                                  \
    { #f, offsetof(kvmix_tag_spec, f) }
static const marker_field MARKERS[] = {MARKER(message_start),       MARKER(message_end),
                                       MARKER(header_end),          MARKER(channel),
                                       MARKER(recipient),           MARKER(reasoning_open),
                                       MARKER(reasoning_close),     MARKER(tool_call_open),
                                       MARKER(tool_call_close),     MARKER(tool_response_open),
                                       MARKER(tool_response_close), MARKER(vision_open),
                                       MARKER(vision_close),        MARKER(image_pad)};
#undef MARKER
enum { N_MARKERS = sizeof MARKERS / sizeof MARKERS[0], N_REQUIRED_MARKERS = 3 };
/* "recipient" came with version 2: a version 1 document has none, and a document without one is
   written as version 1, so that readers of version 1 still read it. */
enum { F_END = 1, F_RECIPIENT = 4 };

static kvmix_tag_marker *marker_at(kvmix_tag_spec *s, int i) {
    return (kvmix_tag_marker *)(void *)((char *)s + MARKERS[i].offset);
}
static const kvmix_tag_marker *marker_at_const(const kvmix_tag_spec *s, int i) {
    return (const kvmix_tag_marker *)(const void *)((const char *)s + MARKERS[i].offset);
}

/* An array of ids: [id, ...], 1 .. KVMIX_TAG_MAX_IDS integers in [0, 2^31 - 1]. */
static kvmix_result take_seq(const cJSON *item, const char *field, kvmix_tag_seq *out, char *err,
                             size_t err_bytes) {
    int32_t n = 0;
    memset(out, 0, sizeof *out);
    if (!cJSON_IsArray(item))
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"%s\": must be an array of ids", field);
    for (const cJSON *x = item->child; x != NULL; x = x->next) {
        /* the range first: converting a double outside it to an integer is undefined */
        if (!cJSON_IsNumber(x) || !(x->valuedouble >= 0 && x->valuedouble <= 2147483647.0) ||
            x->valuedouble != floor(x->valuedouble))
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "spec field \"%s\": ids must be integers in 0 .. 2147483647",
                                 field);
        if (n == KVMIX_TAG_MAX_IDS)
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "spec field \"%s\": more than %d ids", field, KVMIX_TAG_MAX_IDS);
        out->ids[n++] = (int32_t)x->valuedouble;
    }
    if (n == 0)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"%s\": an empty id sequence", field);
    out->n_ids = n;
    return KVMIX_SUCCESS;
}

/* A marker: [[id, ...], ...], 0 .. KVMIX_TAG_MAX_ALTS sequences. */
static kvmix_result take_marker(const cJSON *item, const char *field, kvmix_tag_marker *out,
                                char *err, size_t err_bytes) {
    int n = 0;
    memset(out, 0, sizeof *out);
    if (!cJSON_IsArray(item))
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"%s\": must be an array of id arrays", field);
    for (const cJSON *x = item->child; x != NULL; x = x->next) {
        if (n == KVMIX_TAG_MAX_ALTS)
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "spec field \"%s\": more than %d sequences", field,
                                 KVMIX_TAG_MAX_ALTS);
        kvmix_result r = take_seq(x, field, &out->alts[n++], err, err_bytes);
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

static kvmix_result take_text(const cJSON *item, const char *field, char *out, size_t out_bytes,
                              size_t min_bytes, char *err, size_t err_bytes) {
    if (!cJSON_IsString(item) || item->valuestring == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"%s\": must be a string", field);
    size_t n = strlen(item->valuestring);
    if (n < min_bytes || n >= out_bytes)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"%s\": %zu to %zu bytes", field, min_bytes,
                             out_bytes - 1);
    memcpy(out, item->valuestring, n + 1);
    return KVMIX_SUCCESS;
}

/* "roles" / "channels" / "role_starts": [{"name": ..., "role": ..., "ids": [...]}, ...], at most
   max entries. */
static kvmix_result take_names(const cJSON *item, const char *field, kvmix_tag_name *out,
                               int32_t max, int32_t *out_n, char *err, size_t err_bytes) {
    int32_t n = 0;
    char where[64];
    if (!cJSON_IsArray(item))
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"%s\": must be an array", field);
    for (const cJSON *x = item->child; x != NULL; x = x->next) {
        bool seen[3] = {false, false, false};
        kvmix_tag_name *e = &out[n];
        if (n == max)
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "spec field \"%s\": more than %d entries", field, (int)max);
        snprintf(where, sizeof where, "%s[%d]", field, (int)n);
        if (!cJSON_IsObject(x))
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "spec field \"%s\": must be an object", where);
        memset(e, 0, sizeof *e);
        for (const cJSON *f = x->child; f != NULL; f = f->next) {
            static const char *const KEYS[3] = {"name", "role", "ids"};
            int k = 0;
            char sub[96];
            while (k < 3 && strcmp(f->string, KEYS[k]) != 0) k++;
            if (k == 3)
                return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                     "spec field \"%s.%.32s\": unknown", where, f->string);
            snprintf(sub, sizeof sub, "%s.%s", where, KEYS[k]);
            if (seen[k])
                return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                     "spec field \"%s\": given twice", sub);
            seen[k] = true;
            kvmix_result r = KVMIX_SUCCESS;
            if (k == 0)
                r = take_text(f, sub, e->text, sizeof e->text, 1, err, err_bytes);
            else if (k == 2)
                r = take_seq(f, sub, &e->seq, err, err_bytes);
            else {
                kvmix_tag_role role;
                if (!cJSON_IsString(f) || f->valuestring == NULL ||
                    kvmix_tag_role_from_name(f->valuestring, &role) != KVMIX_SUCCESS ||
                    role == KVMIX_ROLE_SCAFFOLD)
                    return tag_spec_fail(
                        err, err_bytes, KVMIX_ERR_MALFORMED,
                        "spec field \"%s\": one of \"instruction\", \"user\", "
                        "\"assistant\", \"reasoning\", \"tool_call\", \"observation\"",
                        sub);
                e->role = (int32_t)role;
            }
            if (r != KVMIX_SUCCESS) return r;
        }
        for (int k = 0; k < 3; k++)
            if (!seen[k])
                return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                     "spec field \"%s.%s\": required", where,
                                     k == 0   ? "name"
                                     : k == 1 ? "role"
                                              : "ids");
        n++;
    }
    *out_n = n;
    return KVMIX_SUCCESS;
}

static kvmix_result take_fields(const cJSON *root, tag_spec_doc *d, char *err, size_t err_bytes) {
    enum {
        F_VERSION = N_MARKERS,
        F_NAME,
        F_DESCRIPTION,
        F_ROLES,
        F_CHANNELS,
        F_ROLE_STARTS,
        N_FIELDS
    };
    bool seen[N_FIELDS] = {false};
    int version = 0;
    for (const cJSON *item = root->child; item != NULL; item = item->next) {
        int f = 0;
        const char *key = item->string;
        for (; f < N_MARKERS && strcmp(key, MARKERS[f].name) != 0; f++) {
        }
        if (f == N_MARKERS) {
            if (strcmp(key, "version") == 0)
                f = F_VERSION;
            else if (strcmp(key, "name") == 0)
                f = F_NAME;
            else if (strcmp(key, "description") == 0)
                f = F_DESCRIPTION;
            else if (strcmp(key, "roles") == 0)
                f = F_ROLES;
            else if (strcmp(key, "channels") == 0)
                f = F_CHANNELS;
            else if (strcmp(key, "role_starts") == 0)
                f = F_ROLE_STARTS;
            else
                return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                     "spec field \"%.64s\": unknown", key);
        }
        if (seen[f])
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "spec field \"%s\": given twice", key);
        seen[f] = true;
        kvmix_result r = KVMIX_SUCCESS;
        if (f < N_MARKERS) {
            r = take_marker(item, key, marker_at(&d->spec, f), err, err_bytes);
        } else if (f == F_VERSION) {
            if (!cJSON_IsNumber(item) ||
                !(item->valuedouble >= -2147483648.0 && item->valuedouble <= 2147483647.0) ||
                item->valuedouble != floor(item->valuedouble))
                return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                     "spec field \"version\": must be a 32-bit integer");
            version = (int)item->valuedouble;
            if (version < 1 || version > TAG_SPEC_VERSION)
                return tag_spec_fail(
                    err, err_bytes, KVMIX_ERR_VERSION,
                    "spec field \"version\": %d is not supported (this build reads 1 to %d)",
                    version, TAG_SPEC_VERSION);
        } else if (f == F_NAME) {
            r = take_text(item, key, d->name, sizeof d->name, 1, err, err_bytes);
        } else if (f == F_DESCRIPTION) {
            r = take_text(item, key, d->description, sizeof d->description, 0, err, err_bytes);
        } else if (f == F_ROLES) {
            r = take_names(item, key, d->spec.roles, KVMIX_TAG_MAX_NAMES, &d->spec.n_roles, err,
                           err_bytes);
        } else if (f == F_CHANNELS) {
            r = take_names(item, key, d->spec.channels, KVMIX_TAG_MAX_NAMES, &d->spec.n_channels,
                           err, err_bytes);
        } else {
            r = take_names(item, key, d->spec.role_starts, KVMIX_TAG_MAX_STARTS,
                           &d->spec.n_role_starts, err, err_bytes);
        }
        if (r != KVMIX_SUCCESS) return r;
    }
    if (!seen[F_VERSION])
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"version\": required");
    if (!seen[F_NAME])
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED, "spec field \"name\": required");
    if (seen[F_RECIPIENT] && version < 2)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"recipient\": needs version 2 (the document says %d)",
                             version);
    if (seen[F_ROLE_STARTS] && version < 3)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec field \"role_starts\": needs version 3 (the document says %d)",
                             version);
    for (int f = 0; f < N_REQUIRED_MARKERS; f++) {
        if (!seen[f])
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED, "spec field \"%s\": required",
                                 MARKERS[f].name);
        /* a template of role starts (DeepSeek V3) needs no message start or header end */
        if (marker_at(&d->spec, f)->alts[0].n_ids == 0 &&
            (f == F_END || d->spec.n_role_starts == 0))
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "spec field \"%s\": needs a sequence%s", MARKERS[f].name,
                                 f == F_END ? "" : " (or role_starts)");
    }
    return KVMIX_SUCCESS;
}

kvmix_result tag_spec_parse(const char *json, size_t json_bytes, tag_spec_doc *out, char *err,
                            size_t err_bytes) {
    if (json == NULL || out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "spec: NULL argument");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, json_bytes, &end, 0);
    if (root == NULL) {
        size_t at = end != NULL && end >= json ? (size_t)(end - json) : 0;
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "spec: malformed JSON near byte %zu", at);
    }
    tag_spec_doc *d = (tag_spec_doc *)calloc(1, sizeof *d);
    kvmix_result r = KVMIX_SUCCESS;
    while (end != NULL && (size_t)(end - json) < json_bytes &&
           (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
    if (d == NULL)
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_OUT_OF_MEMORY, "spec: out of memory");
    else if (end == NULL || (size_t)(end - json) != json_bytes)
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED, "spec: bytes after the JSON object");
    else if (!cJSON_IsObject(root))
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                          "spec: the document must be a JSON object");
    else
        r = take_fields(root, d, err, err_bytes);
    kvmix_error why;
    if (r == KVMIX_SUCCESS && (r = kvmix_tag_spec_check(&d->spec, &why)) != KVMIX_SUCCESS)
        tag_spec_fail(err, err_bytes, r, "spec: refused by kvmix_tag_spec_check: %s %s", why.field,
                      why.reason);
    if (r == KVMIX_SUCCESS) *out = *d;
    free(d);
    cJSON_Delete(root);
    return r;
}

char *tag_spec_read_file(const char *path, size_t *n_bytes, kvmix_result *why) {
    FILE *f = fopen(path, "rb");
    *why = KVMIX_ERR_NOT_FOUND;
    if (f == NULL) return NULL;
    size_t cap = 1 << 16, n = 0, got;
    char *buf = (char *)malloc(cap);
    while (buf != NULL && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *bigger = cap < (1u << 24) ? (char *)realloc(buf, cap * 2) : NULL;
            if (bigger == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    fclose(f);
    *why = buf != NULL ? KVMIX_SUCCESS : KVMIX_ERR_OUT_OF_MEMORY;
    *n_bytes = n;
    return buf;
}

kvmix_result tag_spec_load(const char *path, tag_spec_doc *out, char *err, size_t err_bytes) {
    if (path == NULL || out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "spec: NULL argument");
    size_t n = 0;
    kvmix_result why;
    char *buf = tag_spec_read_file(path, &n, &why);
    if (buf == NULL)
        return tag_spec_fail(
            err, err_bytes, why,
            why == KVMIX_ERR_NOT_FOUND ? "spec: cannot open %s" : "spec: %s is too large", path);
    kvmix_result r = tag_spec_parse(buf, n, out, err, err_bytes);
    free(buf);
    return r;
}

/* ---- writer -------------------------------------------------------------------------------- */
typedef struct text {
    char *p;
    size_t n, cap;
    bool failed;
} text;

static void put(text *t, const char *fmt, ...) {
    va_list args;
    if (t->failed) return;
    for (;;) {
        va_start(args, fmt);
        int k = vsnprintf(t->p + t->n, t->cap - t->n, fmt, args);
        va_end(args);
        if (k < 0) {
            t->failed = true;
            return;
        }
        if ((size_t)k < t->cap - t->n) {
            t->n += (size_t)k;
            return;
        }
        size_t cap = (t->cap + (size_t)k) * 2;
        char *p = (char *)realloc(t->p, cap);
        if (p == NULL) {
            t->failed = true;
            return;
        }
        t->p = p;
        t->cap = cap;
    }
}

static void put_string(text *t, const char *s) {
    put(t, "\"");
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            put(t, "\\%c", c);
        else if (c == '\n')
            put(t, "\\n");
        else if (c < 0x20)
            put(t, "\\u%04x", c);
        else
            put(t, "%c", c);
    }
    put(t, "\"");
}

static void put_seq(text *t, const kvmix_tag_seq *q) {
    put(t, "[");
    for (int32_t i = 0; i < q->n_ids; i++) put(t, i ? ", %d" : "%d", (int)q->ids[i]);
    put(t, "]");
}

static void put_names(text *t, const char *field, const kvmix_tag_name *names, int32_t n,
                      bool last) {
    put(t, "  \"%s\": [", field);
    for (int32_t i = 0; i < n; i++) {
        put(t, "\n    {\"name\": ");
        put_string(t, names[i].text);
        put(t, ", \"role\": \"%s\", \"ids\": ", kvmix_tag_role_name((kvmix_tag_role)names[i].role));
        put_seq(t, &names[i].seq);
        put(t, i + 1 < n ? "}," : "}\n  ");
    }
    put(t, last ? "]\n" : "],\n");
}

char *tag_spec_json(const tag_spec_doc *doc) {
    text t = {NULL, 0, 0, false};
    if (doc == NULL) return NULL;
    t.cap = 4096;
    t.p = (char *)malloc(t.cap);
    if (t.p == NULL) return NULL;
    bool recipient = false;
    for (int a = 0; a < KVMIX_TAG_MAX_ALTS; a++)
        if (doc->spec.recipient.alts[a].n_ids > 0) recipient = true;
    bool role_starts = doc->spec.n_role_starts > 0;
    put(&t, "{\n  \"version\": %d,\n  \"name\": ", role_starts ? 3 : recipient ? 2 : 1);
    put_string(&t, doc->name);
    put(&t, ",\n  \"description\": ");
    put_string(&t, doc->description);
    put(&t, ",\n");
    for (int f = 0; f < N_MARKERS; f++) {
        const kvmix_tag_marker *m = marker_at_const(&doc->spec, f);
        int first = 1;
        if (f == F_RECIPIENT && !recipient) continue;
        put(&t, "  \"%s\": [", MARKERS[f].name);
        for (int a = 0; a < KVMIX_TAG_MAX_ALTS; a++)
            if (m->alts[a].n_ids > 0) {
                if (!first) put(&t, ", ");
                put_seq(&t, &m->alts[a]);
                first = 0;
            }
        put(&t, "],\n");
    }
    put_names(&t, "roles", doc->spec.roles, doc->spec.n_roles, false);
    put_names(&t, "channels", doc->spec.channels, doc->spec.n_channels, !role_starts);
    if (role_starts)
        put_names(&t, "role_starts", doc->spec.role_starts, doc->spec.n_role_starts, true);
    put(&t, "}\n");
    if (t.failed) {
        free(t.p);
        return NULL;
    }
    return t.p;
}

static bool seq_equal(const kvmix_tag_seq *a, const kvmix_tag_seq *b) {
    if (a->n_ids != b->n_ids) return false;
    for (int32_t i = 0; i < a->n_ids; i++)
        if (a->ids[i] != b->ids[i]) return false;
    return true;
}

static bool names_equal(const kvmix_tag_name *a, int32_t na, const kvmix_tag_name *b, int32_t nb) {
    if (na != nb) return false;
    for (int32_t i = 0; i < na; i++)
        if (strcmp(a[i].text, b[i].text) != 0 || a[i].role != b[i].role ||
            !seq_equal(&a[i].seq, &b[i].seq))
            return false;
    return true;
}

/* Markers compare as the list of their used sequences, in order. */
static bool marker_equal(const kvmix_tag_marker *a, const kvmix_tag_marker *b) {
    int i = 0, j = 0;
    for (;;) {
        while (i < KVMIX_TAG_MAX_ALTS && a->alts[i].n_ids == 0) i++;
        while (j < KVMIX_TAG_MAX_ALTS && b->alts[j].n_ids == 0) j++;
        if (i == KVMIX_TAG_MAX_ALTS || j == KVMIX_TAG_MAX_ALTS)
            return i == KVMIX_TAG_MAX_ALTS && j == KVMIX_TAG_MAX_ALTS;
        if (!seq_equal(&a->alts[i++], &b->alts[j++])) return false;
    }
}

int tag_spec_equal(const tag_spec_doc *a, const tag_spec_doc *b) {
    if (strcmp(a->name, b->name) != 0 || strcmp(a->description, b->description) != 0) return 0;
    for (int f = 0; f < N_MARKERS; f++)
        if (!marker_equal(marker_at_const(&a->spec, f), marker_at_const(&b->spec, f))) return 0;
    return names_equal(a->spec.roles, a->spec.n_roles, b->spec.roles, b->spec.n_roles) &&
           names_equal(a->spec.channels, a->spec.n_channels, b->spec.channels,
                       b->spec.n_channels) &&
           names_equal(a->spec.role_starts, a->spec.n_role_starts, b->spec.role_starts,
                       b->spec.n_role_starts);
}
