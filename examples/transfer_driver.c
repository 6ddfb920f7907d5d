/* transfer_driver.c - a transfer inside the GPU loop (transfer_driver.h). */
#include "transfer_driver.h"
#include <stdlib.h>
#include <string.h>

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

/* The positions a transfer did not send, evicted on the receiver. */
static llama_result evict_dropped(gpu_llama *g, int32_t seq, const uint8_t *tiers, int32_t n,
                                  char *err, size_t err_bytes) {
    int32_t *gone = malloc((size_t)(n > 0 ? n : 1) * sizeof *gone), n_gone = 0;
    if (!gone) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "transfer: out of memory");
    for (int32_t j = 0; j < n; j++)
        if (tiers[j] == KVMIX_PAYLOAD_NO_ROW) gone[n_gone++] = j;
    llama_result r = n_gone > 0 ? gpu_llama_evict(g, seq, gone, n_gone, err, err_bytes) : LLAMA_OK;
    free(gone);
    return r;
}

llama_result transfer_sequence(gpu_llama *g, const llama_config *c, const transfer_setup *setup,
                               int32_t n, int32_t *seq, transfer_stats *stats, char *err,
                               size_t err_bytes) {
    int32_t next = -1;
    size_t floats = (size_t)c->n_layers * (size_t)n * (size_t)(c->n_kv_heads * c->head_dim);
    float *keys = malloc((floats > 0 ? floats : 1) * sizeof *keys);
    float *values = malloc((floats > 0 ? floats : 1) * sizeof *values);
    float *attention = malloc((size_t)(n > 0 ? n : 1) * sizeof *attention);
    uint8_t *tiers = malloc((size_t)(n > 0 ? n : 1));
    llama_result r = keys && values && attention && tiers
                         ? LLAMA_OK
                         : llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "transfer: out of memory");
    kvmix_tier_plan plan;
    size_t bytes = 0, fp16_bytes = 0;
    if (r == LLAMA_OK) r = gpu_llama_rows_read(g, *seq, keys, values, err, err_bytes);
    if (r == LLAMA_OK && setup->mode == TRANSFER_TIERED)
        r = gpu_llama_observed_take(g, *seq, NULL, NULL, attention, err, err_bytes);
    if (r == LLAMA_OK &&
        (transfer_choose(setup, attention, keys, values, c->n_layers, n, c->n_kv_heads, c->head_dim,
                         tiers, &plan, err, err_bytes) != KVMIX_SUCCESS ||
         transfer_round_trip(tiers, setup->group_size, keys, values, c->n_layers, n, c->n_kv_heads,
                             c->head_dim, &bytes, &fp16_bytes, err, err_bytes) != KVMIX_SUCCESS))
        r = LLAMA_ERR_ARGUMENT;
    if (r == LLAMA_OK) {
        gpu_llama_seq_end(g, *seq);
        r = gpu_llama_seq_start(g, &next, err, err_bytes);
    }
    if (r == LLAMA_OK) {
        *seq = next;
        r = gpu_llama_rows_ingest(g, next, n, keys, values, err, err_bytes);
    }
    if (r == LLAMA_OK) r = evict_dropped(g, next, tiers, n, err, err_bytes);
    if (r == LLAMA_OK) add_plan(stats, &plan, n, bytes, fp16_bytes);
    free(keys), free(values), free(attention), free(tiers);
    return r;
}
