/* llama.h - a small fp32 CPU runner for Llama-layout byte-level models.
 *
 * It loads a Hugging Face Llama safetensors checkpoint (F16, BF16 or F32 tensors, converted to
 * fp32), tokenizes text (bytes + special tokens), and runs the forward pass one token at a time.
 * Attention keys and values live behind llama_kv_cache, an interface that a compressed cache
 * implements, so that quality can be measured with any KV-cache format plugged in.
 *
 * Errors: functions return llama_result and, where they take (err, err_bytes), write a one-line
 * message into that caller-owned buffer. Nothing here prints, exits or aborts on bad input.
 * Thread safety: a llama_model is read-only after loading and may be shared; a llama_runner and a
 * llama_kv_cache belong to one caller at a time.
 */
#ifndef LLAMA_H
#define LLAMA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum llama_result {
    LLAMA_OK = 0,
    LLAMA_ERR_IO,          /* a file could not be opened, read or written */
    LLAMA_ERR_FORMAT,      /* bytes are truncated, malformed or inconsistent */
    LLAMA_ERR_UNSUPPORTED, /* well-formed, but a dtype/architecture this runner does not run */
    LLAMA_ERR_MEMORY,      /* an allocation failed */
    LLAMA_ERR_ARGUMENT,    /* a caller passed an invalid argument */
    LLAMA_ERR_CAPACITY     /* more tokens than the context or a buffer holds */
} llama_result;

/* A short constant description of a result code. */
const char *llama_result_string(llama_result result);

#if defined(__GNUC__)
#define LLAMA_PRINTF_LIKE(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define LLAMA_PRINTF_LIKE(fmt, args)
#endif

/* Writes a printf-style message into err (err_bytes, may be NULL/0) and returns result: the one
 * way the runner's functions report what went wrong. */
llama_result llama_fail(char *err, size_t err_bytes, llama_result result, const char *fmt, ...)
    LLAMA_PRINTF_LIKE(4, 5);

/* The whole file at path, NUL-terminated (malloc'd; free() it), its size in *n_bytes; NULL when
 * it cannot be opened, read or allocated. */
char *llama_read_text(const char *path, size_t *n_bytes);

/* ---------------------------------------------------------------------------------------------
 * Safetensors header
 * Layout: u64 little-endian header length N, N bytes of JSON, then the data section. The JSON maps
 * tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data
 * section) and may hold "__metadata__", an object of strings.
 */
enum { LLAMA_MAX_DIMS = 8, LLAMA_MAX_NAME = 128 };

typedef enum llama_dtype { LLAMA_DTYPE_F32, LLAMA_DTYPE_F16, LLAMA_DTYPE_BF16 } llama_dtype;

typedef struct llama_tensor_info {
    char name[LLAMA_MAX_NAME];
    llama_dtype dtype;
    int32_t n_dims;
    int64_t shape[LLAMA_MAX_DIMS];
    size_t offset_bytes; /* from the start of the file */
    size_t size_bytes;
} llama_tensor_info;

typedef struct llama_safetensors {
    llama_tensor_info *tensors; /* [n_tensors], owned */
    int32_t n_tensors;
    char *config_json; /* __metadata__.config, or NULL when absent; owned */
} llama_safetensors;

/* Parses and validates the header of a safetensors file held in memory (file: [file_bytes]).
 * Every tensor must lie inside the file and its byte size must match dtype and shape.
 * Returns LLAMA_OK and fills *out (free with llama_safetensors_free), or an error with a message. */
llama_result llama_safetensors_parse(const uint8_t *file, size_t file_bytes, llama_safetensors *out,
                                     char *err, size_t err_bytes);
void llama_safetensors_free(llama_safetensors *st);

/* ---------------------------------------------------------------------------------------------
 * Config and tokenizer
 */
enum { LLAMA_MAX_SPECIAL = 64, LLAMA_MAX_SPECIAL_BYTES = 64 };

typedef struct llama_tokenizer {
    int32_t n_special;
    int32_t special_id[LLAMA_MAX_SPECIAL]; /* ids are >= 256 */
    char special_text[LLAMA_MAX_SPECIAL][LLAMA_MAX_SPECIAL_BYTES];
    char byte_text[256]; /* byte_text[i] == i: what llama_token_bytes points at for a byte id */
} llama_tokenizer;

typedef struct llama_config {
    char name[64];
    int32_t n_layers;
    int32_t hidden;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t ffn;
    int32_t context; /* max_position_embeddings */
    int32_t vocab;
    float rope_theta;
    float norm_eps;
    bool tied_embeddings;
} llama_config;

/* Parses a Hugging Face Llama config (JSON text of json_bytes) including the byte tokenizer's
 * special tokens ("tokenizer": {"special_tokens": {text: id}}). */
llama_result llama_config_parse(const char *json, size_t json_bytes, llama_config *config,
                                llama_tokenizer *tokenizer, char *err, size_t err_bytes);

/* Encodes text: each special-token string becomes its id, every other byte becomes itself (ids
 * 0-255). ids must hold text_bytes entries (an upper bound); *n_ids receives the count. */
llama_result llama_tokenize(const llama_tokenizer *tok, const char *text, size_t text_bytes,
                            int32_t *ids, int64_t *n_ids);

/* The id of a special token's text, or -1 when the tokenizer has none by that text. */
int32_t llama_special_id(const llama_tokenizer *tok, const char *text);

/* The bytes of one id (*n_bytes of them; not NUL-terminated for byte ids), or NULL for an id that
 * is neither a byte nor a known special token. */
const char *llama_token_bytes(const llama_tokenizer *tok, int32_t id, size_t *n_bytes);

/* ---------------------------------------------------------------------------------------------
 * KV cache interface
 * The model never touches key/value memory itself: for every layer and token it hands the
 * post-RoPE keys and the values to store(), and asks attend() for the attention output of the
 * query heads that share one kv head. A compressed cache keeps its own format and dequantizes
 * however it likes inside attend(). Keys arrive already rotated for their absolute position, so
 * a cache may drop or reorder tokens without touching RoPE.
 * Functions returning llama_result return LLAMA_OK, LLAMA_ERR_CAPACITY when full, or
 * LLAMA_ERR_ARGUMENT for a layer/head/position out of order or range.
 */
typedef struct llama_kv_stats {
    size_t bytes;       /* bytes the cache holds for stored keys and values (payload + metadata) */
    double avg_bits;    /* bits per stored key/value element */
    int64_t n_tokens;   /* tokens currently held (per layer) */
    double packed_bits; /* of them, those in sealed pages (not sinks, window, buffer): bits
                               per element (kvmix_cache_seq_stats); 0 for a cache that packs none */
    int64_t n_packed_tokens;
    double assigned_bits; /* what those tokens' tags ask for at the current turn would cost in
                             full pages (kvmix_cache_precision_bits), their mean; 0 untagged
                             (the GPU loop's per-step stats leave it 0: see
                             gpu_llama_seq_assigned_bits) */
} llama_kv_stats;

typedef struct llama_kv_cache {
    void *state;
    /* Appends one token of one layer. k, v: [n_kv_heads, head_dim], k after RoPE. Tokens arrive in
     * position order; for each position, layers arrive in order 0..n_layers-1. */
    llama_result (*store)(void *state, int32_t layer, int64_t pos, const float *k, const float *v);
    /* Attention of the n_q query heads served by kv_head over every token the cache holds for
     * layer (the one just stored included): out[h] = sum_t softmax_t(scale * q[h].k_t) v_t.
     * q, out: [n_q, head_dim]. Calls for different kv heads of one layer may run concurrently on
     * different threads; no call overlaps a store(). */
    llama_result (*attend)(void *state, int32_t layer, int32_t kv_head, const float *q, int32_t n_q,
                           float scale, float *out);
    /* A new request (a user turn) begins at position pos; a policy may re-tag or evict here. */
    void (*begin_request)(void *state, int64_t pos);
    /* Drops every token: a new, unrelated sequence starts at position 0. */
    void (*reset)(void *state);
    /* What the cache holds now; called between tokens. */
    void (*stats)(const void *state, llama_kv_stats *out);
    /* Frees state and everything it owns. */
    void (*destroy)(void *state);
    /* Token `id` is about to run at position pos (before any layer stores it), or NULL: a cache
     * that stores tokens by their template tag learns the ids here. */
    void (*on_token)(void *state, int64_t pos, int32_t id);
} llama_kv_cache;

/* Softmax attention of one query row over float rows: out = sum_t softmax_t(scale * q.k_t) v_t.
 * keys, values: [n_tokens][head_dim]; scores: [n_tokens] scratch; n_tokens >= 1. The one
 * attention the caches of the runner share. */
void llama_attend_rows(const float *keys, const float *values, int64_t n_tokens, int32_t head_dim,
                       const float *q, float scale, float *scores, float *out);

/* The reference cache: keys and values kept as fp32, room for `capacity` tokens; store() takes
 * positions 0, 1, 2, ... without gaps. */
llama_result llama_kv_fp32_create(const llama_config *config, int64_t capacity,
                                  llama_kv_cache *out);

/* ---------------------------------------------------------------------------------------------
 * Model and runner
 */
typedef struct llama_matrix {
    float *panels; /* rows in panels of LLAMA_PANEL_ROWS, see llama.c; owned */
    int32_t n_out;
    int32_t n_in;
} llama_matrix;

typedef struct llama_layer {
    float *attn_norm;     /* [hidden] */
    float *ffn_norm;      /* [hidden] */
    llama_matrix qkv;     /* [(n_heads + 2 n_kv_heads) head_dim, hidden]: q, k, v projections */
    llama_matrix out;     /* [hidden, n_heads head_dim] */
    llama_matrix gate_up; /* [2 ffn, hidden]: gate rows, then up rows */
    llama_matrix down;    /* [hidden, ffn] */
} llama_layer;

typedef struct llama_model {
    llama_config config;
    llama_tokenizer tokenizer;
    float *embed;      /* [vocab, hidden] */
    float *final_norm; /* [hidden] */
    llama_matrix head; /* [vocab, hidden]: lm_head.weight, or the embeddings when tied */
    llama_layer *layers;
} llama_model;

/* Loads a checkpoint. The config comes from __metadata__.config, else from config.json in the
 * same directory. Free with llama_model_free. */
llama_result llama_model_load(const char *path, llama_model *model, char *err, size_t err_bytes);
void llama_model_free(llama_model *model);

/* The matrix row-major, out [n_out][n_in] (for runners that keep their own copy, a GPU's). */
void llama_matrix_rows(const llama_matrix *m, float *out);

typedef struct llama_pool llama_pool;

/* Scratch buffers and worker threads for one forward pass at a time. */
typedef struct llama_runner {
    const llama_model *model;
    llama_pool *pool;
    float *x, *xn, *qkv, *att, *ffn, *rope, *logits;
    double *inv_freq;
    llama_result *part_results;
} llama_runner;

/* n_threads >= 1: the caller's thread plus n_threads - 1 workers split matmul rows and kv heads. */
llama_result llama_runner_init(llama_runner *runner, const llama_model *model, int32_t n_threads,
                               char *err, size_t err_bytes);
void llama_runner_free(llama_runner *runner);

/* Runs token `token` at position pos (0-based, pos < context), storing its keys and values in
 * cache, and writes the next-token logits [vocab]. */
llama_result llama_forward(llama_runner *runner, llama_kv_cache *cache, int32_t token, int64_t pos,
                           float *logits, char *err, size_t err_bytes);

/* ---------------------------------------------------------------------------------------------
 * Captures: the post-RoPE queries, keys and values of one sequence, for offline study.
 * File format, all integers little-endian, floats IEEE-754 binary32 little-endian:
 *   offset  size  field
 *   0       8     magic "KVMXCAPT"
 *   8       4     u32 version = 1
 *   12      4     u32 n_layers
 *   16      4     u32 n_heads      (query heads)
 *   20      4     u32 n_kv_heads   (n_heads % n_kv_heads == 0)
 *   24      4     u32 head_dim
 *   28      4     u32 n_tokens
 *   32      4*n_tokens          i32 token ids
 *   then, for each layer in order:
 *           4*n_tokens*n_heads*head_dim     f32 q [n_tokens, n_heads, head_dim]
 *           4*n_tokens*n_kv_heads*head_dim  f32 k [n_tokens, n_kv_heads, head_dim]
 *           4*n_tokens*n_kv_heads*head_dim  f32 v [n_tokens, n_kv_heads, head_dim]
 * and nothing after. Every dimension is at least 1 and at most LLAMA_CAPTURE_MAX_DIM.
 */
enum {
    LLAMA_CAPTURE_VERSION = 1,
    LLAMA_CAPTURE_HEADER_BYTES = 32,
    LLAMA_CAPTURE_MAX_DIM = 1 << 20
};

typedef struct llama_capture {
    int32_t n_layers, n_heads, n_kv_heads, head_dim, n_tokens;
    int32_t *token_ids; /* [n_tokens] */
    float *q;           /* [n_layers, n_tokens, n_heads, head_dim] */
    float *k;           /* [n_layers, n_tokens, n_kv_heads, head_dim] */
    float *v;           /* [n_layers, n_tokens, n_kv_heads, head_dim] */
} llama_capture;

/* Allocates an empty capture for n_tokens tokens of the model's shape. */
llama_result llama_capture_init(llama_capture *cap, const llama_config *config, int32_t n_tokens);
void llama_capture_free(llama_capture *cap);

/* A cache that records every stored key/value and every query into cap, then forwards to inner.
 * The wrapper does not own inner or cap; destroy() frees only the wrapper. */
llama_result llama_kv_capture_wrap(llama_kv_cache *inner, llama_capture *cap, llama_kv_cache *out);

llama_result llama_capture_write(const llama_capture *cap, const char *path, char *err,
                                 size_t err_bytes);
/* Validates and decodes a capture held in memory; free with llama_capture_free. */
llama_result llama_capture_parse(const uint8_t *bytes, size_t n_bytes, llama_capture *cap,
                                 char *err, size_t err_bytes);

/* ---------------------------------------------------------------------------------------------
 * Scoring a sequence
 */

/* Marks answer targets in a token sequence (ids: [n], mask: [n], 1 = counted). Token i is an answer
 * token when it lies inside an assistant message (after the "<|im_start|>assistant\n" header, up
 * to and including the message's <|im_end|>) and either
 *   - follows a </think> of that message (the </think> itself is not marked), or
 *   - lies inside a tool call of that message: after <tool_call>, up to and including </tool_call>.
 * The position that predicts token i is i - 1, so a scorer counts position i - 1 when mask[i]. */
void llama_mark_answer_tokens(const llama_tokenizer *tok, const int32_t *ids, int64_t n,
                              uint8_t *mask);

/* True when ids[i] starts a message of the given role: <|im_start|> followed by role and "\n". */
bool llama_is_message_start(const llama_tokenizer *tok, const int32_t *ids, int64_t n, int64_t i,
                            const char *role);

/* Where the text of a message of `role` that starts at i begins: past <|im_start|>, the role and
 * its "\n" (i + 2 + strlen(role)); -1 when ids[i] starts no such message. */
int64_t llama_message_text(const llama_tokenizer *tok, const int32_t *ids, int64_t n, int64_t i,
                           const char *role);

/* True when a message of `role` starts at i and its text opens with `prefix` (plain bytes, no
 * special-token text), e.g. the traces' recall questions: role "user", prefix "Earlier". */
bool llama_message_opens_with(const llama_tokenizer *tok, const int32_t *ids, int64_t n, int64_t i,
                              const char *role, const char *prefix);

typedef struct llama_score {
    double bits;              /* summed cross-entropy (bits) of every scored next token */
    int64_t n_scored;         /* positions scored: n - 1 */
    int64_t n_answer;         /* scored positions whose next token is marked as answer */
    int64_t n_answer_correct; /* ... whose top-1 equals the true next token */
    int64_t n_answer_agree;   /* ... whose top-1 equals ref_argmax at that position */
} llama_score;

/* Resets cache, then feeds ids[0..n-2] one token at a time from position 0 and scores, at each
 * position, the next id. Before a token that starts a user message it calls begin_request.
 * mask: [n] from llama_mark_answer_tokens, or NULL (no answer statistics).
 * argmax_out: [n] receives this run's top-1 at each position, or NULL.
 * ref_argmax: [n] top-1 of a reference run to agree with, or NULL; it may be argmax_out itself.
 * n must be between 2 and context + 1. Adds into *score. */
llama_result llama_score_sequence(llama_runner *runner, llama_kv_cache *cache, const int32_t *ids,
                                  int64_t n, const uint8_t *mask, int32_t *argmax_out,
                                  const int32_t *ref_argmax, llama_score *score, char *err,
                                  size_t err_bytes);

/* A loop's own work before each token runs (a budgeted eviction, evict_driver.h): before(user,
 * pos, ...) runs before the token at pos, after begin_request; a result other than LLAMA_OK stops
 * the scoring with it (its message in err). */
typedef struct llama_step_hook {
    llama_result (*before)(void *user, int64_t pos, char *err, size_t err_bytes);
    void *user;
} llama_step_hook;

/* llama_score_sequence with hook (NULL: none) run before every token. */
llama_result llama_score_sequence_hooked(llama_runner *runner, llama_kv_cache *cache,
                                         const int32_t *ids, int64_t n, const uint8_t *mask,
                                         int32_t *argmax_out, const int32_t *ref_argmax,
                                         const llama_step_hook *hook, llama_score *score, char *err,
                                         size_t err_bytes);

/* Log2 of softmax(logits)[target] negated: the cross-entropy in bits of one target. */
double llama_bits_of(const float *logits, int32_t vocab, int32_t target);
int32_t llama_argmax(const float *logits, int32_t vocab);

#endif /* LLAMA_H */
