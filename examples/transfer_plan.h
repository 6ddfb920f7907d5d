/* transfer_plan.h - how a prefilled sequence's rows travel to a decode worker: each token's tier
 * (kvmix_tier_choose for the tiered policy, or one of the baselines it is measured against) and
 * the round trip of its rows through transfer payloads (kvmix_payload_pack / _unpack), for the
 * runners and examples/pd_transfer.c. Rows are [n_layers][n_tokens][n_kv_heads][head_dim]
 * floats, finite with |x| <= 65504 (what an FP16 cache holds). Links with one kvmix
 * implementation; pure and thread-safe.
 */
#ifndef KVMIX_TRANSFER_PLAN_H
#define KVMIX_TRANSFER_PLAN_H
#include <stddef.h>
#include <stdint.h>
#include "kvmix.h"

typedef enum transfer_mode {
    TRANSFER_TIERED = 1, /* importance = attention * exp(-lambda * age), kvmix_tier_choose */
    TRANSFER_NORMS,      /* the same with the key/value-norm statistic (no attention recorded) */
    TRANSFER_INT8,       /* every token INT8, whatever the budget (its own cost) */
    TRANSFER_INT4,       /* every token INT4, whatever the budget */
    TRANSFER_RANDOM,     /* the tiered policy's mix over random importance, no sinks pinned */
    TRANSFER_SINKS,      /* the same with the sinks pinned: sinks are all it protects */
    TRANSFER_ENDS        /* the sinks and the most recent tokens FP16, the middle not sent */
} transfer_mode;

typedef struct transfer_setup {
    int32_t mode;       /* a transfer_mode */
    double budget;      /* b: bytes over the all-FP16 bytes, (0, 1] */
    double lambda;      /* TIERED, NORMS: recency decay of the importance, >= 0 */
    int32_t n_sink;     /* first tokens pinned to FP16 (all modes but INT8, INT4, RANDOM) */
    int32_t allow_int4; /* 0: the model's INT4 probe failed (tiered modes use FP16 + INT8) */
    int32_t group_size; /* of the INT8/INT4 rows; 0 = KVMIX_GROUP_SIZE_DEFAULT */
    uint64_t seed;      /* RANDOM, SINKS */
} transfer_setup;

/* Parses "MODE:B[:LAMBDA]" (MODE tiered, norms, int8, int4, random, sinks, ends; B the budget;
 * LAMBDA for tiered and norms, default 0) into *out, leaving n_sink, allow_int4, group_size and
 * seed as they were. Returns KVMIX_SUCCESS or INVALID_ARGUMENT (err says why). */
kvmix_result transfer_parse(const char *text, transfer_setup *out, char *err, size_t err_bytes);

/* "tiered", "norms", ... (NULL for another value). */
const char *transfer_mode_name(int32_t mode);

/* Each token's tier (kvmix_format, or KVMIX_PAYLOAD_NO_ROW for a token not sent) and the plan's
 * counts and cost. attention: [n_tokens] accumulated attention mass of the prefill (TIERED
 * only; NULL there is an error); keys, values: the rows (NORMS reads them). Returns
 * KVMIX_SUCCESS, NULL_POINTER, INVALID_ARGUMENT, BAD_VALUE, OUT_OF_MEMORY (err says why);
 * nothing is written on error. */
kvmix_result transfer_choose(const transfer_setup *setup, const float *attention, const float *keys,
                             const float *values, int32_t n_layers, int32_t n_tokens,
                             int32_t n_kv_heads, int32_t head_dim, uint8_t *tiers,
                             kvmix_tier_plan *out_plan, char *err, size_t err_bytes);

/* Sends the rows through payloads and back, in place: each run of sent tokens of each layer is
 * packed as one ROWS payload (first_position = the run's first token) and unpacked over its
 * rows; rows of tokens not sent become zeros (the receiver evicts them). *out_bytes: the
 * payloads' bytes; *out_fp16_bytes (may be NULL): what the same tokens' rows take as all-FP16
 * payloads. Returns KVMIX_SUCCESS or the codec's error (err says which); on error the rows may
 * be partly replaced. */
kvmix_result transfer_round_trip(const uint8_t *tiers, int32_t group_size, float *keys,
                                 float *values, int32_t n_layers, int32_t n_tokens,
                                 int32_t n_kv_heads, int32_t head_dim, size_t *out_bytes,
                                 size_t *out_fp16_bytes, char *err, size_t err_bytes);

#endif /* KVMIX_TRANSFER_PLAN_H */
