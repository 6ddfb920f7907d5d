/* gpu_llama.h - the reference Llama models on a GPU, many sequences at once, with their keys and
 * values in a kvmix cache whose arena is device memory.
 *
 * A gpu_llama holds the weights (fp32, from a llama_model loaded by llama.h), one kvmix cache with
 * a device arena (kvmix.h, "Device arena") built from a kvmix_policy, and room for max_seqs
 * sequences of up to max_tokens positions each. Each step runs one token of every sequence named
 * (decode, teacher-forced or sampled by the caller): the layers' matrix products through cuBLAS,
 * norms, RoPE and activations in kernels of this file, new key/value rows packed on the GPU by
 * the cache's jobs (kvmix_cuda_cache_run), and attention by kvmix_cuda_decode over the layer's
 * view of every sequence in one launch. The host uploads only what changed: tokens, positions,
 * the cache's jobs and the layer's view tables, never rows. Sequences join and leave between
 * steps. The policy "fp32" (formats KVMIX_KV_FORMAT_FP32) keeps fp32 rows in a plain array and
 * attends in fp32: the reference that answer agreement compares with.
 *
 * Errors: functions return llama_result and write a one-line message into (err, err_bytes).
 * Nothing here prints or exits. One gpu_llama belongs to one thread at a time.
 */
#ifndef GPU_LLAMA_H
#define GPU_LLAMA_H

#include "kvmix.h"
#include "llama.h"
#include "tag_allocation.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gpu_llama gpu_llama;

/* Uploads the model and builds the cache for `policy` (resolved for the model's head_dim) into a
 * new runner, *out (NULL on failure, when everything made so far is released), for
 * up to max_seqs sequences of max_tokens positions (past the model's trained context the model
 * runs, but what it predicts there means nothing: for timing only). arena_bytes: the cache's
 * device arena, 0 = room for every position of every sequence at FP16 (granules of 256 bytes);
 * a given budget uses granules of 4 KiB.
 * LLAMA_ERR_UNSUPPORTED: no CUDA device, or a policy or shape the kernel pack does not run;
 * LLAMA_ERR_MEMORY: the model, cache or buffers do not fit on the device. */
llama_result gpu_llama_create(const llama_model *model, const kvmix_policy *policy,
                              int32_t max_seqs, int32_t max_tokens, size_t arena_bytes,
                              gpu_llama **out, char *err, size_t err_bytes);
void gpu_llama_free(gpu_llama *g);

/* on: every sequence's logits are the same bit for bit whatever sequences step beside it and
 * however many: decode cuts every sequence into the split count a lone sequence of max_tokens
 * positions gets, and matrix products run cuBLAS over groups of 128 rows, the last one padded
 * (cuBLAS picks its kernel, and so each output's order of summation, by the number of rows).
 * What a figure must not owe to the batch size (kvmix-eval-cuda) sets it. Call it before any
 * step. off (the default): cuBLAS over the step's rows, and splits chosen per step for its size. */
llama_result gpu_llama_batch_invariant(gpu_llama *g, bool on, char *err, size_t err_bytes);

/* A new, empty sequence; *out_seq in [0, max_seqs). LLAMA_ERR_CAPACITY when all are in use. */
llama_result gpu_llama_seq_start(gpu_llama *g, int32_t *out_seq, char *err, size_t err_bytes);
/* Ends a sequence: its pages return to the cache (after the next step's jobs). */
void gpu_llama_seq_end(gpu_llama *g, int32_t seq);
/* A request (user turn) begins: the policy's request boundary (kvmix_cache_seq_finish when it
 * says finish). */
llama_result gpu_llama_begin_request(gpu_llama *g, int32_t seq, char *err, size_t err_bytes);

/* One step: token tokens[i] at the next position of sequence seqs[i], i < n (distinct sequences,
 * n <= max_seqs); logits [n][vocab] (host) receive each sequence's next-token logits. */
llama_result gpu_llama_step(gpu_llama *g, const int32_t *seqs, const int32_t *tokens, int32_t n,
                            float *logits, char *err, size_t err_bytes);

/* Prefill: runs n_tokens tokens of one sequence from its next position through the model in
 * chunks of up to 128, each chunk's rows in one pass: matrix products over the chunk, its
 * positions reserved (which seals the pages that left the window by the chunk's end) and its
 * keys and values written through the cache's jobs, then causal attention over every row the
 * sequence holds, read back by kvmix_cuda_view_dequantize. So a chunk's queries see its own
 * rows at FP16 and older rows as the cache holds them at the chunk's end (a decode step at the
 * same position may still hold some of them in its window). logits [n_tokens][vocab] (host, or
 * NULL) receive every token's next-token logits. Tagged caches tag the tokens in order. A chunk
 * records nothing for eviction (gpu_llama_observe). Other sequences' steps may run between calls.
 * LLAMA_ERR_CAPACITY when the sequence would pass max_tokens, LLAMA_ERR_UNSUPPORTED when its
 * view holds more rows than the attention's shared memory. */
llama_result gpu_llama_prefill(gpu_llama *g, int32_t seq, const int32_t *tokens, int32_t n_tokens,
                               float *logits, char *err, size_t err_bytes);

/* Appends n_tokens positions of synthetic keys and values (deterministic FP16 values, the same
 * rows for every layer) to a sequence through the cache's own write and seal path, in chunks:
 * a sequence at a long context for benchmarks without running the model over it. precisions:
 * [n_tokens] formats asked per position (NULL = the policy's). LLAMA_ERR_CAPACITY when the
 * arena is full (the sequence keeps what was filled), LLAMA_ERR_UNSUPPORTED for fp32. */
llama_result gpu_llama_fill(gpu_llama *g, int32_t seq, int32_t n_tokens,
                            const kvmix_cache_precision *precisions, char *err, size_t err_bytes);

/* Makes the cache store each token by its template tag, as kvmix_kv_tag (kvmix_kv.h) does on the
 * CPU: a tagger of `spec` per sequence tags the step's tokens, and each asks for the formats
 * `table` gives its tag in the current turn. Call it before any sequence starts. spec and table
 * are copied. LLAMA_ERR_ARGUMENT for fp32, running sequences, a bad spec or table. */
llama_result gpu_llama_tag(gpu_llama *g, const kvmix_tag_spec *spec,
                           const kvmix_tag_precision *table, char *err, size_t err_bytes);

/* Recording for eviction policies (kvmix.h, "Budgeted eviction"). What the next steps of a
 * sequence record, until changed: GPU_LLAMA_OBSERVE_QUERIES sums its post-RoPE query rows (every
 * layer and q head), GPU_LLAMA_OBSERVE_ATTENTION adds the attention its queries give each cached
 * position (per q head a softmax over the live positions, summed over heads and layers, read
 * from the keys as stored: kvmix_cuda_view_intent_score); 0 records nothing. A new sequence
 * records nothing and has nothing recorded. LLAMA_ERR_ARGUMENT: a sequence not running, unknown
 * flags, the fp32 cache. */
enum { GPU_LLAMA_OBSERVE_QUERIES = 1, GPU_LLAMA_OBSERVE_ATTENTION = 2 };
llama_result gpu_llama_observe(gpu_llama *g, int32_t seq, int32_t flags, char *err,
                               size_t err_bytes);

/* Takes what was recorded and clears it: query_sum [n_layers][n_q_heads][head_dim] (NULL: left
 * recorded) receives the summed queries and *out_n_queries (may be NULL) how many steps; attention
 * [positions the sequence has] (NULL: left recorded) receives the attention per position, 0 for
 * positions that got none. */
llama_result gpu_llama_observed_take(gpu_llama *g, int32_t seq, float *query_sum,
                                     int32_t *out_n_queries, float *attention, char *err,
                                     size_t err_bytes);

/* Intent scores of a sequence's positions (kvmix.h, KVMIX_EVICT_INTENT): for each layer the
 * softmax per q head of memory . key over its live positions (kvmix_cuda_view_intent_score),
 * summed over heads and layers; memory [n_layers][n_q_heads][head_dim] (host); scores
 * [positions the sequence has]: -INFINITY for evicted positions. */
llama_result gpu_llama_intent_scores(gpu_llama *g, int32_t seq, const float *memory, float *scores,
                                     char *err, size_t err_bytes);

/* The intent residual's key features of a sequence's positions for a memory (kvmix.h's KEY_NORM
 * and READOUT, as kvmix_kv_key_features): for each layer kvmix_cuda_view_key_features, averaged
 * over layers; memory [n_layers][n_q_heads][head_dim] (host); key_norm, readout [positions the
 * sequence has]: 0 for evicted positions. */
llama_result gpu_llama_key_features(gpu_llama *g, int32_t seq, const float *memory, float *key_norm,
                                    float *readout, char *err, size_t err_bytes);

/* Evicts positions of a sequence (kvmix_cache_evict: later steps never attend them), then
 * compacts its pages left at most KVMIX_KV_COMPACT_LIVE_FRACTION live (kvmix_cache_compact:
 * their memory comes back), as kvmix_kv_evict does;
 * recorded attention is folded to positions first. LLAMA_ERR_ARGUMENT: positions the cache
 * refuses (nothing evicted), the fp32 cache. */
llama_result gpu_llama_evict(gpu_llama *g, int32_t seq, const int32_t *positions,
                             int32_t n_positions, char *err, size_t err_bytes);

/* The rows a sequence holds, as its cache stores them (dequantized): keys, values (host) are
 * [n_layers][n_positions][n_kv_heads][head_dim] floats, n_positions the positions the sequence
 * has run; positions without a row (evicted) are zeros. For a transfer's sender.
 * LLAMA_ERR_ARGUMENT: not a running kvmix sequence. */
llama_result gpu_llama_rows_read(gpu_llama *g, int32_t seq, float *keys, float *values, char *err,
                                 size_t err_bytes);

/* Appends n_tokens positions with the given rows (host, [n_layers][n_tokens][n_kv_heads]
 * [head_dim] floats, rounded to FP16 as a step's rows are) to a sequence that has none yet,
 * through the cache's write and seal path: a transfer's receiver, whose next step runs at
 * position n_tokens. LLAMA_ERR_ARGUMENT: a sequence with positions, rows that are not finite
 * FP16; LLAMA_ERR_CAPACITY: the arena is full. */
llama_result gpu_llama_rows_ingest(gpu_llama *g, int32_t seq, int32_t n_tokens, const float *keys,
                                   const float *values, char *err, size_t err_bytes);

/* gpu_llama_rows_read and gpu_llama_rows_ingest with device rows: keys, values are FP16 (device,
 * [n_layers][n_positions][n_kv_heads][head_dim] halves, 16-byte aligned), what a GPU sender packs
 * into payloads and a GPU receiver unpacks them into. The read is complete when it returns (the
 * caller's streams may read the rows); the ingest waits for the device first, so rows written on
 * any stream are taken. Errors as the host versions'. */
llama_result gpu_llama_rows_read_device(gpu_llama *g, int32_t seq, void *keys, void *values,
                                        char *err, size_t err_bytes);
llama_result gpu_llama_rows_ingest_device(gpu_llama *g, int32_t seq, int32_t n_tokens,
                                          const void *keys, const void *values, char *err,
                                          size_t err_bytes);

/* Records what a sequence's steps and prefill chunks compute from now on into cap (llama.h,
 * "Captures": the file kvmix-calibrate reads), as the CPU runner's llama_kv_capture_wrap does:
 * for each position p < cap->n_tokens that runs, its token and every layer's post-RoPE query, key
 * and value rows in fp32 as the model made them (before the cache stores them). cap: of the
 * model's shape (llama_capture_init), owned by the caller, written on the host as each step
 * ends; NULL stops recording. gpu_llama_seq_end and gpu_llama_seq_start stop it too. */
llama_result gpu_llama_capture(gpu_llama *g, int32_t seq, llama_capture *cap, char *err,
                               size_t err_bytes);

/* Time spent since gpu_llama_profile_start: steps and tokens run, wall seconds inside
 * gpu_llama_step, host seconds of the cache's bookkeeping in them (reserve, row writes, taking
 * jobs, the view), and GPU seconds of attention (rows to FP16, jobs, decode, output), measured
 * with events around each layer's attention. */
typedef struct gpu_llama_profile {
    int64_t steps, tokens;
    double step_seconds, host_seconds, attention_seconds;
    double view_seconds; /* of host_seconds: building and uploading the step's view */
    int64_t flushes;     /* cache calls that found the arena or the job queue full: the queued
                            jobs ran first and the host waited for them */
} gpu_llama_profile;
void gpu_llama_profile_start(gpu_llama *g);
void gpu_llama_profile_get(const gpu_llama *g, gpu_llama_profile *out);

/* What a sequence holds, as llama_kv_cache's stats (kvmix_kv.h's accounting for kvmix policies;
 * 32 bits per element for fp32). */
void gpu_llama_seq_stats(const gpu_llama *g, int32_t seq, llama_kv_stats *out);
/* A tagged sequence's assigned bits (kvmix_kv_assigned_bits: what its packed tokens' tags cost
   at its current turn, at the allocation's prices when prices is not NULL, else in full pages);
   0 untagged. O(positions): once a text, not a step. */
double gpu_llama_seq_assigned_bits(const gpu_llama *g, int32_t seq, const tag_prices *prices);

/* The kvmix cache and its sequence behind a running sequence (NULL / -1 for the fp32 loop or a
 * sequence not running): its host bookkeeping, for views and statistics; its arena is device
 * memory. */
const kvmix_cache *gpu_llama_inner(const gpu_llama *g, int32_t seq, int32_t *out_kv_seq);

/* The device's name, for reports. */
const char *gpu_llama_device_name(const gpu_llama *g);

#ifdef __cplusplus
}
#endif

#endif /* GPU_LLAMA_H */
