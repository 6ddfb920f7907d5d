/* kvmix-eval: next-token quality of a Llama model with a given KV-cache policy.
 *
 *   kvmix-eval --model M.safetensors --data D.jsonl [--kind trace|code] [--offset N]
 *              [--limit N] [--policy P] [--threads N] [--capture DIR]
 *              [--device cpu|cuda] [--batch N] [--tag-spec S.json --allocation A.json]
 *              [--transfer MODE:B[:LAMBDA]] [--tops PATH]
 *              [--reference-tops PATH] [--evict-log PATH]
 *   kvmix-eval --list-policies          the built-in policies' settings, one JSON object a line
 *   kvmix-eval --read-capture PATH      validate a capture file and print its shape
 *
 * --policy is a built-in name (fp32, fp16, int8, int4, kivi2, kivi2-sink, kitty-12, kitty-25) or
 * the path of a policy document (schema: README.md, "Policies"; examples/policies/). fp32 runs
 * the runner's own fp32 cache; every other policy runs the kvmix paged cache (kvmix_kv.h).
 * The selected texts are those of the kind in file order, after skipping the first --offset of
 * them, at most --limit. Each selected text becomes <|endoftext|> + its tokens,
 * cut to the first context + 1 ids, and is fed one token at a time from a reset cache; every
 * position after the first is scored. One JSON object is printed:
 *   bits_per_token    mean cross-entropy (bits) of the true next token over all scored positions
 *   answer_accuracy   over answer positions: top-1 prediction == true next token
 *   answer_agreement  over answer positions: top-1 == top-1 of the same model with the fp32 cache
 *   kv_bytes          the most bytes the cache held at the end of any text
 *   avg_bits          bits per stored key/value element, weighted by tokens held; for kvmix
 *                     policies everything the sequence holds: sealed pages with their scales,
 *                     minima and boost indices, FP16 sink, window and buffer pages at their whole
 *                     capacity, allocation padding, its slot map and page table (kvmix_kv.c)
 *   packed_bits       the same over the sealed pages alone (not sinks, window, buffer), weighted
 *                     by the tokens they hold: what the policy's formats cost (null for fp32)
 *   assigned_bits     (--allocation) what the tags of those tokens at the text's last turn
 *                     cost at the allocation's own prices (its tags' "bits"; runs' closed pages
 *                     included when kvmix-calibrate priced by runs): the allocation's prediction
 *                     for these texts, beside packed_bits, what is held
 *   n_tokens          scored positions; policy: the resolved policy object (all fields)
 * An answer position is one whose *next* token is an answer token: inside an assistant message,
 * after its </think> up to and including its <|im_end|>, or inside one of its tool calls from
 * after <tool_call> up to and including </tool_call> (llama_mark_answer_tokens in llama.h).
 * Before each token that opens a user message ("<|im_start|>user\n") the cache's begin_request
 * hook runs. --capture DIR records every selected text's queries, keys and values (llama.h,
 * "Captures"): DIR/capture-NNNN.bin, NNNN = the text's index in the selection (0000 first, 4 or
 * more digits), one file per text with at least one scored position; DIR must exist and nothing
 * else is written there. Captured keys and values are what the policy's cache received (its
 * quantization affects later layers); --policy fp32 captures the full-precision model.
 *
 * --tops PATH writes the policy's top-1 prediction at every scored position: one line per
 * selected text with at least one scored position, in selection order, its ids separated by
 * spaces; two runs (CPU and GPU, two batch sizes) then compare position by position.
 * --reference-tops PATH takes the reference's top-1 (what answer_agreement compares with) from
 * the --tops file of an fp32 run over the same selection instead of running the fp32 model
 * again: a sweep of many policies runs the reference once. A file whose lines do not match the
 * selection (count, length, ids) is refused.
 *
 * --device cuda (kvmix-eval-cuda, the same program built with the GPU runner, gpu_llama.h; its
 * default) runs the texts on the GPU, up to --batch N (default 256) of them at once in
 * lockstep, one token each per step, sequences joining as others finish; the fp32 reference
 * runs the same way first. The policy's cache is a kvmix cache with a device arena, attention is
 * kvmix_cuda_decode. The runner is batch-invariant (gpu_llama_batch_invariant): --batch changes
 * how fast, not what, it computes. The JSON is the same, with "device" naming the GPU. --capture
 * there records the policy's pass (gpu_llama_capture), each running text's capture whole in host
 * memory (4 bytes x its tokens x layers x (q heads + 2 kv heads) x head_dim: 470 MB for a 14K-token
 * kvm-long trace), so --batch bounds the memory it takes. Progress (texts done, tokens per second, time left) goes to stderr when it is a terminal.
 *
 * --tag-spec S.json --allocation A.json store each token by its template tag: the spec
 * (tag_spec_json.h) tags the ids as they run, the allocation (kvmix-calibrate's,
 * tag_allocation.h) gives each tag its formats by its temporal bucket, tags it does not list keep
 * the policy's; each token's run (kvmix_policy_token_run) keeps tokens that age alike on pages
 * of their own, a page seals in the highest precision its tokens ask for, and when a new user
 * turn begins the pages whose tokens now ask for less are re-tiered down to it
 * (kvmix_policy_retier_turn).
 *
 * A policy with "evict" (README.md, "Policies"; with --tag-spec, whose tags find each user turn's
 * message) evicts once per request, each user turn being a request of the text's session, when
 * its prompt has run (evict_driver.h: the same driver on the CPU, over the kvmix-backed cache's
 * recording, kvmix_kv_observe, and on the GPU, over gpu_llama's). The JSON then adds "eviction":
 * evictions, evicted tokens, the mean over texts of the most live tokens a text had, bytes the
 * evictions freed; --evict-log PATH writes every eviction there, one JSON object a line (text:
 * its index in the selection, request: the user turn's index in the text, positions: evicted,
 * ascending), to hold one runner's evictions against the other's. --residual W.json rescores
 * an intent or query policy's rule with the intent residual's weights (intent_residual_json.h,
 * evict_driver_residual); --residual-rows PATH writes its training rows (evict_driver_rows) as
 * CSV: a header, then per position of each request that a later one followed "text, request,
 * position, the 13 features (kvmix_intent_residual_feature_name), target" (text: its index in
 * the selection; target: the attention the later requests' prompts gave the position), a share
 * --residual-rows-rate P (default 1) of them, chosen by a hash of the three. Every GPU run adds
 * "kv_bytes_read_per_token" (the cache bytes a sequence holds
 * when each of its tokens runs, averaged: what decode reads) and "recall": answer tokens,
 * accuracy, agreement and mean cross-entropy (bits) of the answer tokens of the turns whose user
 * message starts with "Earlier" (the traces' questions about an earlier tool result).
 *
 * --transfer MODE:B[:LAMBDA] hands each text over once, as a prefill worker
 * hands its cache to a decode worker (transfer_driver.h): at the end of the first user message
 * that ends at or after half the text (with --tag-spec; else at half), the sequence's rows go
 * through transfer payloads at budget B with the tiers of MODE (transfer_plan.h: tiered, with
 * the attention the text's prefill gave each position and recency decay LAMBDA; norms; int8;
 * int4; random; sinks; ends; the first SINK_POSITIONS (4) positions are the sinks) into a fresh
 * sequence of the policy's cache, which goes on. The JSON adds "transfer": the tiers' counts,
 * payload bytes against all-FP16 payloads of the same rows (the realized budget), and
 * bits_per_token, answer accuracy and agreement over the positions after the hand-over.
 */
#define _POSIX_C_SOURCE 200809L /* opendir */
#include "kvmix_kv.h"
#include "llama.h"
#include "question_score.h"
#include "tag_allocation.h"
#include "tag_spec_json.h"
#include "intent_residual_json.h"

#include "evict_driver.h"
#include "transfer_driver.h" /* transfer_sequence is the GPU build's */
#ifdef KVMIX_EVAL_CUDA
#include "gpu_llama.h"
#endif

#include <cjson/cJSON.h>
#include <dirent.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ERR_BYTES = 512 };

typedef struct options {
    const char *model_path;
    const char *data_path;
    const char *kind; /* NULL: every text */
    int64_t offset;   /* selected texts of the kind skipped first */
    int64_t limit;    /* 0: no limit */
    const char *policy;
    int32_t n_threads;
    const char *capture_dir; /* NULL: no capture */
    bool list_policies;
    const char *read_capture_path; /* NULL: evaluate */
    bool cuda;                     /* --device cuda */
    int64_t batch;                 /* texts at once on the GPU */
    const char *tag_spec_path;     /* the template's tags: for --allocation, for eviction */
    const char *allocation_path;   /* store tokens by their tags (needs tag_spec_path) */
    const char *transfer;          /* MODE:B[:LAMBDA]: a hand-over per text */
    const char *tops_path;         /* each scored position's top-1, a line per text */
    const char *reference_tops;    /* an fp32 run's --tops: the reference, not run again */
    const char *evict_log;         /* every eviction's positions written there */
    const char *residual_path;     /* the intent residual's weights (JSON) */
    const char *rows_path;         /* the residual's training rows written there (CSV) */
    double rows_rate;              /* the share of rows written */
} options;

enum { SINK_POSITIONS = 4 }; /* a transfer's sinks: the first positions, as eviction's prefix */

static void usage(FILE *f) {
    fprintf(
        f,
        "usage: kvmix-eval --model M.safetensors --data D.jsonl [--kind trace|code] [--offset N]\n"
        "                  [--limit N] [--policy P] [--threads N] [--capture DIR]\n"
        "                  [--device cpu|cuda] [--batch N] [--tag-spec S [--allocation A]]\n"
        "                  [--transfer MODE:B[:LAMBDA]] [--tops PATH]\n"
        "                  [--reference-tops PATH] [--evict-log PATH] [--residual W.json]\n"
        "                  [--residual-rows PATH [--residual-rows-rate P]]\n"
        "       kvmix-eval --list-policies\n"
        "       kvmix-eval --read-capture PATH\n");
}

static bool parse_count(const char *s, int64_t min, int64_t *out) {
    char *end;
    long long v = strtoll(s, &end, 10);
    if (*s == 0 || *end != 0 || v < min) return false;
    *out = v;
    return true;
}

/* A share in (0, 1]. */
static bool parse_rate(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (*s == 0 || *end != 0 || !(v > 0.0 && v <= 1.0)) return false;
    *out = v;
    return true;
}

/* Stores the value of a string flag; false when flag is not one. */
static bool take_string_flag(options *o, const char *flag, const char *value) {
    const struct {
        const char *flag;
        const char **dest;
    } flags[] = {{"--model", &o->model_path},
                 {"--data", &o->data_path},
                 {"--kind", &o->kind},
                 {"--policy", &o->policy},
                 {"--capture", &o->capture_dir},
                 {"--read-capture", &o->read_capture_path},
                 {"--tag-spec", &o->tag_spec_path},
                 {"--allocation", &o->allocation_path},
                 {"--transfer", &o->transfer},
                 {"--tops", &o->tops_path},
                 {"--reference-tops", &o->reference_tops},
                 {"--evict-log", &o->evict_log},
                 {"--residual", &o->residual_path},
                 {"--residual-rows", &o->rows_path}};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        if (strcmp(flag, flags[i].flag) == 0) {
            *flags[i].dest = value;
            return true;
        }
    }
    return false;
}

static bool parse_options(int argc, char **argv, options *o) {
#ifdef KVMIX_EVAL_CUDA
    const bool cuda_default = true;
#else
    const bool cuda_default = false;
#endif
    *o = (options){NULL, NULL, NULL, 0,    0,    "fp32", 2,    NULL, false, NULL, cuda_default,
                   256,  NULL, NULL, NULL, NULL, NULL,   NULL, NULL, NULL,  1.0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *value = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t n;
        if (strcmp(a, "--list-policies") == 0) {
            o->list_policies = true;
            continue;
        }
        if (value == NULL) {
            fprintf(stderr, "kvmix-eval: %s needs a value\n", a);
            return false;
        }
        i++;
        if (take_string_flag(o, a, value)) continue;
        if (strcmp(a, "--limit") == 0 && parse_count(value, 1, &n)) {
            o->limit = n;
        } else if (strcmp(a, "--offset") == 0 && parse_count(value, 0, &n)) {
            o->offset = n;
        } else if (strcmp(a, "--threads") == 0 && parse_count(value, 1, &n) && n <= 256) {
            o->n_threads = (int32_t)n;
        } else if (strcmp(a, "--batch") == 0 && parse_count(value, 1, &n) && n <= 4096) {
            o->batch = n;
        } else if (strcmp(a, "--residual-rows-rate") == 0 && parse_rate(value, &o->rows_rate)) {
            continue;
        } else if (strcmp(a, "--device") == 0 &&
                   (strcmp(value, "cpu") == 0 || strcmp(value, "cuda") == 0)) {
            o->cuda = strcmp(value, "cuda") == 0;
        } else {
            fprintf(stderr, "kvmix-eval: bad option %s %s\n", a, value);
            return false;
        }
    }
    if (o->list_policies || o->read_capture_path != NULL) return true;
    if (o->model_path == NULL || o->data_path == NULL) {
        fprintf(stderr, "kvmix-eval: --model and --data are required\n");
        return false;
    }
#ifndef KVMIX_EVAL_CUDA
    if (o->cuda) {
        fprintf(stderr, "kvmix-eval: built without CUDA; --device cuda is kvmix-eval-cuda's\n");
        return false;
    }
#endif
    if (o->allocation_path != NULL && o->tag_spec_path == NULL) {
        fprintf(stderr, "kvmix-eval: --allocation needs --tag-spec\n");
        return false;
    }
    if (o->transfer != NULL && o->allocation_path != NULL) {
        fprintf(stderr, "kvmix-eval: --transfer runs without --allocation\n");
        return false;
    }
    if (o->rows_rate != 1.0 && o->rows_path == NULL) {
        fprintf(stderr, "kvmix-eval: --residual-rows-rate needs --residual-rows\n");
        return false;
    }
    if (o->kind != NULL && strcmp(o->kind, "trace") != 0 && strcmp(o->kind, "code") != 0) {
        fprintf(stderr, "kvmix-eval: --kind must be trace or code\n");
        return false;
    }
    DIR *dir = o->capture_dir != NULL ? opendir(o->capture_dir) : NULL;
    if (o->capture_dir != NULL && dir == NULL) {
        fprintf(stderr, "kvmix-eval: --capture %s: not a directory that can be opened\n",
                o->capture_dir);
        return false;
    }
    if (dir != NULL) closedir(dir);
    return true;
}

/* The texts of the data file that pass the kind filter, the offset and the limit, in file
 * order. */
typedef struct texts {
    char **items;
    question_list *questions; /* [n]: each text's questions (long-session traces), else empty */
    int64_t n;
} texts;

static void texts_free(texts *t) {
    for (int64_t i = 0; i < t->n; i++) {
        free(t->items[i]);
        questions_free(&t->questions[i]);
    }
    free(t->items);
    free(t->questions);
    *t = (texts){NULL, NULL, 0};
}

/* --policy: a built-in name, else the path of a policy document (schema in README.md). */
static bool load_policy(const char *arg, kvmix_policy *out, char *err) {
    const kvmix_policy *builtin = kvmix_kv_policy_builtin(arg);
    if (builtin != NULL) {
        *out = *builtin;
        return true;
    }
    size_t n_bytes;
    char *doc = llama_read_text(arg, &n_bytes);
    if (doc == NULL) {
        snprintf(err, ERR_BYTES,
                 "%s is neither a built-in policy (see --list-policies) nor a "
                 "readable policy file",
                 arg);
        return false;
    }
    char why[ERR_BYTES - 64];
    bool ok = kvmix_kv_policy_parse(doc, n_bytes, out, why, sizeof why) == LLAMA_OK;
    if (!ok) snprintf(err, ERR_BYTES, "%s: %s", arg, why);
    free(doc);
    return ok;
}

/* Room for one more text. */
static bool texts_grow(texts *out) {
    char **items = realloc(out->items, (size_t)(out->n + 1) * sizeof *out->items);
    if (items != NULL) out->items = items;
    question_list *questions = realloc(out->questions, (size_t)(out->n + 1) * sizeof *questions);
    if (questions != NULL) out->questions = questions;
    return items != NULL && questions != NULL;
}

/* Appends the text of one JSONL line, and its questions, when its kind matches. Returns false,
   with why in err, on a malformed line. */
static bool take_line(const char *line, size_t n_bytes, const char *kind, texts *out, char *err,
                      size_t err_bytes) {
    const char *end = line;
    cJSON *root = cJSON_ParseWithLengthOpts(line, n_bytes, &end, 0);
    const cJSON *k = cJSON_GetObjectItemCaseSensitive(root, "kind");
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(root, "text");
    bool ok = cJSON_IsString(k) && cJSON_IsString(text);
    if (!ok) snprintf(err, err_bytes, "needs {\"kind\": string, \"text\": string}");
    if (ok && (kind == NULL || strcmp(k->valuestring, kind) == 0)) {
        question_list questions;
        size_t len = strlen(text->valuestring);
        char *copy = malloc(len + 1);
        ok = questions_from_json(root, &questions, err, err_bytes);
        if (ok && (copy == NULL || !texts_grow(out))) {
            snprintf(err, err_bytes, "cannot allocate a text of %zu bytes", len);
            questions_free(&questions);
            ok = false;
        }
        if (ok) {
            memcpy(copy, text->valuestring, len + 1);
            out->questions[out->n] = questions;
            out->items[out->n++] = copy;
        } else {
            free(copy);
        }
    }
    cJSON_Delete(root);
    return ok;
}

static bool load_texts(const options *o, texts *out, char *err) {
    *out = (texts){NULL, NULL, 0};
    size_t n_bytes;
    char *data = llama_read_text(o->data_path, &n_bytes);
    if (data == NULL) {
        snprintf(err, ERR_BYTES, "cannot read %s", o->data_path);
        return false;
    }
    int64_t line_no = 0, skipped = 0;
    bool ok = true;
    for (char *line = data; ok && line < data + n_bytes && (o->limit == 0 || out->n < o->limit);) {
        char *newline = memchr(line, '\n', (size_t)(data + n_bytes - line));
        size_t len = newline != NULL ? (size_t)(newline - line) : (size_t)(data + n_bytes - line);
        line_no++;
        char why[ERR_BYTES - 64];
        if (len > 0 && !take_line(line, len, o->kind, out, why, sizeof why)) {
            snprintf(err, ERR_BYTES, "%s:%lld: %s", o->data_path, (long long)line_no, why);
            ok = false;
        }
        if (ok && out->n > 0 && skipped < o->offset) { /* drop it: still inside the offset */
            free(out->items[--out->n]);
            questions_free(&out->questions[out->n]);
            skipped++;
        }
        line += len + 1;
    }
    free(data);
    if (!ok) texts_free(out);
    return ok;
}

/* What one run accumulates over all texts. */
typedef struct totals {
    llama_score score;
    int64_t n_texts;
    size_t kv_bytes_max; /* the most bytes the cache held, at the end of any text */
    double avg_bits_sum; /* avg_bits weighted by the tokens held at the end of each text */
    int64_t held_tokens;
    double packed_bits_sum;   /* packed_bits weighted by the packed tokens at each text's end */
    double assigned_bits_sum; /* assigned_bits, the same way */
    int64_t packed_tokens;
    bool gpu;          /* the fields below are the GPU runner's */
    double bytes_read; /* cache bytes held when each scored token ran, summed */
    llama_score recall;
    bool evicting;
    evict_stats eviction;
    bool transferring;
    transfer_stats transfer;
    llama_score after;           /* the positions after the hand-over */
    distance_scores by_distance; /* the answers of questions that record their distance */
} totals;

typedef struct eval {
    const options *opt;
    const llama_model *model;
    llama_runner runner;
    kvmix_policy policy;      /* resolved for the model */
    llama_kv_cache cache;     /* the policy under test */
    llama_kv_cache reference; /* fp32; only used when the policy is another one */
    bool separate_reference;
    int32_t *ids;
    uint8_t *mask;
    int32_t *ref_argmax;
    int32_t *tops; /* the policy's own top-1 (--tops) */
    FILE *tops_file;
    FILE *reference_tops;   /* --reference-tops: read a line per text instead of an fp32 pass */
    int64_t reference_line; /* lines read from it */
    bool tagged; /* --tag-spec and --allocation: the policy's cache stores tokens by tag */
    const tag_spec_doc *tag_doc;
    kvmix_tag_precision tag_table;
    tag_prices tag_prices; /* the allocation's prices of its tags (assigned_bits) */
    bool transferring;     /* --transfer */
    transfer_setup transfer;
    transfer_stats transfer_stats;
    evict_driver *evict;            /* the CPU runner's, when the policy evicts */
    evict_seq evict_seq;            /* the text running */
    evict_request *requests;        /* [context + 1]: its user turns' messages */
    int64_t text_index;             /* of the text running, in the selection */
    const question_list *questions; /* the running text's */
    FILE *evict_log;                /* --evict-log */
    intent_residual_doc residual;   /* --residual (weights.w1 NULL: none) */
    FILE *rows_file;                /* --residual-rows */
    double rows_rate;
    int64_t transfer_at; /* --transfer on the CPU: where the text running is handed over */
    llama_score *score;  /* the totals the text running adds to */
    llama_score score_at_transfer; /* *score when it was handed over */
    char err[ERR_BYTES];
} eval;

/* --evict-log: one JSON object a line per eviction. */
static void log_eviction(void *user, const evict_seq *s, int32_t request, const int32_t *positions,
                         int32_t n_positions) {
    FILE *f = user;
    fprintf(f, "{\"text\": %lld, \"request\": %d, \"positions\": [", (long long)s->id, request);
    for (int32_t i = 0; i < n_positions; i++) fprintf(f, "%s%d", i > 0 ? ", " : "", positions[i]);
    fprintf(f, "]}\n");
}

/* --residual-rows-rate: whether the row of (text, request, position) is written, by a hash of
   the three (the same rows in every run). */
static bool row_kept(int64_t text, int32_t request, int32_t position, double rate) {
    uint64_t x =
        (uint64_t)text * 0x9e3779b97f4a7c15u ^ (uint64_t)request << 32 ^ (uint32_t)position;
    x ^= x >> 30, x *= 0xbf58476d1ce4e5b9u, x ^= x >> 27, x *= 0x94d049bb133111ebu, x ^= x >> 31;
    return (double)(x >> 11) * 0x1.0p-53 < rate;
}

/* --residual-rows: the header, then per kept position of a request that a later one followed a
   line: text, request, position, the residual's features, the later prompts' attention. */
static void write_rows_header(FILE *f) {
    fprintf(f, "text,request,position");
    for (int32_t k = 0; k < KVMIX_INTENT_RESIDUAL_N_FEATURES; k++)
        fprintf(f, ",%s", kvmix_intent_residual_feature_name(k));
    fprintf(f, ",target\n");
}

static void write_rows(void *user, const evict_seq *s, int32_t request, const float *features,
                       const float *target, int32_t n_positions) {
    const eval *e = user;
    for (int32_t t = 0; t < n_positions; t++) {
        const float *f = features + (size_t)t * KVMIX_INTENT_RESIDUAL_N_FEATURES;
        if (!isfinite(f[KVMIX_INTENT_FEATURE_RULE]) || !row_kept(s->id, request, t, e->rows_rate))
            continue; /* evicted before this request */
        fprintf(e->rows_file, "%lld,%d,%d", (long long)s->id, request, t);
        for (int32_t k = 0; k < KVMIX_INTENT_RESIDUAL_N_FEATURES; k++)
            fprintf(e->rows_file, ",%.9g", f[k]);
        fprintf(e->rows_file, ",%.9g\n", target[t]);
    }
}

/* The residual's weights and its rows' file on a driver (--residual, --residual-rows). */
static llama_result evict_driver_extras(eval *e, evict_driver *d) {
    llama_result r = LLAMA_OK;
    if (e->residual.weights.w1)
        r = evict_driver_residual(d, &e->residual.weights, &e->tag_doc->spec, e->err,
                                  sizeof e->err);
    if (r == LLAMA_OK && e->rows_file)
        r = evict_driver_rows(d, write_rows, e, &e->tag_doc->spec, e->err, sizeof e->err);
    return r;
}

/* Tokens of one text: <|endoftext|> first, then the text, cut to context + 1 ids. */
static int64_t encode_text(const eval *e, const char *text) {
    const llama_model *m = e->model;
    int64_t n = 0;
    size_t len = strlen(text);
    int32_t *all = malloc((len + 1) * sizeof *all);
    if (all == NULL) return -1;
    all[0] = llama_special_id(&m->tokenizer, "<|endoftext|>");
    llama_tokenize(&m->tokenizer, text, len, all + 1, &n);
    n = n + 1 < (int64_t)m->config.context + 1 ? n + 1 : (int64_t)m->config.context + 1;
    memcpy(e->ids, all, (size_t)n * sizeof *all);
    free(all);
    return n;
}

/* Adds what a cache held at a text's end to the totals. */
static void add_held(totals *t, const llama_kv_stats *s) {
    t->avg_bits_sum += s->avg_bits * (double)s->n_tokens;
    t->held_tokens += s->n_tokens;
    t->packed_bits_sum += s->packed_bits * (double)s->n_packed_tokens;
    t->assigned_bits_sum += s->assigned_bits * (double)s->n_packed_tokens;
    t->packed_tokens += s->n_packed_tokens;
}

/* --tops: one text's top-1 at its n scored positions, a line; true without --tops. */
static bool write_tops(eval *e, const int32_t *tops, int64_t n) {
    if (e->tops_file == NULL || n < 1) return true;
    for (int64_t p = 0; p < n; p++) fprintf(e->tops_file, p + 1 < n ? "%d " : "%d\n", (int)tops[p]);
    if (ferror(e->tops_file)) {
        snprintf(e->err, sizeof e->err, "--tops %s: cannot write", e->opt->tops_path);
        return false;
    }
    return true;
}

/* --reference-tops: the next text's fp32 top-1 at its n scored positions into out, the line
   --tops wrote for that text in an fp32 run of the same selection; a line of another length or
   with an id outside the vocabulary is refused, naming the line. */
static bool read_reference_tops(eval *e, int32_t *out, int64_t n) {
    if (n < 1) return true; /* --tops wrote no line for it */
    char *line = NULL, *at = NULL, *end = NULL;
    size_t cap = 0;
    int64_t got = 0;
    bool ok = getline(&line, &cap, e->reference_tops) > 0;
    e->reference_line++;
    for (at = line; ok && got <= n; at = end, got++) {
        while (*at == ' ') at++;
        if (*at == '\n' || *at == '\0') break;
        long id = strtol(at, &end, 10);
        ok = end != at && id >= 0 && id < e->model->config.vocab;
        if (ok && got < n) out[got] = (int32_t)id;
    }
    free(line);
    if (ok && got == n) return true;
    snprintf(e->err, sizeof e->err,
             "--reference-tops %s: line %lld does not hold %lld ids below %d: not an fp32 run's "
             "--tops over the same selection",
             e->opt->reference_tops, (long long)e->reference_line, (long long)n,
             (int)e->model->config.vocab);
    return false;
}

/* --reference-tops: every line taken, and no more. */
static bool reference_tops_done(eval *e) {
    int c;
    while ((c = fgetc(e->reference_tops)) == '\n') {
    }
    if (c == EOF) return true;
    snprintf(e->err, sizeof e->err, "--reference-tops %s: more lines than the %lld texts scored",
             e->opt->reference_tops, (long long)e->reference_line);
    return false;
}

/* --transfer on the CPU runner: the text's n rows leave the policy's cache through the payloads
   (transfer_send) into a fresh cache of the policy, which goes on: as transfer_sequence on the
   GPU. The positions not sent are evicted there. */
static llama_result cpu_hand_over(eval *e, int32_t n, char *err, size_t err_bytes) {
    const llama_config *c = &e->model->config;
    size_t row = (size_t)c->n_kv_heads * (size_t)c->head_dim,
           floats = (size_t)c->n_layers * n * row;
    float *keys = malloc((floats > 0 ? floats : 1) * sizeof *keys);
    float *values = malloc((floats > 0 ? floats : 1) * sizeof *values);
    float *attention = calloc((size_t)(n > 0 ? n : 1), sizeof *attention);
    uint8_t *tiers = malloc((size_t)(n > 0 ? n : 1));
    int32_t *gone = malloc((size_t)(n > 0 ? n : 1) * sizeof *gone), n_gone = 0;
    transfer_setup setup = e->transfer;
    setup.seed = (uint64_t)e->text_index; /* as the GPU runner draws random tiers per text */
    llama_result r = keys && values && attention && tiers && gone
                         ? LLAMA_OK
                         : llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "transfer: out of memory");
    if (r == LLAMA_OK) r = kvmix_kv_rows_read(&e->cache, n, keys, values);
    if (r == LLAMA_OK && setup.mode == TRANSFER_TIERED)
        r = kvmix_kv_observed_take(&e->cache, NULL, NULL, attention);
    if (r == LLAMA_OK)
        r = transfer_send(c, &setup, attention, keys, values, n, tiers, &e->transfer_stats, err,
                          err_bytes);
    if (r == LLAMA_OK) { /* the receiver */
        e->cache.destroy(e->cache.state);
        r = kvmix_kv_create(&e->policy, c, (int64_t)c->context + 1, &e->cache, err, err_bytes);
        if (r != LLAMA_OK) memset(&e->cache, 0, sizeof e->cache);
    }
    for (int32_t l = 0; r == LLAMA_OK && l < c->n_layers; l++)
        r = kvmix_kv_ingest(&e->cache, l, 0, n, keys + (size_t)l * n * row,
                            values + (size_t)l * n * row);
    if (r == LLAMA_OK) transfer_dropped(tiers, n, gone, &n_gone);
    if (r == LLAMA_OK && n_gone > 0) r = kvmix_kv_evict(&e->cache, gone, n_gone);
    if (r != LLAMA_OK && err[0] == 0)
        snprintf(err, err_bytes, "transfer: %s", llama_result_string(r));
    free(keys), free(values), free(attention), free(tiers), free(gone);
    return r;
}

/* Before each token of a text on the CPU runner: the eviction driver over the policy's cache (not
   a capture's wrapper: the kvmix cache itself records), or the hand-over (--transfer). */
static llama_result cpu_before_step(void *user, int64_t pos, char *err, size_t err_bytes) {
    eval *e = user;
    if (e->evict) {
        evict_backend b = evict_backend_cpu(&e->cache);
        return evict_before_step(e->evict, &e->evict_seq, &b, (int32_t)pos, err, err_bytes);
    }
    if (!e->transferring) return LLAMA_OK;
    llama_result r = LLAMA_OK;
    if (pos == 0 && e->transfer.mode == TRANSFER_TIERED) /* the prefill's attention, recorded */
        r = kvmix_kv_observe(&e->cache, KVMIX_KV_OBSERVE_ATTENTION);
    if (r != LLAMA_OK || pos != e->transfer_at) return r;
    e->score_at_transfer = *e->score;
    err[0] = 0;
    return cpu_hand_over(e, (int32_t)pos, err, err_bytes);
}

/* The scores of positions from the hand-over on: what the text added since. */
static void add_after(llama_score *after, const llama_score *now, const llama_score *then) {
    after->bits += now->bits - then->bits;
    after->n_scored += now->n_scored - then->n_scored;
    after->n_answer += now->n_answer - then->n_answer;
    after->n_answer_correct += now->n_answer_correct - then->n_answer_correct;
    after->n_answer_agree += now->n_answer_agree - then->n_answer_agree;
}

/* The running text's requests (user messages) into e->requests, as the tags find them; none
   without a tag spec. */
static llama_result plan_requests(eval *e, int64_t n, int32_t *out_n) {
    *out_n = 0;
    return e->tag_doc ? evict_plan(&e->tag_doc->spec, e->ids, n, e->requests, (int32_t)n, out_n,
                                   e->err, sizeof e->err)
                      : LLAMA_OK;
}

/* A text to hand over starts: where, by its requests (else half). */
static llama_result transfer_text_start(eval *e, int64_t n) {
    int32_t n_requests = 0;
    llama_result r = plan_requests(e, n, &n_requests);
    e->transfer_at = transfer_point(e->requests, n_requests, n - 1);
    return r;
}

/* An evicting text starts: its requests found by the tags. */
static llama_result evict_text_start(eval *e, int64_t n) {
    int32_t n_requests = 0;
    llama_result r = plan_requests(e, n, &n_requests);
    if (r == LLAMA_OK) evict_seq_start(e->evict, &e->evict_seq, e->ids, e->requests, n_requests);
    e->evict_seq.id = e->text_index;
    return r;
}

static llama_result score_text(eval *e, llama_kv_cache *cache, int64_t n, totals *t) {
    const llama_model *m = e->model;
    llama_step_hook hook = {cpu_before_step, e};
    bool hooked = e->evict || e->transferring;
    llama_mark_answer_tokens(&m->tokenizer, e->ids, n, e->mask);
    llama_score ignored = {0};
    llama_result r = LLAMA_OK;
    /* answer_agreement compares top-1 against an fp32 run of the same text; when the policy is
     * fp32 that run is this one, so it records its own top-1 and agrees with itself. */
    if (e->reference_tops && !read_reference_tops(e, e->ref_argmax, n - 1)) return LLAMA_ERR_FORMAT;
    if (e->separate_reference && !e->reference_tops)
        r = llama_score_sequence(&e->runner, &e->reference, e->ids, n, NULL, e->ref_argmax, NULL,
                                 &ignored, e->err, sizeof e->err);
    int32_t *own_argmax = e->separate_reference ? e->tops : e->ref_argmax;
    if (r == LLAMA_OK && e->evict) r = evict_text_start(e, n);
    if (r == LLAMA_OK && e->transferring) r = transfer_text_start(e, n);
    e->score = &t->score;
    e->score_at_transfer = t->score;
    if (r == LLAMA_OK)
        r = llama_score_sequence_hooked(&e->runner, cache, e->ids, n, e->mask, own_argmax,
                                        e->ref_argmax, hooked ? &hook : NULL, &t->score, e->err,
                                        sizeof e->err);
    if (r != LLAMA_OK) return r;
    if (e->transferring) add_after(&t->after, &t->score, &e->score_at_transfer);
    if (!write_tops(e, own_argmax, n - 1)) return LLAMA_ERR_FORMAT;
    distance_scores_add(&t->by_distance, e->questions, e->ids, own_argmax, e->ref_argmax, n);
    if (e->evict) {
        evict_backend b = evict_backend_cpu(&e->cache);
        evict_seq_end(e->evict, &e->evict_seq, &b);
    }
    llama_kv_stats stats;
    cache->stats(cache->state, &stats);
    if (stats.bytes > t->kv_bytes_max) t->kv_bytes_max = stats.bytes;
    add_held(t, &stats);
    t->n_texts++;
    return LLAMA_OK;
}

/* An empty capture for the n - 1 scored positions of a text of n tokens. */
static llama_result capture_init(eval *e, int64_t n, llama_capture *cap) {
    llama_result r = llama_capture_init(cap, &e->model->config, (int32_t)(n - 1));
    if (r != LLAMA_OK)
        snprintf(e->err, sizeof e->err, "cannot allocate a capture of %lld tokens",
                 (long long)n - 1);
    return r;
}

/* Text `index`'s capture file, DIR/capture-NNNN.bin. */
static llama_result capture_write(eval *e, int64_t index, const llama_capture *cap) {
    char path[4096];
    int written =
        snprintf(path, sizeof path, "%s/capture-%04lld.bin", e->opt->capture_dir, (long long)index);
    if (written < 0 || (size_t)written >= sizeof path) {
        snprintf(e->err, sizeof e->err, "--capture: directory path too long");
        return LLAMA_ERR_ARGUMENT;
    }
    return llama_capture_write(cap, path, e->err, sizeof e->err);
}

/* Scores text `index` of the selection through a recording wrapper and writes its capture file,
 * DIR/capture-NNNN.bin. */
static llama_result capture_text(eval *e, int64_t index, int64_t n, totals *t) {
    llama_capture cap;
    llama_kv_cache wrapped;
    llama_result r = capture_init(e, n, &cap);
    if (r != LLAMA_OK) return r;
    memcpy(cap.token_ids, e->ids, (size_t)(n - 1) * sizeof *e->ids);
    r = llama_kv_capture_wrap(&e->cache, &cap, &wrapped);
    if (r == LLAMA_OK) {
        r = score_text(e, &wrapped, n, t);
        wrapped.destroy(wrapped.state);
    }
    if (r == LLAMA_OK) r = capture_write(e, index, &cap);
    llama_capture_free(&cap);
    return r;
}

static double now_seconds(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A one-line progress report on stderr, when it is a terminal, at most twice a second. */
typedef struct progress {
    bool on;
    int64_t total;
    double start, last;
} progress;

static void progress_init(progress *p, int64_t total) {
    p->on = isatty(STDERR_FILENO) != 0;
    p->total = total;
    p->start = p->last = now_seconds();
}

static void progress_show(progress *p, int64_t done, int64_t tokens) {
    double t = now_seconds(), spent = t - p->start;
    if (!p->on || (done < p->total && t - p->last < 0.5)) return;
    p->last = t;
    fprintf(stderr, "\r%lld/%lld texts, %.0f tokens/s", (long long)done, (long long)p->total,
            spent > 0 ? (double)tokens / spent : 0.0);
    if (done > 0 && done < p->total)
        fprintf(stderr, ", %.0f s left   ", spent * (double)(p->total - done) / (double)done);
    if (done == p->total) fprintf(stderr, "%20s\n", "");
}

static llama_result run_texts(eval *e, const texts *list, totals *t) {
    progress prog;
    progress_init(&prog, list->n);
    for (int64_t i = 0; i < list->n; i++) {
        int64_t n = encode_text(e, list->items[i]);
        if (n < 0) {
            snprintf(e->err, sizeof e->err, "cannot allocate tokens for text %lld", (long long)i);
            return LLAMA_ERR_MEMORY;
        }
        if (n < 2) continue; /* an empty text has nothing to predict */
        e->text_index = i;
        e->questions = &list->questions[i];
        llama_result r =
            e->opt->capture_dir != NULL ? capture_text(e, i, n, t) : score_text(e, &e->cache, n, t);
        if (r != LLAMA_OK) return r;
        progress_show(&prog, i + 1, t->score.n_scored);
    }
    progress_show(&prog, list->n, t->score.n_scored);
    t->transferring = e->transferring;
    t->transfer = e->transfer_stats;
    return LLAMA_OK;
}

#ifdef KVMIX_EVAL_CUDA
/* One text on the GPU: its tokens, answer mask, the reference's top-1 and what it scored. */
typedef struct gpu_text {
    int32_t *ids;
    uint8_t *mask;
    int32_t *ref_argmax;
    int32_t *tops; /* the policy's own top-1 */
    int64_t n;
    llama_score score;
    llama_kv_stats stats;
    evict_request *requests; /* the user turns' messages */
    int32_t n_requests;
    uint8_t *recall;          /* [n]: the position is in a turn asking about an earlier result */
    llama_score recall_score; /* answers in those turns */
    double bytes_read;        /* cache bytes held when each scored token ran, summed */
    int64_t transfer_at;      /* --transfer: the position whose step runs on the receiver first */
    llama_score after;        /* scores of the positions from transfer_at on */
} gpu_text;

/* The sequences of a pass that are running: text, sequence, position. */
typedef struct gpu_batch {
    int32_t n, *text, *seq, *pos, *tokens;
    float *logits;
    evict_seq *ev;       /* when evicting: each running sequence's eviction state */
    llama_capture **cap; /* --capture: each running sequence's capture (the policy's pass) */
} gpu_batch;

/* Removes running sequence i (the last takes its place; eviction states swap, keeping their
   buffers). */
static void gpu_batch_remove(gpu_batch *b, int32_t i) {
    b->n--;
    b->text[i] = b->text[b->n], b->seq[i] = b->seq[b->n], b->pos[i] = b->pos[b->n];
    b->cap[i] = b->cap[b->n], b->cap[b->n] = NULL;
    if (b->ev) {
        evict_seq tmp = b->ev[i];
        b->ev[i] = b->ev[b->n];
        b->ev[b->n] = tmp;
    }
}

static void add_answer(llama_score *s, int32_t top, int32_t next, int32_t ref_top) {
    s->n_answer++;
    s->n_answer_correct += top == next;
    s->n_answer_agree += top == ref_top;
}

/* Scores the position every running text is at (the reference pass records its top-1). */
static void gpu_score_step(const eval *e, gpu_text *texts, const gpu_batch *b, bool reference) {
    int32_t vocab = e->model->config.vocab;
    for (int32_t i = 0; i < b->n; i++) {
        gpu_text *t = &texts[b->text[i]];
        const float *row = b->logits + (size_t)i * (size_t)vocab;
        int32_t p = b->pos[i], next = t->ids[p + 1], top = llama_argmax(row, vocab);
        if (reference || !e->separate_reference) t->ref_argmax[p] = top;
        if (reference) continue;
        t->tops[p] = top;
        double bits = llama_bits_of(row, vocab, next);
        t->score.bits += bits;
        t->score.n_scored++;
        if (t->mask[p + 1]) add_answer(&t->score, top, next, t->ref_argmax[p]);
        if (t->mask[p + 1] && t->recall[p + 1]) {
            t->recall_score.bits += bits; /* the answer tokens' alone */
            add_answer(&t->recall_score, top, next, t->ref_argmax[p]);
        }
        if (!e->transferring || p < t->transfer_at) continue;
        t->after.bits += bits;
        t->after.n_scored++;
        if (t->mask[p + 1]) add_answer(&t->after, top, next, t->ref_argmax[p]);
    }
}

/* --transfer: running sequence i is handed over (its random tiers drawn per text). */
static llama_result hand_over(eval *e, gpu_llama *g, gpu_batch *b, int32_t i) {
    transfer_setup setup = e->transfer;
    setup.seed = (uint64_t)b->text[i];
    return transfer_sequence(g, &e->model->config, &setup, b->pos[i], &b->seq[i],
                             &e->transfer_stats, e->err, sizeof e->err);
}

/* --capture: running sequence i's capture, for a text of n tokens, recorded as it steps. */
static llama_result gpu_capture_start(eval *e, gpu_llama *g, int64_t n, gpu_batch *b, int32_t i) {
    llama_result r = LLAMA_ERR_MEMORY;
    if (!(b->cap[i] = malloc(sizeof *b->cap[i])))
        snprintf(e->err, sizeof e->err, "cannot allocate a capture");
    else if ((r = capture_init(e, n, b->cap[i])) != LLAMA_OK)
        free(b->cap[i]), b->cap[i] = NULL;
    else
        r = gpu_llama_capture(g, b->seq[i], b->cap[i], e->err, sizeof e->err);
    return r;
}

static void gpu_capture_free(gpu_batch *b, int32_t i) {
    if (b->cap[i]) llama_capture_free(b->cap[i]);
    free(b->cap[i]);
    b->cap[i] = NULL;
}

/* Runs every text through g, up to b's capacity at once, sequences joining as others end. */
static llama_result gpu_pass(eval *e, gpu_llama *g, gpu_text *texts, int64_t n_texts,
                             int32_t capacity, gpu_batch *b, bool reference, evict_driver *ev) {
    const llama_tokenizer *tok = &e->model->tokenizer;
    int64_t next = 0, done = 0, scored = 0;
    progress prog;
    llama_result r = LLAMA_OK;
    progress_init(&prog, n_texts);
    b->n = 0;
    while (r == LLAMA_OK) {
        for (; b->n < capacity && next < n_texts; next++) {
            if (texts[next].n < 2) { /* an empty text has nothing to predict */
                done++;
                continue;
            }
            if ((r = gpu_llama_seq_start(g, &b->seq[b->n], e->err, sizeof e->err)) != LLAMA_OK)
                return r;
            b->text[b->n] = (int32_t)next;
            if (ev) {
                evict_seq_start(ev, &b->ev[b->n], texts[next].ids, texts[next].requests,
                                texts[next].n_requests);
                b->ev[b->n].id = next;
            }
            if (!reference && e->transferring && e->transfer.mode == TRANSFER_TIERED &&
                (r = gpu_llama_observe(g, b->seq[b->n], GPU_LLAMA_OBSERVE_ATTENTION, e->err,
                                       sizeof e->err)) != LLAMA_OK)
                return r;
            if (!reference && e->opt->capture_dir != NULL &&
                (r = gpu_capture_start(e, g, texts[next].n, b, b->n)) != LLAMA_OK)
                return r;
            b->pos[b->n++] = 0;
        }
        if (b->n == 0) break;
        for (int32_t i = 0; i < b->n && r == LLAMA_OK; i++) {
            const gpu_text *t = &texts[b->text[i]];
            if (llama_is_message_start(tok, t->ids, t->n, b->pos[i], "user"))
                r = gpu_llama_begin_request(g, b->seq[i], e->err, sizeof e->err);
            if (r == LLAMA_OK && ev) {
                evict_backend be = evict_backend_gpu(g, b->seq[i]);
                r = evict_before_step(ev, &b->ev[i], &be, b->pos[i], e->err, sizeof e->err);
            }
            if (r == LLAMA_OK && !reference && e->transferring && b->pos[i] == t->transfer_at) {
                r = hand_over(e, g, b, i);
                if (r == LLAMA_OK && b->cap[i]) /* recorded on from the receiving sequence */
                    r = gpu_llama_capture(g, b->seq[i], b->cap[i], e->err, sizeof e->err);
            }
            b->tokens[i] = t->ids[b->pos[i]];
        }
        if (r == LLAMA_OK)
            r = gpu_llama_step(g, b->seq, b->tokens, b->n, b->logits, e->err, sizeof e->err);
        if (r != LLAMA_OK) break;
        gpu_score_step(e, texts, b, reference);
        scored += b->n;
        for (int32_t i = 0; i < b->n;) {
            gpu_text *t = &texts[b->text[i]];
            llama_kv_stats held;
            gpu_llama_seq_stats(g, b->seq[i], &held);
            if (!reference) t->bytes_read += (double)held.bytes;
            if (++b->pos[i] + 1 < t->n) {
                i++;
                continue;
            }
            t->stats = held;
            t->stats.assigned_bits = gpu_llama_seq_assigned_bits(g, b->seq[i], &e->tag_prices);
            if (ev) {
                evict_backend be = evict_backend_gpu(g, b->seq[i]);
                evict_seq_end(ev, &b->ev[i], &be);
            }
            if (b->cap[i]) {
                r = capture_write(e, b->text[i], b->cap[i]);
                gpu_capture_free(b, i);
                if (r != LLAMA_OK) return r;
            }
            gpu_llama_seq_end(g, b->seq[i]);
            done++;
            gpu_batch_remove(b, i);
        }
        progress_show(&prog, done, scored);
    }
    return r;
}

static void gpu_texts_free(gpu_text *texts, int64_t n) {
    for (int64_t i = 0; texts != NULL && i < n; i++) {
        free(texts[i].ids);
        free(texts[i].mask);
        free(texts[i].ref_argmax);
        free(texts[i].tops);
        free(texts[i].requests);
        free(texts[i].recall);
    }
    free(texts);
}

/* recall[p]: position p lies in a user turn whose message starts with "Earlier" (up to the next
   user message). */
static void mark_recall_turns(const llama_tokenizer *tok, const int32_t *ids, int64_t n,
                              uint8_t *recall) {
    bool on = false;
    for (int64_t p = 0; p < n; p++) {
        if (llama_is_message_start(tok, ids, n, p, "user"))
            on = llama_message_opens_with(tok, ids, n, p, "user", "Earlier");
        recall[p] = on;
    }
}

/* Tokens, masks and buffers of every text; with a tag spec, its requests. */
static gpu_text *gpu_texts_make(eval *e, const texts *list) {
    gpu_text *texts = calloc((size_t)(list->n > 0 ? list->n : 1), sizeof *texts);
    for (int64_t i = 0; texts != NULL && i < list->n; i++) {
        gpu_text *t = &texts[i];
        t->n = encode_text(e, list->items[i]);
        t->ids = malloc((size_t)(t->n > 0 ? t->n : 1) * sizeof *t->ids);
        t->mask = malloc((size_t)(t->n > 0 ? t->n : 1));
        t->ref_argmax = malloc((size_t)(t->n > 0 ? t->n : 1) * sizeof *t->ref_argmax);
        t->tops = malloc((size_t)(t->n > 0 ? t->n : 1) * sizeof *t->tops);
        if (t->n < 0 || !t->ids || !t->mask || !t->ref_argmax || !t->tops) {
            gpu_texts_free(texts, list->n);
            return NULL;
        }
        memcpy(t->ids, e->ids, (size_t)t->n * sizeof *t->ids);
        llama_mark_answer_tokens(&e->model->tokenizer, t->ids, t->n, t->mask);
        t->recall = malloc((size_t)(t->n > 0 ? t->n : 1));
        t->requests = malloc((size_t)(t->n > 0 ? t->n : 1) * sizeof *t->requests);
        if (!t->recall || !t->requests ||
            (e->tag_doc && evict_plan(&e->tag_doc->spec, t->ids, t->n, t->requests, (int32_t)t->n,
                                      &t->n_requests, e->err, sizeof e->err) != LLAMA_OK)) {
            gpu_texts_free(texts, list->n);
            return NULL;
        }
        mark_recall_turns(&e->model->tokenizer, t->ids, t->n, t->recall);
        t->transfer_at = transfer_point(t->requests, t->n_requests, t->n - 1);
    }
    return texts;
}

/* Eviction states of a pass's running sequences (attention buffers for H2O), or NULL. */
static evict_seq *evict_seqs_make(const kvmix_policy *policy, int32_t capacity,
                                  int32_t max_tokens) {
    evict_seq *seqs = calloc((size_t)capacity, sizeof *seqs);
    for (int32_t i = 0; seqs && policy->evict.scorer == KVMIX_EVICT_H2O && i < capacity; i++)
        if (!(seqs[i].mass = malloc((size_t)max_tokens * sizeof(float)))) {
            for (int32_t j = 0; j < i; j++) free(seqs[j].mass);
            free(seqs);
            return NULL;
        }
    return seqs;
}

static void evict_seqs_free(evict_seq *seqs, int32_t capacity) {
    for (int32_t i = 0; seqs && i < capacity; i++) {
        free(seqs[i].mass);
        evict_seq_release(&seqs[i]); /* a pass stopped by an error: the running ones' rows */
    }
    free(seqs);
}

/* A pass of `policy` on a fresh gpu_llama (evicting when the policy says so and this is not the
   reference pass). */
static llama_result gpu_run_policy(eval *e, const kvmix_policy *policy, gpu_text *texts,
                                   int64_t n_texts, int32_t capacity, gpu_batch *b, bool reference,
                                   char *device, size_t device_bytes, evict_stats *eviction) {
    int32_t max_tokens = e->model->config.context + 1;
    gpu_llama *g = NULL;
    evict_driver *ev = NULL;
    bool evicting = !reference && policy->evict.scorer != 0;
    llama_result r =
        gpu_llama_create(e->model, policy, capacity, max_tokens, 0, &g, e->err, sizeof e->err);
    if (r == LLAMA_OK) /* a figure must not depend on --batch */
        r = gpu_llama_batch_invariant(g, true, e->err, sizeof e->err);
    if (r == LLAMA_OK && !reference && e->tagged)
        r = gpu_llama_tag(g, &e->tag_doc->spec, &e->tag_table, e->err, sizeof e->err);
    if (r == LLAMA_OK && evicting)
        r = evict_driver_create(&policy->evict, &e->model->config, capacity, max_tokens, &ev,
                                e->err, sizeof e->err);
    if (r == LLAMA_OK && evicting && e->evict_log) evict_driver_log(ev, log_eviction, e->evict_log);
    if (r == LLAMA_OK && evicting) r = evict_driver_extras(e, ev);
    b->ev = NULL;
    if (r == LLAMA_OK && evicting && !(b->ev = evict_seqs_make(policy, capacity, max_tokens))) {
        snprintf(e->err, sizeof e->err, "cannot allocate eviction buffers");
        r = LLAMA_ERR_MEMORY;
    }
    if (r == LLAMA_OK) {
        snprintf(device, device_bytes, "%s", gpu_llama_device_name(g));
        r = gpu_pass(e, g, texts, n_texts, capacity, b, reference, ev);
    }
    if (ev) evict_driver_stats(ev, eviction);
    evict_seqs_free(b->ev, capacity);
    b->ev = NULL;
    evict_driver_free(ev);
    gpu_llama_free(g);
    return r;
}

/* The texts on the GPU: the fp32 reference pass (unless the policy is fp32), then the policy's;
 * totals folded in text order, as run_texts does. */
static llama_result run_texts_gpu(eval *e, const texts *list, totals *t, char *device,
                                  size_t device_bytes) {
    int32_t capacity = (int32_t)(list->n < e->opt->batch ? list->n : e->opt->batch);
    int32_t vocab = e->model->config.vocab;
    if (capacity < 1) return LLAMA_OK;
    gpu_text *texts = gpu_texts_make(e, list);
    gpu_batch b = {0};
    b.text = malloc((size_t)capacity * sizeof *b.text);
    b.seq = malloc((size_t)capacity * sizeof *b.seq);
    b.pos = malloc((size_t)capacity * sizeof *b.pos);
    b.tokens = malloc((size_t)capacity * sizeof *b.tokens);
    b.logits = malloc((size_t)capacity * (size_t)vocab * sizeof *b.logits);
    b.cap = calloc((size_t)capacity, sizeof *b.cap);
    llama_result r = LLAMA_OK;
    if (!texts || !b.text || !b.seq || !b.pos || !b.tokens || !b.logits || !b.cap) {
        snprintf(e->err, sizeof e->err, "cannot allocate the texts' buffers");
        r = LLAMA_ERR_MEMORY;
    }
    for (int64_t i = 0; r == LLAMA_OK && e->reference_tops && i < list->n; i++)
        if (!read_reference_tops(e, texts[i].ref_argmax, texts[i].n - 1)) r = LLAMA_ERR_FORMAT;
    if (r == LLAMA_OK && e->separate_reference && !e->reference_tops)
        r = gpu_run_policy(e, kvmix_kv_policy_builtin("fp32"), texts, list->n, capacity, &b, true,
                           device, device_bytes, &t->eviction);
    if (r == LLAMA_OK)
        r = gpu_run_policy(e, &e->policy, texts, list->n, capacity, &b, false, device, device_bytes,
                           &t->eviction);
    t->gpu = true;
    t->evicting = e->policy.evict.scorer != 0;
    for (int64_t i = 0; r == LLAMA_OK && i < list->n; i++) {
        const gpu_text *x = &texts[i];
        if (x->n < 2) continue;
        if (!write_tops(e, x->tops, x->n - 1)) r = LLAMA_ERR_FORMAT;
        distance_scores_add(&t->by_distance, &list->questions[i], x->ids, x->tops, x->ref_argmax,
                            x->n);
        t->score.bits += x->score.bits;
        t->score.n_scored += x->score.n_scored;
        t->score.n_answer += x->score.n_answer;
        t->score.n_answer_correct += x->score.n_answer_correct;
        t->score.n_answer_agree += x->score.n_answer_agree;
        if (x->stats.bytes > t->kv_bytes_max) t->kv_bytes_max = x->stats.bytes;
        add_held(t, &x->stats);
        t->n_texts++;
        t->bytes_read += x->bytes_read;
        t->recall.bits += x->recall_score.bits;
        t->recall.n_answer += x->recall_score.n_answer;
        t->recall.n_answer_correct += x->recall_score.n_answer_correct;
        t->recall.n_answer_agree += x->recall_score.n_answer_agree;
        t->after.bits += x->after.bits;
        t->after.n_scored += x->after.n_scored;
        t->after.n_answer += x->after.n_answer;
        t->after.n_answer_correct += x->after.n_answer_correct;
        t->after.n_answer_agree += x->after.n_answer_agree;
    }
    t->transferring = e->transferring;
    t->transfer = e->transfer_stats;
    gpu_texts_free(texts, list->n);
    for (int32_t i = 0; b.cap && i < capacity; i++) gpu_capture_free(&b, i); /* a failed pass's */
    free(b.cap);
    free(b.text);
    free(b.seq);
    free(b.pos);
    free(b.tokens);
    free(b.logits);
    return r;
}
#endif

static double ratio_or_nan(int64_t num, int64_t den) {
    return den > 0 ? (double)num / (double)den : NAN;
}

static void add_number_or_null(cJSON *obj, const char *key, double value) {
    if (!isnan(value))
        cJSON_AddNumberToObject(obj, key, value);
    else
        cJSON_AddNullToObject(obj, key);
}

static void add_score(cJSON *obj, const llama_score *s) {
    cJSON_AddNumberToObject(obj, "n_tokens", (double)s->n_scored);
    add_number_or_null(obj, "bits_per_token",
                       s->n_scored > 0 ? s->bits / (double)s->n_scored : NAN);
    cJSON_AddNumberToObject(obj, "n_answer_tokens", (double)s->n_answer);
    add_number_or_null(obj, "answer_accuracy", ratio_or_nan(s->n_answer_correct, s->n_answer));
    add_number_or_null(obj, "answer_agreement", ratio_or_nan(s->n_answer_agree, s->n_answer));
}

/* What the hand-overs sent and how the texts went on after them. */
static void add_transfer_figures(cJSON *obj, const totals *t) {
    const transfer_stats *s = &t->transfer;
    cJSON *x = cJSON_AddObjectToObject(obj, "transfer");
    cJSON_AddNumberToObject(x, "n_transfers", (double)s->n_transfers);
    cJSON_AddNumberToObject(x, "n_tokens_sent", (double)s->n_tokens);
    cJSON_AddNumberToObject(x, "n_fp16", (double)s->n_fp16);
    cJSON_AddNumberToObject(x, "n_int8", (double)s->n_int8);
    cJSON_AddNumberToObject(x, "n_int4", (double)s->n_int4);
    cJSON_AddNumberToObject(x, "n_dropped", (double)s->n_dropped);
    cJSON_AddNumberToObject(x, "payload_bytes", s->bytes);
    cJSON_AddNumberToObject(x, "fp16_payload_bytes", s->fp16_bytes);
    add_number_or_null(x, "realized_budget", s->fp16_bytes > 0 ? s->bytes / s->fp16_bytes : NAN);
    add_score(cJSON_AddObjectToObject(x, "after"), &t->after);
}

/* The GPU runner's figures: bytes read per token, the recall turns, the hand-overs. */
static void add_gpu_figures(cJSON *obj, const totals *t) {
    add_number_or_null(obj, "kv_bytes_read_per_token",
                       t->score.n_scored > 0 ? t->bytes_read / (double)t->score.n_scored : NAN);
    cJSON *recall = cJSON_AddObjectToObject(obj, "recall");
    cJSON_AddNumberToObject(recall, "n_answer_tokens", (double)t->recall.n_answer);
    add_number_or_null(recall, "answer_accuracy",
                       ratio_or_nan(t->recall.n_answer_correct, t->recall.n_answer));
    add_number_or_null(recall, "answer_agreement",
                       ratio_or_nan(t->recall.n_answer_agree, t->recall.n_answer));
    add_number_or_null(recall, "answer_bits_per_token",
                       t->recall.n_answer > 0 ? t->recall.bits / (double)t->recall.n_answer : NAN);
}

/* What eviction did (either runner). */
static void add_eviction_figures(cJSON *obj, const totals *t) {
    const evict_stats *s = &t->eviction;
    cJSON *ev = cJSON_AddObjectToObject(obj, "eviction");
    cJSON_AddNumberToObject(ev, "n_evictions", (double)s->n_evictions);
    cJSON_AddNumberToObject(ev, "evicted_tokens", (double)s->evicted_tokens);
    add_number_or_null(ev, "live_tokens_peak_mean",
                       s->n_seqs > 0 ? (double)s->live_peak_sum / (double)s->n_seqs : NAN);
    cJSON_AddNumberToObject(ev, "bytes_freed", s->bytes_freed);
}

static bool print_report(const options *o, const llama_model *m, const kvmix_policy *p,
                         const totals *t, double seconds, const char *device) {
    cJSON *obj = cJSON_CreateObject();
    cJSON_AddStringToObject(obj, "device", device);
    if (o->tag_spec_path != NULL) {
        cJSON_AddStringToObject(obj, "tag_spec", o->tag_spec_path);
        if (o->allocation_path != NULL)
            cJSON_AddStringToObject(obj, "allocation", o->allocation_path);
    }
    cJSON_AddStringToObject(obj, "model", o->model_path);
    cJSON_AddStringToObject(obj, "model_name", m->config.name);
    cJSON_AddStringToObject(obj, "data", o->data_path);
    if (o->kind != NULL)
        cJSON_AddStringToObject(obj, "kind", o->kind);
    else
        cJSON_AddNullToObject(obj, "kind");
    cJSON_AddNumberToObject(obj, "offset", (double)o->offset);
    add_number_or_null(obj, "limit", o->limit > 0 ? (double)o->limit : NAN);
    char *policy_text = kvmix_kv_policy_json(p);
    const char *end = NULL;
    cJSON *policy = policy_text != NULL
                        ? cJSON_ParseWithLengthOpts(policy_text, strlen(policy_text), &end, 0)
                        : NULL;
    free(policy_text);
    if (policy == NULL || !cJSON_AddItemToObject(obj, "policy", policy)) {
        cJSON_Delete(policy);
        cJSON_Delete(obj);
        return false;
    }
    cJSON_AddNumberToObject(obj, "n_texts", (double)t->n_texts);
    cJSON_AddNumberToObject(obj, "n_tokens", (double)t->score.n_scored);
    add_number_or_null(obj, "bits_per_token",
                       t->score.n_scored > 0 ? t->score.bits / (double)t->score.n_scored : NAN);
    cJSON_AddNumberToObject(obj, "n_answer_tokens", (double)t->score.n_answer);
    add_number_or_null(obj, "answer_accuracy",
                       ratio_or_nan(t->score.n_answer_correct, t->score.n_answer));
    add_number_or_null(obj, "answer_agreement",
                       ratio_or_nan(t->score.n_answer_agree, t->score.n_answer));
    cJSON_AddNumberToObject(obj, "kv_bytes", (double)t->kv_bytes_max);
    add_number_or_null(obj, "avg_bits",
                       t->held_tokens > 0 ? t->avg_bits_sum / (double)t->held_tokens : NAN);
    add_number_or_null(obj, "packed_bits",
                       t->packed_tokens > 0 ? t->packed_bits_sum / (double)t->packed_tokens : NAN);
    if (o->allocation_path != NULL)
        add_number_or_null(obj, "assigned_bits",
                           t->packed_tokens > 0 ? t->assigned_bits_sum / (double)t->packed_tokens
                                                : NAN);
    if (t->gpu) add_gpu_figures(obj, t);
    if (t->transferring) add_transfer_figures(obj, t);
    if (t->evicting) add_eviction_figures(obj, t);
    distance_scores_to_json(&t->by_distance, obj);
    cJSON_AddNumberToObject(obj, "threads", o->n_threads);
    cJSON_AddNumberToObject(obj, "seconds", seconds);
    cJSON_AddNumberToObject(obj, "tokens_per_second",
                            seconds > 0 ? (double)t->score.n_scored / seconds : 0.0);
    char *text = cJSON_Print(obj);
    bool ok = text != NULL;
    if (ok) printf("%s\n", text);
    free(text);
    cJSON_Delete(obj);
    return ok;
}

/* Validates a capture with the library reader and prints its shape as JSON. */
static int read_capture(const char *path) {
    size_t n_bytes;
    char err[ERR_BYTES];
    char *bytes = llama_read_text(path, &n_bytes);
    if (bytes == NULL) {
        fprintf(stderr, "kvmix-eval: cannot read %s\n", path);
        return 1;
    }
    llama_capture cap;
    llama_result r = llama_capture_parse((const uint8_t *)bytes, n_bytes, &cap, err, sizeof err);
    free(bytes);
    if (r != LLAMA_OK) {
        fprintf(stderr, "kvmix-eval: %s: %s\n", path, err);
        return 1;
    }
    cJSON *obj = cJSON_CreateObject();
    cJSON_AddStringToObject(obj, "capture", path);
    const struct {
        const char *key;
        int32_t value;
    } fields[] = {{"n_layers", cap.n_layers},
                  {"n_heads", cap.n_heads},
                  {"n_kv_heads", cap.n_kv_heads},
                  {"head_dim", cap.head_dim},
                  {"n_tokens", cap.n_tokens}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        cJSON_AddNumberToObject(obj, fields[i].key, fields[i].value);
    char *text = cJSON_PrintUnformatted(obj);
    if (text != NULL) printf("%s\n", text);
    free(text);
    cJSON_Delete(obj);
    llama_capture_free(&cap);
    return 0;
}

/* One line per built-in: its resolved settings as the JSON object a policy file would hold
 * (n_boost 0 with a boost_fraction: resolved against each model's head_dim when it runs). */
static bool list_policies(void) {
    for (int32_t i = 0; i < kvmix_kv_policy_count(); i++) {
        char *text = kvmix_kv_policy_json(kvmix_kv_policy_at(i));
        if (text == NULL) return false;
        printf("%s\n", text);
        free(text);
    }
    return true;
}

static llama_result eval_init(eval *e, const options *o, const kvmix_policy *p,
                              const llama_model *m) {
    int64_t capacity = (int64_t)m->config.context + 1;
    e->opt = o;
    e->model = m;
    e->separate_reference = p->key_format != KVMIX_KV_FORMAT_FP32;
    e->ids = malloc((size_t)capacity * sizeof *e->ids);
    e->mask = malloc((size_t)capacity);
    e->ref_argmax = malloc((size_t)capacity * sizeof *e->ref_argmax);
    e->tops = malloc((size_t)capacity * sizeof *e->tops);
    if (e->ids == NULL || e->mask == NULL || e->ref_argmax == NULL || e->tops == NULL) {
        snprintf(e->err, sizeof e->err, "cannot allocate token buffers");
        return LLAMA_ERR_MEMORY;
    }
    llama_result r =
        kvmix_kv_policy_resolve(p, m->config.head_dim, &e->policy, e->err, sizeof e->err);
    if (r == LLAMA_OK && o->tops_path != NULL &&
        (e->tops_file = fopen(o->tops_path, "w")) == NULL) {
        snprintf(e->err, sizeof e->err, "--tops %s: cannot open", o->tops_path);
        return LLAMA_ERR_ARGUMENT;
    }
    if (r == LLAMA_OK && o->reference_tops != NULL && !e->separate_reference) {
        snprintf(e->err, sizeof e->err, "--reference-tops: an fp32 policy is its own reference");
        return LLAMA_ERR_ARGUMENT;
    }
    if (r == LLAMA_OK && o->reference_tops != NULL &&
        (e->reference_tops = fopen(o->reference_tops, "r")) == NULL) {
        snprintf(e->err, sizeof e->err, "--reference-tops %s: cannot open", o->reference_tops);
        return LLAMA_ERR_ARGUMENT;
    }
    if (r != LLAMA_OK || o->cuda) return r; /* the GPU runner builds its own caches */
    r = llama_runner_init(&e->runner, m, o->n_threads, e->err, sizeof e->err);
    if (r == LLAMA_OK)
        r = kvmix_kv_create(&e->policy, &m->config, capacity, &e->cache, e->err, sizeof e->err);
    if (r == LLAMA_OK && e->separate_reference && !e->reference_tops &&
        (r = llama_kv_fp32_create(&m->config, capacity, &e->reference)) != LLAMA_OK)
        snprintf(e->err, sizeof e->err, "cannot create the reference cache: %s",
                 llama_result_string(r));
    return r;
}

/* --tag-spec and --allocation: the policy's cache stores each token by its tag. */
static llama_result tag_cache(eval *e, const options *o) {
    static tag_spec_doc doc; /* large: kept off the stack */
    kvmix_tag_precision table;
    kvmix_cache_precision fallback = {(uint8_t)e->policy.key_format,
                                      (uint8_t)e->policy.value_format};
    char why[ERR_BYTES - 64];
    if (tag_spec_load(o->tag_spec_path, &doc, why, sizeof why) != KVMIX_SUCCESS ||
        (o->allocation_path != NULL &&
         (tag_allocation_load(o->allocation_path, fallback, &table, why, sizeof why) !=
              KVMIX_SUCCESS ||
          tag_allocation_prices_load(o->allocation_path, &e->tag_prices, why, sizeof why) !=
              KVMIX_SUCCESS))) {
        snprintf(e->err, sizeof e->err, "%s", why);
        return LLAMA_ERR_FORMAT;
    }
    e->tag_doc = &doc;
    if (o->allocation_path == NULL) return LLAMA_OK; /* the tags serve eviction only */
    e->tagged = true;
    e->tag_table = table;
    /* the GPU runner applies them to its own cache (gpu_run_policy) */
    return o->cuda
               ? LLAMA_OK
               : kvmix_kv_tag(&e->cache, &doc.spec, &table, &e->tag_prices, e->err, sizeof e->err);
}

/* A policy that evicts: the driver of the CPU runner (the GPU runner makes its own per pass). Its
   session store holds as many sessions as the GPU runner's (a text's session is keyed by its
   first user message, which texts may share). */
static llama_result evict_init(eval *e, const options *o, int64_t n_texts) {
    int32_t capacity = e->model->config.context + 1;
    int32_t sessions = (int32_t)(n_texts < o->batch ? (n_texts > 0 ? n_texts : 1) : o->batch);
    if (e->tag_doc == NULL) {
        snprintf(e->err, sizeof e->err,
                 "policy %s evicts: that needs --tag-spec (its tags find the requests)",
                 e->policy.name);
        return LLAMA_ERR_ARGUMENT;
    }
    if (o->evict_log != NULL && (e->evict_log = fopen(o->evict_log, "w")) == NULL) {
        snprintf(e->err, sizeof e->err, "--evict-log %s: cannot be written", o->evict_log);
        return LLAMA_ERR_IO;
    }
    if (o->residual_path != NULL && intent_residual_load(o->residual_path, &e->residual, e->err,
                                                         sizeof e->err) != KVMIX_SUCCESS)
        return LLAMA_ERR_FORMAT;
    if (o->rows_path != NULL && (e->rows_file = fopen(o->rows_path, "w")) == NULL) {
        snprintf(e->err, sizeof e->err, "--residual-rows %s: cannot be written", o->rows_path);
        return LLAMA_ERR_IO;
    }
    e->rows_rate = o->rows_rate;
    if (e->rows_file) write_rows_header(e->rows_file);
    if (o->cuda) return LLAMA_OK;
    if (e->policy.key_format == KVMIX_KV_FORMAT_FP32) {
        snprintf(e->err, sizeof e->err, "policy %s evicts: the fp32 cache cannot (a kvmix one can)",
                 e->policy.name);
        return LLAMA_ERR_ARGUMENT;
    }
    llama_result r = evict_driver_create(&e->policy.evict, &e->model->config, sessions, capacity,
                                         &e->evict, e->err, sizeof e->err);
    e->requests = malloc((size_t)capacity * sizeof *e->requests);
    if (e->policy.evict.scorer == KVMIX_EVICT_H2O)
        e->evict_seq.mass = malloc((size_t)capacity * sizeof *e->evict_seq.mass);
    if (r == LLAMA_OK && e->evict_log) evict_driver_log(e->evict, log_eviction, e->evict_log);
    if (r == LLAMA_OK) r = evict_driver_extras(e, e->evict);
    if (r == LLAMA_OK && (e->requests == NULL || (e->policy.evict.scorer == KVMIX_EVICT_H2O &&
                                                  e->evict_seq.mass == NULL))) {
        snprintf(e->err, sizeof e->err, "cannot allocate eviction buffers");
        r = LLAMA_ERR_MEMORY;
    }
    return r;
}

static void eval_free(eval *e) {
    evict_driver_free(e->evict);
    if (e->evict_log != NULL) fclose(e->evict_log);
    if (e->rows_file != NULL) fclose(e->rows_file);
    intent_residual_free(&e->residual);
    free(e->requests);
    free(e->evict_seq.mass);
    evict_seq_release(&e->evict_seq);
    if (e->cache.destroy != NULL) e->cache.destroy(e->cache.state);
    if (e->reference.destroy != NULL) e->reference.destroy(e->reference.state);
    if (e->runner.model != NULL) llama_runner_free(&e->runner);
    free(e->ids);
    free(e->mask);
    free(e->ref_argmax);
    free(e->tops);
    if (e->tops_file != NULL) fclose(e->tops_file);
    if (e->reference_tops != NULL) fclose(e->reference_tops);
}

/* --transfer: the setup, checked against the policy. */
static llama_result transfer_init(eval *e, const options *o) {
    if (transfer_parse(o->transfer, &e->transfer, e->err, sizeof e->err) != KVMIX_SUCCESS)
        return LLAMA_ERR_ARGUMENT;
    if (e->policy.evict.scorer != 0 || strcmp(e->policy.name, "fp32") == 0) {
        snprintf(e->err, sizeof e->err, "--transfer needs a kvmix policy that does not evict");
        return LLAMA_ERR_ARGUMENT;
    }
    e->transfer.n_sink = SINK_POSITIONS;
    e->transfer.allow_int4 = 1;
    e->transferring = true;
    if (o->cuda || e->requests) return LLAMA_OK;
    /* the CPU runner finds each text's hand-over point by its requests */
    e->requests = malloc(((size_t)e->model->config.context + 1) * sizeof *e->requests);
    if (e->requests) return LLAMA_OK;
    snprintf(e->err, sizeof e->err, "cannot allocate the transfer's buffers");
    return LLAMA_ERR_MEMORY;
}

static int run(const options *o) {
    llama_model model;
    eval e = {0};
    kvmix_policy p;
    if (!load_policy(o->policy, &p, e.err)) {
        fprintf(stderr, "kvmix-eval: %s\n", e.err);
        return 2;
    }
    texts list = {NULL, NULL, 0};
    totals t = {0};
    double start = now_seconds();
    llama_result r = llama_model_load(o->model_path, &model, e.err, sizeof e.err);
    if (r != LLAMA_OK) {
        fprintf(stderr, "kvmix-eval: %s: %s\n", o->model_path, e.err);
        return 1;
    }
    if (!load_texts(o, &list, e.err)) r = LLAMA_ERR_FORMAT;
    if (r == LLAMA_OK) r = eval_init(&e, o, &p, &model);
    if (r == LLAMA_OK && o->tag_spec_path != NULL) r = tag_cache(&e, o);
    if (r == LLAMA_OK && o->transfer != NULL) r = transfer_init(&e, o);
    if (r == LLAMA_OK && e.policy.evict.scorer != 0) r = evict_init(&e, o, list.n);
    if (r == LLAMA_OK && e.policy.evict.scorer == 0 &&
        (o->evict_log != NULL || o->residual_path != NULL || o->rows_path != NULL)) {
        snprintf(e.err, sizeof e.err,
                 "--evict-log, --residual and --residual-rows need a policy that evicts");
        r = LLAMA_ERR_ARGUMENT;
    }
    char device[256] = "cpu";
#ifdef KVMIX_EVAL_CUDA
    if (r == LLAMA_OK && o->cuda) r = run_texts_gpu(&e, &list, &t, device, sizeof device);
#endif
    if (r == LLAMA_OK && !o->cuda) r = run_texts(&e, &list, &t);
    if (r == LLAMA_OK && e.reference_tops && !reference_tops_done(&e)) r = LLAMA_ERR_FORMAT;
    if (e.evict != NULL) {
        t.evicting = true;
        evict_driver_stats(e.evict, &t.eviction);
    }
    if (r == LLAMA_OK && !print_report(o, &model, &e.policy, &t, now_seconds() - start, device))
        r = LLAMA_ERR_MEMORY;
    if (r != LLAMA_OK) fprintf(stderr, "kvmix-eval: %s\n", e.err);
    eval_free(&e);
    texts_free(&list);
    llama_model_free(&model);
    return r == LLAMA_OK ? 0 : 1;
}

int main(int argc, char **argv) {
    options o;
    if (!parse_options(argc, argv, &o)) {
        usage(stderr);
        return 2;
    }
    if (o.list_policies) return list_policies() ? 0 : 1;
    if (o.read_capture_path != NULL) return read_capture(o.read_capture_path);
    return run(&o);
}
