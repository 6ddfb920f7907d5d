/* Template tags on real token streams.
 *   - The reference models' spec (examples/specs/kvm-byte.json) on every agent trace of
 *     SHARED/data/eval-dev.jsonl, encoded as the models' tokenizer does (special-token strings to
 *     ids 256-267, other text to bytes): no fallback tag, reasoning / tool-call / tool-response
 *     bracket contents get their roles outside system prompts, every marker is scaffold, the turn
 *     count is the number of user messages that are not tool results, runs agree with one id at a
 *     time.
 *   - Spec document versions: a version 1 document still loads, "recipient" needs version 2.
 *   - The tools: build/kvmix-tag on a line of ids (JSON out), build/kvmix-tagspec on the real
 *     tokenizers (its output equals the shipped spec files).
 *   - The two real templates of SHARED/tokenizers (Qwen3 ChatML, gpt-oss harmony): the spec that
 *     kvmix-tagspec's generator writes from tokenizer.json + tokenizer_config.json equals the
 *     shipped examples/specs file byte for byte; a conversation with a system prompt and tool
 *     schemas, user turns, reasoning, tool calls, tool results, (gpt-oss) a preamble on the
 *     commentary channel and both places of a recipient, and (Qwen3) an image, encoded with the
 *     tokenizer's own vocabulary and merges, gets the expected tag on every token.
 * Usage: test_tags SHARED_DIR (run from the repository root; SPECS_DIR, default examples/specs).
 * A missing tokenizers folder is one skip line. Prints "N passed, N failed". */
#define _POSIX_C_SOURCE 200809L
#include "hf_tokenizer.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef SPECS_DIR
#define SPECS_DIR "examples/specs"
#endif
#ifndef BUILD_DIR
#define BUILD_DIR "build"
#endif

#include "model_check.h"

/* Feeds ids whole and in runs of 1..37; both must agree. Returns the whole-feed tags. */
static kvmix_tag *tag_all(const kvmix_tag_spec *spec, const int32_t *ids, int32_t n,
                          int32_t *out_turn) {
    static kvmix_tagger a, b;
    kvmix_tag *whole = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)(n + 1));
    kvmix_tag *runs = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)(n + 1));
    if (whole == NULL || runs == NULL) abort();
    CHECK(kvmix_tagger_init(&a, spec, NULL) == KVMIX_SUCCESS);
    CHECK(kvmix_tagger_init(&b, spec, NULL) == KVMIX_SUCCESS);
    CHECK(kvmix_tagger_feed(&a, ids, n, whole) == KVMIX_SUCCESS);
    for (int32_t i = 0, k = 0; i < n; k++) {
        int32_t run = 1 + (k * 7) % 37;
        if (run > n - i) run = n - i;
        CHECK(kvmix_tagger_feed(&b, ids + i, run, runs + i) == KVMIX_SUCCESS);
        i += run;
    }
    CHECK_MSG(memcmp(whole, runs, sizeof(kvmix_tag) * (size_t)n) == 0,
              "runs give the same tags as the whole stream");
    CHECK(a.turn == b.turn && a.n_breaks == b.n_breaks);
    *out_turn = a.turn;
    free(runs);
    return whole;
}

/* ---- the reference models' traces ------------------------------------------------------------ */
static const char *const BYTE_SPECIALS[12] = {
    "<|endoftext|>",    "<|im_start|>",     "<|im_end|>",     "<think>",
    "</think>",         "<tool_call>",      "</tool_call>",   "<tool_response>",
    "</tool_response>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"};

static int32_t encode_bytes(const char *text, int32_t *ids) {
    int32_t n = 0;
    while (*text) {
        int k = 0;
        for (; k < 12; k++)
            if (strncmp(text, BYTE_SPECIALS[k], strlen(BYTE_SPECIALS[k])) == 0) break;
        if (k < 12) {
            ids[n++] = 256 + k;
            text += strlen(BYTE_SPECIALS[k]);
        } else {
            ids[n++] = (uint8_t)*text++;
        }
    }
    return n;
}

static void test_byte_traces(const char *shared) {
    char path[1024], err[256];
    tag_spec_doc doc;
    size_t n_bytes;
    snprintf(path, sizeof path, "%s/kvm-byte.json", SPECS_DIR);
    if (!CHECK(tag_spec_load(path, &doc, err, sizeof err) == KVMIX_SUCCESS)) {
        printf("  %s\n", err);
        return;
    }
    for (int32_t r = 0; r < doc.spec.n_roles; r++) { /* role ids are the name's bytes */
        const kvmix_tag_seq *q = &doc.spec.roles[r].seq;
        bool same = (size_t)q->n_ids == strlen(doc.spec.roles[r].text);
        for (int32_t i = 0; same && i < q->n_ids; i++)
            same = q->ids[i] == (uint8_t)doc.spec.roles[r].text[i];
        CHECK_MSG(same, "kvm-byte.json: role ids are the bytes of the role name");
    }
    snprintf(path, sizeof path, "%s/data/eval-dev.jsonl", shared);
    char *all = read_file(path, &n_bytes);
    if (!CHECK_MSG(all != NULL, "eval-dev.jsonl is readable")) return;
    int n_traces = 0;
    for (char *line = all, *next; line < all + n_bytes; line = next) {
        next = strchr(line, '\n');
        next = next ? next + 1 : all + n_bytes;
        cJSON *o = cJSON_ParseWithLengthOpts(line, (size_t)(next - line), NULL, 0);
        const cJSON *kind = cJSON_GetObjectItemCaseSensitive(o, "kind");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(o, "text");
        if (!cJSON_IsString(kind) || strcmp(kind->valuestring, "trace") != 0 ||
            !cJSON_IsString(text)) {
            cJSON_Delete(o);
            continue;
        }
        size_t len = strlen(text->valuestring);
        int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (len + 1)), turn;
        int32_t n = encode_bytes(text->valuestring, ids);
        kvmix_tag *tags = tag_all(&doc.spec, ids, n, &turn);
        /* an independent reading of the same stream */
        int bracket = 0, in_system = 0, want_turn = 0, fallbacks = 0, bad_role = 0, bad_scf = 0;
        for (int32_t i = 0; i < n; i++) {
            int32_t id = ids[i];
            fallbacks += tags[i].flags != 0;
            if (id == 257) {
                in_system = i + 7 <= n && memcmp(text->valuestring, "", 0) == 0 &&
                            ids[i + 1] == 's' && ids[i + 2] == 'y' && ids[i + 3] == 's';
                if (i + 6 < n && ids[i + 1] == 'u' && ids[i + 2] == 's' && ids[i + 3] == 'e' &&
                    ids[i + 4] == 'r' && ids[i + 5] == '\n' && ids[i + 6] != 263)
                    want_turn++;
            }
            bool marker = id >= 257 && id <= 266 && !(in_system && id >= 259 && id <= 264);
            if (marker) bad_scf += tags[i].role != KVMIX_ROLE_SCAFFOLD;
            if (in_system) continue;
            if (id == 259 || id == 261 || id == 263)
                bracket = id;
            else if (id == 260 || id == 262 || id == 264 || id == 258)
                bracket = 0;
            else if (bracket)
                bad_role += tags[i].role != (bracket == 259   ? KVMIX_ROLE_REASONING
                                             : bracket == 261 ? KVMIX_ROLE_TOOL_CALL
                                                              : KVMIX_ROLE_OBSERVATION);
        }
        CHECK_MSG(fallbacks == 0, "a reference trace gets no fallback tag");
        CHECK_MSG(bad_role == 0, "bracket contents get the bracket's role");
        CHECK_MSG(bad_scf == 0, "markers are scaffold");
        CHECK_MSG(turn == want_turn, "turns = user messages that are not tool results");
        free(tags);
        free(ids);
        cJSON_Delete(o);
        n_traces++;
    }
    CHECK_MSG(n_traces >= 100, "eval-dev.jsonl holds the agent traces");
    printf("reference traces: %d tagged\n", n_traces);
    free(all);
}

/* ---- real tokenizers ------------------------------------------------------------------------ */
typedef struct segment {
    const char *text; /* encoded with the tokenizer (special tokens included) */
    int role;         /* expected role of every token of it; -1: header (scaffold) */
    int turn;
    int image; /* expected modality IMAGE */
} segment;

#define S(text, role, turn)                                                                        \
    { text, role, turn, 0 }
enum { SCF = KVMIX_ROLE_SCAFFOLD };

static const segment QWEN3[] = {
    S("<|im_start|>system\n", SCF, 0),
    S("You are a weather agent.\n\n# Tools\n\nYou may call one or more functions to assist with "
      "the user query.\n\nYou are provided with function signatures within <tools></tools> XML "
      "tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
      "\"description\": \"Current weather of a city\", \"parameters\": {\"type\": \"object\", "
      "\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n"
      "</tools>\n\nFor each function call, return a json object with function name and arguments "
      "within ",
      KVMIX_ROLE_INSTRUCTION, 0),
    S("<tool_call>", KVMIX_ROLE_INSTRUCTION, 0), /* named in the system prompt: content */
    S("</tool_call> XML tags.", KVMIX_ROLE_INSTRUCTION, 0),
    S("<|im_end|>\n<|im_start|>user\n", SCF, 0),
    S("What's the weather like in Paris today? Here is a photo:", KVMIX_ROLE_USER, 1),
    S("<|vision_start|>", SCF, 1),
    {"<|image_pad|><|image_pad|><|image_pad|><|image_pad|>", KVMIX_ROLE_USER, 1, 1},
    S("<|vision_end|><|im_end|>\n<|im_start|>assistant\n<think>", SCF, 1),
    S("\nThe user wants the weather in Paris; I will call get_weather.\n", KVMIX_ROLE_REASONING, 1),
    S("</think>", SCF, 1),
    S("\n\n", KVMIX_ROLE_ASSISTANT, 1),
    S("<tool_call>", SCF, 1),
    S("\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n", KVMIX_ROLE_TOOL_CALL,
      1),
    S("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>", SCF, 1),
    S("\n{\"temperature_c\": 21, \"sky\": \"clear\"}\n", KVMIX_ROLE_OBSERVATION, 1),
    S("</tool_response>", SCF, 1),
    S("\n", KVMIX_ROLE_OBSERVATION, 1),
    S("<tool_response>", SCF, 1),
    S("\n{\"humidity\": 40}\n", KVMIX_ROLE_OBSERVATION, 1),
    S("</tool_response><|im_end|>\n<|im_start|>assistant\n<think>", SCF, 1),
    S("\n\n", KVMIX_ROLE_REASONING, 1),
    S("</think>", SCF, 1),
    S("\n\nIt is 21 degrees and clear in Paris.", KVMIX_ROLE_ASSISTANT, 1),
    S("<|im_end|>\n<|im_start|>user\n", SCF, 1),
    S("And tomorrow?", KVMIX_ROLE_USER, 2),
    S("<|im_end|>\n<|im_start|>user\n\n", SCF, 2), /* content that starts with a newline */
    S("Thanks, bye.", KVMIX_ROLE_USER, 3),
    S("<|im_end|>\n", SCF, 3),
};

static const segment GPT_OSS[] = {
    S("<|start|>system<|message|>", SCF, 0),
    S("You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: "
      "2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n# Valid channels: analysis, "
      "commentary, final. Channel must be included for every message.\nCalls to these tools "
      "must go to the commentary channel: 'functions'.",
      KVMIX_ROLE_INSTRUCTION, 0),
    S("<|end|><|start|>developer<|message|>", SCF, 0),
    S("# Instructions\n\nAnswer briefly.\n\n# Tools\n\n## functions\n\nnamespace functions "
      "{\n\n// Gets the current weather in the provided location.\ntype get_weather = (_: {\n"
      "location: string,\n}) => any;\n\n} // namespace functions",
      KVMIX_ROLE_INSTRUCTION, 0),
    S("<|end|><|start|>user<|message|>", SCF, 0),
    S("What is the weather like in Tokyo?", KVMIX_ROLE_USER, 1),
    S("<|end|><|start|>assistant<|channel|>analysis<|message|>", SCF, 1),
    S("The user asks for the weather in Tokyo. Call get_weather.", KVMIX_ROLE_REASONING, 1),
    /* commentary without a recipient: a preamble shown to the user */
    S("<|end|><|start|>assistant<|channel|>commentary<|message|>", SCF, 1),
    S("I'll look that up.", KVMIX_ROLE_ASSISTANT, 1),
    /* the recipient after the channel name */
    S("<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather "
      "<|constrain|>json<|message|>",
      SCF, 1),
    S("{\"location\":\"Tokyo\"}", KVMIX_ROLE_TOOL_CALL, 1),
    S("<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>", SCF,
      1),
    S("{\"temperature\": 20, \"sky\": \"cloudy\"}", KVMIX_ROLE_OBSERVATION, 1),
    S("<|end|><|start|>assistant<|channel|>final<|message|>", SCF, 1),
    S("It is 20 degrees and cloudy in Tokyo.", KVMIX_ROLE_ASSISTANT, 1),
    S("<|return|><|start|>user<|message|>", SCF, 1),
    S("Thanks!", KVMIX_ROLE_USER, 2),
    /* the recipient after the role */
    S("<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",
      SCF, 2),
    S("{\"location\":\"Kyoto\"}", KVMIX_ROLE_TOOL_CALL, 2),
    /* a built-in tool, called on the analysis channel */
    S("<|call|><|start|>assistant<|channel|>analysis to=browser.search code<|message|>", SCF, 2),
    S("{\"query\":\"Kyoto weather\"}", KVMIX_ROLE_TOOL_CALL, 2),
    S("<|call|>", SCF, 2),
};

static void test_tokenizer(const char *shared, const char *dir, const char *spec_name,
                           const segment *segs, int n_segs) {
    char tok_path[1024], config_path[1024], spec_path[1024], err[512];
    hf_tokenizer *tok = NULL;
    snprintf(tok_path, sizeof tok_path, "%s/tokenizers/%s/tokenizer.json.gz", shared, dir);
    snprintf(config_path, sizeof config_path, "%s/tokenizers/%s/tokenizer_config.json", shared,
             dir);
    snprintf(spec_path, sizeof spec_path, "%s/%s.json", SPECS_DIR, spec_name);
    if (!CHECK(hf_tokenizer_load(tok_path, config_path, &tok, err, sizeof err) == KVMIX_SUCCESS)) {
        printf("  %s\n", err);
        return;
    }
    /* the shipped spec is what the generator writes */
    tag_spec_doc gen, shipped;
    size_t n_file = 0;
    char *file = read_file(spec_path, &n_file);
    CHECK(hf_tag_spec_generate(tok, NULL, spec_name, NULL, &gen, err, sizeof err) == KVMIX_SUCCESS);
    char *text = tag_spec_json(&gen);
    CHECK_MSG(file != NULL && text != NULL && strlen(text) == n_file &&
                  memcmp(text, file, n_file) == 0,
              "the generator rewrites the shipped spec file byte for byte");
    CHECK(tag_spec_load(spec_path, &shipped, err, sizeof err) == KVMIX_SUCCESS);
    CHECK(tag_spec_equal(&gen, &shipped));
    free(text);
    free(file);
    /* the conversation, segment by segment, and whole */
    enum { CAP = 8192 };
    static int32_t ids[CAP], whole[CAP];
    static kvmix_tag want[CAP];
    static char joined[32768];
    int32_t n = 0, n_whole = 0;
    joined[0] = 0;
    for (int s = 0; s < n_segs; s++) {
        int32_t k = 0;
        size_t len = strlen(segs[s].text);
        CHECK(hf_tokenizer_encode(tok, segs[s].text, len, ids + n, CAP - n, &k) == KVMIX_SUCCESS);
        for (int32_t i = n; i < n + k; i++) {
            want[i].turn = segs[s].turn;
            want[i].role = (uint8_t)segs[s].role;
            want[i].modality =
                (uint8_t)(segs[s].image ? KVMIX_MODALITY_IMAGE : KVMIX_MODALITY_TEXT);
            want[i].flags = 0;
            want[i].reserved = 0;
        }
        n += k;
        strcat(joined, segs[s].text);
    }
    CHECK(hf_tokenizer_encode(tok, joined, strlen(joined), whole, CAP, &n_whole) == KVMIX_SUCCESS);
    CHECK_MSG(n_whole == n && memcmp(whole, ids, sizeof(int32_t) * (size_t)n) == 0,
              "segments encode as the whole conversation does");
    /* decoding gives the text back */
    static char back[32768];
    size_t at = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t k = hf_tokenizer_decode(tok, ids[i], back + at, sizeof back - at);
        if (!CHECK(k >= 0)) break;
        at += (size_t)k;
    }
    CHECK_MSG(at == strlen(joined) && memcmp(back, joined, at) == 0,
              "decoding the ids gives the text back");
    int32_t turn;
    kvmix_tag *tags = tag_all(&shipped.spec, ids, n, &turn);
    int bad = 0;
    for (int32_t i = 0; i < n; i++)
        if (memcmp(&tags[i], &want[i], sizeof want[i]) != 0 && bad++ < 5) {
            char buf[64] = "";
            int32_t k = hf_tokenizer_decode(tok, ids[i], buf, sizeof buf - 1);
            buf[k > 0 ? k : 0] = 0;
            printf("  %s token %d (id %d \"%s\"): got %s turn %d modality %d flags %d, want %s "
                   "turn %d\n",
                   spec_name, (int)i, (int)ids[i], buf,
                   kvmix_tag_role_name((kvmix_tag_role)tags[i].role), tags[i].turn,
                   tags[i].modality, tags[i].flags,
                   kvmix_tag_role_name((kvmix_tag_role)want[i].role), want[i].turn);
        }
    CHECK_MSG(bad == 0, "every token of the conversation gets its expected tag");
    CHECK(turn == want[n - 1].turn);
    printf("%s: %d ids tagged, %d mismatches\n", spec_name, (int)n, bad);
    free(tags);
    hf_tokenizer_free(tok);
}

static char *run_capture(const char *cmd);

/* ---- template fixtures (tests/templates) ---------------------------------------------------- */
#ifndef TEMPLATES_DIR
#define TEMPLATES_DIR "tests/templates"
#endif

/* The int array `key` of a fixture conversation, n entries, or NULL. */
static int32_t *fixture_ints(const cJSON *conv, const char *key, int32_t n) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(conv, key);
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != n) return NULL;
    int32_t *v = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n + 1)), i = 0;
    if (v == NULL) abort();
    for (const cJSON *x = a->child; x != NULL; x = x->next) v[i++] = (int32_t)x->valuedouble;
    return v;
}

/* One conversation: every content token (truth not "-", template text, or "*", a token across
   template text and content) gets its truth's role, turn and modality. */
static void check_fixture_conversation(const kvmix_tag_spec *spec, const cJSON *conv) {
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(conv, "name");
    const cJSON *ids_json = cJSON_GetObjectItemCaseSensitive(conv, "ids");
    const cJSON *truth = cJSON_GetObjectItemCaseSensitive(conv, "truth");
    int32_t n = cJSON_GetArraySize(ids_json), n_content = 0, bad = 0, turn;
    int32_t *ids = fixture_ints(conv, "ids", n), *turns = fixture_ints(conv, "turn", n);
    int32_t *image = fixture_ints(conv, "image", n);
    if (!CHECK(cJSON_IsString(name) && n > 0 && ids && turns && image &&
               cJSON_GetArraySize(truth) == n)) {
        free(ids);
        free(turns);
        free(image);
        return;
    }
    kvmix_tag *tags = tag_all(spec, ids, n, &turn);
    const cJSON *t = truth->child;
    for (int32_t i = 0; i < n; i++, t = t->next) {
        kvmix_tag_role role;
        if (strcmp(t->valuestring, "-") == 0 || strcmp(t->valuestring, "*") == 0) continue;
        n_content++;
        if (!CHECK(kvmix_tag_role_from_name(t->valuestring, &role) == KVMIX_SUCCESS)) break;
        if ((tags[i].role == role && tags[i].turn == turns[i] && tags[i].flags == 0 &&
             tags[i].modality == (image[i] ? KVMIX_MODALITY_IMAGE : KVMIX_MODALITY_TEXT)) ||
            bad++ >= 5)
            continue;
        printf("  %s token %d (id %d): got %s turn %d modality %d flags %d, want %s turn %d "
               "modality %d\n",
               name->valuestring, (int)i, (int)ids[i],
               kvmix_tag_role_name((kvmix_tag_role)tags[i].role), tags[i].turn, tags[i].modality,
               tags[i].flags, t->valuestring, turns[i], image[i]);
    }
    CHECK_MSG(bad == 0 && n_content > 0, "every content token gets its truth's tag");
    printf("%s: %d ids, %d content tokens, %d mismatches\n", name->valuestring, (int)n,
           (int)n_content, (int)bad);
    free(tags);
    free(ids);
    free(turns);
    free(image);
}

/* A family's fixtures against its shipped spec, and kvmix-tagspec on the trimmed tokenizer.json
   writes that spec. */
static void test_fixture(const char *family) {
    char path[1024], spec_path[1024], cmd[2048], err[512];
    size_t n = 0;
    snprintf(path, sizeof path, "%s/%s.fixture.json", TEMPLATES_DIR, family);
    snprintf(spec_path, sizeof spec_path, "%s/%s.json", SPECS_DIR, family);
    char *text = read_file(path, &n);
    cJSON *root = text != NULL ? cJSON_ParseWithLength(text, n) : NULL;
    tag_spec_doc spec;
    free(text);
    if (!CHECK_MSG(root != NULL, "the fixture file reads") ||
        !CHECK(tag_spec_load(spec_path, &spec, err, sizeof err) == KVMIX_SUCCESS)) {
        cJSON_Delete(root);
        return;
    }
    const cJSON *convs = cJSON_GetObjectItemCaseSensitive(root, "conversations");
    CHECK(cJSON_GetArraySize(convs) > 0);
    for (const cJSON *c = convs != NULL ? convs->child : NULL; c != NULL; c = c->next)
        check_fixture_conversation(&spec.spec, c);
    cJSON_Delete(root);
    snprintf(cmd, sizeof cmd, "%s/kvmix-tagspec --tokenizer %s/%s.tokenizer.json --name %s",
             BUILD_DIR, TEMPLATES_DIR, family, family);
    char *out = run_capture(cmd), *file = read_file(spec_path, &n);
    CHECK_MSG(out != NULL && file != NULL && strcmp(out, file) == 0,
              "kvmix-tagspec on the trimmed tokenizer.json writes the shipped spec");
    free(out);
    free(file);
}

/* ---- document versions ----------------------------------------------------------------------- */
/* A version 1 document (gpt-oss.json as it was: no recipient marker, commentary a tool call)
   still loads and writes back as version 1; "recipient" needs version 2, "role_starts" version 3;
   version 4 is refused. */
static void test_versions(void) {
    static const char *const V1 =
        "{\"version\": 1, \"name\": \"h\", \"message_start\": [[200006]], \"message_end\": "
        "[[200007], [200012]], \"header_end\": [[200008]], \"channel\": [[200005]], "
        "\"roles\": [{\"name\": \"assistant\", \"role\": \"assistant\", \"ids\": [173781]}], "
        "\"channels\": [{\"name\": \"commentary\", \"role\": \"tool_call\", \"ids\": [12606, "
        "815]}]}";
    char doc[1024], err[256];
    tag_spec_doc d, back;
    CHECK(tag_spec_parse(V1, strlen(V1), &d, err, sizeof err) == KVMIX_SUCCESS);
    CHECK(d.spec.recipient.alts[0].n_ids == 0 && d.spec.channels[0].role == KVMIX_ROLE_TOOL_CALL);
    char *text = tag_spec_json(&d);
    CHECK_MSG(text != NULL && strstr(text, "\"version\": 1,") != NULL &&
                  strstr(text, "recipient") == NULL,
              "a spec without a recipient marker writes as version 1");
    free(text);
    /* version 2 with a recipient marker: written and read back */
    snprintf(doc, sizeof doc, "%.*s, \"recipient\": [[316, 28]]}", (int)strlen(V1) - 1, V1);
    doc[12] = '2';
    CHECK(tag_spec_parse(doc, strlen(doc), &d, err, sizeof err) == KVMIX_SUCCESS);
    CHECK(d.spec.recipient.alts[0].n_ids == 2 && d.spec.recipient.alts[0].ids[1] == 28);
    text = tag_spec_json(&d);
    CHECK_MSG(text != NULL && strstr(text, "\"version\": 2,") != NULL &&
                  strstr(text, "\"channel\": [[200005]],\n  \"recipient\": [[316, 28]],\n") != NULL,
              "a spec with a recipient marker writes as version 2, the marker after channel");
    CHECK(text != NULL &&
          tag_spec_parse(text, strlen(text), &back, err, sizeof err) == KVMIX_SUCCESS &&
          tag_spec_equal(&d, &back));
    free(text);
    doc[12] = '1';
    CHECK(tag_spec_parse(doc, strlen(doc), &d, err, sizeof err) == KVMIX_ERR_MALFORMED &&
          strstr(err, "\"recipient\": needs version 2") != NULL);
    doc[12] = '4';
    CHECK(tag_spec_parse(doc, strlen(doc), &d, err, sizeof err) == KVMIX_ERR_VERSION);
    /* role starts need version 3, and then make the message start and header end optional */
    snprintf(doc, sizeof doc,
             "{\"version\": 2, \"name\": \"d\", \"message_start\": [], \"message_end\": [[1]], "
             "\"header_end\": [], \"role_starts\": [{\"name\": \"user\", \"role\": \"user\", "
             "\"ids\": [128803]}]}");
    CHECK(tag_spec_parse(doc, strlen(doc), &d, err, sizeof err) == KVMIX_ERR_MALFORMED &&
          strstr(err, "\"role_starts\": needs version 3") != NULL);
    doc[12] = '3';
    CHECK(tag_spec_parse(doc, strlen(doc), &d, err, sizeof err) == KVMIX_SUCCESS &&
          d.spec.n_role_starts == 1 && d.spec.role_starts[0].seq.ids[0] == 128803);
    text = tag_spec_json(&d);
    CHECK_MSG(text != NULL && strstr(text, "\"version\": 3,") != NULL &&
                  tag_spec_parse(text, strlen(text), &back, err, sizeof err) == KVMIX_SUCCESS &&
                  tag_spec_equal(&d, &back),
              "a spec with role starts writes as version 3 and reads back");
    free(text);
    char *no_start = strstr(doc, ", \"role_starts\"");
    snprintf(no_start, 4, "}");
    CHECK(tag_spec_parse(doc, strlen(doc), &d, err, sizeof err) == KVMIX_ERR_MALFORMED &&
          strstr(err, "(or role_starts)") != NULL);
    /* the recipient marker must differ from the header end and the channel marker */
    snprintf(doc, sizeof doc, "%.*s, \"recipient\": [[200005]]}", (int)strlen(V1) - 1, V1);
    doc[12] = '2';
    CHECK(tag_spec_parse(doc, strlen(doc), &d, err, sizeof err) == KVMIX_ERR_INVALID_ARGUMENT);
}

/* ---- the command-line tools ---------------------------------------------------------------- */
/* The stdout of a command that succeeds, or NULL. */
static char *run_capture(const char *cmd) {
    char *out = NULL;
    if (run_command(cmd, &out) == 0) return out;
    free(out);
    return NULL;
}

static void test_tools(const char *shared, bool have_tokenizers) {
    char cmd[2048], in_path[] = BUILD_DIR "/.test-tags-in.jsonl";
    FILE *f = fopen(in_path, "wb");
    if (!CHECK(f != NULL)) return;
    /* <|im_start|>user\nHi<think>x</think><|im_end|> then a stray </think> */
    fputs("{\"ids\": [257, 117, 115, 101, 114, 10, 72, 105]}\n\n"
          "{\"ids\": [259, 120, 260, 258, 260]}\n",
          f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s/kvmix-tag --spec %s/kvm-byte.json --in %s", BUILD_DIR, SPECS_DIR,
             in_path);
    char *out = run_capture(cmd);
    const char *want =
        "{\"role\": [\"scaffold\", \"scaffold\", \"scaffold\", \"scaffold\", \"scaffold\", "
        "\"scaffold\", \"user\", \"user\"], \"turn\": [0, 0, 0, 0, 0, 0, 1, 1], \"modality\": "
        "[\"text\", \"text\", \"text\", \"text\", \"text\", \"text\", \"text\", \"text\"], "
        "\"fallback\": [0, 0, 0, 0, 0, 0, 0, 0], \"current_turn\": 1}\n"
        "{\"role\": [\"scaffold\", \"reasoning\", \"scaffold\", \"scaffold\", \"scaffold\"], "
        "\"turn\": [1, 1, 1, 1, 1], \"modality\": [\"text\", \"text\", \"text\", \"text\", "
        "\"text\"], \"fallback\": [0, 0, 0, 0, 1], \"current_turn\": 1}\n";
    CHECK_MSG(out != NULL && strcmp(out, want) == 0, "kvmix-tag tags a stream over two lines");
    if (out != NULL && strcmp(out, want) != 0) printf("  got: %s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s/kvmix-tag --spec %s/kvm-byte.json --in %s --reset", BUILD_DIR,
             SPECS_DIR, in_path);
    out = run_capture(cmd);
    CHECK_MSG(out != NULL && strstr(out, "\"fallback\": [1, 0, 1, 1, 1]") != NULL,
              "kvmix-tag --reset starts a new stream at each line");
    free(out);
    snprintf(cmd, sizeof cmd, "%s/kvmix-tag --spec %s/kvm-byte.json --in %s --color", BUILD_DIR,
             SPECS_DIR, in_path);
    out = run_capture(cmd);
    CHECK_MSG(out != NULL && strstr(out, "legend:") != NULL && strstr(out, "<259>") != NULL,
              "kvmix-tag --color prints a legend and the ids");
    free(out);
    remove(in_path);
    if (!have_tokenizers) return;
    static const char *const DIRS[2] = {"Qwen3", "gpt-oss"}, *const NAMES[2] = {"qwen3", "gpt-oss"};
    for (int k = 0; k < 2; k++) {
        char path[1024];
        size_t n = 0;
        snprintf(cmd, sizeof cmd,
                 "%s/kvmix-tagspec --tokenizer %s/tokenizers/%s/tokenizer.json.gz --config "
                 "%s/tokenizers/%s/tokenizer_config.json --name %s",
                 BUILD_DIR, shared, DIRS[k], shared, DIRS[k], NAMES[k]);
        out = run_capture(cmd);
        snprintf(path, sizeof path, "%s/%s.json", SPECS_DIR, NAMES[k]);
        char *file = read_file(path, &n);
        CHECK_MSG(out != NULL && file != NULL && strcmp(out, file) == 0,
                  "kvmix-tagspec writes the shipped spec file");
        free(out);
        free(file);
    }
}

int main(int argc, char **argv) {
    const char *shared = argc > 1 ? argv[1] : "../shared";
    char path[1024];
    test_byte_traces(shared);
    test_versions();
    snprintf(path, sizeof path, "%s/tokenizers/Qwen3/tokenizer.json.gz", shared);
    FILE *f = fopen(path, "rb");
    bool have_tokenizers = f != NULL;
    if (!have_tokenizers) {
        printf("real-tokenizer tag tests skipped: %s/tokenizers not found\n", shared);
    } else {
        fclose(f);
        test_tokenizer(shared, "Qwen3", "qwen3", QWEN3, (int)(sizeof QWEN3 / sizeof QWEN3[0]));
        test_tokenizer(shared, "gpt-oss", "gpt-oss", GPT_OSS,
                       (int)(sizeof GPT_OSS / sizeof GPT_OSS[0]));
    }
    test_tools(shared, have_tokenizers);
    test_fixture("llama3");
    test_fixture("gemma3");
    test_fixture("deepseek-v3");
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed != 0;
}
