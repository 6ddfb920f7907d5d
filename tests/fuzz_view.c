/* Fuzz target: cache views from outside bytes, read by kvmix_view_check, kvmix_ref_view_decode,
   the fast kvmix_view_decode, kvmix_ref_view_score and kvmix_ref_view_key_features.

   Build with libFuzzer:  clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -I. \
                              tests/fuzz_view.c -o build/fuzz_view -lm
   or with the plain driver (any C compiler): add tests/fuzz_driver.c.

   Random bytes rarely make a view that gets past the first check, so the input drives a valid
   view and then damages it:
     0     sequences      1 + b % 3; mutations applied at most (b >> 2) % 8
     1     kv heads       1 + b % 2; q heads per kv head 1 + (b >> 2) % 3
     2     head_dim       32, 64 or 128 (b % 3); n_boost head_dim / 8 or / 4 (b >> 2 & 1)
     3..6  seed           formats, span lengths, dead flags, K/V values, queries
     7..   mutations      4 bytes each: target b0 % 4 (span records, sequence boundaries, dead
                          flags, packed blocks), a 16-bit offset (b1, b2) into it, the new byte b3
   Every array is a heap copy of exactly its size, so AddressSanitizer sees any overread.
   Work per input is bounded by what the target tests (the view's records against its blocks),
   not by the sizes: the spans of all sequences hold at most MAX_VIEW_TOKENS tokens (a span's own
   length stays 1..MAX_TOKENS, so group edges are still crossed), two kv heads place every block
   by its offset, query groups of 1-5 take the fast decode's four-head loops (AVX2 builds) with
   and without a head left over, and the blocks are quantized into a
   static scratch buffer that only the exact-size copy leaves. Decode and score read every live
   token for every query head, so more tokens or heads would cost time, not reach new code.
   Invariants (abort on violation): failed calls leave their outputs untouched; a successful
   decode writes finite outputs and an lse that is finite or -infinity; the fast decode, which
   checks the view's structure and not the packed bytes, succeeds where the reference does and
   agrees with it (and reads nothing outside the blocks whatever they hold); a successful score
   writes no entry past its capacity. */
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#define FUZZ_TARGET_NAME "fuzz_view"
#include "fuzz_invariants.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_SPANS = 9, MAX_TOKENS = 40, MAX_VIEW_TOKENS = 24, MAX_Q = 12, SCORE_CAPACITY = 64 };

/* Bytes of every block of a view, keys and values of 3 kv heads: FP16 rows (2 bytes an element,
   the most of any format) of MAX_VIEW_TOKENS tokens, and per block up to 8 bytes a channel of
   metadata and 16 of padding. */
#define BASE_BYTES ((size_t)2 * 3 * (MAX_VIEW_TOKENS * 128 * 2 + MAX_SPANS * (128 * 8 + 16)))

FUZZ_HARNESS static void random_rows(float *rows, int32_t n) {
    int32_t i;
    for (i = 0; i < n; i++) rows[i] = (float)((int32_t)(next_random() % 2001) - 1000) / 250.0f;
}

static kvmix_layout layout_of(const kvmix_view *v, uint8_t format, int32_t n_tokens) {
    kvmix_layout l;
    memset(&l, 0, sizeof l);
    l.format = (kvmix_format)format;
    l.n_tokens = n_tokens;
    l.head_dim = v->head_dim;
    l.n_boost = format == KVMIX_FORMAT_BOOSTED ? v->n_boost : 0;
    return l;
}

/* Quantizes random rows for every kv head at base + *used; returns the block offset. */
static uint64_t put_blocks(kvmix_view *v, uint8_t *base, size_t base_bytes, uint8_t format,
                           int32_t n_tokens, size_t *used, uint32_t *head_bytes) {
    kvmix_layout l = layout_of(v, format, n_tokens);
    float rows[MAX_TOKENS * 128];
    size_t block = 0;
    uint64_t offset = *used;
    int32_t h;
    kvmix_layout_bytes(&l, &block);
    block = (block + 15) / 16 * 16;
    for (h = 0; h < v->n_kv_heads; h++) {
        random_rows(rows, n_tokens * v->head_dim);
        if (*used + block <= base_bytes) {
            memset(base + *used, 0, block); /* the padding too: the buffer is reused */
            kvmix_ref_quantize(&l, rows, 0, base + *used, base_bytes - *used);
        }
        *used += block;
    }
    *head_bytes = (uint32_t)block;
    return offset;
}

typedef struct fuzz_view {
    kvmix_view view;
    kvmix_view_span *spans;
    int32_t *first;
    uint8_t *dead;
    uint8_t *base;
} fuzz_view;

static void build(fuzz_view *f, const uint8_t *data, int32_t *n_q) {
    static const uint8_t KEYS[] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                   KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
                                   KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
    static const int32_t DIMS[] = {32, 64, 128};
    kvmix_view *v = &f->view;
    static uint8_t base[BASE_BYTES];
    size_t used = 0;
    int32_t s, i, t, n_spans = 0, n_dead = 0, n_left = MAX_VIEW_TOKENS;
    memset(v, 0, sizeof *v);
    v->n_seqs = 1 + data[0] % 3;
    v->n_kv_heads = 1 + data[1] % 2;                 /* two place every block by its offset */
    *n_q = v->n_kv_heads * (1 + (data[1] >> 2) % 5); /* groups of 1-5: four at a time, odd */
    v->head_dim = DIMS[data[2] % 3];
    v->n_boost = v->head_dim / ((data[2] >> 2) & 1 ? 4 : 8);
    fuzz_rng = (uint32_t)data[3] | (uint32_t)data[4] << 8 | (uint32_t)data[5] << 16 |
               (uint32_t)data[6] << 24;
    f->spans = (kvmix_view_span *)calloc(MAX_SPANS, sizeof(kvmix_view_span));
    f->first = (int32_t *)calloc((size_t)v->n_seqs + 1, sizeof(int32_t));
    f->dead = (uint8_t *)calloc(MAX_SPANS * MAX_TOKENS, 1);
    f->base = base;
    for (s = 0; s < v->n_seqs; s++) {
        int32_t count = (int32_t)(next_random() % 4);
        for (i = 0; i < count && n_spans < MAX_SPANS && n_left > 0; i++) {
            kvmix_view_span *vs = &f->spans[n_spans++];
            vs->n_tokens = 1 + (int32_t)(next_random() % MAX_TOKENS);
            if (vs->n_tokens > n_left) vs->n_tokens = n_left;
            n_left -= vs->n_tokens;
            vs->key_format = KEYS[next_random() % 6];
            vs->value_format = KEYS[next_random() % 4];
            vs->key_offset = put_blocks(v, f->base, BASE_BYTES, vs->key_format, vs->n_tokens, &used,
                                        &vs->key_head_bytes);
            vs->value_offset = put_blocks(v, f->base, BASE_BYTES, vs->value_format, vs->n_tokens,
                                          &used, &vs->value_head_bytes);
            vs->dead_index = -1;
            if (next_random() % 2) {
                vs->dead_index = n_dead;
                for (t = 0; t < vs->n_tokens; t++) f->dead[n_dead++] = next_random() % 3 == 0;
            }
        }
        f->first[s + 1] = n_spans;
    }
    v->n_spans = n_spans;
    v->n_dead_flags = n_dead;
    v->base = f->base;
    v->base_bytes = used < BASE_BYTES ? used : BASE_BYTES;
    v->spans = f->spans;
    v->seq_first_span = f->first;
    v->dead = f->dead;
}

/* Mutation target: bytes of the span records, the boundaries, the dead flags or the blocks. */
static void mutate(fuzz_view *f, const uint8_t *m) {
    uint8_t *bytes[4];
    size_t sizes[4], at;
    bytes[0] = (uint8_t *)f->spans;
    sizes[0] = (size_t)f->view.n_spans * sizeof(kvmix_view_span);
    bytes[1] = (uint8_t *)f->first;
    sizes[1] = ((size_t)f->view.n_seqs + 1) * sizeof(int32_t);
    bytes[2] = f->dead;
    sizes[2] = (size_t)f->view.n_dead_flags;
    bytes[3] = f->base;
    sizes[3] = f->view.base_bytes;
    if (sizes[m[0] % 4] == 0) return;
    at = ((size_t)m[1] | (size_t)m[2] << 8) % sizes[m[0] % 4];
    bytes[m[0] % 4][at] = m[3];
}

FUZZ_HARNESS static void random_queries(float *q, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) q[i] = (float)(next_random() % 200) / 100.0f - 1.0f;
}

FUZZ_HARNESS static int all_finite(const float *x, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

/* The fast decode on an exact-size workspace: untouched outputs on failure; where the
   reference succeeded (want: its out), success and the reference's numbers. */
static void check_fast_decode(const kvmix_view *v, int32_t n_q, const float *q, const float *want) {
    float out[3 * MAX_Q * 128];
    size_t n = (size_t)v->n_seqs * (size_t)n_q * (size_t)v->head_dim, bytes = 0, i;
    void *ws;
    kvmix_result r = kvmix_view_decode_workspace(v, n_q, &bytes);
    if (r != KVMIX_SUCCESS) {
        require(!want, "the fast decode has no workspace size for a view the reference read");
        return;
    }
    ws = malloc(bytes ? bytes : 1);
    if (!ws) abort();
    memset(out, POISON, sizeof out);
    r = kvmix_view_decode(v, n_q, 0.0f, q, out, NULL, ws, bytes, NULL);
    free(ws);
    if (r != KVMIX_SUCCESS) {
        require(!want, "the fast decode refused a view the reference read");
        require(all_poisoned(out, sizeof out), "failed fast decode wrote its output");
        return;
    }
    require(all_poisoned((const uint8_t *)(out + n), sizeof out - n * sizeof(float)),
            "fast decode wrote past its output");
    if (want)
        for (i = 0; i < n; i++)
            require(fabsf(out[i] - want[i]) <= 1e-3f * (1.0f + fabsf(want[i])),
                    "fast decode differs from the reference");
}

/* kvmix_ref_view_key_features of sequence 0: on failure nothing written, on success finite
   features with norms not negative, nothing past the capacity. */
static void check_key_features(const kvmix_view *v, int32_t n_q, const float *memory) {
    static float norm[SCORE_CAPACITY + 8], readout[SCORE_CAPACITY + 8];
    kvmix_result r;
    int32_t t;
    memset(norm, POISON, sizeof norm);
    memset(readout, POISON, sizeof readout);
    r = kvmix_ref_view_key_features(v, 0, n_q, 0.0f, memory, norm, readout, SCORE_CAPACITY);
    if (r != KVMIX_SUCCESS) {
        require(all_poisoned(norm, sizeof norm) && all_poisoned(readout, sizeof readout),
                "failed key features wrote");
        return;
    }
    for (t = 0; t < SCORE_CAPACITY; t++)
        if (!all_poisoned(&norm[t], sizeof(float))) /* a token of the sequence */
            require(norm[t] >= 0.0f && isfinite(norm[t]) && isfinite(readout[t]),
                    "key features: a negative or not finite value");
    require(all_poisoned(norm + SCORE_CAPACITY, 8 * sizeof(float)) &&
                all_poisoned(readout + SCORE_CAPACITY, 8 * sizeof(float)),
            "key features past their capacity");
}

static void check_calls(const kvmix_view *v, int32_t n_q) {
    float q[3 * MAX_Q * 128], out[3 * MAX_Q * 128], lse[3 * MAX_Q], memory[MAX_Q * 128];
    float scores[SCORE_CAPACITY + 8];
    size_t n = (size_t)v->n_seqs * (size_t)n_q, i;
    kvmix_result r;
    kvmix_error why = {NULL, NULL};
    random_queries(q, n * (size_t)v->head_dim);
    memcpy(memory, q, sizeof(float) * (size_t)n_q * (size_t)v->head_dim);
    r = kvmix_view_check(v, &why);
    require(error_filled(r, why), "kvmix_view_check names what it refused, and nothing on success");
    memset(out, POISON, sizeof out);
    memset(lse, POISON, sizeof lse);
    r = kvmix_ref_view_decode(v, n_q, 0.0f, q, out, lse);
    if (r != KVMIX_SUCCESS) {
        require(all_poisoned(out, sizeof out) && all_poisoned(lse, sizeof lse),
                "failed decode wrote its outputs");
    } else {
        require(all_finite(out, n * (size_t)v->head_dim), "output not finite");
        for (i = 0; i < n; i++)
            require(isfinite(lse[i]) || lse[i] == -INFINITY, "lse is NaN or +inf");
    }
    check_fast_decode(v, n_q, q, r == KVMIX_SUCCESS ? out : NULL);
    memset(scores, POISON, sizeof scores);
    r = kvmix_ref_view_score(v, 0, n_q, memory, scores, SCORE_CAPACITY);
    if (r != KVMIX_SUCCESS) require(all_poisoned(scores, sizeof scores), "failed score wrote");
    require(all_poisoned(scores + SCORE_CAPACITY, 8 * sizeof(float)), "score past its capacity");
    check_key_features(v, n_q, memory);
}

/* A heap copy of exactly n bytes (at least one, so malloc(0) never returns NULL). */
static void *exact_copy(const void *src, size_t n) {
    void *copy = malloc(n ? n : 1);
    if (!copy) abort();
    memcpy(copy, src, n);
    return copy;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_view f;
    kvmix_view exact;
    int32_t n_q;
    size_t i;
    if (size < 7) return 0;
    build(&f, data, &n_q);
    for (i = 7; i + 4 <= size && i < 7 + 4 * (size_t)((data[0] >> 2) % 8); i += 4)
        mutate(&f, data + i);
    exact = f.view;
    exact.spans = (const kvmix_view_span *)exact_copy(f.spans, (size_t)f.view.n_spans *
                                                                   sizeof(kvmix_view_span));
    exact.seq_first_span =
        (const int32_t *)exact_copy(f.first, ((size_t)f.view.n_seqs + 1) * sizeof(int32_t));
    exact.dead = (const uint8_t *)exact_copy(f.dead, (size_t)f.view.n_dead_flags);
    exact.base = (const uint8_t *)exact_copy(f.base, f.view.base_bytes);
    check_calls(&exact, n_q);
    free((void *)exact.spans);
    free((void *)exact.seq_first_span);
    free((void *)exact.dead);
    free((void *)exact.base);
    free(f.spans);
    free(f.first);
    free(f.dead);
    return 0;
}
