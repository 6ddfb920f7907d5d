/* cache_loop: the paged cache inside a decode loop, the way an inference engine drives it.

   A shared system prompt is prefilled once and forked into two sessions (prefix sharing); each
   session then decodes token by token: reserve the position, and for each layer write its K/V
   rows and run attention over what the cache holds for that layer (kvmix_cache_decode, the fast
   CPU decode, on two threads; kvmix_cache_ref_decode is its reference). Pages fill an FP16 buffer and
   are sealed into 2-bit per-channel keys and 2-bit values once they leave the FP16 window, so
   decoded tokens reach 2 bits too. Halfway, one session evicts the oldest half of its history.
   The program prints the cache's accounting and exits nonzero if any call fails.

   K/V rows here are random stand-ins for a model's projections. Run: make build/cache_loop */
#define KVMIX_IMPLEMENTATION
#include "../kvmix.h"

#include <stdio.h>
#include <stdlib.h>

enum { N_LAYERS = 4, N_KV_HEADS = 2, N_Q_HEADS = 8, HEAD_DIM = 64, PROMPT = 300, STEPS = 400 };
#define ROW_FLOATS (N_KV_HEADS * HEAD_DIM)

static uint32_t rng = 12345u;

static float noise(void) {
    rng = rng * 1664525u + 1013904223u;
    return (float)((rng >> 8) & 0xffff) / 32768.0f - 1.0f;
}

static void fill(float *x, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) x[i] = noise();
}

/* A refused call prints the result and the cache's reason, then the program stops. */
#define TRY(cache, call)                                                                           \
    do {                                                                                           \
        kvmix_result r_ = (call);                                                                  \
        if (r_ != KVMIX_SUCCESS) {                                                                 \
            fprintf(stderr, "cache_loop: %s failed: %s (%s)\n", #call, kvmix_result_string(r_),    \
                    kvmix_cache_last_error(cache));                                                \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Workspace of the decode: allocated once, at its bound for one sequence; and its threads. */
typedef struct workspace {
    void *memory;
    size_t bytes;
    kvmix_parallel parallel;
} workspace;

/* One decode step of one sequence: a new position, then per layer its rows and its attention. */
static int decode_step(kvmix_cache *cache, int32_t seq, const workspace *w) {
    float keys[ROW_FLOATS], values[ROW_FLOATS], q[N_Q_HEADS * HEAD_DIM], out[N_Q_HEADS * HEAD_DIM];
    float lse[N_Q_HEADS];
    int32_t position, layer;
    TRY(cache, kvmix_cache_reserve(cache, seq, 1, NULL, &position));
    for (layer = 0; layer < N_LAYERS; layer++) {
        fill(keys, ROW_FLOATS); /* a model would compute these from the layer's input */
        fill(values, ROW_FLOATS);
        fill(q, N_Q_HEADS * HEAD_DIM);
        TRY(cache, kvmix_cache_write(cache, seq, layer, position, 1, keys, values));
        TRY(cache, kvmix_cache_decode(cache, &seq, 1, layer, N_Q_HEADS, 0.0f, q, out, lse,
                                      w->memory, w->bytes, &w->parallel));
    }
    return 0;
}

static void print_stats(const kvmix_cache *cache, int32_t seq, const char *name) {
    kvmix_cache_seq_stats s;
    if (kvmix_cache_seq_stats_get(cache, seq, &s) != KVMIX_SUCCESS) return;
    printf("%-8s %6d tokens %6d live %4d pages (%d shared) %6d fp16 rows %9.0f bytes %6.3f "
           "bits/elem\n",
           name, s.n_tokens, s.n_live_tokens, s.n_pages, s.n_shared_pages, s.n_fp16_rows,
           s.attributed_bytes, s.bits_per_element);
}

int main(void) {
    kvmix_cache cache = {0}; /* zero: its message reads "" before the init */
    kvmix_cache_desc desc = {0};
    kvmix_cache_stats stats;
    static float prompt_k[N_LAYERS * PROMPT * ROW_FLOATS], prompt_v[N_LAYERS * PROMPT * ROW_FLOATS];
    static int32_t old[PROMPT];
    int32_t prompt, session[2], step, i;
    workspace w = {NULL, 0, {2, NULL, NULL}}; /* 2 threads (or parallel_for: a pool's) */

    desc.n_layers = N_LAYERS;
    desc.n_kv_heads = N_KV_HEADS;
    desc.head_dim = HEAD_DIM;
    desc.page_tokens = 64;
    desc.n_sink = 4;
    desc.n_window = 64;
    desc.max_seqs = 4;
    desc.max_tokens_per_seq = 2048;
    desc.default_precision.key_format = KVMIX_FORMAT_INT2_CHANNEL;
    desc.default_precision.value_format = KVMIX_FORMAT_INT2;
    /* the arena: as if the prompt and both sessions each held all their tokens (the sessions
       share the prompt's pages, which leaves room for their copies on write) */
    TRY(&cache, kvmix_cache_arena_bytes_for(&desc, 3, PROMPT + STEPS, &desc.arena_bytes, NULL));
    TRY(&cache, kvmix_cache_init_allocator(&cache, &desc, NULL, NULL));
    printf("cache: %d layers, %d kv heads, head_dim %d, pages of %d, %d sinks, window %d, "
           "arena %zu bytes\n",
           desc.n_layers, desc.n_kv_heads, desc.head_dim, desc.page_tokens, desc.n_sink,
           desc.n_window, desc.arena_bytes);
    TRY(&cache, kvmix_cache_decode_workspace_max(&desc, 1, N_Q_HEADS, &w.bytes, NULL));
    if (!(w.memory = malloc(w.bytes))) return 1;

    /* prefill the shared prompt once ([layer][token][head][dim] rows), then fork two sessions */
    fill(prompt_k, sizeof prompt_k / sizeof prompt_k[0]);
    fill(prompt_v, sizeof prompt_v / sizeof prompt_v[0]);
    TRY(&cache, kvmix_cache_seq_create(&cache, &prompt));
    TRY(&cache, kvmix_cache_ingest(&cache, prompt, PROMPT, prompt_k, prompt_v, NULL));
    TRY(&cache, kvmix_cache_seq_fork(&cache, prompt, PROMPT, &session[0]));
    TRY(&cache, kvmix_cache_seq_fork(&cache, prompt, PROMPT, &session[1]));
    TRY(&cache, kvmix_cache_seq_free(&cache, prompt)); /* its pages live on in the sessions */

    for (step = 0; step < STEPS; step++) {
        for (i = 0; i < 2; i++)
            if (decode_step(&cache, session[i], &w)) return 1;
        if (step == STEPS / 2) { /* session 1 drops the older half of the prompt */
            for (i = 0; i < PROMPT / 2; i++) old[i] = i + 8;
            TRY(&cache, kvmix_cache_evict(&cache, session[1], old, PROMPT / 2));
        }
    }
    print_stats(&cache, session[0], "session0");
    print_stats(&cache, session[1], "session1");
    TRY(&cache, kvmix_cache_stats_get(&cache, &stats));
    printf("arena    %zu of %zu bytes used, %d pages (%d shared, %d FP16 buffers), %.3f bits/elem "
           "with metadata\n",
           stats.arena_used_bytes, stats.arena_bytes, stats.n_pages, stats.n_shared_pages,
           stats.n_buffer_pages, stats.bits_per_element);
    TRY(&cache, kvmix_cache_check(&cache));
    free(w.memory);
    kvmix_cache_deinit(&cache);
    return 0;
}
