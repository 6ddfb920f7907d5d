/* Fuzz target for the tag allocation readers (tag_allocation_parse and
 * tag_allocation_prices_parse, examples/tag_allocation.c): a document that parses gives a table of
 * known formats only and prices in (0, 65536] or 0; one that does not leaves the output
 * untouched and says why.
 *
 * libFuzzer:  clang -fsanitize=fuzzer,address,undefined -I. -Iexamples tests/fuzz_allocation.c \
 *                 examples/tag_allocation.c examples/tag_spec_json.c -lcjson -lm
 * Driver (-DFUZZ_DRIVER, any compiler; tests/fuzz_seed_driver.h): `fuzz_allocation_run [N]
 * [FILE...]` runs each file, then N seeded mutations of the seeds and the files.
 */
#ifdef FUZZ_DRIVER
#define _POSIX_C_SOURCE 200809L /* the plain driver's limits: tests/fuzz_limits.h */
#endif
#include "tag_allocation.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The prices of a document whose formats parsed: in range, or untouched with a reason. */
static void check_prices(const uint8_t *data, size_t size) {
    static tag_prices prices;
    char err[256];
    memset(&prices, 0x5a, sizeof prices);
    if (tag_allocation_prices_parse((const char *)data, size, &prices, err, sizeof err) !=
        KVMIX_SUCCESS) {
        const uint8_t *p = (const uint8_t *)&prices;
        for (size_t i = 0; i < sizeof prices; i++)
            if (p[i] != 0x5a) abort();
        if (strlen(err) == 0 || strlen(err) >= sizeof err) abort();
        return;
    }
    const double *bits = &prices.bits[0][0][0];
    for (size_t i = 0; i < sizeof prices / sizeof *bits; i++)
        if (!(bits[i] == 0 || (bits[i] > 0 && bits[i] <= 65536.0))) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static kvmix_tag_precision out;
    kvmix_cache_precision int4 = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4};
    char err[256];
    memset(&out, 0x5a, sizeof out);
    if (tag_allocation_parse((const char *)data, size, int4, &out, err, sizeof err) !=
        KVMIX_SUCCESS) {
        const uint8_t *p = (const uint8_t *)&out;
        for (size_t i = 0; i < sizeof out; i++)
            if (p[i] != 0x5a) abort(); /* a failed parse wrote its output */
        if (strlen(err) == 0 || strlen(err) >= sizeof err) abort();
        return 0;
    }
    if (kvmix_tag_precision_check(&out, NULL) != KVMIX_SUCCESS) abort();
    check_prices(data, size);
    return 0;
}

#ifdef FUZZ_DRIVER

#define FUZZ_MAX_INPUT (1 << 12)
#include "fuzz_seed_driver.h"

enum { MAX_SEEDS = 8 };

static const char *const WORDS[] = {
    "\"bucket\"", "\"role\"",      "\"modality\"",   "\"key_format\"", "\"value_format\"",
    "\"older\"",  "\"reasoning\"", "\"image\"",      "\"boosted\"",    "\"fp16\"",
    "\"tags\"",   "\"bits\": 2.5", "\"version\": 1", "null",           "[]",
    "{}"};

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

int main(int argc, char **argv) {
    static buffer seeds[MAX_SEEDS];
    static const char *const docs[] = {
        "{\"version\": 1, \"kind\": \"kvmix-allocation\", \"budget_bits\": 3, \"tags\": ["
        "{\"name\": \"current/user/text\", \"bucket\": \"current\", \"role\": \"user\", "
        "\"modality\": \"text\", \"key_format\": \"int8\", \"value_format\": \"int8\"}, "
        "{\"bucket\": \"older\", \"role\": \"observation\", \"modality\": \"image\", "
        "\"key_format\": \"int2_channel\", \"value_format\": \"int2\"}]}",
        "{\"version\": 1, \"kind\": \"kvmix-allocation\", \"tags\": []}"};
    int32_t n_seeds = 0;
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
        seeds[n_seeds].size = strlen(docs[i]);
        memcpy(seeds[n_seeds++].bytes, docs[i], strlen(docs[i]));
    }
    return fuzz_seed_main(argc, argv, seeds, n_seeds, MAX_SEEDS, 0x51d2c3b4a5968778u, mutate);
}

#endif /* FUZZ_DRIVER */
