/* bench_serve: serving kvm-base on one GPU with its keys and values in a kvmix cache
 * (examples/gpu_llama.h). For each context and policy: sequences are filled to the context with
 * synthetic rows through the cache's own write and seal path until the arena (the memory budget)
 * is full, which gives the largest batch that fits; then whole decode steps of the model (every
 * layer, the logits) are timed at growing batch sizes up to that one. Reported per row: bytes
 * the cache holds per sequence, sequences that fit, batch, milliseconds per step, decode tokens
 * per second, the share of a step spent in attention (GPU time of the layers' attention: rows to
 * FP16, cache jobs, decode), the host's cache bookkeeping per step, and at the largest batch
 * the ratios to the FP16 cache in the same budget; "flushes": cache calls per step that found the
 * arena or the job queue full and waited for the queued jobs (a nearly full arena). Contexts past
 * kvm-base's trained 4096 are for timing only.
 *
 *   bench_serve [--model PATH] [--contexts 4096,32768] [--budgets-gib 2,8] [--steps N]
 *               [--policies fp16,fp16@128,int4,mix,mix@128,kivi2,kitty-25]
 *
 * "mix" is kivi2's layout with one page in four asked at INT4 keys and values: 75% of the pages
 * INT2 (per-channel keys, per-token values), 25% INT4. "NAME@P" is a policy with pages of P
 * tokens (kivi2 and the mix have 32; the decode kernel's benchmarks use 128). */
#define _POSIX_C_SOURCE 200809L /* isatty */
#include "gpu_llama.h"
#include "kvmix_kv.h"
#include "llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { MAX_SEQS = 1024, MAX_LIST = 16, WARM_STEPS = 2 };

typedef struct serve_options {
    const char *model;
    int32_t contexts[MAX_LIST], n_contexts;
    double budgets_gib[MAX_LIST];
    const char *policies[MAX_LIST];
    int32_t n_policies, steps;
} serve_options;

/* What one policy at one context gives at its largest batch. */
typedef struct serve_row {
    int32_t fit;
    double tokens_per_second;
} serve_row;

static int32_t split_list(char *text, char **items, int32_t max) {
    int32_t n = 0;
    for (char *tok = strtok(text, ","); tok && n < max; tok = strtok(NULL, ",")) items[n++] = tok;
    return n;
}

static bool parse(int argc, char **argv, serve_options *o) {
    static char contexts[256] = "4096,32768", budgets[256] = "2,8",
                policies[256] = "fp16,fp16@128,int4,mix,mix@128,kivi2,kitty-25";
    char *items[MAX_LIST];
    o->model = "../shared/models/kvm-base.safetensors";
    o->steps = 16;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--model"))
            o->model = argv[i + 1];
        else if (!strcmp(argv[i], "--contexts"))
            snprintf(contexts, sizeof contexts, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--budgets-gib"))
            snprintf(budgets, sizeof budgets, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--policies"))
            snprintf(policies, sizeof policies, "%s", argv[i + 1]);
        else if (!strcmp(argv[i], "--steps"))
            o->steps = atoi(argv[i + 1]);
        else
            return false;
    }
    o->n_contexts = split_list(contexts, items, MAX_LIST);
    for (int32_t i = 0; i < o->n_contexts; i++) o->contexts[i] = atoi(items[i]);
    if (split_list(budgets, items, MAX_LIST) != o->n_contexts) return false;
    for (int32_t i = 0; i < o->n_contexts; i++) o->budgets_gib[i] = atof(items[i]);
    o->n_policies = split_list(policies, (char **)o->policies, MAX_LIST);
    for (int32_t i = 0; i < o->n_contexts; i++)
        if (o->contexts[i] < 64 || o->budgets_gib[i] <= 0.0) return false;
    return o->steps >= 1 && o->n_policies >= 1;
}

/* The policy a name stands for, and the formats its positions ask for (NULL: the policy's).
 * "NAME@P" is policy NAME with pages of P tokens; *out_policy holds the policy. */
static bool policy_of(const char *name, int32_t context, kvmix_policy *out_policy,
                      kvmix_cache_precision **out_precisions) {
    char base[64];
    const char *at = strchr(name, '@');
    size_t len = at ? (size_t)(at - name) : strlen(name);
    *out_precisions = NULL;
    if (len >= sizeof base) return false;
    memcpy(base, name, len);
    base[len] = '\0';
    bool mix = strcmp(base, "mix") == 0;
    const kvmix_policy *p = kvmix_kv_policy_builtin(mix ? "kivi2" : base);
    if (!p) return false;
    *out_policy = *p;
    snprintf(out_policy->name, sizeof out_policy->name, "%s", name);
    if (at) out_policy->page_tokens = atoi(at + 1);
    if (kvmix_policy_check(out_policy, NULL) != KVMIX_SUCCESS) return false;
    if (!mix) return true;
    kvmix_cache_precision *prec = malloc((size_t)context * sizeof *prec);
    for (int32_t t = 0; prec && t < context; t++) {
        bool int4 = (t / out_policy->page_tokens) % 4 == 0;
        prec[t].key_format = int4 ? KVMIX_FORMAT_INT4 : KVMIX_FORMAT_INT2_CHANNEL;
        prec[t].value_format = int4 ? KVMIX_FORMAT_INT4 : KVMIX_FORMAT_INT2;
    }
    *out_precisions = prec;
    return prec != NULL;
}

/* Fills sequences to `context` until the arena is full, then ends the last, partial one and as
 * many full ones as it takes to leave every other sequence a new FP16 buffer page (what a decode
 * step may add). Returns the sequences kept. */
static int32_t fill_until_full(gpu_llama *g, const llama_config *c, const kvmix_policy *p,
                               int32_t context, const kvmix_cache_precision *prec, char *err,
                               size_t err_bytes) {
    int32_t n = 0, seq;
    bool progress = isatty(STDERR_FILENO) != 0; /* fills take seconds to minutes */
    while (n < MAX_SEQS && gpu_llama_seq_start(g, &seq, err, err_bytes) == LLAMA_OK) {
        if (gpu_llama_fill(g, seq, context, prec, err, err_bytes) != LLAMA_OK) {
            gpu_llama_seq_end(g, seq);
            break;
        }
        n++;
        if (progress)
            fprintf(stderr, "\r%s: %d sequences filled to %d tokens", p->name, n, context);
    }
    if (progress) fprintf(stderr, "\r%60s\r", "");
    if (n == MAX_SEQS || n == 0) return n;
    llama_kv_stats st;
    gpu_llama_seq_stats(g, 0, &st);
    double page = 4.0 * c->n_layers * c->n_kv_heads * p->page_tokens * c->head_dim;
    int32_t room = (int32_t)ceil((double)n * page / (double)(st.bytes ? st.bytes : 1)) + 1;
    while (room-- > 0 && n > 0) gpu_llama_seq_end(g, --n);
    return n;
}

/* Times whole decode steps of sequences 0 .. batch - 1; prints one row. */
static bool time_batch(gpu_llama *g, int32_t vocab, int32_t batch, int32_t steps,
                       const char *policy, int32_t context, double budget, size_t seq_bytes,
                       int32_t fit, serve_row *row, char *err, size_t err_bytes) {
    int32_t *seqs = malloc((size_t)batch * sizeof *seqs), *tokens = malloc((size_t)batch * 4);
    float *logits = malloc((size_t)batch * (size_t)vocab * sizeof *logits);
    bool ok = seqs && tokens && logits;
    for (int32_t i = 0; ok && i < batch; i++) seqs[i] = i, tokens[i] = 'a' + i % 26;
    for (int32_t s = 0; ok && s < WARM_STEPS + steps; s++) {
        if (s == WARM_STEPS) gpu_llama_profile_start(g);
        ok = gpu_llama_step(g, seqs, tokens, batch, logits, err, err_bytes) == LLAMA_OK;
    }
    gpu_llama_profile p;
    gpu_llama_profile_get(g, &p);
    if (ok) {
        double ms = 1e3 * p.step_seconds / (double)p.steps;
        double tps = (double)p.tokens / p.step_seconds;
        printf("%-8s %7d %6.1f %10.2f %5d%s %6d %9.2f %10.0f %8.0f%% %9.0f %9.0f %9.2f\n", policy,
               context, budget, (double)seq_bytes / 1048576.0, fit, fit == MAX_SEQS ? "+" : " ",
               batch, ms, tps, 100.0 * p.attention_seconds / p.step_seconds,
               1e6 * p.host_seconds / (double)p.steps, 1e6 * p.view_seconds / (double)p.steps,
               (double)p.flushes / (double)p.steps);
        row->tokens_per_second = tps;
    }
    free(seqs);
    free(tokens);
    free(logits);
    return ok;
}

/* One policy at one context: fill, then batches 1, 4, 16, ... and the largest. */
static bool run_policy(const llama_model *m, const char *name, int32_t context, double budget_gib,
                       int32_t steps, serve_row *row) {
    char err[512];
    kvmix_cache_precision *prec = NULL;
    kvmix_policy policy;
    const kvmix_policy *p = &policy;
    gpu_llama *g = NULL;
    size_t budget = (size_t)(budget_gib * 1073741824.0);
    if (!policy_of(name, context, &policy, &prec)) {
        fprintf(stderr, "bench_serve: unknown policy or page size: %s\n", name);
        free(prec);
        return false;
    }
    bool ok = gpu_llama_create(m, p, MAX_SEQS, context + 8 * (WARM_STEPS + steps) + 64, budget, &g,
                               err, sizeof err) == LLAMA_OK;
    int32_t fit = ok ? fill_until_full(g, &m->config, p, context, prec, err, sizeof err) : 0;
    llama_kv_stats st = {0};
    if (ok && fit > 0) gpu_llama_seq_stats(g, 0, &st);
    row->fit = fit;
    for (int32_t b = 1; ok && b <= fit; b = b * 4 > fit && b < fit ? fit : b * 4)
        ok = time_batch(g, m->config.vocab, b, steps, name, context, budget_gib, st.bytes, fit, row,
                        err, sizeof err);
    if (!ok) fprintf(stderr, "bench_serve: %s at %d: %s\n", name, context, err);
    gpu_llama_free(g);
    free(prec);
    return ok && fit > 0;
}

int main(int argc, char **argv) {
    serve_options o;
    llama_model m;
    char err[512];
    setvbuf(stdout, NULL, _IOLBF, 0); /* rows survive a run stopped early */
    if (!parse(argc, argv, &o)) {
        fprintf(stderr, "usage: bench_serve [--model PATH] [--contexts 4096,32768] "
                        "[--budgets-gib 2,8] [--steps N] [--policies "
                        "fp16,fp16@128,int4,mix,mix@128,kivi2,kitty-25]\n");
        return 2;
    }
    if (llama_model_load(o.model, &m, err, sizeof err) != LLAMA_OK) {
        fprintf(stderr, "bench_serve: %s: %s\n", o.model, err);
        return 1;
    }
    printf("bench_serve: %s (%d layers, %d kv heads of %d), decode steps of the whole model, "
           "%d timed after %d warm-up; budget = the cache arena\n",
           m.config.name, m.config.n_layers, m.config.n_kv_heads, m.config.head_dim, o.steps,
           WARM_STEPS);
    printf("%-8s %7s %6s %10s %6s %6s %9s %10s %9s %9s %9s %9s\n", "policy", "context", "GiB",
           "MiB/seq", "fit", "batch", "ms/step", "tokens/s", "attn", "host us", "view us",
           "flushes");
    bool ok = true;
    for (int32_t c = 0; c < o.n_contexts; c++) {
        serve_row base = {0, 0.0};
        for (int32_t i = 0; i < o.n_policies; i++) {
            serve_row row = {0, 0.0};
            ok =
                run_policy(&m, o.policies[i], o.contexts[c], o.budgets_gib[c], o.steps, &row) && ok;
            bool fp16 = strncmp(o.policies[i], "fp16", 4) == 0;
            if (fp16 && row.tokens_per_second > base.tokens_per_second) base = row; /* the best */
            if (base.fit > 0 && !fp16)
                printf("  %s at %d, largest batch against the fastest fp16 in %.1f GiB: %.2fx the "
                       "sequences, "
                       "%.2fx the decode tokens/s\n",
                       o.policies[i], o.contexts[c], o.budgets_gib[c],
                       (double)row.fit / (double)base.fit,
                       row.tokens_per_second / base.tokens_per_second);
        }
    }
    llama_model_free(&m);
    return ok ? 0 : 1;
}
