/* kvmix-probe: the INT4 tolerance probe of a model (kvmix_tier_probe), its verdict as the JSON
 * document of tier_probe.h.
 *
 *   kvmix-probe --model M.safetensors --data D.jsonl [--trials 3] [--pass 2] [--budget 0.35]
 *               [--seed N] [--out FILE] [--threads N]
 *
 * A trial is a needle question answered after a tiered transfer: an agent trace of the data file
 * up to one of its recall questions (a user message that starts "Earlier", asking what an
 * earlier tool result held, the needle, at whatever depth the trace put it), prefilled with an
 * fp16 kvmix cache (llama.h, CPU). Its rows are tiered at the budget with INT4 allowed
 * (transfer_plan.h: the key/value-norm statistic, recency decay 0.005, 4 sinks), sent through
 * payloads and back and ingested by a second cache (kvmix_kv_ingest). The model then answers
 * greedily on both caches, up to its <|im_end|> or 96 tokens; the trial passes when the answers
 * are the same tokens. Trial k takes the (seed + k)-th trace that has a recall question (in file
 * order, wrapping) and a recall question of it chosen by seed + k. INT4 is allowed when at least
 * --pass of --trials pass (the paper: 2 of 3 at b = 0.3 in its nominal costs; 0.35 here is that
 * in real bytes with metadata, INT4 at 0.3125 of FP16). One line per trial goes to stderr; the
 * document goes to --out or stdout. Exit status 0 when the probe ran (whatever its verdict), 1
 * when it could not, 2 for bad options.
 */
#define _POSIX_C_SOURCE 200809L
#include "kvmix_kv.h"
#include "llama.h"
#include "tier_probe.h"
#include "transfer_plan.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_ANSWER = 96, N_SINKS = 4 };
#define LAMBDA 0.005

typedef struct options {
    const char *model, *data, *out;
    int32_t trials, pass, threads;
    int64_t seed;
    double budget;
} options;

typedef struct trace {
    int32_t *ids;
    int64_t n;
} trace;

typedef struct probe {
    const options *opt;
    const llama_model *model;
    llama_runner runner;
    trace *traces; /* the traces with a recall question */
    int64_t n_traces;
    float *logits;
    char err[256];
} probe;

/* Where the answer to a recall question starts: after "<|im_start|>assistant\n" that follows
 * the user message at `user`; -1 when there is none. */
static int64_t answer_start(const probe *p, const trace *t, int64_t user) {
    const llama_tokenizer *tok = &p->model->tokenizer;
    for (int64_t i = user + 1; i < t->n; i++) {
        int64_t text = llama_message_text(tok, t->ids, t->n, i, "assistant");
        if (text >= 0) return text < t->n ? text : -1;
    }
    return -1;
}

/* The positions where the trace's recall questions start (user messages that open "Earlier"). */
static int64_t recall_questions(const probe *p, const trace *t, int64_t *out) {
    const llama_tokenizer *tok = &p->model->tokenizer;
    int64_t n = 0;
    for (int64_t i = 0; i < t->n; i++)
        if (llama_message_opens_with(tok, t->ids, t->n, i, "user", "Earlier") &&
            answer_start(p, t, i) > 0)
            out[n++] = i;
    return n;
}

/* Greedy answer from the logits the prompt left: up to <|im_end|> (kept) or MAX_ANSWER tokens. */
static int64_t answer(probe *p, llama_kv_cache *cache, const float *first_logits, int64_t pos,
                      int32_t *out) {
    int32_t vocab = p->model->config.vocab,
            end = llama_special_id(&p->model->tokenizer, "<|im_end|>");
    int32_t token = llama_argmax(first_logits, vocab);
    int64_t n = 0;
    while (n < MAX_ANSWER) {
        out[n++] = token;
        if (token == end || llama_forward(&p->runner, cache, token, pos++, p->logits, p->err,
                                          sizeof p->err) != LLAMA_OK)
            break;
        token = llama_argmax(p->logits, vocab);
    }
    return n;
}

/* The prompt's rows, tiered, through payloads and back, into a fresh cache. */
static bool transferred_cache(probe *p, llama_kv_cache *from, int64_t n, llama_kv_cache *to,
                              kvmix_tier_plan *plan) {
    const llama_config *c = &p->model->config;
    size_t floats = (size_t)c->n_layers * (size_t)n * (size_t)(c->n_kv_heads * c->head_dim);
    size_t layer = floats / (size_t)c->n_layers, bytes = 0;
    float *keys = malloc(floats * sizeof *keys), *values = malloc(floats * sizeof *values);
    uint8_t *tiers = malloc((size_t)n);
    transfer_setup s = {TRANSFER_NORMS, p->opt->budget, LAMBDA, N_SINKS, 1, 0, 0};
    bool ok =
        keys && values && tiers && kvmix_kv_rows_read(from, n, keys, values) == LLAMA_OK &&
        transfer_choose(&s, NULL, keys, values, c->n_layers, (int32_t)n, c->n_kv_heads, c->head_dim,
                        tiers, plan, p->err, sizeof p->err) == KVMIX_SUCCESS &&
        plan->n_dropped == 0 &&
        transfer_round_trip(tiers, 0, keys, values, c->n_layers, (int32_t)n, c->n_kv_heads,
                            c->head_dim, &bytes, NULL, p->err, sizeof p->err) == KVMIX_SUCCESS &&
        kvmix_kv_create(kvmix_kv_policy_builtin("fp16"), c, n + MAX_ANSWER + 1, to, p->err,
                        sizeof p->err) == LLAMA_OK;
    for (int32_t l = 0; ok && l < c->n_layers; l++)
        ok = kvmix_kv_ingest(to, l, 0, n, keys + l * layer, values + l * layer) == LLAMA_OK;
    if (ok && plan->n_dropped > 0) snprintf(p->err, sizeof p->err, "budget below all-INT4");
    free(keys), free(values), free(tiers);
    return ok;
}

static kvmix_result trial(void *ctx, int32_t index, double budget, int32_t *out_passed) {
    probe *p = ctx;
    (void)budget; /* the options' budget, which the probe was given */
    const trace *t = &p->traces[(p->opt->seed + index) % p->n_traces];
    int64_t *questions = malloc((size_t)t->n * sizeof *questions);
    int64_t n_q = questions ? recall_questions(p, t, questions) : 0;
    if (n_q == 0) {
        free(questions);
        return KVMIX_ERR_OUT_OF_MEMORY;
    }
    int64_t n = answer_start(p, t, questions[(p->opt->seed + index) % n_q]);
    free(questions);
    const llama_config *c = &p->model->config;
    llama_kv_cache fp16 = {0}, sent = {0};
    int32_t want[MAX_ANSWER], got[MAX_ANSWER];
    int64_t n_want = 0, n_got = 0;
    kvmix_tier_plan plan = {0};
    float *first = malloc((size_t)c->vocab * sizeof *first);
    bool ok = first && kvmix_kv_create(kvmix_kv_policy_builtin("fp16"), c, n + MAX_ANSWER + 1,
                                       &fp16, p->err, sizeof p->err) == LLAMA_OK;
    for (int64_t i = 0; ok && i < n; i++)
        ok = llama_forward(&p->runner, &fp16, t->ids[i], i, first, p->err, sizeof p->err) ==
             LLAMA_OK;
    ok = ok && transferred_cache(p, &fp16, n, &sent, &plan);
    if (ok) n_want = answer(p, &fp16, first, n, want);
    if (ok) n_got = answer(p, &sent, first, n, got);
    *out_passed = ok && n_want == n_got && memcmp(want, got, (size_t)n_got * sizeof *got) == 0;
    if (ok)
        fprintf(stderr,
                "trial %d: %lld prompt tokens, FP16 %d, INT8 %d, INT4 %d: answer of %lld tokens "
                "%s\n",
                index, (long long)n, plan.n_fp16, plan.n_int8, plan.n_int4, (long long)n_want,
                *out_passed ? "the same (pass)" : "differs (fail)");
    if (fp16.destroy) fp16.destroy(fp16.state);
    if (sent.destroy) sent.destroy(sent.state);
    free(first);
    return ok ? KVMIX_SUCCESS : KVMIX_ERR_INVALID_ARGUMENT;
}

/* Every trace of the data file with a recall question, tokenized. */
static bool load_traces(probe *p) {
    size_t bytes = 0;
    char *data = llama_read_text(p->opt->data, &bytes);
    int64_t *questions = NULL;
    for (char *line = data, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        cJSON *doc = cJSON_Parse(line);
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(doc, "kind");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(doc, "text");
        trace t = {NULL, 0};
        if (cJSON_IsString(kind) && strcmp(kind->valuestring, "trace") == 0 &&
            cJSON_IsString(text) &&
            (t.ids = malloc((strlen(text->valuestring) + 1) * sizeof *t.ids)) != NULL) {
            t.ids[0] = llama_special_id(&p->model->tokenizer, "<|endoftext|>");
            llama_tokenize(&p->model->tokenizer, text->valuestring, strlen(text->valuestring),
                           t.ids + 1, &t.n);
            t.n = t.n + 1 < p->model->config.context - MAX_ANSWER
                      ? t.n + 1
                      : p->model->config.context - MAX_ANSWER;
            free(questions);
            questions = malloc((size_t)t.n * sizeof *questions);
            trace *grown = realloc(p->traces, (size_t)(p->n_traces + 1) * sizeof *grown);
            if (questions && grown && recall_questions(p, &t, questions) > 0) {
                p->traces = grown;
                p->traces[p->n_traces++] = t;
                t.ids = NULL;
            } else if (grown)
                p->traces = grown;
        }
        free(t.ids);
        cJSON_Delete(doc);
    }
    free(questions);
    free(data);
    return p->n_traces > 0;
}

static bool parse_options(int argc, char **argv, options *o) {
    *o = (options){NULL, NULL, NULL, 3, 2, 2, 0, 0.35};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        char *end = NULL;
        if (strcmp(a, "--model") == 0)
            o->model = v;
        else if (strcmp(a, "--data") == 0)
            o->data = v;
        else if (strcmp(a, "--out") == 0)
            o->out = v;
        else if (strcmp(a, "--trials") == 0)
            o->trials = (int32_t)strtol(v, &end, 10);
        else if (strcmp(a, "--pass") == 0)
            o->pass = (int32_t)strtol(v, &end, 10);
        else if (strcmp(a, "--threads") == 0)
            o->threads = (int32_t)strtol(v, &end, 10);
        else if (strcmp(a, "--seed") == 0)
            o->seed = strtoll(v, &end, 10);
        else if (strcmp(a, "--budget") == 0)
            o->budget = strtod(v, &end);
        else
            return false;
        if (end && *end) return false;
    }
    return argc % 2 == 1 && o->model && o->data && o->trials >= 1 && o->trials <= 100 &&
           o->pass >= 1 && o->pass <= o->trials && o->threads >= 1 && o->threads <= 64 &&
           o->seed >= 0 && o->budget > 0.0 && o->budget <= 1.0;
}

int main(int argc, char **argv) {
    options o;
    llama_model model;
    probe p = {0};
    if (!parse_options(argc, argv, &o)) {
        fprintf(stderr, "usage: kvmix-probe --model M.safetensors --data D.jsonl [--trials 3] "
                        "[--pass 2] [--budget 0.35]\n"
                        "                   [--seed N] [--out FILE] [--threads N]\n");
        return 2;
    }
    if (llama_model_load(o.model, &model, p.err, sizeof p.err) != LLAMA_OK) {
        fprintf(stderr, "kvmix-probe: %s: %s\n", o.model, p.err);
        return 1;
    }
    p.opt = &o, p.model = &model;
    p.logits = malloc((size_t)model.config.vocab * sizeof *p.logits);
    int32_t allow = 0, passed = 0;
    tier_probe_record record;
    char *doc = NULL;
    bool ok =
        p.logits && load_traces(&p) &&
        llama_runner_init(&p.runner, &model, o.threads, p.err, sizeof p.err) == LLAMA_OK &&
        kvmix_tier_probe(trial, &p, o.trials, o.pass, o.budget, &allow, &passed) == KVMIX_SUCCESS &&
        tier_probe_record_make(model.config.name, o.budget, o.trials, o.pass, passed, &record) ==
            KVMIX_SUCCESS &&
        (doc = tier_probe_json(&record)) != NULL;
    FILE *f = ok && o.out ? fopen(o.out, "w") : stdout;
    ok = ok && f && fprintf(f, "%s\n", doc) > 0;
    if (f && f != stdout) ok = fclose(f) == 0 && ok;
    if (!ok)
        fprintf(stderr, "kvmix-probe: the probe did not run%s%s\n", p.err[0] ? ": " : "", p.err);
    free(doc);
    for (int64_t i = 0; i < p.n_traces; i++) free(p.traces[i].ids);
    free(p.traces);
    free(p.logits);
    if (p.runner.model) llama_runner_free(&p.runner);
    llama_model_free(&model);
    return ok ? 0 : 1;
}
