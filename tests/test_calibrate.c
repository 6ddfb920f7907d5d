/* Calibration on real captures: build/kvmix-eval --capture, then build/kvmix-calibrate (the
 * sanitized build, kvmix-calibrate-san) on two short texts made of the first three agent traces
 * of SHARED/data/eval-dev.jsonl (write_short_traces: about 1000 tokens each, two user turns),
 * with kvm-small.
 *   - kvmix-eval --capture DIR writes one capture-NNNN.bin per text and nothing else; --offset 1
 *     --limit 1 captures the second text alone, as capture-0000.bin of the same length.
 *   - The table: the five precisions' bits equal kvmix_layout_bits at the table's geometry; per
 *     capture the tags' counts partition its tokens (the file header's n_tokens); a tag's tokens
 *     are the sum over captures, except instruction tags: the median of the captures where they
 *     have tokens; n_captures counts those; names are bucket/role/modality and unique.
 *   - Distortion, for every tag: int8 < int4 < int2c strictly, fp16 <= 5e-2 * int8 and
 *     fp16 <= 1e-5 * int2c (FP16 rounding is ~0 next to the others); boosted < int2c for at least
 *     three quarters of the tags.
 *   - The allocation: realized bits (recomputed from its tags' bits and tokens) <= the budget and
 *     equal to the reported bits; distortion = the sum of its tags' table distortions at their
 *     precisions; every sweep entry within its budget, infeasible (null) exactly when the budget
 *     is below the cheapest precision; two-level exhaustive distortion non-increasing in B.
 *   - kvmix-eval --tag-spec --allocation runs on the allocation written (tag_allocation.c reads it).
 *   - Round trip: --from-table TABLE --table OUT writes TABLE's bytes, and the same allocation;
 *     --threads 1 gives the same table as --threads 2 (at --stride 64, for time; the main run
 *     uses --stride 16).
 *   - Bad input: missing or empty capture directory, truncated or foreign captures, captures of
 *     two shapes, a head_dim the formats do not take, missing or malformed spec, bad options,
 *     an infeasible budget, malformed tables, an unwritable output: exit status 1 or 2 with a
 *     "kvmix-calibrate:" message and no sanitizer report. A tiny hand-made capture (1 layer,
 *     head_dim 32, 3 tokens) calibrates.
 * Usage: test_calibrate SHARED_DIR (from the repository root). Prints "N passed, N failed". */
#define _POSIX_C_SOURCE 200809L
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>

#ifndef BUILD_DIR
#define BUILD_DIR "build"
#endif
#define TMP   BUILD_DIR "/.test-calib"
#define TOOL  BUILD_DIR "/kvmix-calibrate-san"
#define SPEC  "examples/specs/kvm-byte.json"
#define QUIET "ASAN_OPTIONS=exitcode=86 UBSAN_OPTIONS=exitcode=86 "

#include "model_check.h"

static bool write_bytes(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    if (f == NULL) return false;
    bool ok = fwrite(bytes, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

/* Runs cmd (stderr joined to stdout); returns the exit status, output in *out (malloc'd). */
static int run(const char *cmd, char **out) {
    char full[4096];
    snprintf(full, sizeof full, "%s 2>&1", cmd);
    return run_command_exit(full, out);
}

static cJSON *load_json(const char *path) {
    size_t n = 0;
    char *text = read_file(path, &n);
    const char *end = NULL;
    cJSON *root = text != NULL ? cJSON_ParseWithLengthOpts(text, n, &end, 0) : NULL;
    free(text);
    return root;
}

static int64_t header_tokens(const char *path) {
    size_t n = 0;
    unsigned char *b = (unsigned char *)read_file(path, &n);
    int64_t tokens = -1;
    if (b != NULL && n >= 32)
        tokens = (int64_t)b[28] | (int64_t)b[29] << 8 | (int64_t)b[30] << 16 | (int64_t)b[31] << 24;
    free(b);
    return tokens;
}

/* Entries of a directory other than . and .. */
static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    if (d == NULL) return -1;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) n++;
    closedir(d);
    return n;
}

static double num(const cJSON *o, const char *name) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsNumber(f) ? f->valuedouble : NAN;
}

static const char *str(const cJSON *o, const char *name) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsString(f) ? f->valuestring : "";
}

static bool same_files(const char *a, const char *b) {
    size_t na = 0, nb = 0;
    char *x = read_file(a, &na), *y = read_file(b, &nb);
    bool same = x != NULL && y != NULL && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return same;
}

/* ---- data: two short traces made of the first three ---------------------------------------- */

/* Appends the message at msg (from "<|im_start|>" up to its "<|im_end|>\n") to out, its body cut
 * to 120 bytes at a UTF-8 boundary and any bracket the cut leaves open closed again. Returns the
 * position after the message, or NULL when there is none. */
static const char *take_message(const char *msg, char *out, size_t out_bytes) {
    static const char *const OPEN[3] = {"<think>", "<tool_call>", "<tool_response>"};
    static const char *const CLOSE[3] = {"</think>", "</tool_call>", "</tool_response>"};
    const char *end = msg != NULL ? strstr(msg, "<|im_end|>\n") : NULL;
    const char *body = msg != NULL ? strchr(msg, '\n') : NULL;
    if (end == NULL || body == NULL || body > end) return NULL;
    size_t head = (size_t)(body + 1 - msg), len = (size_t)(end - body - 1);
    if (len > 120) len = 120;
    while (len > 0 && ((unsigned char)body[1 + len] & 0xC0) == 0x80) len--;
    char part[512];
    snprintf(part, sizeof part, "%.*s%.*s", (int)head, msg, (int)len, body + 1);
    strncat(out, part, out_bytes - strlen(out) - 1);
    bool system = strncmp(msg, "<|im_start|>system", 18) == 0; /* brackets there are text */
    for (int b = 0; !system && b < 3; b++) {
        int opens = 0, closes = 0;
        for (const char *at = part; (at = strstr(at, OPEN[b])) != NULL; at++) opens++;
        for (const char *at = part; (at = strstr(at, CLOSE[b])) != NULL; at++) closes++;
        if (opens > closes) {
            strncat(out, "\n", out_bytes - strlen(out) - 1);
            strncat(out, CLOSE[b], out_bytes - strlen(out) - 1);
        }
    }
    strncat(out, "<|im_end|>\n", out_bytes - strlen(out) - 1);
    return end + strlen("<|im_end|>\n");
}

/* Text k: trace k's system prompt and first four messages after it, then trace k+1's first three
 * messages after its system prompt (a second user turn), each body cut to 120 bytes: about 1000
 * tokens with instruction, user, reasoning, tool call, observation and two turns. */
static bool write_short_traces(const char *shared, const char *out_path) {
    char path[1024];
    snprintf(path, sizeof path, "%s/data/eval-dev.jsonl", shared);
    size_t n = 0;
    char *data = read_file(path, &n), *traces[3] = {NULL, NULL, NULL};
    cJSON *roots[3] = {NULL, NULL, NULL};
    int taken = 0;
    for (char *line = data; data != NULL && taken < 3 && line < data + n;) {
        char *nl = memchr(line, '\n', (size_t)(data + n - line));
        size_t len = nl != NULL ? (size_t)(nl - line) : (size_t)(data + n - line);
        const char *end = NULL;
        cJSON *root = cJSON_ParseWithLengthOpts(line, len, &end, 0);
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(root, "kind");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text");
        if (cJSON_IsString(kind) && strcmp(kind->valuestring, "trace") == 0 &&
            cJSON_IsString(text)) {
            traces[taken] = text->valuestring;
            roots[taken++] = root;
        } else {
            cJSON_Delete(root);
        }
        line += len + 1;
    }
    FILE *out = fopen(out_path, "wb");
    bool ok = out != NULL && taken == 3;
    for (int k = 0; ok && k < 2; k++) {
        static char text[8192];
        text[0] = 0;
        const char *at = strstr(traces[k], "<|im_start|>");
        for (int m = 0; m < 5 && at != NULL; m++) at = take_message(at, text, sizeof text);
        at = strstr(traces[k + 1], "<|im_start|>user");
        for (int m = 0; m < 3 && at != NULL; m++) at = take_message(at, text, sizeof text);
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "kind", "trace");
        cJSON_AddStringToObject(o, "text", text);
        char *s = cJSON_PrintUnformatted(o);
        ok = s != NULL && at != NULL && fprintf(out, "%s\n", s) > 0;
        free(s);
        cJSON_Delete(o);
    }
    if (out != NULL && fclose(out) != 0) ok = false;
    for (int k = 0; k < 3; k++) cJSON_Delete(roots[k]);
    free(data);
    return ok;
}

/* ---- the table -------------------------------------------------------------------------------- */
/* A tag's prices at the five precisions, recomputed from its "pages" as the header defines them:
   the mean over its pages of kvmix_cache_page_bits for their rows, in a cache of the table's
   geometry and model shape (a full page's when it has none). false when that cache refuses. */
static bool run_prices(const cJSON *t, const cJSON *tag, double out[5]) {
    static const kvmix_format KEYS[5] = {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED,
                                         KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT8, KVMIX_FORMAT_FP16};
    static const kvmix_format VALUES[5] = {KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT4,
                                           KVMIX_FORMAT_INT8, KVMIX_FORMAT_FP16};
    const cJSON *geo = cJSON_GetObjectItemCaseSensitive(t, "geometry");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(t, "model"), *pair;
    kvmix_cache_desc d;
    kvmix_cache c;
    memset(&d, 0, sizeof d);
    d.n_layers = (int32_t)num(model, "n_layers");
    d.n_kv_heads = (int32_t)num(model, "n_kv_heads");
    d.head_dim = (int32_t)num(model, "head_dim");
    d.page_tokens = (int32_t)num(geo, "page_tokens");
    d.group_size = (int32_t)num(geo, "key_group");
    d.value_group_size = (int32_t)num(geo, "value_group");
    d.n_boost = (int32_t)num(geo, "n_boost");
    d.max_seqs = 1;
    d.arena_bytes = 1 << 22;
    if (kvmix_cache_init_allocator(&c, &d, NULL, NULL) != KVMIX_SUCCESS) return false;
    bool ok = true;
    for (int p = 0; p < 5; p++) {
        kvmix_cache_precision want = {(uint8_t)KEYS[p], (uint8_t)VALUES[p]};
        double bits = 0, rows = 0, at = 0;
        cJSON_ArrayForEach(pair, cJSON_GetObjectItemCaseSensitive(tag, "pages")) {
            int32_t r = (int32_t)cJSON_GetArrayItem(pair, 0)->valuedouble;
            double n = cJSON_GetArrayItem(pair, 1)->valuedouble;
            ok = ok && kvmix_cache_page_bits(&c, want, r, &at) == KVMIX_SUCCESS;
            bits += n * r * at;
            rows += n * r;
        }
        ok = ok && kvmix_cache_page_bits(&c, want, d.page_tokens, &at) == KVMIX_SUCCESS;
        out[p] = rows > 0 ? bits / rows : at;
    }
    kvmix_cache_deinit(&c);
    return ok;
}

static int compare_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void check_table(const cJSON *t, const char *caps_dir) {
    const cJSON *geo = cJSON_GetObjectItemCaseSensitive(t, "geometry");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(t, "model");
    const cJSON *precs = cJSON_GetObjectItemCaseSensitive(t, "precisions");
    const cJSON *caps = cJSON_GetObjectItemCaseSensitive(t, "captures");
    const cJSON *tags = cJSON_GetObjectItemCaseSensitive(t, "tags");
    CHECK(num(t, "version") == 1 && strcmp(str(t, "kind"), "kvmix-calibration-table") == 0);
    CHECK(num(model, "head_dim") == 64 && num(model, "n_layers") == 4);
    CHECK(cJSON_GetArraySize(precs) == 5 && cJSON_GetArraySize(caps) == 2);
    if (n_failed > 0 || cJSON_GetArraySize(tags) < 1) return;
    /* bits: kvmix_layout_bits at the geometry */
    static const char *const NAMES[5] = {"int2c", "boosted", "int4", "int8", "fp16"};
    static const kvmix_format KEYS[5] = {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED,
                                         KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT8, KVMIX_FORMAT_FP16};
    static const kvmix_format VALUES[5] = {KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT4,
                                           KVMIX_FORMAT_INT8, KVMIX_FORMAT_FP16};
    int32_t page = (int32_t)num(geo, "page_tokens");
    CHECK(page == 128 && num(geo, "value_group") == 64 && num(geo, "n_boost") == 8);
    for (int p = 0; p < 5; p++) {
        const cJSON *prec = cJSON_GetArrayItem(precs, p);
        kvmix_layout k = {KEYS[p], page, 64, 0, 0}, v = {VALUES[p], page, 64, 0, 0};
        if (p >= 2 && p <= 3) k.group_size = 32;
        if (p == 1) k.n_boost = 8;
        if (p <= 3) v.group_size = 64;
        double kb = 0, vb = 0;
        CHECK(kvmix_layout_bits(&k, &kb) == KVMIX_SUCCESS);
        CHECK(kvmix_layout_bits(&v, &vb) == KVMIX_SUCCESS);
        CHECK_MSG(strcmp(str(prec, "name"), NAMES[p]) == 0 && num(prec, "key_bits") == kb &&
                      num(prec, "value_bits") == vb && num(prec, "bits") == (kb + vb) / 2,
                  "a precision's bits are kvmix_layout_bits at the geometry");
    }
    /* token counts */
    int64_t header[2], sum[2] = {0, 0};
    for (int c = 0; c < 2; c++) {
        char path[1024];
        const cJSON *cap = cJSON_GetArrayItem(caps, c);
        snprintf(path, sizeof path, "%s/%s", caps_dir, str(cap, "file"));
        header[c] = header_tokens(path);
        CHECK(header[c] > 100 && num(cap, "n_tokens") == (double)header[c]);
    }
    int n_tags = cJSON_GetArraySize(tags), boosted_better = 0, bad_order = 0, bad_fp16 = 0;
    int bad_counts = 0, bad_names = 0, bad_pages = 0;
    const cJSON *tag;
    cJSON_ArrayForEach(tag, tags) {
        const cJSON *per = cJSON_GetObjectItemCaseSensitive(tag, "tokens_per_capture");
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(tag, "distortion");
        int64_t counts[2], nonzero[2], total = 0;
        int active = 0;
        for (int c = 0; c < 2; c++) {
            counts[c] = (int64_t)cJSON_GetArrayItem(per, c)->valuedouble;
            sum[c] += counts[c];
            total += counts[c];
            if (counts[c] > 0) nonzero[active++] = counts[c];
        }
        qsort(nonzero, (size_t)active, sizeof nonzero[0], compare_i64);
        int64_t median = active == 1 ? nonzero[0] : (nonzero[0] + nonzero[1] + 1) / 2;
        bool instruction = strcmp(str(tag, "role"), "instruction") == 0;
        if (active < 1 || num(tag, "n_captures") != active ||
            num(tag, "tokens") != (double)(instruction ? median : total))
            bad_counts++;
        /* no sinks, no window: the runs' pages hold every token of every capture */
        double rows = 0, last_rows = 0;
        const cJSON *pair;
        cJSON_ArrayForEach(pair, cJSON_GetObjectItemCaseSensitive(tag, "pages")) {
            double r = cJSON_GetArrayItem(pair, 0)->valuedouble;
            if (!(r > last_rows && r <= page && cJSON_GetArrayItem(pair, 1)->valuedouble > 0))
                bad_pages++;
            rows += r * cJSON_GetArrayItem(pair, 1)->valuedouble;
            last_rows = r;
        }
        if (rows != (double)total) bad_pages++;
        char name[128];
        snprintf(name, sizeof name, "%s/%s/%s", str(tag, "bucket"), str(tag, "role"),
                 str(tag, "modality"));
        if (strcmp(name, str(tag, "name")) != 0) bad_names++;
        for (const cJSON *other = tag->next; other != NULL; other = other->next)
            if (strcmp(str(other, "name"), str(tag, "name")) == 0) bad_names++;
        double v[5];
        for (int p = 0; p < 5; p++) v[p] = cJSON_GetArrayItem(d, p)->valuedouble;
        if (!(v[3] < v[2] && v[2] < v[0])) bad_order++;
        if (!(v[4] <= 5e-2 * v[3] && v[4] <= 1e-5 * v[0])) bad_fp16++;
        if (v[1] < v[0]) boosted_better++;
    }
    CHECK_MSG(bad_counts == 0, "tag token counts: sums, instruction medians, n_captures");
    CHECK_MSG(bad_names == 0, "tag names are bucket/role/modality and unique");
    CHECK_MSG(bad_pages == 0, "a tag's pages: rows increasing, in 1..page, holding its tokens");
    CHECK_MSG(sum[0] == header[0] && sum[1] == header[1],
              "per capture, the tags' counts partition its tokens");
    CHECK_MSG(bad_order == 0, "int8 < int4 < int2c for every tag");
    CHECK_MSG(bad_fp16 == 0, "fp16 <= 5e-2 int8 and <= 1e-5 int2c for every tag");
    CHECK_MSG(4 * boosted_better >= 3 * n_tags, "boosted < int2c for 3/4 of the tags");
    printf("table: %d tags, captures of %lld and %lld tokens\n", n_tags, (long long)header[0],
           (long long)header[1]);
}

static void check_allocation(const cJSON *a, const cJSON *t) {
    const cJSON *tags = cJSON_GetObjectItemCaseSensitive(a, "tags");
    const cJSON *ttags = cJSON_GetObjectItemCaseSensitive(t, "tags");
    const cJSON *precs = cJSON_GetObjectItemCaseSensitive(t, "precisions");
    const cJSON *sweep = cJSON_GetObjectItemCaseSensitive(a, "sweep");
    CHECK(num(a, "version") == 1 && strcmp(str(a, "kind"), "kvmix-allocation") == 0);
    CHECK(num(a, "budget_bits") == 3.0 && strcmp(str(a, "method"), "knapsack") == 0);
    CHECK(cJSON_GetArraySize(tags) == cJSON_GetArraySize(ttags));
    double cost = 0, tokens = 0, dist = 0, cheapest = 0, prices[5];
    int bad = 0, dearer = 0;
    CHECK(strcmp(str(a, "pricing"), "runs") == 0 && strcmp(str(a, "instruction"), "once") == 0);
    for (int i = 0; i < cJSON_GetArraySize(tags) && i < cJSON_GetArraySize(ttags); i++) {
        const cJSON *tag = cJSON_GetArrayItem(tags, i), *tt = cJSON_GetArrayItem(ttags, i);
        int p = 0;
        while (p < 5 && strcmp(str(cJSON_GetArrayItem(precs, p), "name"), str(tag, "precision")))
            p++;
        if (!run_prices(t, tt, prices)) bad++;
        double least = prices[0];
        for (int q = 0; q < 5; q++) {
            least = prices[q] < least ? prices[q] : least;
            dearer += prices[q] > num(cJSON_GetArrayItem(precs, q), "bits");
        }
        cheapest += num(tt, "tokens") * least;
        if (p == 5 || strcmp(str(tag, "name"), str(tt, "name")) != 0 ||
            num(tag, "tokens") != num(tt, "tokens") ||
            fabs(num(tag, "bits") - prices[p]) > 1e-12 * prices[p] ||
            num(tag, "distortion") !=
                cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(tt, "distortion"), p)
                    ->valuedouble ||
            strcmp(str(tag, "key_format"), str(cJSON_GetArrayItem(precs, p), "key_format")) != 0) {
            bad++;
            continue;
        }
        cost += num(tag, "tokens") * num(tag, "bits");
        tokens += num(tag, "tokens");
        dist += num(tag, "distortion");
    }
    CHECK_MSG(bad == 0, "each tag's precision and distortion are the table's, its bits its runs'");
    CHECK_MSG(dearer > 0, "short runs price some tag above a full page");
    CHECK_MSG(cost <= 3.0 * tokens, "the allocation holds the budget");
    CHECK(fabs(cost / tokens - num(a, "bits")) <= 1e-12 * num(a, "bits"));
    CHECK(fabs(dist - num(a, "distortion")) <= 1e-12 * dist);
    CHECK(cJSON_GetArraySize(sweep) == 13);
    double last = INFINITY;
    int bad_sweep = 0;
    cheapest /= tokens;
    const cJSON *e;
    cJSON_ArrayForEach(e, sweep) {
        double b = num(e, "budget_bits");
        const cJSON *k = cJSON_GetObjectItemCaseSensitive(e, "knapsack");
        const cJSON *two = cJSON_GetObjectItemCaseSensitive(e, "two_level");
        if (cJSON_IsNull(k) != (b < cheapest) || cJSON_IsNull(two) != (b < cheapest)) bad_sweep++;
        if (cJSON_IsNull(k)) continue;
        if (!(num(k, "bits") <= b * (1 + 1e-12) && num(two, "bits") <= b * (1 + 1e-12)))
            bad_sweep++;
        if (strcmp(str(two, "method"), "exhaustive") == 0) {
            if (num(two, "distortion") > last) bad_sweep++;
            last = num(two, "distortion");
        }
    }
    CHECK_MSG(bad_sweep == 0, "sweep: within budget, null when infeasible, exhaustive monotone");
}

/* The ablations of the allocation at budget 3 against the full one (alloc.json): "temporal" and
   "role" give every tag of a group one precision within the budget, "blind" keeps the full one's
   tokens at each precision to within a tag. */
static int precision_of(const cJSON *tag) {
    static const char *const names[] = {"int2c", "boosted", "int4", "int8", "fp16"};
    for (int p = 0; p < 5; p++)
        if (strcmp(str(tag, "precision"), names[p]) == 0) return p;
    return -1;
}

static void check_ablations(void) {
    static const char *const kinds[] = {"temporal", "role", "blind"};
    cJSON *full = load_json(TMP "/alloc.json");
    const cJSON *ftags = cJSON_GetObjectItemCaseSensitive(full, "tags");
    double full_mix[5] = {0}, largest = 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, ftags) {
        if (precision_of(x) >= 0) full_mix[precision_of(x)] += num(x, "tokens");
        if (num(x, "tokens") > largest) largest = num(x, "tokens");
    }
    for (int k = 0; k < 3 && full != NULL; k++) {
        char cmd[512];
        snprintf(cmd, sizeof cmd,
                 QUIET TOOL " --from-table " TMP
                            "/table.json --budget 3 --ablate %s --allocation " TMP "/alloc-%s.json",
                 kinds[k], kinds[k]);
        if (!CHECK_MSG(run(cmd, NULL) == 0, "kvmix-calibrate --ablate runs")) continue;
        snprintf(cmd, sizeof cmd, TMP "/alloc-%s.json", kinds[k]);
        cJSON *a = load_json(cmd);
        const cJSON *tags = cJSON_GetObjectItemCaseSensitive(a, "tags"), *t, *u;
        double mix[5] = {0};
        int split = 0;
        CHECK(a != NULL && strcmp(str(a, "ablation"), kinds[k]) == 0);
        cJSON_ArrayForEach(t, tags) {
            if (precision_of(t) >= 0) mix[precision_of(t)] += num(t, "tokens");
            cJSON_ArrayForEach(u, tags) {
                bool grouped = strcmp(str(t, "modality"), str(u, "modality")) == 0 &&
                               strcmp(str(t, k == 0 ? "role" : "bucket"),
                                      str(u, k == 0 ? "role" : "bucket")) == 0;
                if (k < 2 && grouped && precision_of(t) != precision_of(u)) split++;
            }
        }
        if (k < 2) {
            CHECK_MSG(split == 0, "--ablate temporal / role: one precision per group");
            CHECK_MSG(num(a, "bits") <= 3.0 * (1 + 1e-12), "--ablate temporal / role: in budget");
        } else {
            int off = 0;
            for (int p = 0; p < 5; p++) off += fabs(mix[p] - full_mix[p]) > largest;
            CHECK_MSG(off == 0, "--ablate blind: the full allocation's mix, to within a tag");
        }
        cJSON_Delete(a);
    }
    cJSON_Delete(full);
}

static void expect_failure(const char *args, int status, const char *needle);

/* --price and --instruction: full-page prices are the precisions' bits; instruction tags counted
   in each capture sum them; a table without "pages" (an older tool's) prices by full pages and
   refuses --price runs, and one with "pages" on some tags only is refused. */
static void check_pricing(void) {
    cJSON *t = load_json(TMP "/table.json"), *a = NULL, *tag;
    const cJSON *x;
    int bad = 0, instruction = 0;
    if (!CHECK(t != NULL)) return;
    const cJSON *precs = cJSON_GetObjectItemCaseSensitive(t, "precisions");
    CHECK(run(QUIET TOOL " --from-table " TMP "/table.json --price pages --instruction each "
                         "--allocation " TMP "/alloc-pages.json",
              NULL) == 0);
    if (!CHECK((a = load_json(TMP "/alloc-pages.json")) != NULL)) goto done;
    CHECK(strcmp(str(a, "pricing"), "pages") == 0 && strcmp(str(a, "instruction"), "each") == 0);
    int i = 0;
    cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(a, "tags")) {
        const cJSON *tt = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(t, "tags"), i++);
        double sum = 0;
        const cJSON *c;
        cJSON_ArrayForEach(c, cJSON_GetObjectItemCaseSensitive(tt, "tokens_per_capture")) sum +=
            c->valuedouble;
        if (num(x, "bits") != num(cJSON_GetArrayItem(precs, precision_of(x)), "bits")) bad++;
        if (num(x, "tokens") != sum) bad++;
        instruction += strcmp(str(x, "role"), "instruction") == 0;
    }
    CHECK_MSG(bad == 0 && instruction > 0,
              "--price pages: a precision's bits; --instruction each: tokens of every capture");
    /* the same table without its page counts */
    cJSON_ArrayForEach(tag, cJSON_GetObjectItemCaseSensitive(t, "tags")) {
        cJSON_DeleteItemFromObjectCaseSensitive(tag, "pages");
    }
    char *text = cJSON_Print(t);
    CHECK(text != NULL && write_bytes(TMP "/no-pages.json", text, strlen(text)));
    free(text);
    CHECK(run(QUIET TOOL " --from-table " TMP "/no-pages.json --allocation " TMP "/alloc-old.json",
              NULL) == 0);
    cJSON_Delete(a);
    a = load_json(TMP "/alloc-old.json");
    CHECK_MSG(a != NULL && strcmp(str(a, "pricing"), "pages") == 0,
              "a table without pages prices by full pages");
    expect_failure("--from-table " TMP "/no-pages.json --price runs", 1, "counts no pages");
    cJSON_AddItemToObject(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(t, "tags"), 0),
                          "pages", cJSON_CreateArray());
    text = cJSON_Print(t);
    CHECK(text != NULL && write_bytes(TMP "/some-pages.json", text, strlen(text)));
    free(text);
    expect_failure("--from-table " TMP "/some-pages.json", 1, "all or none");
    cJSON_Delete(t);
    if ((t = load_json(TMP "/table.json")) == NULL) goto done;
    cJSON_ReplaceItemInObjectCaseSensitive(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(t, "tags"), 0), "pages",
        cJSON_Parse("[[129, 1]]"));
    text = cJSON_Print(t);
    CHECK(text != NULL && write_bytes(TMP "/bad-pages.json", text, strlen(text)));
    free(text);
    expect_failure("--from-table " TMP "/bad-pages.json", 1, "rows 1..128 once each");
done:
    cJSON_Delete(t);
    cJSON_Delete(a);
}

/* --stored-from the allocation: current-bucket tags measure as before; an aged tag measures the
   same at every precision at or above what its role held in the current bucket (a demotion
   never raises a token); the table records the source and reads back to the same bytes. */
static void check_stored_from(const char *caps_dir) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             QUIET TOOL " --captures %s --stride 64 --threads 2 --stored-from " TMP
                        "/alloc.json --table " TMP "/stored.json",
             caps_dir);
    if (!CHECK_MSG(run(cmd, NULL) == 0, "kvmix-calibrate --stored-from runs")) return;
    CHECK(run(QUIET TOOL " --from-table " TMP "/stored.json --table " TMP "/stored2.json", NULL) ==
          0);
    CHECK_MSG(same_files(TMP "/stored.json", TMP "/stored2.json"), "stored table round trip");
    cJSON *s = load_json(TMP "/stored.json"), *plain = load_json(TMP "/table4.json"),
          *a = load_json(TMP "/alloc.json");
    if (!CHECK(s != NULL && plain != NULL && a != NULL)) goto done;
    CHECK(strcmp(str(cJSON_GetObjectItemCaseSensitive(s, "geometry"), "stored_from"),
                 TMP "/alloc.json") == 0);
    const cJSON *tags = cJSON_GetObjectItemCaseSensitive(s, "tags"), *t;
    const cJSON *ptags = cJSON_GetObjectItemCaseSensitive(plain, "tags");
    int bad_current = 0, bad_aged = 0, aged = 0, i = 0;
    cJSON_ArrayForEach(t, tags) {
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(t, "distortion");
        const cJSON *pd =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(ptags, i++), "distortion");
        if (strcmp(str(t, "bucket"), "current") == 0) {
            for (int p = 0; p < 5; p++)
                bad_current +=
                    cJSON_GetArrayItem(d, p)->valuedouble != cJSON_GetArrayItem(pd, p)->valuedouble;
            continue;
        }
        int held = 4; /* fp16: what an unlisted current tag keeps */
        const cJSON *x;
        cJSON_ArrayForEach(x, cJSON_GetObjectItemCaseSensitive(a, "tags")) {
            if (strcmp(str(x, "bucket"), "current") == 0 &&
                strcmp(str(x, "role"), str(t, "role")) == 0 &&
                strcmp(str(x, "modality"), str(t, "modality")) == 0)
                held = precision_of(x);
        }
        aged++;
        for (int p = held + 1; p < 5; p++)
            bad_aged +=
                cJSON_GetArrayItem(d, p)->valuedouble != cJSON_GetArrayItem(d, held)->valuedouble;
    }
    CHECK_MSG(bad_current == 0, "--stored-from: current-bucket tags as without it");
    CHECK_MSG(aged > 0 && bad_aged == 0, "--stored-from: no aged token rises above what it held");
done:
    cJSON_Delete(s);
    cJSON_Delete(plain);
    cJSON_Delete(a);
}

/* --sinks / --window: positions the cache holds FP16 are measured at full precision. A window
 * longer than the captures leaves no error anywhere; 16 sinks and a window of 32 lower the summed
 * error of every quantized precision, and the table records both. */
static void check_window(const char *caps_dir) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             QUIET TOOL " --captures %s --stride 64 --threads 2 --window 100000 --table " TMP
                        "/window.json",
             caps_dir);
    CHECK_MSG(run(cmd, NULL) == 0, "kvmix-calibrate --window runs");
    snprintf(cmd, sizeof cmd,
             QUIET TOOL " --captures %s --stride 64 --threads 2 --sinks 16 --window 32 --table " TMP
                        "/sinks.json",
             caps_dir);
    CHECK_MSG(run(cmd, NULL) == 0, "kvmix-calibrate --sinks --window runs");
    CHECK(run(QUIET TOOL " --from-table " TMP "/sinks.json --table " TMP "/sinks2.json", NULL) ==
          0);
    CHECK_MSG(same_files(TMP "/sinks.json", TMP "/sinks2.json"), "sinks and window round trip");
    cJSON *all = load_json(TMP "/window.json"), *some = load_json(TMP "/sinks.json"),
          *none = load_json(TMP "/table4.json");
    if (!CHECK(all != NULL && some != NULL && none != NULL)) goto done;
    const cJSON *geo = cJSON_GetObjectItemCaseSensitive(some, "geometry");
    CHECK(num(geo, "sink_tokens") == 16 && num(geo, "window_tokens") == 32);
    CHECK(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(none, "geometry"),
                                           "window_tokens") == NULL);
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(all, "tags"), *t;
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(some, "tags");
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(none, "tags");
    int i = 0, nonzero = 0;
    double with[4] = {0}, without[4] = {0};
    cJSON_ArrayForEach(t, a) {
        const cJSON *da = cJSON_GetObjectItemCaseSensitive(t, "distortion");
        const cJSON *db = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(b, i), "distortion");
        const cJSON *dc = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(c, i), "distortion");
        i++;
        for (int p = 0; p < 4; p++) { /* fp16's own error is rounding alone */
            nonzero += cJSON_GetArrayItem(da, p)->valuedouble > 1e-20;
            with[p] += cJSON_GetArrayItem(db, p)->valuedouble;
            without[p] += cJSON_GetArrayItem(dc, p)->valuedouble;
        }
    }
    CHECK_MSG(i > 0 && nonzero == 0, "--window past every query: no error left");
    for (int p = 0; p < 4; p++)
        CHECK_MSG(with[p] < without[p], "--sinks 16 --window 32: less error at every precision");
done:
    cJSON_Delete(all);
    cJSON_Delete(some);
    cJSON_Delete(none);
}

/* ---- bad input -------------------------------------------------------------------------------- */
static void expect_failure(const char *args, int status, const char *needle) {
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, QUIET TOOL " %s", args);
    int rc = run(cmd, &out);
    bool ok = rc == status && out != NULL && strstr(out, "kvmix-calibrate:") != NULL &&
              strstr(out, needle) != NULL && strstr(out, "Sanitizer") == NULL &&
              strstr(out, "runtime error") == NULL;
    if (!CHECK_MSG(ok, args))
        printf("  status %d (want %d, message with \"%s\"): %s\n", rc, status, needle,
               out != NULL ? out : "(no output)");
    free(out);
}

/* A capture file by hand: n_layers 1, n_heads 1, n_kv_heads 1, head_dim d, 3 tokens. */
static bool write_tiny_capture(const char *path, uint32_t head_dim) {
    uint32_t n = 3, header[6] = {1, 1, 1, 1, head_dim, n};
    size_t floats = 3 * (size_t)n * head_dim, bytes = 32 + 4 * n + 4 * floats;
    unsigned char *b = (unsigned char *)calloc(1, bytes);
    if (b == NULL) return false;
    memcpy(b, "KVMXCAPT", 8);
    for (int i = 0; i < 6; i++)
        for (int k = 0; k < 4; k++) b[8 + 4 * i + k] = (unsigned char)(header[i] >> (8 * k));
    int32_t ids[3] = {256, 257, 10};
    for (uint32_t i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            b[32 + 4 * i + k] = (unsigned char)((uint32_t)ids[i] >> (8 * k));
    uint32_t state = 12345;
    for (size_t i = 0; i < floats; i++) {
        state = state * 1664525u + 1013904223u;
        float x = (float)((double)(state >> 8) / 16777216.0 - 0.5);
        memcpy(b + 32 + 4 * n + 4 * i, &x, 4); /* little-endian hosts, as the runner */
    }
    bool ok = write_bytes(path, b, bytes);
    free(b);
    return ok;
}

static void test_bad_input(const char *caps_dir) {
    char args[2048], path[1024], real[1024];
    snprintf(real, sizeof real, "%s/capture-0000.bin", caps_dir);
    expect_failure("--captures " TMP "/no-such-dir", 1, "cannot open");
    mkdir(TMP "/empty", 0755);
    expect_failure("--captures " TMP "/empty", 1, "no capture-");
    /* truncated capture */
    mkdir(TMP "/trunc", 0755);
    size_t n = 0;
    char *bytes = read_file(real, &n);
    CHECK(bytes != NULL && n > 4096 && write_bytes(TMP "/trunc/capture-0000.bin", bytes, 4096));
    expect_failure("--captures " TMP "/trunc", 1, "not a capture");
    CHECK(write_bytes(TMP "/trunc/capture-0000.bin", "KVMXCAPT", 8));
    expect_failure("--captures " TMP "/trunc", 1, "not a capture");
    CHECK(write_bytes(TMP "/trunc/capture-0000.bin", "{\"ids\": []}\n", 12));
    expect_failure("--captures " TMP "/trunc", 1, "not a capture");
    /* two shapes; a tiny capture alone works; head_dim 48 is refused */
    mkdir(TMP "/mixed", 0755);
    CHECK(bytes != NULL && write_bytes(TMP "/mixed/capture-0000.bin", bytes, n));
    free(bytes);
    CHECK(write_tiny_capture(TMP "/mixed/capture-0001.bin", 32));
    expect_failure("--captures " TMP "/mixed", 1, "model shape differs");
    mkdir(TMP "/tiny", 0755);
    CHECK(write_tiny_capture(TMP "/tiny/capture-0000.bin", 32));
    char *out = NULL;
    CHECK_MSG(run(QUIET TOOL " --captures " TMP "/tiny --budget 64", &out) == 0, /* 3 rows in 8 */
              "a 3-token capture of head_dim 32 calibrates");
    free(out);
    CHECK(write_tiny_capture(TMP "/tiny/capture-0000.bin", 48));
    expect_failure("--captures " TMP "/tiny", 1, "head_dim 48");
    /* spec */
    snprintf(args, sizeof args, "--captures %s --spec " TMP "/no-such-spec.json", caps_dir);
    expect_failure(args, 1, "--spec");
    CHECK(write_bytes(TMP "/bad-spec.json", "{\"version\": 1, \"name\": ", 23));
    snprintf(args, sizeof args, "--captures %s --spec " TMP "/bad-spec.json", caps_dir);
    expect_failure(args, 1, "--spec");
    /* options */
    static const char *const BAD_OPTIONS[][2] = {
        {"--budget -1", "--budget"},        {"--budget abc", "--budget"},
        {"--stride 0", "--stride"},         {"--low int4 --high int2c", "--low"},
        {"--method dp", "--method"},        {"--threads 0", "--threads"},
        {"--colour red", "unknown option"}, {"--page-tokens", "needs a value"}};
    for (size_t i = 0; i < sizeof BAD_OPTIONS / sizeof BAD_OPTIONS[0]; i++) {
        snprintf(args, sizeof args, "--captures %s %s", caps_dir, BAD_OPTIONS[i][0]);
        expect_failure(args, 2, BAD_OPTIONS[i][1]);
    }
    expect_failure("--budget 3", 2, "exactly one");
    snprintf(args, sizeof args, "--captures %s --from-table " TMP "/table.json", caps_dir);
    expect_failure(args, 2, "exactly one");
    expect_failure("--from-table " TMP "/table.json --stride 4", 2, "geometry");
    snprintf(args, sizeof args, "--captures %s --boost 6", caps_dir);
    expect_failure(args, 1, "precision boosted");
    expect_failure("--from-table " TMP "/table.json --budget 2", 1, "budget");
    expect_failure("--from-table " TMP "/table.json --ablate sideways", 2, "--ablate");
    expect_failure("--from-table " TMP "/table.json --stored-from " TMP "/alloc.json", 2,
                   "geometry");
    snprintf(args, sizeof args, "--captures %s --stored-from " TMP "/no-such-alloc.json", caps_dir);
    expect_failure(args, 1, "--stored-from");
    expect_failure("--from-table " TMP "/table.json --table " TMP "/no-such-dir/t.json", 1,
                   "cannot write");
    /* tables */
    expect_failure("--from-table " TMP "/no-such-table.json", 1, "cannot read");
    char *table = read_file(TMP "/table.json", &n);
    if (!CHECK(table != NULL)) return;
    CHECK(write_bytes(TMP "/bad-table.json", table, n / 2));
    expect_failure("--from-table " TMP "/bad-table.json", 1, "bad-table.json");
    static const char *const EDITS[][3] = {
        {"\"version\": 1", "\"version\": 2", "version 2"},
        {"\"distortion\":[", "\"distortions\":[", "missing field \"distortion\""},
        {"\"role\":\"user\"", "\"role\":\"teacher\"", "unknown bucket, role"},
        {"\"name\":\"boosted\"", "\"name\":\"int3\"", "must be \"boosted\""},
        {"\"n_captures\":", "\"n_captures\":-", "n_captures"}};
    for (size_t i = 0; i < sizeof EDITS / sizeof EDITS[0]; i++) {
        char *at = strstr(table, EDITS[i][0]);
        if (!CHECK_MSG(at != NULL, EDITS[i][0])) continue;
        FILE *f = fopen(TMP "/bad-table.json", "wb");
        if (!CHECK(f != NULL)) continue;
        fwrite(table, 1, (size_t)(at - table), f);
        fputs(EDITS[i][1], f);
        fputs(at + strlen(EDITS[i][0]), f);
        fclose(f);
        expect_failure("--from-table " TMP "/bad-table.json", 1, EDITS[i][2]);
    }
    free(table);
    snprintf(path, sizeof path, "%s", TMP "/bad-table.json");
    remove(path);
}

int main(int argc, char **argv) {
    const char *shared = argc > 1 ? argv[1] : "../shared";
    char cmd[4096], *out = NULL;
    mkdir(TMP, 0755);
    mkdir(TMP "/caps", 0755);
    mkdir(TMP "/caps1", 0755);
    remove(TMP "/caps/capture-0000.bin");
    remove(TMP "/caps/capture-0001.bin");
    remove(TMP "/caps1/capture-0000.bin");
    if (!CHECK(write_short_traces(shared, TMP "/traces.jsonl"))) goto end;
    /* captures */
    snprintf(cmd, sizeof cmd,
             "%s/kvmix-eval --model %s/models/kvm-small.safetensors --data " TMP
             "/traces.jsonl --kind trace --limit 2 --policy fp32 --threads 1 --capture " TMP
             "/caps",
             BUILD_DIR, shared);
    if (!CHECK_MSG(run(cmd, &out) == 0, "kvmix-eval --capture DIR")) printf("%s\n", out);
    free(out);
    int64_t first = header_tokens(TMP "/caps/capture-0000.bin");
    int64_t second = header_tokens(TMP "/caps/capture-0001.bin");
    CHECK_MSG(first > 100 && second > 100, "one capture per text");
    CHECK_MSG(count_entries(TMP "/caps") == 2, "--capture DIR writes nothing else");
    snprintf(cmd, sizeof cmd,
             "%s/kvmix-eval --model %s/models/kvm-small.safetensors --data " TMP
             "/traces.jsonl --kind trace --offset 1 --limit 1 --capture " TMP "/caps1",
             BUILD_DIR, shared);
    CHECK(run(cmd, NULL) == 0);
    CHECK_MSG(header_tokens(TMP "/caps1/capture-0000.bin") == second,
              "--offset 1 --limit 1 captures the second text");
    snprintf(cmd, sizeof cmd,
             "%s/kvmix-eval --model %s/models/kvm-small.safetensors --data " TMP
             "/traces.jsonl --limit 1 --capture " TMP "/no-such-dir",
             BUILD_DIR, shared);
    CHECK_MSG(run(cmd, NULL) == 2, "kvmix-eval --capture into a missing directory fails at once");
    if (n_failed > 0) goto end;
    /* calibration */
    CHECK_MSG(run(QUIET TOOL " --captures " TMP "/caps --stride 16 --budget 3 --table " TMP
                             "/table.json --allocation " TMP "/alloc.json",
                  &out) == 0,
              "kvmix-calibrate --captures");
    CHECK(out != NULL && strstr(out, "budget sweep") != NULL);
    if (out != NULL) fputs(out, stdout);
    free(out);
    cJSON *t = load_json(TMP "/table.json"), *a = load_json(TMP "/alloc.json");
    if (CHECK(t != NULL && a != NULL)) {
        check_table(t, TMP "/caps");
        check_allocation(a, t);
    }
    cJSON_Delete(t);
    cJSON_Delete(a);
    /* the runner stores tokens by the allocation it wrote */
    snprintf(cmd, sizeof cmd,
             "%s/kvmix-eval --model %s/models/kvm-small.safetensors --data " TMP
             "/traces.jsonl --limit 1 --policy int4 --tag-spec examples/specs/kvm-byte.json "
             "--allocation " TMP "/alloc.json",
             BUILD_DIR, shared);
    CHECK_MSG(run(cmd, &out) == 0 && out != NULL && strstr(out, "\"allocation\"") != NULL,
              "kvmix-eval --tag-spec --allocation reads kvmix-calibrate's allocation");
    free(out);
    out = NULL;
    CHECK(run(QUIET TOOL " --from-table " TMP "/table.json --budget 3 --table " TMP
                         "/table2.json --allocation " TMP "/alloc2.json",
              NULL) == 0);
    CHECK_MSG(same_files(TMP "/table.json", TMP "/table2.json"), "table round trip: same bytes");
    CHECK_MSG(same_files(TMP "/alloc.json", TMP "/alloc2.json"), "same allocation from the table");
    CHECK(run(QUIET TOOL " --captures " TMP "/caps --stride 64 --threads 1 --table " TMP
                         "/table3.json",
              NULL) == 0);
    CHECK(run(QUIET TOOL " --captures " TMP "/caps --stride 64 --threads 2 --table " TMP
                         "/table4.json",
              NULL) == 0);
    CHECK_MSG(same_files(TMP "/table3.json", TMP "/table4.json"), "--threads 1: the same table");
    CHECK(run(QUIET TOOL " --from-table " TMP "/table.json --method two-level --low boosted "
                         "--high int8 --budget 4 --allocation " TMP "/alloc3.json",
              NULL) == 0);
    cJSON *a3 = load_json(TMP "/alloc3.json");
    CHECK(a3 != NULL && strcmp(str(a3, "low"), "boosted") == 0 &&
          strcmp(str(a3, "method"), "exhaustive") == 0);
    cJSON_Delete(a3);
    check_ablations();
    check_pricing();
    check_window(TMP "/caps");
    check_stored_from(TMP "/caps");
    test_bad_input(TMP "/caps");
end:
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed != 0;
}
