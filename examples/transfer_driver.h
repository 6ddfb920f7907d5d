/* transfer_driver.h - a prefill-to-decode transfer inside a runner's loop, for measuring the
 * transfer tiers (transfer_plan.h) on real texts: a running sequence's rows are read back, tiered,
 * sent through payloads and back (transfer_send), and ingested by a fresh sequence that then goes
 * on as the decode worker would. transfer_sequence does all of it over gpu_llama (transfer_gpu.c,
 * the GPU build's); the CPU runner does it over its kvmix-backed cache (kvmix_eval.c).
 *
 * Errors: llama_result with a one-line message in (err, err_bytes); nothing prints or exits.
 */
#ifndef TRANSFER_DRIVER_H
#define TRANSFER_DRIVER_H

#include "evict_driver.h"
#include "transfer_plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What one run's transfers did, summed over its sequences. */
typedef struct transfer_stats {
    int64_t n_transfers, n_tokens;
    int64_t n_fp16, n_int8, n_int4, n_dropped;
    double bytes, fp16_bytes; /* payload bytes sent, and as all-FP16 payloads */
} transfer_stats;

/* Where a text of n positions is handed over: the end of the first request (user message)
 * that ends at or after n / 2, so that the decode side starts with an answer; without one, n / 2. */
int64_t transfer_point(const evict_request *requests, int32_t n_requests, int64_t n);

/* The sender's side of a hand-over of n positions: each position's tier (tiers [n]) by `setup`
 * over the attention the prefill gave each position (TIERED; [n]) and the rows, then the rows sent
 * through payloads and back in place (keys, values: [n_layers][n][n_kv_heads][head_dim]; a
 * position not sent, KVMIX_PAYLOAD_NO_ROW, the receiver evicts). Adds to *stats. */
llama_result transfer_send(const llama_config *config, const transfer_setup *setup,
                           const float *attention, float *keys, float *values, int32_t n,
                           uint8_t *tiers, transfer_stats *stats, char *err, size_t err_bytes);

/* The positions a transfer did not send (tiers [n]) into gone, *out_n of them. */
void transfer_dropped(const uint8_t *tiers, int32_t n, int32_t *gone, int32_t *out_n);

/* Hands running sequence *seq of g, which has run positions 0 .. n_positions - 1, over: its rows
 * (gpu_llama_rows_read), the attention it recorded since it started (TIERED: gpu_llama_observe
 * with GPU_LLAMA_OBSERVE_ATTENTION from its first step), transfer_send; then *seq ends and a new
 * sequence, which *seq then names, ingests the rows (gpu_llama_rows_ingest) and evicts the
 * positions not sent. Adds to *stats. */
struct gpu_llama;
llama_result transfer_sequence(struct gpu_llama *g, const llama_config *config,
                               const transfer_setup *setup, int32_t n_positions, int32_t *seq,
                               transfer_stats *stats, char *err, size_t err_bytes);

#ifdef __cplusplus
}
#endif

#endif /* TRANSFER_DRIVER_H */
