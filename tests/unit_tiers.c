/* unit_tiers: transfer tiers. Real costs with metadata (INT8 0.5625, INT4 0.3125 of FP16 at group
   32); importance with its recency decay and the norm fallback; the choice under a budget: sinks
   FP16 first, only two adjacent tiers, the most important taking the higher one, as many as the
   budget allows and no more, FP16 + INT8 only without INT4, the least important dropped as a last
   resort; the probe's vote; bad input changes nothing. */
#include "harness.h"

#include <math.h>
#include <string.h>

static void test_costs(void) {
    double c[3];
    CHECK_RESULT(kvmix_tier_costs(128, 0, c), KVMIX_SUCCESS);
    CHECK(c[0] == 1.0 && c[1] == 0.5625 && c[2] == 0.3125);
    CHECK_RESULT(kvmix_tier_costs(64, 64, c), KVMIX_SUCCESS);
    CHECK(c[1] == (64.0 + 4.0) / 128.0 && c[2] == (32.0 + 4.0) / 128.0);
    CHECK_RESULT(kvmix_tier_costs(100, 32, c), KVMIX_ERR_BAD_SHAPE);
    CHECK_RESULT(kvmix_tier_costs(128, 48, c), KVMIX_ERR_BAD_SHAPE);
    CHECK_RESULT(kvmix_tier_costs(128, 32, NULL), KVMIX_ERR_NULL_POINTER);
}

static void test_importance(void) {
    float stat[4] = {1.0f, 2.0f, 0.0f, 4.0f}, out[4], keys[8], values[8];
    int32_t j;
    CHECK_RESULT(kvmix_tier_importance(stat, 4, 0.01, out), KVMIX_SUCCESS);
    for (j = 0; j < 4; j++) CHECK_NEAR(out[j], stat[j] * exp(-0.01 * (3 - j)), 1e-6);
    stat[2] = -1.0f;
    out[0] = 9.0f;
    CHECK_RESULT(kvmix_tier_importance(stat, 4, 0.01, out), KVMIX_ERR_BAD_VALUE);
    CHECK(out[0] == 9.0f);
    CHECK_RESULT(kvmix_tier_importance(stat, 4, -0.1, out), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_tier_importance(stat, 4, INFINITY, out), KVMIX_ERR_INVALID_ARGUMENT);
    for (j = 0; j < 8; j++) keys[j] = (float)j, values[j] = 1.0f;
    CHECK_RESULT(kvmix_tier_norms(keys, values, 2, 4, out), KVMIX_SUCCESS);
    CHECK_NEAR(out[0], sqrt(0.0 + 1 + 4 + 9 + 4), 1e-6);
    CHECK_NEAR(out[1], sqrt(16.0 + 25 + 36 + 49 + 4), 1e-6);
    keys[5] = NAN;
    CHECK_RESULT(kvmix_tier_norms(keys, values, 2, 4, out), KVMIX_ERR_BAD_VALUE);
    CHECK_RESULT(kvmix_tier_norms(keys, values, 2, 0, out), KVMIX_ERR_INVALID_ARGUMENT);
}

static kvmix_tier_desc tier_desc(int32_t n, int32_t sinks, double budget, int32_t int4) {
    kvmix_tier_desc d;
    memset(&d, 0, sizeof d);
    d.n_tokens = n, d.head_dim = 128, d.n_sink = sinks, d.budget = budget, d.allow_int4 = int4;
    return d;
}

/* One choice checked against the rules; returns the plan. */
static kvmix_tier_plan choose(const kvmix_tier_desc *d, const float *importance, uint8_t *tiers) {
    static const double cost_of[8] = {0, 1.0, 0.5625, 0.3125};
    kvmix_tier_plan plan;
    double cost = 0.0, upgrade;
    int32_t j, k, counts[8] = {0};
    memset(&plan, 0, sizeof plan);
    CHECK_RESULT(kvmix_tier_choose(d, importance, tiers, &plan, NULL), KVMIX_SUCCESS);
    for (j = 0; j < d->n_tokens; j++) {
        counts[tiers[j]]++;
        cost += cost_of[tiers[j]];
        if (j < d->n_sink) CHECK_EQ_INT(tiers[j], KVMIX_FORMAT_FP16);
    }
    CHECK_EQ_INT(counts[KVMIX_FORMAT_FP16], plan.n_fp16);
    CHECK_EQ_INT(counts[KVMIX_FORMAT_INT8], plan.n_int8);
    CHECK_EQ_INT(counts[KVMIX_FORMAT_INT4], plan.n_int4);
    CHECK_EQ_INT(counts[KVMIX_PAYLOAD_NO_ROW], plan.n_dropped);
    CHECK_NEAR(cost / d->n_tokens, plan.cost, 1e-12);
    if (d->n_sink <= d->budget * d->n_tokens) CHECK(plan.cost <= d->budget + 1e-12);
    /* two adjacent tiers outside the sinks: FP16 never meets INT4 there */
    CHECK(plan.n_int4 == 0 || plan.n_fp16 == d->n_sink);
    /* no more fits: one more upgrade of the cheapest sent token (or one more sent) breaks it */
    upgrade = plan.n_dropped > 0 ? (plan.n_int4 > 0 || d->allow_int4 ? 0.3125 : 0.5625)
              : plan.n_int4 > 0  ? 0.5625 - 0.3125
              : plan.n_int8 > 0  ? 1.0 - 0.5625
                                 : INFINITY;
    CHECK(plan.cost + upgrade / d->n_tokens > d->budget - 1e-12);
    /* a more important token never travels at a lower tier (sinks aside) */
    for (j = d->n_sink; j < d->n_tokens; j++)
        for (k = d->n_sink; k < d->n_tokens; k++)
            if (importance[j] > importance[k] && tiers[j] != tiers[k])
                CHECK(tiers[j] != KVMIX_PAYLOAD_NO_ROW &&
                      (tiers[k] == KVMIX_PAYLOAD_NO_ROW || tiers[j] < tiers[k]));
    return plan;
}

static void test_choose(void) {
    enum { N = 200 };
    static float importance[N];
    static uint8_t tiers[N];
    static const double budgets[] = {1.0, 0.8, 0.6, 0.5625, 0.46, 0.35, 0.3125, 0.3, 0.1, 0.01};
    test_rng rng;
    kvmix_tier_desc d;
    kvmix_tier_plan p;
    size_t b;
    int32_t j, int4;
    test_rng_init(&rng, "tiers");
    for (j = 0; j < N; j++) importance[j] = (float)test_rng_range(&rng, 0, 40); /* with ties */
    for (int4 = 0; int4 < 2; int4++)
        for (b = 0; b < sizeof budgets / sizeof budgets[0]; b++) {
            test_context("budget %g int4 %d", budgets[b], int4);
            d = tier_desc(N, 8, budgets[b], int4);
            p = choose(&d, importance, tiers);
            if (budgets[b] == 1.0) CHECK_EQ_INT(p.n_fp16, N);
            if (budgets[b] >= 0.6) CHECK(p.n_int4 == 0 && p.n_dropped == 0);
            if (budgets[b] == 0.46 || budgets[b] == 0.35)
                CHECK(int4 ? p.n_int4 > 0 && p.n_dropped == 0 : p.n_dropped > 0);
            if (!int4) CHECK_EQ_INT(p.n_int4, 0);
        }
    test_context(NULL);
    /* ties: the later of two equal tokens takes the higher tier */
    {
        float flat[4] = {1, 1, 1, 1};
        uint8_t t[4];
        d = tier_desc(4, 0, (1.0 + 3 * 0.5625) / 4, 1);
        p = choose(&d, flat, t);
        CHECK(p.n_fp16 == 1 && t[3] == KVMIX_FORMAT_FP16 && t[0] == KVMIX_FORMAT_INT8);
    }
    /* sinks beyond the budget stay; the rest is dropped */
    d = tier_desc(N, 100, 0.2, 1);
    CHECK_RESULT(kvmix_tier_choose(&d, importance, tiers, &p, NULL), KVMIX_SUCCESS);
    CHECK(p.n_fp16 == 100 && p.n_dropped == 100);
    /* bad input: errors naming the field, nothing written */
    memset(tiers, 0xAB, sizeof tiers);
    {
        static const char *const fields[] = {"budget",   "budget",     "n_sink",   "allow_int4",
                                             "head_dim", "group_size", "reserved", "n_tokens"};
        size_t c;
        for (c = 0; c < sizeof fields / sizeof fields[0]; c++) {
            kvmix_error why = {NULL, NULL};
            kvmix_result want = c == 4 || c == 5 ? KVMIX_ERR_BAD_SHAPE : KVMIX_ERR_INVALID_ARGUMENT;
            d = tier_desc(N, 8, c == 0 ? 0.0 : c == 1 ? 1.5 : 0.5, c == 3 ? 2 : 1);
            if (c == 2) d.n_sink = N + 1;
            if (c == 4) d.head_dim = 96 + 4;
            if (c == 5) d.group_size = 24; /* does not divide 128 */
            if (c == 6) d.reserved = 1;
            if (c == 7) d.n_tokens = -1;
            test_context("bad tier desc: %s", fields[c]);
            CHECK_RESULT(kvmix_tier_choose(&d, importance, tiers, &p, &why), want);
            CHECK_ERROR(why, fields[c]);
        }
        test_context(NULL);
    }
    {
        kvmix_error why = {NULL, NULL};
        d = tier_desc(N, 8, 0.5, 1);
        importance[50] = NAN;
        CHECK_RESULT(kvmix_tier_choose(&d, importance, tiers, &p, &why), KVMIX_ERR_BAD_VALUE);
        CHECK_ERROR(why, "importance");
        for (j = 0; j < N; j++) CHECK_EQ_INT(tiers[j], 0xAB);
        CHECK_RESULT(kvmix_tier_choose(NULL, importance, tiers, &p, &why), KVMIX_ERR_NULL_POINTER);
        CHECK_ERROR(why, "desc");
        CHECK_RESULT(kvmix_tier_choose(&d, importance, NULL, &p, &why), KVMIX_ERR_NULL_POINTER);
        CHECK_ERROR(why, "tiers");
        importance[50] = 1.0f;
        CHECK_RESULT(kvmix_tier_choose(&d, importance, tiers, &p, &why), KVMIX_SUCCESS);
        CHECK_ERROR(why, "");
    }
}

/* The chosen tiers are what a payload takes: it packs and its size is the plan's cost. */
static void test_payload_of_tiers(void) {
    enum { N = 64, D = 128, KV = 2 };
    static float rows[N * KV * D], importance[N];
    static uint8_t tiers[N], payload[1 << 18];
    kvmix_tier_desc d = tier_desc(N, 4, 0.46, 1);
    kvmix_tier_plan p;
    kvmix_payload_desc pd;
    kvmix_payload_info info;
    size_t bytes = 0, body, fp16_body;
    int32_t j;
    for (j = 0; j < N * KV * D; j++) rows[j] = (float)((j * 7) % 23 - 11) / 8.0f;
    for (j = 0; j < N; j++) importance[j] = (float)((j * 13) % 17);
    p = choose(&d, importance, tiers);
    memset(&pd, 0, sizeof pd);
    pd.kind = KVMIX_PAYLOAD_ROWS, pd.head_dim = D, pd.n_kv_heads = KV, pd.n_layers = 1;
    pd.n_tokens = N;
    CHECK_RESULT(kvmix_payload_pack(&pd, tiers, rows, rows, payload, sizeof payload, &bytes, NULL),
                 KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_payload_read_head(payload, bytes, &info, NULL, NULL), KVMIX_SUCCESS);
    body = bytes - info.head_bytes;
    fp16_body = (size_t)N * KV * D * 2 * 2;
    CHECK_NEAR((double)body / (double)fp16_body, p.cost, 0.01); /* block padding aside */
}

static kvmix_result vote(void *ctx, int32_t index, double budget, int32_t *out_passed) {
    const int *answers = (const int *)ctx;
    if (budget != 0.3) return KVMIX_ERR_INVALID_ARGUMENT;
    if (answers[index] < 0) return KVMIX_ERR_CUDA;
    *out_passed = answers[index];
    return KVMIX_SUCCESS;
}

static void test_probe(void) {
    int two_of_three[3] = {1, 0, 1}, one_of_three[3] = {0, 0, 1}, broken[3] = {1, -1, 1};
    int32_t allow = 7, passed = 0;
    CHECK_RESULT(kvmix_tier_probe(vote, two_of_three, 3, 2, 0.3, &allow, &passed), KVMIX_SUCCESS);
    CHECK(allow == 1 && passed == 2);
    CHECK_RESULT(kvmix_tier_probe(vote, one_of_three, 3, 2, 0.3, &allow, &passed), KVMIX_SUCCESS);
    CHECK(allow == 0 && passed == 1);
    allow = 7;
    CHECK_RESULT(kvmix_tier_probe(vote, broken, 3, 2, 0.3, &allow, NULL), KVMIX_ERR_CUDA);
    CHECK_EQ_INT(allow, 7);
    CHECK_RESULT(kvmix_tier_probe(vote, two_of_three, 3, 4, 0.3, &allow, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_tier_probe(vote, two_of_three, 0, 1, 0.3, &allow, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_tier_probe(NULL, two_of_three, 3, 2, 0.3, &allow, NULL),
                 KVMIX_ERR_NULL_POINTER);
}

void unit_tiers(void) {
    test_costs();
    test_importance();
    test_choose();
    test_payload_of_tiers();
    test_probe();
}
