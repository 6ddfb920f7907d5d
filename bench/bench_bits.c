/* Realized bits per K/V element of the paged cache against context length, beside the formula of
   Kitty's layout (its released code's memory layout; README.md, "Policies").

   Build: make build/bench_bits, or cc -std=c99 -O2 -I. bench/bench_bits.c -lm -o build/bench_bits
   Usage: build/bench_bits [head_dim]          (default 128; layers 8, kv heads 2, as kvm-base)

   For each policy and context length L (2K, 4K, 32K) it prefills one sequence of L random tokens
   with kvmix_cache_ingest (no request boundary, so the window and the page being filled are what
   a long request holds), then prints kvmix_cache_seq_stats: bits per element of everything the
   sequence holds (packed pages with scales, minima and boost indices, FP16 sink, window and buffer
   pages at their whole capacity, padding, slot map, page table), the bits of its packed blocks over
   the elements they hold, and its FP16 rows. Beside it, the formula for a Kitty layout (S sinks,
   pages of P tokens, r = n_boost / head_dim, R FP16 values of the window, qK keys and qV values
   waiting in the page being filled, all FP16), per key and value element:
       bits(L) = [(S + qK) 16 + (L - S - qK)(2 + 2r + 40/P)
                  + (S + R + qV) 16 + (L - S - R - qV)(2 + 32/G)] / 2L
   with G the value group (head_dim for Kitty); for other policies the same accounting with their
   formats' bits and their window. */
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <stdio.h>
#include <stdlib.h>

enum { LAYERS = 8, KV_HEADS = 2, CHUNK = 256 };

static uint32_t bench_rng = 12345u;
static float bench_normal(void) { /* sum of 4 uniforms, roughly normal */
    float s = 0.0f;
    int i;
    for (i = 0; i < 4; i++) {
        bench_rng = bench_rng * 1664525u + 1013904223u;
        s += (float)((int32_t)(bench_rng >> 8) - (1 << 23)) / (float)(1 << 23);
    }
    return s;
}

/* Bits per element of one sealed block format at pages of P tokens (metadata included). */
static double format_bits(const kvmix_policy *p, int32_t format, int32_t head_dim) {
    kvmix_layout l;
    double bits = 0.0;
    l.format = (kvmix_format)format;
    l.n_tokens = p->page_tokens;
    l.head_dim = head_dim;
    l.group_size =
        format == KVMIX_FORMAT_INT8 || format == KVMIX_FORMAT_INT4 || format == KVMIX_FORMAT_INT2
            ? p->group_size
            : 0;
    l.n_boost = format == KVMIX_FORMAT_BOOSTED ? p->n_boost : 0;
    kvmix_layout_bits(&l, &bits);
    return bits;
}

/* The formula above for a policy at context L, with the FP16 rows the cache holds in its page
   being filled (q) and its window (R, whole pages, values or keys and values). */
static double formula_bits(const kvmix_policy *p, int32_t head_dim, int64_t L) {
    int64_t S = p->sink_tokens, rest = L - S, q = rest % p->page_tokens;
    int64_t R = (int64_t)(p->window_tokens + p->page_tokens - 1) / p->page_tokens * p->page_tokens;
    int64_t key_fp16 = S + q + (p->window_values_only ? 0 : R), value_fp16 = S + q + R;
    if (key_fp16 > L) key_fp16 = L;
    if (value_fp16 > L) value_fp16 = L;
    return ((double)key_fp16 * 16.0 +
            (double)(L - key_fp16) * format_bits(p, p->key_format, head_dim) +
            (double)value_fp16 * 16.0 +
            (double)(L - value_fp16) * format_bits(p, p->value_format, head_dim)) /
           (2.0 * (double)L);
}

static int run(const kvmix_policy *policy, int32_t head_dim, int64_t L) {
    kvmix_cache cache;
    kvmix_cache_desc d = {0};
    kvmix_cache_seq_stats st;
    kvmix_policy p;
    size_t token_floats = (size_t)KV_HEADS * (size_t)head_dim, packed = 0;
    float *k = (float *)malloc((size_t)LAYERS * CHUNK * token_floats * sizeof(float));
    float *v = (float *)malloc((size_t)LAYERS * CHUNK * token_floats * sizeof(float));
    int32_t seq, f;
    int64_t done, i;
    double packed_elems;
    if (!k || !v || kvmix_policy_resolve(policy, head_dim, &p, NULL) != KVMIX_SUCCESS) return 1;
    d.n_layers = LAYERS;
    d.n_kv_heads = KV_HEADS;
    d.head_dim = head_dim;
    d.max_seqs = 1;
    d.max_tokens_per_seq = (int32_t)L;
    d.arena_bytes = (size_t)L * LAYERS * token_floats * 2 * 2 * 2 + ((size_t)64 << 20);
    if (kvmix_policy_apply(&p, &d, NULL) != KVMIX_SUCCESS ||
        kvmix_cache_init_allocator(&cache, &d, NULL, NULL) != KVMIX_SUCCESS)
        return 1;
    kvmix_cache_seq_create(&cache, &seq);
    for (done = 0; done < L; done += CHUNK) {
        int32_t n = (int32_t)(L - done < CHUNK ? L - done : CHUNK);
        for (i = 0; i < (int64_t)LAYERS * n * (int64_t)token_floats; i++) {
            k[i] = bench_normal();
            v[i] = bench_normal();
        }
        if (kvmix_cache_ingest(&cache, seq, n, k, v, NULL) != KVMIX_SUCCESS) return 1;
    }
    kvmix_cache_seq_stats_get(&cache, seq, &st);
    for (f = KVMIX_FORMAT_INT8; f <= KVMIX_FORMAT_BOOSTED; f++) packed += st.format_bytes[f];
    packed_elems =
        (double)(2 * (int64_t)st.n_live_tokens - st.n_fp16_key_rows - st.n_fp16_value_rows) *
        LAYERS * KV_HEADS * head_dim;
    printf("| %s | %lld | %.3f | %.3f | %.3f | %d | %d |\n", p.name, (long long)L,
           st.bits_per_element, formula_bits(&p, head_dim, L),
           packed_elems > 0 ? (double)packed * 8.0 / packed_elems : 0.0, st.n_fp16_key_rows,
           st.n_fp16_value_rows);
    kvmix_cache_deinit(&cache);
    free(k);
    free(v);
    return 0;
}

int main(int argc, char **argv) {
    static const char *names[] = {"kivi2-sink", "kitty-12", "kitty-25", "kitty-paper-12",
                                  "kitty-paper-25"};
    static const int64_t lengths[] = {2048, 4096, 32768};
    int32_t head_dim = argc > 1 ? atoi(argv[1]) : 128;
    size_t i, j;
    printf("bench_bits: %d layers, %d kv heads, head_dim %d, one sequence of random rows by "
           "kvmix_cache_ingest, no request boundary\n",
           LAYERS, KV_HEADS, (int)head_dim);
    printf("| policy | L | realized bits | formula | packed blocks' bits | FP16 keys | FP16 values "
           "|\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        for (j = 0; j < sizeof lengths / sizeof lengths[0]; j++)
            if (run(kvmix_policy_find(names[i]), head_dim, lengths[j]) != 0) {
                fprintf(stderr, "bench_bits: %s at %lld failed\n", names[i], (long long)lengths[j]);
                return 1;
            }
    return 0;
}
