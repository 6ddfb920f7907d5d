/* Compiles the header as the Makefile's language, mode and optimization level (C99, C11, C++,
   KVMIX_STATIC, KVMIX_NO_POLICY for the core alone; -O0 .. -O3, -Os): included twice,
   implementation and all, and a few calls so KVMIX_STATIC functions are referenced. The cache calls run a short decode loop so that the
   optimizer inlines them into a caller, where gcc's flow warnings (maybe-uninitialized) look. */
#define KVMIX_IMPLEMENTATION
#include "../kvmix.h"
#include "../kvmix.h"

#if defined(KVMIX_NO_POLICY) && defined(KVMIX_TAG_MAX_ALTS)
#error "KVMIX_NO_POLICY leaves the policy layer (tags, policies, allocation, intent, tiers) out"
#endif
#if !defined(KVMIX_NO_POLICY) && !defined(KVMIX_TAG_MAX_ALTS)
#error "the policy layer is missing"
#endif

enum { CHECK_LAYERS = 2, CHECK_HEADS = 2, CHECK_DIM = 32, CHECK_STEPS = 40 };
#define CHECK_ROW (CHECK_HEADS * CHECK_DIM)

/* A few decode steps: reserve, write and decode every layer; 0 when every call succeeds. */
static int check_cache_loop(void) {
    kvmix_cache cache;
    kvmix_cache_desc desc;
    kvmix_cache_stats stats;
    float k[CHECK_ROW], v[CHECK_ROW], q[CHECK_ROW], out[CHECK_ROW], lse[CHECK_HEADS];
    double workspace[512];
    size_t need = 0, bound = 0, fast_bound = 0;
    int32_t seq = -1, pos = 0, step, layer, i, failed = 0;
    memset(&desc, 0, sizeof desc);
    desc.n_layers = CHECK_LAYERS;
    desc.n_kv_heads = CHECK_HEADS;
    desc.head_dim = CHECK_DIM;
    desc.max_tokens_per_seq = CHECK_STEPS;
    if (kvmix_cache_arena_bytes_for(&desc, 1, CHECK_STEPS, &desc.arena_bytes, NULL) !=
            KVMIX_SUCCESS ||
        kvmix_cache_init_allocator(&cache, &desc, NULL, NULL) != KVMIX_SUCCESS)
        return 1;
    failed |= kvmix_cache_seq_create(&cache, &seq) != KVMIX_SUCCESS;
    failed |= kvmix_cache_ref_decode_workspace_max(&desc, 1, &bound, NULL) != KVMIX_SUCCESS ||
              bound > sizeof workspace;
    failed |= kvmix_cache_decode_workspace_max(&desc, 1, CHECK_HEADS, &fast_bound, NULL) !=
                  KVMIX_SUCCESS ||
              fast_bound > sizeof workspace;
    for (step = 0; step < CHECK_STEPS && !failed; step++) {
        failed |= kvmix_cache_reserve(&cache, seq, 1, NULL, &pos) != KVMIX_SUCCESS;
        for (layer = 0; layer < CHECK_LAYERS && !failed; layer++) {
            for (i = 0; i < CHECK_ROW; i++) {
                k[i] = (float)((i + step) % 7) * 0.25f;
                v[i] = (float)((i * 3 + layer) % 5) * 0.5f;
                q[i] = (float)(i % 3);
            }
            failed |= kvmix_cache_write(&cache, seq, layer, pos, 1, k, v) != KVMIX_SUCCESS;
            failed |= kvmix_cache_ref_decode(&cache, &seq, 1, layer, CHECK_HEADS, 0.0f, q, out, lse,
                                             workspace, sizeof workspace) != KVMIX_SUCCESS;
            failed |= kvmix_cache_decode(&cache, &seq, 1, layer, CHECK_HEADS, 0.0f, q, out, lse,
                                         workspace, sizeof workspace, NULL) != KVMIX_SUCCESS;
        }
    }
    failed |= kvmix_cache_read(&cache, seq, 0, 0, k, v, NULL) != KVMIX_SUCCESS;
    failed |= kvmix_cache_stats_get(&cache, &stats) != KVMIX_SUCCESS;
    failed |= kvmix_cache_check(&cache) != KVMIX_SUCCESS;
    failed |=
        kvmix_cache_ref_decode_workspace(&cache, &seq, 1, &need) != KVMIX_SUCCESS || need > bound;
    failed |= kvmix_cache_decode_workspace(&cache, &seq, 1, CHECK_HEADS, &need) != KVMIX_SUCCESS ||
              need > fast_bound;
    failed |= kvmix_cache_last_error(&cache)[0] != '\0';
    kvmix_cache_deinit(&cache);
    return failed;
}

#ifndef KVMIX_NO_POLICY
/* The intent residual with a zero output projection: the rule comes back; 0 when it does. */
static int check_residual(void) {
    float w1[2 * KVMIX_INTENT_RESIDUAL_N_FEATURES], b1[2] = {0.5f, -0.25f}, w2[2] = {0.0f, 0.0f};
    float rule[3] = {1.5f, -INFINITY, 0.25f}, out[3],
          features[3 * KVMIX_INTENT_RESIDUAL_N_FEATURES];
    kvmix_intent_residual w;
    int32_t i;
    for (i = 0; i < 2 * KVMIX_INTENT_RESIDUAL_N_FEATURES; i++) w1[i] = (float)(i % 5) * 0.125f;
    memset(&w, 0, sizeof w);
    w.n_features = KVMIX_INTENT_RESIDUAL_N_FEATURES;
    w.hidden = 2;
    w.w1 = w1, w.b1 = b1, w.w2 = w2;
    w.alpha = 1.0f, w.alpha_max = 2.0f;
    if (kvmix_intent_residual_features(rule, NULL, 0, NULL, NULL, 3, features, NULL) !=
            KVMIX_SUCCESS ||
        kvmix_intent_residual_scores(&w, features, rule, 3, out, NULL) != KVMIX_SUCCESS)
        return 1;
    return memcmp(out, rule, sizeof rule) != 0;
}
#else
static int check_residual(void) { return 0; }
#endif

int main(void) {
    kvmix_layout layout;
    size_t bytes = 0;
    memset(&layout, 0, sizeof layout);
    layout.format = KVMIX_FORMAT_BOOSTED;
    layout.n_tokens = 64;
    layout.head_dim = 128;
    layout.n_boost = 16;
    if (kvmix_layout_bytes(&layout, &bytes) != KVMIX_SUCCESS || bytes == 0) return 1;
    if (kvmix_fp32_to_fp16(1.0f) != 0x3c00 || kvmix_fp32_to_bf16(1.0f) != 0x3f80) return 1;
    if (check_cache_loop()) return 1;
    if (check_residual()) return 1;
    return kvmix_result_string(KVMIX_SUCCESS)[0] == 's' ? 0 : 1;
}
