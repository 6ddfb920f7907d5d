/* Fuzz target for the policy reader (kvmix_kv_policy_parse) and what follows a parse: resolution
 * against head dims, and the JSON writer, whose output must parse back to the same policy.
 *
 * libFuzzer:  clang -fsanitize=fuzzer,address,undefined -I. -Iexamples tests/fuzz_policy.c \
 *                 examples/kvmix_kv.c examples/llama.c -lcjson -lm -lpthread
 * Driver (-DFUZZ_DRIVER, any compiler; tests/fuzz_seed_driver.h): `fuzz_policy_run [N] [FILE...]`
 * runs each file, then N (default 4000) seeded mutations of the built-in policies' documents and
 * the files. `--write-seeds DIR` writes the seeds for libFuzzer.
 */
#ifdef FUZZ_DRIVER
#define _POSIX_C_SOURCE 200809L /* the plain driver's limits: tests/fuzz_limits.h */
#endif
#include "kvmix_kv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
    kvmix_policy p, back, resolved;
    if (kvmix_kv_policy_parse((const char *)data, size, &p, err, sizeof err) != LLAMA_OK) return 0;
    static const int32_t head_dims[] = {32, 40, 64, 128, 512};
    for (size_t i = 0; i < sizeof head_dims / sizeof head_dims[0]; i++)
        kvmix_kv_policy_resolve(&p, head_dims[i], &resolved, err, sizeof err);
    char *text = kvmix_kv_policy_json(&p);
    if (text == NULL) return 0;
    /* a policy that parsed writes a document that parses to itself */
    if (kvmix_kv_policy_parse(text, strlen(text), &back, err, sizeof err) != LLAMA_OK ||
        !kvmix_kv_policy_equal(&p, &back))
        abort();
    free(text);
    return 0;
}

#ifdef FUZZ_DRIVER

#define FUZZ_MAX_INPUT (1 << 12)
#include "fuzz_seed_driver.h"

enum { MAX_SEEDS = 24 };

/* Words that steer a JSON policy parser into its interesting branches. */
static const char *const WORDS[] = {"\"version\"",
                                    "\"key_format\"",
                                    "\"n_boost\"",
                                    "\"boosted\"",
                                    "\"fp32\"",
                                    "\"int2_channel\"",
                                    "\"quantize\"",
                                    "1e9",
                                    "-0",
                                    "0.5",
                                    "null",
                                    "\"page_tokens\": 8,",
                                    "\"sink_tokens\"",
                                    "4294967296",
                                    "true",
                                    "\"evict\": {\"scorer\": \"h2o\"}",
                                    "\"budget_fraction\"",
                                    "\"pool_tokens\": 4",
                                    "\"decay\": 1",
                                    "\"recent_fraction\": 0.5"};

static void edit(buffer *b, size_t at, uint64_t kind, uint64_t *rng) {
    switch (kind) {
    case 0: b->bytes[at] = fuzz_json_byte(next_random(rng)); break;
    case 1: fuzz_delete_run(b, at, rng); break;
    case 2: b->size = at; break;
    default: fuzz_insert_word(b, at, WORDS, sizeof WORDS / sizeof WORDS[0], rng); break;
    }
}

static void mutate(buffer *b, uint64_t *rng) { fuzz_mutate(b, rng, 5, edit); }

int main(int argc, char **argv) {
    static buffer seeds[MAX_SEEDS];
    int32_t n_seeds = 0;
    for (int32_t i = 0; i < kvmix_kv_policy_count() && n_seeds < MAX_SEEDS; i++) {
        char *text = kvmix_kv_policy_json(kvmix_kv_policy_at(i));
        if (text == NULL || strlen(text) > FUZZ_MAX_INPUT) return 1;
        seeds[n_seeds].size = strlen(text);
        memcpy(seeds[n_seeds++].bytes, text, strlen(text));
        free(text);
    }
    for (int32_t scorer = KVMIX_EVICT_INTENT; scorer <= KVMIX_EVICT_SNAPKV; scorer++) {
        kvmix_policy p = *kvmix_kv_policy_builtin("kitty-25"); /* with each scorer */
        p.evict.scorer = scorer;
        p.evict.budget_fraction = 0.5;
        p.evict.decay = 0.25;
        p.evict.prefix_tokens = 4;
        p.evict.recent_tokens = 64;
        p.evict.recent_fraction = scorer == KVMIX_EVICT_H2O ? 0.5 : 0.0;
        char *text = kvmix_kv_policy_json(&p);
        if (text == NULL || strlen(text) > FUZZ_MAX_INPUT || n_seeds == MAX_SEEDS) return 1;
        seeds[n_seeds].size = strlen(text);
        memcpy(seeds[n_seeds++].bytes, text, strlen(text));
        free(text);
    }
    return fuzz_seed_main(argc, argv, seeds, n_seeds, MAX_SEEDS, 0x2545f4914f6cdd1du, mutate);
}

#endif /* FUZZ_DRIVER */
