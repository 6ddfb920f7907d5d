/* unit_policy: the kvmix_policy room: built-ins, checks (every rule names its field and leaves the
   output alone), resolution against a head_dim, and a cache built from kvmix_policy_apply storing
   tokens as the policy says. */
#include "harness.h"

#include <string.h>

static kvmix_policy valid_policy(void) {
    kvmix_policy p;
    memset(&p, 0, sizeof p);
    strcpy(p.name, "test");
    p.key_format = KVMIX_FORMAT_INT2_CHANNEL;
    p.value_format = KVMIX_FORMAT_INT4;
    p.group_size = 32;
    p.page_tokens = 16;
    p.sink_tokens = 4;
    p.window_tokens = 32;
    p.partial_page = KVMIX_CACHE_PARTIAL_QUANTIZE;
    return p;
}

static void test_builtins(void) {
    static const char *names[] = {"fp16",     "int8",           "int4",
                                  "kivi2",    "kivi2-sink",     "kitty-12",
                                  "kitty-25", "kitty-paper-12", "kitty-paper-25"};
    int32_t i, j;
    test_context("built-in policies");
    CHECK_EQ_INT(kvmix_policy_count(), (int32_t)(sizeof names / sizeof names[0]));
    for (i = 0; i < kvmix_policy_count(); i++) {
        const kvmix_policy *p = kvmix_policy_at(i);
        kvmix_policy r, again;
        if (!CHECK(p != NULL)) continue;
        CHECK_MSG(strcmp(p->name, names[i]) == 0, "built-in %d is %s", (int)i, names[i]);
        CHECK(kvmix_policy_find(names[i]) == p);
        CHECK_RESULT(kvmix_policy_check(p, NULL), KVMIX_SUCCESS);
        for (j = 64; j <= 256; j *= 2) {
            CHECK_RESULT(kvmix_policy_resolve(p, j, &r, NULL), KVMIX_SUCCESS);
            CHECK_RESULT(kvmix_policy_resolve(&r, j, &again, NULL), KVMIX_SUCCESS);
            CHECK_MEM_EQ(&r, &again, sizeof r); /* a resolved policy resolves to itself */
        }
    }
    CHECK(kvmix_policy_at(-1) == NULL && kvmix_policy_at(kvmix_policy_count()) == NULL);
    CHECK(kvmix_policy_find("kivi3") == NULL && kvmix_policy_find(NULL) == NULL);
    test_context(NULL);
}

typedef struct bad_policy {
    const char *field;
    kvmix_result want;
    void (*spoil)(kvmix_policy *p);
} bad_policy;

static void no_name(kvmix_policy *p) { p->name[0] = 0; }
static void name_unterminated(kvmix_policy *p) { memset(p->name, 'a', sizeof p->name); }
static void description_unterminated(kvmix_policy *p) {
    memset(p->description, 'a', sizeof p->description);
}
static void key_format_zero(kvmix_policy *p) { p->key_format = 0; }
static void value_format_seven(kvmix_policy *p) { p->value_format = 7; }
static void group_twenty(kvmix_policy *p) { p->group_size = 20; }
static void group_negative(kvmix_policy *p) { p->group_size = -8; }
static void group_zero(kvmix_policy *p) { p->group_size = 0; }
static void value_group_twelve(kvmix_policy *p) { p->value_group_size = 12; }
static void values_only_two(kvmix_policy *p) { p->window_values_only = 2; }
static void boost_without_boosted(kvmix_policy *p) { p->n_boost = 8; }
static void fraction_without_boosted(kvmix_policy *p) { p->boost_fraction = 0.25; }
static void boosted_without_boost(kvmix_policy *p) { p->key_format = KVMIX_FORMAT_BOOSTED; }
static void boost_six(kvmix_policy *p) {
    p->key_format = KVMIX_FORMAT_BOOSTED;
    p->n_boost = 6;
}
static void fraction_nan(kvmix_policy *p) {
    p->key_format = KVMIX_FORMAT_BOOSTED;
    p->boost_fraction = -0.5;
}
static void page_twelve(kvmix_policy *p) { p->page_tokens = 12; }
static void page_huge(kvmix_policy *p) { p->page_tokens = 2048; }
static void sinks_past_page(kvmix_policy *p) { p->sink_tokens = 17; }
static void window_negative(kvmix_policy *p) { p->window_tokens = -1; }
static void partial_three(kvmix_policy *p) { p->partial_page = 3; }
static void boundary_two(kvmix_policy *p) { p->request_boundary = 2; }

static void test_check_errors(void) {
    static const bad_policy cases[] = {
        {"name", KVMIX_ERR_INVALID_ARGUMENT, no_name},
        {"name", KVMIX_ERR_INVALID_ARGUMENT, name_unterminated},
        {"description", KVMIX_ERR_INVALID_ARGUMENT, description_unterminated},
        {"key_format", KVMIX_ERR_UNKNOWN_FORMAT, key_format_zero},
        {"value_format", KVMIX_ERR_UNKNOWN_FORMAT, value_format_seven},
        {"group_size", KVMIX_ERR_INVALID_ARGUMENT, group_twenty},
        {"group_size", KVMIX_ERR_INVALID_ARGUMENT, group_negative},
        {"group_size", KVMIX_ERR_INVALID_ARGUMENT, group_zero},
        {"value_group_size", KVMIX_ERR_INVALID_ARGUMENT, value_group_twelve},
        {"window_values_only", KVMIX_ERR_INVALID_ARGUMENT, values_only_two},
        {"n_boost", KVMIX_ERR_INVALID_ARGUMENT, boost_without_boosted},
        {"boost_fraction", KVMIX_ERR_INVALID_ARGUMENT, fraction_without_boosted},
        {"n_boost", KVMIX_ERR_INVALID_ARGUMENT, boosted_without_boost},
        {"n_boost", KVMIX_ERR_INVALID_ARGUMENT, boost_six},
        {"boost_fraction", KVMIX_ERR_INVALID_ARGUMENT, fraction_nan},
        {"page_tokens", KVMIX_ERR_INVALID_ARGUMENT, page_twelve},
        {"page_tokens", KVMIX_ERR_INVALID_ARGUMENT, page_huge},
        {"sink_tokens", KVMIX_ERR_INVALID_ARGUMENT, sinks_past_page},
        {"window_tokens", KVMIX_ERR_INVALID_ARGUMENT, window_negative},
        {"partial_page", KVMIX_ERR_INVALID_ARGUMENT, partial_three},
        {"request_boundary", KVMIX_ERR_INVALID_ARGUMENT, boundary_two},
    };
    size_t i;
    kvmix_policy good = valid_policy(), out, before;
    kvmix_cache_desc desc, desc_before;
    kvmix_policy_error why;
    CHECK_RESULT(kvmix_policy_check(&good, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_policy_check(NULL, NULL), KVMIX_ERR_NULL_POINTER);
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvmix_policy p = valid_policy();
        cases[i].spoil(&p);
        test_context("bad policy case %d (%s)", (int)i, cases[i].field);
        why.field = why.reason = NULL;
        CHECK_RESULT(kvmix_policy_check(&p, &why), cases[i].want);
        CHECK(why.field != NULL && strcmp(why.field, cases[i].field) == 0);
        CHECK(why.reason != NULL && why.reason[0] != 0);
        memset(&out, 0x5a, sizeof out);
        before = out;
        CHECK_RESULT(kvmix_policy_resolve(&p, 64, &out, NULL), cases[i].want);
        CHECK_MEM_EQ(&out, &before, sizeof out);
        memset(&desc, 0, sizeof desc);
        desc.head_dim = 64;
        desc_before = desc;
        CHECK_RESULT(kvmix_policy_apply(&p, &desc, NULL), cases[i].want);
        CHECK_MEM_EQ(&desc, &desc_before, sizeof desc);
    }
    test_context(NULL);
}

static void test_resolve(void) {
    kvmix_policy p = *kvmix_policy_find("kitty-12"), out, before;
    kvmix_policy_error why;
    test_context("kvmix_policy_resolve");
    CHECK_RESULT(kvmix_policy_resolve(&p, 64, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.n_boost == 8 && out.boost_fraction == 0.125);
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.n_boost == 16);
    memset(&before, 0x33, sizeof before);
    out = before;
    CHECK_RESULT(kvmix_policy_resolve(&p, 40, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "head_dim") == 0);
    CHECK_RESULT(kvmix_policy_resolve(&p, 32, &out, &why), KVMIX_SUCCESS); /* 4 of 32 */
    CHECK(out.n_boost == 4);
    p.boost_fraction = 0.1; /* 6.4 channels of 64 */
    out = before;
    CHECK_RESULT(kvmix_policy_resolve(&p, 64, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "boost_fraction") == 0);
    CHECK_MEM_EQ(&out, &before, sizeof out);
    p.n_boost = 8; /* both given: they must agree */
    p.boost_fraction = 0.25;
    CHECK_RESULT(kvmix_policy_resolve(&p, 64, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK_RESULT(kvmix_policy_resolve(&p, 32, &out, &why), KVMIX_SUCCESS);
    p = *kvmix_policy_find("kitty-paper-12"); /* values: one group per head */
    CHECK_RESULT(kvmix_policy_resolve(&p, 64, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.group_size == 64 && out.value_group_size == 64 && out.n_boost == 8 &&
          out.window_values_only == 1);
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.value_group_size == 128 && out.n_boost == 16);
    p.value_group_size = 96; /* divides neither */
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "value_group_size") == 0);
    p = *kvmix_policy_find("int4"); /* value_group_size 0 takes group_size */
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.group_size == 32 && out.value_group_size == 32);
    p = *kvmix_policy_find("int4");
    p.group_size = 128;
    CHECK_RESULT(kvmix_policy_resolve(&p, 64, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "group_size") == 0);
    p.key_format = KVMIX_FORMAT_BOOSTED;
    p.group_size = 32;
    p.n_boost = 252;
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "n_boost") == 0);
    CHECK_RESULT(kvmix_policy_resolve(NULL, 64, &out, NULL), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_policy_resolve(&p, 64, NULL, NULL), KVMIX_ERR_NULL_POINTER);
    test_context(NULL);
}

/* A cache from kvmix_policy_apply: its desc holds the policy, and tokens reserved with NULL
   precisions are stored in the policy's formats once sealed, the sinks in FP16. */
static void test_apply(void) {
    kvmix_policy p = valid_policy();
    kvmix_cache_desc desc;
    kvmix_cache cache;
    kvmix_cache_precision got;
    int32_t seq, pos;
    float k[2 * 64], v[2 * 64];
    int32_t i;
    test_rng rng;
    test_context("kvmix_policy_apply");
    test_rng_init(&rng, "policy apply");
    memset(&desc, 0, sizeof desc);
    desc.n_layers = 2;
    desc.n_kv_heads = 1;
    desc.head_dim = 64;
    desc.max_tokens_per_seq = 24; /* the window is cut to the capacity */
    desc.arena_bytes = (size_t)1 << 20;
    CHECK_RESULT(kvmix_policy_apply(&p, &desc, NULL), KVMIX_SUCCESS);
    CHECK(desc.page_tokens == 16 && desc.n_sink == 4 && desc.n_window == 24 &&
          desc.window_values_only == 0 && desc.group_size == 32 && desc.value_group_size == 32 &&
          desc.partial == KVMIX_CACHE_PARTIAL_QUANTIZE);
    CHECK(desc.default_precision.key_format == KVMIX_FORMAT_INT2_CHANNEL &&
          desc.default_precision.value_format == KVMIX_FORMAT_INT4);
    CHECK_RESULT(kvmix_policy_apply(&p, NULL, NULL), KVMIX_ERR_NULL_POINTER);
    desc.n_window = 0; /* a window of no tokens, so that full pages seal */
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&cache, &desc, NULL), KVMIX_SUCCESS)) return;
    CHECK_RESULT(kvmix_cache_seq_create(&cache, &seq), KVMIX_SUCCESS);
    for (pos = 0; pos < 24; pos++) {
        for (i = 0; i < 2 * 64; i++) {
            k[i] = (float)test_rng_normal(&rng);
            v[i] = (float)test_rng_normal(&rng);
        }
        CHECK_RESULT(kvmix_cache_append(&cache, seq, k, v, desc.default_precision), KVMIX_SUCCESS);
    }
    CHECK_RESULT(kvmix_cache_seq_finish(&cache, seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&cache, seq, 1, 2, NULL, NULL, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_FP16 && got.value_format == KVMIX_FORMAT_FP16);
    CHECK_RESULT(kvmix_cache_read(&cache, seq, 1, 10, NULL, NULL, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_INT2_CHANNEL && got.value_format == KVMIX_FORMAT_INT4);
    kvmix_cache_deinit(&cache);
    test_context(NULL);
}

/* A policy over template tags: each token's formats by its tag, its bucket aging with the turn. */
static void test_tag_precision(void) {
    kvmix_policy p = *kvmix_policy_find("kivi2");
    kvmix_tag_precision table;
    kvmix_cache_precision got, int4 = {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4}, bad = {9, 1};
    kvmix_cache_precision zero_keys = {0, KVMIX_FORMAT_INT8};
    kvmix_tag tag;
    kvmix_policy_error why;
    test_context("tag precision");
    memset(&tag, 0, sizeof tag);
    tag.turn = 2;
    tag.role = KVMIX_ROLE_OBSERVATION;
    tag.modality = KVMIX_MODALITY_TEXT;
    /* no table: the policy's formats */
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 5, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_INT2_CHANNEL && got.value_format == KVMIX_FORMAT_INT2);
    CHECK_RESULT(kvmix_tag_precision_fill(&table, bad), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK_RESULT(kvmix_tag_precision_fill(&table, int4), KVMIX_SUCCESS);
    table.formats[KVMIX_BUCKET_CURRENT][KVMIX_ROLE_OBSERVATION][KVMIX_MODALITY_TEXT].key_format =
        KVMIX_FORMAT_FP16;
    table.formats[KVMIX_BUCKET_OLDER][KVMIX_ROLE_OBSERVATION][KVMIX_MODALITY_TEXT].value_format =
        KVMIX_FORMAT_INT2;
    p.tag_precision = &table;
    CHECK_RESULT(kvmix_policy_check(&p, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 2, &got), KVMIX_SUCCESS); /* current */
    CHECK(got.key_format == KVMIX_FORMAT_FP16 && got.value_format == KVMIX_FORMAT_INT4);
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 3, &got), KVMIX_SUCCESS); /* previous */
    CHECK(got.key_format == KVMIX_FORMAT_INT4 && got.value_format == KVMIX_FORMAT_INT4);
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 9, &got), KVMIX_SUCCESS); /* older */
    CHECK(got.key_format == KVMIX_FORMAT_INT4 && got.value_format == KVMIX_FORMAT_INT2);
    tag.modality = KVMIX_MODALITY_IMAGE; /* another tag of the same turn keeps the fill */
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 2, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_INT4);
    /* a zero format is the policy's, on its side */
    table.formats[KVMIX_BUCKET_CURRENT][KVMIX_ROLE_OBSERVATION][KVMIX_MODALITY_IMAGE] = zero_keys;
    CHECK_RESULT(kvmix_tag_precision_check(&table), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 2, &got), KVMIX_SUCCESS);
    CHECK(got.key_format == KVMIX_FORMAT_INT2_CHANNEL && got.value_format == KVMIX_FORMAT_INT8);
    /* bad tags and tables: an error, nothing written */
    got.key_format = got.value_format = 77;
    tag.role = KVMIX_TAG_N_ROLES;
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 2, &got), KVMIX_ERR_INVALID_ARGUMENT);
    tag.role = KVMIX_ROLE_USER;
    tag.modality = KVMIX_TAG_N_MODALITIES;
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 2, &got), KVMIX_ERR_INVALID_ARGUMENT);
    tag.modality = KVMIX_MODALITY_TEXT;
    table.formats[KVMIX_BUCKET_TWO_BACK][KVMIX_ROLE_SCAFFOLD][KVMIX_MODALITY_IMAGE] = bad;
    CHECK_RESULT(kvmix_tag_precision_check(&table), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK_RESULT(kvmix_policy_check(&p, &why), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK(strcmp(why.field, "tag_precision") == 0);
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 2, &got), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK(got.key_format == 77 && got.value_format == 77);
    CHECK_RESULT(kvmix_policy_token_precision(NULL, tag, 2, &got), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_tag_precision_check(NULL), KVMIX_ERR_NULL_POINTER);
    test_context(NULL);
}

void unit_policy(void) {
    test_builtins();
    test_check_errors();
    test_resolve();
    test_apply();
    test_tag_precision();
}
