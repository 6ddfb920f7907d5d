/* device_arena_scenario.h: one random workload run on two caches of the same desc, one with a host
   arena and one with a device arena whose jobs an executor runs (the CPU reference in
   unit_device_arena.c, the GPU in test_cuda.cu). Creates, forks, reserves, writes layer by layer,
   finishes, evicts, truncates and frees sequences the same way on both, takes the device cache's jobs at
   random points, and checks after each take that every view of every live sequence describes the
   same bytes: same spans, formats, dead flags and block bytes (the device cache's blocks may sit
   elsewhere in its arena: it holds released bytes until the take). Compiles as C and C++. */
#ifndef KVMIX_TESTS_DEVICE_ARENA_SCENARIO_H
#define KVMIX_TESTS_DEVICE_ARENA_SCENARIO_H

#include "../kvmix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct da_executor {
    void *ctx;
    void *arena; /* the device cache's arena: device memory, or host memory for the reference */
    /* Runs one take's batches with the source rows staged since the last take (FP16,
       [n_rows][n_kv_heads][head_dim] each); *bad_jobs counts jobs that wrote nothing. */
    int (*run)(void *ctx, const kvmix_cache_batch *batches, int32_t n_batches,
               const kvmix_quantize_job *jobs, int32_t n_jobs, const uint16_t *key_rows,
               const uint16_t *value_rows, int64_t n_rows, int32_t *bad_jobs);
    /* Copies the arena into host memory of `bytes`. */
    int (*fetch)(void *ctx, uint8_t *host, size_t bytes);
} da_executor;

typedef struct da_state {
    kvmix_cache host, device;
    void *device_memory;
    const da_executor *ex;
    uint64_t rng;
    uint16_t *key_rows, *value_rows; /* staged since the last take */
    int64_t n_rows, max_rows;
    kvmix_quantize_job *jobs;
    kvmix_cache_batch *batches;
    uint8_t *device_copy;
    float *keys, *values; /* one write's rows as floats (FP16 values) */
    int64_t jobs_run, batches_run, takes;
    int64_t compacted;   /* bytes compaction freed, host cache */
    int64_t retiered;    /* pages re-tiered, host cache */
    kvmix_policy policy; /* kvmix_policy_retier_turn's, with table */
    kvmix_tag_precision table;
    kvmix_tag *tags; /* [max_tokens_per_seq] */
    int failures;
    char *why;
    size_t why_bytes;
} da_state;

static uint32_t da_rand(da_state *s, uint32_t n) {
    s->rng ^= s->rng << 13;
    s->rng ^= s->rng >> 7;
    s->rng ^= s->rng << 17;
    return (uint32_t)((s->rng >> 11) % (n ? n : 1));
}

static void da_fail(da_state *s, const char *what, long long a, long long b) {
    if (s->failures++ == 0 && s->why) snprintf(s->why, s->why_bytes, "%s (%lld, %lld)", what, a, b);
}

/* Takes the device cache's jobs and runs them. */
static int da_take(da_state *s) {
    int32_t n_jobs = 0, n_batches = 0, bad = 0;
    kvmix_result r = kvmix_cache_jobs_take(&s->device, s->jobs, s->device.desc.max_jobs, s->batches,
                                           s->device.desc.max_jobs, &n_jobs, &n_batches);
    if (r != KVMIX_SUCCESS) {
        da_fail(s, "kvmix_cache_jobs_take failed", r, 0);
        return 0;
    }
    if (n_jobs > 0 && !s->ex->run(s->ex->ctx, s->batches, n_batches, s->jobs, n_jobs, s->key_rows,
                                  s->value_rows, s->n_rows, &bad)) {
        da_fail(s, "the executor failed", n_jobs, n_batches);
        return 0;
    }
    if (bad != 0) da_fail(s, "jobs wrote nothing", bad, n_jobs);
    s->jobs_run += n_jobs;
    s->batches_run += n_batches;
    s->takes++;
    if (kvmix_cache_check(&s->device) != KVMIX_SUCCESS) da_fail(s, "check after take", 0, 0);
    return 1;
}

/* Runs a call on the device cache; a full job queue is taken and the call repeated. */
#define DA_DEVICE_CALL(s, call, out_r)                                                             \
    do {                                                                                           \
        (out_r) = (call);                                                                          \
        if ((out_r) == KVMIX_ERR_OUT_OF_MEMORY && (s)->device.n_jobs > 0 && da_take(s))            \
            (out_r) = (call);                                                                      \
    } while (0)

static void da_same(da_state *s, kvmix_result host_r, kvmix_result device_r, const char *what) {
    if (host_r != device_r) da_fail(s, what, host_r, device_r);
}

/* Rows of one layer of n tokens: random FP16 values, as floats for the host cache and staged as
   FP16 for the device cache. Returns the first staged row. */
static int64_t da_rows(da_state *s, int32_t n) {
    const kvmix_cache_desc *d = &s->host.desc;
    int64_t per = (int64_t)d->n_kv_heads * d->head_dim, i, first = s->n_rows;
    for (i = 0; i < n * per; i++) {
        float k = ((float)da_rand(s, 20001) - 10000.0f) / 4000.0f;
        float v = ((float)da_rand(s, 20001) - 10000.0f) / 7000.0f;
        if (i % d->head_dim == 3) k *= 8.0f; /* an outlier channel for the boosted keys */
        s->key_rows[first * per + i] = kvmix_fp32_to_fp16(k);
        s->value_rows[first * per + i] = kvmix_fp32_to_fp16(v);
        s->keys[i] = kvmix_fp16_to_fp32(s->key_rows[first * per + i]);
        s->values[i] = kvmix_fp16_to_fp32(s->value_rows[first * per + i]);
    }
    s->n_rows += n;
    return first;
}

static kvmix_cache_precision da_precision(da_state *s) {
    static const uint8_t keys[] = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT2_CHANNEL,
                                   KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT8, KVMIX_FORMAT_FP16};
    static const uint8_t values[] = {KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT8,
                                     KVMIX_FORMAT_FP16};
    kvmix_cache_precision p;
    p.key_format = keys[da_rand(s, sizeof keys)];
    p.value_format = values[da_rand(s, sizeof values)];
    return p;
}

/* Reserves n tokens on both caches and writes their rows layer by layer, in one or two calls
   per layer. */
static void da_extend(da_state *s, int32_t seq, int32_t n) {
    kvmix_cache_precision prec[32];
    kvmix_result rh, rd;
    int32_t i, layer, first = s->host.seqs[seq].n_tokens;
    if (s->n_rows + (int64_t)n * s->host.desc.n_layers > s->max_rows) {
        if (!da_take(s)) return;
        s->n_rows = 0; /* every staged row was read by the jobs just run */
    }
    for (i = 0; i < n; i++) prec[i] = da_precision(s);
    rh = kvmix_cache_reserve(&s->host, seq, n, prec, NULL);
    DA_DEVICE_CALL(s, kvmix_cache_reserve(&s->device, seq, n, prec, NULL), rd);
    da_same(s, rh, rd, "reserve");
    if (rh != KVMIX_SUCCESS) return;
    for (layer = 0; layer < s->host.desc.n_layers; layer++) {
        int32_t split = n > 1 ? (int32_t)da_rand(s, (uint32_t)n) : 0, part;
        for (part = 0; part < 2; part++) {
            int32_t from = part ? split : 0, count = part ? n - split : split;
            int64_t row;
            if (count == 0) continue;
            row = da_rows(s, count);
            rh = kvmix_cache_write(&s->host, seq, layer, first + from, count, s->keys, s->values);
            DA_DEVICE_CALL(
                s, kvmix_cache_write_rows(&s->device, seq, layer, first + from, count, row), rd);
            da_same(s, rh, rd, "write");
        }
    }
}

/* The block bytes a span holds for one kv head: FP16 rows in use, or the packed block. */
static size_t da_block_bytes(const kvmix_view *v, int format, int32_t rows, int is_value) {
    kvmix_layout l;
    size_t bytes = 0;
    memset(&l, 0, sizeof l);
    l.format = (kvmix_format)format;
    l.n_tokens = rows;
    l.head_dim = v->head_dim;
    l.group_size =
        format == KVMIX_FORMAT_INT8 || format == KVMIX_FORMAT_INT4 || format == KVMIX_FORMAT_INT2
            ? (is_value && v->value_group_size ? v->value_group_size : v->group_size)
            : 0;
    l.n_boost = format == KVMIX_FORMAT_BOOSTED ? v->n_boost : 0;
    kvmix_layout_bytes(&l, &bytes);
    return bytes;
}

/* One block, host against device: where they first differ, if they do. */
static void da_compare_block(da_state *s, const char *side, const uint8_t *host,
                             const uint8_t *device, size_t bytes, int format, int32_t n_tokens) {
    size_t i = 0;
    while (i < bytes && host[i] == device[i]) i++;
    if (i < bytes && s->failures++ == 0 && s->why)
        snprintf(s->why, s->why_bytes,
                 "%s block bytes differ: format %d, %d tokens, byte %zu of %zu: %02x vs %02x", side,
                 format, (int)n_tokens, i, bytes, host[i], device[i]);
}

/* Every view of every live sequence, host against device. */
static void da_compare(da_state *s) {
    const kvmix_cache_desc *d = &s->host.desc;
    int32_t seq, layer, n_spans, n_dead;
    size_t arena_bytes = d->arena_bytes / d->granule_bytes * d->granule_bytes;
    if (!da_take(s) || !s->ex->fetch(s->ex->ctx, s->device_copy, arena_bytes)) {
        da_fail(s, "fetching the arena failed", 0, 0);
        return;
    }
    for (seq = 0; seq < d->max_seqs; seq++) {
        kvmix_view_span *hs, *ds, *first_layer;
        uint8_t *hdead, *ddead;
        int32_t hfirst[2], dfirst[2], i, h;
        if (!s->host.seqs[seq].in_use) continue;
        if (kvmix_cache_view_counts(&s->host, &seq, 1, &n_spans, &n_dead) != KVMIX_SUCCESS) {
            da_fail(s, "view counts", seq, 0);
            return;
        }
        hs = (kvmix_view_span *)calloc((size_t)n_spans + 1, sizeof *hs);
        first_layer = (kvmix_view_span *)calloc((size_t)n_spans + 1, sizeof *hs);
        ds = (kvmix_view_span *)calloc((size_t)n_spans + 1, sizeof *ds);
        hdead = (uint8_t *)calloc((size_t)n_dead + 1, 1);
        ddead = (uint8_t *)calloc((size_t)n_dead + 1, 1);
        for (layer = 0; hs && ds && first_layer && hdead && ddead && layer < d->n_layers; layer++) {
            kvmix_view hv, dv;
            if (kvmix_cache_view(&s->host, &seq, 1, layer, hs, n_spans, hfirst, hdead, n_dead,
                                 &hv) != KVMIX_SUCCESS ||
                kvmix_cache_view(&s->device, &seq, 1, layer, ds, n_spans, dfirst, ddead, n_dead,
                                 &dv) != KVMIX_SUCCESS) {
                da_fail(s, "view", seq, layer);
                break;
            }
            if (hv.n_spans != dv.n_spans || hv.n_dead_flags != dv.n_dead_flags ||
                memcmp(hdead, ddead, (size_t)hv.n_dead_flags) != 0) {
                da_fail(s, "view shape or dead flags differ", seq, layer);
                break;
            }
            if (layer == 0) memcpy(first_layer, hs, (size_t)hv.n_spans * sizeof *hs);
            for (i = 0; i < hv.n_spans; i++) {
                const kvmix_view_span *a = &hs[i], *b = &ds[i];
                uint64_t shift = (uint64_t)layer * (uint64_t)d->n_kv_heads *
                                 ((uint64_t)a->key_head_bytes + a->value_head_bytes);
                if (first_layer[i].key_offset + shift != a->key_offset ||
                    first_layer[i].value_offset + shift != a->value_offset ||
                    first_layer[i].n_tokens != a->n_tokens)
                    da_fail(s, "a layer's spans are not layer 0's moved", seq, layer);
                if (a->n_tokens != b->n_tokens || a->key_format != b->key_format ||
                    a->value_format != b->value_format || a->dead_index != b->dead_index) {
                    da_fail(s, "span differs", seq, i);
                    break;
                }
                for (h = 0; h < d->n_kv_heads; h++) {
                    size_t kb = da_block_bytes(&hv, a->key_format, a->n_tokens, 0);
                    size_t vb = da_block_bytes(&hv, a->value_format, a->n_tokens, 1);
                    const uint8_t *hk =
                        s->host.arena + a->key_offset + (size_t)h * a->key_head_bytes;
                    const uint8_t *dk =
                        s->device_copy + b->key_offset + (size_t)h * b->key_head_bytes;
                    const uint8_t *hval =
                        s->host.arena + a->value_offset + (size_t)h * a->value_head_bytes;
                    const uint8_t *dval =
                        s->device_copy + b->value_offset + (size_t)h * b->value_head_bytes;
                    da_compare_block(s, "key", hk, dk, kb, a->key_format, a->n_tokens);
                    da_compare_block(s, "value", hval, dval, vb, a->value_format, a->n_tokens);
                }
            }
        }
        free(hs);
        free(first_layer);
        free(ds);
        free(hdead);
        free(ddead);
    }
}

/* Compaction of a sequence on both caches: the device cache holds released bytes, descriptors
   and queued jobs until a take, so it takes its jobs before each call and calls again until it
   frees nothing more; in all, both free the same bytes. */
static void da_compact(da_state *s, int32_t seq) {
    static const double fractions[] = {0.25, 0.5, 1.0};
    double fraction = fractions[da_rand(s, 3)];
    size_t host_freed = 0, device_freed = 0, freed = 0;
    int i;
    kvmix_result rh = kvmix_cache_compact(&s->host, seq, fraction, &host_freed), rd;
    for (i = 0; i < 8; i++) {
        if (s->device.n_jobs > 0 && !da_take(s)) break; /* what it holds comes back */
        rd = kvmix_cache_compact(&s->device, seq, fraction, &freed);
        da_same(s, rh, rd, "compact");
        device_freed += freed;
        if (freed == 0) break;
    }
    if (host_freed != device_freed)
        da_fail(s, "compacted bytes", (long long)host_freed, (long long)device_freed);
    s->compacted += (int64_t)host_freed;
}

/* Re-tiers on both caches, from what they hold (the form a device arena takes): the page of a
   random written position of seq into a random precision, or every page of seq as random tags
   at a random turn ask (kvmix_policy_retier_turn). */
static void da_retier(da_state *s, int32_t seq) {
    int32_t n = s->host.seqs[seq].n_tokens, pages = 0, pos, b, r;
    kvmix_cache_precision p = da_precision(s);
    kvmix_result rh, rd;
    if (s->host.seqs[seq].n_written == 0) return;
    if (da_rand(s, 2) == 0) {
        pos = (int32_t)da_rand(s, (uint32_t)s->host.seqs[seq].n_written);
        rh = kvmix_cache_retier(&s->host, seq, pos, p, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL);
        DA_DEVICE_CALL(
            s, kvmix_cache_retier(&s->device, seq, pos, p, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL),
            rd);
        da_same(s, rh, rd, "retier");
        s->retiered += rh == KVMIX_SUCCESS;
        return;
    }
    for (b = 0; b < KVMIX_TAG_N_BUCKETS; b++)
        for (r = 0; r < KVMIX_TAG_N_ROLES; r++)
            s->table.formats[b][r][KVMIX_MODALITY_TEXT] = da_precision(s);
    for (pos = 0; pos < n; pos++) {
        memset(&s->tags[pos], 0, sizeof s->tags[pos]);
        s->tags[pos].turn = (int32_t)da_rand(s, 6);
        s->tags[pos].role = (uint8_t)da_rand(s, KVMIX_TAG_N_ROLES);
    }
    s->policy.tag_precision = &s->table;
    b = (int32_t)da_rand(s, 8);
    rh = kvmix_policy_retier_turn(&s->policy, &s->host, seq, s->tags, n, b, &pages);
    DA_DEVICE_CALL(s, kvmix_policy_retier_turn(&s->policy, &s->device, seq, s->tags, n, b, NULL),
                   rd);
    da_same(s, rh, rd, "policy retier");
    s->retiered += pages;
}

/* One random operation on both caches. */
static void da_step(da_state *s) {
    const kvmix_cache_desc *d = &s->host.desc;
    int32_t seq = (int32_t)da_rand(s, (uint32_t)d->max_seqs), child_h = -1, child_d = -1,
            op = (int32_t)da_rand(s, 100);
    kvmix_result rh, rd;
    if (!s->host.seqs[seq].in_use) {
        rh = kvmix_cache_seq_create(&s->host, &child_h);
        rd = kvmix_cache_seq_create(&s->device, &child_d);
        da_same(s, rh, rd, "create");
        if (rh == KVMIX_SUCCESS && child_h != child_d) da_fail(s, "created ids", child_h, child_d);
        return;
    }
    if (op < 55) {
        int32_t room = d->max_tokens_per_seq - s->host.seqs[seq].n_tokens;
        if (da_rand(s, 4) == 0) { /* a new run closes the page being filled */
            uint32_t run = da_rand(s, 3);
            da_same(s, kvmix_cache_seq_set_run(&s->host, seq, run),
                    kvmix_cache_seq_set_run(&s->device, seq, run), "set run");
        }
        int32_t n = 1 + (int32_t)da_rand(s, op < 40 ? 3 : 24);
        if (n > room) n = room;
        if (n > 0) da_extend(s, seq, n);
    } else if (op < 65) {
        rh = kvmix_cache_seq_finish(&s->host, seq);
        DA_DEVICE_CALL(s, kvmix_cache_seq_finish(&s->device, seq), rd);
        da_same(s, rh, rd, "finish");
    } else if (op < 75) {
        int32_t n = s->host.seqs[seq].n_written,
                prefix = n ? (int32_t)da_rand(s, (uint32_t)n + 1) : 0;
        rh = kvmix_cache_seq_fork(&s->host, seq, prefix, &child_h);
        rd = kvmix_cache_seq_fork(&s->device, seq, prefix, &child_d);
        da_same(s, rh, rd, "fork");
    } else if (op < 80) { /* a rewind: the rows it cuts may still have queued writes */
        int32_t n = (int32_t)da_rand(s, (uint32_t)s->host.seqs[seq].n_tokens + 1);
        rh = kvmix_cache_seq_truncate(&s->host, seq, n);
        rd = kvmix_cache_seq_truncate(&s->device, seq, n);
        da_same(s, rh, rd, "truncate");
    } else if (op < 85) {
        int32_t positions[8], n = s->host.seqs[seq].n_written, i;
        for (i = 0; i < 8 && n > 0; i++) positions[i] = (int32_t)da_rand(s, (uint32_t)n);
        rh = kvmix_cache_evict(&s->host, seq, positions, n > 0 ? 8 : 0);
        rd = kvmix_cache_evict(&s->device, seq, positions, n > 0 ? 8 : 0);
        da_same(s, rh, rd, "evict");
        if (da_rand(s, 2) == 0) da_compact(s, seq);
    } else if (op < 88) {
        da_retier(s, seq);
    } else if (op < 90) {
        rh = kvmix_cache_seq_free(&s->host, seq);
        rd = kvmix_cache_seq_free(&s->device, seq);
        da_same(s, rh, rd, "free");
    } else if (op < 95) {
        da_take(s);
    } else {
        da_compare(s);
    }
    if (kvmix_cache_check(&s->device) != KVMIX_SUCCESS) da_fail(s, "device cache check", op, 0);
}

/* What a scenario did, to show that its operations ran. */
typedef struct da_counts {
    int64_t jobs;      /* jobs run in all */
    int64_t compacted; /* bytes compaction freed */
    int64_t retiered;  /* pages re-tiered */
} da_counts;

/* Runs `steps` random operations on caches of `desc` (device_arena set here); returns the number
   of mismatches, the first described in why, and what ran in *out (may be NULL). */
static int da_scenario(const kvmix_cache_desc *desc, uint64_t seed, int steps,
                       const da_executor *ex, char *why, size_t why_bytes, da_counts *out) {
    da_state s;
    kvmix_cache_desc hd = *desc, dd = *desc;
    size_t memory_bytes = 0, per;
    int i;
    memset(&s, 0, sizeof s);
    s.ex = ex;
    s.rng = seed * 2654435761u + 1;
    s.why = why;
    s.why_bytes = why_bytes;
    if (why_bytes) why[0] = 0;
    dd.device_arena = 1;
    if (kvmix_cache_init_allocator(&s.host, &hd, NULL, NULL) != KVMIX_SUCCESS ||
        kvmix_cache_memory_bytes(&dd, &memory_bytes, NULL) != KVMIX_SUCCESS) {
        da_fail(&s, "cache init", 0, 0);
        return s.failures;
    }
    s.device_memory = malloc(memory_bytes);
    if (!s.device_memory || kvmix_cache_init(&s.device, &dd, s.device_memory, memory_bytes,
                                             ex->arena, NULL) != KVMIX_SUCCESS) {
        da_fail(&s, "device cache init", 0, 0);
        kvmix_cache_deinit(&s.host);
        free(s.device_memory);
        return s.failures;
    }
    per = (size_t)hd.n_kv_heads * (size_t)hd.head_dim;
    s.max_rows = 4 * (int64_t)hd.n_layers * 32;
    s.key_rows = (uint16_t *)malloc((size_t)s.max_rows * per * 2);
    s.value_rows = (uint16_t *)malloc((size_t)s.max_rows * per * 2);
    s.keys = (float *)malloc(32 * per * sizeof(float));
    s.values = (float *)malloc(32 * per * sizeof(float));
    s.jobs = (kvmix_quantize_job *)malloc((size_t)dd.max_jobs * sizeof *s.jobs);
    s.batches = (kvmix_cache_batch *)malloc((size_t)dd.max_jobs * sizeof *s.batches);
    s.device_copy = (uint8_t *)malloc(hd.arena_bytes);
    s.tags = (kvmix_tag *)malloc((size_t)hd.max_tokens_per_seq * sizeof *s.tags);
    s.policy = *kvmix_policy_find("int4");
    if (s.key_rows && s.value_rows && s.keys && s.values && s.jobs && s.batches && s.device_copy &&
        s.tags) {
        for (i = 0; i < steps && s.failures == 0; i++) da_step(&s);
        if (s.failures == 0) da_compare(&s);
    } else {
        da_fail(&s, "out of memory", 0, 0);
    }
    if (out) {
        out->jobs = s.jobs_run;
        out->compacted = s.compacted;
        out->retiered = s.retiered;
    }
    free(s.key_rows);
    free(s.value_rows);
    free(s.keys);
    free(s.values);
    free(s.jobs);
    free(s.batches);
    free(s.device_copy);
    free(s.tags);
    kvmix_cache_deinit(&s.host);
    free(s.device_memory);
    return s.failures;
}

#endif /* KVMIX_TESTS_DEVICE_ARENA_SCENARIO_H */
