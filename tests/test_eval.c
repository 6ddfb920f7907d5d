/* The CPU runner's hand-over and eviction from the command line (examples/kvmix_eval.c) on one
 * kvm-small trace of SHARED/data/eval-dev.jsonl:
 *   - --transfer int8:1 sends every position at INT8 (the "transfer" object counts them, its
 *     realized budget is INT8's) and the positions after it are scored;
 *   - --transfer tiered:0.5 keeps to its budget with all three tiers of the kvm-small probe;
 *   - a policy that evicts half of each request's history evicts ("eviction" object) and
 *     --evict-log holds a line per eviction;
 *   - --transfer refuses an evicting policy and an allocation;
 *   - a long-session trace (bench/refmodel/eval-dev-long.jsonl) gets "by_distance": the answers of
 *     its questions that fit kvm-small's context, per distance (fp32 agrees with itself), and a
 *     malformed "questions" array is refused naming it;
 *   - --reference-tops (an fp32 run's --tops) gives the figures the fp32 pass gives, and a file
 *     of another shape is refused.
 * The GPU runner's figures against these are tests/test_gpu_llama.c's.
 * Usage: test_eval SHARED_DIR (from the repository root). Prints "N passed, N failed". */
#define _POSIX_C_SOURCE 200809L
#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef BUILD_DIR
#define BUILD_DIR "build"
#endif
#define TOOL BUILD_DIR "/kvmix-eval"
#define LOG  BUILD_DIR "/.test-eval.log"

#include "model_check.h"

/* kvmix-eval over trace 2 with args: its JSON (NULL when it failed), its exit status in *status. */
static cJSON *run(const char *shared, const char *args, int *status) {
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd,
             TOOL " --model %s/models/kvm-small.safetensors --data %s/data/eval-dev.jsonl "
                  "--kind trace --offset 2 --limit 1 --tag-spec examples/specs/kvm-byte.json %s "
                  "2>/dev/null",
             shared, shared, args);
    *status = run_command_exit(cmd, &out);
    cJSON *doc = *status == 0 && out ? cJSON_Parse(out) : NULL;
    free(out);
    return doc;
}

static double number(const cJSON *doc, const char *object, const char *field) {
    const cJSON *o = object ? cJSON_GetObjectItemCaseSensitive(doc, object) : doc;
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, field);
    return cJSON_IsNumber(x) ? x->valuedouble : NAN;
}

static void check_transfers(const char *shared) {
    int status = -1;
    cJSON *doc = run(shared, "--policy kivi2-sink --transfer int8:1", &status);
    CHECK_MSG(doc, "--transfer int8:1 runs");
    double sent = number(doc, "transfer", "n_tokens_sent");
    CHECK(number(doc, "transfer", "n_transfers") == 1 && sent > 100);
    CHECK(number(doc, "transfer", "n_int8") == sent && number(doc, "transfer", "n_fp16") == 0);
    /* INT8 rows with a scale and minimum per group of 32, against FP16 rows */
    double budget = number(doc, "transfer", "realized_budget");
    CHECK(budget > 0.5 && budget < 0.6);
    const cJSON *after = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(doc, "transfer"), "after");
    CHECK(number(after, NULL, "n_tokens") > 0 && isfinite(number(after, NULL, "bits_per_token")));
    cJSON_Delete(doc);

    doc = run(shared, "--policy kivi2-sink --transfer tiered:0.5", &status);
    CHECK_MSG(doc, "--transfer tiered:0.5 runs");
    sent = number(doc, "transfer", "n_tokens_sent");
    /* the tiers fill the budget; payload headers add about 0.1% */
    CHECK(sent > 100 && number(doc, "transfer", "realized_budget") <= 0.51);
    CHECK(number(doc, "transfer", "n_fp16") > 0 && number(doc, "transfer", "n_int8") > 0 &&
          number(doc, "transfer", "n_int4") > 0);
    CHECK(number(doc, "transfer", "n_fp16") + number(doc, "transfer", "n_int8") +
              number(doc, "transfer", "n_int4") ==
          sent);
    CHECK(isfinite(number(doc, NULL, "bits_per_token")));
    cJSON_Delete(doc);

    CHECK(
        !run(shared, "--policy examples/policies/fp16-intent-50.json --transfer int8:1", &status) &&
        status == 1);
    CHECK(!run(shared,
               "--policy fp16 --transfer int8:1 --allocation "
               "bench/triaxial/kvm-small-p32-runs-each-b3.5.json",
               &status) &&
          status == 2);
}

static void check_eviction(const char *shared) {
    int status = -1;
    remove(LOG);
    cJSON *doc =
        run(shared, "--policy examples/policies/fp16-intent-50.json --evict-log " LOG, &status);
    CHECK_MSG(doc, "an evicting policy runs on the CPU");
    double evictions = number(doc, "eviction", "n_evictions");
    CHECK(evictions >= 1 && number(doc, "eviction", "evicted_tokens") > 0);
    CHECK(isfinite(number(doc, NULL, "bits_per_token")));
    char *log = read_file(LOG, NULL);
    int lines = 0;
    for (const char *at = log; at && (at = strstr(at, "\"positions\": [")) != NULL; at++) lines++;
    CHECK(lines == (int)evictions);
    free(log);
    cJSON_Delete(doc);
    remove(LOG);
}

#define REF_TOPS BUILD_DIR "/.test-eval-ref-tops.txt"
#define BAD_TOPS BUILD_DIR "/.test-eval-bad-tops.txt"

/* bad = good with its last id gone (cut), a line added (extra) or every id 0 (zeros). */
static bool write_bad_tops(const char *good, const char *how) {
    FILE *f = fopen(BAD_TOPS, "w");
    if (!f) return false;
    size_t n = strlen(good);
    while (n > 0 && good[n - 1] == '\n') n--;
    if (strcmp(how, "cut") == 0) {
        while (n > 0 && good[n - 1] != ' ') n--;
        fprintf(f, "%.*s\n", (int)(n > 0 ? n - 1 : 0), good);
    } else if (strcmp(how, "extra") == 0) {
        fprintf(f, "%.*s\n1 2 3\n", (int)n, good);
    } else { /* as many ids, each 0 */
        fputs("0", f);
        for (size_t i = 0; i < n; i++)
            if (good[i] == ' ') fputs(" 0", f);
        fputc('\n', f);
    }
    return fclose(f) == 0;
}

/* --reference-tops: an fp32 run's --tops stands for the reference pass, figure for figure; a
   file whose ids differ changes the agreement; one of another shape, or given to fp32, is
   refused. */
static void check_reference_tops(const char *shared) {
    int status = -1;
    cJSON *doc = run(shared, "--policy fp32 --tops " REF_TOPS, &status);
    CHECK_MSG(doc, "fp32 writes its tops");
    cJSON_Delete(doc);
    cJSON *own = run(shared, "--policy int4", &status);
    cJSON *given = run(shared, "--policy int4 --reference-tops " REF_TOPS, &status);
    CHECK_MSG(own && given, "int4 runs with and without --reference-tops");
    double agreement = number(own, NULL, "answer_agreement");
    CHECK(agreement > 0.5 && agreement == number(given, NULL, "answer_agreement"));
    CHECK(number(own, NULL, "bits_per_token") == number(given, NULL, "bits_per_token"));
    cJSON_Delete(own);
    cJSON_Delete(given);
    char *good = read_file(REF_TOPS, NULL);
    if (!CHECK(good && write_bad_tops(good, "zeros"))) {
        free(good);
        return;
    }
    doc = run(shared, "--policy int4 --reference-tops " BAD_TOPS, &status);
    CHECK(doc && number(doc, NULL, "answer_agreement") < agreement);
    cJSON_Delete(doc);
    CHECK(write_bad_tops(good, "cut") &&
          !run(shared, "--policy int4 --reference-tops " BAD_TOPS, &status) && status == 1);
    CHECK(write_bad_tops(good, "extra") &&
          !run(shared, "--policy int4 --reference-tops " BAD_TOPS, &status) && status == 1);
    CHECK(!run(shared, "--policy fp32 --reference-tops " REF_TOPS, &status) && status == 1);
    free(good);
    remove(REF_TOPS);
    remove(BAD_TOPS);
}

#define LONG_DATA "bench/refmodel/eval-dev-long.jsonl"
#define BAD_DATA  BUILD_DIR "/.test-eval-questions.jsonl"

/* The answer tokens of the first long trace's questions that end inside `n` tokens, per distance
   (distances < 64), from the data file itself. */
static void expected_answers(int64_t n, int64_t tokens[64], int64_t questions[64]) {
    char *data = read_file(LONG_DATA, NULL);
    char *newline = data ? strchr(data, '\n') : NULL;
    if (newline) *newline = 0;
    cJSON *line = data ? cJSON_Parse(data) : NULL;
    const cJSON *q;
    cJSON_ArrayForEach(q, cJSON_GetObjectItemCaseSensitive(line, "questions")) {
        int d = (int)number(q, NULL, "distance");
        int64_t start = (int64_t)number(q, NULL, "token_start"),
                end = (int64_t)number(q, NULL, "token_end");
        if (end < n && d > 0 && d < 64) tokens[d] += end - start, questions[d]++;
    }
    cJSON_Delete(line);
    free(data);
}

static void check_questions(const char *shared) {
    char cmd[1024], *out = NULL;
    snprintf(cmd, sizeof cmd,
             TOOL " --model %s/models/kvm-small.safetensors --data " LONG_DATA
                  " --kind trace --limit 1 --policy fp32 2>/dev/null",
             shared);
    int status = run_command_exit(cmd, &out);
    cJSON *doc = status == 0 && out ? cJSON_Parse(out) : NULL;
    free(out);
    CHECK_MSG(doc, "a long-session trace runs");
    int64_t tokens[64] = {0}, questions[64] = {0}, seen = 0;
    expected_answers((int64_t)number(doc, NULL, "n_tokens") + 1, tokens, questions);
    const cJSON *bin;
    cJSON_ArrayForEach(bin, cJSON_GetObjectItemCaseSensitive(doc, "by_distance")) {
        int d = (int)number(bin, NULL, "distance");
        CHECK(d > 0 && d < 64 && number(bin, NULL, "n_answer_tokens") == (double)tokens[d] &&
              number(bin, NULL, "n_questions") == (double)questions[d]);
        CHECK(number(bin, NULL, "answer_agreement") == 1.0 &&
              number(bin, NULL, "question_agreement") == 1.0);
        seen += (int64_t)number(bin, NULL, "n_questions");
    }
    int64_t expected = 0;
    for (int d = 1; d < 64; d++) expected += questions[d];
    CHECK_MSG(expected > 0 && seen == expected, "every question inside the context is counted");
    cJSON_Delete(doc);

    FILE *f = fopen(BAD_DATA, "w");
    if (f) {
        fputs("{\"kind\": \"trace\", \"text\": \"x\", \"questions\": [{\"token_start\": 3, "
              "\"token_end\": 2, \"distance\": 1}]}\n",
              f);
        fclose(f);
    }
    snprintf(cmd, sizeof cmd,
             TOOL " --model %s/models/kvm-small.safetensors --data " BAD_DATA
                  " --kind trace --policy fp32 2>&1",
             shared);
    out = NULL;
    status = run_command_exit(cmd, &out);
    CHECK_MSG(status != 0 && out && strstr(out, "questions[0]") != NULL,
              "a malformed questions array is refused naming it");
    free(out);
    remove(BAD_DATA);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: test_eval SHARED_DIR\n");
        return 2;
    }
    check_transfers(argv[1]);
    check_eviction(argv[1]);
    check_questions(argv[1]);
    check_reference_tops(argv[1]);
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed == 0 ? 0 : 1;
}
