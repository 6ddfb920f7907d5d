/* Throughput of the streaming template tagger (kvmix_tagger_feed) on one core, in tokens per
   second, for synthetic agent conversations of two real templates (Qwen3 ChatML ids, gpt-oss
   harmony ids with a two-token channel name), fed three ways: whole (one call), in runs of 512
   ids (prefill chunks) and one id per call (a decode loop). Baseline: memcpy of the same number
   of 8-byte tags, timed in the same run.

   Build and run (make bench does the same):
       cc -std=c11 -O2 -I. bench/bench_tags.c -o build/bench_tags -lm
       ./build/bench_tags [tokens=16777216] [reps=7]
   Add -DKVMIX_BENCH_CFLAGS='"..."' to print the compiler flags with the configuration.

   The stream repeats a system prompt (2000 ids: text and tool schemas), then turns of a user
   message (60 ids, every fourth with a 256-pad image), reasoning (300), a tool call (40), a tool
   result (400, as a user message in <tool_response> for ChatML, a functions.x message for
   harmony), an answer (120), until `tokens` ids; content ids are uniform random below the
   special ids. Figure: the median of `reps` repetitions, clock_gettime(CLOCK_MONOTONIC); the
   cpu% column (CPU time / wall time) tells whether other processes took the CPU. */
#define _POSIX_C_SOURCE 199309L
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_common.h"

#define MAX_REPS 64

static uint64_t rng_state = 0x6b766d6978ull;
static uint32_t rng_below(uint32_t n) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)((rng_state >> 33) % n);
}

typedef struct builder {
    int32_t *ids;
    int64_t n, cap;
    int32_t content_max;
} builder;
static void put(builder *b, int32_t id) {
    if (b->n < b->cap) b->ids[b->n++] = id;
}
static void put_n(builder *b, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++) put(b, ids[i]);
}
static void content(builder *b, int n) {
    for (int i = 0; i < n; i++) put(b, (int32_t)rng_below((uint32_t)b->content_max));
}

static void set1(kvmix_tag_marker *m, int alt, int32_t id) {
    m->alts[alt].n_ids = 1;
    m->alts[alt].ids[0] = id;
}
static void name(kvmix_tag_name *names, int32_t *n, const char *text, int role, const int32_t *ids,
                 int n_ids) {
    kvmix_tag_name *x = &names[(*n)++];
    snprintf(x->text, sizeof x->text, "%s", text);
    x->role = role;
    x->seq.n_ids = n_ids;
    memcpy(x->seq.ids, ids, sizeof(int32_t) * (size_t)n_ids);
}

/* Qwen3 ChatML (ids as in examples/specs/qwen3.json) */
static void build_chatml(kvmix_tag_spec *s, builder *b) {
    static const int32_t sys[] = {151644, 8948, 198}, usr[] = {151644, 872, 198},
                         ast[] = {151644, 77091, 198}, end[] = {151645, 198};
    int32_t id;
    memset(s, 0, sizeof *s);
    set1(&s->message_start, 0, 151644), set1(&s->message_end, 0, 151645);
    set1(&s->header_end, 0, 198), set1(&s->header_end, 1, 271);
    set1(&s->reasoning_open, 0, 151667), set1(&s->reasoning_close, 0, 151668);
    set1(&s->tool_call_open, 0, 151657), set1(&s->tool_call_close, 0, 151658);
    set1(&s->tool_response_open, 0, 151665), set1(&s->tool_response_close, 0, 151666);
    set1(&s->vision_open, 0, 151652), set1(&s->vision_close, 0, 151653);
    set1(&s->image_pad, 0, 151655), set1(&s->image_pad, 1, 151656);
    id = 8948, name(s->roles, &s->n_roles, "system", KVMIX_ROLE_INSTRUCTION, &id, 1);
    id = 872, name(s->roles, &s->n_roles, "user", KVMIX_ROLE_USER, &id, 1);
    id = 77091, name(s->roles, &s->n_roles, "assistant", KVMIX_ROLE_ASSISTANT, &id, 1);
    id = 14172, name(s->roles, &s->n_roles, "tool", KVMIX_ROLE_OBSERVATION, &id, 1);
    b->content_max = 151000;
    while (b->n < b->cap) {
        put_n(b, sys, 3), content(b, 2000), put_n(b, end, 2);
        for (int turn = 0; turn < 32 && b->n < b->cap; turn++) {
            put_n(b, usr, 3), content(b, 60);
            if (turn % 4 == 0) {
                put(b, 151652);
                for (int i = 0; i < 256; i++) put(b, 151655);
                put(b, 151653);
            }
            put_n(b, end, 2);
            put_n(b, ast, 3), put(b, 151667), content(b, 300), put(b, 151668), content(b, 2);
            put(b, 151657), content(b, 40), put(b, 151658), put_n(b, end, 2);
            put_n(b, usr, 3), put(b, 151665), content(b, 400), put(b, 151666), put_n(b, end, 2);
            put_n(b, ast, 3), put(b, 151667), put(b, 151668), content(b, 120), put_n(b, end, 2);
        }
    }
}

/* gpt-oss harmony (ids as in examples/specs/gpt-oss.json) */
static void build_harmony(kvmix_tag_spec *s, builder *b) {
    static const int32_t sys[] = {200006, 17360, 200008}, usr[] = {200006, 1428, 200008},
                         analysis[] = {200006, 173781, 200005, 35644, 200008},
                         call[] = {200006, 173781, 316, 28,     44580, 775,   170154,
                                   200005, 12606,  815, 200003, 5701,  200008},
                         result[] = {200006, 44580,  775,   170154, 316,   28,
                                     173781, 200005, 12606, 815,    200008},
                         final[] = {200006, 173781, 200005, 17196, 200008},
                         commentary[] = {12606, 815};
    int32_t id;
    memset(s, 0, sizeof *s);
    set1(&s->message_start, 0, 200006), set1(&s->message_end, 0, 200007);
    set1(&s->message_end, 1, 200012), set1(&s->message_end, 2, 200002);
    set1(&s->header_end, 0, 200008), set1(&s->channel, 0, 200005);
    s->recipient.alts[0].n_ids = 2, s->recipient.alts[0].ids[0] = 316;
    s->recipient.alts[0].ids[1] = 28;
    id = 17360, name(s->roles, &s->n_roles, "system", KVMIX_ROLE_INSTRUCTION, &id, 1);
    id = 77944, name(s->roles, &s->n_roles, "developer", KVMIX_ROLE_INSTRUCTION, &id, 1);
    id = 1428, name(s->roles, &s->n_roles, "user", KVMIX_ROLE_USER, &id, 1);
    id = 173781, name(s->roles, &s->n_roles, "assistant", KVMIX_ROLE_ASSISTANT, &id, 1);
    id = 44580, name(s->roles, &s->n_roles, "functions", KVMIX_ROLE_OBSERVATION, &id, 1);
    id = 35644, name(s->channels, &s->n_channels, "analysis", KVMIX_ROLE_REASONING, &id, 1);
    name(s->channels, &s->n_channels, "commentary", KVMIX_ROLE_ASSISTANT, commentary, 2);
    id = 17196, name(s->channels, &s->n_channels, "final", KVMIX_ROLE_ASSISTANT, &id, 1);
    b->content_max = 199000;
    while (b->n < b->cap) {
        put_n(b, sys, 3), content(b, 2000), put(b, 200007);
        for (int turn = 0; turn < 32 && b->n < b->cap; turn++) {
            put_n(b, usr, 3), content(b, 60), put(b, 200007);
            put_n(b, analysis, 5), content(b, 300), put(b, 200007);
            put_n(b, call, 13), content(b, 40), put(b, 200012);
            put_n(b, result, 11), content(b, 400), put(b, 200007);
            put_n(b, final, 5), content(b, 120), put(b, 200002);
        }
    }
}

/* Median seconds of one pass over the stream, fed in runs of `run` ids (0 = whole). */
static double time_feed(const kvmix_tag_spec *spec, const int32_t *ids, int64_t n, int32_t run,
                        kvmix_tag *tags, int reps, double *busy, int32_t *turns) {
    static kvmix_tagger t;
    double times[MAX_REPS], c0 = cpu_seconds(), wall = 0;
    for (int r = 0; r < reps; r++) {
        kvmix_tagger_init(&t, spec, NULL);
        double t0 = now_seconds();
        if (run == 0)
            kvmix_tagger_feed(&t, ids, (int32_t)n, tags);
        else
            for (int64_t i = 0; i < n; i += run)
                kvmix_tagger_feed(&t, ids + i, (int32_t)(n - i < run ? n - i : run), tags + i);
        times[r] = now_seconds() - t0;
        wall += times[r];
    }
    *busy = (cpu_seconds() - c0) / wall;
    *turns = t.turn;
    qsort(times, (size_t)reps, sizeof times[0], cmp_double);
    return times[reps / 2];
}

int main(int argc, char **argv) {
    int64_t n = 1 << 24;
    int reps = 7;
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "tokens=", 7) == 0)
            n = atoll(argv[i] + 7);
        else if (strncmp(argv[i], "reps=", 5) == 0)
            reps = atoi(argv[i] + 5);
        else {
            fprintf(stderr, "usage: bench_tags [tokens=16777216] [reps=7]\n");
            return 2;
        }
    }
    if (n < 1 || n > 0x7fffffff || reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "bench_tags: tokens 1 .. 2^31-1, reps 1 .. %d\n", MAX_REPS);
        return 2;
    }
    int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)n);
    kvmix_tag *tags = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)n);
    kvmix_tag *copy = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)n);
    if (!ids || !tags || !copy) return 1;
    printf("bench_tags: kvmix_tagger_feed throughput (kvmix %s)\n", kvmix_version_string());
    print_cpu();
    printf("  compiler flags   %s\n", KVMIX_BENCH_CFLAGS);
    printf("  stream           %lld ids per pass, median of %d passes, tags 8 bytes each\n",
           (long long)n, reps);
    printf("\n| template | feeding | Mtokens/s | ns/token | vs memcpy of tags | cpu%% | turns |\n");
    printf("|---|---|---|---|---|---|---|\n");
    memset(copy, 0, sizeof(kvmix_tag) * (size_t)n);
    double tm[MAX_REPS];
    for (int r = 0; r < reps; r++) {
        double t0 = now_seconds();
        memcpy(copy, tags, sizeof(kvmix_tag) * (size_t)n);
        tm[r] = now_seconds() - t0;
    }
    qsort(tm, (size_t)reps, sizeof tm[0], cmp_double);
    double memcpy_s = tm[reps / 2];
    printf("| (baseline) | memcpy of %lld tags | %.0f | %.2f | 1.000 | - | - |\n", (long long)n,
           (double)n / memcpy_s * 1e-6, memcpy_s / (double)n * 1e9);
    for (int tpl = 0; tpl < 2; tpl++) {
        kvmix_tag_spec spec;
        builder b = {ids, 0, n, 0};
        if (tpl == 0)
            build_chatml(&spec, &b);
        else
            build_harmony(&spec, &b);
        static const int32_t runs[3] = {0, 512, 1};
        for (int k = 0; k < 3; k++) {
            double busy;
            int32_t turns;
            double s = time_feed(&spec, ids, n, runs[k], tags, reps, &busy, &turns);
            printf("| %s | %s | %.1f | %.2f | %.3f | %.0f | %d |\n",
                   tpl == 0 ? "Qwen3 ChatML" : "gpt-oss harmony",
                   k == 0   ? "whole (1 call)"
                   : k == 1 ? "runs of 512"
                            : "1 id per call",
                   (double)n / s * 1e-6, s / (double)n * 1e9, memcpy_s / s, busy * 100.0,
                   (int)turns);
        }
    }
    free(ids);
    free(tags);
    free(copy);
    return 0;
}
