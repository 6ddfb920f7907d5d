/* Test harness for kvmix's host tests: check macros that count passes and failures, a
   deterministic pseudo-random generator, and the reference conversions the units share.

   A unit file defines one entry function `void unit_<name>(void)`, declared below and listed in
   main() (tests/harness.c). Checks print nothing when they pass; a failing check prints
   file:line, what failed, the values involved and the current context (test_context). The
   program ends with the line "N passed, N failed" and exits nonzero when any check failed.

   Inputs are fresh on every run: the seed comes from the clock unless KVMIX_TEST_SEED is set,
   and it is printed at the start and again with the first failure. Every test draws from its
   own stream (test_rng_init with a name), so running one unit alone replays the same inputs. */
#ifndef KVMIX_TESTS_HARNESS_H
#define KVMIX_TESTS_HARNESS_H

#include <stddef.h>
#include <stdint.h>

#include "kvmix.h"

/* ---- unit entry points (add new units here and to the table in harness.c) ---------------- */
void unit_core(void);
void unit_formats(void);
void unit_attention(void);
void unit_cache(void);
void unit_device_arena(void);
void unit_view(void);
void unit_fast_decode(void);
void unit_transfer(void);
void unit_policy(void);
void unit_alloc(void);
void unit_tags(void);
void unit_intent(void);
void unit_residual(void);
void unit_tiers(void);
void unit_transfer_plan(void);
void unit_pd_nccl(void);

/* ---- checks ------------------------------------------------------------------------------- */
#if defined(__GNUC__) || defined(__clang__)
#define TEST_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define TEST_PRINTF(fmt_index, first_arg)
#endif

/* Each returns `ok` (nonzero when the check passed) so a caller can stop early. */
int test_check(int ok, const char *file, int line, const char *fmt, ...) TEST_PRINTF(4, 5);
int test_check_int(long long a, long long b, const char *ea, const char *eb, const char *file,
                   int line);
int test_check_uint(unsigned long long a, unsigned long long b, const char *ea, const char *eb,
                    const char *file, int line);
int test_check_near(double a, double b, double tol, const char *ea, const char *eb,
                    const char *file, int line);
int test_check_float_bits(float a, float b, const char *ea, const char *eb, const char *file,
                          int line);
int test_check_result(kvmix_result got, kvmix_result want, const char *expr, const char *file,
                      int line);
int test_check_mem(const void *a, const void *b, size_t n, const char *ea, const char *eb,
                   const char *file, int line);
int test_check_error(kvmix_error got, const char *field, const char *expr, const char *file,
                     int line);

/* CHECK(cond); CHECK_MSG(cond, printf-format, ...) */
#define CHECK(cond)          test_check((cond) != 0, __FILE__, __LINE__, "CHECK(%s)", #cond)
#define CHECK_MSG(cond, ...) test_check((cond) != 0, __FILE__, __LINE__, __VA_ARGS__)
/* a == b as signed / unsigned integers */
#define CHECK_EQ_INT(a, b)                                                                         \
    test_check_int((long long)(a), (long long)(b), #a, #b, __FILE__, __LINE__)
#define CHECK_EQ_UINT(a, b)                                                                        \
    test_check_uint((unsigned long long)(a), (unsigned long long)(b), #a, #b, __FILE__, __LINE__)
/* |a - b| <= tol in double; NaN never passes */
#define CHECK_NEAR(a, b, tol)                                                                      \
    test_check_near((double)(a), (double)(b), (double)(tol), #a, #b, __FILE__, __LINE__)
/* identical float bit patterns (tells -0 from +0; any NaN equals itself bit for bit) */
#define CHECK_EQ_FLOAT_BITS(a, b) test_check_float_bits((a), (b), #a, #b, __FILE__, __LINE__)
/* a kvmix_result equal to `want`; prints both with their descriptions */
#define CHECK_RESULT(expr, want) test_check_result((expr), (want), #expr, __FILE__, __LINE__)
/* a kvmix_error naming `field` with a reason; for field "" (success), reason "" too */
#define CHECK_ERROR(why, field) test_check_error((why), (field), #why, __FILE__, __LINE__)
/* n bytes equal; prints the first differing offset */
#define CHECK_MEM_EQ(a, b, n) test_check_mem((a), (b), (n), #a, #b, __FILE__, __LINE__)

/* Context printed with every failure until replaced; test_context(NULL) clears it. */
void test_context(const char *fmt, ...) TEST_PRINTF(1, 2);

/* Totals so far (for units that want to stop after a failure). */
uint64_t test_failed_count(void);

/* ---- pseudo-random numbers ---------------------------------------------------------------- */
typedef struct test_rng {
    uint64_t state;
    int has_spare;
    double spare;
} test_rng;

uint64_t test_seed(void);
/* A stream of the run's seed, named so that each test's inputs do not depend on the others. */
void test_rng_init(test_rng *rng, const char *stream);
/* A stream of an explicit seed (fuzz driver, benchmarks). */
void test_rng_seed(test_rng *rng, uint64_t seed);
uint64_t test_rng_u64(test_rng *rng);
uint32_t test_rng_u32(test_rng *rng);
int32_t test_rng_range(test_rng *rng, int32_t lo, int32_t hi); /* uniform in [lo, hi] */
double test_rng_unit(test_rng *rng);                           /* uniform in [0, 1) */
double test_rng_normal(test_rng *rng);                         /* standard normal */

/* ---- shared references and helpers ----------------------------------------------------------- */
/* Value of a half (double arithmetic from its fields; NaN for NaN, +-infinity for infinities). */
double test_ref_fp16_value(uint16_t half);
/* Nearest half to `value`, ties to the even code, found by comparing with both neighbours in
   double; |value| >= 65520 gives infinity, NaN gives 0x7FFF. Independent of kvmix's code. */
uint16_t test_ref_fp32_to_fp16(float value);
/* The same for bfloat16 (neighbours by truncating the float's bits). */
uint16_t test_ref_fp32_to_bf16(float value);

/* A layout of the given fields (format, n_tokens, head_dim, group_size, n_boost). */
kvmix_layout test_layout(kvmix_format format, int32_t n_tokens, int32_t head_dim,
                         int32_t group_size, int32_t n_boost);

uint32_t test_float_bits(float value);
float test_bits_float(uint32_t bits);

/* malloc that ends the test program on failure; exact sizes, so ASan sees overreads. */
void *test_alloc(size_t bytes);
/* Fills n bytes with a pattern that depends on the offset and `salt`. */
void test_poison(void *p, size_t n, uint32_t salt);
/* Nonzero when n bytes still hold test_poison(p, n, salt). */
int test_is_poisoned(const void *p, size_t n, uint32_t salt);

#endif /* KVMIX_TESTS_HARNESS_H */
