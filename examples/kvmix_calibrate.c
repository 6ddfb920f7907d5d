/* kvmix-calibrate: from runner captures to a calibration table and a bit allocation per tag.
 *
 *   kvmix-calibrate --captures DIR [--spec FILE] [--budget B] [--table OUT.json]
 *                   [--allocation OUT.json] [--method knapsack|two-level] [--low P] [--high P]
 *                   [--stride N] [--page-tokens N] [--key-group N] [--value-group N]
 *                   [--boost N] [--steps N] [--sinks N] [--window N] [--threads N]
 *                   [--ablate none|temporal|role|blind] [--stored-from ALLOCATION.json]
 *                   [--price runs|pages] [--instruction once|each]
 *   kvmix-calibrate --from-table TABLE.json [--budget B] [--table OUT.json] [--allocation ...]
 *
 * Input: DIR/capture-*.bin, the files `kvmix-eval --capture DIR` writes (one per text, llama.h
 * "Captures"; run it with --policy fp32 so that keys and values are full precision), all of one
 * model shape, read in name order. --spec is the template spec (default
 * examples/specs/kvm-byte.json, the reference models' ChatML).
 *
 * Tags. The streaming tagger (kvmix.h, >>tags) runs over each capture's token ids. For a query at
 * position i, token j <= i has the tag (kvmix_tag_bucket_of(turn_j, turn_i), role_j,
 * modality_j): the bucket ages with the query. A capture's token counts are those of its last
 * position (what a cache holds at the end of the request), so they partition its tokens. Active
 * tags are those with tokens in some capture; a tag is active in a capture when it has tokens
 * there. Token count of a tag: instruction tags (system prompt and tool schemas, stored once as a
 * shared prefix) count once, as the median over the captures where they are active (for an even
 * number, the mean of the two middle counts, rounded to nearest); every other tag sums over the
 * captures. The system prompt's bucket depends on the request's turn count, so it may appear as
 * several instruction tags (previous, two_back, older), each counted once. --instruction each
 * sums them over the captures too, for caches that store each request's system prompt apart
 * (kvmix-eval does: one sequence per text).
 *
 * Precisions (name: keys + values; bits = (key bits + value bits) / 2 per element, every byte of
 * metadata included, from kvmix_layout_bits at a full page of --page-tokens):
 *   int2c    INT2_CHANNEL keys + INT2 values
 *   boosted  BOOSTED keys (--boost channels at 4 bits, default head_dim/8) + INT2 values
 *   int4     INT4 keys + INT4 values
 *   int8     INT8 keys + INT8 values
 *   fp16     FP16 keys + FP16 values
 * Key groups of INT4/INT8 are --key-group channels (default 32); value groups of every per-token
 * value format are --value-group (default head_dim: one group per head). Per-channel key formats
 * quantize blocks of --page-tokens consecutive positions (default 128) as the cache's pages would
 * (the last block holds what is left); per-token formats quantize row by row; FP16 rounds.
 * Quantization uses the real formats: kvmix_ref_quantize then kvmix_ref_dequantize.
 *
 * Distortion D[tag][precision]. Queries: positions 0, N, 2N, ... (--stride N, default 8) and the
 * capture's last position, every layer and every query head. For each query, the attention output
 * with full-precision keys and values (softmax at scale 1/sqrt(head_dim) over positions 0..i) is
 * compared with the output where only the tag's tokens are replaced by their
 * quantized-dequantized keys and values: the squared error averaged over head_dim (MSE). One pass
 * gives every tag at once: the full softmax's weights and weighted values are summed per tag, then,
 * per precision, the same sums over the quantized rows; a tag's output swaps its own sums (all in
 * double). A tag without tokens at a query contributes 0 to that query's mean. Aggregation: for
 * each (tag, precision, layer), the max over query heads of the mean MSE over the capture's
 * queries; then the mean over the captures where the tag is active; then the sum over layers.
 * --sinks S and --window W (a policy's FP16 sinks and window; default 0, none) keep the first S
 * positions and, for a query at i, the positions after i - W at full precision whatever their
 * tag, as the cache holds them (its window is at least W: a page seals once its last row has left
 * it); the table's geometry records them. Caveats: a cache keeps the page being filled in FP16,
 * and a tag's tokens share pages with other tags' tokens here; both only change the per-channel
 * formats' statistics; a tag's token count includes its sink and window tokens.
 *
 * Prices. A cache puts each run of tokens (consecutive tokens of one turn and tag's formats,
 * kvmix_policy_token_run) on pages of its own: a run fills pages from its first position and its
 * last page is closed at its rows, rounded up to 8, with per-channel statistics over those rows
 * alone (kvmix_cache_page_bits). So a tag whose runs are short costs more per token than a full
 * page says. Calibration counts, per tag, the pages its runs would seal by the capture's end
 * (past --sinks, out of --window; a run of one turn, role and modality) as "pages" in the
 * table. --price runs (the default when the table has them) prices a tag's token at a precision
 * as the mean over those pages of what a cache of the table's geometry and model shape holds for
 * them; --price pages (the default for a table without them) at a full page's bits, as before.
 * The allocator takes the prices per tag (kvmix_alloc_problem.tag_bits), so a budget is what
 * sealed pages will hold.
 *
 * Allocation (kvmix.h, "Bit allocation"): budget B (--budget, default 3.0) in effective bits per
 * element over the active tags' token counts, each at its price. --method knapsack (default) is
 * kvmix_alloc_knapsack over all five precisions on a grid of --steps cells (default 4096);
 * --method two-level is kvmix_alloc_two_level between --low and --high (default int2c and int4;
 * exhaustive for up to 22 active tags, else greedy). Both are reported; --method picks the one
 * written to --allocation. The sweep B = 2.00, 2.25, ..., 5.00 prints both allocators' predicted
 * distortion and realized bits ("-": the budget cannot hold every tag at the cheapest choice).
 *
 * Table JSON (--table), version 1 (one line per tag, per precision and per capture):
 *   {"version": 1, "kind": "kvmix-calibration-table",
 *    "model": {"n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64},
 *    "spec": "examples/specs/kvm-byte.json",
 *    "geometry": {"page_tokens": 128, "key_group": 32, "value_group": 64, "n_boost": 8,
 *                 "query_stride": 8},  (+ "sink_tokens", "window_tokens" when set)
 *    "distortion": "attention-output MSE: max over heads, mean over captures, sum over layers",
 *    "precisions": [
 *     {"name": "int2c", "key_format": "int2_channel", "value_format": "int2", "key_bits": 2.25,
 *      "value_bits": 2.5, "bits": 2.375}, ...],
 *    "captures": [{"file": "capture-0000.bin", "n_tokens": 2048}, ...],
 *    "tags": [
 *     {"name": "current/user/text", "bucket": "current", "role": "user", "modality": "text",
 *      "tokens": 812, "n_captures": 2, "tokens_per_capture": [400, 412],
 *      "distortion": [1.2e-3, 9e-4, 2e-4, 1e-6, 1e-10], "pages": [[5, 12], [32, 20]]}, ...]}
 *   distortion: one entry per precision, in the order of "precisions". pages: [rows, count]
 *   pairs, rows increasing (on every tag or none; tables without them read as before).
 * --from-table reads such a table back (strictly: the five precisions in this order, every field)
 * instead of the captures; writing it again with --table gives the same bytes.
 *
 * Allocation JSON (--allocation), version 1:
 *   {"version": 1, "kind": "kvmix-allocation", "budget_bits": 3, "method": "knapsack",
 *    "pricing": "runs", "instruction": "once", "optimal": true, "distortion": 1.1e-3,
 *    "bits": 2.98,
 *    "tags": [{"name": "current/user/text", "bucket": "current", "role": "user",
 *              "modality": "text", "tokens": 812, "precision": "int4", "key_format": "int4",
 *              "value_format": "int4", "key_group": 32, "value_group": 64, "n_boost": 0,
 *              "page_tokens": 128, "distortion": 2e-4, "bits": 4.5}, ...],
 *    "sweep": [{"budget_bits": 2, "two_level": null, "knapsack": null},
 *              {"budget_bits": 2.5, "two_level": {"distortion": ..., "bits": ...},
 *               "knapsack": {"distortion": ..., "bits": ...}}, ...]}
 *   method: "knapsack", or "exhaustive" / "greedy" (two-level; "low" and "high" name its pair).
 *   A tag's "bits" is its price at the chosen precision; "bits" above, their mean by tokens.
 *
 * Demoted tokens (--stored-from A.json, an allocation of these five precisions, usually this
 * tool's at the same geometry): a cache stores a token first in the formats of its tag's current
 * bucket and re-quantizes it, from its rows rounded to FP16, each time its bucket ages into a
 * lower precision (kvmix_policy_retier_turn; never into a higher one). With --stored-from, a
 * token of an aged bucket (previous, two_back, older) at candidate precision p is measured as
 * that chain under A's choices for its role and modality, ending in p when p is lower than what
 * it holds by then (else as it holds it); current-bucket tokens as before. The table's geometry
 * records the file ("stored_from"). Iterate: calibrate, allocate, calibrate --stored-from it.
 *
 * Ablations (--ablate, the allocation and the sweep alike; the allocation JSON names it):
 * "temporal" gives every bucket of a role and modality one precision (their tokens and
 * distortions summed into one knapsack item), "role" every role of a bucket and modality; "blind"
 * keeps the full allocation's tokens at each precision and deals the precisions to the tags in a
 * fixed pseudo-random order, each tag the highest precision with room for half of it (whole tags,
 * so the mix is matched to within a tag).
 *
 * Output: a tag summary and the sweep on stdout. Exit status 0; 1 on bad input (unreadable or
 * malformed captures, spec or table, no capture in DIR, captures of different shapes, an
 * infeasible budget); 2 on bad options. --threads N (default 2) processes captures in parallel;
 * the result does not depend on N.
 */
#define _POSIX_C_SOURCE 200809L /* opendir, pthread */
#include "kvmix.h"
#include "llama.h"
#include "tag_allocation.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N_PREC = 5, N_BUCKETS = 4, N_TAGS = N_BUCKETS * KVMIX_TAG_N_ROLES * 2, ERR_BYTES = 512 };
enum { TABLE_VERSION = 1, ALLOCATION_VERSION = 1 };
enum { MAX_PAGE_TOKENS = 1024 }; /* a cache's largest page (kvmix_cache_desc.page_tokens) */

/* The candidate precisions, cheapest first. */
static const struct {
    const char *name;
    kvmix_format key, value;
} PRECISIONS[N_PREC] = {{"int2c", KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2},
                        {"boosted", KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2},
                        {"int4", KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4},
                        {"int8", KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8},
                        {"fp16", KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16}};

typedef struct geometry {
    int32_t page_tokens, key_group, value_group, n_boost, query_stride; /* 0: default */
    int32_t sink_tokens, window_tokens; /* kept full precision, as a cache's FP16; 0: none */
} geometry;

typedef struct precision {
    kvmix_layout key, value; /* resolved, n_tokens = page_tokens */
    double key_bits, value_bits, bits;
} precision;

/* Ablations: the allocation without one axis of the tags, or blind to them. */
typedef enum ablation {
    ABLATE_NONE = 0,
    ABLATE_TEMPORAL = 1, /* one precision per role and modality, whatever the bucket */
    ABLATE_ROLE = 2,     /* one precision per bucket and modality, whatever the role */
    ABLATE_BLIND = 3     /* the full allocation's mix of precisions, dealt to tags at random */
} ablation;
static const char *const ABLATION_NAMES[] = {"none", "temporal", "role", "blind"};

/* What a tag's token costs the allocation (--price). */
typedef enum pricing {
    PRICE_DEFAULT = 0, /* runs when the table counts pages, else pages */
    PRICE_PAGES = 1,   /* a full page's bits, whatever the runs */
    PRICE_RUNS = 2     /* the pages the tag's runs fill, closed ones at their own cost */
} pricing;
static const char *const PRICING_NAMES[] = {"default", "pages", "runs"};

typedef struct options {
    const char *captures_dir, *spec_path, *from_table, *table_out, *allocation_out, *stored_from;
    double budget;
    bool two_level;        /* --method two-level */
    bool instruction_each; /* --instruction each: instruction tags summed like the others */
    pricing price;
    int32_t low, high, steps, n_threads;
    ablation ablate;
    geometry geo;
} options;

/* One tag of the table (bucket, role, modality) and what calibration measured for it. */
typedef struct table_tag {
    int32_t bucket, role, modality;
    int64_t tokens;
    int32_t n_captures;
    int64_t *per_capture; /* [table.n_captures] */
    int64_t *pages;       /* [geo.page_tokens + 1]: its sealed pages by rows (count_pages) */
    double distortion[N_PREC];
    double price[N_PREC]; /* bits per element of one of its tokens at each precision (--price) */
} table_tag;

typedef struct table {
    int32_t n_layers, n_heads, n_kv_heads, head_dim;
    char *spec;
    char *stored_from; /* --stored-from's allocation, or NULL */
    geometry geo;      /* resolved */
    precision prec[N_PREC];
    int32_t n_captures;
    char **files;      /* [n_captures] base names */
    int64_t *n_tokens; /* [n_captures] */
    int32_t n_tags;
    table_tag tags[N_TAGS];
    bool has_pages; /* the tags' page counts were measured (tables of older tools lack them) */
    pricing price;  /* what price_tags filled the prices with */
} table;

static int tag_index(int32_t bucket, int32_t role, int32_t modality) {
    return (bucket * KVMIX_TAG_N_ROLES + role) * 2 + modality;
}

static void tag_name(const table_tag *t, char *out, size_t out_bytes) {
    snprintf(out, out_bytes, "%s/%s/%s", kvmix_tag_bucket_name((kvmix_tag_bucket)t->bucket),
             kvmix_tag_role_name((kvmix_tag_role)t->role),
             kvmix_tag_modality_name((kvmix_tag_modality)t->modality));
}

static void table_free(table *t) {
    for (int32_t i = 0; i < t->n_tags; i++) free(t->tags[i].pages);
    free(t->spec);
    free(t->stored_from);
    for (int32_t i = 0; i < t->n_captures; i++) free(t->files[i]);
    free(t->files);
    free(t->n_tokens);
    for (int32_t i = 0; i < t->n_tags; i++) free(t->tags[i].per_capture);
    memset(t, 0, sizeof *t);
}

static char *dup_string(const char *s) {
    size_t n = strlen(s) + 1;
    char *copy = malloc(n);
    if (copy != NULL) memcpy(copy, s, n);
    return copy;
}

/* ---- precisions at the calibration geometry ------------------------------------------------ */

/* Resolves geo's defaults for head_dim and the five precisions' layouts and bits. */
static bool precisions_resolve(geometry *geo, int32_t head_dim, precision *prec, char *err) {
    if (geo->page_tokens == 0) geo->page_tokens = 128;
    if (geo->key_group == 0) geo->key_group = 32;
    if (geo->value_group == 0) geo->value_group = head_dim;
    if (geo->n_boost == 0) geo->n_boost = head_dim / 8;
    if (geo->query_stride == 0) geo->query_stride = 8;
    for (int p = 0; p < N_PREC; p++) {
        kvmix_layout k = {PRECISIONS[p].key, geo->page_tokens, head_dim, 0, 0};
        kvmix_layout v = {PRECISIONS[p].value, geo->page_tokens, head_dim, 0, 0};
        if (k.format == KVMIX_FORMAT_INT4 || k.format == KVMIX_FORMAT_INT8)
            k.group_size = geo->key_group;
        if (k.format == KVMIX_FORMAT_BOOSTED) k.n_boost = geo->n_boost;
        if (v.format != KVMIX_FORMAT_FP16) v.group_size = geo->value_group;
        kvmix_result r = kvmix_layout_resolve(&k, NULL);
        if (r == KVMIX_SUCCESS) r = kvmix_layout_resolve(&v, NULL);
        if (r == KVMIX_SUCCESS) r = kvmix_layout_bits(&k, &prec[p].key_bits);
        if (r == KVMIX_SUCCESS) r = kvmix_layout_bits(&v, &prec[p].value_bits);
        if (r != KVMIX_SUCCESS) {
            snprintf(err, ERR_BYTES,
                     "precision %s at head_dim %d (page %d, key group %d, value group %d, boost "
                     "%d): %s",
                     PRECISIONS[p].name, head_dim, geo->page_tokens, geo->key_group,
                     geo->value_group, geo->n_boost, kvmix_result_string(r));
            return false;
        }
        prec[p].key = k;
        prec[p].value = v;
        prec[p].bits = (prec[p].key_bits + prec[p].value_bits) / 2;
    }
    return true;
}

/* Quantizes and dequantizes n rows (src, row stride `stride` floats) in blocks of `block` rows
 * into dst [n][head_dim]; scratch holds one packed block. */
static kvmix_result round_trip(const kvmix_layout *base, const float *src, int32_t stride,
                               int32_t n, int32_t block, float *dst, uint8_t *scratch,
                               size_t scratch_bytes) {
    for (int32_t b = 0; b < n; b += block) {
        kvmix_layout l = *base;
        l.n_tokens = n - b < block ? n - b : block;
        size_t bytes = 0;
        kvmix_result r = kvmix_layout_bytes(&l, &bytes);
        if (r == KVMIX_SUCCESS && bytes > scratch_bytes) r = KVMIX_ERR_BUFFER_TOO_SMALL;
        if (r == KVMIX_SUCCESS)
            r = kvmix_ref_quantize(&l, src + (size_t)b * (size_t)stride, stride, scratch, bytes);
        if (r == KVMIX_SUCCESS)
            r = kvmix_ref_dequantize(&l, scratch, bytes, dst + (size_t)b * (size_t)l.head_dim,
                                     l.head_dim);
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

/* ---- one capture ----------------------------------------------------------------------------- */

typedef struct capture_job {
    const char *path;
    const kvmix_tag_spec *spec;
    geometry geo;                       /* as given; resolved for the capture's head_dim */
    const struct stored_source *stored; /* --stored-from, or NULL */
    /* results */
    int32_t n_layers, n_heads, n_kv_heads, head_dim, n_tokens;
    int64_t count[N_TAGS]; /* tokens per tag at the last position */
    int64_t *pages;        /* [N_TAGS][page_tokens + 1]: sealed pages by rows (count_pages) */
    double *dist;          /* [N_TAGS][N_PREC][n_layers]: max over heads of the mean MSE */
    bool ok;
    char err[ERR_BYTES];
} capture_job;

/* Per-thread buffers for one (layer, kv head) of a capture of n tokens. */
typedef struct work {
    float *kq, *vq;   /* [N_PREC][n][D] quantized-dequantized rows */
    float *kf, *vf;   /* [n][D] full-precision rows */
    double *w;        /* [n] full softmax weights (unnormalized) */
    int32_t *tag_of;  /* [n] tag of each token for the current query */
    double *num_full; /* [N_TAGS][D] sum of w v per tag */
    double *num_q;    /* [N_TAGS][D] sum of w' v' per tag */
    int8_t *bucket;   /* [n] bucket of each token for the current query */
    /* --stored-from: the aged buckets' rows (aged_rows) and its buffers, else NULL */
    float *kqb, *vqb;                               /* [3][N_PREC][n][D] */
    float *chain_k, *chain_v, *out_k, *out_v, *tmp; /* [n][D] */
    int32_t sinks, window; /* --sinks, --window: positions a query sees at full precision */
    double z_full[N_TAGS], z_q[N_TAGS], acc[N_TAGS][N_PREC];
    uint8_t *scratch;
    size_t scratch_bytes;
} work;

static void work_free(work *w) {
    free(w->kq);
    free(w->vq);
    free(w->kf);
    free(w->vf);
    free(w->w);
    free(w->tag_of);
    free(w->num_full);
    free(w->num_q);
    free(w->bucket);
    free(w->kqb);
    free(w->vqb);
    free(w->chain_k);
    free(w->chain_v);
    free(w->out_k);
    free(w->out_v);
    free(w->tmp);
    free(w->scratch);
}

static bool work_alloc(work *w, int32_t n, int32_t d, const precision *prec, bool aged) {
    size_t nd = (size_t)n * (size_t)d;
    memset(w, 0, sizeof *w);
    for (int p = 0; p < N_PREC; p++) { /* the largest block: n rows or a page */
        kvmix_layout k = prec[p].key, v = prec[p].value;
        size_t kb = 0, vb = 0;
        if (n > k.n_tokens) k.n_tokens = v.n_tokens = n;
        kvmix_layout_bytes(&k, &kb);
        kvmix_layout_bytes(&v, &vb);
        if (kb > w->scratch_bytes) w->scratch_bytes = kb;
        if (vb > w->scratch_bytes) w->scratch_bytes = vb;
    }
    w->kq = malloc(N_PREC * nd * sizeof(float));
    w->vq = malloc(N_PREC * nd * sizeof(float));
    w->kf = malloc(nd * sizeof(float));
    w->vf = malloc(nd * sizeof(float));
    w->w = malloc((size_t)n * sizeof(double));
    w->tag_of = malloc((size_t)n * sizeof(int32_t));
    w->num_full = malloc((size_t)N_TAGS * (size_t)d * sizeof(double));
    w->num_q = malloc((size_t)N_TAGS * (size_t)d * sizeof(double));
    w->scratch = malloc(w->scratch_bytes);
    w->bucket = malloc((size_t)n);
    bool ok = w->kq && w->vq && w->kf && w->vf && w->w && w->tag_of && w->num_full && w->num_q &&
              w->scratch && w->bucket;
    if (!aged) return ok;
    w->kqb = malloc((N_BUCKETS - 1) * N_PREC * nd * sizeof(float));
    w->vqb = malloc((N_BUCKETS - 1) * N_PREC * nd * sizeof(float));
    float **rows[] = {&w->chain_k, &w->chain_v, &w->out_k, &w->out_v, &w->tmp};
    for (int i = 0; i < 5; i++) ok = (*rows[i] = malloc(nd * sizeof(float))) != NULL && ok;
    return ok && w->kqb && w->vqb;
}

static double dot(const float *a, const float *b, int32_t d) {
    float s = 0;
    for (int32_t c = 0; c < d; c++) s += a[c] * b[c];
    return (double)s;
}

/* Adds, for the query q at position i of a capture of n_total tokens, each present tag's MSE per
 * precision to w->acc. */
static void measure_query(work *w, const float *q, int32_t i, int32_t n_total, int32_t d,
                          const kvmix_tag *tags, const bool *present) {
    double scale = 1.0 / sqrt((double)d), m = -INFINITY, z = 0;
    int32_t n = i + 1, qturn = tags[i].turn;
    size_t nd = (size_t)n_total * (size_t)d, td = (size_t)N_TAGS * (size_t)d;
    for (int32_t j = 0; j < n; j++) {
        w->w[j] = scale * dot(q, w->kf + (size_t)j * d, d);
        if (w->w[j] > m) m = w->w[j];
        int32_t bucket = (int32_t)kvmix_tag_bucket_of(tags[j].turn, qturn);
        w->tag_of[j] = tag_index(bucket, tags[j].role, tags[j].modality);
        w->bucket[j] = (int8_t)bucket;
    }
    memset(w->num_full, 0, td * sizeof(double));
    memset(w->z_full, 0, sizeof w->z_full);
    for (int32_t j = 0; j < n; j++) {
        double e = exp(w->w[j] - m);
        const float *v = w->vf + (size_t)j * d;
        double *acc = w->num_full + (size_t)w->tag_of[j] * d;
        w->w[j] = e;
        z += e;
        w->z_full[w->tag_of[j]] += e;
        for (int32_t c = 0; c < d; c++) acc[c] += e * v[c];
    }
    double num[KVMIX_MAX_HEAD_DIM], out[KVMIX_MAX_HEAD_DIM];
    for (int32_t c = 0; c < d; c++) {
        double s = 0;
        for (int t = 0; t < N_TAGS; t++) s += w->num_full[(size_t)t * d + c];
        num[c] = s;
        out[c] = s / z;
    }
    for (int p = 0; p < N_PREC; p++) {
        memset(w->num_q, 0, td * sizeof(double));
        memset(w->z_q, 0, sizeof w->z_q);
        for (int32_t j = 0; j < n; j++) {
            /* an aged token as the cache holds it (--stored-from), else quantized from full;
               sinks and the window as the cache holds them, full */
            int full = j < w->sinks || i - j < w->window;
            size_t at = (w->kqb && w->bucket[j] > 0 ? ((size_t)(w->bucket[j] - 1) * N_PREC + p)
                                                    : (size_t)p) *
                            nd +
                        (size_t)j * d;
            const float *k =
                full ? w->kf + (size_t)j * d : (w->kqb && w->bucket[j] > 0 ? w->kqb : w->kq) + at;
            const float *v =
                full ? w->vf + (size_t)j * d : (w->kqb && w->bucket[j] > 0 ? w->vqb : w->vq) + at;
            double e = exp(scale * dot(q, k, d) - m);
            double *acc = w->num_q + (size_t)w->tag_of[j] * d;
            w->z_q[w->tag_of[j]] += e;
            for (int32_t c = 0; c < d; c++) acc[c] += e * v[c];
        }
        for (int t = 0; t < N_TAGS; t++) {
            if (!present[t]) continue;
            const double *full = w->num_full + (size_t)t * d, *quant = w->num_q + (size_t)t * d;
            double zt = z - w->z_full[t] + w->z_q[t], mse = 0;
            for (int32_t c = 0; c < d; c++) {
                double diff = (num[c] - full[c] + quant[c]) / zt - out[c];
                mse += diff * diff;
            }
            w->acc[t][p] += mse / d;
        }
    }
}

/* ---- demoted tokens as a cache stores them (--stored-from) ----------------------------------- */

/* The precision (index in PRECISIONS) a source allocation gives each (bucket, role, modality),
   or -1 where its formats are not one of the calibration's precisions. */
typedef struct stored_source {
    int8_t prec[N_BUCKETS][KVMIX_TAG_N_ROLES][2];
} stored_source;

static bool stored_source_load(const char *path, stored_source *s, char *err) {
    kvmix_tag_precision table;
    kvmix_cache_precision fp16 = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16};
    char why[ERR_BYTES - 64];
    if (tag_allocation_load(path, fp16, &table, why, sizeof why) != KVMIX_SUCCESS) {
        snprintf(err, ERR_BYTES, "--stored-from %s: %s", path, why);
        return false;
    }
    for (int b = 0; b < N_BUCKETS; b++)
        for (int r = 0; r < KVMIX_TAG_N_ROLES; r++)
            for (int m = 0; m < 2; m++) {
                kvmix_cache_precision f = table.formats[b][r][m];
                s->prec[b][r][m] = -1;
                for (int p = 0; p < N_PREC; p++)
                    if (f.key_format == PRECISIONS[p].key && f.value_format == PRECISIONS[p].value)
                        s->prec[b][r][m] = (int8_t)p;
                if (s->prec[b][r][m] < 0) {
                    snprintf(err, ERR_BYTES,
                             "--stored-from %s: %s/%s/%s is not one of the five precisions", path,
                             kvmix_tag_bucket_name((kvmix_tag_bucket)b),
                             kvmix_tag_role_name((kvmix_tag_role)r),
                             kvmix_tag_modality_name((kvmix_tag_modality)m));
                    return false;
                }
            }
    return true;
}

/* dst = rows of precision p re-quantized from src rounded to FP16, as a cache demotes a page. */
static kvmix_result demote(const precision *prec, int p, const float *src_k, const float *src_v,
                           int32_t n, int32_t d, int32_t page, float *dst_k, float *dst_v,
                           work *w) {
    bool per_channel = prec[p].key.format == KVMIX_FORMAT_INT2_CHANNEL ||
                       prec[p].key.format == KVMIX_FORMAT_BOOSTED;
    size_t nd = (size_t)n * (size_t)d;
    kvmix_result r;
    for (size_t i = 0; i < nd; i++) w->tmp[i] = kvmix_fp16_to_fp32(kvmix_fp32_to_fp16(src_k[i]));
    r = round_trip(&prec[p].key, w->tmp, d, n, per_channel ? page : n, dst_k, w->scratch,
                   w->scratch_bytes);
    for (size_t i = 0; r == KVMIX_SUCCESS && i < nd; i++)
        w->tmp[i] = kvmix_fp16_to_fp32(kvmix_fp32_to_fp16(src_v[i]));
    if (r == KVMIX_SUCCESS)
        r = round_trip(&prec[p].value, w->tmp, d, n, n, dst_v, w->scratch, w->scratch_bytes);
    return r;
}

/* The rows of every aged bucket b (1 .. 3) and candidate p as a cache holds them: each token
   stored first in the source's precision of its role and modality in the current bucket, demoted
   as it aged (never raised), then to p if p is lower; into w->kqb / w->vqb [3][N_PREC][n][d],
   rows of the tokens of that role and modality. */
static kvmix_result aged_rows(work *w, const stored_source *src, const precision *prec,
                              const kvmix_tag *tags, int32_t n, int32_t d, int32_t page) {
    size_t nd = (size_t)n * (size_t)d;
    for (int r = 0; r < KVMIX_TAG_N_ROLES; r++)
        for (int m = 0; m < 2; m++) {
            bool present = false;
            for (int32_t j = 0; j < n && !present; j++)
                present = tags[j].role == r && tags[j].modality == m;
            if (!present) continue;
            int c = src->prec[0][r][m]; /* the precision held so far */
            kvmix_result e = c == N_PREC - 1 ? KVMIX_SUCCESS
                                             : demote(prec, c, w->kf, w->vf, n, d, page, w->chain_k,
                                                      w->chain_v, w);
            if (c == N_PREC - 1) {
                memcpy(w->chain_k, w->kf, nd * sizeof(float));
                memcpy(w->chain_v, w->vf, nd * sizeof(float));
            }
            for (int b = 1; b < N_BUCKETS && e == KVMIX_SUCCESS; b++) {
                for (int p = 0; p < N_PREC && e == KVMIX_SUCCESS; p++) {
                    float *ok = w->kqb + ((size_t)(b - 1) * N_PREC + p) * nd;
                    float *ov = w->vqb + ((size_t)(b - 1) * N_PREC + p) * nd;
                    const float *from_k = w->chain_k, *from_v = w->chain_v;
                    if (p < c) {
                        e = demote(prec, p, w->chain_k, w->chain_v, n, d, page, w->out_k, w->out_v,
                                   w);
                        from_k = w->out_k, from_v = w->out_v;
                    }
                    for (int32_t j = 0; j < n; j++)
                        if (tags[j].role == r && tags[j].modality == m) {
                            memcpy(ok + (size_t)j * d, from_k + (size_t)j * d, d * sizeof(float));
                            memcpy(ov + (size_t)j * d, from_v + (size_t)j * d, d * sizeof(float));
                        }
                }
                int next = src->prec[b][r][m]; /* what bucket b holds when it ages on */
                if (e == KVMIX_SUCCESS && next < c) {
                    e = demote(prec, next, w->chain_k, w->chain_v, n, d, page, w->out_k, w->out_v,
                               w);
                    memcpy(w->chain_k, w->out_k, nd * sizeof(float));
                    memcpy(w->chain_v, w->out_v, nd * sizeof(float));
                    c = next;
                }
            }
            if (e != KVMIX_SUCCESS) return e;
        }
    return KVMIX_SUCCESS;
}

/* The capture's layer/kv-head rows, quantized at every precision, then every sampled query of
 * every query head of that kv head. */
static bool measure_capture(capture_job *job, const llama_capture *cap, const kvmix_tag *tags,
                            const precision *prec) {
    int32_t n = cap->n_tokens, d = cap->head_dim, group = cap->n_heads / cap->n_kv_heads;
    int32_t stride = job->geo.query_stride, page = job->geo.page_tokens;
    size_t nd = (size_t)n * (size_t)d;
    work w;
    bool ok = work_alloc(&w, n, d, prec, job->stored != NULL);
    w.sinks = job->geo.sink_tokens;
    w.window = job->geo.window_tokens;
    if (!ok) snprintf(job->err, sizeof job->err, "out of memory");
    /* present[i][t]: tag t has tokens at query i (only sampled queries are filled) */
    bool *present = ok ? calloc((size_t)n * N_TAGS, sizeof(bool)) : NULL;
    if (ok && present == NULL) {
        snprintf(job->err, sizeof job->err, "out of memory");
        ok = false;
    }
    int32_t n_queries = 0;
    for (int32_t i = 0; ok && i < n; i++) {
        if (i % stride != 0 && i != n - 1) continue;
        n_queries++;
        for (int32_t j = 0; j <= i; j++) {
            int32_t bucket = (int32_t)kvmix_tag_bucket_of(tags[j].turn, tags[i].turn);
            present[(size_t)i * N_TAGS + tag_index(bucket, tags[j].role, tags[j].modality)] = true;
        }
    }
    for (int32_t l = 0; ok && l < cap->n_layers; l++) {
        for (int32_t g = 0; ok && g < cap->n_kv_heads; g++) {
            size_t row = (size_t)cap->n_kv_heads * (size_t)d;
            const float *k = cap->k + (size_t)l * nd * cap->n_kv_heads + (size_t)g * d;
            const float *v = cap->v + (size_t)l * nd * cap->n_kv_heads + (size_t)g * d;
            for (int32_t j = 0; j < n; j++) {
                memcpy(w.kf + (size_t)j * d, k + (size_t)j * row, (size_t)d * sizeof(float));
                memcpy(w.vf + (size_t)j * d, v + (size_t)j * row, (size_t)d * sizeof(float));
            }
            if (ok && job->stored != NULL) {
                kvmix_result r = aged_rows(&w, job->stored, prec, tags, n, d, page);
                if (r != KVMIX_SUCCESS) {
                    snprintf(job->err, sizeof job->err, "layer %d kv head %d, aged rows: %s", l, g,
                             kvmix_result_string(r));
                    ok = false;
                }
            }
            for (int p = 0; ok && p < N_PREC; p++) {
                bool per_channel = prec[p].key.format == KVMIX_FORMAT_INT2_CHANNEL ||
                                   prec[p].key.format == KVMIX_FORMAT_BOOSTED;
                kvmix_result r = round_trip(&prec[p].key, w.kf, d, n, per_channel ? page : n,
                                            w.kq + (size_t)p * nd, w.scratch, w.scratch_bytes);
                if (r == KVMIX_SUCCESS)
                    r = round_trip(&prec[p].value, w.vf, d, n, n, w.vq + (size_t)p * nd, w.scratch,
                                   w.scratch_bytes);
                if (r != KVMIX_SUCCESS) {
                    snprintf(job->err, sizeof job->err, "layer %d kv head %d, %s: %s", l, g,
                             PRECISIONS[p].name, kvmix_result_string(r));
                    ok = false;
                }
            }
            for (int32_t hh = 0; ok && hh < group; hh++) {
                int32_t h = g * group + hh;
                memset(w.acc, 0, sizeof w.acc);
                for (int32_t i = 0; i < n; i++) {
                    if (i % stride != 0 && i != n - 1) continue;
                    const float *q = cap->q + (size_t)l * nd * cap->n_heads +
                                     (size_t)i * cap->n_heads * d + (size_t)h * d;
                    measure_query(&w, q, i, n, d, tags, present + (size_t)i * N_TAGS);
                }
                for (int t = 0; t < N_TAGS; t++)
                    for (int p = 0; p < N_PREC; p++) {
                        double mean = w.acc[t][p] / n_queries;
                        double *slot = job->dist + ((size_t)t * N_PREC + p) * cap->n_layers + l;
                        if (mean > *slot) *slot = mean;
                    }
            }
        }
    }
    free(present);
    work_free(&w);
    return ok;
}

/* The pages a cache of this geometry would hold sealed at the capture's end, per tag and row
   count: past the sinks, each run (consecutive tokens of one turn, role and modality, as
   kvmix_policy_token_run keeps them apart) fills pages of page_tokens from its first position,
   the last one closed at its rows; a page counts once it has left the window. */
static void count_pages(capture_job *job, const kvmix_tag *tags, int32_t n) {
    int32_t page = job->geo.page_tokens, last_turn = tags[n - 1].turn;
    int64_t sealed_end = (int64_t)n - job->geo.window_tokens;
    for (int32_t i = job->geo.sink_tokens, j; i < n; i = j) {
        for (j = i; j < n && tags[j].turn == tags[i].turn && tags[j].role == tags[i].role &&
                    tags[j].modality == tags[i].modality;
             j++) {
        }
        int idx = tag_index((int32_t)kvmix_tag_bucket_of(tags[i].turn, last_turn), tags[i].role,
                            tags[i].modality);
        for (int32_t first = i; first < j; first += page) {
            int32_t rows = j - first < page ? j - first : page;
            if (first + rows <= sealed_end) job->pages[(size_t)idx * (size_t)(page + 1) + rows]++;
        }
    }
}

static void run_job(capture_job *job) {
    size_t n_bytes = 0;
    char *bytes = llama_read_text(job->path, &n_bytes);
    llama_capture cap = {0};
    kvmix_tag *tags = NULL;
    precision prec[N_PREC];
    job->ok = false;
    if (bytes == NULL) {
        snprintf(job->err, sizeof job->err, "cannot read it");
        return;
    }
    char why[ERR_BYTES - 64];
    llama_result lr = llama_capture_parse((const uint8_t *)bytes, n_bytes, &cap, why, sizeof why);
    free(bytes);
    if (lr != LLAMA_OK) {
        snprintf(job->err, sizeof job->err, "not a capture: %s", why);
        return;
    }
    job->n_layers = cap.n_layers;
    job->n_heads = cap.n_heads;
    job->n_kv_heads = cap.n_kv_heads;
    job->head_dim = cap.head_dim;
    job->n_tokens = cap.n_tokens;
    kvmix_tagger tagger;
    bool ok = precisions_resolve(&job->geo, cap.head_dim, prec, job->err);
    if (ok && cap.head_dim > KVMIX_MAX_HEAD_DIM) {
        snprintf(job->err, sizeof job->err, "head_dim %d is above %d", cap.head_dim,
                 KVMIX_MAX_HEAD_DIM);
        ok = false;
    }
    if (ok) {
        tags = malloc((size_t)cap.n_tokens * sizeof *tags);
        job->dist = calloc((size_t)N_TAGS * N_PREC * (size_t)cap.n_layers, sizeof(double));
        job->pages = calloc((size_t)N_TAGS * (size_t)(job->geo.page_tokens + 1), sizeof(int64_t));
        ok = tags != NULL && job->dist != NULL && job->pages != NULL;
        if (!ok) snprintf(job->err, sizeof job->err, "out of memory");
    }
    if (ok && (kvmix_tagger_init(&tagger, job->spec, NULL) != KVMIX_SUCCESS ||
               kvmix_tagger_feed(&tagger, cap.token_ids, cap.n_tokens, tags) != KVMIX_SUCCESS)) {
        snprintf(job->err, sizeof job->err, "the tagger refused the spec or the ids");
        ok = false;
    }
    if (ok) {
        int32_t last_turn = tags[cap.n_tokens - 1].turn;
        for (int32_t j = 0; j < cap.n_tokens; j++) {
            int32_t bucket = (int32_t)kvmix_tag_bucket_of(tags[j].turn, last_turn);
            job->count[tag_index(bucket, tags[j].role, tags[j].modality)]++;
        }
        count_pages(job, tags, cap.n_tokens);
        ok = measure_capture(job, &cap, tags, prec);
    }
    free(tags);
    llama_capture_free(&cap);
    job->ok = ok;
}

typedef struct pool {
    capture_job *jobs;
    int32_t n_jobs, next;
    pthread_mutex_t lock;
} pool;

static void *pool_worker(void *arg) {
    pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->lock);
        int32_t i = p->next < p->n_jobs ? p->next++ : -1;
        pthread_mutex_unlock(&p->lock);
        if (i < 0) return NULL;
        run_job(&p->jobs[i]);
    }
}

static void run_jobs(capture_job *jobs, int32_t n_jobs, int32_t n_threads) {
    pool p = {jobs, n_jobs, 0, PTHREAD_MUTEX_INITIALIZER};
    pthread_t threads[64];
    int32_t started = 0;
    if (n_threads > n_jobs) n_threads = n_jobs;
    for (int32_t t = 1; t < n_threads; t++)
        if (pthread_create(&threads[started], NULL, pool_worker, &p) == 0) started++;
    pool_worker(&p);
    for (int32_t t = 0; t < started; t++) pthread_join(threads[t], NULL);
}

/* ---- captures to table ----------------------------------------------------------------------- */

static int compare_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The sorted base names of DIR/capture-*.bin. */
static bool list_captures(const char *dir, char ***out, int32_t *n_out, char *err) {
    DIR *d = opendir(dir);
    if (d == NULL) {
        snprintf(err, ERR_BYTES, "--captures %s: cannot open the directory", dir);
        return false;
    }
    char **names = NULL;
    int32_t n = 0;
    bool ok = true;
    for (struct dirent *e; ok && (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name);
        if (len < 12 || strncmp(e->d_name, "capture-", 8) != 0 ||
            strcmp(e->d_name + len - 4, ".bin") != 0)
            continue;
        char **grown = realloc(names, (size_t)(n + 1) * sizeof *names);
        char *copy = dup_string(e->d_name);
        if (grown != NULL) names = grown;
        if (grown == NULL || copy == NULL || n == INT32_MAX - 1) {
            free(copy);
            snprintf(err, ERR_BYTES, "out of memory");
            ok = false;
        } else {
            names[n++] = copy;
        }
    }
    closedir(d);
    if (ok && n == 0) {
        snprintf(err, ERR_BYTES, "--captures %s: no capture-*.bin file (kvmix-eval --capture %s)",
                 dir, dir);
        ok = false;
    }
    if (!ok) {
        for (int32_t i = 0; i < n; i++) free(names[i]);
        free(names);
        return false;
    }
    qsort(names, (size_t)n, sizeof *names, compare_names);
    *out = names;
    *n_out = n;
    return true;
}

static int compare_counts(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Builds the table from finished jobs (same shape checked). */
static bool table_from_jobs(table *t, capture_job *jobs, int32_t n_jobs, char *err) {
    const capture_job *first = &jobs[0];
    t->n_layers = first->n_layers;
    t->n_heads = first->n_heads;
    t->n_kv_heads = first->n_kv_heads;
    t->head_dim = first->head_dim;
    t->geo = first->geo;
    for (int32_t c = 1; c < n_jobs; c++) {
        const capture_job *j = &jobs[c];
        if (j->n_layers != t->n_layers || j->n_heads != t->n_heads ||
            j->n_kv_heads != t->n_kv_heads || j->head_dim != t->head_dim) {
            snprintf(err, ERR_BYTES, "%s: model shape differs from %s", j->path, first->path);
            return false;
        }
    }
    if (!precisions_resolve(&t->geo, t->head_dim, t->prec, err)) return false;
    const int32_t page = t->geo.page_tokens;
    t->has_pages = true;
    int64_t *counts = malloc((size_t)n_jobs * sizeof *counts);
    if (counts == NULL) {
        snprintf(err, ERR_BYTES, "out of memory");
        return false;
    }
    for (int32_t b = 0; b < N_BUCKETS; b++)
        for (int32_t r = 0; r < KVMIX_TAG_N_ROLES; r++)
            for (int32_t m = 0; m < 2; m++) {
                int idx = tag_index(b, r, m);
                table_tag tag = {b, r, m, 0, 0, NULL, NULL, {0}, {0}};
                int32_t active = 0;
                for (int32_t c = 0; c < n_jobs; c++)
                    if (jobs[c].count[idx] > 0) counts[active++] = jobs[c].count[idx];
                if (active == 0) continue;
                tag.n_captures = active;
                tag.per_capture = malloc((size_t)n_jobs * sizeof(int64_t));
                tag.pages = calloc((size_t)page + 1, sizeof(int64_t));
                if (tag.per_capture == NULL || tag.pages == NULL) {
                    free(tag.per_capture);
                    free(tag.pages);
                    free(counts);
                    snprintf(err, ERR_BYTES, "out of memory");
                    return false;
                }
                for (int32_t c = 0; c < n_jobs; c++)
                    for (int32_t rows = 1; rows <= page; rows++)
                        tag.pages[rows] += jobs[c].pages[(size_t)idx * (size_t)(page + 1) + rows];
                for (int32_t c = 0; c < n_jobs; c++) {
                    tag.per_capture[c] = jobs[c].count[idx];
                    if (r != KVMIX_ROLE_INSTRUCTION) tag.tokens += jobs[c].count[idx];
                }
                if (r == KVMIX_ROLE_INSTRUCTION) {
                    qsort(counts, (size_t)active, sizeof *counts, compare_counts);
                    tag.tokens = active % 2 ? counts[active / 2]
                                            : (counts[active / 2 - 1] + counts[active / 2] + 1) / 2;
                }
                for (int32_t p = 0; p < N_PREC; p++) {
                    double total = 0;
                    for (int32_t l = 0; l < t->n_layers; l++) {
                        double sum = 0;
                        for (int32_t c = 0; c < n_jobs; c++)
                            if (jobs[c].count[idx] > 0)
                                sum += jobs[c].dist[((size_t)idx * N_PREC + p) * t->n_layers + l];
                        total += sum / active;
                    }
                    tag.distortion[p] = total;
                }
                t->tags[t->n_tags++] = tag;
            }
    free(counts);
    return true;
}

static bool table_from_captures(const options *o, table *t, char *err) {
    tag_spec_doc *doc = malloc(sizeof *doc);
    char **names = NULL;
    int32_t n = 0;
    if (doc == NULL) {
        snprintf(err, ERR_BYTES, "out of memory");
        return false;
    }
    char why[ERR_BYTES - 64];
    if (tag_spec_load(o->spec_path, doc, why, sizeof why) != KVMIX_SUCCESS) {
        snprintf(err, ERR_BYTES, "--spec %s: %s", o->spec_path, why);
        free(doc);
        return false;
    }
    if (!list_captures(o->captures_dir, &names, &n, err)) {
        free(doc);
        return false;
    }
    capture_job *jobs = calloc((size_t)n, sizeof *jobs);
    char **paths = calloc((size_t)n, sizeof *paths);
    stored_source stored;
    bool ok = jobs != NULL && paths != NULL;
    if (!ok) snprintf(err, ERR_BYTES, "out of memory");
    if (ok && o->stored_from != NULL && !stored_source_load(o->stored_from, &stored, err)) {
        for (int32_t c = 0; c < n; c++) free(names[c]);
        free(names), free(paths), free(jobs), free(doc);
        return false;
    }
    for (int32_t c = 0; ok && c < n; c++) {
        size_t len = strlen(o->captures_dir) + strlen(names[c]) + 2;
        paths[c] = malloc(len);
        ok = paths[c] != NULL;
        if (ok) snprintf(paths[c], len, "%s/%s", o->captures_dir, names[c]);
        if (ok)
            jobs[c] = (capture_job){.path = paths[c],
                                    .spec = &doc->spec,
                                    .geo = o->geo,
                                    .stored = o->stored_from != NULL ? &stored : NULL};
        if (!ok) snprintf(err, ERR_BYTES, "out of memory");
    }
    if (ok) run_jobs(jobs, n, o->n_threads);
    for (int32_t c = 0; ok && c < n; c++)
        if (!jobs[c].ok) {
            snprintf(err, ERR_BYTES, "%.200s: %.300s", jobs[c].path, jobs[c].err);
            ok = false;
        }
    if (ok) {
        t->spec = dup_string(o->spec_path);
        t->stored_from = o->stored_from != NULL ? dup_string(o->stored_from) : NULL;
        t->files = names;
        t->n_captures = n;
        names = NULL;
        t->n_tokens = malloc((size_t)n * sizeof *t->n_tokens);
        ok = t->spec != NULL && t->n_tokens != NULL;
        if (!ok) snprintf(err, ERR_BYTES, "out of memory");
        for (int32_t c = 0; ok && c < n; c++) t->n_tokens[c] = jobs[c].n_tokens;
    }
    if (ok) ok = table_from_jobs(t, jobs, n, err);
    for (int32_t c = 0; c < n; c++) {
        if (names != NULL) free(names[c]);
        if (paths != NULL) free(paths[c]);
        if (jobs != NULL) free(jobs[c].dist), free(jobs[c].pages);
    }
    free(names);
    free(paths);
    free(jobs);
    free(doc);
    return ok;
}

/* ---- table JSON ------------------------------------------------------------------------------ */

/* One JSON line per item of a list: cJSON_PrintUnformatted for every item, the frame by hand. */
static bool append(char **buf, size_t *len, size_t *cap, const char *text) {
    size_t n = strlen(text);
    if (*len + n + 1 > *cap) {
        size_t grown_cap = (*len + n + 1) * 2;
        char *grown = realloc(*buf, grown_cap);
        if (grown == NULL) return false;
        *buf = grown;
        *cap = grown_cap;
    }
    memcpy(*buf + *len, text, n + 1);
    *len += n;
    return true;
}

static bool append_json(char **buf, size_t *len, size_t *cap, cJSON *item) {
    char *text = item != NULL ? cJSON_PrintUnformatted(item) : NULL;
    bool ok = text != NULL && append(buf, len, cap, text);
    free(text);
    cJSON_Delete(item);
    return ok;
}

/* A number as the shortest of %.15g, %.16g, %.17g that reads back to the same double (cJSON's own
 * printer accepts a near miss), so that tables and allocations round-trip exactly. */
static cJSON *exact_number(double v) {
    char buf[40];
    for (int digits = 15; digits <= 17; digits++) {
        snprintf(buf, sizeof buf, "%.*g", digits, v);
        if (strtod(buf, NULL) == v) break;
    }
    return cJSON_CreateRaw(buf);
}

static void add_exact(cJSON *o, const char *name, double v) {
    cJSON_AddItemToObject(o, name, exact_number(v));
}

static cJSON *precision_json(const precision *p, int idx) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", PRECISIONS[idx].name);
    cJSON_AddStringToObject(o, "key_format", kvmix_format_name(p->key.format));
    cJSON_AddStringToObject(o, "value_format", kvmix_format_name(p->value.format));
    add_exact(o, "key_bits", p->key_bits);
    add_exact(o, "value_bits", p->value_bits);
    add_exact(o, "bits", p->bits);
    return o;
}

static void add_tag_fields(cJSON *o, const table_tag *tag) {
    char name[96];
    tag_name(tag, name, sizeof name);
    cJSON_AddStringToObject(o, "name", name);
    cJSON_AddStringToObject(o, "bucket", kvmix_tag_bucket_name((kvmix_tag_bucket)tag->bucket));
    cJSON_AddStringToObject(o, "role", kvmix_tag_role_name((kvmix_tag_role)tag->role));
    cJSON_AddStringToObject(o, "modality",
                            kvmix_tag_modality_name((kvmix_tag_modality)tag->modality));
    cJSON_AddNumberToObject(o, "tokens", (double)tag->tokens);
}

/* A tag's sealed pages as [[rows, count], ...], rows increasing, counts above 0. */
static cJSON *pages_json(const table_tag *tag, int32_t page) {
    cJSON *list = cJSON_CreateArray();
    for (int32_t rows = 1; rows <= page; rows++) {
        if (tag->pages[rows] == 0) continue;
        cJSON *pair = cJSON_CreateArray();
        cJSON_AddItemToArray(pair, cJSON_CreateNumber(rows));
        cJSON_AddItemToArray(pair, cJSON_CreateNumber((double)tag->pages[rows]));
        cJSON_AddItemToArray(list, pair);
    }
    return list;
}

/* The table as JSON text (malloc'd), or NULL when out of memory. */
static char *table_json(const table *t) {
    char *buf = NULL;
    size_t len = 0, cap = 0;
    bool ok = true;
    cJSON *model = cJSON_CreateObject(), *geo = cJSON_CreateObject();
    cJSON_AddNumberToObject(model, "n_layers", t->n_layers);
    cJSON_AddNumberToObject(model, "n_heads", t->n_heads);
    cJSON_AddNumberToObject(model, "n_kv_heads", t->n_kv_heads);
    cJSON_AddNumberToObject(model, "head_dim", t->head_dim);
    cJSON_AddNumberToObject(geo, "page_tokens", t->geo.page_tokens);
    cJSON_AddNumberToObject(geo, "key_group", t->geo.key_group);
    cJSON_AddNumberToObject(geo, "value_group", t->geo.value_group);
    cJSON_AddNumberToObject(geo, "n_boost", t->geo.n_boost);
    cJSON_AddNumberToObject(geo, "query_stride", t->geo.query_stride);
    if (t->geo.sink_tokens > 0) cJSON_AddNumberToObject(geo, "sink_tokens", t->geo.sink_tokens);
    if (t->geo.window_tokens > 0)
        cJSON_AddNumberToObject(geo, "window_tokens", t->geo.window_tokens);
    if (t->stored_from != NULL) cJSON_AddStringToObject(geo, "stored_from", t->stored_from);
    cJSON *spec = cJSON_CreateString(t->spec);
    char version[64];
    snprintf(version, sizeof version, "{\"version\": %d, \"kind\": \"kvmix-calibration-table\",\n",
             TABLE_VERSION);
    ok = append(&buf, &len, &cap, version) && append(&buf, &len, &cap, " \"model\": ") &&
         append_json(&buf, &len, &cap, model) && append(&buf, &len, &cap, ",\n \"spec\": ") &&
         append_json(&buf, &len, &cap, spec) && append(&buf, &len, &cap, ",\n \"geometry\": ") &&
         append_json(&buf, &len, &cap, geo) &&
         append(&buf, &len, &cap,
                ",\n \"distortion\": \"attention-output MSE: max over heads, mean over "
                "captures, sum over layers\",\n \"precisions\": [");
    for (int p = 0; ok && p < N_PREC; p++)
        ok = append(&buf, &len, &cap, p ? ",\n  " : "\n  ") &&
             append_json(&buf, &len, &cap, precision_json(&t->prec[p], p));
    ok = ok && append(&buf, &len, &cap, "],\n \"captures\": [");
    for (int32_t c = 0; ok && c < t->n_captures; c++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "file", t->files[c]);
        cJSON_AddNumberToObject(o, "n_tokens", (double)t->n_tokens[c]);
        ok = append(&buf, &len, &cap, c ? ",\n  " : "\n  ") && append_json(&buf, &len, &cap, o);
    }
    ok = ok && append(&buf, &len, &cap, "],\n \"tags\": [");
    for (int32_t i = 0; ok && i < t->n_tags; i++) {
        const table_tag *tag = &t->tags[i];
        cJSON *o = cJSON_CreateObject(), *per = cJSON_CreateArray(), *dist = cJSON_CreateArray();
        add_tag_fields(o, tag);
        cJSON_AddNumberToObject(o, "n_captures", tag->n_captures);
        for (int32_t c = 0; c < t->n_captures; c++)
            cJSON_AddItemToArray(per, cJSON_CreateNumber((double)tag->per_capture[c]));
        for (int p = 0; p < N_PREC; p++)
            cJSON_AddItemToArray(dist, exact_number(tag->distortion[p]));
        cJSON_AddItemToObject(o, "tokens_per_capture", per);
        cJSON_AddItemToObject(o, "distortion", dist);
        if (t->has_pages) cJSON_AddItemToObject(o, "pages", pages_json(tag, t->geo.page_tokens));
        ok = append(&buf, &len, &cap, i ? ",\n  " : "\n  ") && append_json(&buf, &len, &cap, o);
    }
    ok = ok && append(&buf, &len, &cap, "]}\n");
    if (!ok) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* Strict readers: each returns false and writes err naming the field. */
static const cJSON *field(const cJSON *obj, const char *name, char *err) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (f == NULL) snprintf(err, ERR_BYTES, "missing field \"%s\"", name);
    return f;
}

static bool get_int(const cJSON *obj, const char *name, int64_t min, int64_t max, int64_t *out,
                    char *err) {
    const cJSON *f = field(obj, name, err);
    if (f == NULL) return false;
    double v = cJSON_IsNumber(f) ? f->valuedouble : NAN;
    if (!(v >= (double)min && v <= (double)max) || v != floor(v)) {
        snprintf(err, ERR_BYTES, "\"%s\" must be an integer in %lld..%lld", name, (long long)min,
                 (long long)max);
        return false;
    }
    *out = (int64_t)v;
    return true;
}

static bool get_i32(const cJSON *obj, const char *name, int32_t min, int32_t max, int32_t *out,
                    char *err) {
    int64_t v;
    if (!get_int(obj, name, min, max, &v, err)) return false;
    *out = (int32_t)v;
    return true;
}

static bool get_number(const cJSON *f, const char *name, double *out, char *err) {
    if (!cJSON_IsNumber(f) || !isfinite(f->valuedouble) || f->valuedouble < 0) {
        snprintf(err, ERR_BYTES, "\"%s\" must be a finite number >= 0", name);
        return false;
    }
    *out = f->valuedouble;
    return true;
}

static const char *get_string(const cJSON *obj, const char *name, char *err) {
    const cJSON *f = field(obj, name, err);
    if (f != NULL && !cJSON_IsString(f)) {
        snprintf(err, ERR_BYTES, "\"%s\" must be a string", name);
        return NULL;
    }
    return f != NULL ? f->valuestring : NULL;
}

static const cJSON *get_array(const cJSON *obj, const char *name, int32_t n, char *err) {
    const cJSON *f = field(obj, name, err);
    if (f != NULL && (!cJSON_IsArray(f) || (n >= 0 && cJSON_GetArraySize(f) != n))) {
        if (n >= 0)
            snprintf(err, ERR_BYTES, "\"%s\" must be an array of %d entries", name, n);
        else
            snprintf(err, ERR_BYTES, "\"%s\" must be an array", name);
        return NULL;
    }
    return f;
}

static bool name_index(const char *s, const char *(*namer)(int), int n, int32_t *out) {
    for (int i = 0; i < n; i++)
        if (strcmp(s, namer(i)) == 0) {
            *out = i;
            return true;
        }
    return false;
}
static const char *bucket_namer(int i) { return kvmix_tag_bucket_name((kvmix_tag_bucket)i); }
static const char *role_namer(int i) { return kvmix_tag_role_name((kvmix_tag_role)i); }
static const char *modality_namer(int i) { return kvmix_tag_modality_name((kvmix_tag_modality)i); }

/* A tag's "pages" ([[rows, count], ...]: rows 1 .. page, each once, counts >= 0) into pages. */
static bool read_pages(const cJSON *list, int32_t page, int64_t *pages, char *err) {
    const cJSON *pair;
    if (!cJSON_IsArray(list)) {
        snprintf(err, ERR_BYTES, "\"pages\" must be an array");
        return false;
    }
    cJSON_ArrayForEach(pair, list) {
        const cJSON *rows = cJSON_GetArrayItem(pair, 0), *count = cJSON_GetArrayItem(pair, 1);
        double r = cJSON_IsNumber(rows) ? rows->valuedouble : -1;
        double c = cJSON_IsNumber(count) ? count->valuedouble : -1;
        if (!cJSON_IsArray(pair) || cJSON_GetArraySize(pair) != 2 || !(r >= 1 && r <= page) ||
            r != floor(r) || !(c >= 0 && c <= 9007199254740992.0) || c != floor(c) ||
            pages[(int32_t)r] != 0) {
            snprintf(err, ERR_BYTES,
                     "\"pages\" must hold [rows, count] pairs, rows 1..%d once each, counts >= 0",
                     page);
            return false;
        }
        pages[(int32_t)r] = (int64_t)c;
    }
    return true;
}

static bool read_tag(const cJSON *o, int32_t n_captures, table_tag *tag, char *err) {
    const char *b = get_string(o, "bucket", err), *r = get_string(o, "role", err),
               *m = get_string(o, "modality", err);
    if (b == NULL || r == NULL || m == NULL) return false;
    if (!name_index(b, bucket_namer, N_BUCKETS, &tag->bucket) ||
        !name_index(r, role_namer, KVMIX_TAG_N_ROLES, &tag->role) ||
        !name_index(m, modality_namer, 2, &tag->modality)) {
        snprintf(err, ERR_BYTES, "unknown bucket, role or modality %s/%s/%s", b, r, m);
        return false;
    }
    const cJSON *per = get_array(o, "tokens_per_capture", n_captures, err);
    const cJSON *dist = get_array(o, "distortion", N_PREC, err);
    if (per == NULL || dist == NULL) return false;
    if (!get_int(o, "tokens", 0, (int64_t)1 << 53, &tag->tokens, err) ||
        !get_i32(o, "n_captures", 1, n_captures, &tag->n_captures, err))
        return false;
    tag->per_capture = malloc((size_t)n_captures * sizeof(int64_t));
    if (tag->per_capture == NULL) {
        snprintf(err, ERR_BYTES, "out of memory");
        return false;
    }
    int32_t c = 0, p = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, per) {
        double v = cJSON_IsNumber(item) ? item->valuedouble : -1;
        if (!(v >= 0 && v <= 9007199254740992.0) || v != floor(v)) {
            snprintf(err, ERR_BYTES, "\"tokens_per_capture\" must hold integers >= 0");
            return false;
        }
        tag->per_capture[c++] = (int64_t)v;
    }
    cJSON_ArrayForEach(item, dist) {
        if (!get_number(item, "distortion", &tag->distortion[p++], err)) return false;
    }
    return true;
}

/* The optional "pages" of every tag: all or none of them carry it. */
static bool read_all_pages(const cJSON *tags, table *t, char *err) {
    const cJSON *item;
    int32_t i = 0, with = 0;
    cJSON_ArrayForEach(item, tags) with += cJSON_GetObjectItemCaseSensitive(item, "pages") != NULL;
    if (with == 0) return true;
    if (t->geo.page_tokens > MAX_PAGE_TOKENS) {
        snprintf(err, ERR_BYTES, "\"pages\" with page_tokens above %d", MAX_PAGE_TOKENS);
        return false;
    }
    if (with != t->n_tags) {
        snprintf(err, ERR_BYTES, "\"pages\" on %d of %d tags: all or none", with, t->n_tags);
        return false;
    }
    t->has_pages = true;
    cJSON_ArrayForEach(item, tags) {
        table_tag *tag = &t->tags[i++];
        char why[ERR_BYTES - 32];
        tag->pages = calloc((size_t)t->geo.page_tokens + 1, sizeof(int64_t));
        if (tag->pages == NULL) {
            snprintf(err, ERR_BYTES, "out of memory");
            return false;
        }
        if (!read_pages(cJSON_GetObjectItemCaseSensitive(item, "pages"), t->geo.page_tokens,
                        tag->pages, why)) {
            snprintf(err, ERR_BYTES, "tag %d: %s", i - 1, why);
            return false;
        }
    }
    return true;
}

static bool table_parse(const char *json, size_t n_bytes, table *t, char *err) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, n_bytes, &end, 0);
    const cJSON *model, *geo, *precs, *caps, *tags, *item;
    int32_t version = 0;
    const char *kind = NULL, *spec = NULL;
    bool ok = false;
    memset(t, 0, sizeof *t);
    if (root == NULL || !cJSON_IsObject(root)) {
        snprintf(err, ERR_BYTES, "not a JSON object (near byte %lld)",
                 (long long)(end != NULL ? end - json : 0));
        goto done;
    }
    if (!get_i32(root, "version", 0, INT32_MAX, &version, err)) goto done;
    if (version != TABLE_VERSION) {
        snprintf(err, ERR_BYTES, "version %d, this reader knows %d", version, TABLE_VERSION);
        goto done;
    }
    if ((kind = get_string(root, "kind", err)) == NULL) goto done;
    if (strcmp(kind, "kvmix-calibration-table") != 0) {
        snprintf(err, ERR_BYTES, "\"kind\" is not \"kvmix-calibration-table\"");
        goto done;
    }
    if ((model = field(root, "model", err)) == NULL ||
        (geo = field(root, "geometry", err)) == NULL ||
        (spec = get_string(root, "spec", err)) == NULL ||
        (precs = get_array(root, "precisions", N_PREC, err)) == NULL ||
        (caps = get_array(root, "captures", -1, err)) == NULL ||
        (tags = get_array(root, "tags", -1, err)) == NULL)
        goto done;
    if (!get_i32(model, "n_layers", 1, LLAMA_CAPTURE_MAX_DIM, &t->n_layers, err) ||
        !get_i32(model, "n_heads", 1, LLAMA_CAPTURE_MAX_DIM, &t->n_heads, err) ||
        !get_i32(model, "n_kv_heads", 1, LLAMA_CAPTURE_MAX_DIM, &t->n_kv_heads, err) ||
        !get_i32(model, "head_dim", 32, KVMIX_MAX_HEAD_DIM, &t->head_dim, err) ||
        !get_i32(geo, "page_tokens", 1, 1 << 20, &t->geo.page_tokens, err) ||
        !get_i32(geo, "key_group", 8, KVMIX_MAX_HEAD_DIM, &t->geo.key_group, err) ||
        !get_i32(geo, "value_group", 8, KVMIX_MAX_HEAD_DIM, &t->geo.value_group, err) ||
        !get_i32(geo, "n_boost", 4, 252, &t->geo.n_boost, err) ||
        !get_i32(geo, "query_stride", 1, 1 << 20, &t->geo.query_stride, err))
        goto done;
    if ((cJSON_GetObjectItemCaseSensitive(geo, "sink_tokens") != NULL &&
         !get_i32(geo, "sink_tokens", 0, 1 << 20, &t->geo.sink_tokens, err)) ||
        (cJSON_GetObjectItemCaseSensitive(geo, "window_tokens") != NULL &&
         !get_i32(geo, "window_tokens", 0, 1 << 26, &t->geo.window_tokens, err)))
        goto done;
    if (cJSON_GetObjectItemCaseSensitive(geo, "stored_from") != NULL) {
        const char *from = get_string(geo, "stored_from", err);
        if (from == NULL || (t->stored_from = dup_string(from)) == NULL) goto done;
    }
    if (!precisions_resolve(&t->geo, t->head_dim, t->prec, err)) goto done;
    int p = 0;
    cJSON_ArrayForEach(item, precs) {
        const char *name = get_string(item, "name", err);
        const cJSON *kb = field(item, "key_bits", err), *vb = field(item, "value_bits", err),
                    *bits = field(item, "bits", err);
        if (name == NULL || kb == NULL || vb == NULL || bits == NULL) goto done;
        if (strcmp(name, PRECISIONS[p].name) != 0) {
            snprintf(err, ERR_BYTES, "precision %d must be \"%s\"", p, PRECISIONS[p].name);
            goto done;
        }
        /* Bits as written (they must be those of the geometry; the file is the record). */
        if (!get_number(kb, "key_bits", &t->prec[p].key_bits, err) ||
            !get_number(vb, "value_bits", &t->prec[p].value_bits, err) ||
            !get_number(bits, "bits", &t->prec[p].bits, err))
            goto done;
        if (!(t->prec[p].bits > 0)) {
            snprintf(err, ERR_BYTES, "\"bits\" of %s must be positive", name);
            goto done;
        }
        p++;
    }
    int32_t n_caps = cJSON_GetArraySize(caps), n_tags = cJSON_GetArraySize(tags);
    if (n_caps < 1 || n_tags < 1 || n_tags > N_TAGS) {
        snprintf(err, ERR_BYTES, "need at least one capture and 1..%d tags", N_TAGS);
        goto done;
    }
    t->spec = dup_string(spec);
    t->files = calloc((size_t)n_caps, sizeof *t->files);
    t->n_tokens = calloc((size_t)n_caps, sizeof *t->n_tokens);
    if (t->spec == NULL || t->files == NULL || t->n_tokens == NULL) {
        snprintf(err, ERR_BYTES, "out of memory");
        goto done;
    }
    cJSON_ArrayForEach(item, caps) {
        const char *file = get_string(item, "file", err);
        if (file == NULL ||
            !get_int(item, "n_tokens", 1, LLAMA_CAPTURE_MAX_DIM, &t->n_tokens[t->n_captures], err))
            goto done;
        if ((t->files[t->n_captures++] = dup_string(file)) == NULL) {
            snprintf(err, ERR_BYTES, "out of memory");
            goto done;
        }
    }
    bool seen[N_TAGS] = {false};
    cJSON_ArrayForEach(item, tags) {
        table_tag *tag = &t->tags[t->n_tags++];
        char why[ERR_BYTES - 32];
        if (!read_tag(item, n_caps, tag, why)) {
            snprintf(err, ERR_BYTES, "tag %d: %s", t->n_tags - 1, why);
            goto done;
        }
        int idx = tag_index(tag->bucket, tag->role, tag->modality);
        if (seen[idx]) {
            snprintf(err, ERR_BYTES, "tag %d appears twice", t->n_tags - 1);
            goto done;
        }
        seen[idx] = true;
    }
    ok = read_all_pages(tags, t, err);
done:
    cJSON_Delete(root);
    if (!ok) table_free(t);
    return ok;
}

/* ---- prices ---------------------------------------------------------------------------------- */

/* A cache of the table's model shape and geometry (pages, groups, boosted channels), with an arena
   of one FP16 page, to price pages with kvmix_cache_page_bits. */
static bool pricing_cache(const table *t, kvmix_cache *c, char *err) {
    kvmix_policy policy = *kvmix_policy_find("int4");
    kvmix_error why = {"", ""};
    kvmix_cache_desc d;
    memset(&d, 0, sizeof d);
    policy.page_tokens = t->geo.page_tokens;
    policy.group_size = t->geo.key_group;
    policy.value_group_size = t->geo.value_group;
    policy.n_boost = t->geo.n_boost;
    policy.boost_fraction = 0;
    d.n_layers = t->n_layers;
    d.n_kv_heads = t->n_kv_heads;
    d.head_dim = t->head_dim;
    d.max_seqs = 1;
    d.max_tokens_per_seq = t->geo.page_tokens;
    d.arena_bytes = ((size_t)t->geo.page_tokens * (size_t)t->head_dim * 4 * (size_t)t->n_layers *
                         (size_t)t->n_kv_heads +
                     255) /
                    256 * 256;
    kvmix_result r = kvmix_policy_apply(&policy, &d, &why);
    if (r == KVMIX_SUCCESS) r = kvmix_cache_init_allocator(c, &d, NULL, NULL);
    if (r != KVMIX_SUCCESS)
        snprintf(err, ERR_BYTES, "a cache of this geometry: %s (%s: %s)", kvmix_result_string(r),
                 why.field, why.reason);
    return r == KVMIX_SUCCESS;
}

/* Fills every tag's prices (--price): a full page's bits (the layouts' kvmix_layout_bits), or
   its measured pages at what the cache holds for their rows, mean per token (a tag without a
   sealed page: a full page's). */
static bool price_tags(table *t, pricing how, char *err) {
    if (how == PRICE_DEFAULT) how = t->has_pages ? PRICE_RUNS : PRICE_PAGES;
    if (how == PRICE_RUNS && !t->has_pages) {
        snprintf(err, ERR_BYTES, "--price runs: the table counts no pages (calibrate it again)");
        return false;
    }
    t->price = how;
    if (how == PRICE_PAGES) {
        for (int32_t i = 0; i < t->n_tags; i++)
            for (int p = 0; p < N_PREC; p++) t->tags[i].price[p] = t->prec[p].bits;
        return true;
    }
    kvmix_cache cache;
    if (!pricing_cache(t, &cache, err)) return false;
    const int32_t page = t->geo.page_tokens;
    double at_rows[MAX_PAGE_TOKENS + 1];
    kvmix_result r = KVMIX_SUCCESS;
    for (int p = 0; r == KVMIX_SUCCESS && p < N_PREC; p++) {
        kvmix_cache_precision want = {(uint8_t)PRECISIONS[p].key, (uint8_t)PRECISIONS[p].value};
        for (int32_t rows = 1; r == KVMIX_SUCCESS && rows <= page; rows++)
            r = kvmix_cache_page_bits(&cache, want, rows, &at_rows[rows]);
        for (int32_t i = 0; r == KVMIX_SUCCESS && i < t->n_tags; i++) {
            double bits = 0, tokens = 0;
            for (int32_t rows = 1; rows <= page; rows++) {
                bits += (double)t->tags[i].pages[rows] * rows * at_rows[rows];
                tokens += (double)t->tags[i].pages[rows] * rows;
            }
            t->tags[i].price[p] = tokens > 0 ? bits / tokens : at_rows[page];
        }
    }
    kvmix_cache_deinit(&cache);
    if (r != KVMIX_SUCCESS) snprintf(err, ERR_BYTES, "pricing pages: %s", kvmix_result_string(r));
    return r == KVMIX_SUCCESS;
}

/* --instruction each: instruction tags count their tokens in every capture, as a cache that does
   not share the system prompt between requests stores them. */
static void count_instruction_each(table *t) {
    for (int32_t i = 0; i < t->n_tags; i++) {
        if (t->tags[i].role != KVMIX_ROLE_INSTRUCTION) continue;
        t->tags[i].tokens = 0;
        for (int32_t c = 0; c < t->n_captures; c++) t->tags[i].tokens += t->tags[i].per_capture[c];
    }
}

/* ---- allocation ------------------------------------------------------------------------------ */

typedef struct allocation {
    kvmix_result r; /* KVMIX_ERR_OUT_OF_MEMORY: the budget is infeasible */
    int32_t choice[N_TAGS];
    kvmix_alloc_summary summary;
} allocation;

static void make_problem(const table *t, double budget, int64_t *tokens, double *dist, double *bits,
                         double *prices, kvmix_alloc_problem *p) {
    for (int32_t i = 0; i < t->n_tags; i++) {
        tokens[i] = t->tags[i].tokens;
        for (int q = 0; q < N_PREC; q++) {
            dist[i * N_PREC + q] = t->tags[i].distortion[q];
            prices[i * N_PREC + q] = t->tags[i].price[q];
        }
    }
    for (int q = 0; q < N_PREC; q++) bits[q] = t->prec[q].bits;
    *p = (kvmix_alloc_problem){t->n_tags, N_PREC, tokens, dist, bits, budget, prices};
}

static allocation allocate(const table *t, double budget, const options *o, bool two_level) {
    int64_t tokens[N_TAGS];
    double dist[N_TAGS * N_PREC], bits[N_PREC], prices[N_TAGS * N_PREC];
    kvmix_alloc_problem p;
    allocation a;
    memset(&a, 0, sizeof a);
    make_problem(t, budget, tokens, dist, bits, prices, &p);
    size_t bytes = 0;
    a.r = two_level ? kvmix_alloc_two_level_workspace_bytes(t->n_tags, KVMIX_ALLOC_AUTO, &bytes)
                    : kvmix_alloc_knapsack_workspace_bytes(&p, o->steps, &bytes);
    double *ws = a.r == KVMIX_SUCCESS && bytes > 0 ? malloc(bytes) : NULL; /* 8-byte aligned */
    if (a.r == KVMIX_SUCCESS && bytes > 0 && ws == NULL) a.r = KVMIX_ERR_OUT_OF_MEMORY;
    if (a.r == KVMIX_SUCCESS)
        a.r = two_level ? kvmix_alloc_two_level(&p, o->low, o->high, KVMIX_ALLOC_AUTO, ws, bytes,
                                                a.choice, &a.summary)
                        : kvmix_alloc_knapsack(&p, o->steps, ws, bytes, a.choice, &a.summary);
    free(ws);
    return a;
}

/* The tagged problem with tags merged into groups (group_of[i] for tag i): a group's tokens and
   distortion are its tags' sums, so that one choice per group is one choice for all of them. */
static int32_t merge_tags(const table *t, ablation how, table *merged, int32_t *group_of) {
    *merged = *t;
    merged->n_tags = 0;
    for (int32_t i = 0; i < t->n_tags; i++) {
        const table_tag *tag = &t->tags[i];
        int32_t g = 0;
        while (g < merged->n_tags &&
               !(merged->tags[g].modality == tag->modality &&
                 (how == ABLATE_TEMPORAL ? merged->tags[g].role == tag->role
                                         : merged->tags[g].bucket == tag->bucket)))
            g++;
        if (g == merged->n_tags) {
            merged->tags[g] = *tag;
            merged->tags[g].tokens = 0;
            memset(merged->tags[g].distortion, 0, sizeof merged->tags[g].distortion);
            memset(merged->tags[g].price, 0, sizeof merged->tags[g].price);
            merged->n_tags++;
        }
        merged->tags[g].tokens += tag->tokens;
        for (int q = 0; q < N_PREC; q++) {
            merged->tags[g].distortion[q] += tag->distortion[q];
            merged->tags[g].price[q] += (double)tag->tokens * tag->price[q]; /* a sum, for now */
        }
        group_of[i] = g;
    }
    for (int32_t g = 0; g < merged->n_tags; g++) /* the members' prices, by their tokens */
        for (int q = 0; q < N_PREC; q++)
            merged->tags[g].price[q] = merged->tags[g].tokens > 0
                                           ? merged->tags[g].price[q] / merged->tags[g].tokens
                                           : t->prec[q].bits;
    return merged->n_tags;
}

/* The summary of a's choices over t's tags. */
static void summarize(const table *t, allocation *a) {
    double dist = 0, bits = 0;
    int64_t tokens = 0;
    for (int32_t i = 0; i < t->n_tags; i++) {
        dist += t->tags[i].distortion[a->choice[i]];
        bits += (double)t->tags[i].tokens * t->tags[i].price[a->choice[i]];
        tokens += t->tags[i].tokens;
    }
    a->summary.distortion = dist;
    a->summary.bits = tokens > 0 ? bits / (double)tokens : 0;
    a->summary.optimal = 0;
}

/* The tag-blind ablation of a: the same tokens at each precision (as near as whole tags come),
   dealt to the tags in a fixed pseudo-random order that ignores what they are, each taking the
   highest precision with room left for at least half of it. */
static void blind_choices(const table *t, allocation *a) {
    int64_t quota[N_PREC] = {0};
    int32_t order[N_TAGS];
    uint64_t rng = 0x9e3779b97f4a7c15u;
    for (int32_t i = 0; i < t->n_tags; i++) {
        quota[a->choice[i]] += t->tags[i].tokens;
        order[i] = i;
    }
    for (int32_t i = t->n_tags - 1; i > 0; i--) { /* Fisher-Yates, xorshift64 */
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        int32_t j = (int32_t)(rng % (uint64_t)(i + 1)), x = order[i];
        order[i] = order[j], order[j] = x;
    }
    for (int32_t k = 0; k < t->n_tags; k++) {
        /* the highest precision with room for at least half the tag, else the one with most */
        int64_t n = t->tags[order[k]].tokens;
        int q = N_PREC - 1, most = N_PREC - 1;
        while (q >= 0 && 2 * quota[q] < n) q--;
        for (int p = 0; p < N_PREC; p++)
            if (quota[p] > quota[most]) most = p;
        a->choice[order[k]] = q >= 0 ? q : most;
        quota[a->choice[order[k]]] -= n;
    }
    summarize(t, a);
}

/* allocate() under the options' ablation. */
static allocation allocate_ablated(const table *t, double budget, const options *o,
                                   bool two_level) {
    if (o->ablate == ABLATE_NONE) return allocate(t, budget, o, two_level);
    if (o->ablate == ABLATE_BLIND) {
        allocation a = allocate(t, budget, o, two_level);
        if (a.r == KVMIX_SUCCESS) blind_choices(t, &a);
        return a;
    }
    table merged;
    int32_t group_of[N_TAGS];
    merge_tags(t, o->ablate, &merged, group_of);
    allocation m = allocate(&merged, budget, o, two_level), a = m;
    if (m.r != KVMIX_SUCCESS) return m;
    for (int32_t i = 0; i < t->n_tags; i++) a.choice[i] = m.choice[group_of[i]];
    summarize(t, &a);
    a.summary.optimal = m.summary.optimal; /* optimal among the merged choices */
    return a;
}

static const char *method_name(kvmix_alloc_method m) {
    switch (m) {
    case KVMIX_ALLOC_EXHAUSTIVE: return "exhaustive";
    case KVMIX_ALLOC_GREEDY: return "greedy";
    case KVMIX_ALLOC_KNAPSACK: return "knapsack";
    default: return "auto";
    }
}

static cJSON *summary_json(const allocation *a) {
    if (a->r != KVMIX_SUCCESS) return cJSON_CreateNull();
    cJSON *o = cJSON_CreateObject();
    add_exact(o, "distortion", a->summary.distortion);
    add_exact(o, "bits", a->summary.bits);
    cJSON_AddStringToObject(o, "method", method_name(a->summary.method));
    return o;
}

enum { SWEEP_N = 13 }; /* B = 2.00, 2.25, ..., 5.00 */
static double sweep_budget(int i) { return 2.0 + 0.25 * i; }

static char *allocation_json(const table *t, const options *o, const allocation *a,
                             const allocation sweep[SWEEP_N][2]) {
    char *buf = NULL;
    size_t len = 0, cap = 0;
    cJSON *head = cJSON_CreateObject();
    cJSON_AddNumberToObject(head, "version", ALLOCATION_VERSION);
    cJSON_AddStringToObject(head, "kind", "kvmix-allocation");
    add_exact(head, "budget_bits", o->budget);
    cJSON_AddStringToObject(head, "method", method_name(a->summary.method));
    cJSON_AddStringToObject(head, "ablation", ABLATION_NAMES[o->ablate]);
    cJSON_AddStringToObject(head, "pricing", PRICING_NAMES[t->price]);
    cJSON_AddStringToObject(head, "instruction", o->instruction_each ? "each" : "once");
    if (o->two_level) {
        cJSON_AddStringToObject(head, "low", PRECISIONS[o->low].name);
        cJSON_AddStringToObject(head, "high", PRECISIONS[o->high].name);
    } else {
        cJSON_AddNumberToObject(head, "budget_steps", o->steps);
    }
    cJSON_AddBoolToObject(head, "optimal", a->summary.optimal != 0);
    add_exact(head, "distortion", a->summary.distortion);
    add_exact(head, "bits", a->summary.bits);
    char *text = cJSON_PrintUnformatted(head);
    cJSON_Delete(head);
    bool ok = text != NULL && append(&buf, &len, &cap, text);
    free(text);
    if (ok) buf[--len] = 0; /* drop the closing brace, the lists follow */
    ok = ok && append(&buf, &len, &cap, ",\n \"tags\": [");
    for (int32_t i = 0; ok && i < t->n_tags; i++) {
        const table_tag *tag = &t->tags[i];
        const precision *p = &t->prec[a->choice[i]];
        cJSON *item = cJSON_CreateObject();
        add_tag_fields(item, tag);
        cJSON_AddStringToObject(item, "precision", PRECISIONS[a->choice[i]].name);
        cJSON_AddStringToObject(item, "key_format", kvmix_format_name(p->key.format));
        cJSON_AddStringToObject(item, "value_format", kvmix_format_name(p->value.format));
        cJSON_AddNumberToObject(item, "key_group", p->key.group_size);
        cJSON_AddNumberToObject(item, "value_group", p->value.group_size);
        cJSON_AddNumberToObject(item, "n_boost", p->key.n_boost);
        cJSON_AddNumberToObject(item, "page_tokens", t->geo.page_tokens);
        add_exact(item, "distortion", tag->distortion[a->choice[i]]);
        add_exact(item, "bits", tag->price[a->choice[i]]);
        ok = append(&buf, &len, &cap, i ? ",\n  " : "\n  ") && append_json(&buf, &len, &cap, item);
    }
    ok = ok && append(&buf, &len, &cap, "],\n \"sweep\": [");
    for (int i = 0; ok && i < SWEEP_N; i++) {
        cJSON *item = cJSON_CreateObject();
        add_exact(item, "budget_bits", sweep_budget(i));
        cJSON_AddItemToObject(item, "two_level", summary_json(&sweep[i][0]));
        cJSON_AddItemToObject(item, "knapsack", summary_json(&sweep[i][1]));
        ok = append(&buf, &len, &cap, i ? ",\n  " : "\n  ") && append_json(&buf, &len, &cap, item);
    }
    ok = ok && append(&buf, &len, &cap, "]}\n");
    if (!ok) {
        free(buf);
        return NULL;
    }
    return buf;
}

static void print_summary(const table *t, const allocation *a, bool instruction_each) {
    int64_t total = 0;
    for (int32_t i = 0; i < t->n_tags; i++) total += t->tags[i].tokens;
    printf("calibration: %d captures, %d active tags, %lld tokens (instruction tags %s); priced "
           "by %s\n",
           t->n_captures, t->n_tags, (long long)total, instruction_each ? "in each" : "once",
           t->price == PRICE_RUNS ? "runs" : "full pages");
    printf("%-28s %8s", "tag", "tokens");
    for (int p = 0; p < N_PREC; p++) printf(" %10s", PRECISIONS[p].name);
    printf("  chosen\n%-28s %8s", "bits", "");
    for (int p = 0; p < N_PREC; p++) printf(" %10.4f", t->prec[p].bits);
    printf("\n");
    for (int32_t i = 0; i < t->n_tags; i++) {
        char name[96];
        tag_name(&t->tags[i], name, sizeof name);
        printf("%-28s %8lld", name, (long long)t->tags[i].tokens);
        for (int p = 0; p < N_PREC; p++) printf(" %10.3e", t->tags[i].distortion[p]);
        printf("  %s\n", PRECISIONS[a->choice[i]].name);
    }
}

static void print_sweep(const allocation sweep[SWEEP_N][2], const options *o) {
    printf("budget sweep (distortion = sum over tags of D; bits = realized mean bits)\n");
    printf("%6s  %-12s %12s %8s  %12s %8s\n", "B", "two-level", "distortion", "bits", "knapsack",
           "bits");
    for (int i = 0; i < SWEEP_N; i++) {
        printf("%6.2f  %-12s", sweep_budget(i),
               sweep[i][0].r == KVMIX_SUCCESS ? method_name(sweep[i][0].summary.method) : "-");
        for (int k = 0; k < 2; k++) {
            if (sweep[i][k].r == KVMIX_SUCCESS)
                printf(" %12.4e %8.4f", sweep[i][k].summary.distortion, sweep[i][k].summary.bits);
            else
                printf(" %12s %8s", "-", "-");
            if (k == 0) printf(" ");
        }
        printf("\n");
    }
    printf("two-level: %s/%s; knapsack: all five precisions, %d budget steps\n",
           PRECISIONS[o->low].name, PRECISIONS[o->high].name, o->steps);
}

/* ---- options and main ------------------------------------------------------------------------ */

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvmix-calibrate --captures DIR [--spec FILE] [--budget B] [--table OUT.json]\n"
            "                       [--allocation OUT.json] [--method knapsack|two-level]\n"
            "                       [--low P] [--high P] [--stride N] [--page-tokens N]\n"
            "                       [--key-group N] [--value-group N] [--boost N] [--steps N]\n"
            "                       [--sinks N] [--window N] [--threads N]\n"
            "                       [--ablate none|temporal|role|blind] [--stored-from A.json]\n"
            "                       [--price runs|pages] [--instruction once|each]\n"
            "       kvmix-calibrate --from-table TABLE.json [--budget B] [--table OUT.json]\n"
            "                       [--allocation OUT.json] [--method ...] [--low P] [--high P]\n"
            "                       [--steps N] [--ablate ...] [--price ...] [--instruction ...]\n"
            "precisions P: int2c, boosted, int4, int8, fp16\n");
}

static bool parse_int(const char *s, int64_t min, int64_t max, int32_t *out) {
    char *end;
    long long v = strtoll(s, &end, 10);
    if (*s == 0 || *end != 0 || v < min || v > max) return false;
    *out = (int32_t)v;
    return true;
}

static bool parse_precision(const char *s, int32_t *out) {
    for (int p = 0; p < N_PREC; p++)
        if (strcmp(s, PRECISIONS[p].name) == 0) {
            *out = p;
            return true;
        }
    return false;
}

static bool parse_options(int argc, char **argv, options *o) {
    *o = (options){.spec_path = "examples/specs/kvm-byte.json",
                   .budget = 3.0,
                   .low = 0,
                   .high = 2,
                   .steps = KVMIX_ALLOC_STEPS_DEFAULT,
                   .n_threads = 2};
    bool geometry_given = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v == NULL) {
            fprintf(stderr, "kvmix-calibrate: %s needs a value\n", a);
            return false;
        }
        i++;
        bool ok = true, geo = false;
        char *end;
        if (strcmp(a, "--captures") == 0)
            o->captures_dir = v;
        else if (strcmp(a, "--spec") == 0)
            o->spec_path = v;
        else if (strcmp(a, "--from-table") == 0)
            o->from_table = v;
        else if (strcmp(a, "--table") == 0)
            o->table_out = v;
        else if (strcmp(a, "--allocation") == 0)
            o->allocation_out = v;
        else if (strcmp(a, "--stored-from") == 0)
            ok = geo = (o->stored_from = v) != NULL;
        else if (strcmp(a, "--budget") == 0) {
            o->budget = strtod(v, &end);
            ok = *v != 0 && *end == 0 && o->budget > 0 && o->budget <= KVMIX_ALLOC_MAX_BITS;
        } else if (strcmp(a, "--method") == 0) {
            ok = strcmp(v, "knapsack") == 0 || strcmp(v, "two-level") == 0;
            o->two_level = strcmp(v, "two-level") == 0;
        } else if (strcmp(a, "--low") == 0)
            ok = parse_precision(v, &o->low);
        else if (strcmp(a, "--high") == 0)
            ok = parse_precision(v, &o->high);
        else if (strcmp(a, "--steps") == 0)
            ok = parse_int(v, 1, KVMIX_ALLOC_MAX_STEPS, &o->steps);
        else if (strcmp(a, "--ablate") == 0) {
            ok = false;
            for (int k = 0; k < 4; k++)
                if (strcmp(v, ABLATION_NAMES[k]) == 0) o->ablate = (ablation)k, ok = true;
        } else if (strcmp(a, "--threads") == 0)
            ok = parse_int(v, 1, 64, &o->n_threads);
        else if (strcmp(a, "--price") == 0) {
            ok = strcmp(v, "runs") == 0 || strcmp(v, "pages") == 0;
            o->price = strcmp(v, "runs") == 0 ? PRICE_RUNS : PRICE_PAGES;
        } else if (strcmp(a, "--instruction") == 0) {
            ok = strcmp(v, "once") == 0 || strcmp(v, "each") == 0;
            o->instruction_each = strcmp(v, "each") == 0;
        } else if (strcmp(a, "--stride") == 0)
            ok = geo = parse_int(v, 1, 1 << 20, &o->geo.query_stride);
        else if (strcmp(a, "--page-tokens") == 0)
            ok = geo = parse_int(v, 1, MAX_PAGE_TOKENS, &o->geo.page_tokens);
        else if (strcmp(a, "--key-group") == 0)
            ok = geo = parse_int(v, 8, KVMIX_MAX_HEAD_DIM, &o->geo.key_group);
        else if (strcmp(a, "--value-group") == 0)
            ok = geo = parse_int(v, 8, KVMIX_MAX_HEAD_DIM, &o->geo.value_group);
        else if (strcmp(a, "--boost") == 0)
            ok = geo = parse_int(v, 4, 252, &o->geo.n_boost);
        else if (strcmp(a, "--sinks") == 0)
            ok = geo = parse_int(v, 0, 1 << 20, &o->geo.sink_tokens);
        else if (strcmp(a, "--window") == 0)
            ok = geo = parse_int(v, 0, 1 << 26, &o->geo.window_tokens);
        else {
            fprintf(stderr, "kvmix-calibrate: unknown option %s\n", a);
            return false;
        }
        if (!ok) {
            fprintf(stderr, "kvmix-calibrate: bad value for %s: %s\n", a, v);
            return false;
        }
        geometry_given = geometry_given || geo;
    }
    if ((o->captures_dir == NULL) == (o->from_table == NULL)) {
        fprintf(stderr, "kvmix-calibrate: give exactly one of --captures and --from-table\n");
        return false;
    }
    if (o->from_table != NULL && geometry_given) {
        fprintf(stderr, "kvmix-calibrate: the geometry of --from-table is the table's own\n");
        return false;
    }
    if (o->low >= o->high) { /* PRECISIONS is cheapest first */
        fprintf(stderr, "kvmix-calibrate: --low must be a cheaper precision than --high\n");
        return false;
    }
    return true;
}

static bool write_text(const char *path, const char *text, char *err) {
    FILE *f = fopen(path, "wb");
    bool ok = f != NULL && fputs(text, f) >= 0;
    if (f != NULL && fclose(f) != 0) ok = false;
    if (!ok) snprintf(err, ERR_BYTES, "cannot write %s", path);
    return ok;
}

static int run(const options *o) {
    table t;
    char err[ERR_BYTES] = "";
    memset(&t, 0, sizeof t);
    bool ok;
    if (o->from_table != NULL) {
        size_t n = 0;
        char *text = llama_read_text(o->from_table, &n);
        char why[ERR_BYTES - 64];
        ok = text != NULL && table_parse(text, n, &t, why);
        if (text == NULL)
            snprintf(err, ERR_BYTES, "cannot read %s", o->from_table);
        else if (!ok)
            snprintf(err, ERR_BYTES, "%s: %s", o->from_table, why);
        free(text);
    } else {
        ok = table_from_captures(o, &t, err);
    }
    if (ok && o->table_out != NULL) {
        char *text = table_json(&t);
        ok = text != NULL && write_text(o->table_out, text, err);
        if (text == NULL) snprintf(err, ERR_BYTES, "out of memory");
        free(text);
    }
    if (ok && o->instruction_each) count_instruction_each(&t);
    if (ok) ok = price_tags(&t, o->price, err);
    allocation a, sweep[SWEEP_N][2];
    if (ok) {
        a = allocate_ablated(&t, o->budget, o, o->two_level);
        if (a.r != KVMIX_SUCCESS) {
            snprintf(err, ERR_BYTES, "allocation at budget %g bits: %s%s", o->budget,
                     kvmix_result_string(a.r),
                     a.r == KVMIX_ERR_OUT_OF_MEMORY ? " (the budget is below the cheapest choice)"
                                                    : "");
            ok = false;
        }
    }
    if (ok) {
        for (int i = 0; i < SWEEP_N; i++)
            for (int k = 0; k < 2; k++)
                sweep[i][k] = allocate_ablated(&t, sweep_budget(i), o, k == 0);
        print_summary(&t, &a, o->instruction_each);
        print_sweep((const allocation(*)[2])sweep, o);
    }
    if (ok && o->allocation_out != NULL) {
        char *text = allocation_json(&t, o, &a, (const allocation(*)[2])sweep);
        ok = text != NULL && write_text(o->allocation_out, text, err);
        if (text == NULL) snprintf(err, ERR_BYTES, "out of memory");
        free(text);
    }
    if (!ok) fprintf(stderr, "kvmix-calibrate: %s\n", err);
    table_free(&t);
    return ok ? 0 : 1;
}

int main(int argc, char **argv) {
    options o;
    if (argc == 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        usage(stdout);
        return 0;
    }
    if (!parse_options(argc, argv, &o)) {
        usage(stderr);
        return 2;
    }
    return run(&o);
}
