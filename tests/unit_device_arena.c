/* unit_device_arena: a cache whose arena is device memory queues jobs instead of writing row
   bytes; run by the CPU reference executor (kvmix_ref_cache_run) they give the bytes of a host
   arena, over random workloads of several policies (device_arena_scenario.h; test_cuda runs the
   same workloads on the GPU). Also: the calls that pass rows through the host refuse a device
   arena, a full job queue fails cleanly, a dropped job is noticed. */
#include "device_arena_scenario.h"
#include "harness.h"

#include <stdlib.h>
#include <string.h>

typedef struct ref_executor {
    uint8_t *arena;
    int drop_one; /* a mutant: skip the last job of the first batch once */
    int reverse;  /* each batch's jobs last to first: a launch runs them in any order */
} ref_executor;

/* The batches in order, each one's jobs from last to first. */
static kvmix_result run_reversed(const kvmix_cache_batch *batches, int32_t n_batches,
                                 const kvmix_quantize_job *jobs, const uint16_t *key_rows,
                                 const uint16_t *value_rows, uint8_t *arena, int32_t *bad_jobs) {
    int32_t b, j, bad = 0;
    for (b = 0; b < n_batches; b++)
        for (j = batches[b].n_jobs - 1; j >= 0; j--) {
            kvmix_cache_batch one = batches[b];
            int32_t one_bad = 0;
            kvmix_result r;
            one.first_job += j;
            one.n_jobs = 1;
            r = kvmix_ref_cache_run(&one, 1, jobs, key_rows, value_rows, arena, &one_bad);
            if (r != KVMIX_SUCCESS) return r;
            bad += one_bad;
        }
    if (bad_jobs) *bad_jobs = bad;
    return KVMIX_SUCCESS;
}

static int ref_run(void *ctx, const kvmix_cache_batch *batches, int32_t n_batches,
                   const kvmix_quantize_job *jobs, int32_t n_jobs, const uint16_t *key_rows,
                   const uint16_t *value_rows, int64_t n_rows, int32_t *bad_jobs) {
    ref_executor *ex = (ref_executor *)ctx;
    kvmix_cache_batch first = batches[0];
    (void)n_jobs;
    (void)n_rows;
    if (ex->drop_one && first.n_jobs > 1) {
        kvmix_cache_batch *copy = (kvmix_cache_batch *)test_alloc((size_t)n_batches * sizeof *copy);
        kvmix_result r;
        memcpy(copy, batches, (size_t)n_batches * sizeof *copy);
        copy[0].n_jobs--;
        ex->drop_one = 0;
        r = kvmix_ref_cache_run(copy, n_batches, jobs, key_rows, value_rows, ex->arena, bad_jobs);
        free(copy);
        return r == KVMIX_SUCCESS;
    }
    if (ex->reverse)
        return run_reversed(batches, n_batches, jobs, key_rows, value_rows, ex->arena, bad_jobs) ==
               KVMIX_SUCCESS;
    return kvmix_ref_cache_run(batches, n_batches, jobs, key_rows, value_rows, ex->arena,
                               bad_jobs) == KVMIX_SUCCESS;
}

static int ref_fetch(void *ctx, uint8_t *host, size_t bytes) {
    memcpy(host, ((ref_executor *)ctx)->arena, bytes);
    return 1;
}

/* The descs of the scenario: per-token formats with a window, Kitty's layout, sinks and a
   partial page quantized at finish, FP16, grouped values. */
static kvmix_cache_desc scenario_desc(int which) {
    kvmix_cache_desc d;
    memset(&d, 0, sizeof d);
    d.n_layers = 2;
    d.n_kv_heads = 2;
    d.head_dim = 64;
    d.page_tokens = 16;
    d.max_seqs = 5;
    d.max_tokens_per_seq = 160;
    d.arena_bytes = (size_t)1 << 21;
    d.max_jobs = 400;
    d.n_boost = 8; /* the scenario asks for BOOSTED keys */
    switch (which) {
    case 0: d.n_window = 16; break;
    case 1:
        d.n_sink = 4;
        d.n_window = 32;
        d.window_values_only = 1;
        break;
    case 2:
        d.n_sink = 8;
        d.partial = KVMIX_CACHE_PARTIAL_QUANTIZE;
        d.group_size = 16;
        d.value_group_size = 64;
        break;
    default:
        d.default_precision.key_format = KVMIX_FORMAT_FP16;
        d.default_precision.value_format = KVMIX_FORMAT_FP16;
        break;
    }
    return d;
}

static void test_scenarios(void) {
    int which, seed;
    for (which = 0; which < 4; which++) {
        int64_t compacted_all = 0, retiered_all = 0;
        for (seed = 0; seed < 6; seed++) {
            kvmix_cache_desc d = scenario_desc(which);
            ref_executor ex = {(uint8_t *)test_alloc(d.arena_bytes), 0, seed % 2};
            da_executor e = {&ex, ex.arena, ref_run, ref_fetch};
            char why[160];
            da_counts counts;
            memset(ex.arena, 0, d.arena_bytes);
            memset(&counts, 0, sizeof counts);
            test_context("desc %d seed %d", which, seed);
            CHECK_MSG(da_scenario(&d, test_seed() + (uint64_t)(seed + 100 * which), 400, &e, why,
                                  sizeof why, &counts) == 0,
                      "%s", why);
            CHECK(counts.jobs > 100); /* the workload did queue work */
            compacted_all += counts.compacted;
            retiered_all += counts.retiered;
            free(ex.arena);
        }
        test_context("desc %d", which);
        CHECK(compacted_all > 0); /* compaction moved pages, on both caches alike */
        CHECK(retiered_all > 0);  /* and pages were re-tiered */
    }
    test_context(NULL);
}

/* A job left out is a difference the scenario reports. */
static void test_dropped_job_noticed(void) {
    kvmix_cache_desc d = scenario_desc(0);
    ref_executor ex = {(uint8_t *)test_alloc(d.arena_bytes), 1, 0};
    da_executor e = {&ex, ex.arena, ref_run, ref_fetch};
    char why[160];
    memset(ex.arena, 0, d.arena_bytes);
    CHECK(da_scenario(&d, 7, 400, &e, why, sizeof why, NULL) > 0);
    free(ex.arena);
}

/* A sequence forked from another that wrote past the fork point, left alone on the page when
   the other is freed, writes the row the other wrote before the take: its write runs last,
   whatever order a launch gives the jobs of a batch. */
static void test_write_after_release(void) {
    kvmix_cache_desc d = scenario_desc(0);
    kvmix_cache cache;
    size_t bytes = 0;
    void *memory;
    uint8_t *arena = (uint8_t *)test_alloc(d.arena_bytes);
    int32_t per = d.n_kv_heads * d.head_dim, parent, child, layer, first[2], n_jobs, n_batches, i;
    uint16_t *rows = (uint16_t *)test_alloc((size_t)28 * (size_t)per * 2);
    kvmix_quantize_job *jobs = (kvmix_quantize_job *)test_alloc(64 * sizeof *jobs);
    kvmix_cache_batch batches[64];
    kvmix_view_span spans[4];
    uint8_t dead[32];
    kvmix_view view;
    for (i = 0; i < 28 * per; i++) rows[i] = kvmix_fp32_to_fp16((float)(i % 251) / 64.0f);
    d.device_arena = 1;
    CHECK_RESULT(kvmix_cache_memory_bytes(&d, &bytes, NULL), KVMIX_SUCCESS);
    memory = test_alloc(bytes);
    CHECK_RESULT(kvmix_cache_init(&cache, &d, memory, bytes, arena, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &parent), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, parent, 13, NULL, NULL), KVMIX_SUCCESS);
    for (layer = 0; layer < 2; layer++) /* staged rows 0-12 and 13-25 */
        CHECK_RESULT(kvmix_cache_write_rows(&cache, parent, layer, 0, 13, 13 * layer),
                     KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_fork(&cache, parent, 12, &child), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_free(&cache, parent), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, child, 1, NULL, NULL), KVMIX_SUCCESS);
    for (layer = 0; layer < 2; layer++) /* staged rows 26 and 27 */
        CHECK_RESULT(kvmix_cache_write_rows(&cache, child, layer, 12, 1, 26 + layer),
                     KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_jobs_take(&cache, jobs, 64, batches, 64, &n_jobs, &n_batches),
                 KVMIX_SUCCESS);
    CHECK_RESULT(run_reversed(batches, n_batches, jobs, rows, rows, arena, NULL), KVMIX_SUCCESS);
    for (layer = 0; layer < 2; layer++) {
        CHECK_RESULT(kvmix_cache_view(&cache, &child, 1, layer, spans, 4, first, dead, 32, &view),
                     KVMIX_SUCCESS);
        CHECK_EQ_INT(view.n_spans, 1);
        CHECK_EQ_INT(spans[0].key_format, KVMIX_FORMAT_FP16);
        CHECK_EQ_INT(spans[0].n_tokens, 13);
        CHECK(memcmp(arena + spans[0].key_offset + (size_t)12 * (size_t)d.head_dim * 2,
                     rows + (size_t)(26 + layer) * (size_t)per, (size_t)d.head_dim * 2) == 0);
    }
    kvmix_cache_deinit(&cache);
    free(memory);
    free(arena);
    free(rows);
    free(jobs);
}

/* Host-row calls refuse a device arena; a full queue fails without changing the cache. */
static void test_device_arena_rules(void) {
    kvmix_cache_desc d = scenario_desc(0);
    kvmix_cache cache;
    size_t bytes = 0;
    void *memory;
    uint8_t *arena = (uint8_t *)test_alloc(d.arena_bytes);
    float rows[2 * 64] = {0};
    kvmix_quantize_job jobs[64];
    kvmix_cache_batch batches[64];
    int32_t seq, n_jobs, n_batches;
    d.device_arena = 1;
    d.max_jobs = 12;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_memory_bytes(&d, &bytes, NULL), KVMIX_SUCCESS);
    memory = test_alloc(bytes);
    CHECK_RESULT(kvmix_cache_init(&cache, &d, memory, bytes, arena, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_append(&cache, seq, rows, rows, d.default_precision),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_reserve(&cache, seq, 3, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_write(&cache, seq, 0, 0, 1, rows, rows), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write_rows(&cache, seq, 0, 0, 1, -1), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_write_rows(&cache, seq, 1, 1, 1, 0), KVMIX_ERR_INVALID_ARGUMENT);
    /* 2 kv heads x (keys, values) = 4 jobs a write of one page run: 12 fit, the 4th write not */
    CHECK_RESULT(kvmix_cache_write_rows(&cache, seq, 0, 0, 1, 0), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_write_rows(&cache, seq, 0, 1, 1, 1), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_write_rows(&cache, seq, 0, 2, 1, 2), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_write_rows(&cache, seq, 1, 0, 3, 0), KVMIX_ERR_OUT_OF_MEMORY);
    CHECK_EQ_INT(cache.written[(size_t)seq * 2 + 1], 0);
    CHECK_RESULT(kvmix_cache_read(&cache, seq, 0, 0, rows, rows, NULL), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_cache_jobs_take(&cache, jobs, 11, batches, 64, &n_jobs, &n_batches),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_RESULT(kvmix_cache_jobs_take(&cache, jobs, 64, batches, 64, &n_jobs, &n_batches),
                 KVMIX_SUCCESS);
    CHECK_EQ_INT(n_jobs, 12);
    CHECK_EQ_INT(n_batches, 2); /* keys and values: two sources */
    CHECK_RESULT(kvmix_cache_write_rows(&cache, seq, 1, 0, 3, 0), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    /* the executor checks every batch before it writes anything */
    CHECK_RESULT(kvmix_cache_jobs_take(&cache, jobs, 64, batches, 64, &n_jobs, &n_batches),
                 KVMIX_SUCCESS);
    test_poison(arena, d.arena_bytes, 7);
    CHECK_RESULT(kvmix_ref_cache_run(batches, n_batches, jobs, NULL, NULL, arena, NULL),
                 KVMIX_ERR_NULL_POINTER); /* the batches read key and value rows */
    batches[n_batches - 1].kind = 7;
    CHECK_RESULT(kvmix_ref_cache_run(batches, n_batches, jobs, (const uint16_t *)arena,
                                     (const uint16_t *)arena, arena, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(test_is_poisoned(arena, d.arena_bytes, 7));
    kvmix_cache_deinit(&cache);
    free(memory);
    free(arena);
}

/* kvmix_cache_seal_ready packs what the next reserve would, and adds no position. */
static void test_seal_ready(void) {
    kvmix_cache_desc d = scenario_desc(0);
    kvmix_cache cache;
    kvmix_cache_stats before, after;
    float *rows = (float *)test_alloc(48 * 2 * 64 * sizeof(float));
    int32_t seq, layer, i;
    for (i = 0; i < 48 * 2 * 64; i++) rows[i] = (float)(i % 97) / 50.0f - 1.0f;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seal_ready(&cache, seq + 1), KVMIX_ERR_INVALID_ARGUMENT);
    /* 48 positions, pages of 16, a window of 16: the first two pages may be sealed */
    CHECK_RESULT(kvmix_cache_reserve(&cache, seq, 48, NULL, NULL), KVMIX_SUCCESS);
    for (layer = 0; layer < d.n_layers; layer++)
        CHECK_RESULT(kvmix_cache_write(&cache, seq, layer, 0, 48, rows, rows), KVMIX_SUCCESS);
    kvmix_cache_stats_get(&cache, &before);
    CHECK_RESULT(kvmix_cache_seal_ready(&cache, seq), KVMIX_SUCCESS);
    kvmix_cache_stats_get(&cache, &after);
    CHECK_EQ_INT(before.n_buffer_pages, 3);
    CHECK_EQ_INT(after.n_buffer_pages, 1);
    CHECK(after.arena_used_bytes < before.arena_used_bytes);
    CHECK_EQ_INT(cache.seqs[seq].n_tokens, 48);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    free(rows);
}

void unit_device_arena(void) {
    test_seal_ready();
    test_device_arena_rules();
    test_write_after_release();
    test_dropped_job_noticed();
    test_scenarios();
}
