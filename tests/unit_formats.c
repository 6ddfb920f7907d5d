/* unit_formats: packed formats against the byte layout and arithmetic documented in kvmix.h's
   >>formats comment. The layout is re-implemented here from that comment (spec_*), so a packed
   block is read without kvmix's own decoder: every code, scale and minimum is checked against
   the documented rules, every element against |x' - x| <= scale / 2, and kvmix's dequantize
   against this file's decoder bit for bit. */
#include "harness.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int32_t HEAD_DIMS[] = {32, 64, 96, 128, 256, 512};
static const int32_t TOKEN_COUNTS[] = {0, 1, 2, 31, 32, 33, 63, 64, 65, 127, 128, 129};
static const int32_t GROUP_SIZES[] = {0, 8, 16, 32, 64}; /* 0 = the default, 32 */
static const kvmix_format ALL_FORMATS[] = {KVMIX_FORMAT_FP16,         KVMIX_FORMAT_INT8,
                                           KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT2,
                                           KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};
#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

static int is_per_token(kvmix_format f) {
    return f == KVMIX_FORMAT_INT8 || f == KVMIX_FORMAT_INT4 || f == KVMIX_FORMAT_INT2;
}

/* ---- the documented layout, re-implemented ------------------------------------------------ */
typedef struct spec {
    kvmix_format format;
    int32_t n, d, g, k, bits, levels;
    size_t row_bytes, high_offset, high_row_bytes, meta_offset, index_offset, total;
} spec;

static spec spec_of(const kvmix_layout *l) {
    spec s;
    size_t n = (size_t)l->n_tokens, d = (size_t)l->head_dim;
    memset(&s, 0, sizeof s);
    s.format = l->format;
    s.n = l->n_tokens;
    s.d = l->head_dim;
    s.g = is_per_token(l->format) ? (l->group_size ? l->group_size : 32) : 0;
    s.k = l->n_boost;
    s.bits = l->format == KVMIX_FORMAT_FP16   ? 16
             : l->format == KVMIX_FORMAT_INT8 ? 8
             : l->format == KVMIX_FORMAT_INT4 ? 4
                                              : 2;
    s.levels = s.bits == 16 ? 0 : (1 << s.bits) - 1;
    s.row_bytes = d * (size_t)s.bits / 8; /* data [n][D*b/8] */
    s.high_offset = n * s.row_bytes;      /* BOOSTED high [n][k/4] */
    s.high_row_bytes = l->format == KVMIX_FORMAT_BOOSTED ? (size_t)s.k / 4 : 0;
    s.meta_offset = s.high_offset + n * s.high_row_bytes;
    if (l->format == KVMIX_FORMAT_FP16)
        s.index_offset = s.meta_offset;
    else if (is_per_token(l->format))
        s.index_offset = s.meta_offset + n * (d / (size_t)s.g) * 4; /* meta [n][D/G] */
    else
        s.index_offset = s.meta_offset + d * 4; /* meta [D] */
    s.total = n ? s.index_offset + (l->format == KVMIX_FORMAT_BOOSTED ? d : 0) : 0;
    return s;
}

/* The size table of kvmix.h's format summary. */
static size_t formula_bytes(kvmix_format f, size_t n, size_t d, size_t g, size_t k) {
    if (n == 0) return 0;
    if (g == 0) g = 32;
    switch (f) {
    case KVMIX_FORMAT_FP16: return 2 * n * d;
    case KVMIX_FORMAT_INT8: return n * d + 4 * n * (d / g);
    case KVMIX_FORMAT_INT4: return n * d / 2 + 4 * n * (d / g);
    case KVMIX_FORMAT_INT2: return n * d / 4 + 4 * n * (d / g);
    case KVMIX_FORMAT_INT2_CHANNEL: return n * d / 4 + 4 * d;
    case KVMIX_FORMAT_BOOSTED: return n * d / 4 + n * k / 4 + 5 * d;
    }
    return 0;
}

static uint16_t load16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static uint32_t get_code(const uint8_t *row, int32_t c, int bits) {
    int per_byte = 8 / bits;
    return (uint32_t)(row[c / per_byte] >> ((c % per_byte) * bits)) & ((1u << bits) - 1u);
}

typedef struct elem {
    uint32_t q;
    int levels;
    uint16_t scale_h, min_h;
} elem;

/* Code and parameters of element (t, c) of an integer block. */
static elem spec_elem(const spec *s, const uint8_t *b, int32_t t, int32_t c) {
    elem e;
    const uint8_t *meta;
    if (is_per_token(s->format)) {
        e.q = get_code(b + (size_t)t * s->row_bytes, c, s->bits);
        e.levels = s->levels;
        meta = b + s->meta_offset + ((size_t)t * (size_t)(s->d / s->g) + (size_t)(c / s->g)) * 4;
    } else {
        e.q = get_code(b + (size_t)t * s->row_bytes, c, 2);
        e.levels = 3;
        if (s->format == KVMIX_FORMAT_BOOSTED && b[s->index_offset + c] != KVMIX_BOOST_NONE) {
            e.q |= get_code(b + s->high_offset + (size_t)t * s->high_row_bytes,
                            b[s->index_offset + c], 2)
                   << 2;
            e.levels = 15;
        }
        meta = b + s->meta_offset + (size_t)c * 4;
    }
    e.scale_h = load16(meta);
    e.min_h = load16(meta + 2);
    return e;
}

/* x' of element (t, c): FP16 value, or (float)q * scale + min with two float roundings. */
static float spec_decode(const spec *s, const uint8_t *b, int32_t t, int32_t c) {
    elem e;
    float scaled;
    if (s->format == KVMIX_FORMAT_FP16)
        return (float)test_ref_fp16_value(load16(b + ((size_t)t * (size_t)s->d + (size_t)c) * 2));
    e = spec_elem(s, b, t, c);
    scaled = (float)e.q * (float)test_ref_fp16_value(e.scale_h);
    return scaled + (float)test_ref_fp16_value(e.min_h);
}

/* ---- failure collection for checks over many elements ------------------------------------- */
typedef struct findings {
    long count;
    char first[400];
} findings;

static void finding(findings *f, const char *fmt, ...) TEST_PRINTF(2, 3);
static void finding(findings *f, const char *fmt, ...) {
    if (f->count++ == 0) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(f->first, sizeof f->first, fmt, args);
        va_end(args);
    }
}

/* ---- quantization rules of one group (per-token) or channel (per-channel) ------------------ */
static uint16_t half_next_up(uint16_t h) {
    if (h == 0x0000u || h == 0x8000u) return 0x0001u;
    return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

/* x[i], code q[i] and decoded dec[i] for i < count, all quantized with one (scale, min). */
static void check_unit(findings *f, const char *where, const float *x, const uint32_t *q,
                       const float *dec, int32_t count, uint16_t scale_h, uint16_t min_h,
                       int levels, unsigned grid) {
    double scale = test_ref_fp16_value(scale_h), min = test_ref_fp16_value(min_h), eps;
    float lo = x[0], hi = x[0], scale_f = (float)scale, min_f = (float)min;
    uint16_t h, h0;
    int32_t i;
    for (i = 1; i < count; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
    }
    if (!(scale >= 0.0) || (scale_h & 0x8000u) || !isfinite(scale) || !isfinite(min)) {
        finding(f, "%s: scale 0x%04x / min 0x%04x not finite and non-negative", where, scale_h,
                min_h);
        return;
    }
    /* min = fp16 of the smallest value rounded toward -infinity: the largest half <= lo */
    if (!(min <= (double)lo) || !(test_ref_fp16_value(half_next_up(min_h)) > (double)lo))
        finding(f, "%s: min 0x%04x (%.9g) is not the largest half <= %.9g", where, min_h, min,
                (double)lo);
    /* every value lies in [min, min + L * scale] (exact, in double) */
    if (!(scale * levels + min >= (double)hi))
        finding(f, "%s: min %.9g + %d * scale %.9g < max %.9g", where, min, levels, scale,
                (double)hi);
    /* scale = fp16((hi - min) / L) rounded up to the grid, raised one grid step at a time only
       while the range is short; on the grid, q * scale is exact in fp16 for every code q */
    h0 = test_ref_fp32_to_fp16((hi - min_f) / (float)levels);
    h0 = (uint16_t)((h0 + grid - 1u) / grid * grid);
    if (scale_h % grid != 0)
        finding(f, "%s: scale 0x%04x is not a multiple of %u fp16 steps", where, scale_h, grid);
    if (scale_h < h0)
        finding(f, "%s: scale 0x%04x below fp16 of (max - min) / L on the grid = 0x%04x", where,
                scale_h, h0);
    for (i = 0; grid > 1 && i <= levels && i * scale <= 65504.0; i++)
        if (test_ref_fp16_value(test_ref_fp32_to_fp16((float)(i * scale))) != i * scale) {
            finding(f, "%s: code %d * scale %.9g is not exact in fp16", where, (int)i, scale);
            break;
        }
    for (h = h0; h < scale_h && h < 0x7c00u; h = (uint16_t)(h + grid))
        if (test_ref_fp16_value(h) * levels + min >= (double)hi) {
            finding(f, "%s: scale 0x%04x raised beyond 0x%04x, which already covers max %.9g",
                    where, scale_h, h, (double)hi);
            break;
        }
    /* codes: rint((x - min) / scale) in float, clamped; error <= scale / 2 up to float rounding */
    eps = ldexp(scale * levels + fabs(min), -21);
    for (i = 0; i < count; i++) {
        uint32_t want = 0;
        if (scale_h != 0) {
            float diff = x[i] - min_f;
            float r = rintf(diff / scale_f);
            if (r < 0.0f) r = 0.0f;
            if (r > (float)levels) r = (float)levels;
            want = (uint32_t)r;
        }
        if (q[i] != want) {
            finding(f, "%s: element %d: x %.9g gives code %lu, expected %lu (scale %.9g, min %.9g)",
                    where, (int)i, (double)x[i], (unsigned long)q[i], (unsigned long)want, scale,
                    min);
            return;
        }
        if (!(fabs((double)dec[i] - (double)x[i]) <= scale / 2 + eps + ldexp(fabs(x[i]), -21))) {
            finding(f, "%s: element %d: |%.9g - %.9g| = %.3g > scale/2 %.3g", where, (int)i,
                    (double)dec[i], (double)x[i], fabs((double)dec[i] - (double)x[i]), scale / 2);
            return;
        }
    }
    /* a constant group of a representable value is stored exactly, with scale 0 */
    if (lo == hi && test_ref_fp16_value(test_ref_fp32_to_fp16(lo)) == (double)lo) {
        if (scale_h != 0)
            finding(f, "%s: constant %.9g has scale 0x%04x, not 0", where, (double)lo, scale_h);
        for (i = 0; i < count; i++)
            if (dec[i] != x[i]) {
                finding(f, "%s: constant %.9g decodes to %.9g", where, (double)x[i],
                        (double)dec[i]);
                break;
            }
    }
}

/* Boosted channels: the k of largest float sum over tokens of |x|, ties to the lower channel;
   slots in increasing channel order. Fills want_slot[c] (KVMIX_BOOST_NONE when not boosted). */
static void spec_boost_slots(const float *x, int32_t stride, int32_t n, int32_t d, int32_t k,
                             uint8_t *want_slot) {
    float score[KVMIX_MAX_HEAD_DIM];
    int32_t c, c2, t, slot = 0;
    for (c = 0; c < d; c++) {
        score[c] = 0.0f;
        for (t = 0; t < n; t++) score[c] += fabsf(x[(size_t)t * stride + c]);
    }
    for (c = 0; c < d; c++) {
        int32_t rank = 0; /* channels that beat c */
        for (c2 = 0; c2 < d; c2++)
            if (score[c2] > score[c] || (score[c2] == score[c] && c2 < c)) rank++;
        want_slot[c] = rank < k ? (uint8_t)slot++ : (uint8_t)KVMIX_BOOST_NONE;
    }
}

/* All documented properties of block `b` quantized from x [n][stride]. */
static void check_block(findings *f, const kvmix_layout *l, const float *x, int32_t stride,
                        const uint8_t *b) {
    spec s = spec_of(l);
    int32_t t, c, g;
    char where[96];
    if (s.n == 0) return;
    if (s.format == KVMIX_FORMAT_FP16) {
        for (t = 0; t < s.n; t++)
            for (c = 0; c < s.d; c++) {
                float v = x[(size_t)t * stride + c];
                uint16_t got = load16(b + ((size_t)t * (size_t)s.d + (size_t)c) * 2);
                if (got != test_ref_fp32_to_fp16(v)) {
                    finding(f, "FP16 token %d channel %d: %.9g stored as 0x%04x, expected 0x%04x",
                            (int)t, (int)c, (double)v, got, test_ref_fp32_to_fp16(v));
                    return;
                }
            }
        return;
    }
    if (is_per_token(s.format)) {
        float xs[KVMIX_MAX_HEAD_DIM], dec[KVMIX_MAX_HEAD_DIM];
        uint32_t q[KVMIX_MAX_HEAD_DIM];
        for (t = 0; t < s.n; t++)
            for (g = 0; g < s.d / s.g; g++) {
                elem e0 = spec_elem(&s, b, t, g * s.g);
                for (c = 0; c < s.g; c++) {
                    xs[c] = x[(size_t)t * stride + g * s.g + c];
                    q[c] = spec_elem(&s, b, t, g * s.g + c).q;
                    dec[c] = spec_decode(&s, b, t, g * s.g + c);
                }
                snprintf(where, sizeof where, "token %d group %d", (int)t, (int)g);
                check_unit(f, where, xs, q, dec, s.g, e0.scale_h, e0.min_h, s.levels,
                           s.bits == 2   ? 4u
                           : s.bits == 4 ? 16u
                                         : 1u);
            }
        return;
    }
    {
        uint8_t want_slot[KVMIX_MAX_HEAD_DIM];
        float *xs = (float *)test_alloc(sizeof(float) * (size_t)s.n);
        float *dec = (float *)test_alloc(sizeof(float) * (size_t)s.n);
        uint32_t *q = (uint32_t *)test_alloc(sizeof(uint32_t) * (size_t)s.n);
        if (s.format == KVMIX_FORMAT_BOOSTED) {
            spec_boost_slots(x, stride, s.n, s.d, s.k, want_slot);
            for (c = 0; c < s.d; c++)
                if (b[s.index_offset + c] != want_slot[c]) {
                    finding(f, "boost index of channel %d is 0x%02x, expected 0x%02x", (int)c,
                            b[s.index_offset + c], want_slot[c]);
                    break;
                }
            /* high bits of unused positions (none: k is a multiple of 4) and padding are 0 */
        }
        for (c = 0; c < s.d; c++) {
            elem e0 = spec_elem(&s, b, 0, c);
            for (t = 0; t < s.n; t++) {
                xs[t] = x[(size_t)t * stride + c];
                q[t] = spec_elem(&s, b, t, c).q;
                dec[t] = spec_decode(&s, b, t, c);
            }
            snprintf(where, sizeof where, "channel %d (%s)", (int)c,
                     e0.levels == 15 ? "boosted" : "2-bit");
            check_unit(f, where, xs, q, dec, s.n, e0.scale_h, e0.min_h, e0.levels, 1u);
        }
        free(xs);
        free(dec);
        free(q);
    }
}

/* ---- realistic data ------------------------------------------------------------------------ */
enum {
    FEATURE_CONSTANT,
    FEATURE_NEGATIVE,
    FEATURE_TINY,
    FEATURE_POSITIVE,
    FEATURE_EXTREME,
    FEATURE_ZERO,
    N_FEATURES
};

/* x [n][stride]: channels with offsets, a few high-magnitude channels, rare outliers, and groups
   (group > 0: token t's channels g*group..; group 0: whole channels) that are constant,
   negative-only, tiny (fp16 subnormal range), positive-only, at the fp16 limits or zero.
   Padding columns are NaN: they must never be read. */
static void gen_data(test_rng *rng, float *x, int32_t n, int32_t d, int32_t stride, int32_t group) {
    double scale = ldexp(1.0, test_rng_range(rng, -8, 3));
    double mean[KVMIX_MAX_HEAD_DIM], sigma[KVMIX_MAX_HEAD_DIM];
    int32_t t, c, i, n_units, unit_len;
    for (c = 0; c < d; c++) {
        int hot = test_rng_range(rng, 0, 15) == 0;
        sigma[c] = hot ? 8.0 + 40.0 * test_rng_unit(rng) : 0.5 + test_rng_unit(rng);
        mean[c] = (hot ? 4.0 : 0.3) * test_rng_normal(rng);
    }
    for (t = 0; t < n; t++) {
        for (c = 0; c < d; c++) {
            double v = (mean[c] + sigma[c] * test_rng_normal(rng)) * scale;
            if (test_rng_range(rng, 0, 511) == 0) /* outlier */
                v = (test_rng_u32(rng) & 1 ? 1 : -1) * (100.0 + 900.0 * test_rng_unit(rng)) *
                    scale * 4;
            if (v > 60000.0) v = 60000.0;
            if (v < -60000.0) v = -60000.0;
            x[(size_t)t * stride + c] = (float)v;
        }
        for (c = d; c < stride; c++) x[(size_t)t * stride + c] = NAN;
    }
    if (n == 0) return;
    unit_len = group ? group : n;
    n_units = group ? n * (d / group) : d;
    for (i = 0; i < n_units / 6 + 1; i++) {
        int32_t u = test_rng_range(rng, 0, n_units - 1), j;
        int feature = test_rng_range(rng, 0, N_FEATURES - 1);
        float constant = (float)(test_rng_normal(rng) * scale * 4);
        int32_t tiny_exp = test_rng_range(rng, 14, 26);
        if (test_rng_u32(rng) & 1)
            constant = (float)test_ref_fp16_value(test_ref_fp32_to_fp16(constant));
        for (j = 0; j < unit_len; j++) {
            float *p = group
                           ? &x[(size_t)(u / (d / group)) * stride + (u % (d / group)) * group + j]
                           : &x[(size_t)j * stride + u];
            switch (feature) {
            case FEATURE_CONSTANT: *p = constant; break;
            case FEATURE_NEGATIVE: *p = -fabsf(*p); break;
            case FEATURE_TINY: *p = (float)ldexp(test_rng_normal(rng), -tiny_exp); break;
            case FEATURE_POSITIVE: *p = fabsf(*p) + (float)(10.0 * scale); break;
            case FEATURE_EXTREME:
                *p = (float)((test_rng_u32(rng) & 1 ? 1 : -1) *
                             (test_rng_u32(rng) & 1 ? 65504.0
                                                    : 30000.0 + 35504.0 * test_rng_unit(rng)));
                break;
            default: *p = (test_rng_u32(rng) & 1) ? 0.0f : -0.0f; break;
            }
            if (*p > 65504.0f) *p = 65504.0f; /* features may stack on one unit */
            if (*p < -65504.0f) *p = -65504.0f;
        }
    }
}

/* ---- round trip over every shape ---------------------------------------------------------- */
static void roundtrip_case(test_rng *rng, kvmix_format format, int32_t d, int32_t n, int32_t g,
                           int32_t k) {
    kvmix_layout l = test_layout(format, n, d, g, k), resolved = l;
    spec s = spec_of(&l);
    int32_t stride = d + ((test_rng_u32(rng) & 1) ? test_rng_range(rng, 1, 9) : 0);
    int32_t dst_stride = d + ((test_rng_u32(rng) & 1) ? test_rng_range(rng, 1, 5) : 0);
    size_t bytes = 12345, n_src = (size_t)n * (size_t)stride,
           n_dst = (size_t)n * (size_t)dst_stride;
    float *x, *compact, *dst, *dst_before, *row;
    uint8_t *packed, *packed_compact, *exact;
    findings f;
    int32_t t, c;
    test_context("round trip %s D=%d n=%d G=%d k=%d stride=%d", kvmix_format_name(format), (int)d,
                 (int)n, (int)g, (int)k, (int)stride);
    if (!CHECK_RESULT(kvmix_layout_resolve(&resolved, NULL), KVMIX_SUCCESS)) return;
    CHECK_EQ_INT(resolved.group_size, is_per_token(format) ? (g ? g : 32) : 0);
    if (!CHECK_RESULT(kvmix_layout_bytes(&l, &bytes), KVMIX_SUCCESS)) return;
    CHECK_EQ_UINT(bytes, formula_bytes(format, (size_t)n, (size_t)d, (size_t)g, (size_t)k));
    CHECK_EQ_UINT(bytes, s.total);

    x = (float *)test_alloc(sizeof(float) * n_src);
    compact = (float *)test_alloc(sizeof(float) * (size_t)n * (size_t)d);
    gen_data(rng, x, n, d, stride,
             is_per_token(format)          ? s.g
             : format == KVMIX_FORMAT_FP16 ? (d % 32 == 0 ? 32 : 8)
                                           : 0);
    for (t = 0; t < n; t++)
        memcpy(compact + (size_t)t * d, x + (size_t)t * stride, sizeof(float) * (size_t)d);

    /* quantize into a larger buffer: nothing past the block's bytes is written */
    packed = (uint8_t *)test_alloc(bytes + 64);
    test_poison(packed, bytes, 1);
    test_poison(packed + bytes, 64, 2);
    CHECK_RESULT(kvmix_ref_quantize(&l, x, stride, packed, bytes + 64), KVMIX_SUCCESS);
    CHECK_MSG(test_is_poisoned(packed + bytes, 64, 2),
              "quantize writes nothing past kvmix_layout_bytes (%zu)", bytes);
    /* the same rows without padding, into an exact-size buffer, give the same bytes */
    packed_compact = (uint8_t *)test_alloc(bytes);
    CHECK_RESULT(kvmix_ref_quantize(&l, compact, 0, packed_compact, bytes), KVMIX_SUCCESS);
    CHECK_MEM_EQ(packed_compact, packed, bytes);

    memset(&f, 0, sizeof f);
    check_block(&f, &l, x, stride, packed);
    CHECK_MSG(f.count == 0, "packed block follows the documented rules (%ld findings; first: %s)",
              f.count, f.first);

    /* dequantize from an exact-size copy with padded rows: padding untouched, every element
       equal to this file's decoder */
    exact = (uint8_t *)test_alloc(bytes);
    memcpy(exact, packed, bytes);
    dst = (float *)test_alloc(sizeof(float) * (n_dst ? n_dst : 1));
    dst_before = (float *)test_alloc(sizeof(float) * (n_dst ? n_dst : 1));
    test_poison(dst, sizeof(float) * n_dst, 3);
    memcpy(dst_before, dst, sizeof(float) * n_dst);
    if (CHECK_RESULT(kvmix_ref_dequantize(&l, exact, bytes, dst, dst_stride), KVMIX_SUCCESS)) {
        long bad = 0, pad = 0;
        for (t = 0; t < n; t++) {
            for (c = 0; c < d; c++) {
                float want = spec_decode(&s, packed, t, c);
                if (test_float_bits(dst[(size_t)t * dst_stride + c]) != test_float_bits(want) &&
                    bad++ == 0)
                    CHECK_MSG(0, "dequantize token %d channel %d: %.9g, documented decode %.9g",
                              (int)t, (int)c, (double)dst[(size_t)t * dst_stride + c],
                              (double)want);
            }
            if (memcmp(dst + (size_t)t * dst_stride + d, dst_before + (size_t)t * dst_stride + d,
                       sizeof(float) * (size_t)(dst_stride - d)) != 0)
                pad++;
        }
        CHECK_MSG(bad == 0, "dequantize equals the documented decode (%ld elements differ)", bad);
        CHECK_MSG(pad == 0, "dequantize leaves row padding untouched (%ld rows written)", pad);
    }
    /* row_stride 0 = head_dim */
    if (n > 0) {
        float *dense = (float *)test_alloc(sizeof(float) * (size_t)n * (size_t)d);
        if (CHECK_RESULT(kvmix_ref_dequantize(&l, exact, bytes, dense, 0), KVMIX_SUCCESS))
            for (t = 0; t < n; t++)
                if (!CHECK_MEM_EQ(dense + (size_t)t * d, dst + (size_t)t * dst_stride,
                                  sizeof(float) * (size_t)d))
                    break;
        free(dense);
    }
    /* dequantize_row equals that row of dequantize */
    row = (float *)test_alloc(sizeof(float) * (size_t)d);
    for (t = 0; t < n; t++) {
        if (n > 40 && t > 2 && t < n - 3 && (t % 17) != 0) continue;
        if (!CHECK_RESULT(kvmix_ref_dequantize_row(&l, exact, bytes, t, row), KVMIX_SUCCESS)) break;
        if (!CHECK_MEM_EQ(row, dst + (size_t)t * dst_stride, sizeof(float) * (size_t)d)) break;
    }
    free(row);
    free(x);
    free(compact);
    free(dst);
    free(dst_before);
    free(packed);
    free(packed_compact);
    free(exact);
    test_context(NULL);
}

static void test_roundtrip_all_shapes(void) {
    test_rng rng;
    size_t fi, di, ni, gi;
    test_rng_init(&rng, "formats/roundtrip");
    for (fi = 0; fi < N_ELEMS(ALL_FORMATS); fi++)
        for (di = 0; di < N_ELEMS(HEAD_DIMS); di++)
            for (ni = 0; ni < N_ELEMS(TOKEN_COUNTS); ni++) {
                kvmix_format f = ALL_FORMATS[fi];
                int32_t d = HEAD_DIMS[di], n = TOKEN_COUNTS[ni];
                if (is_per_token(f)) {
                    for (gi = 0; gi < N_ELEMS(GROUP_SIZES); gi++)
                        if (GROUP_SIZES[gi] == 0 || d % GROUP_SIZES[gi] == 0)
                            roundtrip_case(&rng, f, d, n, GROUP_SIZES[gi], 0);
                } else if (f == KVMIX_FORMAT_BOOSTED) {
                    int32_t boosts[5], nb = 0, i, j;
                    int32_t candidates[5];
                    candidates[0] = 0;
                    candidates[1] = 4;
                    candidates[2] = 8;
                    candidates[3] = d / 8;
                    candidates[4] = d / 4;
                    for (i = 0; i < 5; i++) {
                        int seen = 0;
                        for (j = 0; j < nb; j++) seen |= boosts[j] == candidates[i];
                        if (!seen) boosts[nb++] = candidates[i];
                    }
                    for (i = 0; i < nb; i++) roundtrip_case(&rng, f, d, n, 0, boosts[i]);
                } else {
                    roundtrip_case(&rng, f, d, n, 0, 0);
                }
            }
    /* the largest boost count: 252 slots (255 is KVMIX_BOOST_NONE) */
    roundtrip_case(&rng, KVMIX_FORMAT_BOOSTED, 256, 33, 0, 252);
    roundtrip_case(&rng, KVMIX_FORMAT_BOOSTED, 512, 17, 0, 252);
    roundtrip_case(&rng, KVMIX_FORMAT_BOOSTED, 32, 9, 0, 32); /* every channel boosted */
}

/* head_dims that are multiples of 8 but not of 32 (48, 80, as 96 is not of 64): every format,
   with each group that divides them; the default group of 32 does not divide 48 or 80. */
static void test_roundtrip_head_dims_of_8(void) {
    static const int32_t dims[] = {8, 48, 80, 96};
    static const int32_t counts[] = {1, 17, 32};
    static const kvmix_format per_token[] = {KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4,
                                             KVMIX_FORMAT_INT2};
    test_rng rng;
    size_t di, ni, fi;
    test_rng_init(&rng, "formats/head dims of 8");
    for (di = 0; di < N_ELEMS(dims); di++)
        for (ni = 0; ni < N_ELEMS(counts); ni++) {
            int32_t d = dims[di], n = counts[ni], g, k;
            kvmix_layout l = test_layout(KVMIX_FORMAT_INT8, n, d, 0, 0);
            CHECK_RESULT(kvmix_layout_resolve(&l, NULL),
                         d % 32 == 0 ? KVMIX_SUCCESS : KVMIX_ERR_BAD_SHAPE);
            roundtrip_case(&rng, KVMIX_FORMAT_FP16, d, n, 0, 0);
            roundtrip_case(&rng, KVMIX_FORMAT_INT2_CHANNEL, d, n, 0, 0);
            for (k = 0; k <= 8 && k <= d; k += 4)
                roundtrip_case(&rng, KVMIX_FORMAT_BOOSTED, d, n, 0, k);
            for (fi = 0; fi < N_ELEMS(per_token); fi++)
                for (g = 8; g <= d; g += 8)
                    if (d % g == 0 && (g <= 16 || g == d))
                        roundtrip_case(&rng, per_token[fi], d, n, g, 0);
        }
}

/* ---- sizes and bits ------------------------------------------------------------------------ */
static void test_sizes_and_bits(void) {
    static const struct {
        kvmix_format format;
        int32_t n, d, g, k;
        double bits;
    } cases[] = {
        {KVMIX_FORMAT_FP16, 128, 128, 0, 0, 16.0},
        {KVMIX_FORMAT_INT8, 128, 128, 32, 0, 9.0},         /* 8 + 32 bits per 32 channels */
        {KVMIX_FORMAT_INT8, 128, 128, 0, 0, 9.0},          /* G = 0 is 32 */
        {KVMIX_FORMAT_INT4, 128, 128, 32, 0, 5.0},         /* 4 + 1 */
        {KVMIX_FORMAT_INT2, 128, 128, 32, 0, 3.0},         /* 2 + 1 */
        {KVMIX_FORMAT_INT2, 128, 128, 64, 0, 2.5},         /* 2 + 0.5 */
        {KVMIX_FORMAT_INT2, 1, 128, 8, 0, 6.0},            /* 2 + 4 */
        {KVMIX_FORMAT_INT2_CHANNEL, 128, 128, 0, 0, 2.25}, /* 2 + 32 * 128 / (128 * 128) */
        {KVMIX_FORMAT_INT2_CHANNEL, 64, 128, 0, 0, 2.5},   /* 2 + 32 * 128 / (64 * 128) */
        {KVMIX_FORMAT_BOOSTED, 128, 128, 0, 16, 2.5625},   /* 2 + 16*2/128 + 40/128 */
        {KVMIX_FORMAT_BOOSTED, 128, 128, 0, 32, 2.8125},   /* 2 + 32*2/128 + 40/128 */
        {KVMIX_FORMAT_BOOSTED, 128, 128, 0, 0, 2.3125},    /* 2 + 40/128 */
        {KVMIX_FORMAT_BOOSTED, 1, 32, 0, 4, 42.25},        /* (8 + 1 + 160) * 8 / 32 */
    };
    size_t i;
    for (i = 0; i < N_ELEMS(cases); i++) {
        kvmix_layout l =
            test_layout(cases[i].format, cases[i].n, cases[i].d, cases[i].g, cases[i].k);
        double bits = -1.0;
        test_context("bits %s n=%d D=%d G=%d k=%d", kvmix_format_name(l.format), (int)l.n_tokens,
                     (int)l.head_dim, (int)l.group_size, (int)l.n_boost);
        CHECK_RESULT(kvmix_layout_bits(&l, &bits), KVMIX_SUCCESS);
        CHECK_MSG(bits == cases[i].bits, "kvmix_layout_bits = %.17g, expected exactly %.17g", bits,
                  cases[i].bits);
    }
    test_context(NULL);
    /* n_tokens 0: no bits per element; the output is not written */
    {
        kvmix_layout l = test_layout(KVMIX_FORMAT_INT4, 0, 64, 0, 0);
        double bits = 7.0;
        size_t bytes = 99;
        CHECK_RESULT(kvmix_layout_bits(&l, &bits), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK(bits == 7.0);
        CHECK_RESULT(kvmix_layout_bytes(&l, &bytes), KVMIX_SUCCESS);
        CHECK_EQ_UINT(bytes, 0);
        CHECK_RESULT(kvmix_layout_bits(NULL, &bits), KVMIX_ERR_NULL_POINTER);
        l.n_tokens = 4;
        CHECK_RESULT(kvmix_layout_bits(&l, NULL), KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_layout_bytes(&l, NULL), KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_layout_bytes(NULL, &bytes), KVMIX_ERR_NULL_POINTER);
        CHECK_EQ_UINT(bytes, 0);
        l.head_dim = 33;
        CHECK_RESULT(kvmix_layout_bits(&l, &bits), KVMIX_ERR_BAD_SHAPE);
        CHECK_RESULT(kvmix_layout_bytes(&l, &bytes), KVMIX_ERR_BAD_SHAPE);
        CHECK(bits == 7.0);
        CHECK_EQ_UINT(bytes, 0);
    }
    /* large blocks: sizes are size_t arithmetic (no int overflow) */
    {
        kvmix_layout l = test_layout(KVMIX_FORMAT_FP16, INT32_MAX, 512, 0, 0);
        size_t bytes = 0;
        CHECK_RESULT(kvmix_layout_bytes(&l, &bytes), KVMIX_SUCCESS);
        CHECK_EQ_UINT(bytes, (size_t)2 * 512 * (size_t)INT32_MAX);
        l = test_layout(KVMIX_FORMAT_BOOSTED, INT32_MAX, 512, 0, 252);
        CHECK_RESULT(kvmix_layout_bytes(&l, &bytes), KVMIX_SUCCESS);
        CHECK_EQ_UINT(bytes, formula_bytes(l.format, (size_t)INT32_MAX, 512, 0, 252));
    }
}

/* ---- golden vectors ------------------------------------------------------------------------ */
/* Quantizes src with `l` and compares with bytes worked out by hand; then dequantizes the hand
   bytes and compares with this file's decoder. */
static void golden(const char *name, kvmix_layout l, const float *src, const uint8_t *want,
                   size_t want_bytes) {
    size_t bytes = 0;
    uint8_t *got;
    float *dec;
    spec s = spec_of(&l);
    int32_t t, c;
    test_context("golden %s", name);
    CHECK_RESULT(kvmix_layout_bytes(&l, &bytes), KVMIX_SUCCESS);
    if (!CHECK_EQ_UINT(bytes, want_bytes)) return;
    got = (uint8_t *)test_alloc(bytes);
    test_poison(got, bytes, 4);
    CHECK_RESULT(kvmix_ref_quantize(&l, src, 0, got, bytes), KVMIX_SUCCESS);
    CHECK_MEM_EQ(got, want, bytes);
    dec = (float *)test_alloc(sizeof(float) * (size_t)l.n_tokens * (size_t)l.head_dim);
    memcpy(got, want, bytes);
    if (CHECK_RESULT(kvmix_ref_dequantize(&l, got, bytes, dec, 0), KVMIX_SUCCESS)) {
        long bad = 0;
        for (t = 0; t < l.n_tokens; t++)
            for (c = 0; c < l.head_dim; c++)
                bad += test_float_bits(dec[(size_t)t * l.head_dim + c]) !=
                       test_float_bits(spec_decode(&s, want, t, c));
        CHECK_MSG(bad == 0,
                  "dequantize of the hand bytes equals the documented decode (%ld differ)", bad);
    }
    free(got);
    free(dec);
    test_context(NULL);
}

/* The expected bytes below are laid out by hand (rows, sections); keep them that way. */
/* clang-format off */
/* FP16, D = 32, 2 tokens: [n][D] little-endian halves.
   token 0, channel c holds 1 + c/1024 (half 0x3C00 + c) except:
     c1  -2            -> 0xC000          c2  65504         -> 0x7BFF (largest)
     c3  2^-24         -> 0x0001          c4  -0.0          -> 0x8000
     c5  0.1f: 0.1 * 2^14 = 1638.4 -> 1638 = 1024 + 0x266, exponent 2^-4 (11) -> 0x2E66
     c6  1/3f: 0.3333 * 2^12 = 1365.33 -> 1365 = 1024 + 0x155, exponent 2^-2 (13) -> 0x3555
     c7  1 + 2^-11: halfway between 0x3C00 and 0x3C01, even -> 0x3C00
     c8  1 + 3*2^-11: halfway between 0x3C01 and 0x3C02, even -> 0x3C02
     c9  2^-25: halfway between 0 and 2^-24, even -> 0x0000
     c10 3*2^-25 = 1.5 units of 2^-24: even -> 2 units -> 0x0002
     c11 -65500: nearest half -65504 (spacing 32) -> 0xFBFF
     c12 2^-14 (smallest normal) -> 0x0400
     c13 1 - 2^-12: halfway between 0x3BFF and 0x3C00, even -> 0x3C00
   token 1, channel c holds -(1 + c/1024) -> 0xBC00 + c. */
static void golden_fp16(void) {
    static const uint8_t want[128] = {
        0x00, 0x3c, 0x00, 0xc0, 0xff, 0x7b, 0x01, 0x00, 0x00, 0x80, 0x66, 0x2e, 0x55, 0x35,
        0x00, 0x3c, 0x02, 0x3c, 0x00, 0x00, 0x02, 0x00, 0xff, 0xfb, 0x00, 0x04, 0x00, 0x3c,
        0x0e, 0x3c, 0x0f, 0x3c, 0x10, 0x3c, 0x11, 0x3c, 0x12, 0x3c, 0x13, 0x3c, 0x14, 0x3c,
        0x15, 0x3c, 0x16, 0x3c, 0x17, 0x3c, 0x18, 0x3c, 0x19, 0x3c, 0x1a, 0x3c, 0x1b, 0x3c,
        0x1c, 0x3c, 0x1d, 0x3c, 0x1e, 0x3c, 0x1f, 0x3c,
        /* token 1 */
        0x00, 0xbc, 0x01, 0xbc, 0x02, 0xbc, 0x03, 0xbc, 0x04, 0xbc, 0x05, 0xbc, 0x06, 0xbc,
        0x07, 0xbc, 0x08, 0xbc, 0x09, 0xbc, 0x0a, 0xbc, 0x0b, 0xbc, 0x0c, 0xbc, 0x0d, 0xbc,
        0x0e, 0xbc, 0x0f, 0xbc, 0x10, 0xbc, 0x11, 0xbc, 0x12, 0xbc, 0x13, 0xbc, 0x14, 0xbc,
        0x15, 0xbc, 0x16, 0xbc, 0x17, 0xbc, 0x18, 0xbc, 0x19, 0xbc, 0x1a, 0xbc, 0x1b, 0xbc,
        0x1c, 0xbc, 0x1d, 0xbc, 0x1e, 0xbc, 0x1f, 0xbc};
    float x[2 * 32];
    int c;
    for (c = 0; c < 32; c++) {
        x[c] = 1.0f + (float)c / 1024.0f;
        x[32 + c] = -(1.0f + (float)c / 1024.0f);
    }
    x[1] = -2.0f;
    x[2] = 65504.0f;
    x[3] = 0x1p-24f;
    x[4] = -0.0f;
    x[5] = 0.1f;
    x[6] = 1.0f / 3.0f;
    x[7] = 1.0f + 0x1p-11f;
    x[8] = 1.0f + 3 * 0x1p-11f;
    x[9] = 0x1p-25f;
    x[10] = 3 * 0x1p-25f;
    x[11] = -65500.0f;
    x[12] = 0x1p-14f;
    x[13] = 1.0f - 0x1p-12f;
    golden("FP16 D=32 n=2", test_layout(KVMIX_FORMAT_FP16, 2, 32, 0, 0), x, want, sizeof want);
}

/* INT8, D = 32, G = 8, 2 tokens: data [2][32] codes, then meta [2][4] (scale, min).
   token 0
     group 0: -1 + k/128 for k = 0, 255, 1, 2.5, 3.5, 100, 128, 254.
              min -1 (0xBC00); (0.9921875 + 1) / 255 = 2^-7 exactly -> scale 0x2000, no bump.
              codes k, ties to even: 2.5 -> 2, 3.5 -> 4 -> 00 FF 01 02 04 64 80 FE
     group 1: 3.0 eight times: min 0x4200, scale (3 - 3) / 255 = 0 -> 0x0000, codes 0
     group 2: 0.1f eight times (0.1f = 13421773 * 2^-27, not a half):
              min = half at or below: 0x2E66 = 1638 * 2^-14 = 13418496 * 2^-27
              0.1f - min = 3277 * 2^-27; / 255 = 12.85 * 2^-27 = 1.61 units of 2^-24 -> 0x0002
              2 * 255 * 2^-24 >= 3277 * 2^-27: no bump. code = 3277 * 2^-27 / 2^-23 = 204.81
              -> 205 = 0xCD (decodes to 0.1f + 3 * 2^-27, within scale/2 = 8 * 2^-27)
     group 3: -8 + k/32 for k = 0, 255, 17, 64.5, 65.5, 200, 31, 128 (negative only):
              min -8 (0xC800), 7.96875 / 255 = 2^-5 -> 0x2800; 64.5 -> 64, 65.5 -> 66
              -> 00 FF 11 40 42 C8 1F 80
   token 1: x[c] = c, so group g holds 8g .. 8g+7:
     min 8g: 0x0000, 0x4800, 0x4C00, 0x4E00
     7 / 255 = 0.0274509 = 1799.02 * 2^-16 -> 0x2707 (1799 * 2^-16);
     255 * 1799 * 2^-16 = 6.99989 < 7 -> bump to 0x2708 = 1800 * 2^-16 = 0.0274658203125
     codes j / 0.0274658 = j * 36.41: 0, 36.41, 72.82, 109.23, 145.64, 182.04, 218.45, 254.86
     -> 00 24 49 6D 92 B6 DA FF in every group */
static void golden_int8(void) {
    static const uint8_t want[96] = {
        0x00, 0xff, 0x01, 0x02, 0x04, 0x64, 0x80, 0xfe, /* token 0 data */
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xcd, 0xcd, 0xcd, 0xcd, 0xcd, 0xcd,
        0xcd, 0xcd, 0x00, 0xff, 0x11, 0x40, 0x42, 0xc8, 0x1f, 0x80,
        0x00, 0x24, 0x49, 0x6d, 0x92, 0xb6, 0xda, 0xff, /* token 1 data */
        0x00, 0x24, 0x49, 0x6d, 0x92, 0xb6, 0xda, 0xff, 0x00, 0x24, 0x49, 0x6d, 0x92, 0xb6,
        0xda, 0xff, 0x00, 0x24, 0x49, 0x6d, 0x92, 0xb6, 0xda, 0xff,
        0x00, 0x20, 0x00, 0xbc, 0x00, 0x00, 0x00, 0x42, /* token 0 meta */
        0x02, 0x00, 0x66, 0x2e, 0x00, 0x28, 0x00, 0xc8,
        0x08, 0x27, 0x00, 0x00, 0x08, 0x27, 0x00, 0x48, /* token 1 meta */
        0x08, 0x27, 0x00, 0x4c, 0x08, 0x27, 0x00, 0x4e};
    static const float k0[8] = {0, 255, 1, 2.5f, 3.5f, 100, 128, 254};
    static const float k3[8] = {0, 255, 17, 64.5f, 65.5f, 200, 31, 128};
    float x[64];
    int c;
    for (c = 0; c < 8; c++) {
        x[c] = -1.0f + k0[c] / 128.0f;
        x[8 + c] = 3.0f;
        x[16 + c] = 0.1f;
        x[24 + c] = -8.0f + k3[c] / 32.0f;
    }
    for (c = 0; c < 32; c++) x[32 + c] = (float)c;
    golden("INT8 D=32 G=8 n=2", test_layout(KVMIX_FORMAT_INT8, 2, 32, 8, 0), x, want, sizeof want);
}

/* INT4, D = 32, G = 16, 1 token: data 16 bytes (channel 2i in the low nibble of byte i), then
   meta [2] (scale, min).
     group 0: -3 + 0.5 * k for k = 0, 15, 0.5, 1.5, 2.5, 3.5, 7, 8, 9, 10, 11, 12, 13, 14, 14.5, 5
              min -3 (0xC200), 7.5 / 15 = 0.5 (0x3800); ties to even: 0.5 -> 0, 1.5 -> 2,
              2.5 -> 2, 3.5 -> 4, 14.5 -> 14; codes 0 15 0 2 2 4 7 8 9 10 11 12 13 14 14 5
              -> F0 20 42 87 A9 CB ED 5E
     group 1: u = 2^-24 (fp16 subnormals): 3u 33u 4u 6u 8u 5u 9u 11u 13u 15u 17u 19u 21u 23u
              25u 27u: min 3u (0x0003), 30u / 15 = 2u (0x0002), rounded up to the INT4 scale
              grid of 16 steps: 16u (0x0010); (x - 3u) / 16u = 0, 1.875 -> 2, 0.0625 -> 0,
              0.1875, 0.3125, 0.125, 0.375, 0.5 -> 0, 0.625 ... 1.375 -> 1, 1.5 -> 2
              -> 20 00 00 00 11 11 11 21 */
static void golden_int4(void) {
    static const uint8_t want[24] = {0xf0, 0x20, 0x42, 0x87, 0xa9, 0xcb, 0xed, 0x5e,
                                     0x20, 0x00, 0x00, 0x00, 0x11, 0x11, 0x11, 0x21,
                                     0x00, 0x38, 0x00, 0xc2, 0x10, 0x00, 0x03, 0x00};
    static const float k0[16] = {0, 15, 0.5f, 1.5f, 2.5f, 3.5f, 7, 8,
                                 9, 10, 11, 12, 13, 14, 14.5f, 5};
    static const float u1[16] = {3, 33, 4, 6, 8, 5, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27};
    float x[32];
    int c;
    for (c = 0; c < 16; c++) {
        x[c] = -3.0f + 0.5f * k0[c];
        x[16 + c] = u1[c] * 0x1p-24f;
    }
    golden("INT4 D=32 G=16 n=1", test_layout(KVMIX_FORMAT_INT4, 1, 32, 16, 0), x, want,
           sizeof want);
}

/* INT2, D = 32, G = 0 (resolves to 32), 2 tokens: data [2][8] (channel c in bits 2*(c%4) of
   byte c/4), then meta [2][1].
     token 0: channels 0..7: -1 2 0 1 -0.5 0.5 1.5 0.75, channels 8..31: -1 + (c % 4)
              min -1 (0xBC00), 3 / 3 = 1 (0x3C00); codes 0 3 1 2, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2,
              1.75 -> 2; byte 0 = 0 | 3<<2 | 1<<4 | 2<<6 = 0x9C, byte 1 = 0 | 2<<2 | 2<<4 | 2<<6
              = 0xA8, bytes 2..7 = 0 | 1<<2 | 2<<4 | 3<<6 = 0xE4
     token 1: 5.0 everywhere: min 0x4500, scale 0, codes 0 */
static void golden_int2(void) {
    static const uint8_t want[24] = {0x9c, 0xa8, 0xe4, 0xe4, 0xe4, 0xe4, 0xe4, 0xe4,
                                     0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                                     0x00, 0x3c, 0x00, 0xbc, 0x00, 0x00, 0x00, 0x45};
    static const float head[8] = {-1, 2, 0, 1, -0.5f, 0.5f, 1.5f, 0.75f};
    float x[64];
    int c;
    for (c = 0; c < 32; c++) {
        x[c] = c < 8 ? head[c] : (float)(-1 + c % 4);
        x[32 + c] = 5.0f;
    }
    golden("INT2 D=32 G=0 n=2", test_layout(KVMIX_FORMAT_INT2, 2, 32, 0, 0), x, want, sizeof want);
}

/* INT2_CHANNEL, D = 32, 4 tokens: data [4][8], then meta [32] per channel over the 4 tokens.
   Channel c >= 2 holds x[t][c] = (code - 1) * m with code = (t + c) % 4 and m = c % 4 + 1:
   min -m, scale 3m / 3 = m exactly, codes (t + c) % 4. Halves: 1 -> 3C00, 2 -> 4000,
   3 -> 4200, 4 -> 4400, negated with the sign bit.
   Channel 0 holds -1, 2, -0.5, 0.5: min -1, scale 1, codes 0, 3, 0.5 -> 0, 1.5 -> 2.
   Channel 1 holds 1/3f, 2/3f, 1, 0: min 0; 1 / 3 = 1365.33 * 2^-12 -> 0x3555 (1365 * 2^-12);
   3 * 1365 * 2^-12 = 0.99976 < 1 -> bump to 0x3556 = 0.33349609375; codes 0.9995 -> 1,
   1.999 -> 2, 2.9985 -> 3, 0.
   Rows (byte b holds channels 4b..4b+3, codes (t + j) % 4 for j = 0..3 beyond channel 0/1):
     t0: codes 0 1 2 3 -> E4 everywhere
     t1: byte 0 codes 3 2 3 0 -> 0x3B; others 1 2 3 0 -> 0x39
     t2: byte 0 codes 0 3 0 1 -> 0x4C; others 2 3 0 1 -> 0x4E
     t3: byte 0 codes 2 0 1 2 -> 0x92; others 3 0 1 2 -> 0x93 */
static void golden_int2_channel(void) {
    static const uint8_t rows[32] = {0xe4, 0xe4, 0xe4, 0xe4, 0xe4, 0xe4, 0xe4, 0xe4,
                                     0x3b, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39, 0x39,
                                     0x4c, 0x4e, 0x4e, 0x4e, 0x4e, 0x4e, 0x4e, 0x4e,
                                     0x92, 0x93, 0x93, 0x93, 0x93, 0x93, 0x93, 0x93};
    /* (scale, min) of channels with m = 1, 2, 3, 4 */
    static const uint8_t meta_m[4][4] = {{0x00, 0x3c, 0x00, 0xbc},
                                         {0x00, 0x40, 0x00, 0xc0},
                                         {0x00, 0x42, 0x00, 0xc2},
                                         {0x00, 0x44, 0x00, 0xc4}};
    static const uint8_t meta_c1[4] = {0x56, 0x35, 0x00, 0x00};
    uint8_t want[160];
    float x[4 * 32];
    int t, c;
    memcpy(want, rows, sizeof rows);
    for (c = 0; c < 32; c++) memcpy(want + 32 + 4 * c, c == 1 ? meta_c1 : meta_m[c % 4], 4);
    for (t = 0; t < 4; t++)
        for (c = 2; c < 32; c++) x[t * 32 + c] = (float)(((t + c) % 4 - 1) * (c % 4 + 1));
    x[0 * 32 + 0] = -1.0f;
    x[1 * 32 + 0] = 2.0f;
    x[2 * 32 + 0] = -0.5f;
    x[3 * 32 + 0] = 0.5f;
    x[0 * 32 + 1] = 1.0f / 3.0f;
    x[1 * 32 + 1] = 2.0f / 3.0f;
    x[2 * 32 + 1] = 1.0f;
    x[3 * 32 + 1] = 0.0f;
    golden("INT2_CHANNEL D=32 n=4", test_layout(KVMIX_FORMAT_INT2_CHANNEL, 4, 32, 0, 0), x, want,
           sizeof want);
}

/* BOOSTED, D = 32, k = 4, 4 tokens: dense [4][8], high [4][1], meta [32], index [32] = 196 bytes.
   Every channel not listed holds x[t][c] = ((t + c) % 4 - 1) * 0.5: values -0.5 0 0.5 1, sum of
   |x| = 2, min -0.5 (0xB800), scale 1.5 / 3 = 0.5 (0x3800), codes (t + c) % 4.
     ch 7:  -30 30 2 24     sum 86   min -30 (0xCF80), 60 / 15 = 4 (0x4400);
                                     codes 0 15 8, 54/4 = 13.5 -> 14 (even)
     ch 12: 16 1 8.5 31     sum 56.5 min 1 (0x3C00), 30 / 15 = 2 (0x4000);
                                     codes 7.5 -> 8 (even), 0, 3.75 -> 4, 15
     ch 20: -6 -2 -4 -12    sum 24   min -12 (0xCA00); 10 / 15 = 1365.33 * 2^-11 -> 0x3955;
                                     15 * 1365 * 2^-11 - 12 = -2.0024 < -2 -> bump to 0x3956
                                     (0.6669921875); codes 8.996 -> 9, 14.993 -> 15, 11.994
                                     -> 12, 0
     ch 25: 12 -12 0 0      sum 24   min -12; 24 / 15 = 1.6 = 1638.4 * 2^-10 -> 0x3E66;
                                     15 * 1.599609375 - 12 = 11.994 < 12 -> bump to 0x3E67
                                     (1.6005859375); codes 14.995 -> 15, 0, 7.497 -> 7, 7
     ch 30: 0 0 24 0        sum 24   not boosted: min 0, scale 24 / 3 = 8 (0x4800), codes 0 0 3 0
   Ranking: 7 (86), 12 (56.5), then 20, 25, 30 tie at 24: the lower channels 20 and 25 win.
   Slots in channel order: 7 -> 0, 12 -> 1, 20 -> 2, 25 -> 3.
   4-bit codes (low, high 2 bits):  ch 7: 0 15 8 14 -> low 0 3 0 2, high 0 3 2 3
                                    ch 12: 8 0 4 15 -> low 0 0 0 3, high 2 0 1 3
                                    ch 20: 9 15 12 0 -> low 1 3 0 0, high 2 3 3 0
                                    ch 25: 15 0 7 7 -> low 3 0 3 3, high 3 0 1 1
   Dense rows start from the pattern E4 / 39 / 4E / 93 (codes (t + j) % 4) and replace the
   codes of channels 7 (byte 1, bits 6-7), 12 (byte 3, bits 0-1), 20 (byte 5, bits 0-1),
   25 (byte 6, bits 2-3), 30 (byte 7, bits 4-5), e.g. t0 byte 1: codes 0 1 2 0 -> 0x24.
   High rows: slot s at bits 2s: t0: 0 | 2<<2 | 2<<4 | 3<<6 = 0xE8, t1: 3 | 0 | 3<<4 | 0 = 0x33,
   t2: 2 | 1<<2 | 3<<4 | 1<<6 = 0x76, t3: 3 | 3<<2 | 0 | 1<<6 = 0x4F. */
static void golden_boosted(void) {
    static const uint8_t dense_high[36] = {
        0xe4, 0x24, 0xe4, 0xe4, 0xe4, 0xe5, 0xec, 0xc4, /* t0 */
        0x39, 0xf9, 0x39, 0x38, 0x39, 0x3b, 0x31, 0x09, /* t1 */
        0x4e, 0x0e, 0x4e, 0x4c, 0x4e, 0x4c, 0x4e, 0x7e, /* t2 */
        0x93, 0x93, 0x93, 0x93, 0x93, 0x90, 0x9f, 0x83, /* t3 */
        0xe8, 0x33, 0x76, 0x4f};                        /* high bits */
    static const uint8_t meta_base[4] = {0x00, 0x38, 0x00, 0xb8};
    static const uint8_t meta_7[4] = {0x00, 0x44, 0x80, 0xcf};
    static const uint8_t meta_12[4] = {0x00, 0x40, 0x00, 0x3c};
    static const uint8_t meta_20[4] = {0x56, 0x39, 0x00, 0xca};
    static const uint8_t meta_25[4] = {0x67, 0x3e, 0x00, 0xca};
    static const uint8_t meta_30[4] = {0x00, 0x48, 0x00, 0x00};
    static const float ch7[4] = {-30, 30, 2, 24}, ch12[4] = {16, 1, 8.5f, 31};
    static const float ch20[4] = {-6, -2, -4, -12}, ch25[4] = {12, -12, 0, 0};
    static const float ch30[4] = {0, 0, 24, 0};
    uint8_t want[196];
    float x[4 * 32], dec[4 * 32];
    kvmix_layout l = test_layout(KVMIX_FORMAT_BOOSTED, 4, 32, 0, 4);
    int t, c;
    memcpy(want, dense_high, sizeof dense_high);
    for (c = 0; c < 32; c++) {
        const uint8_t *m = c == 7    ? meta_7
                           : c == 12 ? meta_12
                           : c == 20 ? meta_20
                           : c == 25 ? meta_25
                           : c == 30 ? meta_30
                                     : meta_base;
        memcpy(want + 36 + 4 * c, m, 4);
        want[164 + c] = 0xff;
    }
    want[164 + 7] = 0;
    want[164 + 12] = 1;
    want[164 + 20] = 2;
    want[164 + 25] = 3;
    for (t = 0; t < 4; t++) {
        for (c = 0; c < 32; c++) x[t * 32 + c] = (float)((t + c) % 4 - 1) * 0.5f;
        x[t * 32 + 7] = ch7[t];
        x[t * 32 + 12] = ch12[t];
        x[t * 32 + 20] = ch20[t];
        x[t * 32 + 25] = ch25[t];
        x[t * 32 + 30] = ch30[t];
    }
    golden("BOOSTED D=32 k=4 n=4", l, x, want, sizeof want);
    /* a few decoded values by hand: ch 7 t3: 14 * 4 - 30 = 26; ch 20 t0: 9 * 0.6669921875 - 12
       = -5.9970703125; ch 25 t2: 7 * 1.6005859375 - 12 = -0.7958984375; ch 30 t2: 3 * 8 = 24 */
    if (CHECK_RESULT(kvmix_ref_dequantize(&l, want, sizeof want, dec, 0), KVMIX_SUCCESS)) {
        CHECK(dec[3 * 32 + 7] == 26.0f);
        CHECK(dec[0 * 32 + 20] == -5.9970703125f);
        CHECK(dec[2 * 32 + 25] == -0.7958984375f);
        CHECK(dec[2 * 32 + 30] == 24.0f);
        CHECK(dec[1 * 32 + 12] == 1.0f);
    }
}

/* clang-format on */

static void test_goldens(void) {
    golden_fp16();
    golden_int8();
    golden_int4();
    golden_int2();
    golden_int2_channel();
    golden_boosted();
}

/* ---- boost ranking ------------------------------------------------------------------------- */
static void check_boost_index(const uint8_t *block, const kvmix_layout *l, const float *x,
                              const char *what) {
    spec s = spec_of(l);
    uint8_t want[KVMIX_MAX_HEAD_DIM], seen[256];
    int32_t c, n_boosted = 0, last_slot = -1, ok = 1;
    spec_boost_slots(x, l->head_dim, l->n_tokens, l->head_dim, l->n_boost, want);
    memset(seen, 0, sizeof seen);
    for (c = 0; c < l->head_dim; c++) {
        uint8_t slot = block[s.index_offset + c];
        if (slot != want[c]) ok = 0;
        if (slot == KVMIX_BOOST_NONE) continue;
        if (slot >= l->n_boost || seen[slot] || (int32_t)slot <= last_slot) ok = 0;
        if (slot < 255) seen[slot] = 1;
        last_slot = slot;
        n_boosted++;
    }
    CHECK_MSG(ok && n_boosted == l->n_boost,
              "%s: the boost index gives slots 0..%d to the top channels in channel order", what,
              (int)l->n_boost - 1);
}

static void test_boost_ranking(void) {
    test_rng rng;
    int32_t trial, c, t;
    test_rng_init(&rng, "formats/boost_ranking");
    /* sum of |x|, not max |x| or sum of x: channel 21 alternates +-5 (sum of x is 0) */
    {
        kvmix_layout l = test_layout(KVMIX_FORMAT_BOOSTED, 8, 32, 0, 4);
        float x[8 * 32];
        uint8_t block[8 * 8 + 8 * 1 + 5 * 32];
        spec s = spec_of(&l);
        for (t = 0; t < 8; t++)
            for (c = 0; c < 32; c++) {
                float v = 0.25f;                         /* sum 2 */
                if (c == 3) v = t == 0 ? 10.0f : 0.0f;   /* sum 10, largest max after 21 */
                if (c == 9) v = -2.0f;                   /* sum 16 */
                if (c == 17) v = 1.5f;                   /* sum 12 */
                if (c == 21) v = (t & 1) ? -5.0f : 5.0f; /* sum 40 */
                if (c == 30) v = 0.5f;                   /* sum 4 */
                x[t * 32 + c] = v;
            }
        CHECK_EQ_UINT(sizeof block, s.total);
        if (CHECK_RESULT(kvmix_ref_quantize(&l, x, 0, block, sizeof block), KVMIX_SUCCESS)) {
            for (c = 0; c < 32; c++) {
                int want = c == 3 ? 0 : c == 9 ? 1 : c == 17 ? 2 : c == 21 ? 3 : KVMIX_BOOST_NONE;
                CHECK_MSG(block[s.index_offset + c] == want, "channel %d has slot %d, expected %d",
                          (int)c, block[s.index_offset + c], want);
            }
            check_boost_index(block, &l, x, "sum of |x|");
        }
    }
    /* many exact ties: small multiples of 0.5, so float sums are exact in any order */
    for (trial = 0; trial < 200; trial++) {
        static const int32_t ks[] = {4, 8, 16, 32, 60, 64};
        int32_t k = ks[trial % 6], d = 64, n = test_rng_range(&rng, 1, 9);
        kvmix_layout l = test_layout(KVMIX_FORMAT_BOOSTED, n, d, 0, k);
        float x[9 * 64];
        uint8_t *block;
        size_t bytes = spec_of(&l).total;
        int levels = test_rng_range(&rng, 1, 3);
        for (t = 0; t < n; t++)
            for (c = 0; c < d; c++)
                x[t * d + c] = 0.5f * (float)test_rng_range(&rng, -levels, levels);
        if (trial % 10 == 0) /* all channels equal: the first k win */
            for (t = 0; t < n; t++)
                for (c = 0; c < d; c++) x[t * d + c] = (c + t) % 2 ? 1.0f : -1.0f;
        block = (uint8_t *)test_alloc(bytes);
        test_context("boost ties trial %d n=%d k=%d", (int)trial, (int)n, (int)k);
        if (CHECK_RESULT(kvmix_ref_quantize(&l, x, 0, block, bytes), KVMIX_SUCCESS)) {
            check_boost_index(block, &l, x, "ties");
            if (trial % 10 == 0)
                for (c = 0; c < d; c++)
                    if (!CHECK_EQ_INT(block[spec_of(&l).index_offset + c],
                                      c < k ? c : KVMIX_BOOST_NONE))
                        break;
        }
        free(block);
    }
    test_context(NULL);
}

/* ---- constant groups ----------------------------------------------------------------------- */
static void test_constant_groups(void) {
    static const float values[] = {3.5f,          -0.0f, 0.0f, 65504.0f,  -65504.0f, 0x1p-24f,
                                   -3 * 0x1p-24f, 1e-3f, 0.1f, -60001.0f, 1e-9f,     -1e-9f};
    size_t fi, vi;
    for (fi = 1; fi < N_ELEMS(ALL_FORMATS); fi++)
        for (vi = 0; vi < N_ELEMS(values); vi++) {
            kvmix_format f = ALL_FORMATS[fi];
            kvmix_layout l =
                test_layout(f, 5, 64, is_per_token(f) ? 16 : 0, f == KVMIX_FORMAT_BOOSTED ? 8 : 0);
            spec s = spec_of(&l);
            float x[5 * 64], dec[5 * 64];
            uint8_t *block = (uint8_t *)test_alloc(s.total);
            int representable =
                test_ref_fp16_value(test_ref_fp32_to_fp16(values[vi])) == (double)values[vi];
            findings found;
            int i;
            test_context("constant block %s value %a", kvmix_format_name(f), (double)values[vi]);
            for (i = 0; i < 5 * 64; i++) x[i] = values[vi];
            memset(&found, 0, sizeof found);
            if (CHECK_RESULT(kvmix_ref_quantize(&l, x, 0, block, s.total), KVMIX_SUCCESS)) {
                check_block(&found, &l, x, 64, block);
                CHECK_MSG(found.count == 0, "constant block follows the rules (%s)", found.first);
                if (CHECK_RESULT(kvmix_ref_dequantize(&l, block, s.total, dec, 0), KVMIX_SUCCESS))
                    for (i = 0; i < 5 * 64; i++) {
                        if (representable &&
                            !CHECK_MSG(dec[i] == x[i], "element %d: %a decodes to %a", i,
                                       (double)x[i], (double)dec[i]))
                            break;
                        if (!CHECK(isfinite(dec[i]))) break;
                    }
            }
            free(block);
        }
    test_context(NULL);
}

/* ---- bad input ----------------------------------------------------------------------------- */
#define BAD_D      64
#define BAD_N      5
#define BAD_STRIDE (BAD_D + 3)

static kvmix_layout bad_base_layout(kvmix_format f) {
    return test_layout(f, BAD_N, BAD_D, is_per_token(f) ? 16 : 0,
                       f == KVMIX_FORMAT_BOOSTED ? 8 : 0);
}

static void expect_quantize(kvmix_result want, const kvmix_layout *l, const float *src,
                            int32_t stride, size_t dst_bytes, const char *what) {
    size_t cap = dst_bytes + 64;
    uint8_t *dst = (uint8_t *)test_alloc(cap);
    kvmix_layout copy;
    kvmix_result r;
    if (l) copy = *l;
    test_poison(dst, cap, 5);
    r = kvmix_ref_quantize(l, src, stride, dst, dst_bytes);
    CHECK_MSG(r == want, "quantize with %s returns %s (got %s)", what, kvmix_result_string(want),
              kvmix_result_string(r));
    CHECK_MSG(test_is_poisoned(dst, cap, 5), "quantize with %s leaves dst untouched", what);
    if (l)
        CHECK_MSG(memcmp(&copy, l, sizeof copy) == 0,
                  "quantize with %s leaves the layout as it was", what);
    free(dst);
}

static void test_quantize_bad_input(void) {
    test_rng rng;
    float src[BAD_N * BAD_STRIDE];
    size_t fi, i;
    int32_t t, c;
    test_rng_init(&rng, "formats/bad_input");
    for (t = 0; t < BAD_N; t++)
        for (c = 0; c < BAD_STRIDE; c++)
            src[t * BAD_STRIDE + c] = c < BAD_D ? (float)test_rng_normal(&rng) : NAN;
    for (fi = 0; fi < N_ELEMS(ALL_FORMATS); fi++) {
        kvmix_format f = ALL_FORMATS[fi];
        kvmix_layout base = bad_base_layout(f), l;
        size_t bytes = spec_of(&base).total;
        uint8_t *good = (uint8_t *)test_alloc(bytes);
        test_context("quantize bad input, %s", kvmix_format_name(f));
        CHECK_RESULT(kvmix_ref_quantize(&base, src, BAD_STRIDE, good, bytes), KVMIX_SUCCESS);

        expect_quantize(KVMIX_ERR_NULL_POINTER, NULL, src, BAD_STRIDE, bytes, "a NULL layout");
        expect_quantize(KVMIX_ERR_NULL_POINTER, &base, NULL, BAD_STRIDE, bytes, "a NULL src");
        CHECK_RESULT(kvmix_ref_quantize(&base, src, BAD_STRIDE, NULL, bytes),
                     KVMIX_ERR_NULL_POINTER);
        l = base;
        l.n_tokens = -1;
        expect_quantize(KVMIX_ERR_INVALID_ARGUMENT, &l, src, BAD_STRIDE, bytes, "n_tokens -1");
        l = base;
        l.n_tokens = INT32_MIN;
        expect_quantize(KVMIX_ERR_INVALID_ARGUMENT, &l, src, BAD_STRIDE, bytes,
                        "n_tokens INT32_MIN");
        {
            static const int32_t dims[] = {0, 31, 33, 544, -32, 1024, 44, INT32_MIN};
            for (i = 0; i < N_ELEMS(dims); i++) {
                char what[64];
                l = base;
                l.head_dim = dims[i];
                snprintf(what, sizeof what, "head_dim %d", (int)dims[i]);
                expect_quantize(KVMIX_ERR_BAD_SHAPE, &l, src, BAD_STRIDE, bytes, what);
            }
        }
        {
            static const int formats[] = {0, 7, -1, 100, INT32_MIN};
            for (i = 0; i < N_ELEMS(formats); i++) {
                char what[64];
                l = base;
                l.format = (kvmix_format)formats[i];
                snprintf(what, sizeof what, "format %d", formats[i]);
                expect_quantize(KVMIX_ERR_UNKNOWN_FORMAT, &l, src, BAD_STRIDE, bytes, what);
            }
        }
        if (is_per_token(f)) {
            static const int32_t groups[] = {12, 24, -8, 128, 4, 40, 1};
            uint8_t *g32 = (uint8_t *)test_alloc(spec_of(&base).total * 2), *g0;
            for (i = 0; i < N_ELEMS(groups); i++) {
                char what[64];
                l = base;
                l.group_size = groups[i];
                snprintf(what, sizeof what, "group_size %d with head_dim %d", (int)groups[i],
                         BAD_D);
                expect_quantize(KVMIX_ERR_BAD_SHAPE, &l, src, BAD_STRIDE, bytes * 4, what);
            }
            /* group 0 is group 32 */
            l = base;
            l.group_size = 32;
            bytes = spec_of(&l).total;
            g0 = g32 + bytes;
            CHECK_RESULT(kvmix_ref_quantize(&l, src, BAD_STRIDE, g32, bytes), KVMIX_SUCCESS);
            l.group_size = 0;
            CHECK_RESULT(kvmix_ref_quantize(&l, src, BAD_STRIDE, g0, bytes), KVMIX_SUCCESS);
            CHECK_MEM_EQ(g0, g32, bytes);
            bytes = spec_of(&base).total;
            free(g32);
        } else {
            l = base;
            l.group_size = 8;
            expect_quantize(KVMIX_ERR_BAD_SHAPE, &l, src, BAD_STRIDE, bytes,
                            "a group size with a per-channel or FP16 format");
            l = base;
            l.group_size = 32;
            expect_quantize(KVMIX_ERR_BAD_SHAPE, &l, src, BAD_STRIDE, bytes,
                            "group size 32 with a per-channel or FP16 format");
        }
        if (f == KVMIX_FORMAT_BOOSTED) {
            static const int32_t boosts[] = {2, 3, -4, 68, 66, 1, 255, INT32_MAX};
            for (i = 0; i < N_ELEMS(boosts); i++) {
                char what[64];
                l = base;
                l.n_boost = boosts[i];
                snprintf(what, sizeof what, "n_boost %d with head_dim %d", (int)boosts[i], BAD_D);
                expect_quantize(KVMIX_ERR_BAD_SHAPE, &l, src, BAD_STRIDE, bytes * 4, what);
            }
            {
                /* 256 > 252 slots even though head_dim 512 has room; 252 is fine */
                float *big = (float *)test_alloc(sizeof(float) * 512 * 2);
                uint8_t *out;
                for (i = 0; i < 1024; i++) big[i] = (float)test_rng_normal(&rng);
                l = test_layout(KVMIX_FORMAT_BOOSTED, 2, 512, 0, 256);
                expect_quantize(KVMIX_ERR_BAD_SHAPE, &l, big, 0, 1 << 16,
                                "n_boost 256 with head_dim 512");
                l.n_boost = 252;
                out = (uint8_t *)test_alloc(spec_of(&l).total);
                CHECK_RESULT(kvmix_ref_quantize(&l, big, 0, out, spec_of(&l).total), KVMIX_SUCCESS);
                free(out);
                free(big);
            }
        } else {
            l = base;
            l.n_boost = 4;
            expect_quantize(KVMIX_ERR_BAD_SHAPE, &l, src, BAD_STRIDE, bytes * 4,
                            "n_boost 4 with a format that is not BOOSTED");
        }
        expect_quantize(KVMIX_ERR_INVALID_ARGUMENT, &base, src, BAD_D - 1, bytes,
                        "row_stride head_dim - 1");
        expect_quantize(KVMIX_ERR_INVALID_ARGUMENT, &base, src, -1, bytes, "row_stride -1");
        expect_quantize(KVMIX_ERR_INVALID_ARGUMENT, &base, src, INT32_MIN, bytes,
                        "row_stride INT32_MIN");
        expect_quantize(KVMIX_ERR_BUFFER_TOO_SMALL, &base, src, BAD_STRIDE, bytes - 1,
                        "dst one byte too small");
        expect_quantize(KVMIX_ERR_BUFFER_TOO_SMALL, &base, src, BAD_STRIDE, 0, "dst_bytes 0");
        {
            /* values outside FP16 at the last element (and the first) */
            static const float bad_values[] = {NAN,       INFINITY, -INFINITY, 65505.0f,
                                               -70000.0f, 65520.0f, -65504.5f, 3.4e38f};
            const size_t last = (BAD_N - 1) * BAD_STRIDE + BAD_D - 1;
            float copy[BAD_N * BAD_STRIDE];
            for (i = 0; i < N_ELEMS(bad_values); i++) {
                char what[80];
                memcpy(copy, src, sizeof copy);
                copy[last] = bad_values[i];
                snprintf(what, sizeof what, "%g at the last element", (double)bad_values[i]);
                expect_quantize(KVMIX_ERR_BAD_VALUE, &base, copy, BAD_STRIDE, bytes, what);
                memcpy(copy, src, sizeof copy);
                copy[0] = bad_values[i];
                snprintf(what, sizeof what, "%g at the first element", (double)bad_values[i]);
                expect_quantize(KVMIX_ERR_BAD_VALUE, &base, copy, BAD_STRIDE, bytes, what);
            }
            /* the limits themselves are fine, and NaN in the row padding is never read */
            memcpy(copy, src, sizeof copy);
            copy[last] = 65504.0f;
            copy[0] = -65504.0f;
            CHECK_RESULT(kvmix_ref_quantize(&base, copy, BAD_STRIDE, good, bytes), KVMIX_SUCCESS);
        }
        /* no tokens: nothing is read or written, NULL pointers are fine */
        l = base;
        l.n_tokens = 0;
        CHECK_RESULT(kvmix_ref_quantize(&l, NULL, 0, NULL, 0), KVMIX_SUCCESS);
        expect_quantize(KVMIX_SUCCESS, &l, src, 0, 0, "no tokens");
        l.head_dim = 33;
        CHECK_RESULT(kvmix_ref_quantize(&l, NULL, 0, NULL, 0), KVMIX_ERR_BAD_SHAPE);
        free(good);
    }
    /* kvmix_layout_resolve: writes back only on success */
    {
        kvmix_layout l = test_layout(KVMIX_FORMAT_INT4, 3, 64, 0, 0), copy;
        CHECK_RESULT(kvmix_layout_resolve(NULL, NULL), KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_layout_resolve(&l, NULL), KVMIX_SUCCESS);
        CHECK_EQ_INT(l.group_size, 32);
        l.group_size = 12;
        copy = l;
        CHECK_RESULT(kvmix_layout_resolve(&l, NULL), KVMIX_ERR_BAD_SHAPE);
        CHECK(memcmp(&l, &copy, sizeof l) == 0);
        l = test_layout(KVMIX_FORMAT_BOOSTED, 3, 64, 0, 0);
        CHECK_RESULT(kvmix_layout_resolve(&l, NULL), KVMIX_SUCCESS);
        CHECK_EQ_INT(l.n_boost, 0);
        CHECK_EQ_INT(l.group_size, 0);
    }
    test_context(NULL);
}

/* dequantize and dequantize_row (row 0) return `want` / `want_row`; on failure their outputs
   are untouched. */
static void expect_dequantize2(kvmix_result want, kvmix_result want_row, const kvmix_layout *l,
                               const void *src, size_t src_bytes, int32_t stride,
                               const char *what) {
    size_t cap = sizeof(float) * BAD_N * BAD_STRIDE * 2,
           row_cap = sizeof(float) * KVMIX_MAX_HEAD_DIM;
    float *dst = (float *)test_alloc(cap);
    float *row = (float *)test_alloc(row_cap);
    kvmix_result r;
    test_poison(dst, cap, 6);
    test_poison(row, row_cap, 7);
    r = kvmix_ref_dequantize(l, src, src_bytes, dst, stride);
    CHECK_MSG(r == want, "dequantize with %s returns %s (got %s)", what, kvmix_result_string(want),
              kvmix_result_string(r));
    if (want != KVMIX_SUCCESS)
        CHECK_MSG(test_is_poisoned(dst, cap, 6), "dequantize with %s leaves dst untouched", what);
    r = kvmix_ref_dequantize_row(l, src, src_bytes, 0, row);
    CHECK_MSG(r == want_row, "dequantize_row with %s returns %s (got %s)", what,
              kvmix_result_string(want_row), kvmix_result_string(r));
    if (want_row != KVMIX_SUCCESS)
        CHECK_MSG(test_is_poisoned(row, row_cap, 7), "dequantize_row with %s leaves dst untouched",
                  what);
    free(dst);
    free(row);
}

static void expect_dequantize(kvmix_result want, const kvmix_layout *l, const void *src,
                              size_t src_bytes, int32_t stride, const char *what) {
    expect_dequantize2(want, want, l, src, src_bytes, stride, what);
}

static void test_dequantize_bad_input(void) {
    test_rng rng;
    float src[BAD_N * BAD_D], row[BAD_D];
    size_t fi;
    int32_t i;
    test_rng_init(&rng, "formats/dequantize_bad_input");
    for (i = 0; i < BAD_N * BAD_D; i++) src[i] = (float)test_rng_normal(&rng);
    for (fi = 0; fi < N_ELEMS(ALL_FORMATS); fi++) {
        kvmix_format f = ALL_FORMATS[fi];
        kvmix_layout base = bad_base_layout(f), l;
        size_t bytes = spec_of(&base).total;
        uint8_t *block = (uint8_t *)test_alloc(bytes);
        test_context("dequantize bad input, %s", kvmix_format_name(f));
        CHECK_RESULT(kvmix_ref_quantize(&base, src, 0, block, bytes), KVMIX_SUCCESS);
        expect_dequantize(KVMIX_SUCCESS, &base, block, bytes, BAD_STRIDE, "valid input (control)");
        expect_dequantize(KVMIX_ERR_NULL_POINTER, NULL, block, bytes, 0, "a NULL layout");
        expect_dequantize(KVMIX_ERR_NULL_POINTER, &base, NULL, bytes, 0, "a NULL src");
        CHECK_RESULT(kvmix_ref_dequantize(&base, block, bytes, NULL, 0), KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_ref_dequantize_row(&base, block, bytes, 0, NULL),
                     KVMIX_ERR_NULL_POINTER);
        expect_dequantize(KVMIX_ERR_BUFFER_TOO_SMALL, &base, block, bytes - 1, 0,
                          "src one byte short");
        expect_dequantize(KVMIX_ERR_BUFFER_TOO_SMALL, &base, block, 0, 0, "src_bytes 0");
        expect_dequantize2(KVMIX_ERR_INVALID_ARGUMENT, KVMIX_SUCCESS, &base, block, bytes,
                           BAD_D - 1, "row_stride head_dim - 1");
        expect_dequantize2(KVMIX_ERR_INVALID_ARGUMENT, KVMIX_SUCCESS, &base, block, bytes, -5,
                           "row_stride -5");
        l = base;
        l.n_tokens = -1;
        expect_dequantize(KVMIX_ERR_INVALID_ARGUMENT, &l, block, bytes, 0, "n_tokens -1");
        l = base;
        l.head_dim = 33;
        expect_dequantize(KVMIX_ERR_BAD_SHAPE, &l, block, bytes, 0, "head_dim 33");
        l = base;
        l.head_dim = 544;
        expect_dequantize(KVMIX_ERR_BAD_SHAPE, &l, block, bytes, 0, "head_dim 544");
        l = base;
        l.format = (kvmix_format)7;
        expect_dequantize(KVMIX_ERR_UNKNOWN_FORMAT, &l, block, bytes, 0, "format 7");
        l = base;
        l.format = (kvmix_format)0;
        expect_dequantize(KVMIX_ERR_UNKNOWN_FORMAT, &l, block, bytes, 0, "format 0");
        l = base;
        l.n_boost = 2;
        expect_dequantize(KVMIX_ERR_BAD_SHAPE, &l, block, bytes, 0, "n_boost 2");
        /* rows out of range */
        test_poison(row, sizeof row, 8);
        CHECK_RESULT(kvmix_ref_dequantize_row(&base, block, bytes, -1, row),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_ref_dequantize_row(&base, block, bytes, BAD_N, row),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_RESULT(kvmix_ref_dequantize_row(&base, block, bytes, INT32_MIN, row),
                     KVMIX_ERR_INVALID_ARGUMENT);
        CHECK(test_is_poisoned(row, sizeof row, 8));
        CHECK_RESULT(kvmix_ref_dequantize_row(&base, block, bytes, BAD_N - 1, row), KVMIX_SUCCESS);
        /* no tokens */
        l = base;
        l.n_tokens = 0;
        CHECK_RESULT(kvmix_ref_dequantize(&l, NULL, 0, NULL, 0), KVMIX_SUCCESS);
        test_poison(row, sizeof row, 8);
        CHECK_RESULT(kvmix_ref_dequantize_row(&l, NULL, 0, 0, row), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK(test_is_poisoned(row, sizeof row, 8));
        free(block);
    }
    test_context(NULL);
}

/* ---- corrupt packed bytes ------------------------------------------------------------------ */
static void expect_corrupt(const kvmix_layout *l, const uint8_t *block, size_t bytes,
                           const char *what) {
    uint8_t *copy = (uint8_t *)test_alloc(bytes); /* exact size: ASan sees any overread */
    memcpy(copy, block, bytes);
    expect_dequantize(KVMIX_ERR_CORRUPT_DATA, l, copy, bytes, 0, what);
    free(copy);
}

static void test_corrupt_data(void) {
    test_rng rng;
    float src[BAD_N * BAD_D];
    size_t fi, i;
    int32_t c;
    test_rng_init(&rng, "formats/corrupt");
    for (i = 0; i < BAD_N * BAD_D; i++) src[i] = (float)test_rng_normal(&rng);
    for (fi = 0; fi < N_ELEMS(ALL_FORMATS); fi++) {
        kvmix_format f = ALL_FORMATS[fi];
        kvmix_layout l = bad_base_layout(f);
        spec s = spec_of(&l);
        uint8_t *good = (uint8_t *)test_alloc(s.total), *bad = (uint8_t *)test_alloc(s.total);
        size_t n_meta = (s.index_offset - s.meta_offset) / 4;
        test_context("corrupt data, %s", kvmix_format_name(f));
        CHECK_RESULT(kvmix_ref_quantize(&l, src, 0, good, s.total), KVMIX_SUCCESS);
        if (f == KVMIX_FORMAT_FP16) {
            /* halves that no quantize call writes: infinities and NaN (inputs must be finite
               and within +-65504) */
            static const uint16_t halves[] = {0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x7c01};
            for (i = 0; i < N_ELEMS(halves); i++) {
                char what[64];
                size_t at =
                    (i % 2) ? s.total - 2 : 2 * (size_t)test_rng_range(&rng, 0, BAD_N * BAD_D - 1);
                memcpy(bad, good, s.total);
                bad[at] = (uint8_t)(halves[i] & 0xff);
                bad[at + 1] = (uint8_t)(halves[i] >> 8);
                snprintf(what, sizeof what, "FP16 element 0x%04x at byte %zu", halves[i], at);
                expect_corrupt(&l, bad, s.total, what);
            }
        } else {
            static const struct {
                int field; /* 0 = scale, 1 = min */
                uint16_t half;
                const char *what;
            } cases[] = {{0, 0x7e00, "a NaN scale"},       {0, 0xbc00, "a negative scale (-1)"},
                         {0, 0xfbff, "scale -65504"},      {0, 0x7c00, "an infinite scale"},
                         {0, 0x8001, "scale -2^-24"},      {1, 0x7c00, "an infinite min"},
                         {1, 0xfc00, "a -infinite min"},   {1, 0xfe01, "a NaN min"},
                         {0, 0xfc00, "a -infinite scale"}, {0, 0x8000, "scale -0"}};
            for (i = 0; i < N_ELEMS(cases); i++) {
                /* first, last and a random entry of the meta section */
                size_t entries[3], e;
                entries[0] = 0;
                entries[1] = n_meta - 1;
                entries[2] = (size_t)test_rng_range(&rng, 0, (int32_t)n_meta - 1);
                for (e = 0; e < 3; e++) {
                    char what[96];
                    size_t at = s.meta_offset + entries[e] * 4 + 2 * (size_t)cases[i].field;
                    memcpy(bad, good, s.total);
                    bad[at] = (uint8_t)(cases[i].half & 0xff);
                    bad[at + 1] = (uint8_t)(cases[i].half >> 8);
                    snprintf(what, sizeof what, "%s in meta entry %zu", cases[i].what, entries[e]);
                    expect_corrupt(&l, bad, s.total, what);
                }
            }
        }
        if (f == KVMIX_FORMAT_BOOSTED) {
            int32_t boosted[KVMIX_MAX_HEAD_DIM], plain[KVMIX_MAX_HEAD_DIM], nb = 0, np = 0;
            uint8_t *idx;
            for (c = 0; c < s.d; c++) {
                if (good[s.index_offset + c] == KVMIX_BOOST_NONE)
                    plain[np++] = c;
                else
                    boosted[nb++] = c;
            }
            CHECK_EQ_INT(nb, s.k);
            memcpy(bad, good, s.total);
            idx = bad + s.index_offset;
            idx[plain[0]] = idx[boosted[1]]; /* a slot used twice */
            expect_corrupt(&l, bad, s.total, "a duplicate boost slot");
            memcpy(bad, good, s.total);
            idx[boosted[2]] = (uint8_t)s.k; /* one past the last slot */
            expect_corrupt(&l, bad, s.total, "boost slot n_boost");
            memcpy(bad, good, s.total);
            idx[plain[np - 1]] = 0xfe;
            expect_corrupt(&l, bad, s.total, "boost slot 0xFE");
            memcpy(bad, good, s.total);
            idx[boosted[nb - 1]] = KVMIX_BOOST_NONE; /* slot k-1 missing */
            expect_corrupt(&l, bad, s.total, "a missing boost slot");
            memcpy(bad, good, s.total);
            memset(idx, KVMIX_BOOST_NONE, (size_t)s.d);
            expect_corrupt(&l, bad, s.total, "no boosted channel at all");
            memcpy(bad, good, s.total);
            idx[boosted[0]] = idx[boosted[1]]; /* missing and duplicate together */
            expect_corrupt(&l, bad, s.total, "a slot moved onto another");
            /* swapping two slots keeps a permutation: still valid */
            memcpy(bad, good, s.total);
            idx[boosted[0]] = good[s.index_offset + boosted[1]];
            idx[boosted[1]] = good[s.index_offset + boosted[0]];
            expect_dequantize(KVMIX_SUCCESS, &l, bad, s.total, 0, "two swapped slots");
            /* k = 0 allows no slot at all */
            {
                kvmix_layout l0 = l;
                spec s0;
                uint8_t *b0;
                l0.n_boost = 0;
                s0 = spec_of(&l0);
                b0 = (uint8_t *)test_alloc(s0.total);
                CHECK_RESULT(kvmix_ref_quantize(&l0, src, 0, b0, s0.total), KVMIX_SUCCESS);
                b0[s0.index_offset + 5] = 0;
                expect_corrupt(&l0, b0, s0.total, "slot 0 with n_boost 0");
                free(b0);
            }
        }
        free(good);
        free(bad);
    }
    test_context(NULL);
}

void unit_formats(void) {
    test_sizes_and_bits();
    test_goldens();
    test_boost_ranking();
    test_constant_groups();
    test_quantize_bad_input();
    test_dequantize_bad_input();
    test_corrupt_data();
    test_roundtrip_all_shapes();
    test_roundtrip_head_dims_of_8();
}
