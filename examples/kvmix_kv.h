/* kvmix_kv.h - KV-cache policies and a llama_kv_cache backed by the kvmix paged cache.
 *
 * A policy says how the runner's key/value cache stores tokens: the key and value formats, the
 * channel group of per-token integer formats, the boosted channels of BOOSTED keys, the page
 * size, the FP16 sink and window tokens, and what a request boundary does to a partial page.
 * Policies are built in (kvmix_kv_policy_builtin) or read from a JSON document whose schema is
 * in README.md ("Policies"); kvmix_kv_policy_json writes the resolved object back.
 *
 * The kvmix-backed cache keeps one kvmix_cache per runner with one sequence per text. store()
 * of layer 0 reserves the position (kvmix_cache_reserve with the policy's formats), store() of
 * every layer writes that layer's row (kvmix_cache_write), attend() computes attention over what
 * the cache holds. For speed, attend() reads a per-layer float mirror of the dequantized rows
 * (kvmix_cache_read of each position); a row of the mirror is refreshed exactly when the cache's
 * content for it changes: when the row is written, and when a page-table entry's page, formats or
 * sealed state change (a page sealed, copied or re-tiered) in reserve or a request boundary.
 *
 * Errors: functions return llama_result and, where they take (err, err_bytes), write a one-line
 * message into that caller-owned buffer. Nothing here prints or exits. Thread safety: as
 * llama_kv_cache (llama.h); policy functions are pure and thread-safe.
 */
#ifndef KVMIX_KV_H
#define KVMIX_KV_H

#include "kvmix.h"
#include "llama.h"

enum {
    KVMIX_KV_POLICY_VERSION = 1,
    KVMIX_KV_MAX_NAME = 64,         /* bytes of a name, the terminating NUL included */
    KVMIX_KV_MAX_DESCRIPTION = 256, /* bytes of a description, the terminating NUL included */
    KVMIX_KV_FORMAT_FP32 = 0        /* key_format/value_format of the fp32 reference cache */
};

typedef struct kvmix_kv_policy {
    char name[KVMIX_KV_MAX_NAME];
    char description[KVMIX_KV_MAX_DESCRIPTION];
    int32_t key_format; /* KVMIX_KV_FORMAT_FP32 (both or neither) or a kvmix_format */
    int32_t value_format;
    int32_t group_size;    /* channels per scale of INT8/INT4/INT2 blocks; 8 .. 512, default 32 */
    int32_t n_boost;       /* BOOSTED: channels kept at 4 bits; 0 = head_dim * boost_fraction */
    double boost_fraction; /* BOOSTED: a fraction of head_dim in (0, 1]; 0 = n_boost / head_dim;
                              when both are set they must agree for the model's head_dim */
    int32_t page_tokens;   /* tokens per page (KIVI's key group); 8 .. 1024, multiple of 8 */
    int32_t sink_tokens;   /* first positions kept FP16 forever; 0 .. page_tokens */
    int32_t window_tokens; /* most recent positions kept FP16; 0 .. 2^26 */
    int32_t partial_page;  /* kvmix_cache_partial at a request boundary: KEEP_FP16 or QUANTIZE */
} kvmix_kv_policy;

/* Built-in policies by index (0 .. kvmix_kv_policy_count() - 1): fp32, fp16, int8, int4, kivi2,
 * kivi2-sink, kitty-12, kitty-25. */
int32_t kvmix_kv_policy_count(void);
const kvmix_kv_policy *kvmix_kv_policy_at(int32_t index);
/* The built-in of this name, or NULL. */
const kvmix_kv_policy *kvmix_kv_policy_builtin(const char *name);

/* Parses a policy document of json_bytes (need not be NUL-terminated). Strict: unknown or
 * repeated keys, wrong types, non-integral or out-of-range numbers, unknown format names and
 * trailing bytes are errors whose message names the field. Returns LLAMA_OK and *out, or
 * LLAMA_ERR_FORMAT (malformed or invalid document) / LLAMA_ERR_UNSUPPORTED (another version). */
llama_result kvmix_kv_policy_parse(const char *json, size_t json_bytes, kvmix_kv_policy *out,
                                   char *err, size_t err_bytes);

/* The policy's settings for a model of this head_dim: n_boost resolved from boost_fraction,
 * group_size and n_boost checked against head_dim. LLAMA_ERR_ARGUMENT with a message otherwise. */
llama_result kvmix_kv_policy_resolve(const kvmix_kv_policy *policy, int32_t head_dim,
                                     kvmix_kv_policy *out, char *err, size_t err_bytes);

/* The policy as a JSON object with every field (format names as in the schema), compact, NUL-
 * terminated; malloc'd, free() it. NULL when out of memory. */
char *kvmix_kv_policy_json(const kvmix_kv_policy *policy);

/* True when two policies have equal settings (names and descriptions included). */
bool kvmix_kv_policy_equal(const kvmix_kv_policy *a, const kvmix_kv_policy *b);

/* A llama_kv_cache for the policy: the fp32 reference cache when its formats are fp32, else a
 * kvmix-backed one with room for `capacity` positions. The policy is resolved for the config's
 * head_dim (kvmix_kv_policy_resolve). stats(): bytes = what kvmix holds for the sequence (see
 * kvmix_kv.c: page allocations, FP16 buffers, sinks and window included, plus its slot map, page
 * table and record); avg_bits = bytes * 8 / (tokens * layers * kv heads * head_dim * 2). */
llama_result kvmix_kv_create(const kvmix_kv_policy *policy, const llama_config *config,
                             int64_t capacity, llama_kv_cache *out, char *err, size_t err_bytes);

/* For tests: the kvmix cache and sequence behind a kvmix-backed llama_kv_cache (NULL / -1 for
 * the fp32 one). */
const kvmix_cache *kvmix_kv_inner(const llama_kv_cache *cache, int32_t *out_seq);

/* For tests: compares every mirrored row of every layer with kvmix_cache_read of the cache,
 * bit for bit. Returns the number of floats that differ (0 = the mirror is what the cache holds),
 * or -1 for a cache that is not kvmix-backed or a read that fails. */
int64_t kvmix_kv_mirror_mismatches(const llama_kv_cache *cache);

#endif /* KVMIX_KV_H */
