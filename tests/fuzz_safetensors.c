/* Fuzz target for the readers of outside bytes in llama.c: the safetensors header, the model
 * config JSON and the capture file. Every input goes through all three.
 *
 * libFuzzer:  clang -fsanitize=fuzzer,address,undefined -Iexamples tests/fuzz_safetensors.c \
 *                 examples/llama.c -lcjson -lm -lpthread
 * Driver (-DFUZZ_DRIVER, any compiler; tests/fuzz_seed_driver.h): `fuzz_safetensors_run [N]
 * [FILE...]` runs each file, then N (default 4000) seeded mutations of the built-in seeds and the
 * files, so CI without libFuzzer explores the same code deterministically. `--write-seeds DIR`
 * writes the seeds for libFuzzer.
 */
#ifdef FUZZ_DRIVER
#define _POSIX_C_SOURCE 200809L /* the plain driver's limits: tests/fuzz_limits.h */
#endif
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[256];
    llama_config config;
    llama_tokenizer tok;
    llama_safetensors st;
    if (llama_safetensors_parse(data, size, &st, err, sizeof err) == LLAMA_OK) {
        if (st.config_json != NULL)
            llama_config_parse(st.config_json, strlen(st.config_json), &config, &tok, err,
                               sizeof err);
        llama_safetensors_free(&st);
    }
    if (size > 0) llama_config_parse((const char *)data, size, &config, &tok, err, sizeof err);
    llama_capture cap;
    if (llama_capture_parse(data, size, &cap, err, sizeof err) == LLAMA_OK)
        llama_capture_free(&cap);
    return 0;
}

#ifdef FUZZ_DRIVER

#define FUZZ_MAX_INPUT (1 << 16)
#include "fuzz_seed_driver.h"

enum { MAX_SEEDS = 16 };

static const char SEED_CONFIG[] =
    "{\"hidden_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
    "\"num_key_value_heads\": 1, \"head_dim\": 4, \"intermediate_size\": 8, "
    "\"max_position_embeddings\": 16, \"rope_theta\": 10000.0, \"rms_norm_eps\": 1e-05, "
    "\"vocab_size\": 258, \"tie_word_embeddings\": true, \"tokenizer\": {\"special_tokens\": "
    "{\"<|endoftext|>\": 256, \"<|im_end|>\": 257}}}";

static void put_u64_le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void seed_safetensors(buffer *b) {
    char config[2 * sizeof SEED_CONFIG], json[4096];
    size_t c = 0;
    for (const char *p = SEED_CONFIG; *p != 0; p++) { /* escaped as a JSON string */
        if (*p == '"') config[c++] = '\\';
        config[c++] = *p;
    }
    config[c] = 0;
    int n = snprintf(
        json, sizeof json,
        "{\"__metadata__\": {\"format\": \"pt\", \"config\": \"%s\"}, "
        "\"model.norm.weight\": {\"dtype\": \"F16\", \"shape\": [8], \"data_offsets\": [0, 16]}, "
        "\"w\": {\"dtype\": \"BF16\", \"shape\": [2, 2], \"data_offsets\": [16, 24]}, "
        "\"x\": {\"dtype\": \"F32\", \"shape\": [], \"data_offsets\": [24, 28]}}",
        config);
    put_u64_le(b->bytes, (uint64_t)n);
    memcpy(b->bytes + 8, json, (size_t)n);
    for (size_t i = 0; i < 28; i++) b->bytes[8 + (size_t)n + i] = (uint8_t)(i * 37);
    b->size = 8 + (size_t)n + 28;
}

static void seed_capture(buffer *b) {
    const uint32_t header[] = {1, 1, 2,
                               1, 2, 3}; /* version, layers, heads, kv heads, dim, tokens */
    memcpy(b->bytes, "KVMXCAPT", 8);
    for (size_t i = 0; i < 6; i++)
        for (int j = 0; j < 4; j++)
            b->bytes[8 + 4 * i + (size_t)j] = (uint8_t)(header[i] >> (8 * j));
    b->size = 32 + 4 * 3 + 4 * 3 * (2 + 2 * 1) * 2;
    for (size_t i = 32; i < b->size; i++) b->bytes[i] = (uint8_t)(i % 3 == 0 ? 0 : i);
}

static void seed_config(buffer *b) {
    b->size = strlen(SEED_CONFIG);
    memcpy(b->bytes, SEED_CONFIG, b->size);
}

/* A safetensors header edited as text, its length field then fixed so the JSON is what changes. */
static bool mutate_header_text(buffer *b, uint64_t *rng) {
    if (b->size < 8) return false;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b->bytes[i];
    if (n == 0 || n > b->size - 8 || b->size + 1 > FUZZ_MAX_INPUT) return false;
    size_t at = 8 + (size_t)(next_random(rng) % n);
    char c = (char)fuzz_json_byte(next_random(rng));
    switch (next_random(rng) % 3) {
    case 0: b->bytes[at] = (uint8_t)c; break;
    case 1: /* insert */
        memmove(b->bytes + at + 1, b->bytes + at, b->size - at);
        b->bytes[at] = (uint8_t)c;
        b->size++;
        n++;
        break;
    default: /* delete */
        memmove(b->bytes + at, b->bytes + at + 1, b->size - at - 1);
        b->size--;
        n--;
        break;
    }
    put_u64_le(b->bytes, n);
    return true;
}

static void edit(buffer *b, size_t at, uint64_t kind, uint64_t *rng) {
    switch (kind) {
    case 0: b->bytes[at] ^= (uint8_t)(1u << (next_random(rng) % 8)); break;
    case 1: b->bytes[at] = (uint8_t)next_random(rng); break;
    case 2: b->size = at; break;
    case 3: /* a small or huge number in a header field */
        if ((at & ~(size_t)3) + 4 <= b->size) {
            uint32_t v = next_random(rng) % 2 ? (uint32_t)(next_random(rng) % 5)
                                              : (uint32_t)next_random(rng);
            for (int j = 0; j < 4; j++)
                b->bytes[(at & ~(size_t)3) + (size_t)j] = (uint8_t)(v >> (8 * j));
        }
        break;
    default:
        if (!mutate_header_text(b, rng)) b->bytes[at] = fuzz_json_byte(at);
        break;
    }
}

static void mutate(buffer *b, uint64_t *rng) { fuzz_mutate(b, rng, 6, edit); }

int main(int argc, char **argv) {
    static buffer seeds[MAX_SEEDS];
    seed_safetensors(&seeds[0]);
    seed_capture(&seeds[1]);
    seed_config(&seeds[2]);
    return fuzz_seed_main(argc, argv, seeds, 3, MAX_SEEDS, 0x9e3779b97f4a7c15u, mutate);
}

#endif /* FUZZ_DRIVER */
