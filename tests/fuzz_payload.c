/* Fuzz target: transfer payloads from outside bytes, read by kvmix_payload_read_head and
   kvmix_payload_unpack.

   Build with libFuzzer:  clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -I. \
                              tests/fuzz_payload.c -o build/fuzz_payload -lm
   or with the plain driver (any C compiler): add tests/fuzz_driver.c.

   Random bytes rarely get past the magic, so byte 0 chooses:
     even   the input is the payload, as received;
     odd    the input drives a valid payload that is then damaged:
              1      kind (b & 1: RESIDUAL), head_dim 32 * (1 + (b >> 1) % 4), group 16 or 32
              2      kv heads 1 + b % 2, layers 1 + (b >> 2) % 2, first layer b >> 4
              3      tokens b % 20 (the tier table's padding to 16 is crossed)
            Two heads and two layers are enough to place every block by its offset, and
            unpack_all reads only the first and last layers; more heads, layers or tokens would
            cost time (every row is quantized and decoded the same way), not reach new code.
              4..7   seed of tiers and rows
              8..    mutations, 3 bytes each: a 16-bit offset into the payload, the new byte
   Every buffer is a heap copy of exactly its size, so AddressSanitizer sees any overread.
   Invariants (abort on violation): a failed unpack leaves its outputs untouched; a successful one
   writes finite values (rows of a ROWS payload; residuals added to zeros).

   Work per input is bounded by what the target tests, not by what a header declares: a header
   of 80 bytes may declare 65,535 layers of 65,535 kv heads, and one unpack checks every block of
   its layer (2 x kv heads x 3). Layers differ only in their offset, so unpack_all reads the
   first and last layers and one out of range on each side, never every layer; the in-range
   calls run only while the floats to decode stay within MAX_FLOATS and the blocks to check
   within MAX_BLOCK_CHECKS (a larger header still goes through read_head, the range and size
   checks). That keeps every input well under a millisecond. */
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#define FUZZ_TARGET_NAME "fuzz_payload"
#include "fuzz_invariants.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Caps on what one unpack may be asked to do (see above): floats per layer, block checks per
   layer (2 x kv heads x 3 tiers). Valid payloads built from bytes 1..3 stay far below both. */
enum { MAX_FLOATS = 1 << 15, MAX_BLOCK_CHECKS = 6 * 256 };

FUZZ_HARNESS static void random_rows(float *keys, float *values, size_t n) {
    size_t i;
    for (i = 0; i < n; i++) {
        keys[i] =
            ((float)(next_random() % 20001) - 10000.0f) / (next_random() % 4 ? 1000.0f : 3.0f);
        values[i] = ((float)(next_random() % 2001) - 1000.0f) / 100.0f;
    }
}

/* 1 when the n floats of a and b are all zero (want_zero) or all finite (!want_zero). */
FUZZ_HARNESS static int all_floats(const float *a, const float *b, size_t n, int want_zero) {
    size_t i;
    for (i = 0; i < n; i++)
        if (want_zero ? a[i] != 0.0f || b[i] != 0.0f : !isfinite(a[i]) || !isfinite(b[i])) return 0;
    return 1;
}

/* A valid payload from the parameter bytes; NULL when they describe nothing packable. */
static uint8_t *build_payload(const uint8_t *data, size_t size, size_t *out_bytes) {
    kvmix_payload_desc d;
    kvmix_payload_info info;
    uint8_t *tiers, *payload = NULL;
    float *keys, *values;
    size_t n_floats;
    int32_t t;
    if (size < 8) return NULL;
    memset(&d, 0, sizeof d);
    d.kind = (data[1] & 1) ? KVMIX_PAYLOAD_RESIDUAL : KVMIX_PAYLOAD_ROWS;
    d.head_dim = 32 * (1 + (data[1] >> 1) % 4);
    d.group_size = d.head_dim % 16 == 0 && (data[1] & 0x40) ? 16 : 32;
    d.n_kv_heads = 1 + data[2] % 2;
    d.n_layers = 1 + (data[2] >> 2) % 2;
    d.first_layer = data[2] >> 4;
    d.n_tokens = data[3] % 20;
    d.id = 7;
    d.base_id = d.kind == KVMIX_PAYLOAD_RESIDUAL ? 6 : 0;
    fuzz_rng = (uint32_t)data[4] | (uint32_t)data[5] << 8 | (uint32_t)data[6] << 16 |
               (uint32_t)data[7] << 24;
    tiers = (uint8_t *)malloc((size_t)d.n_tokens + 1);
    for (t = 0; t < d.n_tokens; t++) {
        tiers[t] = (uint8_t)(1 + next_random() % 3);
        if (d.kind == KVMIX_PAYLOAD_RESIDUAL && next_random() % 4 == 0)
            tiers[t] = KVMIX_PAYLOAD_NO_ROW;
    }
    n_floats = (size_t)d.n_layers * (size_t)d.n_tokens * (size_t)d.n_kv_heads * (size_t)d.head_dim;
    keys = (float *)malloc(n_floats * sizeof(float) + 1);
    values = (float *)malloc(n_floats * sizeof(float) + 1);
    random_rows(keys, values, n_floats);
    if (kvmix_payload_describe(&d, tiers, &info, NULL) == KVMIX_SUCCESS) {
        payload = (uint8_t *)malloc(info.total_bytes);
        require(kvmix_payload_pack(&d, tiers, keys, values, payload, info.total_bytes, out_bytes,
                                   NULL) == KVMIX_SUCCESS,
                "packing a valid description succeeds");
    }
    free(tiers);
    free(keys);
    free(values);
    return payload;
}

static void unpack_all(const uint8_t *payload, size_t bytes) {
    kvmix_payload_info info;
    size_t n_floats;
    float *keys, *values;
    int32_t k, layers[4];
    int skip_body;
    kvmix_error why = {NULL, NULL};
    kvmix_result r = kvmix_payload_read_head(payload, bytes, &info, NULL, &why);
    require(error_filled(r, why), "read_head names what it refused, and nothing on success");
    if (r != KVMIX_SUCCESS) return;
    require(info.head_bytes <= bytes && info.head_bytes >= KVMIX_PAYLOAD_HEADER_BYTES,
            "an accepted head lies inside the input");
    n_floats =
        (size_t)info.desc.n_tokens * (size_t)info.desc.n_kv_heads * (size_t)info.desc.head_dim;
    /* Beyond the caps, the in-range layers are read only when the body is short (unpack fails
       before any block); outputs then have no room, so a write would show as an overflow. */
    skip_body = (n_floats > MAX_FLOATS || 6 * (size_t)info.desc.n_kv_heads > MAX_BLOCK_CHECKS) &&
                bytes >= info.total_bytes;
    if (n_floats > MAX_FLOATS) n_floats = 0;
    /* first - 1 (out of range), first, last, last + 1 (out of range) */
    layers[0] = info.desc.first_layer - 1;
    layers[1] = info.desc.first_layer;
    layers[2] = info.desc.first_layer + info.desc.n_layers - 1;
    layers[3] = info.desc.first_layer + info.desc.n_layers;
    keys = (float *)malloc(n_floats * sizeof(float) + 1);
    values = (float *)malloc(n_floats * sizeof(float) + 1);
    for (k = 0; k < 4; k++) {
        const int32_t layer = layers[k];
        const int fill = info.desc.kind == KVMIX_PAYLOAD_ROWS ? POISON : 0; /* residuals add */
        kvmix_result r;
        if (k == 2 && layers[2] == layers[1]) continue; /* one layer: first is last */
        if ((k == 1 || k == 2) && skip_body) continue;
        memset(keys, fill, n_floats * sizeof(float));
        memset(values, fill, n_floats * sizeof(float));
        r = kvmix_payload_unpack(payload, bytes, layer, keys, values, NULL);
        if (r != KVMIX_SUCCESS) {
            if (info.desc.kind == KVMIX_PAYLOAD_ROWS)
                require(all_poisoned(keys, n_floats * sizeof(float)) &&
                            all_poisoned(values, n_floats * sizeof(float)),
                        "a failed unpack writes nothing");
            else
                require(all_floats(keys, values, n_floats, 1), "a failed unpack adds nothing");
            continue;
        }
        require(all_floats(keys, values, n_floats, 0), "unpacked rows are finite");
    }
    free(keys);
    free(values);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *payload;
    size_t bytes = 0, i;
    if (size == 0) return 0;
    if ((data[0] & 1) == 0) {
        payload = (uint8_t *)malloc(size - 1 + 1);
        memcpy(payload, data + 1, size - 1);
        unpack_all(payload, size - 1);
        free(payload);
        return 0;
    }
    if (!(payload = build_payload(data, size, &bytes))) return 0;
    for (i = 8; i + 3 <= size; i += 3) {
        size_t off = ((size_t)data[i] | (size_t)data[i + 1] << 8) % bytes;
        payload[off] = data[i + 2];
    }
    unpack_all(payload, bytes);
    unpack_all(payload, bytes - (size > 8 ? data[size - 1] % 17 : 0)); /* truncated too */
    free(payload);
    return 0;
}
