/* transfer_driver.c - a transfer's runner-free parts (transfer_driver.h). */
#include "transfer_driver.h"

int64_t transfer_point(const evict_request *requests, int32_t n_requests, int64_t n) {
    for (int32_t i = 0; i < n_requests; i++)
        if (requests[i].end >= n / 2 && requests[i].end < n) return requests[i].end;
    return n / 2;
}

static void add_plan(transfer_stats *s, const kvmix_tier_plan *p, int32_t n_tokens, size_t bytes,
                     size_t fp16_bytes) {
    s->n_transfers++;
    s->n_tokens += n_tokens;
    s->n_fp16 += p->n_fp16, s->n_int8 += p->n_int8, s->n_int4 += p->n_int4;
    s->n_dropped += p->n_dropped;
    s->bytes += (double)bytes, s->fp16_bytes += (double)fp16_bytes;
}

llama_result transfer_send(const llama_config *c, const transfer_setup *setup,
                           const float *attention, float *keys, float *values, int32_t n,
                           uint8_t *tiers, transfer_stats *stats, char *err, size_t err_bytes) {
    kvmix_tier_plan plan;
    size_t bytes = 0, fp16_bytes = 0;
    if (transfer_choose(setup, attention, keys, values, c->n_layers, n, c->n_kv_heads, c->head_dim,
                        tiers, &plan, err, err_bytes) != KVMIX_SUCCESS ||
        transfer_round_trip(tiers, setup->group_size, keys, values, c->n_layers, n, c->n_kv_heads,
                            c->head_dim, &bytes, &fp16_bytes, err, err_bytes) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    add_plan(stats, &plan, n, bytes, fp16_bytes);
    return LLAMA_OK;
}

void transfer_dropped(const uint8_t *tiers, int32_t n, int32_t *gone, int32_t *out_n) {
    *out_n = 0;
    for (int32_t j = 0; j < n; j++)
        if (tiers[j] == KVMIX_PAYLOAD_NO_ROW) gone[(*out_n)++] = j;
}
