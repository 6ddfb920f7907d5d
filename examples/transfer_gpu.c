/* transfer_gpu.c - a transfer inside the GPU loop over gpu_llama (transfer_driver.h). */
#include "gpu_llama.h"
#include "transfer_driver.h"
#include <stdlib.h>

/* The positions a transfer did not send, evicted on the receiver. */
static llama_result evict_dropped(gpu_llama *g, int32_t seq, const uint8_t *tiers, int32_t n,
                                  char *err, size_t err_bytes) {
    int32_t *gone = malloc((size_t)(n > 0 ? n : 1) * sizeof *gone), n_gone = 0;
    if (!gone) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "transfer: out of memory");
    transfer_dropped(tiers, n, gone, &n_gone);
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
    if (r == LLAMA_OK) r = gpu_llama_rows_read(g, *seq, keys, values, err, err_bytes);
    if (r == LLAMA_OK && setup->mode == TRANSFER_TIERED)
        r = gpu_llama_observed_take(g, *seq, NULL, NULL, attention, err, err_bytes);
    if (r == LLAMA_OK)
        r = transfer_send(c, setup, attention, keys, values, n, tiers, stats, err, err_bytes);
    if (r == LLAMA_OK) {
        gpu_llama_seq_end(g, *seq);
        r = gpu_llama_seq_start(g, &next, err, err_bytes);
    }
    if (r == LLAMA_OK) {
        *seq = next;
        r = gpu_llama_rows_ingest(g, next, n, keys, values, err, err_bytes);
    }
    if (r == LLAMA_OK) r = evict_dropped(g, next, tiers, n, err, err_bytes);
    free(keys), free(values), free(attention), free(tiers);
    return r;
}
