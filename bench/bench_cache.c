/* Host cost of one decode step of the paged cache: kvmix_cache_append (FP16 row write into the
   buffer page, slot map and page-table update, and the page seal that every page_tokens-th append
   of a sequence does) for every sequence of a batch.

   Build: make build/bench_cache, or cc -std=c99 -O2 -I. bench/bench_cache.c -lm -o build/bench_cache
   Usage: build/bench_cache [n_seqs] [decode_steps]       (defaults 256 and 128)

   Each configuration prefills every sequence with kvmix_cache_ingest, then runs decode steps of
   one append per sequence, timing each append. It prints the configuration, ns per append (mean,
   median, p99, max; mean split into appends that sealed a page and those that did not), the
   bookkeeping-only baseline measured in the same run (the same steps with a 1-layer, 1-head,
   head_dim 32 cache, where row bytes are negligible), and the cache's accounting.

   Then the device-arena bookkeeping row: what a GPU loop's host does per decode step when the
   arena is device memory (the host never touches it; examples/gpu_llama.cu): reserve one
   position per sequence, queue every layer's row copies (kvmix_cache_write_rows), take the jobs
   after each layer, and bring the step's view of layer 0 up to date: the spans each sequence
   keeps from step to step, rebuilt from the first entry kvmix_cache_view_changes reports
   (kvmix_cache_view_seq), as the GPU loop does; a whole view (kvmix_cache_view_counts +
   kvmix_cache_view) is timed beside it. Sequences are first filled to the context the same
   way, in chunks. Shape of kvm-base (8 layers, 2 kv heads of 128), kivi2 (pages of 32, a
   128-token FP16 window). */
#define _POSIX_C_SOURCE 199309L /* clock_gettime under -std=c99/c11 */
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct bench_config {
    const char *name;
    int32_t n_layers, n_kv_heads, head_dim, page_tokens, n_sink, n_window, prefill;
    uint8_t key_format, value_format;
} bench_config;

static double bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int bench_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint32_t bench_rng = 12345u;
static float bench_value(void) {
    bench_rng = bench_rng * 1664525u + 1013904223u;
    return (float)((int32_t)(bench_rng >> 8) - (1 << 23)) / (float)(1 << 23);
}

/* Runs one configuration; returns 0 on success. */
static int bench_run(const bench_config *bc, int32_t n_seqs, int32_t steps, int quiet,
                     double *out_mean_ns) {
    kvmix_cache cache;
    kvmix_cache_desc d;
    kvmix_cache_stats st;
    kvmix_cache_precision prec;
    size_t token_floats = (size_t)bc->n_layers * bc->n_kv_heads * bc->head_dim;
    size_t fp16_page = 4 * token_floats * (size_t)bc->page_tokens;
    int32_t *seqs = (int32_t *)malloc((size_t)n_seqs * sizeof(int32_t));
    double *times = (double *)malloc((size_t)n_seqs * steps * sizeof(double));
    float *rows = (float *)malloc(token_floats * (size_t)bc->prefill * sizeof(float));
    kvmix_cache_precision *precs =
        (kvmix_cache_precision *)malloc((size_t)bc->prefill * sizeof(kvmix_cache_precision));
    double sum = 0.0, seal_sum = 0.0, plain_sum = 0.0, t0, t_all;
    int64_t n_seal = 0, n_plain = 0;
    int32_t s, step, i, total = n_seqs * steps;
    kvmix_result r;
    if (!seqs || !times || !rows || !precs) return 1;
    for (i = 0; i < (int32_t)(token_floats * (size_t)bc->prefill); i++) rows[i] = bench_value();
    prec.key_format = bc->key_format;
    prec.value_format = bc->value_format;
    for (i = 0; i < bc->prefill; i++) precs[i] = prec;
    memset(&d, 0, sizeof d);
    d.n_layers = bc->n_layers;
    d.n_kv_heads = bc->n_kv_heads;
    d.head_dim = bc->head_dim;
    d.page_tokens = bc->page_tokens;
    d.n_sink = bc->n_sink;
    d.n_window = bc->n_window;
    d.max_seqs = n_seqs;
    d.max_tokens_per_seq = bc->prefill + steps + 1;
    /* buffer, window and sealed pages of every sequence, with room to spare */
    d.arena_bytes =
        (size_t)n_seqs *
        (fp16_page * (size_t)(2 + (bc->n_window + bc->page_tokens - 1) / bc->page_tokens) +
         fp16_page / 4 * (size_t)((bc->prefill + steps) / bc->page_tokens + 1));
    r = kvmix_cache_init_allocator(&cache, &d, NULL, NULL);
    if (r != KVMIX_SUCCESS) {
        printf("init: %s\n", kvmix_result_string(r));
        return 1;
    }
    memset(cache.arena, 0, cache.desc.arena_bytes); /* a warm arena: no first-touch page faults */
    for (s = 0; s < n_seqs; s++) {
        if ((r = kvmix_cache_seq_create(&cache, &seqs[s])) != KVMIX_SUCCESS ||
            (r = kvmix_cache_ingest(&cache, seqs[s], bc->prefill, rows, rows, precs)) !=
                KVMIX_SUCCESS) {
            printf("prefill: %s\n", kvmix_result_string(r));
            return 1;
        }
    }
    t_all = bench_now_ns();
    for (step = 0; step < steps; step++)
        for (s = 0; s < n_seqs; s++) {
            const float *k = rows + (size_t)((step + s) % bc->prefill) * token_floats;
            t0 = bench_now_ns();
            r = kvmix_cache_append(&cache, seqs[s], k, k, prec);
            times[step * n_seqs + s] = bench_now_ns() - t0;
            if (r != KVMIX_SUCCESS) {
                printf("append: %s\n", kvmix_result_string(r));
                return 1;
            }
        }
    t_all = bench_now_ns() - t_all;
    for (i = 0; i < total; i++) {
        /* the append that makes a page leave the window seals it: classify by length */
        int32_t step_i = i / n_seqs, len = bc->prefill + step_i + 1;
        int sealed = (len - bc->n_window - bc->n_sink) > 0 &&
                     (len - bc->n_window - bc->n_sink) % bc->page_tokens == 0;
        sum += times[i];
        if (sealed) {
            seal_sum += times[i];
            n_seal++;
        } else {
            plain_sum += times[i];
            n_plain++;
        }
    }
    kvmix_cache_stats_get(&cache, &st);
    qsort(times, (size_t)total, sizeof(double), bench_cmp);
    *out_mean_ns = sum / total;
    if (!quiet) {
        printf("config %s: n_seqs %d, decode steps %d, n_layers %d, n_kv_heads %d, head_dim %d, "
               "page_tokens %d, n_sink %d, n_window %d, prefill %d, formats key %d value %d\n",
               bc->name, (int)n_seqs, (int)steps, (int)bc->n_layers, (int)bc->n_kv_heads,
               (int)bc->head_dim, (int)bc->page_tokens, (int)bc->n_sink, (int)bc->n_window,
               (int)bc->prefill, bc->key_format, bc->value_format);
        printf("  bytes written per append: %zu (FP16 K and V rows of every layer and head)\n",
               token_floats * 4);
        printf("  ns per append: mean %.0f, median %.0f, p99 %.0f, max %.0f; "
               "mean without a seal %.0f (%lld), with a seal %.0f (%lld)\n",
               sum / total, times[total / 2], times[(int64_t)total * 99 / 100], times[total - 1],
               n_plain ? plain_sum / n_plain : 0.0, (long long)n_plain,
               n_seal ? seal_sum / n_seal : 0.0, (long long)n_seal);
        printf("  one decode step (%d appends): %.3f ms; row bandwidth %.2f GB/s\n", (int)n_seqs,
               t_all / steps / 1e6, (double)token_floats * 4 * total / t_all);
        printf("  arena %.1f MiB used of %.1f, metadata %.1f MiB, pages %d (%d buffers), "
               "bits/element %.3f (arena only %.3f)\n",
               st.arena_used_bytes / 1048576.0, st.arena_bytes / 1048576.0,
               st.metadata_bytes / 1048576.0, (int)st.n_pages, (int)st.n_buffer_pages,
               st.bits_per_element, st.arena_bits_per_element);
    }
    kvmix_cache_deinit(&cache);
    free(seqs);
    free(times);
    free(rows);
    free(precs);
    return 0;
}

/* The spans of layer 0 each sequence keeps ([n_seqs][max_pages_per_seq], n_kept of each),
   rebuilt from the first entry that changed since the last update. */
static int bench_kept_update(kvmix_cache *cache, const int32_t *seqs, int32_t n_seqs,
                             kvmix_view_span *kept, int32_t *n_kept) {
    int32_t stride = cache->desc.max_pages_per_seq, s, from, n, n_dead;
    uint8_t no_dead[1];
    for (s = 0; s < n_seqs; s++) {
        if (kvmix_cache_view_changes(cache, seqs[s], &from) != KVMIX_SUCCESS) return 1;
        if (from > n_kept[s]) from = n_kept[s];
        if (kvmix_cache_view_seq(cache, seqs[s], 0, from, kept + (size_t)s * stride + from,
                                 stride - from, no_dead, 0, 0, &n, &n_dead) != KVMIX_SUCCESS)
            return 1; /* (these sequences evict nothing: no dead flags) */
        n_kept[s] = from + n;
    }
    return 0;
}

/* Per decode step of the device-arena bookkeeping, in microseconds (mean over `steps`). */
static int bench_device_step(int32_t n_seqs, int32_t context, int32_t steps) {
    kvmix_cache_desc d;
    kvmix_cache cache;
    size_t bytes = 0, arena_granules;
    void *memory;
    kvmix_quantize_job *jobs;
    kvmix_cache_batch *batches;
    kvmix_view_span *spans, *kept;
    uint8_t *dead;
    int32_t *seqs, *first, *n_kept, s, t, layer, n_jobs, n_batches, n_spans = 0, n_dead = 0;
    double per_step, take_ns = 0.0, view_ns = 0.0, kept_ns = 0.0, total_ns = 0.0;
    kvmix_view view;
    memset(&d, 0, sizeof d);
    d.n_layers = 8, d.n_kv_heads = 2, d.head_dim = 128, d.max_seqs = n_seqs;
    d.max_tokens_per_seq = context + steps + 8;
    kvmix_policy_apply(kvmix_policy_find("kivi2"), &d, NULL);
    /* every page at 2.5 bytes a row and head, and the FP16 window: ample for kivi2 */
    arena_granules = (size_t)n_seqs * ((size_t)context / 32 + 16) * 64;
    d.granule_bytes = 4096;
    d.arena_bytes = arena_granules * d.granule_bytes;
    d.device_arena = 1;
    if (kvmix_cache_memory_bytes(&d, &bytes, NULL) != KVMIX_SUCCESS) return 1;
    memory = malloc(bytes);
    /* a device pointer the host never dereferences: any aligned value does */
    if (!memory ||
        kvmix_cache_init(&cache, &d, memory, bytes, (void *)(uintptr_t)4096, NULL) != KVMIX_SUCCESS)
        return 1;
    jobs = (kvmix_quantize_job *)malloc((size_t)d.max_jobs * sizeof *jobs);
    batches = (kvmix_cache_batch *)malloc((size_t)d.max_jobs * sizeof *batches);
    seqs = (int32_t *)malloc((size_t)n_seqs * sizeof *seqs);
    first = (int32_t *)malloc(((size_t)n_seqs + 1) * sizeof *first);
    if (!jobs || !batches || !seqs || !first) return 1;
    for (s = 0; s < n_seqs; s++) {
        if (kvmix_cache_seq_create(&cache, &seqs[s]) != KVMIX_SUCCESS) return 1;
        for (t = 0; t < context; t += 1024) {
            int32_t n = context - t < 1024 ? context - t : 1024;
            if (kvmix_cache_reserve(&cache, seqs[s], n, NULL, NULL) != KVMIX_SUCCESS) return 1;
            for (layer = 0; layer < d.n_layers; layer++)
                kvmix_cache_write_rows(&cache, seqs[s], layer, t, n, 0);
            kvmix_cache_jobs_take(&cache, jobs, d.max_jobs, batches, d.max_jobs, &n_jobs,
                                  &n_batches);
        }
        if (kvmix_cache_seal_ready(&cache, seqs[s]) != KVMIX_SUCCESS) return 1;
        kvmix_cache_jobs_take(&cache, jobs, d.max_jobs, batches, d.max_jobs, &n_jobs, &n_batches);
    }
    kvmix_cache_view_counts(&cache, seqs, n_seqs, &n_spans, &n_dead);
    spans = (kvmix_view_span *)malloc(((size_t)n_spans + (size_t)n_seqs) * sizeof *spans);
    kept = (kvmix_view_span *)malloc((size_t)n_seqs * d.max_pages_per_seq * sizeof *kept);
    n_kept = (int32_t *)calloc((size_t)n_seqs, sizeof *n_kept);
    dead = (uint8_t *)malloc((size_t)n_dead + 1);
    if (!spans || !kept || !n_kept || !dead) return 1;
    for (t = 0; t < steps; t++) {
        double step_start = bench_now_ns(), mark;
        for (s = 0; s < n_seqs; s++)
            if (kvmix_cache_reserve(&cache, seqs[s], 1, NULL, NULL) != KVMIX_SUCCESS) return 1;
        for (layer = 0; layer < d.n_layers; layer++) {
            for (s = 0; s < n_seqs; s++)
                kvmix_cache_write_rows(&cache, seqs[s], layer, context + t, 1, s);
            mark = bench_now_ns();
            kvmix_cache_jobs_take(&cache, jobs, d.max_jobs, batches, d.max_jobs, &n_jobs,
                                  &n_batches);
            take_ns += bench_now_ns() - mark;
            if (layer == 0) {
                mark = bench_now_ns();
                if (bench_kept_update(&cache, seqs, n_seqs, kept, n_kept)) return 1;
                kept_ns += bench_now_ns() - mark;
                mark = bench_now_ns();
                kvmix_cache_view_counts(&cache, seqs, n_seqs, &n_spans, &n_dead);
                if (kvmix_cache_view(&cache, seqs, n_seqs, 0, spans, n_spans, first, dead, n_dead,
                                     &view) != KVMIX_SUCCESS)
                    return 1;
                view_ns += bench_now_ns() - mark;
            }
        }
        total_ns += bench_now_ns() - step_start;
    }
    per_step = (total_ns - view_ns) / steps / 1e3;
    printf("device-arena kvm-base-shape kivi2: %d seqs at %d tokens (%d spans a view): %.0f us "
           "a step with kept views (their update %.1f us, taking jobs %.0f, reserve and row "
           "writes the rest); a whole view instead: %.0f us\n",
           n_seqs, context, view.n_spans, per_step, kept_ns / steps / 1e3, take_ns / steps / 1e3,
           view_ns / steps / 1e3);
    kvmix_cache_deinit(&cache);
    free(memory), free(jobs), free(batches), free(seqs), free(first), free(spans), free(dead);
    free(kept), free(n_kept);
    return 0;
}

int main(int argc, char **argv) {
    int32_t n_seqs = argc > 1 ? atoi(argv[1]) : 256, steps = argc > 2 ? atoi(argv[2]) : 128;
    static const bench_config configs[] = {
        {"8B-shape-kivi2", 32, 8, 128, 64, 0, 0, 192, KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2},
        {"8B-shape-sink4-window64", 32, 8, 128, 64, 4, 64, 192, KVMIX_FORMAT_INT2_CHANNEL,
         KVMIX_FORMAT_INT2},
        {"8B-shape-int4", 32, 8, 128, 64, 0, 0, 192, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4},
    };
    bench_config tiny = configs[0];
    double mean = 0.0, baseline = 0.0;
    size_t i;
    if (n_seqs <= 0 || steps <= 0) {
        printf("usage: bench_cache [n_seqs] [decode_steps]\n");
        return 2;
    }
    tiny.name = "bookkeeping-baseline";
    tiny.n_layers = 1;
    tiny.n_kv_heads = 1;
    tiny.head_dim = 32;
    if (bench_run(&tiny, n_seqs, steps, 0, &baseline)) return 1;
    for (i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        if (bench_run(&configs[i], n_seqs, steps, 0, &mean)) return 1;
        printf("  ratio to the bookkeeping baseline: %.1fx\n", mean / baseline);
    }
    if (bench_device_step(64, 4096, 32) || bench_device_step(256, 4096, 32) ||
        bench_device_step(64, 32768, 16) || bench_device_step(135, 32768, 16))
        return 1;
    return 0;
}
