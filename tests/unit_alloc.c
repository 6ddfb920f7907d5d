/* unit_alloc: the bit allocators (kvmix_alloc_two_level, kvmix_alloc_knapsack) against brute
   force on random instances, their edge cases and their argument checks.

   Random instances use integer token counts whose total is a power of two and bits that are
   multiples of 1/16, so every cost sum and budget (B * T) is exact in double: "within budget"
   and "optimal" then mean the same thing here as in real arithmetic, and budgets can be put
   exactly on a boundary (the cost of some choice). Distortions are arbitrary doubles, so
   optimal distortions are compared with a relative tolerance. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TAGS  64
#define MAX_PREC  8
#define DIST_TOL  1e-12 /* relative, for distortion sums taken in different orders */
#define POISON_ID 0x5a5au

typedef struct instance {
    int32_t n, np;
    int64_t tokens[MAX_TAGS];
    double distortion[MAX_TAGS * MAX_PREC];
    double bits[MAX_PREC];
    double tag_bits[MAX_TAGS * MAX_PREC]; /* used when priced_by_tag */
    int priced_by_tag;
    double budget;
    int64_t total;
    kvmix_alloc_problem problem;
} instance;

static void instance_bind(instance *in) {
    in->problem.n_tags = in->n;
    in->problem.n_precisions = in->np;
    in->problem.tokens = in->tokens;
    in->problem.distortion = in->distortion;
    in->problem.bits = in->bits;
    in->problem.budget_bits = in->budget;
    in->problem.tag_bits = in->priced_by_tag ? in->tag_bits : NULL;
}

/* Tag t's tokens at precision k, in token-bits. */
static double tag_cost(const instance *in, int32_t t, int32_t k) {
    return (double)in->tokens[t] * (in->priced_by_tag ? in->tag_bits[t * in->np + k] : in->bits[k]);
}

/* The canonical cost of a choice (tag order, as the header defines it). */
static double cost_of(const instance *in, const int32_t *choice) {
    double c = 0.0;
    int32_t t;
    for (t = 0; t < in->n; t++) c += tag_cost(in, t, choice[t]);
    return c;
}

static double distortion_of(const instance *in, const int32_t *choice) {
    double d = 0.0;
    int32_t t;
    for (t = 0; t < in->n; t++) d += in->distortion[t * in->np + choice[t]];
    return d;
}

static double limit_of(const instance *in) { return in->budget * (double)in->total; }

/* A random instance: n tags, np precisions with increasing bits (multiples of 1/16 in 1..20),
   tokens 0..max_tokens with a power-of-two total, distortions that mostly fall with bits
   (each precision's tag-specific sensitivity, some noise, sometimes a rise). Budget unset. */
static void random_instance(test_rng *rng, instance *in, int32_t n, int32_t np,
                            int32_t max_tokens) {
    int64_t sum = 0, total = 1;
    int32_t t, k;
    memset(in, 0, sizeof *in);
    in->n = n;
    in->np = np;
    for (k = 0; k < np; k++) {
        double step = (double)test_rng_range(rng, 1, 64) / 16.0;
        in->bits[k] = (k == 0 ? (double)test_rng_range(rng, 16, 48) / 16.0 : in->bits[k - 1]) +
                      (k == 0 ? 0.0 : step);
    }
    for (t = 0; t < n; t++) {
        double sensitivity = exp(4.0 * test_rng_unit(rng)) * (t % 3 == 0 ? 10.0 : 1.0);
        in->tokens[t] = test_rng_unit(rng) < 0.08 ? 0 : test_rng_range(rng, 1, max_tokens);
        sum += in->tokens[t];
        for (k = 0; k < np; k++) {
            double d = sensitivity * exp2(-in->bits[k]) * (1.0 + 0.3 * test_rng_unit(rng));
            if (test_rng_unit(rng) < 0.05) d *= 3.0; /* a non-monotone measurement */
            in->distortion[t * np + k] = d;
        }
    }
    while (total <= sum) total *= 2;
    in->tokens[n - 1] += total - sum; /* total is a power of two: cost / total is exact */
    in->total = total;
    instance_bind(in);
}

/* Raises the last tag's tokens so that the total is a power of two again. */
static void fix_total(instance *in) {
    int64_t sum = 0, total = 1;
    int32_t t;
    for (t = 0; t < in->n; t++) sum += in->tokens[t];
    while (total < sum) total *= 2;
    in->tokens[in->n - 1] += total - sum;
    in->total = total;
}

/* Sets the budget so that budget * total == cost exactly (total is a power of two). */
static void set_budget_cost(instance *in, double cost) {
    in->budget = cost / (double)in->total;
    instance_bind(in);
}

/* A budget uniformly between the all-cheapest and the all-dearest cost, or exactly the cost of
   a random choice (a boundary), each half the time. */
static void random_budget(test_rng *rng, instance *in, int32_t lo_prec, int32_t hi_prec) {
    int32_t choice[MAX_TAGS], t;
    if (test_rng_unit(rng) < 0.5) {
        for (t = 0; t < in->n; t++) choice[t] = test_rng_range(rng, lo_prec, hi_prec);
        set_budget_cost(in, cost_of(in, choice));
    } else {
        double lo = in->bits[lo_prec], hi = in->bits[hi_prec];
        /* a multiple of 1/1024 keeps budget * total exact */
        in->budget = floor((lo + (hi - lo) * test_rng_unit(rng)) * 1024.0) / 1024.0;
        if (in->budget < lo) in->budget = lo;
        instance_bind(in);
    }
}

/* Brute force over the two-level assignments: the least distortion within the budget. */
static double brute_two_level(const instance *in, int32_t low, int32_t high) {
    double best = HUGE_VAL, limit = limit_of(in);
    int32_t choice[MAX_TAGS], t;
    uint32_t mask;
    for (mask = 0; mask < (1u << in->n); mask++) {
        for (t = 0; t < in->n; t++) choice[t] = (mask >> t) & 1u ? high : low;
        if (cost_of(in, choice) <= limit) {
            double d = distortion_of(in, choice);
            if (d < best) best = d;
        }
    }
    return best;
}

/* Brute force over every precision of every tag (np^n choices); max_cost bounds the cost. */
static double brute_all(const instance *in, double max_cost) {
    double best = HUGE_VAL;
    int32_t choice[MAX_TAGS], t;
    memset(choice, 0, sizeof choice);
    for (;;) {
        if (cost_of(in, choice) <= max_cost) {
            double d = distortion_of(in, choice);
            if (d < best) best = d;
        }
        for (t = 0; t < in->n && ++choice[t] == in->np; t++) choice[t] = 0;
        if (t == in->n) break;
    }
    return best;
}

static int near_rel(double a, double b) { return fabs(a - b) <= DIST_TOL * (fabs(b) + 1e-300); }

/* Checks what every successful call must satisfy: choices in range (low/high for two-level),
   the summary equal to a recomputation, and the real budget held. */
static void check_outcome(const instance *in, const int32_t *choice, const kvmix_alloc_summary *s,
                          int32_t low, int32_t high) {
    int32_t t, bad = 0;
    double cost, limit = limit_of(in);
    for (t = 0; t < in->n; t++) {
        if (choice[t] < 0 || choice[t] >= in->np)
            bad++;
        else if (low >= 0 && choice[t] != low && choice[t] != high)
            bad++;
    }
    if (!CHECK_EQ_INT(bad, 0)) return;
    cost = cost_of(in, choice);
    CHECK_MSG(cost <= limit, "cost %.17g within the budget %.17g", cost, limit);
    CHECK_NEAR(s->distortion, distortion_of(in, choice), 0.0);
    CHECK_NEAR(s->bits, cost / (double)in->total, 0.0);
    /* the division may round a cost at the budget an ulp or two above B (documented) */
    CHECK_MSG(s->bits <= in->budget * (1.0 + 1e-15), "summary bits %.17g <= budget %.17g", s->bits,
              in->budget);
}

/* ---- two-level --------------------------------------------------------------------------- */

static void test_two_level_random(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], i;
    kvmix_alloc_summary s;
    test_rng_init(&rng, "alloc.two_level");
    for (i = 0; i < 400; i++) {
        int32_t n = i < 40 ? 1 + i % 8 : test_rng_range(&rng, 1, 14);
        int32_t np = test_rng_range(&rng, 2, 5);
        int32_t low = test_rng_range(&rng, 0, np - 2), high = test_rng_range(&rng, low + 1, np - 1);
        double want;
        kvmix_result r;
        random_instance(&rng, &in, n, np, test_rng_unit(&rng) < 0.5 ? 8 : 5000);
        random_budget(&rng, &in, low, high);
        test_context("two-level instance %d: n %d, low %d, high %d, budget %.17g", (int)i, (int)n,
                     (int)low, (int)high, in.budget);
        want = brute_two_level(&in, low, high);
        memset(&s, 0, sizeof s);
        r = kvmix_alloc_two_level(&in.problem, low, high, KVMIX_ALLOC_AUTO, NULL, 0, choice, &s);
        if (!CHECK_RESULT(r, KVMIX_SUCCESS)) continue;
        check_outcome(&in, choice, &s, low, high);
        CHECK_MSG(near_rel(s.distortion, want), "exhaustive %.17g equals brute force %.17g",
                  s.distortion, want);
        CHECK_EQ_INT(s.method, KVMIX_ALLOC_EXHAUSTIVE);
        CHECK_EQ_INT(s.optimal, 1);
    }
    test_context(NULL);
}

/* One instance at the exhaustive limit, against brute force. */
static void test_two_level_largest(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS];
    kvmix_alloc_summary s;
    double want;
    test_rng_init(&rng, "alloc.two_level_largest");
    random_instance(&rng, &in, KVMIX_ALLOC_EXACT_MAX_TAGS, 2, 3000);
    random_budget(&rng, &in, 0, 1);
    test_context("two-level at n = %d, budget %.17g", KVMIX_ALLOC_EXACT_MAX_TAGS, in.budget);
    want = brute_two_level(&in, 0, 1);
    if (CHECK_RESULT(
            kvmix_alloc_two_level(&in.problem, 0, 1, KVMIX_ALLOC_AUTO, NULL, 0, choice, &s),
            KVMIX_SUCCESS)) {
        check_outcome(&in, choice, &s, 0, 1);
        CHECK_MSG(near_rel(s.distortion, want), "exhaustive %.17g equals brute force %.17g",
                  s.distortion, want);
    }
    test_context(NULL);
}

/* Reference greedy: the documented order, by selection (O(n^2)), the documented skipping. */
static void reference_greedy(const instance *in, int32_t low, int32_t high, int32_t *choice) {
    double key[MAX_TAGS], cost = 0.0, limit = limit_of(in);
    int32_t used[MAX_TAGS], t;
    for (t = 0; t < in->n; t++) {
        double dc = tag_cost(in, t, high) - tag_cost(in, t, low);
        double gain = in->distortion[t * in->np + low] - in->distortion[t * in->np + high];
        choice[t] = low;
        cost += tag_cost(in, t, low);
        key[t] = dc > 0.0 ? gain / dc : HUGE_VAL;
        used[t] = !(gain > 0.0);
    }
    for (;;) {
        int32_t best = -1;
        for (t = 0; t < in->n; t++)
            if (!used[t] && (best < 0 || key[t] > key[best])) best = t;
        if (best < 0) break;
        used[best] = 1;
        choice[best] = high;
        if (cost_of(in, choice) > limit)
            choice[best] = low;
        else
            cost = cost_of(in, choice);
    }
    (void)cost;
}

static void test_greedy_random(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], want[MAX_TAGS], i, t;
    kvmix_alloc_summary s;
    size_t ws_bytes;
    void *ws;
    test_rng_init(&rng, "alloc.greedy");
    for (i = 0; i < 300; i++) {
        int32_t n = test_rng_range(&rng, 1, i < 100 ? 12 : MAX_TAGS);
        int32_t np = test_rng_range(&rng, 2, 4);
        int32_t low = 0, high = np - 1;
        double all_low, optimum = 0.0;
        kvmix_alloc_method method =
            n > KVMIX_ALLOC_EXACT_MAX_TAGS && (i & 1) ? KVMIX_ALLOC_AUTO : KVMIX_ALLOC_GREEDY;
        random_instance(&rng, &in, n, np, 4000);
        random_budget(&rng, &in, low, high);
        test_context("greedy instance %d: n %d, budget %.17g", (int)i, (int)n, in.budget);
        for (t = 0; t < n; t++) want[t] = low;
        all_low = distortion_of(&in, want);
        if (n <= 12) optimum = brute_two_level(&in, low, high);
        if (!CHECK_RESULT(kvmix_alloc_two_level_workspace_bytes(n, method, &ws_bytes),
                          KVMIX_SUCCESS))
            continue;
        CHECK_EQ_UINT(ws_bytes, (size_t)n * 32);
        ws = test_alloc(ws_bytes);
        test_poison(ws, ws_bytes, 3);
        if (CHECK_RESULT(
                kvmix_alloc_two_level(&in.problem, low, high, method, ws, ws_bytes, choice, &s),
                KVMIX_SUCCESS)) {
            check_outcome(&in, choice, &s, low, high);
            CHECK_EQ_INT(s.method, KVMIX_ALLOC_GREEDY);
            CHECK_EQ_INT(s.optimal, 0);
            CHECK_MSG(s.distortion <= all_low, "greedy %.17g <= all-low %.17g", s.distortion,
                      all_low);
            if (n <= 12)
                CHECK_MSG(s.distortion >= optimum * (1.0 - DIST_TOL),
                          "greedy %.17g >= optimum %.17g", s.distortion, optimum);
            /* exact costs: the order and the skips are those documented */
            reference_greedy(&in, low, high, want);
            CHECK_MEM_EQ(choice, want, (size_t)n * sizeof choice[0]);
            /* maximal: no tag left at low with a positive gain fits any more */
            for (t = 0; t < n; t++)
                if (choice[t] == low &&
                    in.distortion[t * np + low] > in.distortion[t * np + high]) {
                    choice[t] = high;
                    CHECK_MSG(cost_of(&in, choice) > limit_of(&in), "tag %d left low does not fit",
                              (int)t);
                    choice[t] = low;
                }
        }
        free(ws);
    }
    test_context(NULL);
}

/* Inexact arithmetic: tokens with any total, bits with full mantissas, budgets at the cost of a
   random assignment divided by the total (so B * T lands within an ulp or two of that cost, on
   either side). The budget test is the canonical double sum, so the exhaustive search must
   still equal brute force, and greedy must hold the budget. */
static void test_two_level_inexact(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], pick[MAX_TAGS], i, t;
    kvmix_alloc_summary s;
    static double ws[MAX_TAGS * 4];
    test_rng_init(&rng, "alloc.two_level_inexact");
    for (i = 0; i < 300; i++) {
        int32_t n = test_rng_range(&rng, 1, 14);
        double want;
        random_instance(&rng, &in, n, 2, 100000);
        in.total = 0;
        for (t = 0; t < n; t++) {
            in.tokens[t] = test_rng_range(&rng, 0, 100000) + (t == 0);
            in.total += in.tokens[t];
        }
        in.bits[0] = 2.0 + test_rng_unit(&rng);
        in.bits[1] = in.bits[0] + 0.1 + 5.0 * test_rng_unit(&rng);
        for (t = 0; t < n; t++) pick[t] = test_rng_range(&rng, 0, 1);
        in.budget = cost_of(&in, pick) / (double)in.total;
        if (test_rng_unit(&rng) < 0.3) in.budget = nextafter(in.budget, 0.0);
        if (test_rng_unit(&rng) < 0.3) in.budget = nextafter(in.budget, HUGE_VAL);
        instance_bind(&in);
        for (t = 0; t < n; t++) pick[t] = 0;
        if (cost_of(&in, pick) > limit_of(&in)) {
            in.budget = in.bits[0] * 1.0000001;
            instance_bind(&in);
        }
        test_context("inexact instance %d: n %d, budget %.17g", (int)i, (int)n, in.budget);
        want = brute_two_level(&in, 0, 1);
        if (CHECK_RESULT(
                kvmix_alloc_two_level(&in.problem, 0, 1, KVMIX_ALLOC_AUTO, NULL, 0, choice, &s),
                KVMIX_SUCCESS)) {
            check_outcome(&in, choice, &s, 0, 1);
            CHECK_MSG(near_rel(s.distortion, want), "exhaustive %.17g equals brute force %.17g",
                      s.distortion, want);
        }
        if (CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, 1, KVMIX_ALLOC_GREEDY, ws, sizeof ws,
                                               choice, &s),
                         KVMIX_SUCCESS))
            check_outcome(&in, choice, &s, 0, 1);
        if (CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, 64, ws, sizeof ws, choice, &s),
                         KVMIX_SUCCESS))
            check_outcome(&in, choice, &s, -1, -1);
    }
    test_context(NULL);
}

/* ---- knapsack ---------------------------------------------------------------------------- */

/* The sweep on a grid of `cell` token-bits (1/16, or 0 when the budget is the cheapest cost):
   its last entry is the knapsack's optimum, it
   never rises, and a few entries equal brute force at their budgets. */
static void check_sweep(const instance *in, int32_t steps, double cheapest, double cell, void *ws,
                        size_t ws_bytes, double knapsack_distortion) {
    double *budgets = (double *)test_alloc(sizeof(double) * ((size_t)steps + 1));
    double *curve = (double *)test_alloc(sizeof(double) * ((size_t)steps + 1));
    int32_t w, bad_order = 0, bad_budget = 0, probe;
    if (CHECK_RESULT(kvmix_alloc_knapsack_sweep(&in->problem, steps, ws, ws_bytes, budgets, curve),
                     KVMIX_SUCCESS)) {
        CHECK_NEAR(curve[steps], knapsack_distortion, 0.0);
        for (w = 0; w <= steps; w++) {
            double want = (cheapest + (double)w * cell) / (double)in->total;
            if (w > 0 && curve[w] > curve[w - 1]) bad_order++;
            if (!(fabs(budgets[w] - want) <= 1e-12 * want)) bad_budget++;
        }
        CHECK_EQ_INT(bad_order, 0);
        CHECK_EQ_INT(bad_budget, 0);
        for (probe = 0; probe < 3; probe++) {
            double want;
            w = probe == 0 ? 0 : probe == 1 ? steps / 2 : steps / 3;
            want = brute_all(in, cheapest + (double)w * cell);
            CHECK_MSG(near_rel(curve[w], want), "sweep[%d] %.17g equals brute force %.17g", (int)w,
                      curve[w], want);
        }
        CHECK_RESULT(kvmix_alloc_knapsack_sweep(&in->problem, steps, ws, ws_bytes, NULL, NULL),
                     KVMIX_SUCCESS);
    }
    free(budgets);
    free(curve);
}

/* Knapsack on the grid (extra costs and room multiples of 1/16 = one cell): equals brute force
   over every precision. */
static void test_knapsack_grid(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], i;
    kvmix_alloc_summary s;
    test_rng_init(&rng, "alloc.knapsack_grid");
    for (i = 0; i < 300; i++) {
        int32_t n = test_rng_range(&rng, 1, 6), np = test_rng_range(&rng, 1, 5), k, t;
        int32_t steps;
        double cheapest = 0.0, want, room;
        size_t ws_bytes;
        void *ws;
        random_instance(&rng, &in, n, np, 60);
        /* shuffle the precisions so the cheapest need not be index 0 */
        for (k = np - 1; k > 0; k--) {
            int32_t j = test_rng_range(&rng, 0, k);
            double b = in.bits[k];
            in.bits[k] = in.bits[j];
            in.bits[j] = b;
        }
        random_budget(&rng, &in, 0, np - 1);
        for (t = 0; t < n; t++) {
            int32_t c, kmin = 0;
            for (c = 1; c < np; c++)
                if (in.bits[c] < in.bits[kmin]) kmin = c;
            cheapest += (double)in.tokens[t] * in.bits[kmin];
        }
        if (limit_of(&in) < cheapest) set_budget_cost(&in, cheapest);
        room = limit_of(&in) - cheapest; /* a multiple of 1/1024 */
        room = floor(room * 16.0) / 16.0;
        set_budget_cost(&in, cheapest + room); /* now a multiple of 1/16 */
        steps = room > 0.0 ? (int32_t)(room * 16.0) : test_rng_range(&rng, 1, 5);
        if (steps > 200000) steps = 0; /* cannot be on the grid cheaply: skip the grid */
        if (steps == 0) continue;
        test_context("knapsack grid instance %d: n %d, np %d, budget %.17g, steps %d", (int)i,
                     (int)n, (int)np, in.budget, (int)steps);
        want = brute_all(&in, limit_of(&in));
        if (!CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(&in.problem, steps, &ws_bytes),
                          KVMIX_SUCCESS))
            continue;
        CHECK_EQ_UINT(ws_bytes, ((size_t)steps + 1) * ((size_t)n + 16));
        ws = test_alloc(ws_bytes);
        test_poison(ws, ws_bytes, 4);
        if (CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, steps, ws, ws_bytes, choice, &s),
                         KVMIX_SUCCESS)) {
            check_outcome(&in, choice, &s, -1, -1);
            CHECK_MSG(near_rel(s.distortion, want), "knapsack %.17g equals brute force %.17g",
                      s.distortion, want);
            CHECK_EQ_INT(s.method, KVMIX_ALLOC_KNAPSACK);
            CHECK_EQ_INT(s.optimal, 1);
            check_sweep(&in, steps, cheapest, room > 0.0 ? 1.0 / 16.0 : 0.0, ws, ws_bytes,
                        s.distortion);
        }
        free(ws);
    }
    test_context(NULL);
}

/* Off the grid (arbitrary bits and budget): always within the real budget, never below the
   true optimum, and at most the optimum over choices that leave n_tags cells of room. */
static void test_knapsack_off_grid(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], i;
    kvmix_alloc_summary s;
    test_rng_init(&rng, "alloc.knapsack_off_grid");
    for (i = 0; i < 300; i++) {
        int32_t n = test_rng_range(&rng, 1, 6), np = test_rng_range(&rng, 2, 5), k, t;
        int32_t steps = test_rng_range(&rng, 1, 3000);
        double cheapest = 0.0, dearest = 0.0, optimum, bound, cell;
        size_t ws_bytes;
        void *ws;
        random_instance(&rng, &in, n, np, 1000);
        for (k = 0; k < np; k++) in.bits[k] *= 1.0 + 0.01 * test_rng_unit(&rng);
        for (t = 0; t < n; t++) {
            double lo = HUGE_VAL, hi = 0.0;
            for (k = 0; k < np; k++) {
                double c = (double)in.tokens[t] * in.bits[k];
                if (c < lo) lo = c;
                if (c > hi) hi = c;
            }
            cheapest += lo;
            dearest += hi;
        }
        in.budget = (cheapest + (dearest - cheapest) * test_rng_unit(&rng)) / (double)in.total;
        if (in.budget * (double)in.total < cheapest) in.budget = nextafter(in.budget, HUGE_VAL);
        instance_bind(&in);
        if (limit_of(&in) < cheapest) continue;
        test_context("knapsack off-grid instance %d: n %d, np %d, budget %.17g, steps %d", (int)i,
                     (int)n, (int)np, in.budget, (int)steps);
        cell = (limit_of(&in) - cheapest) / (double)steps;
        optimum = brute_all(&in, limit_of(&in));
        bound = brute_all(&in, limit_of(&in) - (double)n * cell * (1.0 + 1e-9));
        CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(&in.problem, steps, &ws_bytes),
                     KVMIX_SUCCESS);
        ws = test_alloc(ws_bytes);
        if (CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, steps, ws, ws_bytes, choice, &s),
                         KVMIX_SUCCESS)) {
            check_outcome(&in, choice, &s, -1, -1);
            CHECK_MSG(s.distortion >= optimum * (1.0 - DIST_TOL), "knapsack %.17g >= optimum %.17g",
                      s.distortion, optimum);
            CHECK_EQ_INT(s.optimal, 1); /* rounding up never needs the read-back restart */
            CHECK_MSG(bound == HUGE_VAL || s.distortion <= bound * (1.0 + DIST_TOL),
                      "knapsack %.17g <= optimum with n_tags cells of room %.17g", s.distortion,
                      bound);
        }
        free(ws);
    }
    test_context(NULL);
}

/* ---- per-tag prices (tag_bits) ------------------------------------------------------------ */

/* Every tag at its cheapest precision, in token-bits. */
static double cheapest_cost(const instance *in) {
    double sum = 0.0;
    int32_t t, k;
    for (t = 0; t < in->n; t++) {
        double lo = HUGE_VAL;
        for (k = 0; k < in->np; k++) lo = tag_cost(in, t, k) < lo ? tag_cost(in, t, k) : lo;
        sum += lo;
    }
    return sum;
}

/* Prices each tag's precisions apart, as runs do: bits[k] plus a tag's own overhead, multiples
   of 1/16 (costs stay exact), not always in the order of bits. The budget is the cost of a
   random choice (a boundary) or a multiple of 1/1024 between the cheapest and dearest costs. */
static void price_by_tag(test_rng *rng, instance *in) {
    int32_t choice[MAX_TAGS], t, k;
    double cheapest, dearest = 0.0;
    in->priced_by_tag = 1;
    for (t = 0; t < in->n; t++)
        for (k = 0; k < in->np; k++)
            in->tag_bits[t * in->np + k] = in->bits[k] + (double)test_rng_range(rng, 0, 40) / 16.0;
    instance_bind(in);
    cheapest = cheapest_cost(in);
    for (t = 0; t < in->n; t++) {
        double hi = 0.0;
        for (k = 0; k < in->np; k++) hi = tag_cost(in, t, k) > hi ? tag_cost(in, t, k) : hi;
        dearest += hi;
    }
    if (test_rng_unit(rng) < 0.5) {
        for (t = 0; t < in->n; t++) choice[t] = test_rng_range(rng, 0, in->np - 1);
        set_budget_cost(in, cost_of(in, choice));
        return;
    }
    in->budget =
        ceil((cheapest + (dearest - cheapest) * test_rng_unit(rng)) / (double)in->total * 1024.0) /
        1024.0;
    instance_bind(in);
}

/* Every allocator prices a tag by its own row: exhaustive equals brute force, greedy follows the
   documented order, the knapsack stays within its bounds, all within the budget. */
static void test_tag_bits_random(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], want[MAX_TAGS], all_low[MAX_TAGS] = {0}, i;
    kvmix_alloc_summary s;
    test_rng_init(&rng, "alloc.tag_bits");
    for (i = 0; i < 200; i++) {
        int32_t n = test_rng_range(&rng, 1, 7), np = test_rng_range(&rng, 2, 4), steps = 2048;
        size_t ws_bytes = 0;
        void *ws;
        double optimum, cell, bound;
        random_instance(&rng, &in, n, np, 3000);
        price_by_tag(&rng, &in);
        test_context("tag_bits instance %d: n %d, np %d, budget %.17g", (int)i, (int)n, (int)np,
                     in.budget);
        ws = test_alloc((size_t)MAX_TAGS * 32);
        if (cost_of(&in, all_low) > limit_of(&in)) { /* documented: every tag at low must fit */
            CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, np - 1, KVMIX_ALLOC_EXHAUSTIVE, NULL,
                                               0, choice, &s),
                         KVMIX_ERR_OUT_OF_MEMORY);
        } else {
            optimum = brute_two_level(&in, 0, np - 1);
            if (CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, np - 1, KVMIX_ALLOC_EXHAUSTIVE,
                                                   NULL, 0, choice, &s),
                             KVMIX_SUCCESS)) {
                check_outcome(&in, choice, &s, 0, np - 1);
                CHECK_MSG(near_rel(s.distortion, optimum),
                          "exhaustive %.17g equals brute force %.17g", s.distortion, optimum);
            }
            if (CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, np - 1, KVMIX_ALLOC_GREEDY, ws,
                                                   (size_t)MAX_TAGS * 32, choice, &s),
                             KVMIX_SUCCESS)) {
                check_outcome(&in, choice, &s, 0, np - 1);
                reference_greedy(&in, 0, np - 1, want);
                CHECK_MEM_EQ(choice, want, (size_t)n * sizeof choice[0]);
            }
        }
        free(ws);
        optimum = brute_all(&in, limit_of(&in));
        cell = (limit_of(&in) - cheapest_cost(&in)) / (double)steps;
        bound = brute_all(&in, limit_of(&in) - (double)n * cell * (1.0 + 1e-9));
        CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(&in.problem, steps, &ws_bytes),
                     KVMIX_SUCCESS);
        ws = test_alloc(ws_bytes);
        if (optimum < HUGE_VAL &&
            CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, steps, ws, ws_bytes, choice, &s),
                         KVMIX_SUCCESS)) {
            check_outcome(&in, choice, &s, -1, -1);
            CHECK_MSG(s.distortion >= optimum * (1.0 - DIST_TOL), "knapsack %.17g >= optimum %.17g",
                      s.distortion, optimum);
            CHECK_MSG(bound == HUGE_VAL || s.distortion <= bound * (1.0 + DIST_TOL),
                      "knapsack %.17g <= optimum with n_tags cells of room %.17g", s.distortion,
                      bound);
        }
        free(ws);
    }
    test_context(NULL);
}

/* A tag whose runs make its dear precision dearer than another tag's loses the upgrade that
   plain bits would give it; a priced row that is not finite and positive is refused. */
static void test_tag_bits_decide(void) {
    instance in;
    int32_t choice[2], t;
    kvmix_alloc_summary s;
    double ws[256];
    memset(&in, 0, sizeof in);
    in.n = 2;
    in.np = 2;
    in.tokens[0] = in.tokens[1] = 64;
    in.total = 128;
    in.bits[0] = 2.0;
    in.bits[1] = 4.0;
    in.distortion[0] = 10.0; /* tag 0 gains 10 from the upgrade, tag 1 gains 9 */
    in.distortion[2] = 9.0;
    in.budget = 3.25;
    instance_bind(&in);
    CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, 1, KVMIX_ALLOC_AUTO, NULL, 0, choice, &s),
                 KVMIX_SUCCESS);
    CHECK(choice[0] == 1 && choice[1] == 0); /* plain bits: tag 0 is upgraded */
    in.priced_by_tag = 1;
    in.tag_bits[0] = 2.5; /* tag 0 in short runs: its upgrade no longer fits */
    in.tag_bits[1] = 8.0;
    in.tag_bits[2] = 2.0;
    in.tag_bits[3] = 4.0;
    instance_bind(&in);
    for (t = 0; t < 3; t++) {
        kvmix_result r = t < 2 ? kvmix_alloc_two_level(&in.problem, 0, 1,
                                                       t ? KVMIX_ALLOC_GREEDY : KVMIX_ALLOC_AUTO,
                                                       ws, sizeof ws, choice, &s)
                               : kvmix_alloc_knapsack(&in.problem, 16, ws, sizeof ws, choice, &s);
        test_context("allocator %d", (int)t);
        if (!CHECK_RESULT(r, KVMIX_SUCCESS)) continue;
        CHECK(choice[0] == 0 && choice[1] == 1);
        CHECK_NEAR(s.bits, (64 * 2.5 + 64 * 4.0) / 128.0, 0.0);
    }
    test_context(NULL);
    in.tag_bits[3] = NAN;
    CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, 1, KVMIX_ALLOC_AUTO, NULL, 0, choice, &s),
                 KVMIX_ERR_BAD_VALUE);
    in.tag_bits[3] = 0.0;
    CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, 16, ws, sizeof ws, choice, &s),
                 KVMIX_ERR_BAD_VALUE);
}

/* The knapsack over two precisions on the grid against the exhaustive search, at sizes where
   brute force over all precisions would be too slow. */
static void test_knapsack_vs_exhaustive(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], i;
    kvmix_alloc_summary s, e;
    test_rng_init(&rng, "alloc.knapsack_vs_exhaustive");
    for (i = 0; i < 40; i++) {
        int32_t n = test_rng_range(&rng, 8, 20), steps, t;
        double room, all_low = 0.0;
        size_t ws_bytes;
        void *ws;
        random_instance(&rng, &in, n, 2, 100);
        random_budget(&rng, &in, 0, 1);
        for (t = 0; t < n; t++) all_low += (double)in.tokens[t] * in.bits[0];
        room = floor((limit_of(&in) - all_low) * 16.0) / 16.0;
        set_budget_cost(&in, all_low + room);
        steps = (int32_t)(room * 16.0);
        if (steps < 1) steps = 1;
        test_context("knapsack vs exhaustive %d: n %d, budget %.17g, steps %d", (int)i, (int)n,
                     in.budget, (int)steps);
        if (!CHECK_RESULT(
                kvmix_alloc_two_level(&in.problem, 0, 1, KVMIX_ALLOC_AUTO, NULL, 0, choice, &e),
                KVMIX_SUCCESS) ||
            !CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(&in.problem, steps, &ws_bytes),
                          KVMIX_SUCCESS))
            continue;
        ws = test_alloc(ws_bytes);
        if (CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, steps, ws, ws_bytes, choice, &s),
                         KVMIX_SUCCESS)) {
            check_outcome(&in, choice, &s, -1, -1);
            CHECK_MSG(near_rel(s.distortion, e.distortion),
                      "knapsack %.17g equals exhaustive %.17g", s.distortion, e.distortion);
        }
        free(ws);
    }
    test_context(NULL);
}

/* ---- edge cases -------------------------------------------------------------------------- */

static kvmix_result run_two_level(const instance *in, int32_t low, int32_t high,
                                  kvmix_alloc_method method, int32_t *choice,
                                  kvmix_alloc_summary *s) {
    static double ws[MAX_TAGS * 4];
    return kvmix_alloc_two_level(&in->problem, low, high, method, ws, sizeof ws, choice, s);
}

static kvmix_result run_knapsack(const instance *in, int32_t steps, int32_t *choice,
                                 kvmix_alloc_summary *s) {
    size_t bytes = 0;
    void *ws;
    kvmix_result r;
    if (kvmix_alloc_knapsack_workspace_bytes(&in->problem, steps, &bytes) != KVMIX_SUCCESS)
        bytes = 64;
    ws = test_alloc(bytes);
    r = kvmix_alloc_knapsack(&in->problem, steps, ws, bytes, choice, s);
    free(ws);
    return r;
}

static void test_edges(void) {
    test_rng rng;
    instance in;
    int32_t choice[MAX_TAGS], all[MAX_TAGS], t, m, steps;
    kvmix_alloc_summary s;
    kvmix_alloc_method methods[2] = {KVMIX_ALLOC_EXHAUSTIVE, KVMIX_ALLOC_GREEDY};
    test_rng_init(&rng, "alloc.edges");

    /* budget exactly the all-high cost: everything goes high (gains are positive) */
    random_instance(&rng, &in, 10, 2, 100);
    for (t = 0; t < 10; t++) {
        in.distortion[t * 2 + 0] = 1.0 + t;
        in.distortion[t * 2 + 1] = 0.5;
        all[t] = 1;
    }
    set_budget_cost(&in, cost_of(&in, all));
    for (m = 0; m < 2; m++) {
        test_context("budget at the all-high cost, method %d", (int)methods[m]);
        if (CHECK_RESULT(run_two_level(&in, 0, 1, methods[m], choice, &s), KVMIX_SUCCESS)) {
            CHECK_MEM_EQ(choice, all, sizeof(int32_t) * 10);
            CHECK_NEAR(s.distortion, 5.0, 0.0);
            check_outcome(&in, choice, &s, 0, 1);
        }
    }
    test_context("budget at the all-high cost, knapsack on the grid");
    steps = (int32_t)((cost_of(&in, all) - (double)in.total * in.bits[0]) * 16.0);
    if (CHECK_RESULT(run_knapsack(&in, steps, choice, &s), KVMIX_SUCCESS))
        CHECK_MEM_EQ(choice, all, sizeof(int32_t) * 10);
    test_context("budget at the all-high cost, knapsack, default grid");
    if (CHECK_RESULT(run_knapsack(&in, 0, choice, &s), KVMIX_SUCCESS))
        CHECK_MEM_EQ(choice, all, sizeof(int32_t) * 10);
    /* one ulp less: the most expensive choice no longer fits */
    in.budget = nextafter(in.budget, 0.0);
    instance_bind(&in);
    test_context("budget one ulp under the all-high cost");
    if (CHECK_RESULT(run_two_level(&in, 0, 1, KVMIX_ALLOC_EXHAUSTIVE, choice, &s), KVMIX_SUCCESS))
        CHECK(memcmp(choice, all, sizeof(int32_t) * 10) != 0);
    if (CHECK_RESULT(run_knapsack(&in, 64, choice, &s), KVMIX_SUCCESS)) {
        CHECK(memcmp(choice, all, sizeof(int32_t) * 10) != 0);
        check_outcome(&in, choice, &s, -1, -1);
    }

    /* budget exactly the all-low cost: all low (but zero-token tags go high for free) */
    for (t = 0; t < 10; t++) all[t] = 0;
    for (t = 0; t < 10; t++) in.tokens[t] += in.tokens[t] == 0;
    in.tokens[3] = 0;
    fix_total(&in);
    set_budget_cost(&in, cost_of(&in, all));
    all[3] = 1;
    for (m = 0; m < 2; m++) {
        test_context("budget at the all-low cost, method %d", (int)methods[m]);
        if (CHECK_RESULT(run_two_level(&in, 0, 1, methods[m], choice, &s), KVMIX_SUCCESS)) {
            CHECK_MEM_EQ(choice, all, sizeof(int32_t) * 10);
            check_outcome(&in, choice, &s, 0, 1);
        }
    }
    test_context("knapsack at the all-low cost");
    if (CHECK_RESULT(run_knapsack(&in, 1, choice, &s), KVMIX_SUCCESS)) {
        CHECK_MEM_EQ(choice, all, sizeof(int32_t) * 10);
        CHECK_EQ_INT(s.optimal, 1);
    }

    /* infeasible: under the all-low cost; nothing written */
    in.budget = nextafter(in.budget, 0.0);
    instance_bind(&in);
    for (m = 0; m < 2; m++) {
        test_context("infeasible budget, method %d", (int)methods[m]);
        test_poison(choice, sizeof choice, POISON_ID);
        test_poison(&s, sizeof s, POISON_ID);
        CHECK_RESULT(run_two_level(&in, 0, 1, methods[m], choice, &s), KVMIX_ERR_OUT_OF_MEMORY);
        CHECK(test_is_poisoned(choice, sizeof choice, POISON_ID));
        CHECK(test_is_poisoned(&s, sizeof s, POISON_ID));
    }
    test_context("infeasible budget, knapsack");
    test_poison(choice, sizeof choice, POISON_ID);
    test_poison(&s, sizeof s, POISON_ID);
    CHECK_RESULT(run_knapsack(&in, 16, choice, &s), KVMIX_ERR_OUT_OF_MEMORY);
    CHECK(test_is_poisoned(choice, sizeof choice, POISON_ID));
    CHECK(test_is_poisoned(&s, sizeof s, POISON_ID));
    {
        double curve[17], ws[64];
        size_t bytes = 0;
        test_context("infeasible budget, sweep");
        CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(&in.problem, 16, &bytes), KVMIX_SUCCESS);
        CHECK(bytes <= sizeof ws);
        test_poison(curve, sizeof curve, POISON_ID);
        CHECK_RESULT(kvmix_alloc_knapsack_sweep(&in.problem, 16, ws, sizeof ws, curve, curve),
                     KVMIX_ERR_OUT_OF_MEMORY);
        CHECK(test_is_poisoned(curve, sizeof curve, POISON_ID));
        CHECK_RESULT(kvmix_alloc_knapsack_sweep(NULL, 16, ws, sizeof ws, curve, curve),
                     KVMIX_ERR_NULL_POINTER);
        CHECK_RESULT(kvmix_alloc_knapsack_sweep(&in.problem, 16, ws, 8, curve, curve),
                     KVMIX_ERR_BUFFER_TOO_SMALL);
        CHECK(test_is_poisoned(curve, sizeof curve, POISON_ID));
    }

    /* one tag: high when the budget allows, low otherwise */
    random_instance(&rng, &in, 1, 3, 50);
    in.distortion[0] = 3.0;
    in.distortion[1] = 2.0;
    in.distortion[2] = 1.0;
    in.budget = in.bits[2];
    instance_bind(&in);
    test_context("one tag");
    if (CHECK_RESULT(run_two_level(&in, 0, 2, KVMIX_ALLOC_AUTO, choice, &s), KVMIX_SUCCESS))
        CHECK_EQ_INT(choice[0], 2);
    if (CHECK_RESULT(run_knapsack(&in, 0, choice, &s), KVMIX_SUCCESS)) CHECK_EQ_INT(choice[0], 2);
    in.budget = (in.bits[1] + in.bits[2]) / 2.0;
    instance_bind(&in);
    if (CHECK_RESULT(run_two_level(&in, 0, 2, KVMIX_ALLOC_GREEDY, choice, &s), KVMIX_SUCCESS))
        CHECK_EQ_INT(choice[0], 0);
    if (CHECK_RESULT(run_knapsack(&in, 0, choice, &s), KVMIX_SUCCESS)) CHECK_EQ_INT(choice[0], 1);

    /* equal gains and tokens: exactly floor(room / cost) tags go high, lowest indices first in
       greedy; the optimum has the same count */
    random_instance(&rng, &in, 16, 2, 1);
    for (t = 0; t < 16; t++) {
        in.tokens[t] = 4;
        in.distortion[t * 2] = 2.0;
        in.distortion[t * 2 + 1] = 1.0;
    }
    in.total = 64;
    in.bits[0] = 2.0;
    in.bits[1] = 4.0;
    in.budget = 2.0 + 2.0 * 5.5 / 16.0; /* room for 5.5 upgrades */
    instance_bind(&in);
    for (m = 0; m < 2; m++) {
        int32_t n_high = 0;
        test_context("equal gains, method %d", (int)methods[m]);
        if (!CHECK_RESULT(run_two_level(&in, 0, 1, methods[m], choice, &s), KVMIX_SUCCESS))
            continue;
        for (t = 0; t < 16; t++) n_high += choice[t];
        CHECK_EQ_INT(n_high, 5);
        CHECK_NEAR(s.distortion, 27.0, 0.0);
        if (methods[m] == KVMIX_ALLOC_GREEDY)
            for (t = 0; t < 16; t++) CHECK_EQ_INT(choice[t], t < 5);
    }
    if (CHECK_RESULT(run_knapsack(&in, 0, choice, &s), KVMIX_SUCCESS))
        CHECK_NEAR(s.distortion, 27.0, 0.0);

    /* zero distortion everywhere: any choice within budget, distortion 0; greedy upgrades
       nothing (no gain) */
    for (t = 0; t < 32; t++) in.distortion[t] = 0.0;
    for (m = 0; m < 2; m++) {
        test_context("zero distortion, method %d", (int)methods[m]);
        if (CHECK_RESULT(run_two_level(&in, 0, 1, methods[m], choice, &s), KVMIX_SUCCESS)) {
            CHECK_NEAR(s.distortion, 0.0, 0.0);
            check_outcome(&in, choice, &s, 0, 1);
        }
    }
    if (CHECK_RESULT(run_knapsack(&in, 0, choice, &s), KVMIX_SUCCESS)) {
        CHECK_NEAR(s.distortion, 0.0, 0.0);
        check_outcome(&in, choice, &s, -1, -1);
    }

    /* higher precision measured worse (negative gain): never upgraded */
    for (t = 0; t < 16; t++) {
        in.distortion[t * 2] = 1.0;
        in.distortion[t * 2 + 1] = 1.5;
    }
    in.budget = 4.0;
    instance_bind(&in);
    for (m = 0; m < 2; m++) {
        test_context("negative gains, method %d", (int)methods[m]);
        if (CHECK_RESULT(run_two_level(&in, 0, 1, methods[m], choice, &s), KVMIX_SUCCESS))
            CHECK_NEAR(s.distortion, 16.0, 0.0);
    }
    if (CHECK_RESULT(run_knapsack(&in, 0, choice, &s), KVMIX_SUCCESS))
        CHECK_NEAR(s.distortion, 16.0, 0.0);
    test_context(NULL);
}

/* ---- argument checks ---------------------------------------------------------------------- */

/* Runs both allocators (two-level greedy and exhaustive, knapsack) on a broken instance and
   checks the result and that nothing was written; with a field, kvmix_alloc_problem_check gives
   the same result and names it. */
static void expect_error(const instance *in, int32_t low, int32_t high, int knapsack_too,
                         kvmix_result want, const char *field, const char *what) {
    static double ws[4096];
    int32_t choice[MAX_TAGS];
    kvmix_alloc_summary s;
    kvmix_error why = {NULL, NULL};
    test_context("bad input: %s", what);
    if (field) {
        CHECK_RESULT(kvmix_alloc_problem_check(&in->problem, &why), want);
        CHECK_MSG(why.field != NULL && strcmp(why.field, field) == 0, "field %s, expected %s",
                  why.field ? why.field : "(null)", field);
        CHECK(why.reason != NULL && why.reason[0] != '\0');
    }
    test_poison(choice, sizeof choice, POISON_ID);
    test_poison(&s, sizeof s, POISON_ID);
    CHECK_RESULT(kvmix_alloc_two_level(&in->problem, low, high, KVMIX_ALLOC_GREEDY, ws, sizeof ws,
                                       choice, &s),
                 want);
    CHECK_RESULT(
        kvmix_alloc_two_level(&in->problem, low, high, KVMIX_ALLOC_AUTO, ws, sizeof ws, choice, &s),
        want);
    if (knapsack_too)
        CHECK_RESULT(kvmix_alloc_knapsack(&in->problem, 16, ws, sizeof ws, choice, &s), want);
    CHECK(test_is_poisoned(choice, sizeof choice, POISON_ID));
    CHECK(test_is_poisoned(&s, sizeof s, POISON_ID));
}

static void test_bad_input(void) {
    test_rng rng;
    instance good, in;
    int32_t choice[MAX_TAGS];
    kvmix_alloc_summary s;
    size_t bytes;
    double ws[1024];
    test_rng_init(&rng, "alloc.bad_input");
    random_instance(&rng, &good, 6, 3, 100);
    good.budget = good.bits[1];
    instance_bind(&good);

#define BAD(stmt, want, field, what)                                                               \
    do {                                                                                           \
        in = good;                                                                                 \
        instance_bind(&in);                                                                        \
        stmt;                                                                                      \
        expect_error(&in, 0, 2, 1, want, field, what);                                             \
    } while (0)
    {
        kvmix_error why = {NULL, NULL};
        CHECK_RESULT(kvmix_alloc_problem_check(&good.problem, &why), KVMIX_SUCCESS);
        CHECK(why.field != NULL && strcmp(why.field, "") == 0 && strcmp(why.reason, "") == 0);
        CHECK_RESULT(kvmix_alloc_problem_check(NULL, &why), KVMIX_ERR_NULL_POINTER);
        CHECK(strcmp(why.field, "problem") == 0);
    }
    BAD(in.problem.n_tags = 0, KVMIX_ERR_INVALID_ARGUMENT, "n_tags", "n_tags 0");
    BAD(in.problem.n_tags = -3, KVMIX_ERR_INVALID_ARGUMENT, "n_tags", "n_tags negative");
    BAD(in.problem.n_tags = KVMIX_ALLOC_MAX_TAGS + 1, KVMIX_ERR_INVALID_ARGUMENT, "n_tags",
        "n_tags big");
    BAD(in.problem.n_precisions = 0, KVMIX_ERR_INVALID_ARGUMENT, "n_precisions", "n_precisions 0");
    BAD(in.problem.n_precisions = KVMIX_ALLOC_MAX_PRECISIONS + 1, KVMIX_ERR_INVALID_ARGUMENT,
        "n_precisions", "n_precisions big");
    BAD(in.problem.tokens = NULL, KVMIX_ERR_NULL_POINTER, "tokens", "tokens NULL");
    BAD(in.problem.distortion = NULL, KVMIX_ERR_NULL_POINTER, "distortion", "distortion NULL");
    BAD(in.problem.bits = NULL, KVMIX_ERR_NULL_POINTER, "bits", "bits NULL");
    BAD(in.tokens[2] = -1, KVMIX_ERR_INVALID_ARGUMENT, "tokens", "negative tokens");
    BAD(memset(in.tokens, 0, sizeof in.tokens), KVMIX_ERR_INVALID_ARGUMENT, "tokens", "no tokens");
    BAD((in.tokens[0] = INT64_MAX / 2, in.tokens[1] = INT64_MAX / 2), KVMIX_ERR_INVALID_ARGUMENT,
        "tokens", "tokens beyond 2^53");
    BAD(in.distortion[4] = NAN, KVMIX_ERR_BAD_VALUE, "distortion", "NaN distortion");
    BAD(in.distortion[4] = -1e-300, KVMIX_ERR_BAD_VALUE, "distortion", "negative distortion");
    BAD(in.distortion[0] = HUGE_VAL, KVMIX_ERR_BAD_VALUE, "distortion", "infinite distortion");
    BAD((in.distortion[0] = 1.5e308, in.distortion[3] = 1.5e308), KVMIX_ERR_BAD_VALUE, "distortion",
        "distortion sum overflows");
    BAD(in.bits[1] = NAN, KVMIX_ERR_BAD_VALUE, "bits", "NaN bits");
    BAD(in.bits[0] = 0.0, KVMIX_ERR_BAD_VALUE, "bits", "zero bits");
    BAD(in.bits[2] = -4.0, KVMIX_ERR_BAD_VALUE, "bits", "negative bits");
    BAD(in.bits[2] = 70000.0, KVMIX_ERR_BAD_VALUE, "bits", "bits too large");
    BAD(in.problem.budget_bits = NAN, KVMIX_ERR_BAD_VALUE, "budget_bits", "NaN budget");
    BAD(in.problem.budget_bits = 0.0, KVMIX_ERR_BAD_VALUE, "budget_bits", "zero budget");
    BAD(in.problem.budget_bits = -3.0, KVMIX_ERR_BAD_VALUE, "budget_bits", "negative budget");
    BAD(in.problem.budget_bits = HUGE_VAL, KVMIX_ERR_BAD_VALUE, "budget_bits", "infinite budget");
    BAD(in.problem.budget_bits = 1e308, KVMIX_ERR_BAD_VALUE, "budget_bits",
        "budget times tokens overflows");
#undef BAD

    in = good;
    instance_bind(&in);
    expect_error(&in, 1, 1, 0, KVMIX_ERR_INVALID_ARGUMENT, NULL, "low == high");
    expect_error(&in, 2, 0, 0, KVMIX_ERR_INVALID_ARGUMENT, NULL, "bits[low] > bits[high]");
    expect_error(&in, -1, 2, 0, KVMIX_ERR_INVALID_ARGUMENT, NULL, "low negative");
    expect_error(&in, 0, 3, 0, KVMIX_ERR_INVALID_ARGUMENT, NULL, "high out of range");
    in.bits[2] = in.bits[0];
    expect_error(&in, 0, 2, 0, KVMIX_ERR_INVALID_ARGUMENT, NULL, "bits[low] == bits[high]");

    in = good;
    instance_bind(&in);
    test_context("bad input: calls");
    test_poison(choice, sizeof choice, POISON_ID);
    test_poison(&s, sizeof s, POISON_ID);
    CHECK_RESULT(kvmix_alloc_two_level(NULL, 0, 2, KVMIX_ALLOC_AUTO, ws, sizeof ws, choice, &s),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(
        kvmix_alloc_two_level(&in.problem, 0, 2, KVMIX_ALLOC_AUTO, ws, sizeof ws, NULL, &s),
        KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(
        kvmix_alloc_two_level(&in.problem, 0, 2, (kvmix_alloc_method)7, ws, sizeof ws, choice, &s),
        KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(
        kvmix_alloc_two_level(&in.problem, 0, 2, KVMIX_ALLOC_KNAPSACK, ws, sizeof ws, choice, &s),
        KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(
        kvmix_alloc_two_level(&in.problem, 0, 2, KVMIX_ALLOC_GREEDY, ws, 6 * 32 - 1, choice, &s),
        KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_RESULT(
        kvmix_alloc_two_level(&in.problem, 0, 2, KVMIX_ALLOC_GREEDY, NULL, 6 * 32, choice, &s),
        KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, 2, KVMIX_ALLOC_GREEDY, (char *)ws + 4,
                                       sizeof ws - 4, choice, &s),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_alloc_knapsack(NULL, 16, ws, sizeof ws, choice, &s), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, 16, ws, sizeof ws, NULL, &s),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, -1, ws, sizeof ws, choice, &s),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(
        kvmix_alloc_knapsack(&in.problem, KVMIX_ALLOC_MAX_STEPS + 1, ws, sizeof ws, choice, &s),
        KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, 16, ws, 17 * 22 - 1, choice, &s),
                 KVMIX_ERR_BUFFER_TOO_SMALL);
    CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, 16, NULL, 17 * 22, choice, &s),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, 16, (char *)ws + 4, sizeof ws - 4, choice, &s),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK(test_is_poisoned(choice, sizeof choice, POISON_ID));
    CHECK(test_is_poisoned(&s, sizeof s, POISON_ID));
    /* the summary is optional */
    CHECK_RESULT(kvmix_alloc_two_level(&in.problem, 0, 2, KVMIX_ALLOC_AUTO, NULL, 0, choice, NULL),
                 KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_alloc_knapsack(&in.problem, 16, ws, sizeof ws, choice, NULL), KVMIX_SUCCESS);

    /* exhaustive is refused above its limit, and so is its workspace query */
    {
        static int64_t tokens[KVMIX_ALLOC_EXACT_MAX_TAGS + 1];
        static double dist[(KVMIX_ALLOC_EXACT_MAX_TAGS + 1) * 2];
        static const double bits[2] = {2.0, 4.0};
        kvmix_alloc_problem p = {0};
        int32_t t;
        for (t = 0; t <= KVMIX_ALLOC_EXACT_MAX_TAGS; t++) {
            tokens[t] = 1;
            dist[2 * t] = 1.0;
            dist[2 * t + 1] = 0.5;
        }
        p.n_tags = KVMIX_ALLOC_EXACT_MAX_TAGS + 1;
        p.n_precisions = 2;
        p.tokens = tokens;
        p.distortion = dist;
        p.bits = bits;
        p.budget_bits = 3.0;
        test_context("exhaustive above KVMIX_ALLOC_EXACT_MAX_TAGS");
        test_poison(choice, sizeof choice, POISON_ID);
        CHECK_RESULT(
            kvmix_alloc_two_level(&p, 0, 1, KVMIX_ALLOC_EXHAUSTIVE, ws, sizeof ws, choice, &s),
            KVMIX_ERR_INVALID_ARGUMENT);
        CHECK(test_is_poisoned(choice, sizeof choice, POISON_ID));
        CHECK_RESULT(
            kvmix_alloc_two_level_workspace_bytes(p.n_tags, KVMIX_ALLOC_EXHAUSTIVE, &bytes),
            KVMIX_ERR_INVALID_ARGUMENT);
        if (CHECK_RESULT(
                kvmix_alloc_two_level(&p, 0, 1, KVMIX_ALLOC_AUTO, ws, sizeof ws, choice, &s),
                KVMIX_SUCCESS))
            CHECK_EQ_INT(s.method, KVMIX_ALLOC_GREEDY);
    }

    test_context("workspace queries");
    CHECK_RESULT(kvmix_alloc_two_level_workspace_bytes(5, KVMIX_ALLOC_AUTO, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_alloc_two_level_workspace_bytes(0, KVMIX_ALLOC_AUTO, &bytes),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_alloc_two_level_workspace_bytes(5, (kvmix_alloc_method)-1, &bytes),
                 KVMIX_ERR_INVALID_ARGUMENT);
    if (CHECK_RESULT(kvmix_alloc_two_level_workspace_bytes(5, KVMIX_ALLOC_AUTO, &bytes),
                     KVMIX_SUCCESS))
        CHECK_EQ_UINT(bytes, 0);
    if (CHECK_RESULT(kvmix_alloc_two_level_workspace_bytes(23, KVMIX_ALLOC_AUTO, &bytes),
                     KVMIX_SUCCESS))
        CHECK_EQ_UINT(bytes, 23 * 32);
    CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(NULL, 0, &bytes), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(&in.problem, 0, NULL),
                 KVMIX_ERR_NULL_POINTER);
    if (CHECK_RESULT(kvmix_alloc_knapsack_workspace_bytes(&in.problem, 0, &bytes), KVMIX_SUCCESS))
        CHECK_EQ_UINT(bytes, (size_t)(KVMIX_ALLOC_STEPS_DEFAULT + 1) * (6 + 16));
    test_context(NULL);
}

void unit_alloc(void) {
    test_two_level_random();
    test_two_level_largest();
    test_two_level_inexact();
    test_greedy_random();
    test_knapsack_grid();
    test_knapsack_off_grid();
    test_knapsack_vs_exhaustive();
    test_tag_bits_random();
    test_tag_bits_decide();
    test_edges();
    test_bad_input();
}
