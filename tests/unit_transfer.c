/* unit_transfer: the transfer payload (kvmix_payload_*). Packed bytes are checked against an
   independent construction from the documented layout: each block is kvmix_ref_quantize of the
   rows of its tier gathered in position order, at the offset the >>transfer comment gives, with
   zero padding. Unpacked rows must equal kvmix_ref_dequantize of those blocks bit for bit, a
   RESIDUAL payload must add exactly its decoded residuals, and every malformed head or body must
   be refused with its outputs untouched. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const kvmix_format TIERS[3] = {KVMIX_FORMAT_FP16, KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4};

typedef struct payload_case {
    kvmix_payload_desc desc;
    uint8_t *tiers;
    float *keys, *values; /* [n_layers][n_tokens][n_kv_heads][head_dim] */
    size_t n_floats;
} payload_case;

static size_t round16(size_t n) { return (n + 15u) & ~(size_t)15u; }

static void random_case(test_rng *rng, payload_case *pc, kvmix_payload_kind kind) {
    static const int32_t dims[] = {32, 48, 64, 80, 96, 128};
    int32_t i, mix = test_rng_range(rng, 0, 3);
    memset(pc, 0, sizeof *pc);
    pc->desc.kind = kind;
    pc->desc.head_dim = dims[test_rng_range(rng, 0, 5)];
    /* 48 and 80: groups of 16, as the default 32 does not divide them */
    pc->desc.group_size =
        pc->desc.head_dim % 32 != 0 || (pc->desc.head_dim % 64 == 0 && test_rng_range(rng, 0, 1))
            ? 16
            : 0;
    pc->desc.n_kv_heads = test_rng_range(rng, 1, 3);
    pc->desc.first_layer = test_rng_range(rng, 0, 5);
    pc->desc.n_layers = test_rng_range(rng, 1, 3);
    pc->desc.n_tokens =
        test_rng_range(rng, 0, 1) ? test_rng_range(rng, 0, 3) : test_rng_range(rng, 4, 40);
    pc->desc.first_position = test_rng_range(rng, 0, 1000);
    pc->desc.id = test_rng_u64(rng);
    pc->desc.base_id = kind == KVMIX_PAYLOAD_RESIDUAL ? test_rng_u64(rng) : 0;
    pc->tiers = (uint8_t *)test_alloc((size_t)pc->desc.n_tokens + 1);
    for (i = 0; i < pc->desc.n_tokens; i++) {
        /* mix 0..2: everything at one tier; 3: random; RESIDUAL also skips some tokens */
        pc->tiers[i] = (uint8_t)(mix < 3 ? TIERS[mix] : TIERS[test_rng_range(rng, 0, 2)]);
        if (kind == KVMIX_PAYLOAD_RESIDUAL && test_rng_range(rng, 0, 2) == 0)
            pc->tiers[i] = KVMIX_PAYLOAD_NO_ROW;
    }
    pc->n_floats = (size_t)pc->desc.n_layers * (size_t)pc->desc.n_tokens *
                   (size_t)pc->desc.n_kv_heads * (size_t)pc->desc.head_dim;
    pc->keys = (float *)test_alloc(pc->n_floats * sizeof(float) + 1);
    pc->values = (float *)test_alloc(pc->n_floats * sizeof(float) + 1);
    for (i = 0; i < (int32_t)pc->n_floats; i++) {
        pc->keys[i] = (float)(test_rng_normal(rng) * (i % 11 == 0 ? 6.0 : 1.0));
        pc->values[i] = (float)test_rng_normal(rng);
    }
}

static void free_case(payload_case *pc) {
    free(pc->tiers);
    free(pc->keys);
    free(pc->values);
}

static int32_t group_of(const payload_case *pc) {
    return pc->desc.group_size ? pc->desc.group_size : KVMIX_GROUP_SIZE_DEFAULT;
}

/* Bytes of tier i's block in this case, from kvmix_layout_bytes (0 when no token is at it). */
static size_t tier_block_bytes(const payload_case *pc, int i, int32_t *count) {
    kvmix_layout l;
    size_t bytes = 0;
    int32_t t;
    *count = 0;
    for (t = 0; t < pc->desc.n_tokens; t++) *count += pc->tiers[t] == (uint8_t)TIERS[i];
    l = test_layout(TIERS[i], *count, pc->desc.head_dim, i ? group_of(pc) : 0, 0);
    CHECK_RESULT(kvmix_layout_bytes(&l, &bytes), KVMIX_SUCCESS);
    return bytes;
}

/* Builds the expected payload from the documented layout; returns its size. */
static size_t expected_payload(const payload_case *pc, uint8_t **out) {
    const int32_t d = pc->desc.head_dim, nh = pc->desc.n_kv_heads, n = pc->desc.n_tokens;
    size_t head = 80 + round16((size_t)n), slice = 0, block[3], total, off;
    int32_t count[3], layer, kv, h, t, i, r;
    uint8_t *p;
    float *gathered = (float *)test_alloc((size_t)(n + 1) * (size_t)d * sizeof(float));
    for (i = 0; i < 3; i++) slice += round16(block[i] = tier_block_bytes(pc, i, &count[i]));
    total = head + (size_t)pc->desc.n_layers * 2u * (size_t)nh * slice;
    p = (uint8_t *)test_alloc(total);
    memset(p, 0, total);
    memcpy(p, "KVMP", 4);
    p[4] = 1;
    p[6] = (uint8_t)pc->desc.kind;
    for (i = 0; i < 4; i++) {
        p[8 + i] = (uint8_t)((uint32_t)d >> (8 * i));
        p[12 + i] = (uint8_t)((uint32_t)nh >> (8 * i));
        p[16 + i] = (uint8_t)((uint32_t)group_of(pc) >> (8 * i));
        p[20 + i] = (uint8_t)((uint32_t)pc->desc.first_layer >> (8 * i));
        p[24 + i] = (uint8_t)((uint32_t)pc->desc.n_layers >> (8 * i));
        p[28 + i] = (uint8_t)((uint32_t)n >> (8 * i));
        p[56 + i] = (uint8_t)((uint32_t)count[0] >> (8 * i));
        p[60 + i] = (uint8_t)((uint32_t)count[1] >> (8 * i));
        p[64 + i] = (uint8_t)((uint32_t)count[2] >> (8 * i));
    }
    for (i = 0; i < 8; i++) {
        p[32 + i] = (uint8_t)((uint64_t)pc->desc.first_position >> (8 * i));
        p[40 + i] = (uint8_t)(pc->desc.id >> (8 * i));
        p[48 + i] = (uint8_t)(pc->desc.base_id >> (8 * i));
        p[72 + i] = (uint8_t)((uint64_t)total >> (8 * i));
    }
    if (n > 0) memcpy(p + 80, pc->tiers, (size_t)n);
    off = head;
    for (layer = 0; layer < pc->desc.n_layers; layer++)
        for (kv = 0; kv < 2; kv++)
            for (h = 0; h < nh; h++)
                for (i = 0; i < 3; i++) {
                    const float *rows = (kv ? pc->values : pc->keys) +
                                        (size_t)layer * (size_t)n * (size_t)nh * (size_t)d;
                    kvmix_layout l = test_layout(TIERS[i], count[i], d, i ? group_of(pc) : 0, 0);
                    for (t = 0, r = 0; t < n; t++)
                        if (pc->tiers[t] == (uint8_t)TIERS[i])
                            memcpy(gathered + (size_t)r++ * d, rows + ((size_t)t * nh + h) * d,
                                   (size_t)d * sizeof(float));
                    CHECK_RESULT(kvmix_ref_quantize(&l, gathered, 0, p + off, block[i]),
                                 KVMIX_SUCCESS);
                    off += round16(block[i]);
                }
    CHECK_EQ_UINT(off, total);
    free(gathered);
    *out = p;
    return total;
}

static uint8_t *pack_case(const payload_case *pc, size_t *bytes) {
    kvmix_payload_info info;
    uint8_t *p;
    CHECK_RESULT(kvmix_payload_describe(&pc->desc, pc->tiers, &info, NULL), KVMIX_SUCCESS);
    p = (uint8_t *)test_alloc(info.total_bytes);
    CHECK_RESULT(kvmix_payload_pack(&pc->desc, pc->tiers, pc->keys, pc->values, p, info.total_bytes,
                                    bytes, NULL),
                 KVMIX_SUCCESS);
    CHECK_EQ_UINT(*bytes, info.total_bytes);
    return p;
}

/* Decodes the expected rows of one layer from the expected blocks with kvmix_ref_dequantize. */
static void expected_rows(const payload_case *pc, const uint8_t *p, int32_t layer, int kv,
                          float *out) {
    const int32_t d = pc->desc.head_dim, nh = pc->desc.n_kv_heads, n = pc->desc.n_tokens;
    size_t slice = 0, block[3], off;
    int32_t count[3], h, t, i, r;
    float *rows = (float *)test_alloc((size_t)(n + 1) * (size_t)d * sizeof(float));
    for (i = 0; i < 3; i++) slice += round16(block[i] = tier_block_bytes(pc, i, &count[i]));
    off = 80 + round16((size_t)n) + ((size_t)layer * 2u + (size_t)kv) * (size_t)nh * slice;
    for (h = 0; h < nh; h++)
        for (i = 0; i < 3; i++) {
            kvmix_layout l = test_layout(TIERS[i], count[i], d, i ? group_of(pc) : 0, 0);
            CHECK_RESULT(kvmix_ref_dequantize(&l, p + off, block[i], rows, 0), KVMIX_SUCCESS);
            for (t = 0, r = 0; t < n; t++)
                if (pc->tiers[t] == (uint8_t)TIERS[i])
                    memcpy(out + ((size_t)t * nh + h) * d, rows + (size_t)r++ * d,
                           (size_t)d * sizeof(float));
            off += round16(block[i]);
        }
    free(rows);
}

static void test_pack_matches_layout(void) {
    test_rng rng;
    int iter;
    test_rng_init(&rng, "transfer.pack");
    for (iter = 0; iter < 200; iter++) {
        payload_case pc;
        uint8_t *got, *want;
        size_t got_bytes, want_bytes;
        kvmix_payload_info info;
        const uint8_t *tiers = NULL;
        random_case(&rng, &pc, iter % 3 == 2 ? KVMIX_PAYLOAD_RESIDUAL : KVMIX_PAYLOAD_ROWS);
        test_context("pack case %d: D %d G %d heads %d layers %d tokens %d kind %d", iter,
                     pc.desc.head_dim, group_of(&pc), pc.desc.n_kv_heads, pc.desc.n_layers,
                     pc.desc.n_tokens, (int)pc.desc.kind);
        got = pack_case(&pc, &got_bytes);
        want_bytes = expected_payload(&pc, &want);
        CHECK_EQ_UINT(got_bytes, want_bytes);
        if (got_bytes == want_bytes) CHECK_MEM_EQ(got, want, got_bytes);
        CHECK_RESULT(kvmix_payload_read_head(got, got_bytes, &info, &tiers, NULL), KVMIX_SUCCESS);
        CHECK(tiers == got + 80);
        CHECK_EQ_UINT(info.total_bytes, want_bytes);
        CHECK_EQ_UINT(info.head_bytes, 80 + round16((size_t)pc.desc.n_tokens));
        CHECK_EQ_INT(info.desc.group_size, group_of(&pc));
        CHECK(info.desc.id == pc.desc.id && info.desc.base_id == pc.desc.base_id);
        CHECK_EQ_INT(info.desc.first_position, pc.desc.first_position);
        free(got);
        free(want);
        free_case(&pc);
    }
    test_context(NULL);
}

static void test_unpack_rows(void) {
    test_rng rng;
    int iter;
    test_rng_init(&rng, "transfer.unpack");
    for (iter = 0; iter < 120; iter++) {
        payload_case pc;
        uint8_t *p;
        size_t bytes, layer_floats;
        int32_t layer, kv;
        random_case(&rng, &pc, KVMIX_PAYLOAD_ROWS);
        test_context("unpack case %d: D %d tokens %d", iter, pc.desc.head_dim, pc.desc.n_tokens);
        p = pack_case(&pc, &bytes);
        layer_floats = pc.n_floats / (size_t)pc.desc.n_layers;
        for (layer = 0; layer < pc.desc.n_layers; layer++)
            for (kv = 0; kv < 2; kv++) {
                float *got = (float *)test_alloc(layer_floats * sizeof(float) + 1);
                float *want = (float *)test_alloc(layer_floats * sizeof(float) + 1);
                const float *orig = (kv ? pc.values : pc.keys) + (size_t)layer * layer_floats;
                size_t i;
                double err = 0.0, energy = 0.0;
                test_poison(got, layer_floats * sizeof(float), 7);
                CHECK_RESULT(kvmix_payload_unpack(p, bytes, pc.desc.first_layer + layer,
                                                  kv ? NULL : got, kv ? got : NULL, NULL),
                             KVMIX_SUCCESS);
                expected_rows(&pc, p, layer, kv, want);
                CHECK_MEM_EQ(got, want, layer_floats * sizeof(float));
                for (i = 0; i < layer_floats; i++) {
                    err += (got[i] - orig[i]) * (double)(got[i] - orig[i]);
                    energy += orig[i] * (double)orig[i];
                }
                /* INT4 per-token groups of unit normals: NMSE about 1e-2 at worst */
                CHECK_MSG(err <= 0.05 * energy + 1e-30, "NMSE %g", err / (energy + 1e-30));
                free(got);
                free(want);
            }
        free(p);
        free_case(&pc);
    }
    test_context(NULL);
}

/* head_dim 48, 80 (groups of 16) and 96: packed bytes as the layouts say, unpacked rows as the
   blocks decode. */
static void test_head_dims_of_8(void) {
    static const int32_t dims[] = {48, 80, 96};
    test_rng rng;
    size_t di;
    test_rng_init(&rng, "transfer.head dims of 8");
    for (di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        payload_case pc;
        uint8_t *got, *want;
        size_t got_bytes, want_bytes, layer_floats;
        int32_t layer, kv;
        do { /* a ROWS case of this head_dim with tokens at every tier */
            random_case(&rng, &pc, KVMIX_PAYLOAD_ROWS);
            if (pc.desc.head_dim == dims[di] && pc.desc.n_tokens >= 3) break;
            free_case(&pc);
        } while (1);
        pc.tiers[0] = KVMIX_FORMAT_FP16, pc.tiers[1] = KVMIX_FORMAT_INT8;
        pc.tiers[2] = KVMIX_FORMAT_INT4;
        test_context("head_dim %d, group %d, %d tokens", dims[di], group_of(&pc), pc.desc.n_tokens);
        got = pack_case(&pc, &got_bytes);
        want_bytes = expected_payload(&pc, &want);
        if (CHECK_EQ_UINT(got_bytes, want_bytes)) CHECK_MEM_EQ(got, want, got_bytes);
        layer_floats = pc.n_floats / (size_t)pc.desc.n_layers;
        for (layer = 0; layer < pc.desc.n_layers; layer++)
            for (kv = 0; kv < 2; kv++) {
                float *rows = (float *)test_alloc(layer_floats * sizeof(float));
                float *rows_want = (float *)test_alloc(layer_floats * sizeof(float));
                test_poison(rows, layer_floats * sizeof(float), 7);
                CHECK_RESULT(kvmix_payload_unpack(got, got_bytes, pc.desc.first_layer + layer,
                                                  kv ? NULL : rows, kv ? rows : NULL, NULL),
                             KVMIX_SUCCESS);
                expected_rows(&pc, got, layer, kv, rows_want);
                CHECK_MEM_EQ(rows, rows_want, layer_floats * sizeof(float));
                free(rows);
                free(rows_want);
            }
        free(got);
        free(want);
        free_case(&pc);
    }
    test_context(NULL);
}

/* A cold-tier upgrade: rows sent at INT4, then a RESIDUAL payload at INT8 for some tokens. */
static void test_residual_upgrade(void) {
    test_rng rng;
    int iter;
    test_rng_init(&rng, "transfer.residual");
    for (iter = 0; iter < 60; iter++) {
        payload_case base, res;
        uint8_t *pb, *pr;
        size_t nb, nr, nf, i;
        int32_t t, h, c, n_up = 0;
        float *rows, *upgraded, *decoded_res;
        double err_base = 0.0, err_up = 0.0;
        random_case(&rng, &base, KVMIX_PAYLOAD_ROWS);
        base.desc.n_layers = 1; /* the arrays keep room for more */
        base.desc.n_tokens = base.desc.n_tokens > 0 ? base.desc.n_tokens : 1;
        if (base.n_floats == 0) {
            free_case(&base);
            iter--;
            continue;
        }
        for (t = 0; t < base.desc.n_tokens; t++) base.tiers[t] = KVMIX_FORMAT_INT4;
        nf = (size_t)base.desc.n_tokens * (size_t)base.desc.n_kv_heads * (size_t)base.desc.head_dim;
        pb = pack_case(&base, &nb);
        rows = (float *)test_alloc(nf * sizeof(float));
        upgraded = (float *)test_alloc(nf * sizeof(float));
        decoded_res = (float *)test_alloc(nf * sizeof(float));
        CHECK_RESULT(kvmix_payload_unpack(pb, nb, base.desc.first_layer, rows, NULL, NULL),
                     KVMIX_SUCCESS);
        /* the residual payload: original - received, INT8 for a random half of the tokens */
        res = base;
        res.desc.kind = KVMIX_PAYLOAD_RESIDUAL;
        res.desc.base_id = base.desc.id;
        res.desc.id = base.desc.id + 1;
        res.tiers = (uint8_t *)test_alloc((size_t)base.desc.n_tokens);
        res.keys = (float *)test_alloc(nf * sizeof(float));
        res.values = (float *)test_alloc(nf * sizeof(float));
        for (t = 0; t < base.desc.n_tokens; t++) {
            res.tiers[t] = test_rng_range(&rng, 0, 1) ? KVMIX_FORMAT_INT8 : KVMIX_PAYLOAD_NO_ROW;
            n_up += res.tiers[t] != KVMIX_PAYLOAD_NO_ROW;
        }
        for (i = 0; i < nf; i++) {
            res.keys[i] = base.keys[i] - rows[i];
            res.values[i] = test_bits_float(0x7fc00000u); /* NaN: values of the residual unused */
        }
        for (t = 0; t < base.desc.n_tokens; t++)
            if (res.tiers[t] != KVMIX_PAYLOAD_NO_ROW)
                for (i = 0; i < nf / (size_t)base.desc.n_tokens; i++)
                    res.values[(size_t)t * (nf / (size_t)base.desc.n_tokens) + i] = 0.5f;
        pr = pack_case(&res, &nr);
        memcpy(upgraded, rows, nf * sizeof(float));
        memset(decoded_res, 0, nf * sizeof(float));
        CHECK_RESULT(kvmix_payload_unpack(pr, nr, base.desc.first_layer, upgraded, NULL, NULL),
                     KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_payload_unpack(pr, nr, base.desc.first_layer, decoded_res, NULL, NULL),
                     KVMIX_SUCCESS);
        for (t = 0; t < base.desc.n_tokens; t++)
            for (h = 0; h < base.desc.n_kv_heads; h++)
                for (c = 0; c < base.desc.head_dim; c++) {
                    size_t k = ((size_t)t * base.desc.n_kv_heads + h) * base.desc.head_dim + c;
                    if (res.tiers[t] == KVMIX_PAYLOAD_NO_ROW) {
                        CHECK_EQ_FLOAT_BITS(upgraded[k], rows[k]);
                        CHECK_EQ_FLOAT_BITS(decoded_res[k], 0.0f);
                    } else {
                        CHECK_EQ_FLOAT_BITS(upgraded[k], rows[k] + decoded_res[k]);
                        err_base += (rows[k] - base.keys[k]) * (double)(rows[k] - base.keys[k]);
                        err_up +=
                            (upgraded[k] - base.keys[k]) * (double)(upgraded[k] - base.keys[k]);
                    }
                }
        /* INT8 of an INT4 residual: the error of upgraded rows falls by about 2^8 */
        if (n_up > 0)
            CHECK_MSG(err_up * 1000.0 < err_base, "upgrade %g vs base %g", err_up, err_base);
        free(pb);
        free(pr);
        free(rows);
        free(upgraded);
        free(decoded_res);
        free_case(&res);
        free_case(&base);
    }
}

/* One fixed case for the error paths: 2 layers from layer 3, 2 heads, mixed tiers. */
static void fixed_case(test_rng *rng, payload_case *pc) {
    int32_t t;
    do {
        random_case(rng, pc, KVMIX_PAYLOAD_ROWS);
        if (pc->desc.n_tokens >= 6) break;
        free_case(pc);
    } while (1);
    for (t = 0; t < pc->desc.n_tokens; t++) pc->tiers[t] = (uint8_t)TIERS[t % 3];
}

/* read_head refuses the head with `want`, names `field` (the >>transfer layout's name), and
   writes nothing. */
static void check_head_refused(const uint8_t *p, size_t bytes, kvmix_result want, const char *field,
                               const char *what) {
    kvmix_payload_info info;
    const uint8_t *tiers = (const uint8_t *)&info;
    kvmix_error why = {NULL, NULL};
    test_poison(&info, sizeof info, 5);
    test_context("%s", what);
    CHECK_RESULT(kvmix_payload_read_head(p, bytes, &info, &tiers, &why), want);
    CHECK_ERROR(why, want == KVMIX_SUCCESS ? "" : field);
    if (want != KVMIX_SUCCESS) {
        CHECK(test_is_poisoned(&info, sizeof info, 5));
        CHECK(tiers == (const uint8_t *)&info);
    }
}

static void test_bad_heads(void) {
    test_rng rng;
    payload_case pc;
    uint8_t *p, *copy;
    size_t bytes;
    test_rng_init(&rng, "transfer.heads");
    fixed_case(&rng, &pc);
    p = pack_case(&pc, &bytes);
    copy = (uint8_t *)test_alloc(bytes);
#define MUTATE(off, val, want, field, what)                                                        \
    do {                                                                                           \
        memcpy(copy, p, bytes);                                                                    \
        copy[off] = (uint8_t)(val);                                                                \
        check_head_refused(copy, bytes, want, field, what);                                        \
    } while (0)
    MUTATE(0, 'X', KVMIX_ERR_MALFORMED, "magic", "magic");
    MUTATE(4, 2, KVMIX_ERR_VERSION, "version", "version 2");
    MUTATE(6, 3, KVMIX_ERR_INVALID_ARGUMENT, "kind", "kind 3");
    MUTATE(8, 33, KVMIX_ERR_BAD_SHAPE, "head_dim", "head_dim not a multiple of 8");
    MUTATE(15, 0x80, KVMIX_ERR_INVALID_ARGUMENT, "n_kv_heads", "n_kv_heads beyond int32");
    MUTATE(16, 0, KVMIX_ERR_INVALID_ARGUMENT, "group_size", "group_size 0");
    MUTATE(16, 7, KVMIX_ERR_BAD_SHAPE, "group_size", "group_size 7");
    MUTATE(24, 0, KVMIX_ERR_INVALID_ARGUMENT, "n_layers", "n_layers 0");
    MUTATE(28, pc.desc.n_tokens + 16, KVMIX_ERR_MALFORMED, "total_bytes",
           "n_tokens past the table");
    MUTATE(39, 0x80, KVMIX_ERR_INVALID_ARGUMENT, "first_position", "negative first_position");
    MUTATE(48, 1, KVMIX_ERR_INVALID_ARGUMENT, "base_id", "ROWS with a base id");
    MUTATE(56, p[56] + 1, KVMIX_ERR_MALFORMED, "n_fp16", "FP16 count off by one");
    MUTATE(67, 0x80, KVMIX_ERR_INVALID_ARGUMENT, "n_int4", "INT4 count beyond int32");
    MUTATE(68, 1, KVMIX_ERR_MALFORMED, "reserved", "reserved field set");
    MUTATE(72, p[72] ^ 16, KVMIX_ERR_MALFORMED, "total_bytes", "total_bytes off");
    MUTATE(80, KVMIX_FORMAT_INT2, KVMIX_ERR_MALFORMED, "tiers", "INT2 tier");
    MUTATE(80, KVMIX_PAYLOAD_NO_ROW, KVMIX_ERR_MALFORMED, "tiers", "NO_ROW in a ROWS payload");
    MUTATE(80, pc.tiers[1], pc.tiers[0] == pc.tiers[1] ? KVMIX_SUCCESS : KVMIX_ERR_MALFORMED,
           "tiers", "tier table disagreeing with the counts");
    if (pc.desc.n_tokens % 16 != 0)
        MUTATE(80 + pc.desc.n_tokens, 1, KVMIX_ERR_MALFORMED, "tiers", "nonzero table padding");
#undef MUTATE
    check_head_refused(p, 79, KVMIX_ERR_MALFORMED, "src_bytes", "truncated header");
    check_head_refused(p, 80 + (size_t)pc.desc.n_tokens - 1, KVMIX_ERR_MALFORMED, "src_bytes",
                       "truncated tier table");
    check_head_refused(p, bytes, KVMIX_SUCCESS, "", "the whole payload");
    test_context(NULL);
    CHECK_RESULT(kvmix_payload_read_head(NULL, bytes, NULL, NULL, NULL), KVMIX_ERR_NULL_POINTER);
    {
        kvmix_payload_info info;
        kvmix_error why = {NULL, NULL};
        CHECK_RESULT(kvmix_payload_read_head(NULL, bytes, &info, NULL, &why),
                     KVMIX_ERR_NULL_POINTER);
        CHECK_ERROR(why, "src");
        CHECK_RESULT(kvmix_payload_read_head(p, bytes, NULL, NULL, &why), KVMIX_ERR_NULL_POINTER);
        CHECK_ERROR(why, "out_info");
    }
    free(copy);
    free(p);
    free_case(&pc);
}

static void test_bad_bodies(void) {
    test_rng rng;
    payload_case pc;
    uint8_t *p;
    size_t bytes, layer_bytes, i;
    float *out;
    int32_t layer;
    kvmix_error why = {NULL, NULL};
    test_rng_init(&rng, "transfer.bodies");
    fixed_case(&rng, &pc);
    p = pack_case(&pc, &bytes);
    layer = pc.desc.first_layer;
    layer_bytes = pc.n_floats / (size_t)pc.desc.n_layers * sizeof(float);
    out = (float *)test_alloc(layer_bytes);
    test_poison(out, layer_bytes, 3);
    CHECK_RESULT(kvmix_payload_unpack(p, bytes - 1, layer, out, NULL, &why),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_ERROR(why, "src_bytes");
    CHECK_RESULT(kvmix_payload_unpack(p, bytes, layer - 1, out, NULL, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "layer");
    CHECK_RESULT(kvmix_payload_unpack(p, bytes, layer + pc.desc.n_layers, out, NULL, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "layer");
    CHECK_RESULT(kvmix_payload_unpack(p, 79, layer, out, NULL, &why), KVMIX_ERR_MALFORMED);
    CHECK_ERROR(why, "src_bytes"); /* read_head's */
    CHECK(test_is_poisoned(out, layer_bytes, 3));
    /* every byte of the last layer's value blocks flipped in turn: a flip that makes a scale
       negative or a value infinite must be refused with nothing written, keys included */
    for (i = 0; i < 64; i++) {
        size_t off = bytes - 1 - (size_t)test_rng_range(&rng, 0, (int32_t)(bytes / 4));
        uint8_t saved = p[off];
        kvmix_result r;
        p[off] = (uint8_t)(saved ^ 0xfc);
        test_poison(out, layer_bytes, 4);
        why.field = why.reason = NULL;
        r = kvmix_payload_unpack(p, bytes, layer + pc.desc.n_layers - 1, out, NULL, &why);
        CHECK_MSG(r == KVMIX_SUCCESS || r == KVMIX_ERR_CORRUPT_DATA || r == KVMIX_ERR_MALFORMED,
                  "flip at %zu: %s", off, kvmix_result_string(r));
        if (r == KVMIX_SUCCESS) CHECK_ERROR(why, "");
        if (r == KVMIX_ERR_CORRUPT_DATA) CHECK_ERROR(why, "src");
        if (r != KVMIX_SUCCESS) CHECK(test_is_poisoned(out, layer_bytes, 4));
        p[off] = saved;
    }
    free(out);
    free(p);
    free_case(&pc);
}

static void test_bad_packs(void) {
    test_rng rng;
    payload_case pc;
    kvmix_payload_info info;
    kvmix_payload_desc d;
    uint8_t *dst;
    size_t bytes = 0;
    kvmix_error why = {NULL, NULL};
    test_rng_init(&rng, "transfer.packs");
    fixed_case(&rng, &pc);
    CHECK_RESULT(kvmix_payload_describe(&pc.desc, pc.tiers, &info, &why), KVMIX_SUCCESS);
    CHECK_ERROR(why, "");
    dst = (uint8_t *)test_alloc(info.total_bytes);
    test_poison(dst, info.total_bytes, 9);
    CHECK_RESULT(kvmix_payload_pack(&pc.desc, pc.tiers, pc.keys, pc.values, dst,
                                    info.total_bytes - 1, &bytes, &why),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_ERROR(why, "dst_bytes");
    pc.values[pc.n_floats - 1] = 70000.0f;
    CHECK_RESULT(kvmix_payload_pack(&pc.desc, pc.tiers, pc.keys, pc.values, dst, info.total_bytes,
                                    &bytes, &why),
                 KVMIX_ERR_BAD_VALUE);
    CHECK_ERROR(why, "values");
    pc.values[pc.n_floats - 1] = test_bits_float(0x7f800000u);
    CHECK_RESULT(kvmix_payload_pack(&pc.desc, pc.tiers, pc.keys, pc.values, dst, info.total_bytes,
                                    &bytes, &why),
                 KVMIX_ERR_BAD_VALUE);
    CHECK_ERROR(why, "values");
    pc.values[pc.n_floats - 1] = 0.0f;
    CHECK_RESULT(kvmix_payload_pack(&pc.desc, pc.tiers, NULL, pc.values, dst, info.total_bytes,
                                    &bytes, &why),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "keys");
    pc.tiers[0] = KVMIX_PAYLOAD_NO_ROW;
    CHECK_RESULT(kvmix_payload_pack(&pc.desc, pc.tiers, pc.keys, pc.values, dst, info.total_bytes,
                                    &bytes, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "tiers");
    pc.tiers[0] = KVMIX_FORMAT_INT2;
    CHECK_RESULT(kvmix_payload_describe(&pc.desc, pc.tiers, &info, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "tiers");
    pc.tiers[0] = KVMIX_FORMAT_FP16;
    CHECK(test_is_poisoned(dst, info.total_bytes, 9));
    CHECK_EQ_UINT(bytes, 0);
    d = pc.desc;
    d.head_dim = 44;
    CHECK_RESULT(kvmix_payload_describe(&d, pc.tiers, &info, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK_ERROR(why, "head_dim");
    d = pc.desc;
    d.base_id = 1;
    CHECK_RESULT(kvmix_payload_describe(&d, pc.tiers, &info, &why), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "base_id");
    d = pc.desc;
    d.n_layers = 65535;
    d.n_kv_heads = 65535;
    d.head_dim = 512;
    d.n_tokens = 0x7fffffff;
    {
        uint8_t *all = (uint8_t *)test_alloc((size_t)1);
        kvmix_payload_desc big = d;
        big.n_tokens = 1;
        all[0] = KVMIX_FORMAT_FP16;
        CHECK_RESULT(kvmix_payload_describe(&big, all, &info, &why), KVMIX_SUCCESS);
        CHECK_ERROR(why, "");
        free(all);
        big.n_tokens = 1 << 20; /* 2^33 blocks of 2^30 bytes: past 2^62 */
        all = (uint8_t *)test_alloc((size_t)big.n_tokens);
        memset(all, KVMIX_FORMAT_FP16, (size_t)big.n_tokens);
        CHECK_RESULT(kvmix_payload_describe(&big, all, &info, &why), KVMIX_ERR_BAD_SHAPE);
        CHECK_ERROR(why, "n_layers");
        free(all);
    }
    CHECK_RESULT(kvmix_payload_pack(&pc.desc, pc.tiers, pc.keys, pc.values, NULL, info.total_bytes,
                                    &bytes, &why),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "dst");
    d.kind = (kvmix_payload_kind)0;
    CHECK_RESULT(kvmix_payload_describe(&d, pc.tiers, &info, &why), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "kind");
    CHECK_RESULT(kvmix_payload_describe(NULL, pc.tiers, &info, &why), KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "desc");
    /* write_head refuses an info that does not describe these tiers */
    CHECK_RESULT(kvmix_payload_describe(&pc.desc, pc.tiers, &info, &why), KVMIX_SUCCESS);
    CHECK_ERROR(why, "");
    CHECK_RESULT(kvmix_payload_write_head(&info, pc.tiers, dst, info.head_bytes - 1, &why),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_ERROR(why, "dst_bytes");
    CHECK_RESULT(kvmix_payload_write_head(&info, pc.tiers, NULL, info.head_bytes, &why),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "dst");
    info.n_fp16++;
    CHECK_RESULT(kvmix_payload_write_head(&info, pc.tiers, dst, info.total_bytes, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "info");
    CHECK(test_is_poisoned(dst, info.total_bytes - 1, 9));
    info.n_fp16--;
    CHECK_RESULT(kvmix_payload_write_head(&info, pc.tiers, dst, info.total_bytes, &why),
                 KVMIX_SUCCESS);
    CHECK_ERROR(why, "");
    free(dst);
    free_case(&pc);
}

/* The receiver's path: reserve the positions, then unpack and kvmix_cache_write layer by layer;
   the cache holds exactly what the payload decodes to (its FP16 buffer rounds each value). */
static void test_into_cache(void) {
    test_rng rng;
    payload_case pc;
    kvmix_cache cache;
    kvmix_cache_desc cd;
    uint8_t *p;
    size_t bytes, layer_floats;
    int32_t seq, first, layer, t, h, c;
    float *k, *v, *rk, *rv;
    test_rng_init(&rng, "transfer.cache");
    fixed_case(&rng, &pc);
    pc.desc.first_layer = 0;
    p = pack_case(&pc, &bytes);
    memset(&cd, 0, sizeof cd);
    cd.n_layers = pc.desc.n_layers;
    cd.n_kv_heads = pc.desc.n_kv_heads;
    cd.head_dim = pc.desc.head_dim;
    cd.group_size = pc.desc.group_size; /* 16 where 32 does not divide head_dim */
    cd.page_tokens = 16;
    cd.max_seqs = 2;
    cd.max_tokens_per_seq = 256;
    cd.n_window = 256; /* stays FP16: the read-back is the written row rounded to FP16 */
    cd.arena_bytes = 1u << 20;
    CHECK_RESULT(kvmix_cache_init_allocator(&cache, &cd, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_reserve(&cache, seq, pc.desc.n_tokens, NULL, &first), KVMIX_SUCCESS);
    layer_floats = pc.n_floats / (size_t)pc.desc.n_layers;
    k = (float *)test_alloc(layer_floats * sizeof(float));
    v = (float *)test_alloc(layer_floats * sizeof(float));
    rk = (float *)test_alloc((size_t)pc.desc.n_kv_heads * pc.desc.head_dim * sizeof(float));
    rv = (float *)test_alloc((size_t)pc.desc.n_kv_heads * pc.desc.head_dim * sizeof(float));
    for (layer = 0; layer < pc.desc.n_layers; layer++) {
        CHECK_RESULT(kvmix_payload_unpack(p, bytes, layer, k, v, NULL), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_cache_write(&cache, seq, layer, first, pc.desc.n_tokens, k, v),
                     KVMIX_SUCCESS);
        for (t = 0; t < pc.desc.n_tokens; t++) {
            CHECK_RESULT(kvmix_cache_read(&cache, seq, layer, first + t, rk, rv, NULL),
                         KVMIX_SUCCESS);
            for (h = 0; h < pc.desc.n_kv_heads; h++)
                for (c = 0; c < pc.desc.head_dim; c++) {
                    size_t i = (size_t)h * pc.desc.head_dim + c;
                    size_t j = (size_t)t * pc.desc.n_kv_heads * pc.desc.head_dim + i;
                    CHECK_EQ_FLOAT_BITS(rk[i],
                                        (float)test_ref_fp16_value(test_ref_fp32_to_fp16(k[j])));
                    CHECK_EQ_FLOAT_BITS(rv[i],
                                        (float)test_ref_fp16_value(test_ref_fp32_to_fp16(v[j])));
                }
        }
    }
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    free(k);
    free(v);
    free(rk);
    free(rv);
    free(p);
    free_case(&pc);
}

void unit_transfer(void) {
    test_pack_matches_layout();
    test_unpack_rows();
    test_head_dims_of_8();
    test_residual_upgrade();
    test_bad_heads();
    test_bad_bodies();
    test_bad_packs();
    test_into_cache();
}
