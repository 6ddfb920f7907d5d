/* Fuzz target for the intent residual's weight reader (intent_residual_parse,
 * examples/intent_residual_json.c) and what follows a parse: the weights check, rescore a few
 * positions to finite scores (dead ones stay dead), and write (intent_residual_json) a text that
 * parses back to equal weights and writes the same text again; a document that does not parse
 * leaves the output untouched and says why.
 *
 * libFuzzer:  clang -fsanitize=fuzzer,address,undefined -I. -Iexamples tests/fuzz_residual.c \
 *                 examples/intent_residual_json.c examples/tag_spec_json.c -lcjson -lm
 * Driver (-DFUZZ_DRIVER, any compiler; tests/fuzz_seed_driver.h): `fuzz_residual_run [N] [FILE...]`
 * runs each file, then N (default 4000) seeded mutations of the seeds (weights of a few widths,
 * written by intent_residual_json) and the files. `--write-seeds DIR` writes them.
 */
#ifdef FUZZ_DRIVER
#define _POSIX_C_SOURCE 200809L /* the plain driver's limits: tests/fuzz_limits.h */
#endif
#include "intent_residual_json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { F = KVMIX_INTENT_RESIDUAL_N_FEATURES, N_ROWS = 4 };

/* Rescores N_ROWS positions (the last one dead): finite where the rule is, dead stays dead. */
static void rescore(const kvmix_intent_residual *w) {
    static const float rule[N_ROWS] = {0.5f, -3.0f, 1e30f, -INFINITY};
    float features[N_ROWS * F], out[N_ROWS];
    for (int i = 0; i < N_ROWS * F; i++) features[i] = (float)((i * 7) % 11) * 0.25f - 1.0f;
    if (kvmix_intent_residual_scores(w, features, rule, N_ROWS, out, NULL) != KVMIX_SUCCESS)
        abort();
    for (int i = 0; i < N_ROWS - 1; i++)
        if (!isfinite(out[i])) abort();
    if (out[N_ROWS - 1] != -INFINITY) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static intent_residual_doc untouched;
    intent_residual_doc doc, back;
    char err[256];
    memset(&untouched, 0x5a, sizeof untouched);
    if (intent_residual_parse((const char *)data, size, &untouched, err, sizeof err) !=
        KVMIX_SUCCESS) {
        const uint8_t *p = (const uint8_t *)&untouched;
        for (size_t i = 0; i < sizeof untouched; i++)
            if (p[i] != 0x5a) abort(); /* a failed parse wrote its output */
        if (strlen(err) == 0 || strlen(err) >= sizeof err) abort();
        return 0;
    }
    doc = untouched;
    if (kvmix_intent_residual_check(&doc.weights, NULL) != KVMIX_SUCCESS) abort();
    rescore(&doc.weights);
    char *text = intent_residual_json(&doc.weights, doc.description);
    if (text == NULL) abort(); /* weights that parsed check */
    if (intent_residual_parse(text, strlen(text), &back, err, sizeof err) != KVMIX_SUCCESS ||
        !intent_residual_equal(&doc, &back))
        abort();
    char *again = intent_residual_json(&back.weights, back.description);
    if (again == NULL || strcmp(text, again) != 0) abort();
    free(text);
    free(again);
    intent_residual_free(&back);
    intent_residual_free(&doc);
    return 0;
}

#ifdef FUZZ_DRIVER

#define FUZZ_MAX_INPUT (1 << 13)
#include "fuzz_seed_driver.h"

enum { MAX_SEEDS = 8, MAX_H = 4 };

static const char *const WORDS[] = {"\"version\"",
                                    "\"hidden\"",
                                    "\"w1\"",
                                    "\"b1\"",
                                    "\"w2\"",
                                    "\"alpha_max\"",
                                    "\"description\"",
                                    "\"features\"",
                                    "\"readout\"",
                                    "\"rule\"",
                                    "[0.5, -1]",
                                    "[]",
                                    "-0",
                                    "3.4028235e38",
                                    "3.4028234663852886e+38",
                                    "1e-46",
                                    "1e400",
                                    "257",
                                    "null",
                                    "\"\\u0000\"",
                                    "\"b2\": 1,"};

static void edit(buffer *b, size_t at, uint64_t kind, uint64_t *rng) {
    fuzz_json_edit(b, at, kind, WORDS, sizeof WORDS / sizeof WORDS[0], rng);
}

static void mutate(buffer *b, uint64_t *rng) { fuzz_mutate(b, rng, 5, edit); }

/* Weights of width hidden: w1 from a formula, zero output projection when zero_out. */
static void add_seed(buffer *seeds, int32_t *n, int32_t hidden, int zero_out, const char *about) {
    static float w1[MAX_H * F], b1[MAX_H], w2[MAX_H];
    kvmix_intent_residual w;
    memset(&w, 0, sizeof w);
    for (int32_t i = 0; i < hidden * F; i++) w1[i] = (float)((i * 5) % 13 - 6) / 7.0f;
    for (int32_t j = 0; j < hidden; j++) {
        b1[j] = (float)j * 0.1f - 0.2f;
        w2[j] = zero_out ? 0.0f : (float)(j + 1) * -0.3f;
    }
    w.n_features = F, w.hidden = hidden, w.w1 = w1, w.b1 = b1, w.w2 = w2;
    w.b2 = zero_out ? 0.0f : 0.125f;
    w.alpha = zero_out ? 0.0f : 0.3f;
    w.alpha_max = 1.0f;
    char *text = intent_residual_json(&w, about);
    if (text == NULL || strlen(text) > FUZZ_MAX_INPUT) exit(1);
    seeds[*n].size = strlen(text);
    memcpy(seeds[(*n)++].bytes, text, strlen(text));
    free(text);
}

int main(int argc, char **argv) {
    static buffer seeds[MAX_SEEDS];
    int32_t n_seeds = 0;
    add_seed(seeds, &n_seeds, 1, 1, "day zero: the rule");
    add_seed(seeds, &n_seeds, 2, 0, "");
    add_seed(seeds, &n_seeds, MAX_H, 0, "a \"quoted\"\\ description\n");
    return fuzz_seed_main(argc, argv, seeds, n_seeds, MAX_SEEDS, 0x51ed270b27d1f3a5u, mutate);
}

#endif /* FUZZ_DRIVER */
