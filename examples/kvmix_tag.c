/* kvmix-tag: tags token ids with kvmix's streaming template tagger.
 *
 *   kvmix-tag --spec SPEC.json [--in FILE] [--reset]
 *             [--tokenizer tokenizer.json[.gz] [--config tokenizer_config.json] [--color]]
 *
 * Input: JSON lines {"ids": [...]} (stdin without --in). The lines continue one stream, as an
 * inference loop produces runs; --reset starts a new stream at every line. Output: one JSON line
 * per input line, each array one entry per id:
 *   {"role": ["scaffold", "instruction", ...], "turn": [0, 0, ...], "modality": ["text", ...],
 *    "fallback": [0, 0, ...], "current_turn": 0}
 * Roles: instruction, user, assistant, reasoning, tool_call, observation, scaffold.
 * With --tokenizer and --color it prints the decoded text instead, coloured by role (a legend
 * first; fallback tags underlined, runs of image ids shown as [image xN]), so that a template's
 * tags can be checked at a glance. Exit status 0, or 1 on a malformed line or a bad spec. */
#define _POSIX_C_SOURCE 200809L
#include "hf_tokenizer.h"
#include "tag_spec_json.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const COLOR[KVMIX_TAG_N_ROLES] = {
    "\033[35m",   /* instruction: magenta */
    "\033[32m",   /* user: green */
    "\033[34;1m", /* assistant: bold blue */
    "\033[33m",   /* reasoning: yellow */
    "\033[36m",   /* tool_call: cyan */
    "\033[31m",   /* observation: red */
    "\033[90m"    /* scaffold: grey */
};

static int usage(void) {
    fprintf(stderr,
            "usage: kvmix-tag --spec SPEC.json [--in FILE] [--reset]\n"
            "                 [--tokenizer tokenizer.json[.gz] [--config tokenizer_config.json] "
            "[--color]]\n");
    return 2;
}

/* Reads {"ids": [...]} into *ids (grown as needed). Returns the count, or -1 with a message. */
static int32_t read_ids(const char *line, size_t len, int32_t **ids, int32_t *cap, char *err,
                        size_t err_bytes) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    int32_t n = -1;
    if (root == NULL) {
        snprintf(err, err_bytes, "malformed JSON");
        return -1;
    }
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, "ids");
    if (!cJSON_IsObject(root) || !cJSON_IsArray(arr) || cJSON_GetArraySize(root) != 1) {
        snprintf(err, err_bytes, "a line must be {\"ids\": [...]}");
    } else {
        int32_t count = cJSON_GetArraySize(arr);
        if (count > *cap) {
            int32_t *bigger = (int32_t *)realloc(*ids, sizeof(int32_t) * (size_t)count);
            if (bigger == NULL) {
                snprintf(err, err_bytes, "out of memory");
                cJSON_Delete(root);
                return -1;
            }
            *ids = bigger;
            *cap = count;
        }
        n = 0;
        for (const cJSON *x = arr->child; x != NULL; x = x->next) {
            /* the range first: converting a double outside it to an integer is undefined */
            if (!cJSON_IsNumber(x) ||
                !(x->valuedouble >= -2147483648.0 && x->valuedouble <= 2147483647.0) ||
                x->valuedouble != floor(x->valuedouble)) {
                snprintf(err, err_bytes, "\"ids\" must hold 32-bit integers");
                n = -1;
                break;
            }
            (*ids)[n++] = (int32_t)x->valuedouble;
        }
    }
    cJSON_Delete(root);
    return n;
}

static void print_json(const kvmix_tag *tags, int32_t n, int32_t current_turn) {
    fputs("{\"role\": [", stdout);
    for (int32_t i = 0; i < n; i++)
        printf(i ? ", \"%s\"" : "\"%s\"", kvmix_tag_role_name((kvmix_tag_role)tags[i].role));
    fputs("], \"turn\": [", stdout);
    for (int32_t i = 0; i < n; i++) printf(i ? ", %d" : "%d", (int)tags[i].turn);
    fputs("], \"modality\": [", stdout);
    for (int32_t i = 0; i < n; i++)
        printf(i ? ", \"%s\"" : "\"%s\"",
               kvmix_tag_modality_name((kvmix_tag_modality)tags[i].modality));
    fputs("], \"fallback\": [", stdout);
    for (int32_t i = 0; i < n; i++)
        printf(i ? ", %d" : "%d", (tags[i].flags & KVMIX_TAG_FLAG_FALLBACK) ? 1 : 0);
    printf("], \"current_turn\": %d}\n", (int)current_turn);
}

static void print_color(const hf_tokenizer *tok, const int32_t *ids, const kvmix_tag *tags,
                        int32_t n) {
    char bytes[256];
    int last = -1; /* role and flags of the colour in effect */
    for (int32_t i = 0; i < n;) {
        const kvmix_tag *t = &tags[i];
        int now = (t->role < KVMIX_TAG_N_ROLES ? t->role : KVMIX_ROLE_SCAFFOLD) |
                  (t->flags & KVMIX_TAG_FLAG_FALLBACK) << 4;
        if (now != last || t->modality == KVMIX_MODALITY_IMAGE) {
            fputs("\033[0m", stdout);
            fputs(COLOR[now & 15], stdout);
            if (now >> 4) fputs("\033[4m", stdout);
            last = t->modality == KVMIX_MODALITY_IMAGE ? -1 : now;
        }
        if (t->modality == KVMIX_MODALITY_IMAGE) {
            int32_t j = i;
            while (j < n && tags[j].modality == KVMIX_MODALITY_IMAGE && tags[j].role == t->role)
                j++;
            printf("\033[7m[image x%d]", (int)(j - i));
            i = j;
            continue;
        }
        int32_t k = tok ? hf_tokenizer_decode(tok, ids[i], bytes, sizeof bytes) : -1;
        if (k >= 0)
            fwrite(bytes, 1, (size_t)k, stdout);
        else
            printf("<%d>", (int)ids[i]);
        i++;
    }
    fputs("\033[0m\n", stdout);
}

int main(int argc, char **argv) {
    const char *spec_path = NULL, *in_path = NULL, *tok_path = NULL, *config_path = NULL;
    bool reset = false, color = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--reset") == 0)
            reset = true;
        else if (strcmp(a, "--color") == 0)
            color = true;
        else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            return usage() - 2;
        else if (v == NULL)
            return usage();
        else if (strcmp(a, "--spec") == 0)
            spec_path = v, i++;
        else if (strcmp(a, "--in") == 0)
            in_path = v, i++;
        else if (strcmp(a, "--tokenizer") == 0)
            tok_path = v, i++;
        else if (strcmp(a, "--config") == 0)
            config_path = v, i++;
        else
            return usage();
    }
    if (spec_path == NULL) return usage();
    char err[512];
    tag_spec_doc doc;
    if (tag_spec_load(spec_path, &doc, err, sizeof err) != KVMIX_SUCCESS) {
        fprintf(stderr, "kvmix-tag: %s\n", err);
        return 1;
    }
    hf_tokenizer *tok = NULL;
    if (tok_path != NULL &&
        hf_tokenizer_load(tok_path, config_path, &tok, err, sizeof err) != KVMIX_SUCCESS) {
        fprintf(stderr, "kvmix-tag: %s\n", err);
        return 1;
    }
    FILE *in = in_path ? fopen(in_path, "rb") : stdin;
    if (in == NULL) {
        fprintf(stderr, "kvmix-tag: cannot open %s\n", in_path);
        hf_tokenizer_free(tok);
        return 1;
    }
    static kvmix_tagger tagger;
    kvmix_tagger_init(&tagger, &doc.spec, NULL); /* the spec passed kvmix_tag_spec_check */
    if (color) {
        fputs("legend:", stdout);
        for (int r = 0; r < KVMIX_TAG_N_ROLES; r++)
            printf(" %s%s\033[0m", COLOR[r], kvmix_tag_role_name((kvmix_tag_role)r));
        printf(" \033[4mfallback\033[0m\n");
    }
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t len;
    int32_t *ids = NULL, cap = 0, tag_cap = 0, line_no = 0;
    kvmix_tag *tags = NULL;
    int status = 0;
    while ((len = getline(&line, &line_cap, in)) > 0) {
        line_no++;
        size_t n_bytes = (size_t)len;
        while (n_bytes > 0 && (line[n_bytes - 1] == '\n' || line[n_bytes - 1] == '\r')) n_bytes--;
        if (n_bytes == 0) continue;
        int32_t n = read_ids(line, n_bytes, &ids, &cap, err, sizeof err);
        if (n < 0) {
            fprintf(stderr, "kvmix-tag: line %d: %s\n", (int)line_no, err);
            status = 1;
            break;
        }
        if (n > tag_cap) {
            kvmix_tag *bigger = (kvmix_tag *)realloc(tags, sizeof(kvmix_tag) * (size_t)n);
            if (bigger == NULL) {
                fprintf(stderr, "kvmix-tag: out of memory\n");
                status = 1;
                break;
            }
            tags = bigger;
            tag_cap = n;
        }
        if (reset) kvmix_tagger_reset(&tagger);
        kvmix_tagger_feed(&tagger, ids, n, tags);
        if (color)
            print_color(tok, ids, tags, n);
        else
            print_json(tags, n, tagger.turn);
    }
    free(line);
    free(ids);
    free(tags);
    if (in != stdin) fclose(in);
    hf_tokenizer_free(tok);
    return status;
}
