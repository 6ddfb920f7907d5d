/* Fuzz target for the INT4 probe record reader (tier_probe_parse, examples/tier_probe.c): a
 * document that parses writes back a document that parses to the same record; one that does not
 * leaves the output untouched and says why.
 *
 * libFuzzer:  clang -fsanitize=fuzzer,address,undefined -I. -Iexamples tests/fuzz_probe.c \
 *                 examples/tier_probe.c examples/tag_spec_json.c -lcjson -lm
 * Driver (-DFUZZ_DRIVER, any compiler; tests/fuzz_seed_driver.h): `fuzz_probe_run [N] [FILE...]`
 * first checks the reader on fixed documents (each refusal with its result), then runs each
 * file and N seeded mutations of the seeds and the files.
 */
#ifdef FUZZ_DRIVER
#define _POSIX_C_SOURCE 200809L /* the plain driver's limits: tests/fuzz_limits.h */
#endif
#include "tier_probe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    tier_probe_record out, back;
    char err[256];
    memset(&out, 0x5a, sizeof out);
    if (tier_probe_parse((const char *)data, size, &out, err, sizeof err) != KVMIX_SUCCESS) {
        const uint8_t *p = (const uint8_t *)&out;
        for (size_t i = 0; i < sizeof out; i++)
            if (p[i] != 0x5a) abort(); /* a failed parse wrote its output */
        if (strlen(err) == 0 || strlen(err) >= sizeof err) abort();
        return 0;
    }
    char *text = tier_probe_json(&out);
    if (!text) abort(); /* a record that parsed checks */
    memset(&back, 0, sizeof back);
    if (tier_probe_parse(text, strlen(text), &back, err, sizeof err) != KVMIX_SUCCESS ||
        strcmp(back.model, out.model) != 0 || back.budget != out.budget ||
        back.n_trials != out.n_trials || back.n_pass != out.n_pass ||
        back.n_passed != out.n_passed || back.allow_int4 != out.allow_int4)
        abort();
    free(text);
    return 0;
}

#ifdef FUZZ_DRIVER

#define FUZZ_MAX_INPUT (1 << 12)
#include "fuzz_seed_driver.h"

enum { MAX_SEEDS = 4 };

static const char *const WORDS[] = {"\"version\"", "\"kind\"",   "\"budget\"", "\"trials\"",
                                    "\"pass\"",    "\"passed\"", "true",       "false",
                                    "0.3",         "1e9",        "null",       "{}"};

static void edit(buffer *b, size_t at, uint64_t kind, uint64_t *rng) {
    if (kind == 0) {
        b->bytes[at] = fuzz_json_byte(next_random(rng));
    } else if (kind == 1) {
        b->size = at;
    } else {
        fuzz_insert_word(b, at, WORDS, sizeof WORDS / sizeof WORDS[0], rng);
    }
}

static void mutate(buffer *b, uint64_t *rng) { fuzz_mutate(b, rng, 3, edit); }

#define GOOD "\"kind\": \"kvmix-int4-probe\", \"model\": \"kvm-small\", \"budget\": 0.3, "

/* The reader on fixed documents: what it accepts, each refusal's result; 0 when all hold. */
static int check_fixed(void) {
    static const struct {
        const char *doc;
        kvmix_result want;
    } cases[] = {{"{\"version\": 1, " GOOD
                  "\"trials\": 3, \"pass\": 2, \"passed\": 2, \"allow_int4\": true}",
                  KVMIX_SUCCESS},
                 {"{\"version\": 1, " GOOD
                  "\"trials\": 3, \"pass\": 2, \"passed\": 1, \"allow_int4\": true}",
                  KVMIX_ERR_MALFORMED}, /* inconsistent verdict */
                 {"{\"version\": 2, " GOOD
                  "\"trials\": 3, \"pass\": 2, \"passed\": 2, \"allow_int4\": true}",
                  KVMIX_ERR_VERSION},
                 {"{\"version\": 1, " GOOD
                  "\"trials\": 3, \"pass\": 4, \"passed\": 2, \"allow_int4\": false}",
                  KVMIX_ERR_MALFORMED}, /* pass beyond trials */
                 {"{\"version\": 1, " GOOD "\"trials\": 3, \"pass\": 2, \"passed\": 2}",
                  KVMIX_ERR_MALFORMED},
                 {"{\"version\": 1, " GOOD
                  "\"trials\": 3, \"pass\": 2, \"passed\": 2, \"allow_int4\": true, "
                  "\"extra\": 1}",
                  KVMIX_ERR_MALFORMED},
                 {"{\"version\": 1, " GOOD
                  "\"trials\": 3, \"pass\": 2, \"passed\": 2, \"allow_int4\": true} x",
                  KVMIX_ERR_MALFORMED}};
    tier_probe_record r, made;
    char err[256];
    int bad = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvmix_result got =
            tier_probe_parse(cases[i].doc, strlen(cases[i].doc), &r, err, sizeof err);
        if (got != cases[i].want) {
            fprintf(stderr, "probe case %zu: %d, want %d (%s)\n", i, got, cases[i].want, err);
            bad++;
        }
    }
    if (tier_probe_record_make("kvm-small", 0.3, 3, 2, 2, &made) != KVMIX_SUCCESS ||
        !made.allow_int4 ||
        tier_probe_record_make("kvm-small", 0.3, 3, 2, 1, &made) != KVMIX_SUCCESS ||
        made.allow_int4 || tier_probe_record_make("", 0.3, 3, 2, 1, &made) == KVMIX_SUCCESS ||
        tier_probe_record_make("m", 1.5, 3, 2, 1, &made) == KVMIX_SUCCESS) {
        fprintf(stderr, "probe record: a wrong verdict or a bad record made\n");
        bad++;
    }
    return bad;
}

int main(int argc, char **argv) {
    static buffer seeds[MAX_SEEDS];
    tier_probe_record r;
    int32_t n_seeds = 0;
    if (check_fixed() != 0) return 1;
    for (int32_t passed = 0; passed <= 3; passed++) {
        char *text;
        if (tier_probe_record_make(passed % 2 ? "kvm-base" : "kvm-small", 0.3, 3, 2, passed, &r) !=
                KVMIX_SUCCESS ||
            !(text = tier_probe_json(&r)))
            return 1;
        seeds[n_seeds].size = strlen(text);
        memcpy(seeds[n_seeds++].bytes, text, strlen(text));
        free(text);
    }
    return fuzz_seed_main(argc, argv, seeds, n_seeds, MAX_SEEDS, 0x6a09e667f3bcc908u, mutate);
}

#endif /* FUZZ_DRIVER */
