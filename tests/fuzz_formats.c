/* Fuzz target: packed blocks from outside bytes, read by kvmix_ref_dequantize,
   kvmix_ref_dequantize_row and kvmix_ref_attention_decode.

   Build with libFuzzer:  clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -I. \
                              tests/fuzz_formats.c -o build/fuzz_formats -lm
   or with the plain driver (any C compiler): add tests/fuzz_driver.c.

   Input: a 12-byte header, then the payload (packed bytes).
     0  key format            b % 8 (0 and 7 are not formats)
     1  head_dim              b < 0xF0: 32 * (1 + b % 16); else (b - 0xF0) * 7 - 1 (invalid but 48, 104)
     2  n_tokens              b < 0xFC: b % 72; else 0xFB - b (negative)
     3  group sizes, dead     key group GROUPS[b % 8], value group GROUPS[(b >> 3) % 8],
                              dead flags b >> 6 (0 none, 1 random, 2 all dead, 3 all live)
     4  key n_boost           b < 0xC0: 4 * (b % 48); else b - 0xC0 (mostly invalid)
     5  value format          b % 8
     6  value n_boost         as byte 4
     7  heads, spans          n_kv_heads 1 + (b & 3) % 3, q heads per kv head 1 + (b >> 2) % 4,
                              extra spans (b >> 4) % 4, scale 0 or explicit (b >> 6)
     8  key head stride       0: key_head_bytes 0; 0xFF: 2^63 (wraps with 3 kv heads);
                              else block + b - 1
     9  value head stride     as byte 8
     10 row stride, row       dequantize row_stride head_dim + b % 6 - 1; row b >> 3
     11 seed                  q and dead flags
   The payload is given whole to dequantize / dequantize_row of the key layout. For attention
   it is split: keys take the first bytes up to the extent of n_kv_heads key blocks, values the
   rest; each part is copied to a heap block of exactly its size, and keys_bytes / values_bytes
   say that size (honest extents, so AddressSanitizer sees any overread).

   Invariants checked (abort on violation): failed calls leave their outputs untouched;
   successful ones produce finite outputs, dequantize_row equals the row of dequantize,
   attention outputs are convex combinations of the live value rows (within float rounding),
   lse is finite exactly when a token is live, and every block attention accepted also
   dequantizes. */
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_HEADER_BYTES 12
#define FUZZ_MAX_SPANS    4

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const int32_t FUZZ_GROUPS[8] = {0, 8, 16, 32, 64, 24, 12, 128};

#ifdef KVMIX_FUZZ_STATS
/* Result counts per entry point, for the plain driver's summary (-DKVMIX_FUZZ_STATS). */
long kvmix_fuzz_results[3][16];
#define FUZZ_COUNT(call, r) (kvmix_fuzz_results[call][-(int)(r)&15]++)
#else
#define FUZZ_COUNT(call, r) ((void)0)
#endif

static void fuzz_fail(const char *what, const char *detail) {
    fprintf(stderr, "fuzz_formats: invariant violated: %s (%s)\n", what, detail);
    abort();
}

static void *fuzz_alloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) abort();
    return p;
}

static uint8_t *fuzz_copy(const uint8_t *data, size_t bytes) {
    uint8_t *p = (uint8_t *)fuzz_alloc(bytes);
    if (bytes) memcpy(p, data, bytes);
    return p;
}

static void fuzz_poison(void *p, size_t bytes) { memset(p, 0xa7, bytes); }

static int fuzz_poisoned(const void *p, size_t bytes) {
    size_t i;
    for (i = 0; i < bytes; i++)
        if (((const uint8_t *)p)[i] != 0xa7) return 0;
    return 1;
}

static uint32_t fuzz_next(uint32_t *state) { /* xorshift32 */
    uint32_t x = *state ? *state : 0x9e3779b9u;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *state = x;
}

static int32_t fuzz_boost(uint8_t b) { return b < 0xc0 ? 4 * (b % 48) : b - 0xc0; }

/* Bytes of a block of layout l, or 0 when the layout is invalid. */
static size_t fuzz_block_bytes(const kvmix_layout *l) {
    size_t bytes = 0;
    if (kvmix_layout_bytes(l, &bytes) != KVMIX_SUCCESS) return 0;
    return bytes;
}

static size_t fuzz_head_bytes(uint8_t b, size_t block) {
    if (b == 0) return 0;
    if (b == 0xff) return (SIZE_MAX >> 1) + 1;
    return block + (size_t)(b - 1);
}

/* dequantize and dequantize_row of one layout over the whole payload */
static void fuzz_dequantize(const kvmix_layout *l, const uint8_t *payload, size_t payload_bytes,
                            uint8_t stride_byte) {
    uint8_t *src = fuzz_copy(payload, payload_bytes);
    kvmix_layout resolved = *l;
    int valid = kvmix_layout_resolve(&resolved, NULL) == KVMIX_SUCCESS;
    int32_t d = valid ? resolved.head_dim : 32, n = valid ? resolved.n_tokens : 0;
    int32_t stride = d + stride_byte % 6 - 1, row = stride_byte >> 3, t, c;
    size_t n_dst = (size_t)(n > 0 ? n : 1) * (size_t)(stride > d ? stride : d);
    float *dst = (float *)fuzz_alloc(sizeof(float) * n_dst);
    float *row_out = (float *)fuzz_alloc(sizeof(float) * (size_t)d);
    kvmix_result r, rr;
    fuzz_poison(dst, sizeof(float) * n_dst);
    r = kvmix_ref_dequantize(l, src, payload_bytes, dst, stride);
    FUZZ_COUNT(0, r);
    if (r != KVMIX_SUCCESS || n == 0) {
        if (!fuzz_poisoned(dst, sizeof(float) * n_dst))
            fuzz_fail("dequantize wrote on failure", kvmix_result_string(r));
    } else {
        if (payload_bytes < fuzz_block_bytes(l)) fuzz_fail("dequantize read a short block", "");
        for (t = 0; t < n; t++) {
            for (c = 0; c < d; c++)
                if (!isfinite(dst[(size_t)t * stride + c]))
                    fuzz_fail("dequantize output not finite", "");
            if (!fuzz_poisoned(dst + (size_t)t * stride + d, sizeof(float) * (size_t)(stride - d)))
                fuzz_fail("dequantize wrote row padding", "");
        }
    }
    for (t = 0; t < 3; t++) {
        int32_t which = t == 0 ? row : t == 1 ? 0 : n - 1;
        fuzz_poison(row_out, sizeof(float) * (size_t)d);
        rr = kvmix_ref_dequantize_row(l, src, payload_bytes, which, row_out);
        FUZZ_COUNT(1, rr);
        if (rr != KVMIX_SUCCESS) {
            if (!fuzz_poisoned(row_out, sizeof(float) * (size_t)d))
                fuzz_fail("dequantize_row wrote on failure", "");
            if (r == KVMIX_SUCCESS && which >= 0 && which < n)
                fuzz_fail("dequantize_row failed where dequantize succeeded",
                          kvmix_result_string(rr));
            continue;
        }
        if (which < 0 || which >= n) fuzz_fail("dequantize_row accepted a row out of range", "");
        for (c = 0; c < d; c++)
            if (!isfinite(row_out[c])) fuzz_fail("dequantize_row output not finite", "");
        if (r == KVMIX_SUCCESS &&
            memcmp(row_out, dst + (size_t)which * stride, sizeof(float) * (size_t)d) != 0)
            fuzz_fail("dequantize_row differs from dequantize", "");
    }
    free(src);
    free(dst);
    free(row_out);
}

typedef struct fuzz_part {
    uint8_t *bytes;
    size_t size, head_bytes;
} fuzz_part;

/* attention over spans built on the payload */
static void fuzz_attention(const uint8_t *h, const kvmix_layout *kl, const kvmix_layout *vl,
                           const uint8_t *payload, size_t payload_bytes) {
    int32_t n_kv = 1 + (h[7] & 3) % 3, n_q = n_kv * (1 + (h[7] >> 2) % 4);
    int32_t n_spans = 1 + (h[7] >> 4) % 4, d = kl->head_dim, i, t, c, qh;
    int dead_mode = h[3] >> 6;
    uint32_t seed = h[11] * 0x01000193u + (uint32_t)payload_bytes;
    size_t kblock = fuzz_block_bytes(kl), vblock = fuzz_block_bytes(vl), kextent, ksplit;
    size_t khead = fuzz_head_bytes(h[8], kblock), vhead = fuzz_head_bytes(h[9], vblock);
    fuzz_part keys, values;
    kvmix_span spans[FUZZ_MAX_SPANS];
    kvmix_attention_desc desc;
    uint8_t *dead = NULL;
    float *q, *out, *lse;
    size_t n_out;
    kvmix_result r;
    int32_t live = 0;

    if (d <= 0 || d > KVMIX_MAX_HEAD_DIM) d = 32; /* q and out sizes; the call rejects it */
    /* split: keys get the extent of n_kv key blocks (as far as the payload goes) */
    kextent =
        kblock ? (khead && khead < ((size_t)1 << 40) ? khead : kblock) * (size_t)(n_kv - 1) + kblock
               : payload_bytes / 2;
    ksplit = kextent < payload_bytes ? kextent : payload_bytes;
    keys.bytes = fuzz_copy(payload, ksplit);
    keys.size = ksplit;
    keys.head_bytes = khead;
    values.bytes = fuzz_copy(payload + ksplit, payload_bytes - ksplit);
    values.size = payload_bytes - ksplit;
    values.head_bytes = vhead;

    memset(spans, 0, sizeof spans);
    spans[0].key_layout = *kl;
    spans[0].value_layout = *vl;
    spans[0].keys = keys.bytes;
    spans[0].values = values.bytes;
    spans[0].key_head_bytes = keys.head_bytes;
    spans[0].value_head_bytes = values.head_bytes;
    spans[0].keys_bytes = keys.size;
    spans[0].values_bytes = values.size;
    if (dead_mode && kl->n_tokens > 0 && kl->n_tokens <= 4096) {
        dead = (uint8_t *)fuzz_alloc((size_t)kl->n_tokens);
        for (t = 0; t < kl->n_tokens; t++)
            dead[t] = dead_mode == 2   ? 1
                      : dead_mode == 3 ? 0
                                       : (uint8_t)(fuzz_next(&seed) % 3 == 0);
        spans[0].dead = dead;
    }
    /* span 1: no tokens, no memory; span 2: span 0 without dead flags; span 3: the same bytes
       read as a shorter block */
    spans[1] = spans[0];
    spans[1].key_layout.n_tokens = spans[1].value_layout.n_tokens = 0;
    spans[1].keys = spans[1].values = NULL;
    spans[1].keys_bytes = spans[1].values_bytes = 0;
    spans[1].dead = NULL;
    spans[2] = spans[0];
    spans[2].dead = NULL;
    spans[3] = spans[0];
    spans[3].key_layout.n_tokens = spans[3].value_layout.n_tokens = kl->n_tokens / 2;

    memset(&desc, 0, sizeof desc);
    desc.n_q_heads = n_q;
    desc.n_kv_heads = n_kv;
    desc.head_dim = kl->head_dim;
    desc.scale = (h[7] >> 6) == 1 ? 0.125f : (h[7] >> 6) == 2 ? 1.0f : 0.0f;
    n_out = (size_t)n_q * (size_t)d;
    q = (float *)fuzz_alloc(sizeof(float) * n_out);
    out = (float *)fuzz_alloc(sizeof(float) * n_out);
    lse = (float *)fuzz_alloc(sizeof(float) * (size_t)n_q);
    for (i = 0; i < (int32_t)n_out; i++)
        q[i] = (float)((int32_t)(fuzz_next(&seed) % 4001) - 2000) / 1000.0f;
    fuzz_poison(out, sizeof(float) * n_out);
    fuzz_poison(lse, sizeof(float) * (size_t)n_q);
    r = kvmix_ref_attention_decode(&desc, q, spans, n_spans, out, lse);
    FUZZ_COUNT(2, r);
    if (r != KVMIX_SUCCESS) {
        if (!fuzz_poisoned(out, sizeof(float) * n_out) ||
            !fuzz_poisoned(lse, sizeof(float) * (size_t)n_q))
            fuzz_fail("attention wrote on failure", kvmix_result_string(r));
        goto done;
    }
    for (i = 0; i < n_spans; i++)
        for (t = 0; t < spans[i].key_layout.n_tokens; t++)
            live += !(spans[i].dead && spans[i].dead[t]);
    for (qh = 0; qh < n_q; qh++) {
        int32_t kvh = qh / (n_q / n_kv);
        float lo[KVMIX_MAX_HEAD_DIM], hi[KVMIX_MAX_HEAD_DIM];
        if (isnan(lse[qh]) || (isinf(lse[qh]) && lse[qh] > 0)) fuzz_fail("lse NaN or +inf", "");
        if ((live > 0) != !isinf(lse[qh]))
            fuzz_fail("lse is -inf exactly when no token is live", "");
        for (c = 0; c < d; c++) {
            if (!isfinite(out[(size_t)qh * d + c])) fuzz_fail("attention output not finite", "");
            if (live == 0 && out[(size_t)qh * d + c] != 0.0f)
                fuzz_fail("no live token but output not 0", "");
            lo[c] = INFINITY;
            hi[c] = -INFINITY;
        }
        if (live == 0) continue;
        /* every accepted block dequantizes; the output lies between the live values */
        for (i = 0; i < n_spans; i++) {
            const kvmix_span *s = &spans[i];
            size_t kb = fuzz_block_bytes(&s->key_layout), vb = fuzz_block_bytes(&s->value_layout);
            size_t ks = s->key_head_bytes ? s->key_head_bytes : kb,
                   vs = s->value_head_bytes ? s->value_head_bytes : vb;
            int32_t n = s->key_layout.n_tokens;
            float *v;
            if (n == 0) continue;
            v = (float *)fuzz_alloc(sizeof(float) * (size_t)n * (size_t)d);
            if (kvmix_ref_dequantize(&s->key_layout, (const uint8_t *)s->keys + ks * (size_t)kvh,
                                     kb, v, 0) != KVMIX_SUCCESS ||
                kvmix_ref_dequantize(&s->value_layout,
                                     (const uint8_t *)s->values + vs * (size_t)kvh, vb, v,
                                     0) != KVMIX_SUCCESS)
                fuzz_fail("attention accepted a block that dequantize rejects", "");
            for (t = 0; t < n; t++) {
                if (s->dead && s->dead[t]) continue;
                for (c = 0; c < d; c++) {
                    float x = v[(size_t)t * d + c];
                    if (x < lo[c]) lo[c] = x;
                    if (x > hi[c]) hi[c] = x;
                }
            }
            free(v);
        }
        for (c = 0; c < d; c++) {
            float o = out[(size_t)qh * d + c];
            float tol =
                1e-3f * (fabsf(lo[c]) > fabsf(hi[c]) ? fabsf(lo[c]) : fabsf(hi[c])) + 1e-30f;
            if (o < lo[c] - tol || o > hi[c] + tol)
                fuzz_fail("attention output outside the live values", "");
        }
    }
done:
    free(keys.bytes);
    free(values.bytes);
    free(dead);
    free(q);
    free(out);
    free(lse);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *payload = data + FUZZ_HEADER_BYTES;
    size_t payload_bytes;
    kvmix_layout kl, vl;
    if (size < FUZZ_HEADER_BYTES) return 0;
    payload_bytes = size - FUZZ_HEADER_BYTES;
    memset(&kl, 0, sizeof kl);
    kl.format = (kvmix_format)(data[0] % 8);
    kl.head_dim = data[1] < 0xf0 ? 32 * (1 + data[1] % 16) : (data[1] - 0xf0) * 7 - 1;
    kl.n_tokens = data[2] < 0xfc ? data[2] % 72 : 0xfb - data[2];
    kl.group_size = FUZZ_GROUPS[data[3] % 8];
    kl.n_boost = fuzz_boost(data[4]);
    vl = kl;
    vl.format = (kvmix_format)(data[5] % 8);
    vl.group_size = FUZZ_GROUPS[(data[3] >> 3) % 8];
    vl.n_boost = fuzz_boost(data[6]);
    fuzz_dequantize(&kl, payload, payload_bytes, data[10]);
    fuzz_dequantize(&vl, payload, payload_bytes, data[10]);
    fuzz_attention(data, &kl, &vl, payload, payload_bytes);
    return 0;
}
