/* kvmix_kv.h - KV-cache policies as documents, and a llama_kv_cache backed by the kvmix paged cache.
 *
 * A policy (kvmix_policy, kvmix.h) says how the runner's key/value cache stores tokens. Besides
 * kvmix.h's built-ins the runner knows one more, "fp32": its own reference cache, whose formats
 * are KVMIX_KV_FORMAT_FP32 (a marker of this runner, not a kvmix_format). Policies are also read
 * from a JSON document whose schema is in README.md ("Policies"); kvmix_kv_policy_json writes the
 * resolved object back.
 *
 * The kvmix-backed cache keeps one kvmix_cache per runner with one sequence per text, built from
 * the policy by kvmix_policy_apply. store() of layer 0 reserves the position, store() of every
 * layer writes that layer's row (kvmix_cache_write), and attend() reads exactly what the cache
 * holds: the layer's view (kvmix_cache_view, every page in its own formats, evicted positions
 * flagged dead) decoded by kvmix's fast CPU decode (kvmix_view_decode, on the calling thread) for
 * one kv head; it agrees with the reference (kvmix_ref_view_decode) within float rounding. There
 * is no float copy of the history: what the runner scores is what the cache stores.
 *
 * Errors: functions return llama_result and, where they take (err, err_bytes), write a one-line
 * message into that caller-owned buffer. Nothing here prints or exits. Thread safety: as
 * llama_kv_cache (llama.h); policy functions are pure and thread-safe.
 */
#ifndef KVMIX_KV_H
#define KVMIX_KV_H

#include "kvmix.h"
#include "llama.h"
#include "tag_allocation.h"

enum {
    KVMIX_KV_POLICY_VERSION = 1,
    KVMIX_KV_FORMAT_FP32 = 0 /* key_format/value_format of the fp32 reference cache */
};

/* Built-in policies by index (0 .. kvmix_kv_policy_count() - 1): fp32, then kvmix.h's
 * (kvmix_policy_at): fp16, int8, int4, kivi2, kivi2-sink, kitty-12, kitty-25. */
int32_t kvmix_kv_policy_count(void);
const kvmix_policy *kvmix_kv_policy_at(int32_t index);
/* The built-in of this name, or NULL. */
const kvmix_policy *kvmix_kv_policy_builtin(const char *name);

/* Parses a policy document of json_bytes (need not be NUL-terminated). Strict: unknown or
 * repeated keys, wrong types, non-integral or out-of-range numbers, unknown format names and
 * trailing bytes are errors whose message names the field. Returns LLAMA_OK and *out, or
 * LLAMA_ERR_FORMAT (malformed or invalid document) / LLAMA_ERR_UNSUPPORTED (another version). */
llama_result kvmix_kv_policy_parse(const char *json, size_t json_bytes, kvmix_policy *out,
                                   char *err, size_t err_bytes);

/* The policy's settings for a model of this head_dim: n_boost resolved from boost_fraction,
 * group_size and n_boost checked against head_dim. LLAMA_ERR_ARGUMENT with a message otherwise. */
llama_result kvmix_kv_policy_resolve(const kvmix_policy *policy, int32_t head_dim,
                                     kvmix_policy *out, char *err, size_t err_bytes);

/* The policy as a JSON object with every field (format names as in the schema), compact, NUL-
 * terminated; malloc'd, free() it. NULL when out of memory. */
char *kvmix_kv_policy_json(const kvmix_policy *policy);

/* True when two policies have equal settings (names and descriptions included). */
bool kvmix_kv_policy_equal(const kvmix_policy *a, const kvmix_policy *b);

/* A llama_kv_cache for the policy: the fp32 reference cache when its formats are fp32, else a
 * kvmix-backed one with room for `capacity` positions. The policy is resolved for the config's
 * head_dim (kvmix_kv_policy_resolve). stats(): bytes = what kvmix holds for the sequence (see
 * kvmix_kv.c: page allocations, FP16 buffers, sinks and window included, plus its slot map, page
 * table and record); avg_bits = bytes * 8 / (tokens * layers * kv heads * head_dim * 2). */
llama_result kvmix_kv_create(const kvmix_policy *policy, const llama_config *config,
                             int64_t capacity, llama_kv_cache *out, char *err, size_t err_bytes);

/* Makes a kvmix-backed cache store each token by its template tag: the tagger of `spec` tags the
 * ids the runner announces (llama_kv_cache.on_token), and a token asks for the formats `table`
 * gives its tag in the current turn (kvmix_policy_token_precision); a page is sealed in the
 * highest precision its tokens ask for, and keeps it as the turn ages (no re-tiering yet).
 * prices (may be NULL): the allocation's, for the stats' assigned_bits. spec, table and prices
 * are copied. LLAMA_ERR_ARGUMENT for the fp32 cache, a spec that does not check or a table with
 * unknown formats. */
llama_result kvmix_kv_tag(llama_kv_cache *cache, const kvmix_tag_spec *spec,
                          const kvmix_tag_precision *table, const tag_prices *prices, char *err,
                          size_t err_bytes);

/* `policy` storing by tag, for a runner that tags (kvmix_kv_tag, gpu_llama_tag): checks it with
   `table`, then copies table into *table_copy (the runner's, kept as long as the policy) and
   writes *out_policy pointing at the copy. LLAMA_ERR_ARGUMENT naming the refused field, with
   `who` first (nothing written then). */
llama_result kvmix_kv_policy_tagged(const kvmix_policy *policy, const kvmix_tag_precision *table,
                                    kvmix_tag_precision *table_copy, kvmix_policy *out_policy,
                                    const char *who, char *err, size_t err_bytes);

/* The mean over seq's positions in sealed pages (not sinks) of what their tags at current_turn
   cost: the allocation's price of the tag (prices, when not NULL and it lists the tag), else what
   the formats the tag asks for (kvmix_policy_token_precision of tags[position]) cost in full
   pages (kvmix_cache_precision_bits). The bits the tag allocation assigns, beside the packed bits
   the pages hold. 0 when no position is packed. */
double kvmix_kv_assigned_bits(const kvmix_cache *cache, int32_t seq, const kvmix_policy *policy,
                              const kvmix_tag *tags, int32_t current_turn,
                              const tag_prices *prices);

/* For tests: the kvmix cache and sequence behind a kvmix-backed llama_kv_cache (NULL / -1 for
 * the fp32 one). */
const kvmix_cache *kvmix_kv_inner(const llama_kv_cache *cache, int32_t *out_seq);

/* Evicts positions of a kvmix-backed cache's sequence (kvmix_cache_evict): later attention
 * skips them; then compacts the pages left at most KVMIX_KV_COMPACT_LIVE_FRACTION live
 * (kvmix_cache_compact), as gpu_llama_evict does. LLAMA_ERR_ARGUMENT for the fp32 cache or
 * positions the cache refuses (nothing is evicted then). */
#define KVMIX_KV_COMPACT_LIVE_FRACTION 0.5
llama_result kvmix_kv_evict(llama_kv_cache *cache, const int32_t *positions, int32_t n_positions);

/* Recording for eviction policies (kvmix.h, "Budgeted eviction"), what gpu_llama_observe records
 * on the GPU. What the next steps record, until changed: KVMIX_KV_OBSERVE_QUERIES sums the post-
 * RoPE queries attend() receives (every layer and q head), KVMIX_KV_OBSERVE_ATTENTION adds the
 * attention each query gives each held position (per q head a softmax over the live positions,
 * read from the keys as stored: kvmix_ref_view_intent_score; summed over heads and layers);
 * 0 records nothing. reset() clears both. LLAMA_ERR_ARGUMENT: the fp32 cache, unknown flags;
 * LLAMA_ERR_MEMORY: no room for the recording (allocated on first use). */
enum { KVMIX_KV_OBSERVE_QUERIES = 1, KVMIX_KV_OBSERVE_ATTENTION = 2 };
llama_result kvmix_kv_observe(llama_kv_cache *cache, int32_t flags);

/* Takes what was recorded and clears it: query_sum [n_layers][n_heads][head_dim] (NULL: left
 * recorded) receives the summed queries and *out_n_queries (may be NULL) how many steps;
 * attention [positions the sequence has] (NULL: left recorded) the attention per position, 0
 * for positions that got none. Errors as kvmix_kv_observe. */
llama_result kvmix_kv_observed_take(llama_kv_cache *cache, float *query_sum, int32_t *out_n_queries,
                                    float *attention);

/* Intent scores of the held positions (kvmix.h, KVMIX_EVICT_INTENT), as gpu_llama_intent_scores:
 * for each layer kvmix_ref_view_intent_score of memory over the layer's view, summed over
 * layers; memory [n_layers][n_heads][head_dim]; scores [positions the sequence has]: -INFINITY
 * for evicted positions. Errors as kvmix_kv_observe. */
llama_result kvmix_kv_intent_scores(llama_kv_cache *cache, const float *memory, float *scores);

/* The intent residual's key features of the held positions, for the memory the intent scores
 * took: for each layer kvmix_ref_view_key_features over the layer's view, averaged over layers;
 * key_norm, readout [positions the sequence has]: 0 for evicted positions. Errors as
 * kvmix_kv_observe. */
llama_result kvmix_kv_key_features(llama_kv_cache *cache, const float *memory, float *key_norm,
                                   float *readout);

/* A transfer's sender: the rows of positions 0 .. n_positions - 1 as the cache holds them
 * (dequantized), keys, values: [n_layers][n_positions][n_kv_heads][head_dim] floats.
 * LLAMA_ERR_ARGUMENT for the fp32 cache or a position without a row (evicted, not written). */
llama_result kvmix_kv_rows_read(const llama_kv_cache *cache, int64_t n_positions, float *keys,
                                float *values);

/* A transfer's receiver: writes layer `layer`'s rows of positions first_position ..
 * first_position + n_tokens - 1 ([n_tokens][n_kv_heads][head_dim] floats, rounded as store()
 * rounds them) to a kvmix-backed cache, layer 0 reserving the positions. As store(), layers come
 * in order: first_position is the positions the layer has, and a layer above 0 writes no
 * position its layer below lacks. LLAMA_ERR_ARGUMENT otherwise (nothing written),
 * LLAMA_ERR_CAPACITY when the cache is full. */
llama_result kvmix_kv_ingest(llama_kv_cache *cache, int32_t layer, int64_t first_position,
                             int64_t n_tokens, const float *keys, const float *values);

/* A cold-tier upgrade on the receiver: adds residual rows to the sealed page that holds
 * `position` (kvmix_cache_retier with KVMIX_CACHE_ROWS_RESIDUAL, in the policy's formats).
 * keys, values: [n_layers][page_tokens][n_kv_heads][head_dim], rows from the page's first
 * position (zeros leave a row as it is). LLAMA_ERR_ARGUMENT for the fp32 cache or a page the
 * cache refuses (not sealed yet, bad rows; the cache is unchanged then). */
llama_result kvmix_kv_upgrade(llama_kv_cache *cache, int64_t position, const float *keys,
                              const float *values);

#endif /* KVMIX_KV_H */
