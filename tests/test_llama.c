/* Tests for the Llama runner: tokenizer, safetensors/config errors, the forward pass against a
 * plain double-precision reference on a tiny random model, the fp32 cache, captures, answer marks,
 * and the quality of kvm-small on a slice of eval-dev; then the policies and the kvmix-backed
 * cache (test_policy.c).
 * Usage: test_llama [SHARED_DIR]; SHARED_DIR (default ../shared, beside the repository root)
 * holds models/kvm-small.safetensors and data/eval-dev.jsonl. A missing model is a failure.
 * Prints one line per failed check and "N passed, N failed"; exits nonzero on any failure. */
#define _POSIX_C_SOURCE 200809L
#include "llama.h"
#include "test_policy.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Each text of the quality slice is cut to this many ids: enough for real long-range attention,
 * short enough to run in seconds under the sanitizers. */
enum { SLICE_TOKENS = 768 };

/* Bits per token of kvm-small over the first 3 trace and 2 code texts of eval-dev (each cut to
 * SLICE_TOKENS ids), measured with this runner (fp32 cache), whose full 60 + 60 text runs match
 * the model card's figures within 1%. */
static const double SMALL_SLICE_BITS = 0.414725;

static int n_passed, n_failed;

static bool check_at(bool ok, int line, const char *what) {
    if (ok)
        n_passed++;
    else {
        n_failed++;
        printf("FAIL line %d: %s\n", line, what);
    }
    return ok;
}
#define CHECK(cond) check_at((cond), __LINE__, #cond)

/* An error result with a message that mentions `word`. */
static bool check_error_at(llama_result got, llama_result want, const char *err, const char *word,
                           int line) {
    char what[640];
    snprintf(what, sizeof what, "expected %s mentioning \"%s\", got %s: %s",
             llama_result_string(want), word, llama_result_string(got), err);
    return check_at(got == want && strstr(err, word) != NULL, line, what);
}
#define CHECK_ERROR(got, want, err, word) check_error_at((got), (want), (err), (word), __LINE__)

/* ------------------------------------------------------------------------------------------------
 * A tiny random model, written as safetensors
 */
typedef struct tiny_tensor {
    char name[LLAMA_MAX_NAME];
    int32_t rows, cols; /* cols == 0: a vector */
    float *data;
} tiny_tensor;

enum { TINY_MAX_TENSORS = 16 };

typedef struct tiny_model {
    llama_config config;
    tiny_tensor tensors[TINY_MAX_TENSORS];
    int32_t n_tensors;
} tiny_model;

static const char TINY_CONFIG[] =
    "{\"model_type\": \"llama\", \"name\": \"tiny\", \"hidden_size\": 32, \"num_hidden_layers\": 1,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
    " \"intermediate_size\": 40, \"max_position_embeddings\": 16, \"rope_theta\": 10000.0,"
    " \"rms_norm_eps\": 1e-05, \"tie_word_embeddings\": true, \"vocab_size\": 268,"
    " \"tokenizer\": {\"special_tokens\": {\"<|endoftext|>\": 256, \"<|im_start|>\": 257,"
    " \"<|im_end|>\": 258, \"<think>\": 259, \"</think>\": 260, \"<tool_call>\": 261,"
    " \"</tool_call>\": 262, \"<tool_response>\": 263, \"</tool_response>\": 264,"
    " \"<|vision_start|>\": 265, \"<|vision_end|>\": 266, \"<|image_pad|>\": 267}}}";

static uint32_t next_random(uint32_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 17;
    *state ^= *state << 5;
    return *state;
}

/* Multiples of 1/64 in [-1, 1] (plus `center`): exact in F16, BF16 and F32 alike. */
static void fill_exact(float *data, size_t n, float center, uint32_t *rng) {
    for (size_t i = 0; i < n; i++)
        data[i] = center + (float)((int32_t)(next_random(rng) % 129) - 64) / 64.0f;
}

static void tiny_add(tiny_model *t, const char *name, int32_t layer, int32_t rows, int32_t cols,
                     float center, uint32_t *rng) {
    tiny_tensor *x = &t->tensors[t->n_tensors++];
    snprintf(x->name, sizeof x->name, name, layer);
    x->rows = rows;
    x->cols = cols;
    size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
    x->data = malloc(n * sizeof(float));
    fill_exact(x->data, n, center, rng);
    if (cols > 0) /* keep activations moderate: weights scaled by 1/4, still exact */
        for (size_t i = 0; i < n; i++) x->data[i] *= 0.25f;
}

static void tiny_build(tiny_model *t) {
    llama_tokenizer tok;
    char err[256];
    memset(t, 0, sizeof *t);
    llama_config_parse(TINY_CONFIG, strlen(TINY_CONFIG), &t->config, &tok, err, sizeof err);
    const llama_config *c = &t->config;
    uint32_t rng = 12345;
    int32_t q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
    tiny_add(t, "model.embed_tokens.weight", 0, c->vocab, c->hidden, 0.0f, &rng);
    tiny_add(t, "model.norm.weight", 0, c->hidden, 0, 1.0f, &rng);
    tiny_add(t, "model.layers.%d.input_layernorm.weight", 0, c->hidden, 0, 1.0f, &rng);
    tiny_add(t, "model.layers.%d.post_attention_layernorm.weight", 0, c->hidden, 0, 1.0f, &rng);
    tiny_add(t, "model.layers.%d.self_attn.q_proj.weight", 0, q, c->hidden, 0.0f, &rng);
    tiny_add(t, "model.layers.%d.self_attn.k_proj.weight", 0, kv, c->hidden, 0.0f, &rng);
    tiny_add(t, "model.layers.%d.self_attn.v_proj.weight", 0, kv, c->hidden, 0.0f, &rng);
    tiny_add(t, "model.layers.%d.self_attn.o_proj.weight", 0, c->hidden, q, 0.0f, &rng);
    tiny_add(t, "model.layers.%d.mlp.gate_proj.weight", 0, c->ffn, c->hidden, 0.0f, &rng);
    tiny_add(t, "model.layers.%d.mlp.up_proj.weight", 0, c->ffn, c->hidden, 0.0f, &rng);
    tiny_add(t, "model.layers.%d.mlp.down_proj.weight", 0, c->hidden, c->ffn, 0.0f, &rng);
}

static void tiny_free(tiny_model *t) {
    for (int32_t i = 0; i < t->n_tensors; i++) free(t->tensors[i].data);
}

static const float *tiny_get(const tiny_model *t, const char *name) {
    for (int32_t i = 0; i < t->n_tensors; i++)
        if (strcmp(t->tensors[i].name, name) == 0) return t->tensors[i].data;
    return NULL;
}

/* The bytes of an exactly representable float in the given dtype, little-endian. */
static size_t encode_value(float f, const char *dtype, uint8_t *out) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (strcmp(dtype, "F32") == 0) {
        for (int i = 0; i < 4; i++) out[i] = (uint8_t)(bits >> (8 * i));
        return 4;
    }
    uint16_t half;
    if (strcmp(dtype, "BF16") == 0)
        half = (uint16_t)(bits >> 16);
    else if (f == 0.0f)
        half = (uint16_t)((bits >> 16) & 0x8000);
    else
        half = (uint16_t)(((bits >> 16) & 0x8000) | ((((bits >> 23) & 0xff) - 112) << 10) |
                          ((bits >> 13) & 0x3ff));
    out[0] = (uint8_t)half;
    out[1] = (uint8_t)(half >> 8);
    return 2;
}

/* The header as a cJSON tree (so a test can break it), and the data section. */
typedef struct tiny_file {
    cJSON *header;
    uint8_t *data;
    size_t data_bytes;
} tiny_file;

static void tiny_encode(const tiny_model *t, const char *dtype, bool with_config, tiny_file *f) {
    size_t elem = strcmp(dtype, "F32") == 0 ? 4 : 2, total = 0;
    for (int32_t i = 0; i < t->n_tensors; i++)
        total += (size_t)t->tensors[i].rows *
                 (size_t)(t->tensors[i].cols ? t->tensors[i].cols : 1) * elem;
    f->header = cJSON_CreateObject();
    f->data = malloc(total);
    f->data_bytes = 0;
    if (with_config) {
        cJSON *meta = cJSON_AddObjectToObject(f->header, "__metadata__");
        cJSON_AddStringToObject(meta, "config", TINY_CONFIG);
    }
    for (int32_t i = 0; i < t->n_tensors; i++) {
        const tiny_tensor *x = &t->tensors[i];
        size_t n = (size_t)x->rows * (size_t)(x->cols ? x->cols : 1), begin = f->data_bytes;
        for (size_t j = 0; j < n; j++)
            f->data_bytes += encode_value(x->data[j], dtype, f->data + f->data_bytes);
        cJSON *entry = cJSON_AddObjectToObject(f->header, x->name);
        cJSON_AddStringToObject(entry, "dtype", dtype);
        const int shape[2] = {x->rows, x->cols};
        cJSON_AddItemToObject(entry, "shape", cJSON_CreateIntArray(shape, x->cols ? 2 : 1));
        cJSON *offsets = cJSON_AddArrayToObject(entry, "data_offsets");
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)begin));
        cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)f->data_bytes));
    }
}

/* Writes the file, keeping only its first keep_bytes bytes when keep_bytes is not SIZE_MAX. */
static bool tiny_write(const tiny_file *f, const char *path, size_t keep_bytes) {
    char *json = cJSON_PrintUnformatted(f->header);
    size_t json_bytes = strlen(json), total = 8 + json_bytes + f->data_bytes;
    uint8_t *file = malloc(total);
    for (int i = 0; i < 8; i++) file[i] = (uint8_t)((uint64_t)json_bytes >> (8 * i));
    memcpy(file + 8, json, json_bytes);
    memcpy(file + 8 + json_bytes, f->data, f->data_bytes);
    FILE *out = fopen(path, "wb");
    size_t n = keep_bytes < total ? keep_bytes : total;
    bool ok = out != NULL && fwrite(file, 1, n, out) == n;
    if (out != NULL) ok = fclose(out) == 0 && ok;
    free(json);
    free(file);
    return ok;
}

static void tiny_file_free(tiny_file *f) {
    cJSON_Delete(f->header);
    free(f->data);
}

static char temp_dir[64];

static const char *temp_path(const char *name) {
    static char path[128];
    snprintf(path, sizeof path, "%s/%s", temp_dir, name);
    return path;
}

/* ------------------------------------------------------------------------------------------------
 * Reference forward pass: plain loops in double over the row-major tiny weights, keeping every
 * key and value; written from the model card, sharing nothing with llama.c.
 */
typedef struct reference {
    const tiny_model *t;
    double *keys, *values; /* [context, n_kv_heads * head_dim] */
} reference;

static void ref_matvec(const float *w, int32_t rows, int32_t cols, const double *x, double *y) {
    for (int32_t r = 0; r < rows; r++) {
        double s = 0;
        for (int32_t i = 0; i < cols; i++) s += (double)w[(size_t)r * cols + i] * x[i];
        y[r] = s;
    }
}

static void ref_norm(const double *x, const float *w, int32_t n, double eps, double *y) {
    double ss = 0;
    for (int32_t i = 0; i < n; i++) ss += x[i] * x[i];
    double scale = 1.0 / sqrt(ss / n + eps);
    for (int32_t i = 0; i < n; i++) y[i] = x[i] * scale * w[i];
}

static void ref_rope(double *head, int32_t dim, int64_t pos, double theta) {
    for (int32_t i = 0; i < dim / 2; i++) {
        double angle = (double)pos * pow(theta, -2.0 * i / dim), a = head[i], b = head[i + dim / 2];
        head[i] = a * cos(angle) - b * sin(angle);
        head[i + dim / 2] = b * cos(angle) + a * sin(angle);
    }
}

static void ref_attention(const reference *ref, const double *q, int64_t pos, double *out) {
    const llama_config *c = &ref->t->config;
    int32_t d = c->head_dim, kv_width = c->n_kv_heads * d, group = c->n_heads / c->n_kv_heads;
    double *w = malloc((size_t)(pos + 1) * sizeof *w);
    for (int32_t h = 0; h < c->n_heads; h++) {
        int32_t kv = h / group;
        double max = -INFINITY, sum = 0;
        for (int64_t t = 0; t <= pos; t++) {
            double s = 0;
            for (int32_t i = 0; i < d; i++)
                s += q[h * d + i] * ref->keys[t * kv_width + kv * d + i];
            w[t] = s / sqrt((double)d);
            if (w[t] > max) max = w[t];
        }
        for (int64_t t = 0; t <= pos; t++) sum += (w[t] = exp(w[t] - max));
        for (int32_t i = 0; i < d; i++) {
            double o = 0;
            for (int64_t t = 0; t <= pos; t++)
                o += w[t] / sum * ref->values[t * kv_width + kv * d + i];
            out[h * d + i] = o;
        }
    }
    free(w);
}

static void ref_forward(reference *ref, int32_t token, int64_t pos, double *logits) {
    const tiny_model *t = ref->t;
    const llama_config *c = &t->config;
    int32_t H = c->hidden, d = c->head_dim, q_width = c->n_heads * d, kv_width = c->n_kv_heads * d;
    double x[64], xn[64], q[128], att[128], tmp[64], gate[64], up[64];
    for (int32_t i = 0; i < H; i++)
        x[i] = tiny_get(t, "model.embed_tokens.weight")[(size_t)token * H + i];
    ref_norm(x, tiny_get(t, "model.layers.0.input_layernorm.weight"), H, c->norm_eps, xn);
    ref_matvec(tiny_get(t, "model.layers.0.self_attn.q_proj.weight"), q_width, H, xn, q);
    ref_matvec(tiny_get(t, "model.layers.0.self_attn.k_proj.weight"), kv_width, H, xn,
               ref->keys + pos * kv_width);
    ref_matvec(tiny_get(t, "model.layers.0.self_attn.v_proj.weight"), kv_width, H, xn,
               ref->values + pos * kv_width);
    for (int32_t h = 0; h < c->n_heads; h++) ref_rope(q + h * d, d, pos, c->rope_theta);
    for (int32_t h = 0; h < c->n_kv_heads; h++)
        ref_rope(ref->keys + pos * kv_width + h * d, d, pos, c->rope_theta);
    ref_attention(ref, q, pos, att);
    ref_matvec(tiny_get(t, "model.layers.0.self_attn.o_proj.weight"), H, q_width, att, tmp);
    for (int32_t i = 0; i < H; i++) x[i] += tmp[i];
    ref_norm(x, tiny_get(t, "model.layers.0.post_attention_layernorm.weight"), H, c->norm_eps, xn);
    ref_matvec(tiny_get(t, "model.layers.0.mlp.gate_proj.weight"), c->ffn, H, xn, gate);
    ref_matvec(tiny_get(t, "model.layers.0.mlp.up_proj.weight"), c->ffn, H, xn, up);
    for (int32_t i = 0; i < c->ffn; i++) gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i];
    ref_matvec(tiny_get(t, "model.layers.0.mlp.down_proj.weight"), H, c->ffn, gate, tmp);
    for (int32_t i = 0; i < H; i++) x[i] += tmp[i];
    ref_norm(x, tiny_get(t, "model.norm.weight"), H, c->norm_eps, xn);
    const float *head = tiny_get(t, "lm_head.weight"); /* the embeddings when tied */
    ref_matvec(head != NULL ? head : tiny_get(t, "model.embed_tokens.weight"), c->vocab, H, xn,
               logits);
}

/* ------------------------------------------------------------------------------------------------
 * Tests
 */
static void test_tokenizer(void) {
    llama_config config;
    llama_tokenizer tok;
    char err[256] = "";
    CHECK(llama_config_parse(TINY_CONFIG, strlen(TINY_CONFIG), &config, &tok, err, sizeof err) ==
          LLAMA_OK);
    const char text[] = "<|im_start|>user\nh\xc3\xa9 \xe6\x97\xa5 <tool_call>{\"a\": 1}</tool_call>"
                        "<|im_end|> <think <|im_end| </think><";
    int32_t ids[sizeof text];
    int64_t n = 0;
    CHECK(llama_tokenize(&tok, text, strlen(text), ids, &n) == LLAMA_OK);
    CHECK(n > 0 && ids[0] == 257);
    CHECK(llama_special_id(&tok, "</tool_call>") == 262 && llama_special_id(&tok, "<nope>") == -1);
    int32_t n_special = 0;
    for (int64_t i = 0; i < n; i++) n_special += ids[i] >= 256;
    CHECK(n_special == 5); /* "<think " and "<|im_end| " are not special tokens */
    char decoded[sizeof text];
    size_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        size_t len;
        const char *bytes = llama_token_bytes(&tok, ids[i], &len);
        if (!CHECK(bytes != NULL && at + len < sizeof decoded)) return;
        memcpy(decoded + at, bytes, len);
        at += len;
    }
    CHECK(at == strlen(text) && memcmp(decoded, text, at) == 0);
    size_t len;
    CHECK(llama_token_bytes(&tok, 300, &len) == NULL);
}

static void test_config_errors(void) {
    llama_config config;
    llama_tokenizer tok;
    char err[256] = "";
    const char *bad_json = "{\"hidden_size\": 32,";
    CHECK_ERROR(llama_config_parse(bad_json, strlen(bad_json), &config, &tok, err, sizeof err),
                LLAMA_ERR_FORMAT, err, "malformed");
    const char *missing = "{\"hidden_size\": 32}";
    CHECK_ERROR(llama_config_parse(missing, strlen(missing), &config, &tok, err, sizeof err),
                LLAMA_ERR_FORMAT, err, "num_hidden_layers");
    const char *scaled =
        "{\"hidden_size\": 32, \"num_hidden_layers\": 1, \"num_attention_heads\": 4,"
        " \"intermediate_size\": 8, \"max_position_embeddings\": 8, \"vocab_size\": 300,"
        " \"rope_scaling\": {\"type\": \"linear\"}}";
    CHECK_ERROR(llama_config_parse(scaled, strlen(scaled), &config, &tok, err, sizeof err),
                LLAMA_ERR_UNSUPPORTED, err, "rope_scaling");
}

/* Loads a tiny file variant and checks the error. */
static void expect_load_error(const tiny_file *f, size_t keep_bytes, llama_result want,
                              const char *word) {
    llama_model model;
    char err[256] = "";
    const char *path = temp_path("bad.safetensors");
    if (!CHECK(tiny_write(f, path, keep_bytes))) return;
    llama_result r = llama_model_load(path, &model, err, sizeof err);
    CHECK_ERROR(r, want, err, word);
    if (r == LLAMA_OK) llama_model_free(&model);
}

static void set_tensor_field(cJSON *header, const char *tensor, const char *field, cJSON *value) {
    cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetObjectItemCaseSensitive(header, tensor), field,
                                           value);
}

static void test_safetensors_errors(const tiny_model *t) {
    const char *q = "model.layers.0.self_attn.q_proj.weight";
    tiny_file f;
    tiny_encode(t, "F16", true, &f);
    expect_load_error(&f, 5, LLAMA_ERR_FORMAT, "shorter than the 8-byte");
    expect_load_error(&f, 200, LLAMA_ERR_FORMAT, "header length");
    char *json = cJSON_PrintUnformatted(f.header);
    expect_load_error(&f, 8 + strlen(json) + f.data_bytes - 1, LLAMA_ERR_FORMAT, "outside");
    free(json);

    const int out_of_range[2] = {0, 1 << 30};
    set_tensor_field(f.header, q, "data_offsets", cJSON_CreateIntArray(out_of_range, 2));
    expect_load_error(&f, SIZE_MAX, LLAMA_ERR_FORMAT, "outside");
    tiny_file_free(&f);

    tiny_encode(t, "F16", true, &f);
    const int too_short[2] = {0, 2};
    set_tensor_field(f.header, q, "data_offsets", cJSON_CreateIntArray(too_short, 2));
    expect_load_error(&f, SIZE_MAX, LLAMA_ERR_FORMAT, "need");
    tiny_file_free(&f);

    tiny_encode(t, "F16", true, &f);
    set_tensor_field(f.header, q, "dtype", cJSON_CreateString("I16"));
    expect_load_error(&f, SIZE_MAX, LLAMA_ERR_UNSUPPORTED, "dtype I16");
    tiny_file_free(&f);

    tiny_encode(t, "F16", true, &f);
    cJSON_DeleteItemFromObjectCaseSensitive(f.header, "model.layers.0.mlp.up_proj.weight");
    expect_load_error(&f, SIZE_MAX, LLAMA_ERR_FORMAT,
                      "missing tensor model.layers.0.mlp.up_proj.weight");
    tiny_file_free(&f);

    tiny_encode(t, "F16", true, &f);
    const int transposed[2] = {32, 64}; /* same bytes as [64, 32], wrong orientation */
    set_tensor_field(f.header, q, "shape", cJSON_CreateIntArray(transposed, 2));
    expect_load_error(&f, SIZE_MAX, LLAMA_ERR_FORMAT, "shape [32, 64]");
    tiny_file_free(&f);

    tiny_encode(t, "F16", false, &f); /* no __metadata__ and no config.json beside it */
    expect_load_error(&f, SIZE_MAX, LLAMA_ERR_IO, "config.json");
    tiny_file_free(&f);

    const uint8_t not_json[] = {4, 0, 0, 0, 0, 0, 0, 0, '{', '"', 'a', 'x'};
    llama_safetensors st;
    char err[256] = "";
    CHECK_ERROR(llama_safetensors_parse(not_json, sizeof not_json, &st, err, sizeof err),
                LLAMA_ERR_FORMAT, err, "malformed");
}

static void test_forward_matches_reference(const tiny_model *t, const char *dtype,
                                           bool config_beside) {
    tiny_file f;
    tiny_encode(t, dtype, !config_beside, &f);
    const char *path = temp_path("tiny.safetensors");
    CHECK(tiny_write(&f, path, SIZE_MAX));
    tiny_file_free(&f);
    if (config_beside) {
        FILE *cf = fopen(temp_path("config.json"), "wb");
        CHECK(cf != NULL && fputs(TINY_CONFIG, cf) >= 0 && fclose(cf) == 0);
    }
    llama_model model;
    char err[256] = "";
    if (!CHECK(llama_model_load(temp_path("tiny.safetensors"), &model, err, sizeof err) ==
               LLAMA_OK)) {
        printf("  %s\n", err);
        return;
    }
    if (config_beside) remove(temp_path("config.json"));
    const llama_config *c = &model.config;
    llama_runner runner;
    llama_kv_cache cache;
    CHECK(llama_runner_init(&runner, &model, 2, err, sizeof err) == LLAMA_OK);
    CHECK(llama_kv_fp32_create(c, c->context, &cache) == LLAMA_OK);
    reference ref = {t, calloc((size_t)c->context * 64, sizeof(double)),
                     calloc((size_t)c->context * 64, sizeof(double))};
    float logits[268];
    double want[268], worst = 0;
    const int32_t tokens[] = {256, 257, 'u', 's', 'e', 'r', '\n', 'h',
                              'i', 258, 10,  200, 3,   267, 99,   100};
    for (int64_t pos = 0; pos < c->context; pos++) {
        CHECK(llama_forward(&runner, &cache, tokens[pos], pos, logits, err, sizeof err) ==
              LLAMA_OK);
        ref_forward(&ref, tokens[pos], pos, want);
        for (int32_t i = 0; i < c->vocab; i++)
            if (fabs(logits[i] - want[i]) > worst) worst = fabs(logits[i] - want[i]);
    }
    char what[96];
    snprintf(what, sizeof what, "%s logits within 1e-4 of the reference (worst %.3g)", dtype,
             worst);
    check_at(worst < 1e-4, __LINE__, what);
    CHECK_ERROR(llama_forward(&runner, &cache, 1, c->context, logits, err, sizeof err),
                LLAMA_ERR_CAPACITY, err, "context");
    cache.destroy(cache.state);
    llama_runner_free(&runner);
    llama_model_free(&model);
    free(ref.keys);
    free(ref.values);
}

/* With lm_head.weight present the runner uses it; untied without it is an error. */
static void test_untied_head(tiny_model *t) {
    uint32_t rng = 777;
    tiny_add(t, "lm_head.weight", 0, t->config.vocab, t->config.hidden, 0.0f, &rng);
    test_forward_matches_reference(t, "F32", false);
    t->n_tensors--;
    free(t->tensors[t->n_tensors].data);

    tiny_file f;
    tiny_encode(t, "F32", false, &f);
    char untied[sizeof TINY_CONFIG + 8];
    snprintf(untied, sizeof untied, "%s", TINY_CONFIG);
    char *tie = strstr(untied, "\"tie_word_embeddings\": true");
    memcpy(tie, "\"tie_word_embeddings\": 0   ", strlen("\"tie_word_embeddings\": true"));
    FILE *cf = fopen(temp_path("config.json"), "wb");
    CHECK(cf != NULL && fputs(untied, cf) >= 0 && fclose(cf) == 0);
    expect_load_error(&f, SIZE_MAX, LLAMA_ERR_FORMAT, "missing tensor lm_head.weight");
    remove(temp_path("config.json"));
    tiny_file_free(&f);
}

/* The fp32 cache's attention against a direct softmax in double, on random keys and values. */
static void test_fp32_cache_attend(void) {
    llama_config c = {.n_layers = 2, .n_heads = 6, .n_kv_heads = 2, .head_dim = 40};
    enum { T = 37, G = 3, D = 40 };
    llama_kv_cache cache;
    CHECK(llama_kv_fp32_create(&c, T, &cache) == LLAMA_OK);
    uint32_t rng = 99;
    static float k[T][2 * D], v[T][2 * D];
    float q[G * D], out[G * D];
    fill_exact(&k[0][0], sizeof k / sizeof(float), 0.0f, &rng);
    fill_exact(&v[0][0], sizeof v / sizeof(float), 0.0f, &rng);
    fill_exact(q, G * D, 0.0f, &rng);
    for (int64_t t = 0; t < T; t++)
        for (int32_t l = 0; l < c.n_layers; l++)
            CHECK(cache.store(cache.state, l, t, k[t], v[t]) == LLAMA_OK);
    CHECK(cache.store(cache.state, 0, T, k[0], v[0]) == LLAMA_ERR_CAPACITY);
    CHECK(cache.attend(cache.state, 1, 1, q, G, 0.3f, out) == LLAMA_OK);
    double worst = 0;
    for (int32_t h = 0; h < G; h++) {
        double s[T], max = -INFINITY, sum = 0;
        for (int32_t t = 0; t < T; t++) {
            s[t] = 0;
            for (int32_t i = 0; i < D; i++) s[t] += 0.3 * q[h * D + i] * k[t][D + i];
            if (s[t] > max) max = s[t];
        }
        for (int32_t t = 0; t < T; t++) sum += (s[t] = exp(s[t] - max));
        for (int32_t i = 0; i < D; i++) {
            double o = 0;
            for (int32_t t = 0; t < T; t++) o += s[t] / sum * v[t][D + i];
            if (fabs(o - out[h * D + i]) > worst) worst = fabs(o - out[h * D + i]);
        }
    }
    CHECK(worst < 1e-5);
    llama_kv_stats stats;
    cache.stats(cache.state, &stats);
    CHECK(stats.n_tokens == T && stats.bytes == (size_t)2 * T * 2 * 2 * D * 4 &&
          stats.avg_bits == 32.0);
    cache.reset(cache.state);
    cache.stats(cache.state, &stats);
    CHECK(stats.n_tokens == 0 && stats.bytes == 0);
    cache.destroy(cache.state);
}

static void test_answer_marks(void) {
    llama_config config;
    llama_tokenizer tok;
    char err[256];
    llama_config_parse(TINY_CONFIG, strlen(TINY_CONFIG), &config, &tok, err, sizeof err);
    /* Answer bytes are upper case; everything else lower case. */
    const char text[] =
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>A"
        "<tool_call>B</tool_call>C<|im_end|>\n<|im_start|>assistant\nx<tool_call>D"
        "</tool_call>y<|im_end|><|im_start|>tool\n<tool_call>z</tool_call><|im_end|>";
    int32_t ids[sizeof text];
    uint8_t mask[sizeof text];
    int64_t n;
    llama_tokenize(&tok, text, strlen(text), ids, &n);
    llama_mark_answer_tokens(&tok, ids, n, mask);
    char marked[sizeof text] = "";
    for (int64_t i = 0; i < n; i++) {
        if (!mask[i]) continue;
        size_t len;
        const char *bytes = llama_token_bytes(&tok, ids[i], &len);
        strncat(marked, bytes, len);
    }
    const char want[] = "A<tool_call>B</tool_call>C<|im_end|>D</tool_call>";
    char what[400];
    snprintf(what, sizeof what, "answer tokens are \"%s\", want \"%s\"", marked, want);
    check_at(strcmp(marked, want) == 0, __LINE__, what);
    CHECK(llama_is_message_start(&tok, ids, n, 0, "user") &&
          !llama_is_message_start(&tok, ids, n, 0, "assistant"));
}

static void test_capture_round_trip(const tiny_model *t) {
    llama_model model;
    char err[256] = "";
    tiny_file tf;
    tiny_encode(t, "F32", true, &tf);
    CHECK(tiny_write(&tf, temp_path("tiny.safetensors"), SIZE_MAX));
    tiny_file_free(&tf);
    if (!CHECK(llama_model_load(temp_path("tiny.safetensors"), &model, err, sizeof err) ==
               LLAMA_OK))
        return;
    const llama_config *c = &model.config;
    llama_runner runner;
    llama_kv_cache inner, wrapped;
    llama_capture cap, back;
    float logits[268];
    CHECK(llama_runner_init(&runner, &model, 1, err, sizeof err) == LLAMA_OK);
    CHECK(llama_kv_fp32_create(c, c->context, &inner) == LLAMA_OK);
    CHECK(llama_capture_init(&cap, c, 5) == LLAMA_OK);
    CHECK(llama_kv_capture_wrap(&inner, &cap, &wrapped) == LLAMA_OK);
    for (int32_t pos = 0; pos < 5; pos++) {
        cap.token_ids[pos] = 40 + pos;
        CHECK(llama_forward(&runner, &wrapped, 40 + pos, pos, logits, err, sizeof err) == LLAMA_OK);
    }
    CHECK(llama_capture_write(&cap, temp_path("cap.bin"), err, sizeof err) == LLAMA_OK);
    FILE *f = fopen(temp_path("cap.bin"), "rb");
    static uint8_t bytes[1 << 16];
    size_t n = f != NULL ? fread(bytes, 1, sizeof bytes, f) : 0;
    if (f != NULL) fclose(f);
    size_t want_bytes = 32 + 4 * 5 + (size_t)4 * 5 * (4 + 2 * 2) * 16;
    CHECK(n == want_bytes);
    if (CHECK(llama_capture_parse(bytes, n, &back, err, sizeof err) == LLAMA_OK)) {
        size_t q_floats = (size_t)5 * 4 * 16, kv_floats = (size_t)5 * 2 * 16;
        CHECK(back.n_tokens == 5 && back.n_heads == 4 && back.n_kv_heads == 2 &&
              back.head_dim == 16);
        CHECK(memcmp(back.token_ids, cap.token_ids, 5 * sizeof(int32_t)) == 0);
        CHECK(memcmp(back.q, cap.q, q_floats * sizeof(float)) == 0);
        CHECK(memcmp(back.k, cap.k, kv_floats * sizeof(float)) == 0 &&
              memcmp(back.v, cap.v, kv_floats * sizeof(float)) == 0);
        bool q_filled = true; /* every query row was recorded (no row left all zero) */
        for (size_t row = 0; row < q_floats / 16; row++) {
            float norm = 0;
            for (int32_t i = 0; i < 16; i++) norm += fabsf(back.q[row * 16 + i]);
            q_filled = q_filled && norm > 0;
        }
        CHECK(q_filled);
        llama_capture_free(&back);
    }
    CHECK_ERROR(llama_capture_parse(bytes, n - 1, &back, err, sizeof err), LLAMA_ERR_FORMAT, err,
                "implies");
    bytes[0] = 'X';
    CHECK_ERROR(llama_capture_parse(bytes, n, &back, err, sizeof err), LLAMA_ERR_FORMAT, err,
                "magic");
    wrapped.destroy(wrapped.state);
    inner.destroy(inner.state);
    llama_capture_free(&cap);
    llama_runner_free(&runner);
    llama_model_free(&model);
}

/* Forwards to an fp32 cache and records where begin_request was called. */
typedef struct counting_cache {
    llama_kv_cache inner;
    int64_t starts[8];
    int32_t n_starts;
} counting_cache;

static llama_result counting_store(void *state, int32_t layer, int64_t pos, const float *k,
                                   const float *v) {
    counting_cache *c = state;
    return c->inner.store(c->inner.state, layer, pos, k, v);
}

static llama_result counting_attend(void *state, int32_t layer, int32_t kv_head, const float *q,
                                    int32_t n_q, float scale, float *out) {
    counting_cache *c = state;
    return c->inner.attend(c->inner.state, layer, kv_head, q, n_q, scale, out);
}

static void counting_begin_request(void *state, int64_t pos) {
    counting_cache *c = state;
    if (c->n_starts < 8) c->starts[c->n_starts++] = pos;
}

static void counting_reset(void *state) {
    counting_cache *c = state;
    c->inner.reset(c->inner.state);
}

static void counting_stats(const void *state, llama_kv_stats *out) {
    const counting_cache *c = state;
    c->inner.stats(c->inner.state, out);
}

static void counting_destroy(void *state) { (void)state; }

/* llama_score_sequence: begin_request at each user turn, and the answer statistics. */
static void test_score_sequence(void) {
    llama_model model;
    char err[256] = "";
    if (!CHECK(llama_model_load(temp_path("tiny.safetensors"), &model, err, sizeof err) ==
               LLAMA_OK))
        return;
    llama_runner runner;
    counting_cache counter = {0};
    CHECK(llama_runner_init(&runner, &model, 2, err, sizeof err) == LLAMA_OK);
    CHECK(llama_kv_fp32_create(&model.config, model.config.context, &counter.inner) == LLAMA_OK);
    llama_kv_cache cache = {
        &counter,       counting_store, counting_attend,  counting_begin_request,
        counting_reset, counting_stats, counting_destroy, NULL};
    const int32_t ids[16] = {256, 257, 'u', 's', 'e', 'r', '\n', 'a',
                             258, 257, 'u', 's', 'e', 'r', '\n', 'b'};
    uint8_t mask[16];
    int32_t argmax[16], ref[16];
    memset(mask, 1, sizeof mask);
    llama_score first = {0}, second = {0};
    CHECK(llama_score_sequence(&runner, &cache, ids, 16, mask, argmax, argmax, &first, err,
                               sizeof err) == LLAMA_OK);
    CHECK(counter.n_starts == 2 && counter.starts[0] == 1 && counter.starts[1] == 9);
    int64_t correct = 0;
    for (int32_t pos = 0; pos < 15; pos++) correct += argmax[pos] == ids[pos + 1];
    CHECK(first.n_scored == 15 && first.n_answer == 15 && first.n_answer_agree == 15);
    CHECK(first.n_answer_correct == correct && first.bits > 0);
    memcpy(ref, argmax, sizeof ref);
    ref[3] = (ref[3] + 1) % model.config.vocab; /* a reference that disagrees once */
    mask[5] = 0;                                /* and position 4 no longer counts */
    CHECK(llama_score_sequence(&runner, &cache, ids, 16, mask, NULL, ref, &second, err,
                               sizeof err) == LLAMA_OK);
    CHECK(second.n_answer == 14 && second.n_answer_agree == 13 && second.bits == first.bits);
    CHECK_ERROR(
        llama_score_sequence(&runner, &cache, ids, 1, NULL, NULL, NULL, &second, err, sizeof err),
        LLAMA_ERR_ARGUMENT, err, "need 2");
    counter.inner.destroy(counter.inner.state);
    llama_runner_free(&runner);
    llama_model_free(&model);
}

/* The first n_trace trace texts and n_code code texts of eval-dev, cut to max_tokens ids each. */
typedef struct slice {
    int32_t *ids[8];
    int64_t n[8];
    int32_t n_texts;
} slice;

static bool load_slice(const char *data_path, const llama_tokenizer *tok, int32_t n_trace,
                       int32_t n_code, int64_t max_tokens, slice *s) {
    FILE *f = fopen(data_path, "rb");
    if (f == NULL) return false;
    static char line[1 << 20];
    int32_t want[2] = {n_trace, n_code};
    memset(s, 0, sizeof *s);
    while (fgets(line, sizeof line, f) != NULL && s->n_texts < n_trace + n_code) {
        cJSON *obj = cJSON_ParseWithLengthOpts(line, strlen(line), NULL, 0);
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(obj, "kind");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(obj, "text");
        int32_t k = cJSON_IsString(kind) && strcmp(kind->valuestring, "code") == 0;
        if (cJSON_IsString(text) && want[k] > 0) {
            want[k]--;
            size_t len = strlen(text->valuestring);
            int32_t *ids = malloc((len + 1) * sizeof *ids);
            int64_t n = 0;
            ids[0] = llama_special_id(tok, "<|endoftext|>");
            llama_tokenize(tok, text->valuestring, len, ids + 1, &n);
            s->ids[s->n_texts] = ids;
            s->n[s->n_texts++] = n + 1 < max_tokens ? n + 1 : max_tokens;
        }
        cJSON_Delete(obj);
    }
    fclose(f);
    return s->n_texts == n_trace + n_code;
}

static double slice_bits(llama_runner *runner, llama_kv_cache *cache, const slice *s,
                         int64_t *n_scored) {
    llama_score score = {0};
    char err[256] = "";
    for (int32_t i = 0; i < s->n_texts; i++)
        if (!CHECK(llama_score_sequence(runner, cache, s->ids[i], s->n[i], NULL, NULL, NULL, &score,
                                        err, sizeof err) == LLAMA_OK))
            printf("  %s\n", err);
    *n_scored = score.n_scored;
    return score.n_scored > 0 ? score.bits / (double)score.n_scored : 0.0;
}

static void test_small_model_quality(const char *shared_dir) {
    char model_path[512], data_path[512];
    snprintf(model_path, sizeof model_path, "%s/models/kvm-small.safetensors", shared_dir);
    snprintf(data_path, sizeof data_path, "%s/data/eval-dev.jsonl", shared_dir);
    llama_model model;
    char err[256] = "";
    if (!CHECK(llama_model_load(model_path, &model, err, sizeof err) == LLAMA_OK)) {
        printf("  %s (the quality test needs it)\n", err);
        return;
    }
    slice s;
    llama_runner two, one;
    llama_kv_cache cache;
    int64_t n_scored, n_scored_one;
    if (CHECK(load_slice(data_path, &model.tokenizer, 3, 2, SLICE_TOKENS, &s)) &&
        CHECK(llama_runner_init(&two, &model, 2, err, sizeof err) == LLAMA_OK)) {
        CHECK(llama_kv_fp32_create(&model.config, model.config.context + 1, &cache) == LLAMA_OK);
        double bits = slice_bits(&two, &cache, &s, &n_scored);
        char what[160];
        snprintf(what, sizeof what,
                 "kvm-small slice: %.6f bits/token over %lld tokens, want %.5f +- 2%%", bits,
                 (long long)n_scored, SMALL_SLICE_BITS);
        check_at(fabs(bits - SMALL_SLICE_BITS) <= 0.02 * SMALL_SLICE_BITS, __LINE__, what);
        /* Threads split rows, never a sum: one thread must give the same bits exactly. */
        slice first = {{s.ids[0]}, {s.n[0] < 300 ? s.n[0] : 300}, 1};
        CHECK(llama_runner_init(&one, &model, 1, err, sizeof err) == LLAMA_OK);
        CHECK(slice_bits(&one, &cache, &first, &n_scored_one) ==
              slice_bits(&two, &cache, &first, &n_scored));
        llama_runner_free(&one);
        llama_runner_free(&two);
        cache.destroy(cache.state);
    }
    for (int32_t i = 0; i < s.n_texts; i++) free(s.ids[i]);
    llama_model_free(&model);
}

int main(int argc, char **argv) {
    const char *shared_dir = argc > 1 ? argv[1] : "../shared";
    snprintf(temp_dir, sizeof temp_dir, "/tmp/test-llama-XXXXXX");
    if (mkdtemp(temp_dir) == NULL) {
        printf("FAIL: cannot create a temporary directory\n");
        return 1;
    }
    tiny_model tiny;
    tiny_build(&tiny);
    test_tokenizer();
    test_config_errors();
    test_safetensors_errors(&tiny);
    test_forward_matches_reference(&tiny, "F32", false);
    test_forward_matches_reference(&tiny, "BF16", false);
    test_forward_matches_reference(&tiny, "F16", true);
    test_untied_head(&tiny);
    test_fp32_cache_attend();
    test_answer_marks();
    test_capture_round_trip(&tiny);
    test_score_sequence();
    test_small_model_quality(shared_dir);
    test_policy_run(shared_dir, &n_passed, &n_failed);
    tiny_free(&tiny);
    const char *names[] = {"tiny.safetensors", "bad.safetensors", "cap.bin", "config.json"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) remove(temp_path(names[i]));
    rmdir(temp_dir);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
