/* tag_allocation.c - see tag_allocation.h. */
#include "tag_allocation.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The index whose name(index) equals text among [0, n), or -1. */
static int name_index(const char *text, int n, const char *(*name)(int)) {
    for (int i = 0; i < n; i++)
        if (strcmp(text, name(i)) == 0) return i;
    return -1;
}

static const char *bucket_name(int i) { return kvmix_tag_bucket_name((kvmix_tag_bucket)i); }
static const char *role_name(int i) { return kvmix_tag_role_name((kvmix_tag_role)i); }
static const char *modality_name(int i) { return kvmix_tag_modality_name((kvmix_tag_modality)i); }
static const char *format_name(int i) { return kvmix_format_name((kvmix_format)i); }

/* A string field of a tag entry, looked up by name; -1 when missing or unknown. */
static int field_index(const cJSON *tag, const char *field, int n, const char *(*name)(int)) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(tag, field);
    return cJSON_IsString(item) ? name_index(item->valuestring, n, name) : -1;
}

/* One entry of "tags" into the table. */
static kvmix_result take_tag(const cJSON *tag, int index, kvmix_tag_precision *table, char *err,
                             size_t err_bytes) {
    static const char *const fields[] = {"bucket", "role", "modality", "key_format",
                                         "value_format"};
    int v[5];
    v[0] = field_index(tag, fields[0], KVMIX_TAG_N_BUCKETS, bucket_name);
    v[1] = field_index(tag, fields[1], KVMIX_TAG_N_ROLES, role_name);
    v[2] = field_index(tag, fields[2], KVMIX_TAG_N_MODALITIES, modality_name);
    v[3] = field_index(tag, fields[3], 7, format_name);
    v[4] = field_index(tag, fields[4], 7, format_name);
    for (int f = 0; f < 5; f++)
        if (v[f] < 0 || (f >= 3 && v[f] == 0))
            return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                                 "allocation: tags[%d].%s is missing or unknown", index, fields[f]);
    table->formats[v[0]][v[1]][v[2]].key_format = (uint8_t)v[3];
    table->formats[v[0]][v[1]][v[2]].value_format = (uint8_t)v[4];
    return KVMIX_SUCCESS;
}

/* One entry's "bits" into prices (its names checked by take_tag first). */
static kvmix_result take_price(const cJSON *tag, int index, tag_prices *prices, char *err,
                               size_t err_bytes) {
    const cJSON *bits = cJSON_GetObjectItemCaseSensitive(tag, "bits");
    if (!cJSON_IsNumber(bits) || !(bits->valuedouble > 0 && bits->valuedouble <= 65536.0))
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "allocation: tags[%d].bits must be a number in (0, 65536]", index);
    prices->bits[field_index(tag, "bucket", KVMIX_TAG_N_BUCKETS, bucket_name)]
                [field_index(tag, "role", KVMIX_TAG_N_ROLES, role_name)]
                [field_index(tag, "modality", KVMIX_TAG_N_MODALITIES, modality_name)] =
        bits->valuedouble;
    return KVMIX_SUCCESS;
}

/* Parses the document into *table (filled with fallback first) and, when prices is not NULL,
   each listed tag's price. */
static kvmix_result parse_tags(const char *json, size_t json_bytes, kvmix_cache_precision fallback,
                               kvmix_tag_precision *out, tag_prices *prices, char *err,
                               size_t err_bytes) {
    if (json == NULL || (out == NULL && prices == NULL))
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "allocation: NULL argument");
    kvmix_tag_precision table;
    tag_prices priced;
    memset(&priced, 0, sizeof priced);
    if (kvmix_tag_precision_fill(&table, fallback) != KVMIX_SUCCESS)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_UNKNOWN_FORMAT,
                             "allocation: the fallback formats are unknown");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, json_bytes, &end, 0);
    const cJSON *version = cJSON_GetObjectItemCaseSensitive(root, "version");
    const cJSON *kind = cJSON_GetObjectItemCaseSensitive(root, "kind");
    const cJSON *tags = cJSON_GetObjectItemCaseSensitive(root, "tags");
    kvmix_result r = KVMIX_SUCCESS;
    if (!cJSON_IsObject(root) || !cJSON_IsNumber(version) || !cJSON_IsString(kind) ||
        strcmp(kind->valuestring, "kvmix-allocation") != 0 || !cJSON_IsArray(tags))
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                          "allocation: needs {\"version\", \"kind\": \"kvmix-allocation\", "
                          "\"tags\": [...]}");
    else if (version->valuedouble != 1.0)
        r = tag_spec_fail(err, err_bytes, KVMIX_ERR_VERSION, "allocation: version %g, reads 1",
                          version->valuedouble);
    int index = 0;
    for (const cJSON *tag = r == KVMIX_SUCCESS ? tags->child : NULL; tag && r == KVMIX_SUCCESS;
         tag = tag->next) {
        r = take_tag(tag, index, &table, err, err_bytes);
        if (r == KVMIX_SUCCESS && prices != NULL)
            r = take_price(tag, index, &priced, err, err_bytes);
        index++;
    }
    cJSON_Delete(root);
    if (r == KVMIX_SUCCESS && out != NULL) *out = table;
    if (r == KVMIX_SUCCESS && prices != NULL) *prices = priced;
    return r;
}

kvmix_result tag_allocation_parse(const char *json, size_t json_bytes,
                                  kvmix_cache_precision fallback, kvmix_tag_precision *out,
                                  char *err, size_t err_bytes) {
    if (out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "allocation: NULL argument");
    return parse_tags(json, json_bytes, fallback, out, NULL, err, err_bytes);
}

kvmix_result tag_allocation_prices_parse(const char *json, size_t json_bytes, tag_prices *out,
                                         char *err, size_t err_bytes) {
    kvmix_cache_precision any = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16};
    if (out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "allocation: NULL argument");
    return parse_tags(json, json_bytes, any, NULL, out, err, err_bytes);
}

/* Reads the file at path and parses it (out or prices may be NULL, not both). */
static kvmix_result load_tags(const char *path, kvmix_cache_precision fallback,
                              kvmix_tag_precision *out, tag_prices *prices, char *err,
                              size_t err_bytes) {
    if (path == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "allocation: NULL path");
    size_t n = 0;
    kvmix_result why;
    char *text = tag_spec_read_file(path, &n, &why);
    if (text == NULL)
        return tag_spec_fail(err, err_bytes, why,
                             why == KVMIX_ERR_NOT_FOUND ? "cannot read %s" : "%s is too large",
                             path);
    kvmix_result r = parse_tags(text, n, fallback, out, prices, err, err_bytes);
    free(text);
    return r;
}

kvmix_result tag_allocation_load(const char *path, kvmix_cache_precision fallback,
                                 kvmix_tag_precision *out, char *err, size_t err_bytes) {
    if (out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "allocation: NULL argument");
    return load_tags(path, fallback, out, NULL, err, err_bytes);
}

kvmix_result tag_allocation_prices_load(const char *path, tag_prices *out, char *err,
                                        size_t err_bytes) {
    kvmix_cache_precision any = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16};
    if (out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "allocation: NULL argument");
    return load_tags(path, any, NULL, out, err, err_bytes);
}
