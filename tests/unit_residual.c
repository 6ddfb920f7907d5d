/* unit_residual: the intent residual (kvmix_intent_residual_scores and the calls beside it).
   A zero output projection, a zero alpha or a zero clip give the rule scores bit for bit, also in
   place and with -0 and dead (-INFINITY) scores, and kvmix_evict_select then evicts exactly what
   it evicts on the rule; a hand-computed case and random weights match a double computation of
   the documented formula within 1e-6; alpha is clipped; infinite rule scores stay as they are;
   huge weights stay finite. The feature rows: ages, turns back, one-hot roles, image, key norms
   and readouts as documented. The readout against a double reference. Bad arguments give their
   result and name their field, and write nothing. */
#include "harness.h"

#include <float.h>
#include <math.h>
#include <string.h>

enum { F = KVMIX_INTENT_RESIDUAL_N_FEATURES, MAX_H = 64, MAX_N = 512 };

/* Weights in caller memory, filled with normals of the given spreads. */
typedef struct weights {
    float w1[MAX_H * F], b1[MAX_H], w2[MAX_H];
    kvmix_intent_residual w;
} weights;

static void weights_random(weights *x, test_rng *rng, int32_t hidden, double w2_spread) {
    int32_t i;
    memset(x, 0, sizeof *x);
    for (i = 0; i < hidden * F; i++) x->w1[i] = (float)(test_rng_normal(rng) * 0.5);
    for (i = 0; i < hidden; i++) x->b1[i] = (float)(test_rng_normal(rng) * 0.5);
    for (i = 0; i < hidden; i++) x->w2[i] = (float)(test_rng_normal(rng) * w2_spread);
    x->w.n_features = F;
    x->w.hidden = hidden;
    x->w.w1 = x->w1, x->w.b1 = x->b1, x->w.w2 = x->w2;
    x->w.b2 = w2_spread == 0.0 ? 0.0f : (float)(test_rng_normal(rng) * w2_spread);
    x->w.alpha = (float)(test_rng_unit(rng) * 2.0 - 1.0);
    x->w.alpha_max = 1.0f;
}

/* Rule scores: normals, some exact -0 and +0, every dead-th one -INFINITY (dead 0: none). */
static void rule_random(float *rule, int32_t n, test_rng *rng, int32_t dead) {
    int32_t t;
    for (t = 0; t < n; t++) {
        int32_t k = test_rng_range(rng, 0, 19);
        rule[t] = k == 0 ? -0.0f : k == 1 ? 0.0f : (float)(test_rng_normal(rng) * 3.0);
        if (dead > 0 && t % dead == dead - 1) rule[t] = -INFINITY;
    }
}

/* Feature rows of random tags, key norms and readouts over rule. */
static void features_random(float *features, const float *rule, int32_t n, test_rng *rng) {
    static kvmix_tag tags[MAX_N];
    static float norm[MAX_N], readout[MAX_N];
    int32_t t;
    for (t = 0; t < n; t++) {
        memset(&tags[t], 0, sizeof tags[t]);
        tags[t].turn = t * 6 / (n > 0 ? n : 1);
        tags[t].role = (uint8_t)test_rng_range(rng, 0, KVMIX_TAG_N_ROLES - 1);
        tags[t].modality = (uint8_t)test_rng_range(rng, 0, 1);
        norm[t] = (float)(test_rng_unit(rng) * 20.0);
        readout[t] = (float)(test_rng_normal(rng) * 2.0);
    }
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 5, norm, readout, n, features, NULL),
                 KVMIX_SUCCESS);
}

static double gelu_ref(double x) { return 0.5 * x * (1.0 + erf(x / sqrt(2.0))); }

/* The documented formula in double, independently of the header. */
static double residual_ref(const kvmix_intent_residual *w, const float *f, double rule) {
    double a = w->alpha, r = w->b2;
    int32_t j, k;
    if (a > w->alpha_max) a = w->alpha_max;
    if (a < -w->alpha_max) a = -w->alpha_max;
    for (j = 0; j < w->hidden; j++) {
        double x = w->b1[j];
        for (k = 0; k < F; k++) x += (double)w->w1[j * F + k] * f[k];
        r += w->w2[j] * gelu_ref(x);
    }
    return rule + a * r;
}

/* Zero output weights, alpha 0 or a clip of 0: the rule, bit for bit, in place too. */
static void test_zero_is_rule(void) {
    static float rule[MAX_N], features[MAX_N * F], out[MAX_N], inplace[MAX_N];
    weights x;
    int32_t trial, n, way;
    test_rng rng;
    test_rng_init(&rng, "residual zero is rule");
    for (trial = 0; trial < 30; trial++) {
        n = test_rng_range(&rng, 0, MAX_N);
        rule_random(rule, n, &rng, test_rng_range(&rng, 0, 7));
        features_random(features, rule, n, &rng);
        for (way = 0; way < 3; way++) {
            test_context("trial %d, n %d, way %d", (int)trial, (int)n, (int)way);
            weights_random(&x, &rng, test_rng_range(&rng, 1, MAX_H), way == 0 ? 0.0 : 1.0);
            if (way == 1) x.w.alpha = 0.0f;
            if (way == 2) x.w.alpha_max = 0.0f;
            test_poison(out, sizeof out, 3);
            CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, rule, n, out, NULL),
                         KVMIX_SUCCESS);
            CHECK_MEM_EQ(out, rule, (size_t)n * sizeof(float));
            memcpy(inplace, rule, sizeof rule);
            CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, inplace, n, inplace, NULL),
                         KVMIX_SUCCESS);
            CHECK_MEM_EQ(inplace, rule, (size_t)n * sizeof(float));
        }
    }
    test_context(NULL);
}

/* F = 3 by hand (the other features' weights 0), H = 2: x = (1, -1), so
   r = 1.5 gelu(1) - 2 gelu(-1) + 0.25 and out = 0.75 + 0.5 r. */
static void test_hand_case(void) {
    float w1[2 * F], b1[2] = {0.0f, 0.0f}, w2[2] = {1.5f, -2.0f}, f[F], rule = 0.75f, out = 0.0f;
    kvmix_intent_residual w;
    kvmix_error why;
    memset(w1, 0, sizeof w1);
    memset(f, 0, sizeof f);
    f[0] = 0.5f, f[1] = 2.0f, f[2] = -1.0f;
    w1[0] = 2.0f;                    /* x_0 = 2 * 0.5 = 1 */
    w1[F + 1] = 0.5f, w1[F + 2] = 2; /* x_1 = 0.5 * 2 + 2 * -1 = -1 */
    memset(&w, 0, sizeof w);
    w.n_features = F, w.hidden = 2, w.w1 = w1, w.b1 = b1, w.w2 = w2;
    w.b2 = 0.25f, w.alpha = 0.5f, w.alpha_max = 1.0f;
    CHECK_RESULT(kvmix_intent_residual_scores(&w, f, &rule, 1, &out, &why), KVMIX_SUCCESS);
    CHECK_ERROR(why, "");
    /* gelu(1) = 0.8413447460685429, gelu(-1) = -0.15865525393145707 */
    CHECK_NEAR(out, 0.75 + 0.5 * (1.5 * 0.8413447460685429 + 2.0 * 0.15865525393145707 + 0.25),
               1e-6);
    CHECK_NEAR(out, 1.6646638134828642, 1e-6);
    CHECK_NEAR(out, residual_ref(&w, f, rule), 1e-6);
}

/* Random weights over random features: the double formula within 1e-6 (relative above 1). */
static void test_random_against_double(void) {
    static float rule[MAX_N], features[MAX_N * F], out[MAX_N];
    weights x;
    int32_t trial, t, n, moved = 0;
    test_rng rng;
    test_rng_init(&rng, "residual random");
    for (trial = 0; trial < 20; trial++) {
        n = test_rng_range(&rng, 1, MAX_N);
        rule_random(rule, n, &rng, 9);
        features_random(features, rule, n, &rng);
        weights_random(&x, &rng, test_rng_range(&rng, 1, MAX_H), 0.3);
        CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, rule, n, out, NULL),
                     KVMIX_SUCCESS);
        for (t = 0; t < n; t++) {
            double want;
            if (rule[t] == -INFINITY) {
                CHECK(out[t] == -INFINITY);
                continue;
            }
            want = residual_ref(&x.w, features + (size_t)t * F, rule[t]);
            CHECK_NEAR(out[t], want, 1e-6 * (fabs(want) > 1.0 ? fabs(want) : 1.0));
            moved += out[t] != rule[t];
        }
    }
    CHECK(moved > 0);
}

/* alpha beyond the clip acts as the clip; -alpha as -clip. */
static void test_clip(void) {
    static float rule[64], features[64 * F], clipped[64], at_clip[64];
    weights x;
    int32_t sign;
    test_rng rng;
    test_rng_init(&rng, "residual clip");
    rule_random(rule, 64, &rng, 0);
    features_random(features, rule, 64, &rng);
    weights_random(&x, &rng, 16, 1.0);
    x.w.alpha_max = 0.75f;
    for (sign = -1; sign <= 1; sign += 2) {
        x.w.alpha = 5.0f * (float)sign;
        CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, rule, 64, clipped, NULL),
                     KVMIX_SUCCESS);
        x.w.alpha = 0.75f * (float)sign;
        CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, rule, 64, at_clip, NULL),
                     KVMIX_SUCCESS);
        CHECK_MEM_EQ(clipped, at_clip, sizeof clipped);
        CHECK(memcmp(clipped, rule, sizeof rule) != 0);
    }
}

/* -INFINITY (dead) and +INFINITY stay, whatever the features hold; huge weights stay finite. */
static void test_infinite_and_huge(void) {
    static float features[8 * F], out[8];
    float rule[8] = {-INFINITY, 1.0f, INFINITY, -2.0f, -INFINITY, 0.5f, 3.0f, -INFINITY};
    weights x;
    int32_t t, k;
    test_rng rng;
    test_rng_init(&rng, "residual infinite");
    for (t = 0; t < 8; t++)
        for (k = 0; k < F; k++)
            features[t * F + k] = isinf(rule[t]) ? NAN : (float)test_rng_normal(&rng);
    weights_random(&x, &rng, 8, 1.0);
    x.w.alpha = 1.0f;
    CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, rule, 8, out, NULL), KVMIX_SUCCESS);
    for (t = 0; t < 8; t++) {
        if (isinf(rule[t]))
            CHECK_EQ_FLOAT_BITS(out[t], rule[t]);
        else
            CHECK(isfinite(out[t]) && out[t] != rule[t]);
    }
    for (k = 0; k < 8 * F; k++) x.w1[k] = FLT_MAX;
    for (k = 0; k < 8; k++) x.w2[k] = FLT_MAX, x.b1[k] = FLT_MAX;
    for (t = 0; t < 8; t++)
        for (k = 0; k < F; k++)
            if (!isinf(rule[t])) features[t * F + k] = FLT_MAX;
    x.w.alpha_max = FLT_MAX, x.w.alpha = FLT_MAX;
    CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, rule, 8, out, NULL), KVMIX_SUCCESS);
    for (t = 0; t < 8; t++) {
        if (isinf(rule[t]))
            CHECK_EQ_FLOAT_BITS(out[t], rule[t]);
        else
            CHECK_EQ_FLOAT_BITS(out[t], FLT_MAX);
    }
}

/* Each bad argument: its result, its field, out untouched (written on success). */
static void expect_refused(const kvmix_intent_residual *w, const float *features, const float *rule,
                           int32_t n, kvmix_result want, const char *field) {
    static float out[16];
    kvmix_error why = {"?", "?"};
    test_context("field %s", field);
    test_poison(out, sizeof out, 11);
    CHECK_RESULT(kvmix_intent_residual_scores(w, features, rule, n, out, &why), want);
    CHECK_ERROR(why, field);
    CHECK(test_is_poisoned(out, sizeof out, 11) == (want != KVMIX_SUCCESS));
}

static void test_bad_inputs(void) {
    static float features[16 * F], rule[16];
    weights x, y;
    int32_t t;
    test_rng rng;
    test_rng_init(&rng, "residual bad");
    rule_random(rule, 16, &rng, 0);
    features_random(features, rule, 16, &rng);
    weights_random(&x, &rng, 4, 1.0);
    expect_refused(NULL, features, rule, 16, KVMIX_ERR_NULL_POINTER, "w");
    expect_refused(&x.w, NULL, rule, 16, KVMIX_ERR_NULL_POINTER, "features");
    expect_refused(&x.w, features, NULL, 16, KVMIX_ERR_NULL_POINTER, "rule");
    expect_refused(&x.w, features, rule, -1, KVMIX_ERR_INVALID_ARGUMENT, "n");
    y = x, y.w.n_features = F - 1;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_INVALID_ARGUMENT, "n_features");
    y = x, y.w.hidden = 0;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_INVALID_ARGUMENT, "hidden");
    y = x, y.w.hidden = KVMIX_INTENT_RESIDUAL_MAX_HIDDEN + 1;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_INVALID_ARGUMENT, "hidden");
    y = x, y.w.w1 = NULL;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_NULL_POINTER, "w1");
    y = x, y.w.b1 = NULL;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_NULL_POINTER, "b1");
    y = x, y.w.w2 = NULL;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_NULL_POINTER, "w2");
    y = x, y.w1[3 * F + 7] = NAN, y.w.w1 = y.w1, y.w.b1 = y.b1, y.w.w2 = y.w2;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "w1");
    y = x, y.b1[2] = INFINITY, y.w.w1 = y.w1, y.w.b1 = y.b1, y.w.w2 = y.w2;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "b1");
    y = x, y.w2[0] = -INFINITY, y.w.w1 = y.w1, y.w.b1 = y.b1, y.w.w2 = y.w2;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "w2");
    y = x, y.w.b2 = NAN;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "b2");
    y = x, y.w.alpha = INFINITY;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "alpha");
    y = x, y.w.alpha_max = NAN;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "alpha_max");
    y = x, y.w.alpha_max = -0.5f;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_INVALID_ARGUMENT, "alpha_max");
    /* zero weights do not skip the checks */
    y = x, memset(y.w2, 0, sizeof y.w2), y.w.b2 = 0.0f, y.w.w2 = y.w2, y.w1[0] = NAN;
    y.w.w1 = y.w1, y.w.b1 = y.b1;
    expect_refused(&y.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "w1");
    rule[9] = NAN;
    expect_refused(&x.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "rule");
    rule[9] = 1.0f;
    features[12 * F + 4] = INFINITY;
    expect_refused(&x.w, features, rule, 16, KVMIX_ERR_BAD_VALUE, "features");
    rule[12] = -INFINITY; /* a dead position's features are not read */
    expect_refused(&x.w, features, rule, 16, KVMIX_SUCCESS, "");
    test_context(NULL);
    /* n = 0 needs no arrays */
    CHECK_RESULT(kvmix_intent_residual_scores(&x.w, NULL, NULL, 0, NULL, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_intent_residual_check(&x.w, NULL), KVMIX_SUCCESS);
    for (t = 0; t < F; t++) CHECK(kvmix_intent_residual_feature_name(t) != NULL);
    CHECK(kvmix_intent_residual_feature_name(-1) == NULL);
    CHECK(kvmix_intent_residual_feature_name(F) == NULL);
    CHECK(strcmp(kvmix_intent_residual_feature_name(KVMIX_INTENT_FEATURE_ROLE + KVMIX_ROLE_USER),
                 "role_user") == 0);
    CHECK(strcmp(kvmix_intent_residual_feature_name(KVMIX_INTENT_FEATURE_READOUT), "readout") == 0);
}

/* Zero output weights: the same evictions as the rule, through shaping and selection. */
static void test_select_same(void) {
    static float rule[MAX_N], features[MAX_N * F], residual[MAX_N], scratch[MAX_N];
    static uint8_t live[MAX_N], forced[MAX_N];
    static int32_t evict_rule[MAX_N], evict_residual[MAX_N];
    kvmix_evict_policy policy;
    weights x;
    int32_t trial, t, n, keep, n_rule, n_residual, evicted = 0;
    test_rng rng;
    test_rng_init(&rng, "residual select");
    for (trial = 0; trial < 40; trial++) {
        test_context("trial %d", (int)trial);
        n = test_rng_range(&rng, 1, MAX_N);
        memset(&policy, 0, sizeof policy);
        policy.scorer = KVMIX_EVICT_INTENT;
        policy.budget_fraction = 0.125 + 0.125 * test_rng_range(&rng, 0, 5);
        policy.prefix_tokens = test_rng_range(&rng, 0, 8);
        policy.recent_tokens = test_rng_range(&rng, 0, 16);
        policy.pool_tokens = 2 * test_rng_range(&rng, 0, 3) + 1;
        CHECK_RESULT(kvmix_evict_policy_resolve(&policy, NULL), KVMIX_SUCCESS);
        rule_random(rule, n, &rng, 0);
        for (t = 0; t < n; t++) {
            live[t] = test_rng_range(&rng, 0, 9) != 0;
            if (!live[t]) rule[t] = -INFINITY;
            if (test_rng_range(&rng, 0, 9) == 0) rule[t] = rule[t > 0 ? t - 1 : 0]; /* ties */
        }
        features_random(features, rule, n, &rng);
        weights_random(&x, &rng, test_rng_range(&rng, 1, MAX_H), 0.0);
        CHECK_RESULT(kvmix_intent_residual_scores(&x.w, features, rule, n, residual, NULL),
                     KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_evict_shape_scores(&policy, rule, n, scratch), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_evict_shape_scores(&policy, residual, n, scratch), KVMIX_SUCCESS);
        CHECK_MEM_EQ(residual, rule, (size_t)n * sizeof(float));
        CHECK_RESULT(kvmix_evict_budget(&policy, n, &keep), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_evict_forced(&policy, n, n > 4 ? n - 4 : 0, n, forced), KVMIX_SUCCESS);
        CHECK_RESULT(kvmix_evict_select(rule, live, forced, n, keep, evict_rule, &n_rule),
                     KVMIX_SUCCESS);
        CHECK_RESULT(
            kvmix_evict_select(residual, live, forced, n, keep, evict_residual, &n_residual),
            KVMIX_SUCCESS);
        CHECK_EQ_INT(n_residual, n_rule);
        CHECK_MEM_EQ(evict_residual, evict_rule, (size_t)n_rule * sizeof(int32_t));
        evicted += n_rule;
    }
    CHECK(evicted > 0);
    test_context(NULL);
}

/* Feature rows as documented, with and without tags, and their refusals. */
static void test_features(void) {
    float rule[4] = {2.5f, -INFINITY, -1.0f, 0.0f}, norm[4] = {1.0f, 0.0f, 3.5f, 2.0f};
    float readout[4] = {0.25f, 0.0f, -0.5f, 1.0f}, f[4 * F], g[4 * F];
    kvmix_tag tags[4];
    kvmix_error why;
    int32_t t, k;
    memset(tags, 0, sizeof tags);
    tags[0].turn = 0, tags[0].role = KVMIX_ROLE_INSTRUCTION;
    tags[1].turn = 1, tags[1].role = KVMIX_ROLE_USER, tags[1].modality = KVMIX_MODALITY_IMAGE;
    tags[2].turn = 2, tags[2].role = KVMIX_ROLE_OBSERVATION;
    tags[3].turn = 4, tags[3].role = KVMIX_ROLE_SCAFFOLD; /* after current_turn: 0 back */
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, f, &why),
                 KVMIX_SUCCESS);
    CHECK_ERROR(why, "");
    for (t = 0; t < 4; t++) {
        const float *row = f + t * F;
        int32_t back = tags[t].turn < 3 ? 3 - tags[t].turn : 0;
        test_context("position %d", (int)t);
        CHECK_EQ_FLOAT_BITS(row[KVMIX_INTENT_FEATURE_RULE], rule[t]);
        CHECK_EQ_FLOAT_BITS(row[KVMIX_INTENT_FEATURE_LOG_AGE], (float)log(1.0 + (3 - t)));
        CHECK_EQ_FLOAT_BITS(row[KVMIX_INTENT_FEATURE_LOG_TURNS_BACK], (float)log(1.0 + back));
        for (k = 0; k < KVMIX_TAG_N_ROLES; k++)
            CHECK(row[KVMIX_INTENT_FEATURE_ROLE + k] == (k == tags[t].role ? 1.0f : 0.0f));
        CHECK(row[KVMIX_INTENT_FEATURE_IMAGE] == (t == 1 ? 1.0f : 0.0f));
        CHECK_EQ_FLOAT_BITS(row[KVMIX_INTENT_FEATURE_KEY_NORM], norm[t]);
        CHECK_EQ_FLOAT_BITS(row[KVMIX_INTENT_FEATURE_READOUT], readout[t]);
    }
    test_context(NULL);
    /* no tags, key norms or readouts: zeros where they would be */
    CHECK_RESULT(kvmix_intent_residual_features(rule, NULL, -7, NULL, NULL, 4, g, NULL),
                 KVMIX_SUCCESS);
    for (t = 0; t < 4; t++)
        for (k = KVMIX_INTENT_FEATURE_LOG_TURNS_BACK; k < F; k++) CHECK(g[t * F + k] == 0.0f);
    CHECK_EQ_FLOAT_BITS(g[3 * F + KVMIX_INTENT_FEATURE_LOG_AGE], 0.0f);
    /* refusals write nothing */
    memcpy(g, f, sizeof f);
    tags[2].role = KVMIX_TAG_N_ROLES;
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, g, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "tags");
    tags[2].role = 0, tags[2].modality = 2;
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, g, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "tags");
    tags[2].modality = 0, tags[2].turn = -1;
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, g, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "tags");
    tags[2].turn = 2;
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, -1, norm, readout, 4, g, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "current_turn");
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, -1, g, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "n_positions");
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, NULL, &why),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "features");
    norm[3] = -1.0f;
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, g, &why),
                 KVMIX_ERR_BAD_VALUE);
    CHECK_ERROR(why, "key_norm");
    norm[3] = 2.0f, readout[0] = NAN;
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, g, &why),
                 KVMIX_ERR_BAD_VALUE);
    CHECK_ERROR(why, "readout");
    readout[0] = 0.25f, rule[2] = NAN;
    CHECK_RESULT(kvmix_intent_residual_features(rule, tags, 3, norm, readout, 4, g, &why),
                 KVMIX_ERR_BAD_VALUE);
    CHECK_ERROR(why, "rule");
    CHECK_MEM_EQ(g, f, sizeof f);
}

/* The readout against sum_j softmax(s)_j s_j in double; one query gives s; none gives 0. */
static void test_readout(void) {
    enum { D = 24, NK = 37, NQ = 9 };
    static float keys[NK * D], queries[NQ * D], out[NK];
    kvmix_error why;
    int32_t i, j, c, trial;
    test_rng rng;
    test_rng_init(&rng, "residual readout");
    for (trial = 0; trial < 4; trial++) {
        float scale = trial == 0 ? 0.0f : (float)(test_rng_unit(&rng) * 2.0);
        double s_used = trial == 0 ? 1.0 / sqrt((double)D) : scale;
        int32_t nq = trial == 3 ? 1 : NQ;
        for (i = 0; i < NK * D; i++) keys[i] = (float)(test_rng_normal(&rng) * 2.0);
        for (i = 0; i < NQ * D; i++) queries[i] = (float)(test_rng_normal(&rng) * 2.0);
        CHECK_RESULT(kvmix_intent_readout(keys, NK, queries, nq, D, scale, out, &why),
                     KVMIX_SUCCESS);
        CHECK_ERROR(why, "");
        for (i = 0; i < NK; i++) {
            double s[NQ], top = -HUGE_VAL, z = 0.0, acc = 0.0;
            for (j = 0; j < nq; j++) {
                s[j] = 0.0;
                for (c = 0; c < D; c++) s[j] += (double)keys[i * D + c] * queries[j * D + c];
                s[j] *= s_used;
                if (s[j] > top) top = s[j];
            }
            for (j = 0; j < nq; j++) z += exp(s[j] - top), acc += exp(s[j] - top) * s[j];
            CHECK_NEAR(out[i], acc / z, 1e-6 * (fabs(acc / z) > 1.0 ? fabs(acc / z) : 1.0));
            if (nq == 1) CHECK_NEAR(out[i], s[0], 1e-6 * (fabs(s[0]) > 1.0 ? fabs(s[0]) : 1.0));
        }
    }
    test_poison(out, sizeof out, 5);
    CHECK_RESULT(kvmix_intent_readout(keys, NK, NULL, 0, D, 0.0f, out, NULL), KVMIX_SUCCESS);
    for (i = 0; i < NK; i++) CHECK_EQ_FLOAT_BITS(out[i], 0.0f);
    test_poison(out, sizeof out, 5);
    CHECK_RESULT(kvmix_intent_readout(keys, NK, queries, NQ, 0, 0.0f, out, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "head_dim");
    CHECK_RESULT(kvmix_intent_readout(keys, NK, queries, NQ, D, -1.0f, out, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "scale");
    CHECK_RESULT(kvmix_intent_readout(keys, -1, queries, NQ, D, 0.0f, out, &why),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_ERROR(why, "n_keys");
    CHECK_RESULT(kvmix_intent_readout(keys, NK, NULL, NQ, D, 0.0f, out, &why),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "queries");
    queries[5] = INFINITY;
    CHECK_RESULT(kvmix_intent_readout(keys, NK, queries, NQ, D, 0.0f, out, &why),
                 KVMIX_ERR_BAD_VALUE);
    CHECK_ERROR(why, "queries");
    keys[7] = NAN;
    CHECK_RESULT(kvmix_intent_readout(keys, NK, queries, NQ, D, 0.0f, out, &why),
                 KVMIX_ERR_BAD_VALUE);
    CHECK_ERROR(why, "keys");
    CHECK(test_is_poisoned(out, sizeof out, 5));
}

void unit_residual(void) {
    test_zero_is_rule();
    test_hand_case();
    test_random_against_double();
    test_clip();
    test_infinite_and_huge();
    test_bad_inputs();
    test_select_same();
    test_features();
    test_readout();
}
