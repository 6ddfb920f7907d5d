/* hf_tokenizer.c - byte-level BPE from a Hugging Face tokenizer.json; see hf_tokenizer.h. */
#define _POSIX_C_SOURCE 200809L
#include "hf_tokenizer.h"

#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- a string-pair hash table (open addressing) ------------------------------------------- */
typedef struct entry {
    const char *a, *b; /* b: NULL for single keys */
    uint32_t la, lb;
    int32_t value;
} entry;

typedef struct table {
    entry *e;
    size_t mask;
} table;

static uint64_t hash_pair(const char *a, size_t la, const char *b, size_t lb) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < la; i++) h = (h ^ (uint8_t)a[i]) * 1099511628211ull;
    h = (h ^ 0x1ff) * 1099511628211ull;
    for (size_t i = 0; i < lb; i++) h = (h ^ (uint8_t)b[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static bool table_init(table *t, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    t->e = (entry *)calloc(cap, sizeof *t->e);
    t->mask = cap - 1;
    return t->e != NULL;
}

static entry *table_slot(const table *t, const char *a, size_t la, const char *b, size_t lb) {
    size_t i = (size_t)hash_pair(a, la, b, lb) & t->mask;
    for (;; i = (i + 1) & t->mask) {
        entry *e = &t->e[i];
        if (e->a == NULL) return e;
        if (e->la == la && e->lb == lb && memcmp(e->a, a, la) == 0 &&
            (lb == 0 || memcmp(e->b, b, lb) == 0))
            return e;
    }
}

/* Inserts unless present (the first value wins, as the lowest merge rank must). */
static void table_put(table *t, const char *a, size_t la, const char *b, size_t lb, int32_t v) {
    entry *e = table_slot(t, a, la, b, lb);
    if (e->a != NULL) return;
    e->a = a;
    e->la = (uint32_t)la;
    e->b = b;
    e->lb = (uint32_t)lb;
    e->value = v;
}

static int32_t table_get(const table *t, const char *a, size_t la, const char *b, size_t lb) {
    const entry *e = table_slot(t, a, la, b, lb);
    return e->a != NULL ? e->value : -1;
}

/* ---- the tokenizer ------------------------------------------------------------------------- */
typedef struct added {
    const char *content;
    size_t len;
    int32_t id;
} added;

struct hf_tokenizer {
    cJSON *root;
    table vocab, merges;
    char *merge_text;   /* copies of "a b" merges, split at the space */
    const char **by_id; /* [n_ids]: vocabulary string (byte-mapped) or added content */
    bool *is_added;
    int32_t n_ids;
    added *added;
    int32_t n_added;
    char byte_char[256][4]; /* byte -> vocabulary characters, UTF-8, NUL-terminated */
    int16_t char_byte[512]; /* byte level: code point -> byte, -1 when none */
    bool byte_level;        /* GPT-2 byte table; else metaspace (" " is "\u2581", bytes <0xXX>) */
};

/* Nonzero when a "type" of node or of any object inside it is `type`. */
static bool has_type(const cJSON *node, const char *type) {
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(node, "type");
    if (cJSON_IsString(t) && strcmp(t->valuestring, type) == 0) return true;
    for (const cJSON *x = node != NULL ? node->child : NULL; x != NULL; x = x->next)
        if ((cJSON_IsObject(x) || cJSON_IsArray(x)) && has_type(x, type)) return true;
    return false;
}

/* Metaspace tokenizers (Gemma's) keep bytes as they are, but a space is "\u2581"; bytes >= 0x80
   are taken whole characters at a time by bpe(). */
static void build_metaspace_table(hf_tokenizer *t) {
    for (int b = 0; b < 256; b++) {
        t->byte_char[b][0] = (char)b;
        t->byte_char[b][1] = 0;
    }
    memcpy(t->byte_char[' '], "\xE2\x96\x81", 4);
}

static void build_byte_table(hf_tokenizer *t) {
    int n = 0;
    for (int i = 0; i < 512; i++) t->char_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        int cp = printable ? b : 256 + n++;
        if (cp < 0x80) {
            t->byte_char[b][0] = (char)cp;
            t->byte_char[b][1] = 0;
        } else {
            t->byte_char[b][0] = (char)(0xC0 | (cp >> 6));
            t->byte_char[b][1] = (char)(0x80 | (cp & 0x3F));
            t->byte_char[b][2] = 0;
        }
        t->char_byte[cp] = (int16_t)b;
    }
}

static char *read_all(const char *path, size_t *out_n) {
    size_t len = strlen(path);
    bool gz = len > 3 && strcmp(path + len - 3, ".gz") == 0;
    FILE *f;
    if (gz) {
        char cmd[4200];
        if (strchr(path, '\'') != NULL || len > 4000) return NULL;
        snprintf(cmd, sizeof cmd, "gzip -dc -- '%s' 2>/dev/null", path);
        f = popen(cmd, "r");
    } else {
        f = fopen(path, "rb");
    }
    if (f == NULL) return NULL;
    size_t cap = 1 << 20, n = 0, got;
    char *buf = (char *)malloc(cap + 1);
    while (buf != NULL && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *bigger = (char *)realloc(buf, cap * 2 + 1);
            if (bigger == NULL) {
                free(buf);
                buf = NULL;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    int status = gz ? pclose(f) : fclose(f);
    if (buf != NULL && (status != 0 || n == 0)) {
        free(buf);
        buf = NULL;
    }
    if (buf != NULL) buf[n] = 0;
    *out_n = n;
    return buf;
}

void hf_tokenizer_free(hf_tokenizer *tok) {
    if (tok == NULL) return;
    cJSON_Delete(tok->root);
    free(tok->vocab.e);
    free(tok->merges.e);
    free(tok->merge_text);
    free(tok->by_id);
    free(tok->is_added);
    free(tok->added);
    free(tok);
}

static kvmix_result check_config(hf_tokenizer *t, const char *config_path, char *err,
                                 size_t err_bytes) {
    size_t n;
    char *text = read_all(config_path, &n);
    if (text == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NOT_FOUND, "tokenizer: cannot read %s",
                             config_path);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, n, &end, 0);
    free(text);
    if (root == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED, "tokenizer: %s is not JSON",
                             config_path);
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(root, "added_tokens_decoder");
    kvmix_result r = KVMIX_SUCCESS;
    for (const cJSON *x = cJSON_IsObject(dec) ? dec->child : NULL; x != NULL; x = x->next) {
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(x, "content");
        char *stop = NULL;
        long id = strtol(x->string, &stop, 10);
        if (!cJSON_IsString(content) || stop == x->string || *stop != 0) {
            r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                              "tokenizer: %s: added_tokens_decoder entry \"%.32s\" is malformed",
                              config_path, x->string);
            break;
        }
        int32_t have = hf_tokenizer_special(t, content->valuestring);
        if (have != id) {
            r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                              "tokenizer: %s says %.64s is %ld, tokenizer.json says %d",
                              config_path, content->valuestring, id, (int)have);
            break;
        }
    }
    cJSON_Delete(root);
    return r;
}

kvmix_result hf_tokenizer_load(const char *tokenizer_path, const char *config_path,
                               hf_tokenizer **out, char *err, size_t err_bytes) {
    if (tokenizer_path == NULL || out == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "tokenizer: NULL argument");
    size_t n;
    char *text = read_all(tokenizer_path, &n);
    if (text == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NOT_FOUND, "tokenizer: cannot read %s",
                             tokenizer_path);
    hf_tokenizer *t = (hf_tokenizer *)calloc(1, sizeof *t);
    if (t == NULL) {
        free(text);
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    }
    const char *end = NULL;
    t->root = cJSON_ParseWithLengthOpts(text, n, &end, 0);
    free(text);
    t->byte_level =
        has_type(cJSON_GetObjectItemCaseSensitive(t->root, "pre_tokenizer"), "ByteLevel") ||
        has_type(cJSON_GetObjectItemCaseSensitive(t->root, "decoder"), "ByteLevel");
    if (t->byte_level)
        build_byte_table(t);
    else
        build_metaspace_table(t);
    kvmix_result r = KVMIX_SUCCESS;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(t->root, "model");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    const cJSON *adds = cJSON_GetObjectItemCaseSensitive(t->root, "added_tokens");
    if (t->root == NULL || !cJSON_IsString(type) || strcmp(type->valuestring, "BPE") != 0 ||
        !cJSON_IsObject(vocab) || !cJSON_IsArray(merges) || !cJSON_IsArray(adds)) {
        hf_tokenizer_free(t);
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                             "tokenizer: %s is not a BPE tokenizer.json (model.type, model.vocab, "
                             "model.merges, added_tokens)",
                             tokenizer_path);
    }
    int32_t n_vocab = cJSON_GetArraySize(vocab), n_merges = cJSON_GetArraySize(merges);
    int32_t n_adds = cJSON_GetArraySize(adds), max_id = -1;
    size_t merge_bytes = 0;
    for (const cJSON *x = vocab->child; x != NULL; x = x->next)
        if (cJSON_IsNumber(x) && x->valueint > max_id) max_id = x->valueint;
    for (const cJSON *x = adds->child; x != NULL; x = x->next) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(x, "id");
        if (cJSON_IsNumber(id) && id->valueint > max_id) max_id = id->valueint;
    }
    for (const cJSON *x = merges->child; x != NULL; x = x->next)
        if (cJSON_IsString(x)) merge_bytes += strlen(x->valuestring) + 1;
    t->n_ids = max_id + 1;
    if (!table_init(&t->vocab, (size_t)n_vocab) || !table_init(&t->merges, (size_t)n_merges) ||
        (t->by_id = (const char **)calloc((size_t)t->n_ids + 1, sizeof *t->by_id)) == NULL ||
        (t->is_added = (bool *)calloc((size_t)t->n_ids + 1, sizeof *t->is_added)) == NULL ||
        (t->added = (added *)calloc((size_t)n_adds + 1, sizeof *t->added)) == NULL ||
        (t->merge_text = (char *)malloc(merge_bytes + 1)) == NULL) {
        hf_tokenizer_free(t);
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    }
    for (const cJSON *x = vocab->child; x != NULL; x = x->next) {
        if (!cJSON_IsNumber(x) || x->valueint < 0) continue;
        table_put(&t->vocab, x->string, strlen(x->string), NULL, 0, x->valueint);
        t->by_id[x->valueint] = x->string;
    }
    int32_t rank = 0;
    char *mt = t->merge_text;
    for (const cJSON *x = merges->child; x != NULL; x = x->next, rank++) {
        const char *a = NULL, *b = NULL;
        if (cJSON_IsString(x)) { /* "a b" */
            size_t len = strlen(x->valuestring);
            memcpy(mt, x->valuestring, len + 1);
            char *space = strchr(mt, ' ');
            if (space != NULL) {
                *space = 0;
                a = mt;
                b = space + 1;
            }
            mt += len + 1;
        } else if (cJSON_IsArray(x) && cJSON_GetArraySize(x) == 2 && cJSON_IsString(x->child) &&
                   cJSON_IsString(x->child->next)) {
            a = x->child->valuestring;
            b = x->child->next->valuestring;
        }
        if (a == NULL || b == NULL || *a == 0 || *b == 0) {
            r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                              "tokenizer: model.merges[%d] is malformed", (int)rank);
            break;
        }
        table_put(&t->merges, a, strlen(a), b, strlen(b), rank);
    }
    for (const cJSON *x = adds->child; x != NULL && r == KVMIX_SUCCESS; x = x->next) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(x, "id");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(x, "content");
        if (!cJSON_IsNumber(id) || id->valueint < 0 || !cJSON_IsString(content) ||
            content->valuestring[0] == 0) {
            r = tag_spec_fail(err, err_bytes, KVMIX_ERR_MALFORMED,
                              "tokenizer: an added_tokens entry is "
                              "malformed");
            break;
        }
        added *a = &t->added[t->n_added++];
        a->content = content->valuestring;
        a->len = strlen(a->content);
        a->id = id->valueint;
        t->by_id[a->id] = a->content;
        t->is_added[a->id] = true;
    }
    if (r == KVMIX_SUCCESS && config_path != NULL) r = check_config(t, config_path, err, err_bytes);
    if (r != KVMIX_SUCCESS) {
        hf_tokenizer_free(t);
        return r;
    }
    *out = t;
    return KVMIX_SUCCESS;
}

int32_t hf_tokenizer_special(const hf_tokenizer *tok, const char *content) {
    if (tok == NULL || content == NULL) return -1;
    for (int32_t i = 0; i < tok->n_added; i++)
        if (strcmp(tok->added[i].content, content) == 0) return tok->added[i].id;
    return -1;
}

/* ---- encoding ------------------------------------------------------------------------------ */
static bool is_letter(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
}
static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static bool is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
static bool is_newline(unsigned char c) { return c == '\n' || c == '\r'; }

/* Length of the pre-token at s[0 .. n): metaspace tokenizers take the text whole. */
static size_t pretoken(const hf_tokenizer *t, const unsigned char *s, size_t n) {
    size_t i = 0;
    if (!t->byte_level) return n;
    if (s[0] == '\'' && n >= 2) { /* contractions */
        static const char *const C[] = {"re", "ve", "ll", "s", "t", "m", "d"};
        for (int k = 0; k < 7; k++) {
            size_t len = strlen(C[k]);
            bool ok = n >= 1 + len;
            for (size_t j = 0; ok && j < len; j++) ok = (s[1 + j] | 0x20) == (unsigned char)C[k][j];
            if (ok) return 1 + len;
        }
    }
    if (is_letter(s[0]) || (!is_newline(s[0]) && !is_digit(s[0]) && n >= 2 && is_letter(s[1]))) {
        i = is_letter(s[0]) ? 0 : 1;
        while (i < n && is_letter(s[i])) i++;
        return i;
    }
    if (is_digit(s[0])) {
        while (i < n && i < 3 && is_digit(s[i])) i++;
        return i;
    }
    if (!is_space(s[0]) ||
        (s[0] == ' ' && n >= 2 && !is_space(s[1]) && !is_letter(s[1]) && !is_digit(s[1]))) {
        i = s[0] == ' ' ? 1 : 0;
        while (i < n && !is_space(s[i]) && !is_letter(s[i]) && !is_digit(s[i])) i++;
        while (i < n && is_newline(s[i])) i++;
        return i;
    }
    size_t run = 0, last_nl = 0;
    while (run < n && is_space(s[run])) {
        if (is_newline(s[run])) last_nl = run + 1;
        run++;
    }
    if (last_nl) return last_nl;
    if (run == n || run == 1) return run;
    return run - 1;
}

/* BPE of one pre-token: its bytes mapped to characters, merged by rank, looked up. */
static kvmix_result bpe(const hf_tokenizer *t, const unsigned char *s, size_t n, int32_t *ids,
                        int32_t cap, int32_t *io_n) {
    char buf[1024];
    size_t starts[513], m = 0, len = 0;
    if (n > 256) { /* long runs: encode in pieces (valid ids, not always canonical) */
        kvmix_result r = bpe(t, s, 256, ids, cap, io_n);
        return r != KVMIX_SUCCESS ? r : bpe(t, s + 256, n - 256, ids, cap, io_n);
    }
    for (size_t i = 0; i < n; i++) {
        /* a piece a character: a byte at the byte level, UTF-8 lead and continuation bytes else */
        if (t->byte_level || (s[i] & 0xC0) != 0x80 || m == 0) starts[m++] = len;
        size_t k = strlen(t->byte_char[s[i]]);
        memcpy(buf + len, t->byte_char[s[i]], k);
        len += k;
    }
    starts[m] = len;
    while (m > 1) {
        int32_t best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < m; i++) {
            int32_t rank = table_get(&t->merges, buf + starts[i], starts[i + 1] - starts[i],
                                     buf + starts[i + 1], starts[i + 2] - starts[i + 1]);
            if (rank >= 0 && (best < 0 || rank < best)) {
                best = rank;
                at = i;
            }
        }
        if (best < 0) break;
        memmove(starts + at + 1, starts + at + 2, sizeof starts[0] * (m - at - 1));
        m--;
    }
    for (size_t i = 0; i < m; i++) {
        int32_t id = table_get(&t->vocab, buf + starts[i], starts[i + 1] - starts[i], NULL, 0);
        if (id >= 0) {
            if (*io_n >= cap) return KVMIX_ERR_BUFFER_TOO_SMALL;
            ids[(*io_n)++] = id;
            continue;
        }
        if (t->byte_level) return KVMIX_ERR_NOT_FOUND;
        for (size_t b = starts[i]; b < starts[i + 1]; b++) { /* byte fallback: <0xXX> */
            char piece[8];
            snprintf(piece, sizeof piece, "<0x%02X>", (unsigned)(unsigned char)buf[b]);
            if ((id = table_get(&t->vocab, piece, 6, NULL, 0)) < 0) return KVMIX_ERR_NOT_FOUND;
            if (*io_n >= cap) return KVMIX_ERR_BUFFER_TOO_SMALL;
            ids[(*io_n)++] = id;
        }
    }
    return KVMIX_SUCCESS;
}

int32_t hf_tokenizer_vocab_id(const hf_tokenizer *tok, const char *bytes, size_t n_bytes) {
    char buf[1024];
    size_t len = 0;
    if (tok == NULL || bytes == NULL || n_bytes > 200) return -1;
    for (size_t i = 0; i < n_bytes; i++) {
        const char *c = tok->byte_char[(unsigned char)bytes[i]];
        size_t k = strlen(c);
        memcpy(buf + len, c, k);
        len += k;
    }
    return table_get(&tok->vocab, buf, len, NULL, 0);
}

kvmix_result hf_tokenizer_encode(const hf_tokenizer *tok, const char *text, size_t n_bytes,
                                 int32_t *ids, int32_t cap, int32_t *out_n) {
    if (tok == NULL || (text == NULL && n_bytes > 0) || out_n == NULL || (ids == NULL && cap > 0))
        return KVMIX_ERR_NULL_POINTER;
    const unsigned char *s = (const unsigned char *)text;
    int32_t n = 0;
    size_t i = 0, plain = 0;
    while (i <= n_bytes) {
        const added *hit = NULL;
        for (int32_t k = 0; i < n_bytes && k < tok->n_added; k++) {
            const added *a = &tok->added[k];
            if (a->len <= n_bytes - i && memcmp(s + i, a->content, a->len) == 0 &&
                (hit == NULL || a->len > hit->len))
                hit = a;
        }
        if (hit == NULL && i < n_bytes) {
            i++;
            continue;
        }
        while (plain < i) { /* the text before the special token (or the end) */
            size_t len = pretoken(tok, s + plain, i - plain);
            kvmix_result r = bpe(tok, s + plain, len, ids, cap, &n);
            if (r != KVMIX_SUCCESS) return r;
            plain += len;
        }
        if (hit == NULL) break;
        if (n >= cap) return KVMIX_ERR_BUFFER_TOO_SMALL;
        ids[n++] = hit->id;
        i += hit->len;
        plain = i;
    }
    *out_n = n;
    return KVMIX_SUCCESS;
}

/* A metaspace vocabulary entry: "\u2581" is a space, "<0xXX>" one byte, the rest as it is. */
static int32_t decode_metaspace(const char *s, char *out, size_t cap) {
    size_t n = 0, len = strlen(s);
    unsigned byte;
    char tail;
    if (len == 6 && sscanf(s, "<0x%2X%c", &byte, &tail) == 2 && tail == '>') {
        if (cap < 1) return -1;
        out[0] = (char)byte;
        return 1;
    }
    for (size_t i = 0; i < len; n++) {
        if (n >= cap) return -1;
        if (strncmp(s + i, "\xE2\x96\x81", 3) == 0) {
            out[n] = ' ';
            i += 3;
        } else {
            out[n] = s[i++];
        }
    }
    return (int32_t)n;
}

int32_t hf_tokenizer_decode(const hf_tokenizer *tok, int32_t id, char *out, size_t cap) {
    if (tok == NULL || id < 0 || id >= tok->n_ids || tok->by_id[id] == NULL || out == NULL)
        return -1;
    const unsigned char *s = (const unsigned char *)tok->by_id[id];
    size_t n = 0;
    if (tok->is_added[id]) {
        n = strlen((const char *)s);
        if (n > cap) return -1;
        memcpy(out, s, n);
        return (int32_t)n;
    }
    if (!tok->byte_level) return decode_metaspace((const char *)s, out, cap);
    while (*s) {
        unsigned cp;
        if (*s < 0x80)
            cp = *s++;
        else if ((*s & 0xE0) == 0xC0 && (s[1] & 0xC0) == 0x80) {
            cp = (unsigned)(*s & 0x1F) << 6 | (s[1] & 0x3F);
            s += 2;
        } else
            return -1;
        if (cp >= 512 || tok->char_byte[cp] < 0 || n >= cap) return -1;
        out[n++] = (char)tok->char_byte[cp];
    }
    return (int32_t)n;
}

/* ---- template specs ------------------------------------------------------------------------ */
/* A template family is data: which marker each special token or text is, the role words (or
   role-naming special tokens) and channel names, and the special token that identifies it. */
typedef enum piece_kind {
    P_SPECIAL,     /* an added token, then `text` encoded (when not NULL); required */
    P_SPECIAL_OPT, /* the same, left out when the tokenizer lacks the token */
    P_TEXT,        /* `text` encoded through the vocabulary */
    P_VOCAB_OPT    /* `text` as one vocabulary entry, left out when there is none */
} piece_kind;

typedef struct piece {
    size_t marker; /* offsetof(kvmix_tag_spec, ...): each piece is one alternative of it */
    piece_kind kind;
    const char *special, *text;
} piece;

typedef struct named {
    const char *name;    /* the role word or channel name, encoded unless `special` is given */
    kvmix_tag_role role; /* the role its content gets */
    const char *special; /* a role start's added token */
} named;

typedef struct family {
    const char *name, *detect; /* detect: an added token that only this family has */
    const piece *pieces;
    const named *roles, *channels, *starts; /* each ends with a NULL name */
} family;

#define AT(f) offsetof(kvmix_tag_spec, f)
static const piece CHATML[] = {
    {AT(message_start), P_SPECIAL, "<|im_start|>", NULL},
    {AT(message_end), P_SPECIAL, "<|im_end|>", NULL},
    {AT(header_end), P_TEXT, NULL, "\n"},
    /* content that starts with a newline merges with the header's: "\n\n" ends it too */
    {AT(header_end), P_VOCAB_OPT, NULL, "\n\n"},
    {AT(reasoning_open), P_SPECIAL_OPT, "<think>", NULL},
    {AT(reasoning_close), P_SPECIAL_OPT, "</think>", NULL},
    {AT(tool_call_open), P_SPECIAL_OPT, "<tool_call>", NULL},
    {AT(tool_call_close), P_SPECIAL_OPT, "</tool_call>", NULL},
    {AT(tool_response_open), P_SPECIAL_OPT, "<tool_response>", NULL},
    {AT(tool_response_close), P_SPECIAL_OPT, "</tool_response>", NULL},
    {AT(vision_open), P_SPECIAL_OPT, "<|vision_start|>", NULL},
    {AT(vision_close), P_SPECIAL_OPT, "<|vision_end|>", NULL},
    {AT(image_pad), P_SPECIAL_OPT, "<|image_pad|>", NULL},
    {AT(image_pad), P_SPECIAL_OPT, "<|video_pad|>", NULL},
    {0, P_TEXT, NULL, NULL}};
static const named CHATML_ROLES[] = {{"system", KVMIX_ROLE_INSTRUCTION, NULL},
                                     {"user", KVMIX_ROLE_USER, NULL},
                                     {"assistant", KVMIX_ROLE_ASSISTANT, NULL},
                                     {"tool", KVMIX_ROLE_OBSERVATION, NULL},
                                     {NULL, KVMIX_ROLE_USER, NULL}};

static const piece HARMONY[] = {
    {AT(message_start), P_SPECIAL, "<|start|>", NULL},
    {AT(message_end), P_SPECIAL, "<|end|>", NULL},
    {AT(message_end), P_SPECIAL, "<|call|>", NULL},
    {AT(message_end), P_SPECIAL, "<|return|>", NULL},
    {AT(header_end), P_SPECIAL, "<|message|>", NULL},
    {AT(channel), P_SPECIAL, "<|channel|>", NULL},
    /* a message to a tool names it after the role or the channel: " to=functions.NAME" */
    {AT(recipient), P_TEXT, NULL, " to="},
    {0, P_TEXT, NULL, NULL}};
static const named HARMONY_ROLES[] = {
    {"system", KVMIX_ROLE_INSTRUCTION, NULL},
    {"developer", KVMIX_ROLE_INSTRUCTION, NULL},
    {"user", KVMIX_ROLE_USER, NULL},
    {"assistant", KVMIX_ROLE_ASSISTANT, NULL},
    /* a tool's message has the tool's name as its role: functions.NAME, browser.*, python */
    {"functions", KVMIX_ROLE_OBSERVATION, NULL},
    {"browser", KVMIX_ROLE_OBSERVATION, NULL},
    {"python", KVMIX_ROLE_OBSERVATION, NULL},
    {NULL, KVMIX_ROLE_USER, NULL}};
static const named HARMONY_CHANNELS[] = {
    {"analysis", KVMIX_ROLE_REASONING, NULL},
    /* commentary without a recipient is a preamble shown to the user */
    {"commentary", KVMIX_ROLE_ASSISTANT, NULL},
    {"final", KVMIX_ROLE_ASSISTANT, NULL},
    {NULL, KVMIX_ROLE_USER, NULL}};

/* Llama 3.x: <|start_header_id|>ROLE<|end_header_id|>\n\n ... <|eot_id|>; 3.1 adds <|eom_id|>
   (a built-in tool call ends there) and <|python_tag|>, which opens a tool call that runs to the
   message end. */
static const piece LLAMA3[] = {{AT(message_start), P_SPECIAL, "<|start_header_id|>", NULL},
                               {AT(message_end), P_SPECIAL, "<|eot_id|>", NULL},
                               {AT(message_end), P_SPECIAL_OPT, "<|eom_id|>", NULL},
                               {AT(header_end), P_SPECIAL, "<|end_header_id|>", "\n\n"},
                               {AT(tool_call_open), P_SPECIAL_OPT, "<|python_tag|>", NULL},
                               {0, P_TEXT, NULL, NULL}};
static const named LLAMA3_ROLES[] = {{"system", KVMIX_ROLE_INSTRUCTION, NULL},
                                     {"user", KVMIX_ROLE_USER, NULL},
                                     {"assistant", KVMIX_ROLE_ASSISTANT, NULL},
                                     {"ipython", KVMIX_ROLE_OBSERVATION, NULL}, /* tool results */
                                     {"tool", KVMIX_ROLE_OBSERVATION, NULL},
                                     {NULL, KVMIX_ROLE_USER, NULL}};

/* Gemma 3: <start_of_turn>user|model\n ... <end_of_turn>; no system turn (its template writes the
   system prompt into the first user turn). An image is "\n\n<start_of_image>" 256 soft tokens
   "<end_of_image>\n\n": one at a turn's head makes the header's newline a longer run. */
static const piece GEMMA3[] = {{AT(message_start), P_SPECIAL, "<start_of_turn>", NULL},
                               {AT(message_end), P_SPECIAL, "<end_of_turn>", NULL},
                               {AT(header_end), P_TEXT, NULL, "\n"},
                               {AT(header_end), P_VOCAB_OPT, NULL, "\n\n"},
                               {AT(header_end), P_VOCAB_OPT, NULL, "\n\n\n"},
                               {AT(vision_open), P_SPECIAL_OPT, "<start_of_image>", NULL},
                               {AT(vision_close), P_SPECIAL_OPT, "<end_of_image>", NULL},
                               {AT(image_pad), P_SPECIAL_OPT, "<image_soft_token>", NULL},
                               {0, P_TEXT, NULL, NULL}};
static const named GEMMA3_ROLES[] = {{"user", KVMIX_ROLE_USER, NULL},
                                     {"model", KVMIX_ROLE_ASSISTANT, NULL},
                                     {NULL, KVMIX_ROLE_USER, NULL}};

/* DeepSeek V3: role-naming tokens, no headers. The system prompt follows <｜begin▁of▁sentence｜>;
   a user message ends at <｜Assistant｜>; tool results sit between <｜tool▁outputs▁begin｜> and
   <｜tool▁outputs▁end｜>, after which the assistant answers. */
static const piece DEEPSEEK_V3[] = {
    {AT(message_end), P_SPECIAL, "<｜end▁of▁sentence｜>", NULL},
    {AT(reasoning_open), P_SPECIAL_OPT, "<think>", NULL},
    {AT(reasoning_close), P_SPECIAL_OPT, "</think>", NULL},
    {AT(tool_call_open), P_SPECIAL, "<｜tool▁call▁begin｜>", NULL},
    {AT(tool_call_close), P_SPECIAL, "<｜tool▁call▁end｜>", NULL},
    {AT(tool_response_open), P_SPECIAL, "<｜tool▁output▁begin｜>", NULL},
    {AT(tool_response_close), P_SPECIAL, "<｜tool▁output▁end｜>", NULL},
    {0, P_TEXT, NULL, NULL}};
static const named DEEPSEEK_V3_STARTS[] = {
    {"system", KVMIX_ROLE_INSTRUCTION, "<｜begin▁of▁sentence｜>"},
    {"user", KVMIX_ROLE_USER, "<｜User｜>"},
    {"assistant", KVMIX_ROLE_ASSISTANT, "<｜Assistant｜>"},
    {"tool outputs", KVMIX_ROLE_OBSERVATION, "<｜tool▁outputs▁begin｜>"},
    {"answer", KVMIX_ROLE_ASSISTANT, "<｜tool▁outputs▁end｜>"},
    {NULL, KVMIX_ROLE_USER, NULL}};
static const named NONE[] = {{NULL, KVMIX_ROLE_USER, NULL}};
#undef AT

static const family FAMILIES[] = {
    {"chatml", "<|im_start|>", CHATML, CHATML_ROLES, NONE, NONE},
    {"harmony", "<|channel|>", HARMONY, HARMONY_ROLES, HARMONY_CHANNELS, NONE},
    {"llama3", "<|start_header_id|>", LLAMA3, LLAMA3_ROLES, NONE, NONE},
    {"gemma3", "<start_of_turn>", GEMMA3, GEMMA3_ROLES, NONE, NONE},
    {"deepseek-v3", "<｜User｜>", DEEPSEEK_V3, NONE, NONE, DEEPSEEK_V3_STARTS}};
enum { N_FAMILIES = sizeof FAMILIES / sizeof FAMILIES[0] };

typedef struct gen {
    const hf_tokenizer *tok;
    char *err;
    size_t err_bytes;
    kvmix_result r;
} gen;

/* Appends the id of added token `content` to q; a missing one fails when required. */
static bool add_special(gen *g, kvmix_tag_seq *q, const char *content, bool required) {
    int32_t id = hf_tokenizer_special(g->tok, content);
    if (g->r != KVMIX_SUCCESS) return false;
    if (id < 0) {
        if (required)
            g->r = tag_spec_fail(g->err, g->err_bytes, KVMIX_ERR_NOT_FOUND,
                                 "tokenizer: special token %s is missing", content);
        return false;
    }
    q->ids[q->n_ids++] = id;
    return true;
}

/* Appends text encoded through the vocabulary to q. */
static void add_text(gen *g, kvmix_tag_seq *q, const char *text) {
    int32_t n = 0;
    if (g->r != KVMIX_SUCCESS) return;
    if (hf_tokenizer_encode(g->tok, text, strlen(text), q->ids + q->n_ids,
                            KVMIX_TAG_MAX_IDS - q->n_ids, &n) != KVMIX_SUCCESS ||
        n == 0) {
        g->r = tag_spec_fail(g->err, g->err_bytes, KVMIX_ERR_NOT_FOUND,
                             "tokenizer: \"%s\" does not encode in at most %d ids", text,
                             KVMIX_TAG_MAX_IDS);
        return;
    }
    q->n_ids += n;
}

/* One alternative of a marker from a piece (none when an optional piece is missing). */
static void add_piece(gen *g, kvmix_tag_spec *s, const piece *p) {
    kvmix_tag_marker *m = (kvmix_tag_marker *)(void *)((char *)s + p->marker);
    kvmix_tag_seq q;
    int a = 0;
    memset(&q, 0, sizeof q);
    if (p->kind == P_VOCAB_OPT) {
        int32_t id = hf_tokenizer_vocab_id(g->tok, p->text, strlen(p->text));
        if (id < 0) return;
        q.ids[q.n_ids++] = id;
    } else if (p->kind == P_TEXT) {
        add_text(g, &q, p->text);
    } else if (add_special(g, &q, p->special, p->kind == P_SPECIAL) && p->text != NULL) {
        add_text(g, &q, p->text);
    }
    while (a < KVMIX_TAG_MAX_ALTS && m->alts[a].n_ids > 0) a++;
    if (g->r == KVMIX_SUCCESS && q.n_ids > 0 && a < KVMIX_TAG_MAX_ALTS) m->alts[a] = q;
}

static void add_names(gen *g, kvmix_tag_name *out, int32_t *out_n, const named *names) {
    for (; names->name != NULL && g->r == KVMIX_SUCCESS; names++) {
        kvmix_tag_name *x = &out[*out_n];
        memset(x, 0, sizeof *x);
        snprintf(x->text, sizeof x->text, "%s", names->name);
        x->role = (int32_t)names->role;
        if (names->special != NULL)
            add_special(g, &x->seq, names->special, true);
        else
            add_text(g, &x->seq, names->name);
        ++*out_n;
    }
}

static const family *find_family(const hf_tokenizer *tok, const char *name) {
    for (int i = 0; i < N_FAMILIES; i++)
        if (name != NULL ? strcmp(name, FAMILIES[i].name) == 0
                         : hf_tokenizer_special(tok, FAMILIES[i].detect) >= 0)
            return &FAMILIES[i];
    return NULL;
}

kvmix_result hf_tag_spec_generate(const hf_tokenizer *tok, const char *template_name,
                                  const char *doc_name, const char *description, tag_spec_doc *out,
                                  char *err, size_t err_bytes) {
    if (tok == NULL || out == NULL || doc_name == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_NULL_POINTER, "spec: NULL argument");
    const family *f = find_family(tok, template_name);
    if (f == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_INVALID_ARGUMENT,
                             "spec: unknown template \"%.32s\" (chatml, harmony, llama3, gemma3, "
                             "deepseek-v3)",
                             template_name != NULL ? template_name : "(none detected)");
    tag_spec_doc *d = (tag_spec_doc *)calloc(1, sizeof *d);
    if (d == NULL)
        return tag_spec_fail(err, err_bytes, KVMIX_ERR_OUT_OF_MEMORY, "spec: out of memory");
    gen g = {tok, err, err_bytes, KVMIX_SUCCESS};
    kvmix_tag_spec *s = &d->spec;
    snprintf(d->name, sizeof d->name, "%s", doc_name);
    if (description != NULL)
        snprintf(d->description, sizeof d->description, "%s", description);
    else
        snprintf(d->description, sizeof d->description,
                 "%s template; written by kvmix-tagspec from a tokenizer.json", f->name);
    for (const piece *p = f->pieces; p->special != NULL || p->text != NULL; p++)
        add_piece(&g, s, p);
    add_names(&g, s->roles, &s->n_roles, f->roles);
    add_names(&g, s->channels, &s->n_channels, f->channels);
    add_names(&g, s->role_starts, &s->n_role_starts, f->starts);
    kvmix_error why;
    if (g.r == KVMIX_SUCCESS && (g.r = kvmix_tag_spec_check(s, &why)) != KVMIX_SUCCESS)
        tag_spec_fail(err, err_bytes, g.r, "spec: kvmix_tag_spec_check refused it: %s %s",
                      why.field, why.reason);
    if (g.r == KVMIX_SUCCESS) *out = *d;
    free(d);
    return g.r;
}
