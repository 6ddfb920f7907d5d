/* kvmix-tagspec: writes the template spec (JSON, tag_spec_json.h) of a Hugging Face tokenizer.
 *
 *   kvmix-tagspec --tokenizer tokenizer.json[.gz] [--config tokenizer_config.json]
 *                 [--template chatml|harmony] --name NAME [--description TEXT] [-o FILE]
 *
 * Special-token ids come by name from tokenizer.json's "added_tokens" (checked against the
 * config's "added_tokens_decoder" when given); role and channel names are encoded through the
 * vocabulary and merges (several ids when BPE gives several). The template is chosen by the
 * special tokens when --template is not given. Writes to stdout without -o. */
#include "hf_tokenizer.h"
#include "tag_spec_json.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int usage(void) {
    fprintf(stderr, "usage: kvmix-tagspec --tokenizer tokenizer.json[.gz] [--config "
                    "tokenizer_config.json]\n"
                    "                     [--template chatml|harmony] --name NAME [--description "
                    "TEXT] [-o FILE]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *tokenizer = NULL, *config = NULL, *template_name = NULL, *name = NULL;
    const char *description = NULL, *output = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) return usage() - 2;
        if (v == NULL) return usage();
        if (strcmp(a, "--tokenizer") == 0)
            tokenizer = v;
        else if (strcmp(a, "--config") == 0)
            config = v;
        else if (strcmp(a, "--template") == 0)
            template_name = v;
        else if (strcmp(a, "--name") == 0)
            name = v;
        else if (strcmp(a, "--description") == 0)
            description = v;
        else if (strcmp(a, "-o") == 0)
            output = v;
        else
            return usage();
        i++;
    }
    if (tokenizer == NULL || name == NULL) return usage();
    char err[512];
    hf_tokenizer *tok = NULL;
    tag_spec_doc doc;
    if (hf_tokenizer_load(tokenizer, config, &tok, err, sizeof err) != KVMIX_SUCCESS ||
        hf_tag_spec_generate(tok, template_name, name, description, &doc, err, sizeof err) !=
            KVMIX_SUCCESS) {
        fprintf(stderr, "kvmix-tagspec: %s\n", err);
        hf_tokenizer_free(tok);
        return 1;
    }
    hf_tokenizer_free(tok);
    char *text = tag_spec_json(&doc);
    if (text == NULL) {
        fprintf(stderr, "kvmix-tagspec: out of memory\n");
        return 1;
    }
    FILE *f = output ? fopen(output, "wb") : stdout;
    int ok = f != NULL && fputs(text, f) >= 0;
    if (output && f != NULL) ok = fclose(f) == 0 && ok;
    free(text);
    if (!ok) {
        fprintf(stderr, "kvmix-tagspec: cannot write %s\n", output ? output : "stdout");
        return 1;
    }
    return 0;
}
