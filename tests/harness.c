/* Test harness: check bookkeeping, the pseudo-random generator, shared references and main().
   Usage: unit_tests [UNIT...]   runs the named units (with or without the "unit_" prefix), or
   all of them; --list prints the names. KVMIX_TEST_SEED=N repeats a run's inputs. */
#include "harness.h"

#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the units ------------------------------------------------------------------------------ */
typedef struct test_unit {
    const char *name;
    void (*run)(void);
} test_unit;

static const test_unit test_units[] = {
    {"unit_core", unit_core},
    {"unit_formats", unit_formats},
    {"unit_attention", unit_attention},
    {"unit_cache", unit_cache},
    {"unit_view", unit_view},
    {"unit_fast_decode", unit_fast_decode},
    {"unit_transfer", unit_transfer},
    {"unit_policy", unit_policy},
    {"unit_alloc", unit_alloc},
    {"unit_tags", unit_tags},
    {"unit_device_arena", unit_device_arena},
    {"unit_intent", unit_intent},
    {"unit_residual", unit_residual},
    {"unit_tiers", unit_tiers},
    {"unit_transfer_plan", unit_transfer_plan},
    {"unit_pd_nccl", unit_pd_nccl},
};

#define TEST_N_UNITS              (sizeof test_units / sizeof test_units[0])
#define TEST_MAX_PRINTED_FAILURES 100

/* ---- check bookkeeping ---------------------------------------------------------------------- */
static uint64_t test_passed, test_failed, test_seed_value;
static const char *test_current_unit = "";
static char test_context_text[512];

uint64_t test_failed_count(void) { return test_failed; }

void test_context(const char *fmt, ...) {
    va_list args;
    if (!fmt) {
        test_context_text[0] = '\0';
        return;
    }
    va_start(args, fmt);
    vsnprintf(test_context_text, sizeof test_context_text, fmt, args);
    va_end(args);
}

/* Prints the head of a failure message: location, seed on the first failure. Returns 0 when
   the message should be left out because too many were printed already. */
static int test_fail_begin(const char *file, int line) {
    test_failed++;
    if (test_failed == 1)
        printf("first failure; inputs repeat with KVMIX_TEST_SEED=%llu\n",
               (unsigned long long)test_seed_value);
    if (test_failed > TEST_MAX_PRINTED_FAILURES) {
        if (test_failed == TEST_MAX_PRINTED_FAILURES + 1)
            printf("(further failures are counted but not printed)\n");
        return 0;
    }
    printf("%s:%d: [%s] ", file, line, test_current_unit);
    return 1;
}

static void test_fail_end(void) {
    if (test_context_text[0]) printf("\n    context: %s", test_context_text);
    printf("\n");
    fflush(stdout);
}

int test_check(int ok, const char *file, int line, const char *fmt, ...) {
    va_list args;
    if (ok) {
        test_passed++;
        return 1;
    }
    if (!test_fail_begin(file, line)) return 0;
    va_start(args, fmt);
    vprintf(fmt, args);
    va_end(args);
    printf(" failed");
    test_fail_end();
    return 0;
}

int test_check_int(long long a, long long b, const char *ea, const char *eb, const char *file,
                   int line) {
    if (a == b) {
        test_passed++;
        return 1;
    }
    if (test_fail_begin(file, line)) {
        printf("CHECK_EQ_INT(%s, %s) failed: %lld != %lld", ea, eb, a, b);
        test_fail_end();
    }
    return 0;
}

int test_check_uint(unsigned long long a, unsigned long long b, const char *ea, const char *eb,
                    const char *file, int line) {
    if (a == b) {
        test_passed++;
        return 1;
    }
    if (test_fail_begin(file, line)) {
        printf("CHECK_EQ_UINT(%s, %s) failed: %llu (0x%llx) != %llu (0x%llx)", ea, eb, a, a, b, b);
        test_fail_end();
    }
    return 0;
}

int test_check_near(double a, double b, double tol, const char *ea, const char *eb,
                    const char *file, int line) {
    if (fabs(a - b) <= tol) { /* false for NaN */
        test_passed++;
        return 1;
    }
    if (test_fail_begin(file, line)) {
        printf("CHECK_NEAR(%s, %s) failed: %.9g vs %.9g, difference %.3g > tolerance %.3g", ea, eb,
               a, b, fabs(a - b), tol);
        test_fail_end();
    }
    return 0;
}

int test_check_float_bits(float a, float b, const char *ea, const char *eb, const char *file,
                          int line) {
    if (test_float_bits(a) == test_float_bits(b)) {
        test_passed++;
        return 1;
    }
    if (test_fail_begin(file, line)) {
        printf("CHECK_EQ_FLOAT_BITS(%s, %s) failed: %.9g (0x%08lx) != %.9g (0x%08lx)", ea, eb,
               (double)a, (unsigned long)test_float_bits(a), (double)b,
               (unsigned long)test_float_bits(b));
        test_fail_end();
    }
    return 0;
}

int test_check_result(kvmix_result got, kvmix_result want, const char *expr, const char *file,
                      int line) {
    if (got == want) {
        test_passed++;
        return 1;
    }
    if (test_fail_begin(file, line)) {
        printf("%s returned %d (%s), expected %d (%s)", expr, (int)got, kvmix_result_string(got),
               (int)want, kvmix_result_string(want));
        test_fail_end();
    }
    return 0;
}

int test_check_error(kvmix_error got, const char *field, const char *expr, const char *file,
                     int line) {
    int named = got.field && got.reason && strcmp(got.field, field) == 0;
    if (named && (field[0] ? got.reason[0] != 0 : got.reason[0] == 0)) {
        test_passed++;
        return 1;
    }
    if (test_fail_begin(file, line)) {
        printf("%s is {\"%s\", \"%s\"}, expected field \"%s\" with %s", expr,
               got.field ? got.field : "(null)", got.reason ? got.reason : "(null)", field,
               field[0] ? "a reason" : "reason \"\"");
        test_fail_end();
    }
    return 0;
}

int test_check_mem(const void *a, const void *b, size_t n, const char *ea, const char *eb,
                   const char *file, int line) {
    const uint8_t *pa = (const uint8_t *)a, *pb = (const uint8_t *)b;
    size_t i, first = n, count = 0;
    for (i = 0; i < n; i++)
        if (pa[i] != pb[i]) {
            if (first == n) first = i;
            count++;
        }
    if (count == 0) {
        test_passed++;
        return 1;
    }
    if (test_fail_begin(file, line)) {
        printf("CHECK_MEM_EQ(%s, %s, %zu) failed: %zu bytes differ, first at offset %zu "
               "(0x%02x != 0x%02x)",
               ea, eb, n, count, first, pa[first], pb[first]);
        test_fail_end();
    }
    return 0;
}

/* ---- pseudo-random numbers (splitmix64 steps) ------------------------------------------------ */
uint64_t test_seed(void) { return test_seed_value; }

static uint64_t test_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void test_rng_seed(test_rng *rng, uint64_t seed) {
    rng->state = test_mix64(seed ^ 0x6a09e667f3bcc909ull);
    rng->has_spare = 0;
    rng->spare = 0.0;
}

void test_rng_init(test_rng *rng, const char *stream) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a of the stream name */
    const char *p;
    for (p = stream; *p; p++) h = (h ^ (uint8_t)*p) * 0x100000001b3ull;
    test_rng_seed(rng, test_seed_value ^ test_mix64(h));
}

uint64_t test_rng_u64(test_rng *rng) {
    rng->state += 0x9e3779b97f4a7c15ull;
    return test_mix64(rng->state);
}

uint32_t test_rng_u32(test_rng *rng) { return (uint32_t)(test_rng_u64(rng) >> 32); }

int32_t test_rng_range(test_rng *rng, int32_t lo, int32_t hi) {
    uint64_t span = (uint64_t)((int64_t)hi - (int64_t)lo) + 1u;
    return (int32_t)((int64_t)lo + (int64_t)(test_rng_u64(rng) % span));
}

double test_rng_unit(test_rng *rng) { return (double)(test_rng_u64(rng) >> 11) * 0x1p-53; }

double test_rng_normal(test_rng *rng) {
    double u, v, r;
    if (rng->has_spare) {
        rng->has_spare = 0;
        return rng->spare;
    }
    u = 1.0 - test_rng_unit(rng); /* (0, 1] */
    v = test_rng_unit(rng);
    r = sqrt(-2.0 * log(u));
    rng->spare = r * sin(6.283185307179586 * v);
    rng->has_spare = 1;
    return r * cos(6.283185307179586 * v);
}

/* ---- shared references -------------------------------------------------------------------- */
kvmix_layout test_layout(kvmix_format format, int32_t n_tokens, int32_t head_dim,
                         int32_t group_size, int32_t n_boost) {
    kvmix_layout l;
    memset(&l, 0, sizeof l);
    l.format = format;
    l.n_tokens = n_tokens;
    l.head_dim = head_dim;
    l.group_size = group_size;
    l.n_boost = n_boost;
    return l;
}

uint32_t test_float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

float test_bits_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

double test_ref_fp16_value(uint16_t half) {
    int exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff;
    double magnitude;
    if (exponent == 0x1f)
        magnitude = mantissa ? NAN : INFINITY;
    else if (exponent == 0)
        magnitude = ldexp((double)mantissa, -24);
    else
        magnitude = ldexp((double)(1024 + mantissa), exponent - 25);
    return (half & 0x8000) ? -magnitude : magnitude;
}

/* Values of the positive finite halves 0x0000 .. 0x7BFF, and 65536 as the value "one step above
   65504" for rounding purposes (the overflow threshold 65520 is their midpoint). */
static double test_half_table[0x7c01];
static int test_half_table_ready;

uint16_t test_ref_fp32_to_fp16(float value) {
    uint16_t sign = signbit(value) ? 0x8000u : 0;
    double a = fabs((double)value), below, above;
    uint32_t lo = 0, hi = 0x7bff, code;
    if (isnan(value)) return 0x7fff;
    if (a >= 65520.0) return (uint16_t)(sign | 0x7c00u);
    if (!test_half_table_ready) {
        for (code = 0; code < 0x7c00; code++)
            test_half_table[code] = test_ref_fp16_value((uint16_t)code);
        test_half_table[0x7c00] = 65536.0;
        test_half_table_ready = 1;
    }
    while (lo < hi) { /* largest code whose value is <= a */
        uint32_t mid = (lo + hi + 1) / 2;
        if (test_half_table[mid] <= a)
            lo = mid;
        else
            hi = mid - 1;
    }
    below = a - test_half_table[lo];
    above = test_half_table[lo + 1] - a;
    if (below < above || (below == above && (lo & 1u) == 0))
        code = lo;
    else
        code = lo + 1;
    return (uint16_t)(sign | code);
}

uint16_t test_ref_fp32_to_bf16(float value) {
    uint32_t bits = test_float_bits(value), sign = bits & 0x80000000u, mag = bits & 0x7fffffffu;
    uint32_t lo, up, code;
    double a, below, above;
    if (isnan(value)) return 0x7fff;
    if (mag == 0x7f800000u) return (uint16_t)((sign | mag) >> 16);
    lo = mag & 0xffff0000u; /* truncation: the bfloat16 at or below |value| */
    up = lo + 0x10000u;     /* the next one up (0x7f800000 stands for 2^128) */
    a = (double)test_bits_float(mag);
    below = a - (double)test_bits_float(lo);
    above = (up == 0x7f800000u ? ldexp(1.0, 128) : (double)test_bits_float(up)) - a;
    if (below < above || (below == above && ((lo >> 16) & 1u) == 0))
        code = lo;
    else
        code = up;
    return (uint16_t)((sign | code) >> 16);
}

void *test_alloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        printf("test_alloc: out of memory (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

static uint8_t test_poison_byte(size_t i, uint32_t salt) {
    return (uint8_t)(0xa5u ^ (uint32_t)(i * 131u) ^ (uint32_t)(i >> 8) ^ (salt * 0x9du));
}

void test_poison(void *p, size_t n, uint32_t salt) {
    size_t i;
    for (i = 0; i < n; i++) ((uint8_t *)p)[i] = test_poison_byte(i, salt);
}

int test_is_poisoned(const void *p, size_t n, uint32_t salt) {
    size_t i;
    for (i = 0; i < n; i++)
        if (((const uint8_t *)p)[i] != test_poison_byte(i, salt)) return 0;
    return 1;
}

/* ---- main ----------------------------------------------------------------------------------- */
static int test_unit_selected(const char *name, int argc, char **argv) {
    int i;
    if (argc <= 1) return 1;
    for (i = 1; i < argc; i++)
        if (strcmp(argv[i], name) == 0 || strcmp(argv[i], name + strlen("unit_")) == 0) return 1;
    return 0;
}

int main(int argc, char **argv) {
    const char *seed_text = getenv("KVMIX_TEST_SEED");
    size_t u;
    int i;
    for (i = 1; i < argc; i++) {
        int known = 0;
        if (strcmp(argv[i], "--list") == 0) {
            for (u = 0; u < TEST_N_UNITS; u++) printf("%s\n", test_units[u].name);
            return 0;
        }
        for (u = 0; u < TEST_N_UNITS; u++)
            if (strcmp(argv[i], test_units[u].name) == 0 ||
                strcmp(argv[i], test_units[u].name + strlen("unit_")) == 0)
                known = 1;
        if (!known) {
            printf("unknown unit \"%s\" (--list prints the units)\n", argv[i]);
            return 2;
        }
    }
    if (seed_text && seed_text[0]) {
        char *end;
        test_seed_value = (uint64_t)strtoull(seed_text, &end, 0);
        if (*end) {
            printf("KVMIX_TEST_SEED must be an integer, not \"%s\"\n", seed_text);
            return 2;
        }
    } else {
        test_seed_value =
            test_mix64((uint64_t)time(NULL) ^ ((uint64_t)clock() << 32)) % 1000000000ull;
    }
    printf("kvmix tests: seed %llu (KVMIX_TEST_SEED=%llu repeats this run)\n",
           (unsigned long long)test_seed_value, (unsigned long long)test_seed_value);
    for (u = 0; u < TEST_N_UNITS; u++) {
        uint64_t passed0 = test_passed, failed0 = test_failed;
        if (!test_unit_selected(test_units[u].name, argc, argv)) continue;
        test_current_unit = test_units[u].name;
        test_context(NULL);
        test_units[u].run();
        printf("%-16s %llu passed, %llu failed\n", test_units[u].name,
               (unsigned long long)(test_passed - passed0),
               (unsigned long long)(test_failed - failed0));
        fflush(stdout);
    }
    printf("%llu passed, %llu failed\n", (unsigned long long)test_passed,
           (unsigned long long)test_failed);
    return test_failed ? 1 : 0;
}
