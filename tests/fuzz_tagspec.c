/* Fuzz target for the template spec reader (tag_spec_parse, examples/tag_spec_json.c) and its
 * writer: a document that parses writes (tag_spec_json) a text that parses back to an equal doc
 * and writes the same text again; a document that does not parse leaves the output untouched.
 *
 * libFuzzer:  clang -fsanitize=fuzzer,address,undefined -I. -Iexamples tests/fuzz_tagspec.c \
 *                 examples/tag_spec_json.c -lcjson -lm
 * Driver (-DFUZZ_DRIVER, any compiler; tests/fuzz_seed_driver.h): `fuzz_tagspec_run [N] [FILE...]`
 * runs each file, then N (default 4000) seeded mutations of the seeds (the shipped spec
 * documents' shapes, written by tag_spec_json) and the files. `--write-seeds DIR` writes them.
 */
#ifdef FUZZ_DRIVER
#define _POSIX_C_SOURCE 200809L /* the plain driver's limits: tests/fuzz_limits.h */
#endif
#include "tag_spec_json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static tag_spec_doc doc, back, untouched;
    char err[256];
    memset(&untouched, 0x5a, sizeof untouched);
    if (tag_spec_parse((const char *)data, size, &untouched, err, sizeof err) != KVMIX_SUCCESS) {
        const uint8_t *p = (const uint8_t *)&untouched;
        for (size_t i = 0; i < sizeof untouched; i++)
            if (p[i] != 0x5a) abort(); /* a failed parse wrote its output */
        if (strlen(err) == 0 || strlen(err) >= sizeof err) abort();
        return 0;
    }
    doc = untouched;
    if (kvmix_tag_spec_check(&doc.spec, NULL) != KVMIX_SUCCESS) abort();
    char *text = tag_spec_json(&doc);
    if (text == NULL) return 0;
    if (tag_spec_parse(text, strlen(text), &back, err, sizeof err) != KVMIX_SUCCESS ||
        !tag_spec_equal(&doc, &back))
        abort();
    char *again = tag_spec_json(&back);
    if (again == NULL || strcmp(text, again) != 0) abort();
    free(text);
    free(again);
    return 0;
}

#ifdef FUZZ_DRIVER

#define FUZZ_MAX_INPUT (1 << 13)
#include "fuzz_seed_driver.h"

enum { MAX_SEEDS = 16 };

static const char *const WORDS[] = {"\"version\"",
                                    "\"roles\"",
                                    "\"channels\"",
                                    "\"recipient\"",
                                    "\"image_pad\"",
                                    "\"header_end\"",
                                    "[[1]]",
                                    "[[1, 2], [3]]",
                                    "[]",
                                    "{\"name\": \"x\", \"role\": \"user\", \"ids\": [5]}",
                                    "\"scaffold\"",
                                    "\"observation\"",
                                    "-1",
                                    "2147483648",
                                    "1.5",
                                    "null",
                                    "[[]]",
                                    "\"message_end\": [[7]],"};

static void edit(buffer *b, size_t at, uint64_t kind, uint64_t *rng) {
    fuzz_json_edit(b, at, kind, WORDS, sizeof WORDS / sizeof WORDS[0], rng);
}

static void mutate(buffer *b, uint64_t *rng) { fuzz_mutate(b, rng, 5, edit); }

static void add_seed(buffer *seeds, int32_t *n, const tag_spec_doc *doc) {
    char *text = tag_spec_json(doc);
    if (text == NULL || strlen(text) > FUZZ_MAX_INPUT) exit(1);
    seeds[*n].size = strlen(text);
    memcpy(seeds[(*n)++].bytes, text, strlen(text));
    free(text);
}

static void set1(kvmix_tag_marker *m, int alt, int32_t id) {
    m->alts[alt].n_ids = 1;
    m->alts[alt].ids[0] = id;
}
static void name(kvmix_tag_name *names, int32_t *n, const char *text, int role, int32_t a,
                 int32_t b) {
    kvmix_tag_name *x = &names[(*n)++];
    snprintf(x->text, sizeof x->text, "%s", text);
    x->role = role;
    x->seq.ids[0] = a;
    x->seq.ids[1] = b;
    x->seq.n_ids = b >= 0 ? 2 : 1;
}

int main(int argc, char **argv) {
    static buffer seeds[MAX_SEEDS];
    static tag_spec_doc d;
    int32_t n_seeds = 0;
    /* ChatML (the shapes of kvm-byte.json and qwen3.json) */
    snprintf(d.name, sizeof d.name, "chatml");
    snprintf(d.description, sizeof d.description, "a \"quoted\"\\ description\n");
    set1(&d.spec.message_start, 0, 257), set1(&d.spec.message_end, 0, 258);
    set1(&d.spec.header_end, 0, 10), set1(&d.spec.header_end, 1, 271);
    set1(&d.spec.reasoning_open, 0, 259), set1(&d.spec.reasoning_close, 0, 260);
    set1(&d.spec.tool_call_open, 0, 261), set1(&d.spec.tool_call_close, 0, 262);
    set1(&d.spec.tool_response_open, 0, 263), set1(&d.spec.tool_response_close, 0, 264);
    set1(&d.spec.vision_open, 0, 265), set1(&d.spec.vision_close, 0, 266);
    set1(&d.spec.image_pad, 0, 267), set1(&d.spec.image_pad, 1, 268);
    name(d.spec.roles, &d.spec.n_roles, "system", KVMIX_ROLE_INSTRUCTION, 115, 121);
    name(d.spec.roles, &d.spec.n_roles, "user", KVMIX_ROLE_USER, 117, -1);
    name(d.spec.roles, &d.spec.n_roles, "assistant", KVMIX_ROLE_ASSISTANT, 97, 115);
    name(d.spec.roles, &d.spec.n_roles, "tool", KVMIX_ROLE_OBSERVATION, 116, -1);
    add_seed(seeds, &n_seeds, &d);
    /* harmony (the shape of gpt-oss.json) */
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "harmony");
    set1(&d.spec.message_start, 0, 200006), set1(&d.spec.message_end, 0, 200007);
    set1(&d.spec.message_end, 1, 200012), set1(&d.spec.message_end, 2, 200002);
    set1(&d.spec.header_end, 0, 200008), set1(&d.spec.channel, 0, 200005);
    d.spec.recipient.alts[0].n_ids = 2;
    d.spec.recipient.alts[0].ids[0] = 316, d.spec.recipient.alts[0].ids[1] = 28;
    name(d.spec.roles, &d.spec.n_roles, "system", KVMIX_ROLE_INSTRUCTION, 17360, -1);
    name(d.spec.roles, &d.spec.n_roles, "user", KVMIX_ROLE_USER, 1428, -1);
    name(d.spec.roles, &d.spec.n_roles, "assistant", KVMIX_ROLE_ASSISTANT, 173781, -1);
    name(d.spec.roles, &d.spec.n_roles, "functions", KVMIX_ROLE_OBSERVATION, 44580, -1);
    name(d.spec.channels, &d.spec.n_channels, "analysis", KVMIX_ROLE_REASONING, 35644, -1);
    name(d.spec.channels, &d.spec.n_channels, "commentary", KVMIX_ROLE_ASSISTANT, 12606, 815);
    name(d.spec.channels, &d.spec.n_channels, "final", KVMIX_ROLE_ASSISTANT, 17196, -1);
    add_seed(seeds, &n_seeds, &d);
    /* role starts, no header (the shape of deepseek-v3.json; version 3) */
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "deepseek-v3");
    set1(&d.spec.message_end, 0, 1);
    set1(&d.spec.tool_call_open, 0, 128808), set1(&d.spec.tool_call_close, 0, 128809);
    set1(&d.spec.tool_response_open, 0, 128812), set1(&d.spec.tool_response_close, 0, 128813);
    name(d.spec.role_starts, &d.spec.n_role_starts, "system", KVMIX_ROLE_INSTRUCTION, 0, -1);
    name(d.spec.role_starts, &d.spec.n_role_starts, "user", KVMIX_ROLE_USER, 128803, -1);
    name(d.spec.role_starts, &d.spec.n_role_starts, "assistant", KVMIX_ROLE_ASSISTANT, 128804, -1);
    name(d.spec.role_starts, &d.spec.n_role_starts, "tool outputs", KVMIX_ROLE_OBSERVATION, 128810,
         -1);
    add_seed(seeds, &n_seeds, &d);
    return fuzz_seed_main(argc, argv, seeds, n_seeds, MAX_SEEDS, 0x7a6b5c4d3e2f1a0bu, mutate);
}

#endif /* FUZZ_DRIVER */
