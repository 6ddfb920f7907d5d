/* unit_core: result strings, version, FP16 and BF16 conversion. */
#include "harness.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define N_RANDOM_FLOATS 4000000

static void test_result_strings(void) {
    static const kvmix_result all[] = {KVMIX_SUCCESS,
                                       KVMIX_ERR_NULL_POINTER,
                                       KVMIX_ERR_INVALID_ARGUMENT,
                                       KVMIX_ERR_BAD_SHAPE,
                                       KVMIX_ERR_UNKNOWN_FORMAT,
                                       KVMIX_ERR_BUFFER_TOO_SMALL,
                                       KVMIX_ERR_BAD_VALUE,
                                       KVMIX_ERR_OUT_OF_MEMORY,
                                       KVMIX_ERR_UNSUPPORTED,
                                       KVMIX_ERR_CORRUPT_DATA,
                                       KVMIX_ERR_VERSION,
                                       KVMIX_ERR_MALFORMED,
                                       KVMIX_ERR_NOT_FOUND,
                                       KVMIX_ERR_CUDA};
    static const int unknown[] = {1, 2, 14, 100, -14, -15, -100, -1000000};
    const size_t n = sizeof all / sizeof all[0];
    size_t i, j;
    test_context("kvmix_result_string");
    CHECK_EQ_INT(KVMIX_SUCCESS, 0);
    for (i = 0; i < n; i++) {
        const char *s = kvmix_result_string(all[i]);
        CHECK_EQ_INT(all[i], -(int)i); /* the enum is dense: 0, -1, ..., -13 */
        if (!CHECK_MSG(s != NULL, "kvmix_result_string(%d) is not NULL", (int)all[i])) continue;
        CHECK_MSG(s[0] != '\0', "kvmix_result_string(%d) is not empty", (int)all[i]);
        for (j = 0; j < i; j++)
            CHECK_MSG(strcmp(s, kvmix_result_string(all[j])) != 0,
                      "results %d and %d have distinct strings (both \"%s\")", (int)all[i],
                      (int)all[j], s);
    }
    for (i = 0; i < sizeof unknown / sizeof unknown[0]; i++) {
        const char *s = kvmix_result_string((kvmix_result)unknown[i]);
        if (!CHECK_MSG(s != NULL, "kvmix_result_string(%d) (unknown) is not NULL", unknown[i]))
            continue;
        CHECK_MSG(s[0] != '\0', "kvmix_result_string(%d) (unknown) is not empty", unknown[i]);
        for (j = 0; j < n; j++)
            CHECK_MSG(strcmp(s, kvmix_result_string(all[j])) != 0,
                      "unknown result %d does not reuse the string of %d (\"%s\")", unknown[i],
                      (int)all[j], s);
    }
    test_context(NULL);
}

static void test_version(void) {
    char text[64];
    snprintf(text, sizeof text, "%d.%d.%d", KVMIX_VERSION_MAJOR, KVMIX_VERSION_MINOR,
             KVMIX_VERSION_PATCH);
    CHECK_MSG(strcmp(text, KVMIX_VERSION_STRING) == 0,
              "KVMIX_VERSION_STRING \"%s\" matches the number macros \"%s\"", KVMIX_VERSION_STRING,
              text);
    CHECK(kvmix_version_string() != NULL);
    CHECK_MSG(kvmix_version_string() && strcmp(kvmix_version_string(), KVMIX_VERSION_STRING) == 0,
              "kvmix_version_string() equals KVMIX_VERSION_STRING");
    CHECK(KVMIX_VERSION_MAJOR >= 0 && KVMIX_VERSION_MINOR >= 0 && KVMIX_VERSION_PATCH >= 0);
}

/* ---- FP16 --------------------------------------------------------------------------------- */

/* Every half: fp16 -> fp32 equals the value computed from the fields, and fp32 -> fp16 gives the
   same half back (NaNs give the canonical 0x7FFF). */
static void test_fp16_exhaustive(void) {
    uint32_t h, bad_value = 0, bad_trip = 0, first_value = 0, first_trip = 0;
    for (h = 0; h < 0x10000u; h++) {
        uint16_t half = (uint16_t)h;
        float f = kvmix_fp16_to_fp32(half);
        double want = test_ref_fp16_value(half);
        int is_nan = ((h >> 10) & 0x1f) == 0x1f && (h & 0x3ff) != 0;
        int value_ok, trip_ok;
        if (is_nan) {
            value_ok = isnan(f);
            trip_ok = kvmix_fp32_to_fp16(f) == 0x7fff;
        } else {
            value_ok = (double)f == want && !signbit(f) == !signbit(want);
            trip_ok = kvmix_fp32_to_fp16(f) == half;
        }
        if (!value_ok && bad_value++ == 0) first_value = h;
        if (!trip_ok && bad_trip++ == 0) first_trip = h;
    }
    CHECK_MSG(bad_value == 0,
              "kvmix_fp16_to_fp32 exact for all 65536 halves (%lu wrong, first 0x%04lx -> %.9g)",
              (unsigned long)bad_value, (unsigned long)first_value,
              (double)kvmix_fp16_to_fp32((uint16_t)first_value));
    CHECK_MSG(bad_trip == 0,
              "fp16 -> fp32 -> fp16 round trip of all halves (%lu wrong, first 0x%04lx -> 0x%04x)",
              (unsigned long)bad_trip, (unsigned long)first_trip,
              kvmix_fp32_to_fp16(kvmix_fp16_to_fp32((uint16_t)first_trip)));
}

typedef struct fp16_case {
    float value;
    uint16_t half;
    const char *what;
} fp16_case;

static void test_fp16_hand_picked(void) {
    const float u = 0x1p-24f; /* the smallest subnormal half */
    const fp16_case cases[] = {
        {1.0f, 0x3c00, "one"},
        {-2.0f, 0xc000, "minus two"},
        {0.0f, 0x0000, "zero"},
        {-0.0f, 0x8000, "negative zero keeps its sign"},
        {65504.0f, 0x7bff, "largest half"},
        {-65504.0f, 0xfbff, "most negative half"},
        {65505.0f, 0x7bff, "65505 rounds down to 65504"},
        {0x1.ffdffep+15f, 0x7bff, "largest float below 65520 rounds to 65504"},
        {65520.0f, 0x7c00, "65520: tie between 65504 (odd) and 65536 -> infinity"},
        {-65520.0f, 0xfc00, "-65520 -> -infinity"},
        {1e10f, 0x7c00, "overflow -> infinity"},
        {FLT_MAX, 0x7c00, "FLT_MAX -> infinity"},
        {INFINITY, 0x7c00, "infinity"},
        {-INFINITY, 0xfc00, "-infinity"},
        {1.0f + 0x1p-11f, 0x3c00, "1 + 2^-11: tie, even is 1.0"},
        {1.0f + 3 * 0x1p-11f, 0x3c02, "1 + 3*2^-11: tie, even is 0x3c02"},
        {1.0f + 0x1p-11f + 0x1p-23f, 0x3c01, "just above the tie rounds up"},
        {1.0f - 0x1p-12f, 0x3c00, "1 - 2^-12: tie between 0x3bff and 0x3c00 -> even"},
        {2049.0f, 0x6800, "2049: tie between 2048 and 2050 -> 2048"},
        {2051.0f, 0x6802, "2051: tie between 2050 and 2052 -> 2052"},
        {0.1f, 0x2e66, "0.1"},
        {1.0f / 3.0f, 0x3555, "1/3"},
        {u, 0x0001, "2^-24, smallest subnormal"},
        {0x1p-25f, 0x0000, "2^-25: tie between 0 and 2^-24 -> 0"},
        {-0x1p-25f, 0x8000, "-2^-25 -> -0"},
        {0x1.000002p-25f, 0x0001, "just above 2^-25 -> 2^-24"},
        {0x1p-26f, 0x0000, "2^-26 -> 0"},
        {1e-30f, 0x0000, "tiny -> 0"},
        {-1e-30f, 0x8000, "-tiny -> -0"},
        {FLT_MIN, 0x0000, "FLT_MIN -> 0"},
        {1.5f * u, 0x0002, "1.5 units: tie -> 2 units"},
        {2.5f * u, 0x0002, "2.5 units: tie -> 2 units"},
        {3.5f * u, 0x0004, "3.5 units: tie -> 4 units"},
        {-3.5f * u, 0x8004, "-3.5 units: tie -> -4 units"},
        {0x1p-14f, 0x0400, "2^-14, smallest normal"},
        {0x1p-14f - 0.5f * u, 0x0400, "1023.5 units: tie -> 1024 (normal)"},
        {0x1p-14f - 1.5f * u, 0x03fe, "1022.5 units: tie -> 1022"},
        {0x1p-15f + 0.5f * u, 0x0200, "512.5 units: tie -> 512"},
        {0x1p-15f + 1.5f * u, 0x0202, "513.5 units: tie -> 514"},
        {0x1p-14f + 0x1p-25f, 0x0400, "2^-14 + half a normal step: tie -> even"},
        {0x1p-14f + 3 * 0x1p-25f, 0x0402, "2^-14 + 1.5 steps: tie -> 0x0402"},
    };
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = kvmix_fp32_to_fp16(cases[i].value);
        CHECK_MSG(got == cases[i].half, "kvmix_fp32_to_fp16(%a) (%s) = 0x%04x, expected 0x%04x",
                  (double)cases[i].value, cases[i].what, got, cases[i].half);
        CHECK_MSG(test_ref_fp32_to_fp16(cases[i].value) == cases[i].half,
                  "test reference agrees on %s", cases[i].what);
    }
    /* every NaN, whatever its sign and payload, becomes 0x7FFF */
    {
        static const uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u,
                                        0x7fffffffu, 0xffffffffu, 0x7fa00000u, 0x7f802000u};
        for (i = 0; i < sizeof nans / sizeof nans[0]; i++)
            CHECK_MSG(kvmix_fp32_to_fp16(test_bits_float(nans[i])) == 0x7fff,
                      "NaN 0x%08lx -> 0x7fff (got 0x%04x)", (unsigned long)nans[i],
                      kvmix_fp32_to_fp16(test_bits_float(nans[i])));
    }
}

/* A float drawn to exercise conversions: raw bit patterns, floats in and around the half
   range, and values one float step around midpoints between adjacent halves. */
static float random_conversion_input(test_rng *rng, int for_bf16) {
    uint32_t r = test_rng_u32(rng), kind = r & 3u, sign = (r & 4u) ? 0x80000000u : 0;
    if (kind == 0) return test_bits_float(test_rng_u32(rng));
    if (kind == 1) { /* exponents around (and a little beyond) the half range */
        uint32_t exponent = (uint32_t)test_rng_range(rng, 97, 146);
        if (for_bf16) exponent = (uint32_t)test_rng_range(rng, 0, 254);
        return test_bits_float(sign | (exponent << 23) | (test_rng_u32(rng) & 0x7fffffu));
    }
    if (for_bf16) { /* near a midpoint between adjacent bfloat16 values */
        uint32_t bits = test_rng_u32(rng) & 0xffff0000u;
        if ((bits & 0x7f800000u) == 0x7f800000u) bits &= 0xbfffffffu;
        bits |= 0x8000u;
        return test_bits_float(bits + (uint32_t)test_rng_range(rng, -2, 2));
    }
    {
        /* midpoint of half h and the next one up (exact in float: 12 significant bits) */
        uint16_t h = (uint16_t)test_rng_range(rng, 0, 0x7bff);
        double next = h == 0x7bff ? 65536.0 : test_ref_fp16_value((uint16_t)(h + 1));
        float mid = (float)((test_ref_fp16_value(h) + next) / 2);
        uint32_t bits = test_float_bits(mid);
        int32_t step = test_rng_range(rng, -2, 2);
        if (mid == 0.0f) step = step < 0 ? -step : step;
        return test_bits_float((bits + (uint32_t)step) | sign);
    }
}

static void test_fp16_random(void) {
    test_rng rng;
    uint32_t i, bad = 0;
    float first = 0.0f;
    test_rng_init(&rng, "core/fp16_random");
    for (i = 0; i < N_RANDOM_FLOATS; i++) {
        float f = random_conversion_input(&rng, 0);
        if (kvmix_fp32_to_fp16(f) != test_ref_fp32_to_fp16(f) && bad++ == 0) first = f;
    }
    CHECK_MSG(bad == 0,
              "kvmix_fp32_to_fp16 equals the double-arithmetic reference on %d random floats "
              "(%lu differ, first %a (0x%08lx): 0x%04x, reference 0x%04x)",
              N_RANDOM_FLOATS, (unsigned long)bad, (double)first,
              (unsigned long)test_float_bits(first), kvmix_fp32_to_fp16(first),
              test_ref_fp32_to_fp16(first));
}

/* ---- BF16 --------------------------------------------------------------------------------- */

static void test_bf16_exhaustive(void) {
    uint32_t b, bad_value = 0, bad_trip = 0, first_value = 0, first_trip = 0;
    for (b = 0; b < 0x10000u; b++) {
        float f = kvmix_bf16_to_fp32((uint16_t)b);
        int is_nan = ((b >> 7) & 0xff) == 0xff && (b & 0x7f) != 0;
        int value_ok = test_float_bits(f) == b << 16;
        int trip_ok = kvmix_fp32_to_bf16(f) == (is_nan ? 0x7fff : b);
        if (!value_ok && bad_value++ == 0) first_value = b;
        if (!trip_ok && bad_trip++ == 0) first_trip = b;
    }
    CHECK_MSG(bad_value == 0,
              "kvmix_bf16_to_fp32 is the upper half of the float (%lu wrong, "
              "first 0x%04lx)",
              (unsigned long)bad_value, (unsigned long)first_value);
    CHECK_MSG(bad_trip == 0, "bf16 -> fp32 -> bf16 round trip (%lu wrong, first 0x%04lx)",
              (unsigned long)bad_trip, (unsigned long)first_trip);
}

static void test_bf16_hand_picked(void) {
    static const struct {
        uint32_t bits;
        uint16_t bf16;
        const char *what;
    } cases[] = {
        {0x3f800000u, 0x3f80, "one"},
        {0x80000000u, 0x8000, "negative zero"},
        {0x3f808000u, 0x3f80, "1 + 2^-8: tie -> even 0x3f80"},
        {0x3f818000u, 0x3f82, "1 + 3*2^-8: tie -> even 0x3f82"},
        {0x3f808001u, 0x3f81, "just above the tie"},
        {0x3f807fffu, 0x3f80, "just below the tie"},
        {0x7f7fffffu, 0x7f80, "FLT_MAX rounds to infinity"},
        {0x7f7f7fffu, 0x7f7f, "largest float rounding to the largest bfloat16"},
        {0x7f7f8000u, 0x7f80, "tie above the largest bfloat16 (odd) -> infinity"},
        {0xff7fffffu, 0xff80, "-FLT_MAX -> -infinity"},
        {0x7f800000u, 0x7f80, "infinity"},
        {0xff800000u, 0xff80, "-infinity"},
        {0x00008000u, 0x0000, "subnormal tie -> 0"},
        {0x00018000u, 0x0002, "subnormal tie -> even 0x0002"},
        {0x007fffffu, 0x0080, "largest subnormal rounds up to FLT_MIN"},
        {0x7fc00000u, 0x7fff, "quiet NaN"},
        {0xffc00000u, 0x7fff, "negative NaN"},
        {0x7f800001u, 0x7fff, "signalling NaN with payload 1 (truncation would give infinity)"},
        {0x7fffffffu, 0x7fff, "NaN with all payload bits"},
    };
    size_t i;
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float f = test_bits_float(cases[i].bits);
        CHECK_MSG(kvmix_fp32_to_bf16(f) == cases[i].bf16,
                  "kvmix_fp32_to_bf16(0x%08lx) (%s) = 0x%04x, expected 0x%04x",
                  (unsigned long)cases[i].bits, cases[i].what, kvmix_fp32_to_bf16(f),
                  cases[i].bf16);
        CHECK_MSG(test_ref_fp32_to_bf16(f) == cases[i].bf16, "test reference agrees on %s",
                  cases[i].what);
    }
}

static void test_bf16_random(void) {
    test_rng rng;
    uint32_t i, bad = 0;
    float first = 0.0f;
    test_rng_init(&rng, "core/bf16_random");
    for (i = 0; i < N_RANDOM_FLOATS; i++) {
        float f = random_conversion_input(&rng, 1);
        if (kvmix_fp32_to_bf16(f) != test_ref_fp32_to_bf16(f) && bad++ == 0) first = f;
    }
    CHECK_MSG(bad == 0,
              "kvmix_fp32_to_bf16 equals the double-arithmetic reference on %d random floats "
              "(%lu differ, first 0x%08lx: 0x%04x, reference 0x%04x)",
              N_RANDOM_FLOATS, (unsigned long)bad, (unsigned long)test_float_bits(first),
              kvmix_fp32_to_bf16(first), test_ref_fp32_to_bf16(first));
}

/* Format names are the lowercase spellings policies use; unknown values say so. */
static void test_format_names(void) {
    static const struct {
        kvmix_format format;
        const char *name;
    } names[] = {{KVMIX_FORMAT_FP16, "fp16"},
                 {KVMIX_FORMAT_INT8, "int8"},
                 {KVMIX_FORMAT_INT4, "int4"},
                 {KVMIX_FORMAT_INT2, "int2"},
                 {KVMIX_FORMAT_INT2_CHANNEL, "int2_channel"},
                 {KVMIX_FORMAT_BOOSTED, "boosted"}};
    size_t i;
    for (i = 0; i < sizeof names / sizeof names[0]; i++)
        CHECK_MSG(strcmp(kvmix_format_name(names[i].format), names[i].name) == 0,
                  "format %d is named %s, expected %s", (int)names[i].format,
                  kvmix_format_name(names[i].format), names[i].name);
    CHECK(strcmp(kvmix_format_name((kvmix_format)0), "unknown") == 0);
    CHECK(strcmp(kvmix_format_name((kvmix_format)7), "unknown") == 0);
}

void unit_core(void) {
    test_format_names();
    test_result_strings();
    test_version();
    test_fp16_exhaustive();
    test_fp16_hand_picked();
    test_fp16_random();
    test_bf16_exhaustive();
    test_bf16_hand_picked();
    test_bf16_random();
}
