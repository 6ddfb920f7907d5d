/* unit_transfer_plan: the tiers of a transfer per mode (examples/transfer_plan.c) and the round
   trip of rows through payloads: the tiered policy puts a heavy token above its neighbours and
   pins the sinks, norms follow the rows, uniform modes ignore the budget, the random mix is
   seeded, ends keeps the sinks and the most recent and drops the rest; rows come back as the
   codec decodes them (FP16 exact to FP16, INT8 close, dropped zero) and the bytes match the
   plan's cost; bad specs and arguments are refused. */
#include "harness.h"
#include "transfer_plan.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { L = 2, N = 96, H = 2, D = 64, ROW = H * D };

static void fill_rows(float *keys, float *values) {
    for (int32_t i = 0; i < L * N * ROW; i++) {
        keys[i] = sinf(0.37f * (float)i) * 2.0f;
        values[i] = cosf(0.11f * (float)i);
    }
}

static void test_parse(void) {
    transfer_setup s = {0};
    char err[128];
    s.n_sink = 4;
    CHECK_RESULT(transfer_parse("tiered:0.46:0.005", &s, err, sizeof err), KVMIX_SUCCESS);
    CHECK(s.mode == TRANSFER_TIERED && s.budget == 0.46 && s.lambda == 0.005 && s.n_sink == 4);
    CHECK_RESULT(transfer_parse("ends:0.6", &s, err, sizeof err), KVMIX_SUCCESS);
    CHECK(s.mode == TRANSFER_ENDS && s.lambda == 0.0);
    CHECK(strcmp(transfer_mode_name(TRANSFER_SINKS), "sinks") == 0 && !transfer_mode_name(99));
    const char *bad[] = {"int8:0.5:0.01", "tiered:0", "tiered:1.5",    "fast:0.4",
                         "tiered:0.4x",   "tiered",   "tiered:0.4:-1", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        transfer_setup before = s;
        CHECK_RESULT(transfer_parse(bad[i], &s, err, sizeof err), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK(memcmp(&before, &s, sizeof s) == 0);
    }
    CHECK_RESULT(transfer_parse(NULL, &s, err, sizeof err), KVMIX_ERR_NULL_POINTER);
}

static int32_t count_tier(const uint8_t *tiers, uint8_t tier) {
    int32_t n = 0;
    for (int32_t j = 0; j < N; j++) n += tiers[j] == tier;
    return n;
}

static void test_modes(float *keys, float *values) {
    transfer_setup s = {TRANSFER_TIERED, 0.46, 0.0, 4, 1, 0, 7};
    float attention[N];
    uint8_t tiers[N], again[N];
    kvmix_tier_plan plan;
    char err[128];
    int32_t j;
    for (j = 0; j < N; j++) attention[j] = 1.0f;
    attention[50] = 100.0f;
    CHECK_RESULT(
        transfer_choose(&s, attention, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
        KVMIX_SUCCESS);
    for (j = 0; j < 4; j++) CHECK(tiers[j] == KVMIX_FORMAT_FP16);
    CHECK(tiers[50] == KVMIX_FORMAT_INT8 && plan.cost <= 0.46 && plan.n_int4 > 0);
    CHECK_EQ_INT(plan.n_fp16 + plan.n_int8 + plan.n_int4 + plan.n_dropped, N);
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_ERR_NULL_POINTER);
    /* norms: a token with large rows on one layer is kept higher */
    s.mode = TRANSFER_NORMS;
    for (j = 0; j < ROW; j++) keys[(size_t)(N + 70) * ROW + j] = 40.0f; /* layer 1, token 70 */
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    CHECK(tiers[70] == KVMIX_FORMAT_INT8);
    fill_rows(keys, values);
    /* uniform tiers whatever the budget */
    s.mode = TRANSFER_INT4;
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    CHECK(count_tier(tiers, KVMIX_FORMAT_INT4) == N && plan.cost == 0.3125);
    s.mode = TRANSFER_INT8;
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    CHECK(count_tier(tiers, KVMIX_FORMAT_INT8) == N && plan.n_int8 == N);
    /* the random mix: seeded, the sinks pinned only by SINKS */
    s.mode = TRANSFER_SINKS;
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    for (j = 0; j < 4; j++) CHECK(tiers[j] == KVMIX_FORMAT_FP16);
    s.mode = TRANSFER_RANDOM;
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    CHECK(count_tier(tiers, KVMIX_FORMAT_FP16) == 0 && plan.cost <= 0.46);
    s.seed = 8;
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, again, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    CHECK(memcmp(tiers, again, N) != 0);
    /* ends: 44 of 96 at FP16, the 4 sinks and the 40 most recent */
    s.mode = TRANSFER_ENDS;
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    for (j = 0; j < N; j++)
        CHECK(tiers[j] == (j < 4 || j >= N - 40 ? KVMIX_FORMAT_FP16 : KVMIX_PAYLOAD_NO_ROW));
    CHECK(plan.n_fp16 == 44 && plan.n_dropped == 52);
    s.n_sink = N + 1;
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_ERR_INVALID_ARGUMENT);
}

/* Rows sent at tiers come back as the codec decodes them, the bytes as the plan costs. */
static void test_round_trip(float *keys, float *values) {
    transfer_setup s = {TRANSFER_ENDS, 0.5, 0.0, 4, 1, 0, 0};
    static float k[L * N * ROW], v[L * N * ROW];
    uint8_t tiers[N];
    kvmix_tier_plan plan;
    size_t bytes = 0, fp16_bytes = 0;
    char err[128];
    int32_t j, i;
    for (j = 0; j < N; j++) tiers[j] = j % 3 == 0 ? KVMIX_FORMAT_FP16 : KVMIX_FORMAT_INT8;
    tiers[5] = KVMIX_PAYLOAD_NO_ROW;
    memcpy(k, keys, sizeof k);
    memcpy(v, values, sizeof v);
    CHECK_RESULT(
        transfer_round_trip(tiers, 0, k, v, L, N, H, D, &bytes, &fp16_bytes, err, sizeof err),
        KVMIX_SUCCESS);
    for (int32_t l = 0; l < L; l++)
        for (j = 0; j < N; j++)
            for (i = 0; i < ROW; i++) {
                size_t at = ((size_t)l * N + (size_t)j) * ROW + (size_t)i;
                if (tiers[j] == KVMIX_PAYLOAD_NO_ROW)
                    CHECK(k[at] == 0.0f && v[at] == 0.0f);
                else if (tiers[j] == KVMIX_FORMAT_FP16)
                    CHECK(k[at] == kvmix_fp16_to_fp32(kvmix_fp32_to_fp16(keys[at])));
                else
                    CHECK(fabsf(k[at] - keys[at]) < 0.02f && fabsf(v[at] - values[at]) < 0.01f);
            }
    /* an ends plan's bytes over all-FP16 payloads: its cost plus the payloads' heads */
    CHECK_RESULT(transfer_choose(&s, NULL, keys, values, L, N, H, D, tiers, &plan, err, sizeof err),
                 KVMIX_SUCCESS);
    memcpy(k, keys, sizeof k);
    memcpy(v, values, sizeof v);
    CHECK_RESULT(
        transfer_round_trip(tiers, 0, k, v, L, N, H, D, &bytes, &fp16_bytes, err, sizeof err),
        KVMIX_SUCCESS);
    CHECK_NEAR((double)bytes / (double)fp16_bytes, plan.cost, 0.02);
    CHECK_RESULT(transfer_round_trip(tiers, 0, k, v, 0, N, H, D, &bytes, NULL, err, sizeof err),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(transfer_round_trip(tiers, 48, k, v, L, N, H, D, &bytes, NULL, err, sizeof err),
                 KVMIX_ERR_BAD_SHAPE);
}

void unit_transfer_plan(void) {
    static float keys[L * N * ROW], values[L * N * ROW];
    fill_rows(keys, values);
    test_parse();
    test_modes(keys, values);
    test_round_trip(keys, values);
}
