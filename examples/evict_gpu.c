/* evict_gpu.c - the eviction driver's backend over gpu_llama (evict_driver.h): each call is the
 * gpu_llama function of the same name. */
#include "evict_driver.h"
#include "gpu_llama.h"

_Static_assert((int)EVICT_OBSERVE_QUERIES == (int)GPU_LLAMA_OBSERVE_QUERIES &&
                   (int)EVICT_OBSERVE_ATTENTION == (int)GPU_LLAMA_OBSERVE_ATTENTION,
               "the driver's flags pass through unchanged");

static llama_result gpu_observe(void *runner, int32_t seq, int32_t flags, char *err,
                                size_t err_bytes) {
    return gpu_llama_observe(runner, seq, flags, err, err_bytes);
}

static llama_result gpu_observed_take(void *runner, int32_t seq, float *query_sum,
                                      int32_t *out_n_queries, float *attention, char *err,
                                      size_t err_bytes) {
    return gpu_llama_observed_take(runner, seq, query_sum, out_n_queries, attention, err,
                                   err_bytes);
}

static llama_result gpu_intent_scores(void *runner, int32_t seq, const float *memory, float *scores,
                                      char *err, size_t err_bytes) {
    return gpu_llama_intent_scores(runner, seq, memory, scores, err, err_bytes);
}

static const kvmix_cache *gpu_inner(const void *runner, int32_t seq, int32_t *out_kv_seq) {
    return gpu_llama_inner(runner, seq, out_kv_seq);
}

static llama_result gpu_evict(void *runner, int32_t seq, const int32_t *positions,
                              int32_t n_positions, char *err, size_t err_bytes) {
    return gpu_llama_evict(runner, seq, positions, n_positions, err, err_bytes);
}

static void gpu_seq_stats(const void *runner, int32_t seq, llama_kv_stats *out) {
    gpu_llama_seq_stats(runner, seq, out);
}

static llama_result gpu_key_features(void *runner, int32_t seq, const float *memory,
                                     float *key_norm, float *readout, char *err, size_t err_bytes) {
    return gpu_llama_key_features(runner, seq, memory, key_norm, readout, err, err_bytes);
}

evict_backend evict_backend_gpu(struct gpu_llama *g, int32_t seq) {
    evict_backend b = {g,         seq,       gpu_observe,   gpu_observed_take, gpu_intent_scores,
                       gpu_inner, gpu_evict, gpu_seq_stats, gpu_key_features};
    return b;
}
