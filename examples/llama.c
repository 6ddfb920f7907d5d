/* llama.c - see llama.h. Sections: >>errors >>safetensors >>config >>tokenizer >>load >>pool
 * >>forward >>fp32cache >>capture >>score */
#define _POSIX_C_SOURCE 200809L /* sched_yield */
/* The one implementation of kvmix.h in the runner's programs. */
#define KVMIX_IMPLEMENTATION
#include "../kvmix.h"
#include "llama.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Rows per matmul panel: 16 accumulators fit vector registers and keep each row's sum in order;
 * panel_times() spells out this many. */
enum { LLAMA_PANEL_ROWS = 16 };

/* A header bigger than this is refused before parsing (real ones are a few kilobytes). */
#define LLAMA_MAX_HEADER_BYTES ((uint64_t)100 << 20)

/* Largest config dimension accepted; keeps every size product far from overflow. */
enum { LLAMA_MAX_CONFIG_DIM = 1 << 20 };

// >>errors

const char *llama_result_string(llama_result result) {
    switch (result) {
    case LLAMA_OK: return "ok";
    case LLAMA_ERR_IO: return "i/o error";
    case LLAMA_ERR_FORMAT: return "malformed input";
    case LLAMA_ERR_UNSUPPORTED: return "unsupported input";
    case LLAMA_ERR_MEMORY: return "out of memory";
    case LLAMA_ERR_ARGUMENT: return "invalid argument";
    case LLAMA_ERR_CAPACITY: return "capacity exceeded";
    }
    return "unknown result";
}

llama_result llama_fail(char *err, size_t err_bytes, llama_result result, const char *fmt, ...) {
    if (err != NULL && err_bytes > 0) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(err, err_bytes, fmt, args);
        va_end(args);
    }
    return result;
}

static bool mul_fits(uint64_t a, uint64_t b, uint64_t limit, uint64_t *product) {
    if (a != 0 && b > limit / a) return false;
    *product = a * b;
    return true;
}

static uint32_t get_u32_le(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64_le(const uint8_t *p) {
    return (uint64_t)get_u32_le(p) | (uint64_t)get_u32_le(p + 4) << 32;
}

static llama_result read_whole_file(const char *path, uint8_t **bytes, size_t *n_bytes, char *err,
                                    size_t err_bytes) {
    *bytes = NULL;
    *n_bytes = 0;
    FILE *f = fopen(path, "rb");
    if (f == NULL) return llama_fail(err, err_bytes, LLAMA_ERR_IO, "cannot open %s", path);
    long size = -1;
    if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (size < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return llama_fail(err, err_bytes, LLAMA_ERR_IO, "cannot seek in %s", path);
    }
    uint8_t *buf = malloc((size_t)size + 1); /* +1: room for a terminating NUL */
    if (buf == NULL) {
        fclose(f);
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "cannot allocate %ld bytes for %s",
                          size, path);
    }
    size_t got = fread(buf, 1, (size_t)size, f);
    fclose(f);
    if (got != (size_t)size) {
        free(buf);
        return llama_fail(err, err_bytes, LLAMA_ERR_IO, "short read on %s", path);
    }
    buf[size] = 0;
    *bytes = buf;
    *n_bytes = (size_t)size;
    return LLAMA_OK;
}

char *llama_read_text(const char *path, size_t *n_bytes) {
    uint8_t *bytes;
    size_t n;
    if (path == NULL || n_bytes == NULL || read_whole_file(path, &bytes, &n, NULL, 0) != LLAMA_OK)
        return NULL;
    *n_bytes = n;
    return (char *)bytes;
}

// >>safetensors

/* A JSON number that is a whole number in [0, 2^53], the range where doubles are exact. */
static bool json_to_size(const cJSON *item, uint64_t *value) {
    if (!cJSON_IsNumber(item)) return false;
    double d = item->valuedouble;
    if (!(d >= 0.0 && d <= 9007199254740992.0) || d != floor(d)) return false;
    *value = (uint64_t)d;
    return true;
}

static llama_result parse_dtype(const cJSON *tensor, const char *name, llama_dtype *dtype,
                                size_t *elem_bytes, char *err, size_t err_bytes) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(tensor, "dtype");
    if (!cJSON_IsString(item))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "tensor %s has no dtype string", name);
    const char *s = item->valuestring;
    if (strcmp(s, "F32") == 0) {
        *dtype = LLAMA_DTYPE_F32;
        *elem_bytes = 4;
    } else if (strcmp(s, "F16") == 0) {
        *dtype = LLAMA_DTYPE_F16;
        *elem_bytes = 2;
    } else if (strcmp(s, "BF16") == 0) {
        *dtype = LLAMA_DTYPE_BF16;
        *elem_bytes = 2;
    } else {
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "tensor %s has dtype %.16s; only F32, F16 and BF16 are read", name, s);
    }
    return LLAMA_OK;
}

static llama_result parse_shape(const cJSON *tensor, llama_tensor_info *info, uint64_t *n_elems,
                                char *err, size_t err_bytes) {
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(tensor, "shape");
    if (!cJSON_IsArray(shape))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "tensor %s has no shape array",
                          info->name);
    int n_dims = cJSON_GetArraySize(shape);
    if (n_dims > LLAMA_MAX_DIMS)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "tensor %s has %d dims (max %d)",
                          info->name, n_dims, LLAMA_MAX_DIMS);
    uint64_t count = 1;
    int d = 0;
    for (const cJSON *dim = shape->child; dim != NULL; dim = dim->next, d++) {
        uint64_t extent;
        if (!json_to_size(dim, &extent) || !mul_fits(count, extent, SIZE_MAX / 8, &count))
            return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "tensor %s has an invalid shape",
                              info->name);
        info->shape[d] = (int64_t)extent;
    }
    info->n_dims = n_dims;
    *n_elems = count;
    return LLAMA_OK;
}

static llama_result parse_offsets(const cJSON *tensor, llama_tensor_info *info,
                                  uint64_t expected_bytes, size_t data_begin, size_t data_bytes,
                                  char *err, size_t err_bytes) {
    const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(tensor, "data_offsets");
    uint64_t begin, end;
    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2 ||
        !json_to_size(offsets->child, &begin) || !json_to_size(offsets->child->next, &end))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "tensor %s needs data_offsets [begin, end] of whole numbers", info->name);
    if (begin > end || end > data_bytes)
        return llama_fail(
            err, err_bytes, LLAMA_ERR_FORMAT,
            "tensor %s data_offsets [%llu, %llu] lie outside the %zu-byte data section", info->name,
            (unsigned long long)begin, (unsigned long long)end, data_bytes);
    if (end - begin != expected_bytes)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "tensor %s holds %llu bytes but its dtype and shape need %llu",
                          info->name, (unsigned long long)(end - begin),
                          (unsigned long long)expected_bytes);
    info->offset_bytes = data_begin + (size_t)begin;
    info->size_bytes = (size_t)(end - begin);
    return LLAMA_OK;
}

static llama_result parse_tensor(const cJSON *tensor, llama_tensor_info *info, size_t data_begin,
                                 size_t data_bytes, char *err, size_t err_bytes) {
    memset(info, 0, sizeof *info);
    if (strlen(tensor->string) >= LLAMA_MAX_NAME)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "tensor name longer than %d bytes: %.40s...", LLAMA_MAX_NAME - 1,
                          tensor->string);
    strcpy(info->name, tensor->string);
    if (!cJSON_IsObject(tensor))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "tensor %s is not a JSON object",
                          info->name);
    size_t elem_bytes = 0;
    uint64_t n_elems = 0;
    llama_result r = parse_dtype(tensor, info->name, &info->dtype, &elem_bytes, err, err_bytes);
    if (r == LLAMA_OK) r = parse_shape(tensor, info, &n_elems, err, err_bytes);
    if (r != LLAMA_OK) return r;
    return parse_offsets(tensor, info, n_elems * elem_bytes, data_begin, data_bytes, err,
                         err_bytes);
}

static llama_result parse_metadata(const cJSON *metadata, llama_safetensors *out, char *err,
                                   size_t err_bytes) {
    if (!cJSON_IsObject(metadata))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "__metadata__ is not a JSON object");
    const cJSON *config = cJSON_GetObjectItemCaseSensitive(metadata, "config");
    if (config == NULL) return LLAMA_OK;
    if (out->config_json != NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "header has two __metadata__ entries");
    if (!cJSON_IsString(config))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "__metadata__.config is not a string");
    size_t n = strlen(config->valuestring);
    out->config_json = malloc(n + 1);
    if (out->config_json == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "cannot copy the %zu-byte config", n);
    memcpy(out->config_json, config->valuestring, n + 1);
    return LLAMA_OK;
}

static llama_result parse_header_json(const cJSON *root, size_t data_begin, size_t data_bytes,
                                      llama_safetensors *out, char *err, size_t err_bytes) {
    if (!cJSON_IsObject(root))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "safetensors header is not a JSON object");
    int n_entries = cJSON_GetArraySize(root);
    out->tensors = calloc(n_entries > 0 ? (size_t)n_entries : 1, sizeof *out->tensors);
    if (out->tensors == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "cannot allocate %d tensor entries",
                          n_entries);
    for (const cJSON *entry = root->child; entry != NULL; entry = entry->next) {
        llama_result r;
        if (strcmp(entry->string, "__metadata__") == 0) {
            r = parse_metadata(entry, out, err, err_bytes);
        } else {
            r = parse_tensor(entry, &out->tensors[out->n_tensors], data_begin, data_bytes, err,
                             err_bytes);
            out->n_tensors++;
        }
        if (r != LLAMA_OK) return r;
    }
    return LLAMA_OK;
}

llama_result llama_safetensors_parse(const uint8_t *file, size_t file_bytes, llama_safetensors *out,
                                     char *err, size_t err_bytes) {
    if (out == NULL || (file == NULL && file_bytes > 0))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "safetensors: NULL argument");
    memset(out, 0, sizeof *out);
    if (file_bytes < 8)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "file of %zu bytes is shorter than the 8-byte header length", file_bytes);
    uint64_t header_bytes = get_u64_le(file);
    if (header_bytes < 2 || header_bytes > file_bytes - 8)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "header length %llu does not fit the %zu bytes after it",
                          (unsigned long long)header_bytes, file_bytes - 8);
    if (header_bytes > LLAMA_MAX_HEADER_BYTES)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "header of %llu bytes is over the limit",
                          (unsigned long long)header_bytes);
    const char *json = (const char *)file + 8;
    const char *end = json;
    cJSON *root = cJSON_ParseWithLengthOpts(json, (size_t)header_bytes, &end, 0);
    if (root == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "header JSON is malformed near byte %lld", (long long)(end - json));
    size_t data_begin = 8 + (size_t)header_bytes;
    llama_result r =
        parse_header_json(root, data_begin, file_bytes - data_begin, out, err, err_bytes);
    cJSON_Delete(root);
    if (r != LLAMA_OK) llama_safetensors_free(out);
    return r;
}

void llama_safetensors_free(llama_safetensors *st) {
    if (st == NULL) return;
    free(st->tensors);
    free(st->config_json);
    memset(st, 0, sizeof *st);
}

// >>config

static llama_result config_int(const cJSON *root, const char *key, int32_t fallback, int32_t *value,
                               char *err, size_t err_bytes) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    uint64_t v;
    if (item == NULL && fallback > 0) {
        *value = fallback;
        return LLAMA_OK;
    }
    if (item == NULL) return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "config has no %s", key);
    if (!json_to_size(item, &v) || v < 1 || v > LLAMA_MAX_CONFIG_DIM)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "config %s must be a whole number in [1, %d]", key, LLAMA_MAX_CONFIG_DIM);
    *value = (int32_t)v;
    return LLAMA_OK;
}

static llama_result config_float(const cJSON *root, const char *key, double fallback, float *value,
                                 char *err, size_t err_bytes) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    if (item == NULL) {
        *value = (float)fallback;
        return LLAMA_OK;
    }
    if (!cJSON_IsNumber(item) || !(item->valuedouble > 0.0 && item->valuedouble < 1e30))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "config %s must be a positive number",
                          key);
    *value = (float)item->valuedouble;
    return LLAMA_OK;
}

/* A string field that, when present, must equal the one value this runner implements. */
static llama_result config_expect(const cJSON *root, const char *key, const char *expected,
                                  char *err, size_t err_bytes) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    if (item == NULL || cJSON_IsNull(item)) return LLAMA_OK;
    if (!cJSON_IsString(item) || strcmp(item->valuestring, expected) != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "config %s must be \"%s\"", key,
                          expected);
    return LLAMA_OK;
}

static llama_result config_shapes(const cJSON *root, llama_config *c, char *err, size_t err_bytes) {
    llama_result r = config_int(root, "hidden_size", 0, &c->hidden, err, err_bytes);
    if (r == LLAMA_OK) r = config_int(root, "num_hidden_layers", 0, &c->n_layers, err, err_bytes);
    if (r == LLAMA_OK) r = config_int(root, "num_attention_heads", 0, &c->n_heads, err, err_bytes);
    if (r == LLAMA_OK)
        r = config_int(root, "num_key_value_heads", c->n_heads, &c->n_kv_heads, err, err_bytes);
    if (r == LLAMA_OK)
        r = config_int(root, "head_dim", c->hidden / c->n_heads, &c->head_dim, err, err_bytes);
    if (r == LLAMA_OK) r = config_int(root, "intermediate_size", 0, &c->ffn, err, err_bytes);
    if (r == LLAMA_OK)
        r = config_int(root, "max_position_embeddings", 0, &c->context, err, err_bytes);
    if (r == LLAMA_OK) r = config_int(root, "vocab_size", 0, &c->vocab, err, err_bytes);
    if (r != LLAMA_OK) return r;
    if (c->n_heads % c->n_kv_heads != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "%d attention heads is not a multiple of %d kv heads", c->n_heads,
                          c->n_kv_heads);
    if (c->head_dim % 2 != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "RoPE needs an even head_dim, got %d", c->head_dim);
    if (c->vocab < 256)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "vocab_size %d cannot hold the 256 byte tokens", c->vocab);
    return LLAMA_OK;
}

static llama_result config_flags(const cJSON *root, llama_config *c, char *err, size_t err_bytes) {
    llama_result r = config_float(root, "rope_theta", 10000.0, &c->rope_theta, err, err_bytes);
    if (r == LLAMA_OK) r = config_float(root, "rms_norm_eps", 1e-6, &c->norm_eps, err, err_bytes);
    if (r == LLAMA_OK) r = config_expect(root, "model_type", "llama", err, err_bytes);
    if (r == LLAMA_OK) r = config_expect(root, "hidden_act", "silu", err, err_bytes);
    if (r == LLAMA_OK) r = config_expect(root, "rope_convention", "rotate_half", err, err_bytes);
    if (r != LLAMA_OK) return r;
    const cJSON *scaling = cJSON_GetObjectItemCaseSensitive(root, "rope_scaling");
    if (scaling != NULL && !cJSON_IsNull(scaling))
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "rope_scaling is not implemented");
    c->tied_embeddings =
        cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings"));
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(root, "name");
    if (cJSON_IsString(name)) snprintf(c->name, sizeof c->name, "%s", name->valuestring);
    return LLAMA_OK;
}

static llama_result config_tokenizer(const cJSON *root, int32_t vocab, llama_tokenizer *tok,
                                     char *err, size_t err_bytes) {
    memset(tok, 0, sizeof *tok);
    for (int32_t i = 0; i < 256; i++) tok->byte_text[i] = (char)(unsigned char)i;
    const cJSON *tokenizer = cJSON_GetObjectItemCaseSensitive(root, "tokenizer");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(tokenizer, "special_tokens");
    if (!cJSON_IsObject(specials))
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "config has no tokenizer.special_tokens object");
    for (const cJSON *s = specials->child; s != NULL; s = s->next) {
        uint64_t id;
        size_t n = strlen(s->string);
        if (!json_to_size(s, &id) || id < 256 || id >= (uint64_t)vocab)
            return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                              "special token %.40s needs an id in [256, %d)", s->string, vocab);
        if (n == 0 || n >= LLAMA_MAX_SPECIAL_BYTES || tok->n_special == LLAMA_MAX_SPECIAL)
            return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                              "special tokens: at most %d, each 1 to %d bytes", LLAMA_MAX_SPECIAL,
                              LLAMA_MAX_SPECIAL_BYTES - 1);
        tok->special_id[tok->n_special] = (int32_t)id;
        memcpy(tok->special_text[tok->n_special], s->string, n + 1);
        tok->n_special++;
    }
    return LLAMA_OK;
}

llama_result llama_config_parse(const char *json, size_t json_bytes, llama_config *config,
                                llama_tokenizer *tokenizer, char *err, size_t err_bytes) {
    if (json == NULL || config == NULL || tokenizer == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "config: NULL argument");
    memset(config, 0, sizeof *config);
    const char *end = json;
    cJSON *root = cJSON_ParseWithLengthOpts(json, json_bytes, &end, 0);
    if (root == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "config JSON is malformed near byte %lld", (long long)(end - json));
    llama_result r = LLAMA_OK;
    if (!cJSON_IsObject(root))
        r = llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "config is not a JSON object");
    if (r == LLAMA_OK) r = config_shapes(root, config, err, err_bytes);
    if (r == LLAMA_OK) r = config_flags(root, config, err, err_bytes);
    if (r == LLAMA_OK) r = config_tokenizer(root, config->vocab, tokenizer, err, err_bytes);
    cJSON_Delete(root);
    return r;
}

// >>tokenizer

/* The longest special token starting at text (so "<tool_call>" never loses to a prefix), or -1. */
static int32_t match_special(const llama_tokenizer *tok, const char *text, size_t left,
                             size_t *n_matched) {
    int32_t best = -1;
    *n_matched = 0;
    for (int32_t s = 0; s < tok->n_special; s++) {
        size_t n = strlen(tok->special_text[s]);
        if (n <= left && n > *n_matched && memcmp(text, tok->special_text[s], n) == 0) {
            best = tok->special_id[s];
            *n_matched = n;
        }
    }
    return best;
}

llama_result llama_tokenize(const llama_tokenizer *tok, const char *text, size_t text_bytes,
                            int32_t *ids, int64_t *n_ids) {
    if (tok == NULL || (text == NULL && text_bytes > 0) || ids == NULL || n_ids == NULL)
        return LLAMA_ERR_ARGUMENT;
    int64_t n = 0;
    for (size_t i = 0; i < text_bytes;) {
        size_t matched = 0;
        int32_t id = text[i] == '<' ? match_special(tok, text + i, text_bytes - i, &matched) : -1;
        if (id >= 0) {
            ids[n++] = id;
            i += matched;
        } else {
            ids[n++] = (uint8_t)text[i];
            i++;
        }
    }
    *n_ids = n;
    return LLAMA_OK;
}

int32_t llama_special_id(const llama_tokenizer *tok, const char *text) {
    for (int32_t s = 0; s < tok->n_special; s++)
        if (strcmp(tok->special_text[s], text) == 0) return tok->special_id[s];
    return -1;
}

const char *llama_token_bytes(const llama_tokenizer *tok, int32_t id, size_t *n_bytes) {
    if (id >= 0 && id < 256) {
        *n_bytes = 1;
        return &tok->byte_text[id];
    }
    for (int32_t s = 0; s < tok->n_special; s++) {
        if (tok->special_id[s] == id) {
            *n_bytes = strlen(tok->special_text[s]);
            return tok->special_text[s];
        }
    }
    *n_bytes = 0;
    return NULL;
}

// >>load

static float bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void tensor_to_f32(const uint8_t *file, const llama_tensor_info *t, float *out) {
    const uint8_t *p = file + t->offset_bytes;
    size_t elem_bytes = t->dtype == LLAMA_DTYPE_F32 ? 4 : 2;
    size_t n = t->size_bytes / elem_bytes;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *e = p + i * elem_bytes;
        uint16_t half = (uint16_t)(e[0] | e[1] << 8);
        switch (t->dtype) {
        case LLAMA_DTYPE_F32: out[i] = bits_to_f32(get_u32_le(e)); break;
        case LLAMA_DTYPE_F16: out[i] = kvmix_fp16_to_fp32(half); break;
        case LLAMA_DTYPE_BF16: out[i] = kvmix_bf16_to_fp32(half); break;
        }
    }
}

typedef struct loader {
    const uint8_t *file;
    const llama_safetensors *st;
    char *err;
    size_t err_bytes;
} loader;

static const llama_tensor_info *find_tensor(const llama_safetensors *st, const char *name) {
    for (int32_t i = 0; i < st->n_tensors; i++)
        if (strcmp(st->tensors[i].name, name) == 0) return &st->tensors[i];
    return NULL;
}

/* Converts tensor `name`, which must have shape [rows, cols] (cols == 0: shape [rows]), into dst. */
static llama_result load_tensor(const loader *ld, const char *name, int64_t rows, int64_t cols,
                                float *dst) {
    const llama_tensor_info *t = find_tensor(ld->st, name);
    if (t == NULL)
        return llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_FORMAT, "missing tensor %s", name);
    bool ok = cols == 0 ? t->n_dims == 1 && t->shape[0] == rows
                        : t->n_dims == 2 && t->shape[0] == rows && t->shape[1] == cols;
    if (!ok) {
        char got[96] = "";
        for (int32_t d = 0; d < t->n_dims && d < 4; d++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "",
                     (long long)t->shape[d]);
        return llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_FORMAT,
                          "tensor %s has shape [%s], config needs [%lld%s%.0lld]", name, got,
                          (long long)rows, cols ? ", " : "", (long long)cols);
    }
    tensor_to_f32(ld->file, t, dst);
    return LLAMA_OK;
}

static llama_result load_vector(const loader *ld, const char *name, int64_t n, float **dst) {
    *dst = malloc((size_t)n * sizeof(float));
    if (*dst == NULL)
        return llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_MEMORY, "cannot allocate %s", name);
    return load_tensor(ld, name, n, 0, *dst);
}

void llama_matrix_rows(const llama_matrix *m, float *out) {
    for (int32_t r = 0; r < m->n_out; r++) {
        size_t p = (size_t)(r / LLAMA_PANEL_ROWS), j = (size_t)(r % LLAMA_PANEL_ROWS);
        for (int32_t i = 0; i < m->n_in; i++)
            out[(size_t)r * (size_t)m->n_in + (size_t)i] =
                m->panels[(p * (size_t)m->n_in + (size_t)i) * LLAMA_PANEL_ROWS + j];
    }
}

/* Packs row-major rows into panels: row r = p*LLAMA_PANEL_ROWS + j, column i lives at
 * panels[(p*n_in + i)*LLAMA_PANEL_ROWS + j]; rows past n_out are zero. */
static llama_result pack_matrix(const float *rows, int32_t n_out, int32_t n_in, llama_matrix *m) {
    int32_t n_panels = (n_out + LLAMA_PANEL_ROWS - 1) / LLAMA_PANEL_ROWS;
    size_t n_floats = (size_t)n_panels * LLAMA_PANEL_ROWS * (size_t)n_in;
    m->panels = aligned_alloc(64, n_floats * sizeof(float)); /* a multiple of 64 bytes */
    if (m->panels == NULL) return LLAMA_ERR_MEMORY;
    m->n_out = n_out;
    m->n_in = n_in;
    for (int32_t p = 0; p < n_panels; p++)
        for (int32_t i = 0; i < n_in; i++)
            for (int32_t j = 0; j < LLAMA_PANEL_ROWS; j++) {
                int32_t r = p * LLAMA_PANEL_ROWS + j;
                m->panels[((size_t)p * n_in + i) * LLAMA_PANEL_ROWS + j] =
                    r < n_out ? rows[(size_t)r * n_in + i] : 0.0f;
            }
    return LLAMA_OK;
}

/* Loads tensors named by `names` (a printf pattern with the layer), stacked top to bottom, into one
 * packed matrix: fusing q/k/v and gate/up halves the thread handoffs per token. */
static llama_result load_matrix(const loader *ld, int32_t layer, const char *const *names,
                                const int32_t *rows, int32_t n_parts, int32_t n_in,
                                llama_matrix *m) {
    int32_t n_out = 0;
    for (int32_t i = 0; i < n_parts; i++) n_out += rows[i];
    float *stacked = malloc((size_t)n_out * (size_t)n_in * sizeof(float));
    if (stacked == NULL)
        return llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_MEMORY,
                          "cannot allocate a %d x %d matrix", n_out, n_in);
    llama_result r = LLAMA_OK;
    size_t row0 = 0;
    for (int32_t i = 0; i < n_parts && r == LLAMA_OK; i++) {
        char name[LLAMA_MAX_NAME];
        snprintf(name, sizeof name, names[i], layer);
        r = load_tensor(ld, name, rows[i], n_in, stacked + row0 * (size_t)n_in);
        row0 += (size_t)rows[i];
    }
    if (r == LLAMA_OK && pack_matrix(stacked, n_out, n_in, m) != LLAMA_OK)
        r = llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_MEMORY,
                       "cannot allocate a packed %d x %d matrix", n_out, n_in);
    free(stacked);
    return r;
}

static llama_result load_layer(const loader *ld, const llama_config *c, int32_t l,
                               llama_layer *layer) {
    static const char *const qkv[] = {"model.layers.%d.self_attn.q_proj.weight",
                                      "model.layers.%d.self_attn.k_proj.weight",
                                      "model.layers.%d.self_attn.v_proj.weight"};
    static const char *const out[] = {"model.layers.%d.self_attn.o_proj.weight"};
    static const char *const gate_up[] = {"model.layers.%d.mlp.gate_proj.weight",
                                          "model.layers.%d.mlp.up_proj.weight"};
    static const char *const down[] = {"model.layers.%d.mlp.down_proj.weight"};
    const int32_t q_rows = c->n_heads * c->head_dim, kv_rows = c->n_kv_heads * c->head_dim;
    const int32_t qkv_rows[] = {q_rows, kv_rows, kv_rows}, ffn_rows[] = {c->ffn, c->ffn};
    char name[LLAMA_MAX_NAME];
    snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
    llama_result r = load_vector(ld, name, c->hidden, &layer->attn_norm);
    snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
    if (r == LLAMA_OK) r = load_vector(ld, name, c->hidden, &layer->ffn_norm);
    if (r == LLAMA_OK) r = load_matrix(ld, l, qkv, qkv_rows, 3, c->hidden, &layer->qkv);
    if (r == LLAMA_OK) r = load_matrix(ld, l, out, &c->hidden, 1, q_rows, &layer->out);
    if (r == LLAMA_OK) r = load_matrix(ld, l, gate_up, ffn_rows, 2, c->hidden, &layer->gate_up);
    if (r == LLAMA_OK) r = load_matrix(ld, l, down, &c->hidden, 1, c->ffn, &layer->down);
    return r;
}

static llama_result load_weights(const loader *ld, llama_model *m) {
    const llama_config *c = &m->config;
    static const char *const embed[] = {"model.embed_tokens.weight"};
    static const char *const head[] = {"lm_head.weight"};
    bool has_head = find_tensor(ld->st, head[0]) != NULL;
    llama_result r = load_vector(ld, "model.norm.weight", c->hidden, &m->final_norm);
    if (r != LLAMA_OK) return r;
    m->embed = malloc((size_t)c->vocab * (size_t)c->hidden * sizeof(float));
    if (m->embed == NULL)
        return llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_MEMORY, "cannot allocate embeddings");
    r = load_tensor(ld, embed[0], c->vocab, c->hidden, m->embed);
    if (r == LLAMA_OK && !has_head && !c->tied_embeddings)
        r = llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_FORMAT,
                       "missing tensor lm_head.weight (config does not tie embeddings)");
    if (r == LLAMA_OK)
        r = load_matrix(ld, 0, has_head ? head : embed, &c->vocab, 1, c->hidden, &m->head);
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    if (r == LLAMA_OK && m->layers == NULL)
        r = llama_fail(ld->err, ld->err_bytes, LLAMA_ERR_MEMORY, "cannot allocate layers");
    for (int32_t l = 0; l < c->n_layers && r == LLAMA_OK; l++)
        r = load_layer(ld, c, l, &m->layers[l]);
    return r;
}

/* The config JSON: __metadata__.config, else config.json next to the checkpoint. */
static llama_result load_config(const char *path, const llama_safetensors *st, llama_model *m,
                                char *err, size_t err_bytes) {
    if (st->config_json != NULL)
        return llama_config_parse(st->config_json, strlen(st->config_json), &m->config,
                                  &m->tokenizer, err, err_bytes);
    const char *slash = strrchr(path, '/');
    size_t dir_bytes = slash != NULL ? (size_t)(slash - path) + 1 : 0;
    char *config_path = malloc(dir_bytes + sizeof "config.json");
    if (config_path == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "cannot allocate a path");
    memcpy(config_path, path, dir_bytes);
    memcpy(config_path + dir_bytes, "config.json", sizeof "config.json");
    uint8_t *json;
    size_t json_bytes;
    llama_result r = read_whole_file(config_path, &json, &json_bytes, err, err_bytes);
    if (r != LLAMA_OK)
        r = llama_fail(err, err_bytes, r, "%s has no __metadata__.config and %s is unreadable",
                       path, config_path);
    else
        r = llama_config_parse((const char *)json, json_bytes, &m->config, &m->tokenizer, err,
                               err_bytes);
    free(json);
    free(config_path);
    return r;
}

llama_result llama_model_load(const char *path, llama_model *model, char *err, size_t err_bytes) {
    if (path == NULL || model == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "NULL argument");
    memset(model, 0, sizeof *model);
    uint8_t *file;
    size_t file_bytes;
    llama_result r = read_whole_file(path, &file, &file_bytes, err, err_bytes);
    if (r != LLAMA_OK) return r;
    llama_safetensors st;
    r = llama_safetensors_parse(file, file_bytes, &st, err, err_bytes);
    if (r == LLAMA_OK) {
        r = load_config(path, &st, model, err, err_bytes);
        loader ld = {file, &st, err, err_bytes};
        if (r == LLAMA_OK) r = load_weights(&ld, model);
        llama_safetensors_free(&st);
    }
    free(file);
    if (r != LLAMA_OK) llama_model_free(model);
    return r;
}

void llama_model_free(llama_model *model) {
    if (model == NULL) return;
    if (model->layers != NULL) {
        for (int32_t l = 0; l < model->config.n_layers; l++) {
            llama_layer *layer = &model->layers[l];
            free(layer->attn_norm);
            free(layer->ffn_norm);
            free(layer->qkv.panels);
            free(layer->out.panels);
            free(layer->gate_up.panels);
            free(layer->down.panels);
        }
    }
    free(model->layers);
    free(model->embed);
    free(model->final_norm);
    free(model->head.panels);
    memset(model, 0, sizeof *model);
}

// >>pool

/* Workers spin this many times on the job counter before sleeping: jobs come microseconds apart
 * during a forward pass, and a futex wake per matmul would cost more than the matmul. */
enum { LLAMA_SPIN_LIMIT = 1 << 16 };

/* Runs items [begin, end) of a job. */
typedef void (*llama_job_fn)(void *ctx, int32_t begin, int32_t end);

struct llama_pool {
    int32_t n_threads;
    pthread_t *threads;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    atomic_uint_fast64_t generation; /* bumped once per job */
    atomic_int_fast32_t n_done;      /* workers finished with the current job */
    atomic_int_fast32_t next_item;   /* the first item of the current job nobody took yet */
    atomic_bool stop;
    llama_job_fn fn;
    void *ctx;
    int32_t n_items, chunk;
};

/* Threads take chunks of items until none is left, so a thread that the OS pauses (other work
 * on the machine) delays the job by one chunk at most, not by its whole share. */
static void pool_take_items(llama_pool *pool) {
    for (;;) {
        int32_t begin = (int32_t)atomic_fetch_add(&pool->next_item, pool->chunk);
        if (begin >= pool->n_items) return;
        int32_t end = begin + pool->chunk < pool->n_items ? begin + pool->chunk : pool->n_items;
        pool->fn(pool->ctx, begin, end);
    }
}

static uint64_t pool_wait_job(llama_pool *pool, uint64_t seen) {
    for (int32_t spin = 0; spin < LLAMA_SPIN_LIMIT; spin++) {
        uint64_t g = atomic_load(&pool->generation);
        if (g != seen) return g;
    }
    pthread_mutex_lock(&pool->mutex);
    while (atomic_load(&pool->generation) == seen) pthread_cond_wait(&pool->wake, &pool->mutex);
    pthread_mutex_unlock(&pool->mutex);
    return atomic_load(&pool->generation);
}

static void *pool_worker(void *arg) {
    llama_pool *pool = arg;
    uint64_t seen = 0;
    for (;;) {
        seen = pool_wait_job(pool, seen);
        if (atomic_load(&pool->stop)) return NULL;
        pool_take_items(pool);
        atomic_fetch_add(&pool->n_done, 1);
    }
}

/* Runs fn over items [0, n_items) in chunks, on the caller's thread and the workers. */
static void pool_run(llama_pool *pool, llama_job_fn fn, void *ctx, int32_t n_items, int32_t chunk) {
    if (pool->n_threads == 1) {
        fn(ctx, 0, n_items);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n_items = n_items;
    pool->chunk = chunk;
    atomic_store(&pool->next_item, 0);
    atomic_store(&pool->n_done, 0);
    atomic_fetch_add(&pool->generation, 1);
    /* Under the mutex so that a worker between its check and its wait cannot miss the wake. */
    pthread_mutex_lock(&pool->mutex);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    pool_take_items(pool);
    /* A worker still inside its last chunk may have been paused: spin briefly, then yield. */
    for (int32_t spin = 0; atomic_load(&pool->n_done) < pool->n_threads - 1; spin++)
        if (spin > LLAMA_SPIN_LIMIT) sched_yield();
}

static void pool_free(llama_pool *pool, int32_t n_started) {
    if (pool == NULL) return;
    atomic_store(&pool->stop, true);
    atomic_fetch_add(&pool->generation, 1);
    pthread_mutex_lock(&pool->mutex);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mutex);
    for (int32_t i = 0; i < n_started; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mutex);
    free(pool->threads);
    free(pool);
}

static llama_result pool_create(int32_t n_threads, llama_pool **out) {
    llama_pool *pool = calloc(1, sizeof *pool);
    if (pool == NULL) return LLAMA_ERR_MEMORY;
    pool->n_threads = n_threads;
    pool->threads = calloc((size_t)n_threads, sizeof *pool->threads);
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->n_done, 0);
    atomic_init(&pool->next_item, 0);
    atomic_init(&pool->stop, false);
    int32_t started = 0;
    llama_result r = pool->threads != NULL ? LLAMA_OK : LLAMA_ERR_MEMORY;
    for (int32_t i = 1; i < n_threads && r == LLAMA_OK; i++) {
        if (pthread_create(&pool->threads[started], NULL, pool_worker, pool) != 0)
            r = LLAMA_ERR_MEMORY;
        else
            started++;
    }
    if (r != LLAMA_OK) {
        pool_free(pool, started);
        return r;
    }
    *out = pool;
    return LLAMA_OK;
}

// >>forward

llama_result llama_runner_init(llama_runner *runner, const llama_model *model, int32_t n_threads,
                               char *err, size_t err_bytes) {
    if (runner == NULL || model == NULL || n_threads < 1 || n_threads > 256)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "runner needs a model and 1 to 256 threads");
    memset(runner, 0, sizeof *runner);
    const llama_config *c = &model->config;
    size_t q_floats = (size_t)c->n_heads * (size_t)c->head_dim;
    size_t qkv_floats = q_floats + 2 * (size_t)c->n_kv_heads * (size_t)c->head_dim;
    size_t wide = (size_t)c->hidden > q_floats ? (size_t)c->hidden : q_floats;
    runner->model = model;
    runner->x = malloc((size_t)c->hidden * sizeof(float));
    runner->xn = malloc(wide * sizeof(float));
    runner->qkv = malloc(qkv_floats * sizeof(float));
    runner->att = malloc(q_floats * sizeof(float));
    runner->ffn = malloc(2 * (size_t)c->ffn * sizeof(float));
    runner->rope = malloc((size_t)c->head_dim * sizeof(float));
    runner->logits = malloc((size_t)c->vocab * sizeof(float));
    runner->inv_freq = malloc((size_t)c->head_dim / 2 * sizeof(double));
    runner->part_results = malloc((size_t)c->n_kv_heads * sizeof(llama_result));
    if (!runner->x || !runner->xn || !runner->qkv || !runner->att || !runner->ffn ||
        !runner->rope || !runner->logits || !runner->inv_freq || !runner->part_results ||
        pool_create(n_threads, &runner->pool) != LLAMA_OK) {
        llama_runner_free(runner);
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY,
                          "cannot allocate runner buffers or threads");
    }
    for (int32_t i = 0; i < c->head_dim / 2; i++)
        runner->inv_freq[i] = pow((double)c->rope_theta, -2.0 * i / c->head_dim);
    return LLAMA_OK;
}

void llama_runner_free(llama_runner *runner) {
    if (runner == NULL) return;
    pool_free(runner->pool, runner->pool != NULL ? runner->pool->n_threads - 1 : 0);
    free(runner->x);
    free(runner->xn);
    free(runner->qkv);
    free(runner->att);
    free(runner->ffn);
    free(runner->rope);
    free(runner->logits);
    free(runner->inv_freq);
    free(runner->part_results);
    memset(runner, 0, sizeof *runner);
}

/* out[j] = sum_i panel[i * stride + j] * x[i] for j < 16. Sixteen named accumulators (not an
 * array) are what lets gcc and clang keep them in vector registers; each sum runs in order of i. */
static void panel_times(const float *panel, size_t stride, const float *x, int32_t n_in,
                        float out[LLAMA_PANEL_ROWS]) {
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    float a8 = 0, a9 = 0, a10 = 0, a11 = 0, a12 = 0, a13 = 0, a14 = 0, a15 = 0;
    for (int32_t i = 0; i < n_in; i++) {
        const float xi = x[i];
        const float *c = panel + (size_t)i * stride;
        a0 += c[0] * xi;
        a1 += c[1] * xi;
        a2 += c[2] * xi;
        a3 += c[3] * xi;
        a4 += c[4] * xi;
        a5 += c[5] * xi;
        a6 += c[6] * xi;
        a7 += c[7] * xi;
        a8 += c[8] * xi;
        a9 += c[9] * xi;
        a10 += c[10] * xi;
        a11 += c[11] * xi;
        a12 += c[12] * xi;
        a13 += c[13] * xi;
        a14 += c[14] * xi;
        a15 += c[15] * xi;
    }
    const float acc[LLAMA_PANEL_ROWS] = {a0, a1, a2,  a3,  a4,  a5,  a6,  a7,
                                         a8, a9, a10, a11, a12, a13, a14, a15};
    memcpy(out, acc, sizeof acc);
}

static void matvec_panels(const llama_matrix *w, const float *x, float *y, int32_t p_begin,
                          int32_t p_end) {
    for (int32_t p = p_begin; p < p_end; p++) {
        float acc[LLAMA_PANEL_ROWS];
        panel_times(w->panels + (size_t)p * (size_t)w->n_in * LLAMA_PANEL_ROWS, LLAMA_PANEL_ROWS, x,
                    w->n_in, acc);
        int32_t row0 = p * LLAMA_PANEL_ROWS;
        int32_t n_rows = w->n_out - row0 < LLAMA_PANEL_ROWS ? w->n_out - row0 : LLAMA_PANEL_ROWS;
        memcpy(y + row0, acc, (size_t)n_rows * sizeof(float));
    }
}

typedef struct matvec_job {
    const llama_matrix *w;
    const float *x;
    float *y;
} matvec_job;

static void matvec_part(void *ctx, int32_t panel_begin, int32_t panel_end) {
    const matvec_job *job = ctx;
    matvec_panels(job->w, job->x, job->y, panel_begin, panel_end);
}

/* Panels per work item: 64 rows, enough work to hide the handoff. */
enum { LLAMA_PANELS_PER_CHUNK = 4 };

/* y[n_out] = W x, output rows split across the runner's threads. */
static void matvec(llama_runner *runner, const llama_matrix *w, const float *x, float *y) {
    matvec_job job = {w, x, y};
    int32_t n_panels = (w->n_out + LLAMA_PANEL_ROWS - 1) / LLAMA_PANEL_ROWS;
    pool_run(runner->pool, matvec_part, &job, n_panels, LLAMA_PANELS_PER_CHUNK);
}

static void rms_norm(float *out, const float *x, const float *weight, int32_t n, float eps) {
    double sum_squares = 0.0;
    for (int32_t i = 0; i < n; i++) sum_squares += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(sum_squares / n + eps));
    for (int32_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

/* Rotate-half RoPE: dimension i pairs with i + head_dim/2. rope holds cos then sin [head_dim/2]. */
static void apply_rope(float *heads, int32_t n_heads, int32_t head_dim, const float *rope) {
    int32_t half = head_dim / 2;
    for (int32_t h = 0; h < n_heads; h++) {
        float *x = heads + (size_t)h * head_dim;
        for (int32_t i = 0; i < half; i++) {
            float a = x[i], b = x[i + half], c = rope[i], s = rope[half + i];
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}

typedef struct attend_job {
    llama_kv_cache *cache;
    int32_t layer, n_kv_heads, group, head_dim;
    float scale;
    const float *q;
    float *out;
    llama_result *results; /* [n_kv_heads] */
} attend_job;

static void attend_part(void *ctx, int32_t kv_begin, int32_t kv_end) {
    const attend_job *job = ctx;
    for (int32_t kv = kv_begin; kv < kv_end; kv++) {
        size_t offset = (size_t)kv * job->group * job->head_dim;
        job->results[kv] = job->cache->attend(job->cache->state, job->layer, kv, job->q + offset,
                                              job->group, job->scale, job->out + offset);
    }
}

static llama_result attention(llama_runner *runner, llama_kv_cache *cache, int32_t l, int64_t pos,
                              char *err, size_t err_bytes) {
    const llama_config *c = &runner->model->config;
    float *q = runner->qkv;
    float *k = q + (size_t)c->n_heads * c->head_dim;
    float *v = k + (size_t)c->n_kv_heads * c->head_dim;
    apply_rope(q, c->n_heads, c->head_dim, runner->rope);
    apply_rope(k, c->n_kv_heads, c->head_dim, runner->rope);
    llama_result r = cache->store(cache->state, l, pos, k, v);
    if (r != LLAMA_OK)
        return llama_fail(err, err_bytes, r, "kv cache store failed at layer %d, position %lld", l,
                          (long long)pos);
    attend_job job = {cache,
                      l,
                      c->n_kv_heads,
                      c->n_heads / c->n_kv_heads,
                      c->head_dim,
                      (float)(1.0 / sqrt((double)c->head_dim)),
                      q,
                      runner->att,
                      runner->part_results};
    pool_run(runner->pool, attend_part, &job, c->n_kv_heads, 1);
    for (int32_t kv = 0; kv < c->n_kv_heads; kv++)
        if (runner->part_results[kv] != LLAMA_OK)
            return llama_fail(err, err_bytes, runner->part_results[kv],
                              "kv cache attend failed at layer %d, kv head %d, position %lld", l,
                              kv, (long long)pos);
    return LLAMA_OK;
}

static void add_into(float *x, const float *delta, int32_t n) {
    for (int32_t i = 0; i < n; i++) x[i] += delta[i];
}

static void swiglu(float *gate_up, int32_t ffn) {
    for (int32_t i = 0; i < ffn; i++) {
        float g = gate_up[i];
        gate_up[i] = g / (1.0f + expf(-g)) * gate_up[ffn + i];
    }
}

static void rope_table(llama_runner *runner, int64_t pos) {
    int32_t half = runner->model->config.head_dim / 2;
    for (int32_t i = 0; i < half; i++) {
        double angle = (double)pos * runner->inv_freq[i];
        runner->rope[i] = (float)cos(angle);
        runner->rope[half + i] = (float)sin(angle);
    }
}

llama_result llama_forward(llama_runner *runner, llama_kv_cache *cache, int32_t token, int64_t pos,
                           float *logits, char *err, size_t err_bytes) {
    if (runner == NULL || cache == NULL || logits == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "forward: NULL argument");
    const llama_model *m = runner->model;
    const llama_config *c = &m->config;
    if (token < 0 || token >= c->vocab)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "token %d is outside the vocab of %d",
                          token, c->vocab);
    if (pos < 0 || pos >= c->context)
        return llama_fail(err, err_bytes, LLAMA_ERR_CAPACITY,
                          "position %lld is outside the context of %d", (long long)pos, c->context);
    if (cache->on_token != NULL) cache->on_token(cache->state, pos, token);
    memcpy(runner->x, m->embed + (size_t)token * c->hidden, (size_t)c->hidden * sizeof(float));
    rope_table(runner, pos);
    for (int32_t l = 0; l < c->n_layers; l++) {
        const llama_layer *layer = &m->layers[l];
        rms_norm(runner->xn, runner->x, layer->attn_norm, c->hidden, c->norm_eps);
        matvec(runner, &layer->qkv, runner->xn, runner->qkv);
        llama_result r = attention(runner, cache, l, pos, err, err_bytes);
        if (r != LLAMA_OK) return r;
        matvec(runner, &layer->out, runner->att, runner->xn);
        add_into(runner->x, runner->xn, c->hidden);
        rms_norm(runner->xn, runner->x, layer->ffn_norm, c->hidden, c->norm_eps);
        matvec(runner, &layer->gate_up, runner->xn, runner->ffn);
        swiglu(runner->ffn, c->ffn);
        matvec(runner, &layer->down, runner->ffn, runner->xn);
        add_into(runner->x, runner->xn, c->hidden);
    }
    rms_norm(runner->xn, runner->x, m->final_norm, c->hidden, c->norm_eps);
    matvec(runner, &m->head, runner->xn, logits);
    return LLAMA_OK;
}

// >>fp32cache

/* Keys and values as fp32, laid out [layer][kv_head][token][head_dim] so that attention over one
 * kv head walks contiguous memory. */
typedef struct kv_fp32 {
    int32_t n_layers, n_kv_heads, head_dim;
    int64_t capacity;
    int64_t *n_tokens; /* [n_layers] */
    float *k, *v;
    float *
        scores; /* [n_kv_heads, capacity]: one row per kv head, so concurrent attends never share */
} kv_fp32;

static size_t kv_fp32_offset(const kv_fp32 *kv, int32_t layer, int32_t head, int64_t token) {
    return (((size_t)layer * kv->n_kv_heads + (size_t)head) * (size_t)kv->capacity +
            (size_t)token) *
           (size_t)kv->head_dim;
}

static llama_result kv_fp32_store(void *state, int32_t layer, int64_t pos, const float *k,
                                  const float *v) {
    kv_fp32 *kv = state;
    if (layer < 0 || layer >= kv->n_layers || pos != kv->n_tokens[layer]) return LLAMA_ERR_ARGUMENT;
    if (pos >= kv->capacity) return LLAMA_ERR_CAPACITY;
    for (int32_t h = 0; h < kv->n_kv_heads; h++) {
        size_t at = kv_fp32_offset(kv, layer, h, pos), from = (size_t)h * kv->head_dim;
        memcpy(kv->k + at, k + from, (size_t)kv->head_dim * sizeof(float));
        memcpy(kv->v + at, v + from, (size_t)kv->head_dim * sizeof(float));
    }
    kv->n_tokens[layer]++;
    return LLAMA_OK;
}

/* Eight partial sums, so the compiler can keep them in vector registers. */
static float dot(const float *a, const float *b, int32_t n) {
    float acc[8] = {0};
    int32_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int32_t j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[0] += a[i] * b[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void llama_attend_rows(const float *keys, const float *values, int64_t n_tokens, int32_t head_dim,
                       const float *q, float scale, float *scores, float *out) {
    float max_score = -INFINITY;
    for (int64_t t = 0; t < n_tokens; t++) {
        scores[t] = scale * dot(q, keys + (size_t)t * head_dim, head_dim);
        if (scores[t] > max_score) max_score = scores[t];
    }
    double sum = 0.0;
    for (int64_t t = 0; t < n_tokens; t++) {
        scores[t] = expf(scores[t] - max_score);
        sum += scores[t];
    }
    /* out = scores . values, 16 dims at a time as a panel whose rows are tokens. */
    float inv_sum = (float)(1.0 / sum);
    int32_t d = 0;
    for (; d + LLAMA_PANEL_ROWS <= head_dim; d += LLAMA_PANEL_ROWS) {
        float acc[LLAMA_PANEL_ROWS];
        panel_times(values + d, (size_t)head_dim, scores, (int32_t)n_tokens, acc);
        for (int32_t j = 0; j < LLAMA_PANEL_ROWS; j++) out[d + j] = acc[j] * inv_sum;
    }
    for (; d < head_dim; d++) {
        float acc = 0.0f;
        for (int64_t t = 0; t < n_tokens; t++) acc += scores[t] * values[(size_t)t * head_dim + d];
        out[d] = acc * inv_sum;
    }
}

static llama_result kv_fp32_attend(void *state, int32_t layer, int32_t kv_head, const float *q,
                                   int32_t n_q, float scale, float *out) {
    kv_fp32 *kv = state;
    if (layer < 0 || layer >= kv->n_layers || kv_head < 0 || kv_head >= kv->n_kv_heads)
        return LLAMA_ERR_ARGUMENT;
    int64_t n_tokens = kv->n_tokens[layer];
    if (n_tokens == 0) return LLAMA_ERR_ARGUMENT;
    const float *keys = kv->k + kv_fp32_offset(kv, layer, kv_head, 0);
    const float *values = kv->v + kv_fp32_offset(kv, layer, kv_head, 0);
    float *scores = kv->scores + (size_t)kv_head * (size_t)kv->capacity;
    for (int32_t h = 0; h < n_q; h++)
        llama_attend_rows(keys, values, n_tokens, kv->head_dim, q + (size_t)h * kv->head_dim, scale,
                          scores, out + (size_t)h * kv->head_dim);
    return LLAMA_OK;
}

static void kv_fp32_begin_request(void *state, int64_t pos) {
    (void)state; /* a full-precision cache keeps everything; nothing to re-tag */
    (void)pos;
}

static void kv_fp32_reset(void *state) {
    kv_fp32 *kv = state;
    memset(kv->n_tokens, 0, (size_t)kv->n_layers * sizeof *kv->n_tokens);
}

static void kv_fp32_stats(const void *state, llama_kv_stats *out) {
    const kv_fp32 *kv = state;
    int64_t n_tokens = kv->n_tokens[0];
    memset(out, 0, sizeof *out); /* packs nothing */
    out->n_tokens = n_tokens;
    out->bytes = 2 * (size_t)n_tokens * (size_t)kv->n_layers * (size_t)kv->n_kv_heads *
                 (size_t)kv->head_dim * sizeof(float);
    out->avg_bits = 32.0;
}

static void kv_fp32_destroy(void *state) {
    kv_fp32 *kv = state;
    if (kv == NULL) return;
    free(kv->n_tokens);
    free(kv->k);
    free(kv->v);
    free(kv->scores);
    free(kv);
}

llama_result llama_kv_fp32_create(const llama_config *config, int64_t capacity,
                                  llama_kv_cache *out) {
    if (config == NULL || out == NULL || capacity < 1 || capacity > LLAMA_MAX_CONFIG_DIM)
        return LLAMA_ERR_ARGUMENT;
    kv_fp32 *kv = calloc(1, sizeof *kv);
    if (kv == NULL) return LLAMA_ERR_MEMORY;
    kv->n_layers = config->n_layers;
    kv->n_kv_heads = config->n_kv_heads;
    kv->head_dim = config->head_dim;
    kv->capacity = capacity;
    size_t n_floats = kv_fp32_offset(kv, kv->n_layers, 0, 0);
    kv->n_tokens = calloc((size_t)kv->n_layers, sizeof *kv->n_tokens);
    kv->k = malloc(n_floats * sizeof(float));
    kv->v = malloc(n_floats * sizeof(float));
    kv->scores = malloc((size_t)kv->n_kv_heads * (size_t)capacity * sizeof(float));
    if (!kv->n_tokens || !kv->k || !kv->v || !kv->scores) {
        kv_fp32_destroy(kv);
        return LLAMA_ERR_MEMORY;
    }
    *out = (llama_kv_cache){kv,
                            kv_fp32_store,
                            kv_fp32_attend,
                            kv_fp32_begin_request,
                            kv_fp32_reset,
                            kv_fp32_stats,
                            kv_fp32_destroy,
                            NULL};
    return LLAMA_OK;
}

// >>capture

static size_t capture_q_floats(const llama_capture *cap) {
    return (size_t)cap->n_tokens * (size_t)cap->n_heads * (size_t)cap->head_dim;
}

static size_t capture_kv_floats(const llama_capture *cap) {
    return (size_t)cap->n_tokens * (size_t)cap->n_kv_heads * (size_t)cap->head_dim;
}

static llama_result capture_alloc(llama_capture *cap) {
    size_t layers = (size_t)cap->n_layers;
    cap->token_ids = calloc((size_t)cap->n_tokens, sizeof *cap->token_ids);
    cap->q = calloc(layers * capture_q_floats(cap), sizeof(float));
    cap->k = calloc(layers * capture_kv_floats(cap), sizeof(float));
    cap->v = calloc(layers * capture_kv_floats(cap), sizeof(float));
    if (!cap->token_ids || !cap->q || !cap->k || !cap->v) {
        llama_capture_free(cap);
        return LLAMA_ERR_MEMORY;
    }
    return LLAMA_OK;
}

llama_result llama_capture_init(llama_capture *cap, const llama_config *config, int32_t n_tokens) {
    if (cap == NULL || config == NULL || n_tokens < 1 || n_tokens > LLAMA_CAPTURE_MAX_DIM)
        return LLAMA_ERR_ARGUMENT;
    *cap = (llama_capture){config->n_layers,
                           config->n_heads,
                           config->n_kv_heads,
                           config->head_dim,
                           n_tokens,
                           NULL,
                           NULL,
                           NULL,
                           NULL};
    return capture_alloc(cap);
}

void llama_capture_free(llama_capture *cap) {
    if (cap == NULL) return;
    free(cap->token_ids);
    free(cap->q);
    free(cap->k);
    free(cap->v);
    memset(cap, 0, sizeof *cap);
}

typedef struct kv_capture {
    llama_kv_cache inner;
    llama_capture *cap;
    int64_t *last_pos; /* [n_layers]: the position attend() is answering for */
} kv_capture;

static llama_result kv_capture_store(void *state, int32_t layer, int64_t pos, const float *k,
                                     const float *v) {
    kv_capture *w = state;
    const llama_capture *cap = w->cap;
    if (layer < 0 || layer >= cap->n_layers) return LLAMA_ERR_ARGUMENT;
    w->last_pos[layer] = pos;
    if (pos >= 0 && pos < cap->n_tokens) {
        size_t row = (size_t)cap->n_kv_heads * (size_t)cap->head_dim;
        size_t at = (size_t)layer * capture_kv_floats(cap) + (size_t)pos * row;
        memcpy(cap->k + at, k, row * sizeof(float));
        memcpy(cap->v + at, v, row * sizeof(float));
    }
    return w->inner.store(w->inner.state, layer, pos, k, v);
}

static llama_result kv_capture_attend(void *state, int32_t layer, int32_t kv_head, const float *q,
                                      int32_t n_q, float scale, float *out) {
    kv_capture *w = state;
    const llama_capture *cap = w->cap;
    int64_t pos = layer >= 0 && layer < cap->n_layers ? w->last_pos[layer] : -1;
    bool shape_ok = kv_head >= 0 && n_q == cap->n_heads / cap->n_kv_heads;
    if (shape_ok && pos >= 0 && pos < cap->n_tokens) {
        size_t row = (size_t)cap->n_heads * (size_t)cap->head_dim;
        size_t at = (size_t)layer * capture_q_floats(cap) + (size_t)pos * row +
                    (size_t)kv_head * (size_t)n_q * (size_t)cap->head_dim;
        memcpy(cap->q + at, q, (size_t)n_q * (size_t)cap->head_dim * sizeof(float));
    }
    return w->inner.attend(w->inner.state, layer, kv_head, q, n_q, scale, out);
}

static void kv_capture_begin_request(void *state, int64_t pos) {
    kv_capture *w = state;
    w->inner.begin_request(w->inner.state, pos);
}

static void kv_capture_on_token(void *state, int64_t pos, int32_t id) {
    kv_capture *w = state;
    w->inner.on_token(w->inner.state, pos, id);
}

static void kv_capture_reset(void *state) {
    kv_capture *w = state;
    w->inner.reset(w->inner.state);
}

static void kv_capture_stats(const void *state, llama_kv_stats *out) {
    const kv_capture *w = state;
    w->inner.stats(w->inner.state, out);
}

static void kv_capture_destroy(void *state) {
    kv_capture *w = state;
    if (w == NULL) return;
    free(w->last_pos);
    free(w);
}

llama_result llama_kv_capture_wrap(llama_kv_cache *inner, llama_capture *cap, llama_kv_cache *out) {
    if (inner == NULL || cap == NULL || out == NULL || cap->n_layers < 1) return LLAMA_ERR_ARGUMENT;
    kv_capture *w = calloc(1, sizeof *w);
    if (w == NULL) return LLAMA_ERR_MEMORY;
    w->last_pos = calloc((size_t)cap->n_layers, sizeof *w->last_pos);
    if (w->last_pos == NULL) {
        free(w);
        return LLAMA_ERR_MEMORY;
    }
    w->inner = *inner;
    w->cap = cap;
    *out = (llama_kv_cache){w,
                            kv_capture_store,
                            kv_capture_attend,
                            kv_capture_begin_request,
                            kv_capture_reset,
                            kv_capture_stats,
                            kv_capture_destroy,
                            inner->on_token != NULL ? kv_capture_on_token : NULL};
    return LLAMA_OK;
}

static void put_u32_le(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

/* Writes n 32-bit words (floats or ints, by their bits) little-endian, a chunk at a time. */
static bool write_words(FILE *f, const void *words, size_t n) {
    uint8_t chunk[4096];
    const uint8_t *src = words;
    for (size_t done = 0; done < n;) {
        size_t batch = n - done < sizeof chunk / 4 ? n - done : sizeof chunk / 4;
        for (size_t i = 0; i < batch; i++) {
            uint32_t word;
            memcpy(&word, src + (done + i) * 4, 4);
            put_u32_le(chunk + i * 4, word);
        }
        if (fwrite(chunk, 4, batch, f) != batch) return false;
        done += batch;
    }
    return true;
}

llama_result llama_capture_write(const llama_capture *cap, const char *path, char *err,
                                 size_t err_bytes) {
    if (cap == NULL || path == NULL || cap->q == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "capture: nothing to write");
    FILE *f = fopen(path, "wb");
    if (f == NULL) return llama_fail(err, err_bytes, LLAMA_ERR_IO, "cannot create %s", path);
    uint8_t header[LLAMA_CAPTURE_HEADER_BYTES];
    memcpy(header, "KVMXCAPT", 8);
    const uint32_t fields[] = {LLAMA_CAPTURE_VERSION,   (uint32_t)cap->n_layers,
                               (uint32_t)cap->n_heads,  (uint32_t)cap->n_kv_heads,
                               (uint32_t)cap->head_dim, (uint32_t)cap->n_tokens};
    for (size_t i = 0; i < 6; i++) put_u32_le(header + 8 + 4 * i, fields[i]);
    bool ok = fwrite(header, 1, sizeof header, f) == sizeof header &&
              write_words(f, cap->token_ids, (size_t)cap->n_tokens);
    for (int32_t l = 0; l < cap->n_layers && ok; l++) {
        ok = write_words(f, cap->q + (size_t)l * capture_q_floats(cap), capture_q_floats(cap)) &&
             write_words(f, cap->k + (size_t)l * capture_kv_floats(cap), capture_kv_floats(cap)) &&
             write_words(f, cap->v + (size_t)l * capture_kv_floats(cap), capture_kv_floats(cap));
    }
    if (fclose(f) != 0) ok = false;
    return ok ? LLAMA_OK : llama_fail(err, err_bytes, LLAMA_ERR_IO, "cannot write %s", path);
}

static void read_words(const uint8_t *src, void *dst, size_t n) {
    uint8_t *out = dst;
    for (size_t i = 0; i < n; i++) {
        uint32_t word = get_u32_le(src + 4 * i);
        memcpy(out + 4 * i, &word, 4);
    }
}

/* Total file bytes the header's dimensions imply, or false when that overflows. */
static bool capture_expected_bytes(const llama_capture *cap, uint64_t *total) {
    uint64_t per_token = (uint64_t)(cap->n_heads + 2 * cap->n_kv_heads) * (uint64_t)cap->head_dim;
    uint64_t floats;
    if (!mul_fits(per_token, (uint64_t)cap->n_tokens, SIZE_MAX / 4, &floats) ||
        !mul_fits(floats, (uint64_t)cap->n_layers, SIZE_MAX / 4, &floats))
        return false;
    uint64_t words = floats + (uint64_t)cap->n_tokens;
    if (words > (SIZE_MAX - LLAMA_CAPTURE_HEADER_BYTES) / 4) return false;
    *total = LLAMA_CAPTURE_HEADER_BYTES + 4 * words;
    return true;
}

static llama_result capture_parse_header(const uint8_t *bytes, size_t n_bytes, llama_capture *cap,
                                         char *err, size_t err_bytes) {
    if (n_bytes < LLAMA_CAPTURE_HEADER_BYTES)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "capture of %zu bytes is shorter than its header", n_bytes);
    if (memcmp(bytes, "KVMXCAPT", 8) != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT, "not a capture: bad magic");
    uint32_t version = get_u32_le(bytes + 8);
    if (version != LLAMA_CAPTURE_VERSION)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "capture version %u, expected %d",
                          version, LLAMA_CAPTURE_VERSION);
    int32_t *dims[] = {&cap->n_layers, &cap->n_heads, &cap->n_kv_heads, &cap->head_dim,
                       &cap->n_tokens};
    for (size_t i = 0; i < 5; i++) {
        uint32_t v = get_u32_le(bytes + 12 + 4 * i);
        if (v < 1 || v > LLAMA_CAPTURE_MAX_DIM)
            return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                              "capture dimension %zu is %u, outside [1, %d]", i, v,
                              LLAMA_CAPTURE_MAX_DIM);
        *dims[i] = (int32_t)v;
    }
    if (cap->n_heads % cap->n_kv_heads != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "capture: %d heads not a multiple of %d kv heads", cap->n_heads,
                          cap->n_kv_heads);
    uint64_t expected = 0;
    if (!capture_expected_bytes(cap, &expected) || expected != n_bytes)
        return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                          "capture holds %zu bytes, its header implies %llu", n_bytes,
                          (unsigned long long)expected);
    return LLAMA_OK;
}

llama_result llama_capture_parse(const uint8_t *bytes, size_t n_bytes, llama_capture *cap,
                                 char *err, size_t err_bytes) {
    if (cap == NULL || (bytes == NULL && n_bytes > 0))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "capture: NULL argument");
    memset(cap, 0, sizeof *cap);
    llama_result r = capture_parse_header(bytes, n_bytes, cap, err, err_bytes);
    if (r != LLAMA_OK) return r;
    if (capture_alloc(cap) != LLAMA_OK)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "cannot allocate a %zu-byte capture",
                          n_bytes);
    const uint8_t *p = bytes + LLAMA_CAPTURE_HEADER_BYTES;
    read_words(p, cap->token_ids, (size_t)cap->n_tokens);
    p += 4 * (size_t)cap->n_tokens;
    for (int32_t t = 0; t < cap->n_tokens; t++) {
        if (cap->token_ids[t] < 0) {
            int32_t bad = cap->token_ids[t];
            llama_capture_free(cap);
            return llama_fail(err, err_bytes, LLAMA_ERR_FORMAT,
                              "capture token %d has negative id %d", t, bad);
        }
    }
    size_t q_floats = capture_q_floats(cap), kv_floats = capture_kv_floats(cap);
    for (int32_t l = 0; l < cap->n_layers; l++) {
        read_words(p, cap->q + (size_t)l * q_floats, q_floats);
        p += 4 * q_floats;
        read_words(p, cap->k + (size_t)l * kv_floats, kv_floats);
        p += 4 * kv_floats;
        read_words(p, cap->v + (size_t)l * kv_floats, kv_floats);
        p += 4 * kv_floats;
    }
    return LLAMA_OK;
}

// >>score

bool llama_is_message_start(const llama_tokenizer *tok, const int32_t *ids, int64_t n, int64_t i,
                            const char *role) {
    if (i < 0 || i >= n || ids[i] != llama_special_id(tok, "<|im_start|>")) return false;
    size_t role_bytes = strlen(role);
    if ((uint64_t)(n - i - 1) < role_bytes + 1) return false;
    for (size_t j = 0; j < role_bytes; j++)
        if (ids[i + 1 + (int64_t)j] != (uint8_t)role[j]) return false;
    return ids[i + 1 + (int64_t)role_bytes] == '\n';
}

int64_t llama_message_text(const llama_tokenizer *tok, const int32_t *ids, int64_t n, int64_t i,
                           const char *role) {
    return llama_is_message_start(tok, ids, n, i, role) ? i + 2 + (int64_t)strlen(role) : -1;
}

bool llama_message_opens_with(const llama_tokenizer *tok, const int32_t *ids, int64_t n, int64_t i,
                              const char *role, const char *prefix) {
    int64_t text = llama_message_text(tok, ids, n, i, role), len = (int64_t)strlen(prefix);
    if (text < 0 || text + len > n) return false;
    for (int64_t j = 0; j < len; j++)
        if (ids[text + j] != (uint8_t)prefix[j]) return false;
    return true;
}

void llama_mark_answer_tokens(const llama_tokenizer *tok, const int32_t *ids, int64_t n,
                              uint8_t *mask) {
    const int32_t im_end = llama_special_id(tok, "<|im_end|>");
    const int32_t think_end = llama_special_id(tok, "</think>");
    const int32_t call_open = llama_special_id(tok, "<tool_call>");
    const int32_t call_close = llama_special_id(tok, "</tool_call>");
    bool in_assistant = false, after_think = false, in_call = false;
    memset(mask, 0, (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        if (llama_is_message_start(tok, ids, n, i, "assistant")) {
            in_assistant = true;
            after_think = in_call = false;
            i += (int64_t)strlen("assistant\n"); /* the header is never an answer */
            continue;
        }
        if (!in_assistant) continue;
        /* Decided before this token updates the state: opening markers are out, closing ones in. */
        mask[i] = after_think || in_call;
        if (ids[i] == think_end) after_think = true;
        if (ids[i] == call_open) in_call = true;
        if (ids[i] == call_close) in_call = false;
        if (ids[i] == im_end) in_assistant = false;
    }
}

double llama_bits_of(const float *logits, int32_t vocab, int32_t target) {
    float max_logit = logits[0];
    for (int32_t i = 1; i < vocab; i++)
        if (logits[i] > max_logit) max_logit = logits[i];
    double sum = 0.0;
    for (int32_t i = 0; i < vocab; i++) sum += exp((double)logits[i] - max_logit);
    return (log(sum) - ((double)logits[target] - max_logit)) / log(2.0);
}

int32_t llama_argmax(const float *logits, int32_t vocab) {
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

llama_result llama_score_sequence(llama_runner *runner, llama_kv_cache *cache, const int32_t *ids,
                                  int64_t n, const uint8_t *mask, int32_t *argmax_out,
                                  const int32_t *ref_argmax, llama_score *score, char *err,
                                  size_t err_bytes) {
    return llama_score_sequence_hooked(runner, cache, ids, n, mask, argmax_out, ref_argmax, NULL,
                                       score, err, err_bytes);
}

llama_result llama_score_sequence_hooked(llama_runner *runner, llama_kv_cache *cache,
                                         const int32_t *ids, int64_t n, const uint8_t *mask,
                                         int32_t *argmax_out, const int32_t *ref_argmax,
                                         const llama_step_hook *hook, llama_score *score, char *err,
                                         size_t err_bytes) {
    if (runner == NULL || cache == NULL || ids == NULL || score == NULL)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "score: NULL argument");
    const llama_model *m = runner->model;
    if (n < 2 || n > (int64_t)m->config.context + 1)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "score: %lld tokens, need 2 to context + 1", (long long)n);
    cache->reset(cache->state);
    for (int64_t pos = 0; pos + 1 < n; pos++) {
        if (llama_is_message_start(&m->tokenizer, ids, n, pos, "user"))
            cache->begin_request(cache->state, pos);
        llama_result r = hook != NULL ? hook->before(hook->user, pos, err, err_bytes) : LLAMA_OK;
        if (r == LLAMA_OK)
            r = llama_forward(runner, cache, ids[pos], pos, runner->logits, err, err_bytes);
        if (r != LLAMA_OK) return r;
        int32_t next = ids[pos + 1], top = llama_argmax(runner->logits, m->config.vocab);
        if (next < 0 || next >= m->config.vocab)
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "token %d is outside the vocab",
                              next);
        score->bits += llama_bits_of(runner->logits, m->config.vocab, next);
        score->n_scored++;
        if (argmax_out != NULL) argmax_out[pos] = top;
        if (mask != NULL && mask[pos + 1]) {
            score->n_answer++;
            score->n_answer_correct += top == next;
            score->n_answer_agree += ref_argmax != NULL && top == ref_argmax[pos];
        }
    }
    return LLAMA_OK;
}
