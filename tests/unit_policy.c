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
    kvmix_error why = {NULL, NULL};
    CHECK_RESULT(kvmix_policy_check(&good, &why), KVMIX_SUCCESS);
    CHECK(strcmp(why.field, "") == 0 && strcmp(why.reason, "") == 0);
    CHECK_RESULT(kvmix_policy_check(NULL, &why), KVMIX_ERR_NULL_POINTER);
    CHECK(strcmp(why.field, "policy") == 0);
    why.field = NULL;
    CHECK_RESULT(kvmix_policy_resolve(&good, 64, &out, &why), KVMIX_SUCCESS);
    CHECK(why.field != NULL && strcmp(why.field, "") == 0);
    memset(&desc, 0, sizeof desc);
    desc.head_dim = 64;
    why.field = NULL;
    CHECK_RESULT(kvmix_policy_apply(&good, &desc, &why), KVMIX_SUCCESS);
    CHECK(why.field != NULL && strcmp(why.field, "") == 0);
    CHECK_RESULT(kvmix_policy_apply(&good, NULL, &why), KVMIX_ERR_NULL_POINTER);
    CHECK(strcmp(why.field, "desc") == 0);
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
    kvmix_error why;
    test_context("kvmix_policy_resolve");
    CHECK_RESULT(kvmix_policy_resolve(&p, 64, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.n_boost == 8 && out.boost_fraction == 0.125);
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.n_boost == 16);
    memset(&before, 0x33, sizeof before);
    out = before;
    CHECK_RESULT(kvmix_policy_resolve(&p, 36, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "head_dim") == 0);
    CHECK_RESULT(kvmix_policy_resolve(&p, 40, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "group_size") == 0); /* 32 does not divide 40 */
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
    /* boost settings of a policy whose own formats are not BOOSTED: for a tag allocation's */
    p = *kvmix_policy_find("int4");
    p.boost_fraction = 0.25;
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, NULL), KVMIX_SUCCESS);
    CHECK(out.n_boost == 32 && out.boost_fraction == 0.25);
    p.boost_fraction = 0.1;
    CHECK_RESULT(kvmix_policy_resolve(&p, 128, &out, &why), KVMIX_ERR_BAD_SHAPE);
    CHECK(strcmp(why.field, "boost_fraction") == 0);
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
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&cache, &desc, NULL, NULL), KVMIX_SUCCESS)) return;
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
    kvmix_error why;
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
    why.field = why.reason = NULL;
    CHECK_RESULT(kvmix_tag_precision_check(&table, &why), KVMIX_SUCCESS);
    CHECK_ERROR(why, "");
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
    CHECK_RESULT(kvmix_tag_precision_check(&table, &why), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK_ERROR(why, "formats[two_back][scaffold][image]");
    CHECK(strncmp(why.reason, "key_format", 10) == 0); /* 9 is no format */
    {
        kvmix_tag_precision copy = table; /* an earlier entry, its value side bad: named first */
        copy.formats[KVMIX_BUCKET_PREVIOUS][KVMIX_ROLE_USER][KVMIX_MODALITY_TEXT].value_format = 8;
        CHECK_RESULT(kvmix_tag_precision_check(&copy, &why), KVMIX_ERR_UNKNOWN_FORMAT);
        CHECK_ERROR(why, "formats[previous][user][text]");
        CHECK(strncmp(why.reason, "value_format", 12) == 0);
        copy.formats[KVMIX_BUCKET_CURRENT][KVMIX_ROLE_INSTRUCTION][KVMIX_MODALITY_TEXT].key_format =
            200;
        CHECK_RESULT(kvmix_tag_precision_check(&copy, &why), KVMIX_ERR_UNKNOWN_FORMAT);
        CHECK_ERROR(why, "formats[current][instruction][text]");
    }
    CHECK_RESULT(kvmix_policy_check(&p, &why), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK(strcmp(why.field, "tag_precision") == 0);
    CHECK_RESULT(kvmix_policy_token_precision(&p, tag, 2, &got), KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK(got.key_format == 77 && got.value_format == 77);
    CHECK_RESULT(kvmix_policy_token_precision(NULL, tag, 2, &got), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_tag_precision_check(NULL, &why), KVMIX_ERR_NULL_POINTER);
    CHECK_ERROR(why, "table");
    test_context(NULL);
}

/* The tags of the test stream: the system prompt (turn 0), then turns 1 and 2, each a user
   message and a tool result, with scaffold between. */
static kvmix_tag retier_tag(int32_t pos) {
    kvmix_tag t;
    memset(&t, 0, sizeof t);
    t.turn = pos < 8 ? 0 : pos < 56 ? 1 : 2;
    t.role = pos < 8         ? KVMIX_ROLE_INSTRUCTION
             : pos % 48 < 12 ? KVMIX_ROLE_USER
             : pos % 48 < 14 ? KVMIX_ROLE_SCAFFOLD
                             : KVMIX_ROLE_OBSERVATION;
    t.modality = KVMIX_MODALITY_TEXT;
    return t;
}

/* Formats by bucket: observations and user text fall as they age, scaffold would rise (never
   applied), the system prompt stays INT8. */
static void retier_table(kvmix_tag_precision *table) {
    static const uint8_t obs[4][2] = {{KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8},
                                      {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4},
                                      {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2},
                                      {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2}};
    static const uint8_t user[4][2] = {{KVMIX_FORMAT_FP16, KVMIX_FORMAT_INT8},
                                       {KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT4},
                                       {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4},
                                       {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT2}};
    kvmix_cache_precision int8 = {KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8};
    int b;
    kvmix_tag_precision_fill(table, int8);
    for (b = 0; b < 4; b++) {
        kvmix_cache_precision *o = &table->formats[b][KVMIX_ROLE_OBSERVATION][KVMIX_MODALITY_TEXT];
        kvmix_cache_precision *u = &table->formats[b][KVMIX_ROLE_USER][KVMIX_MODALITY_TEXT];
        o->key_format = obs[b][0], o->value_format = obs[b][1];
        u->key_format = user[b][0], u->value_format = user[b][1];
    }
    table->formats[KVMIX_BUCKET_CURRENT][KVMIX_ROLE_SCAFFOLD][KVMIX_MODALITY_TEXT].key_format =
        KVMIX_FORMAT_INT4;
    table->formats[KVMIX_BUCKET_PREVIOUS][KVMIX_ROLE_SCAFFOLD][KVMIX_MODALITY_TEXT].key_format =
        KVMIX_FORMAT_FP16;
}

/* Appends positions [from, to) with random rows, each in its tag's formats at turn `current`
   (-1: its own turn), in its tag's run when `runs`. */
static void retier_append(kvmix_cache *cache, int32_t seq, const kvmix_policy *p, int32_t from,
                          int32_t to, int32_t current, int runs, test_rng *rng) {
    float k[2 * 2 * 64], v[2 * 2 * 64];
    int32_t pos, i;
    for (pos = from; pos < to; pos++) {
        kvmix_cache_precision want;
        kvmix_tag t = retier_tag(pos);
        uint32_t run = 0;
        if (runs) {
            CHECK_RESULT(kvmix_policy_token_run(p, t, &run), KVMIX_SUCCESS);
            CHECK_RESULT(kvmix_cache_seq_set_run(cache, seq, run), KVMIX_SUCCESS);
        }
        for (i = 0; i < 2 * 2 * 64; i++) {
            k[i] = (float)test_rng_normal(rng);
            v[i] = (float)test_rng_normal(rng);
        }
        kvmix_policy_token_precision(p, t, current < 0 ? t.turn : current, &want);
        CHECK_RESULT(kvmix_cache_append(cache, seq, k, v, want), KVMIX_SUCCESS);
    }
}

/* Each page's formats (by the page of every position) and every row, dequantized. */
static void retier_snapshot(const kvmix_cache *cache, int32_t seq, int32_t n, uint32_t *pages,
                            kvmix_cache_precision *formats, float *rows) {
    int32_t pos;
    for (pos = 0; pos < n; pos++) {
        uint32_t slot = 0;
        kvmix_cache_locate(cache, seq, pos, &slot);
        pages[pos] = slot / (uint32_t)cache->desc.page_tokens;
        kvmix_cache_read(cache, seq, 1, pos, rows + (size_t)pos * 256,
                         rows + (size_t)pos * 256 + 128, &formats[pos]);
    }
}

static int format_rank_of(uint8_t f) {
    static const uint8_t order[] = {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2,
                                    KVMIX_FORMAT_BOOSTED,      KVMIX_FORMAT_INT4,
                                    KVMIX_FORMAT_INT8,         KVMIX_FORMAT_FP16};
    int i;
    for (i = 0; i < 6; i++)
        if (order[i] == f) return i;
    return -1;
}

/* Bytes of a block of `rows` rows of head_dim 64 in `format` at the test's group of 32. */
static size_t block_bytes(uint8_t format, int32_t rows) {
    kvmix_layout l;
    size_t bytes = 0;
    memset(&l, 0, sizeof l);
    l.format = (kvmix_format)format;
    l.n_tokens = rows;
    l.head_dim = 64;
    l.group_size = format == KVMIX_FORMAT_INT2_CHANNEL || format == KVMIX_FORMAT_FP16 ? 0 : 32;
    kvmix_layout_bytes(&l, &bytes);
    return bytes;
}

/* With each tag's run (kvmix_policy_token_run), pages hold tokens that age alike: once aged, every
   sealed position holds exactly what its tag asks for at the turn (or what it held, when that is
   lower: a demotion never raises), the allocation's per-token precision. */
static void test_retier_runs(const kvmix_policy *p, const kvmix_cache_desc *desc) {
    enum { N = 88 };
    kvmix_cache cache;
    kvmix_cache_desc d = *desc;
    kvmix_tag tags[N];
    test_rng rng;
    int32_t seq, pos, turn, exact = 0;
    uint32_t a = 0, b = 0;
    kvmix_tag user = retier_tag(8), obs = retier_tag(20);
    CHECK_RESULT(kvmix_policy_token_run(p, user, &a), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_policy_token_run(p, obs, &b), KVMIX_SUCCESS);
    CHECK(a != 0 && b != 0 && a != b);
    user.role = KVMIX_TAG_N_ROLES;
    CHECK_RESULT(kvmix_policy_token_run(p, user, &a), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_policy_token_run(kvmix_policy_find("int4"), obs, &a), KVMIX_SUCCESS);
    CHECK(a == 0); /* no tags: one run */
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&cache, &d, NULL, NULL), KVMIX_SUCCESS)) return;
    kvmix_cache_seq_create(&cache, &seq);
    for (pos = 0; pos < N; pos++) tags[pos] = retier_tag(pos);
    test_rng_init(&rng, "retier runs");
    retier_append(&cache, seq, p, 0, N, -1, 1, &rng);
    for (turn = 2; turn <= 4; turn++) {
        CHECK_RESULT(kvmix_policy_retier_turn(p, &cache, seq, tags, N, turn, NULL), KVMIX_SUCCESS);
        for (pos = 0; pos < N; pos++) {
            uint32_t slot = 0;
            kvmix_cache_precision held, want, own;
            kvmix_cache_locate(&cache, seq, pos, &slot);
            if (!cache.pages[slot / 16].sealed || cache.pages[slot / 16].sink) continue;
            kvmix_cache_read(&cache, seq, 0, pos, NULL, NULL, &held);
            kvmix_policy_token_precision(p, tags[pos], turn, &want);
            kvmix_policy_token_precision(p, tags[pos], tags[pos].turn, &own);
            if (format_rank_of(want.key_format) > format_rank_of(own.key_format))
                want.key_format = own.key_format;
            if (format_rank_of(want.value_format) > format_rank_of(own.value_format))
                want.value_format = own.value_format;
            test_context("retier runs: turn %d position %d", turn, pos);
            if (held.key_format == want.key_format && held.value_format == want.value_format)
                exact++;
            else /* kept: the lower formats would take more bytes (metadata over a few rows) */
                CHECK(block_bytes(held.key_format, cache.pages[slot / 16].n_rows) <
                          block_bytes(want.key_format, cache.pages[slot / 16].n_rows) ||
                      block_bytes(held.value_format, cache.pages[slot / 16].n_rows) <
                          block_bytes(want.value_format, cache.pages[slot / 16].n_rows));
        }
    }
    test_context("retier runs");
    CHECK(exact > 3 * 48);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
}

/* Whether the spans a loop kept of seq's layer-0 view, brought up to date from the entry
   kvmix_cache_view_changes names, equal its view built whole: what a device loop that keeps spans
   between steps reads. kept: [stride] spans from the last call. */
static int retier_kept_view_current(kvmix_cache *cache, int32_t seq, kvmix_view_span *kept,
                                    int32_t *n_kept, int32_t stride) {
    kvmix_view_span whole[64];
    static uint8_t dead[64 * 64];
    int32_t from = 0, n = 0, n_dead = 0, n_whole = 0, j;
    if (!CHECK_RESULT(kvmix_cache_view_changes(cache, seq, &from), KVMIX_SUCCESS)) return 0;
    if (from > *n_kept) from = *n_kept;
    if (!CHECK_RESULT(kvmix_cache_view_seq(cache, seq, 0, from, kept + from, stride - from, dead,
                                           (int32_t)sizeof dead, 0, &n, &n_dead),
                      KVMIX_SUCCESS) ||
        !CHECK_RESULT(kvmix_cache_view_seq(cache, seq, 0, 0, whole, 64, dead, (int32_t)sizeof dead,
                                           0, &n_whole, &n_dead),
                      KVMIX_SUCCESS))
        return 0;
    *n_kept = from + n;
    if (*n_kept != n_whole) return 0;
    for (j = 0; j < n_whole; j++)
        if (kept[j].key_offset != whole[j].key_offset ||
            kept[j].value_offset != whole[j].value_offset ||
            kept[j].key_format != whole[j].key_format ||
            kept[j].value_format != whole[j].value_format ||
            kept[j].key_head_bytes != whole[j].key_head_bytes ||
            kept[j].value_head_bytes != whole[j].value_head_bytes)
            return 0;
    return 1;
}

/* kvmix_policy_retier_turn: each page the sequence alone holds falls to the highest formats its
   positions ask at the new turn, never rises, and holds the bytes kvmix_cache_retier gives;
   sinks and shared pages stay; a buffer page seals to what it asks then; bad input changes
   nothing. */
static void test_retier_turn(void) {
    enum { N = 88, CUR = 2 };
    kvmix_policy p = *kvmix_policy_find("int4");
    kvmix_tag_precision table;
    kvmix_tag tags[N + 16];
    kvmix_cache_desc desc;
    kvmix_cache cache, twin;
    uint32_t pages[N + 16], twin_pages[N];
    kvmix_cache_precision before[N + 16], after[N + 16], twin_formats[N];
    static float rows[(N + 16) * 256], twin_rows[N * 256], rows_after[(N + 16) * 256];
    int32_t seq, twin_seq, child, pos, done = -1, changed = 0, q, n_kept = 0;
    kvmix_view_span kept[64];
    test_rng rng;
    test_context("kvmix_policy_retier_turn");
    retier_table(&table);
    p.tag_precision = &table;
    p.sink_tokens = 4;
    p.page_tokens = 16;
    memset(&desc, 0, sizeof desc);
    desc.n_layers = 2;
    desc.n_kv_heads = 2;
    desc.head_dim = 64;
    desc.max_seqs = 3;
    desc.max_tokens_per_seq = N + 16;
    desc.arena_bytes = (size_t)1 << 21;
    CHECK_RESULT(kvmix_policy_apply(&p, &desc, NULL), KVMIX_SUCCESS);
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&cache, &desc, NULL, NULL), KVMIX_SUCCESS)) return;
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&twin, &desc, NULL, NULL), KVMIX_SUCCESS)) return;
    for (pos = 0; pos < N + 16; pos++) tags[pos] = retier_tag(pos);
    kvmix_cache_seq_create(&cache, &seq);
    kvmix_cache_seq_create(&twin, &twin_seq);
    test_rng_init(&rng, "retier turn");
    retier_append(&cache, seq, &p, 0, N, -1, 0, &rng);
    test_rng_init(&rng, "retier turn");
    retier_append(&twin, twin_seq, &p, 0, N, -1, 0, &rng);
    CHECK_RESULT(kvmix_cache_seq_fork(&cache, seq, 20, &child), KVMIX_SUCCESS); /* shares 4..19 */
    retier_snapshot(&cache, seq, N, pages, before, rows);

    /* bad input: an error, nothing changed */
    CHECK_RESULT(kvmix_policy_retier_turn(NULL, &cache, seq, tags, N, CUR, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, seq, NULL, N, CUR, NULL),
                 KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, seq, tags, N - 1, CUR, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, seq, tags, N, -1, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, 7, tags, N, CUR, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    tags[30].role = KVMIX_TAG_N_ROLES;
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, seq, tags, N, CUR, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    tags[30] = retier_tag(30);
    retier_snapshot(&cache, seq, N, pages, after, rows_after);
    CHECK(memcmp(before, after, sizeof before[0] * N) == 0 &&
          memcmp(rows, rows_after, sizeof rows[0] * 256 * N) == 0);

    /* the turn ages: turn 1 is the previous one now; a loop's kept spans learn of each page that
       fell (kvmix_cache_view_changes), or it would read new bytes in the old formats */
    CHECK(retier_kept_view_current(&cache, seq, kept, &n_kept, 64));
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, seq, tags, N, CUR, &done), KVMIX_SUCCESS);
    CHECK(retier_kept_view_current(&cache, seq, kept, &n_kept, 64));
    retier_snapshot(&cache, seq, N, pages, after, rows_after);
    for (pos = 0; pos < N; pos++) {
        kvmix_cache_precision want = {0, 0}, w;
        const kvmix_cache_page *pg = &cache.pages[pages[pos]];
        for (q = 0; q < N; q++)
            if (pages[q] == pages[pos]) {
                kvmix_policy_token_precision(&p, tags[q], CUR, &w);
                if (format_rank_of(w.key_format) > format_rank_of(want.key_format))
                    want.key_format = w.key_format;
                if (format_rank_of(w.value_format) > format_rank_of(want.value_format))
                    want.value_format = w.value_format;
            }
        if (pg->sink || pg->refcount > 1 || !pg->sealed) {
            want = before[pos]; /* left alone */
        } else {
            if (format_rank_of(want.key_format) > format_rank_of(before[pos].key_format))
                want.key_format = before[pos].key_format; /* never rises */
            if (format_rank_of(want.value_format) > format_rank_of(before[pos].value_format))
                want.value_format = before[pos].value_format;
        }
        test_context("kvmix_policy_retier_turn position %d", pos);
        CHECK(after[pos].key_format == want.key_format &&
              after[pos].value_format == want.value_format);
        if (after[pos].key_format != before[pos].key_format ||
            after[pos].value_format != before[pos].value_format) {
            changed++;
            if (pos == 0 || pages[pos - 1] != pages[pos]) /* the twin re-tiers the page alone */
                CHECK_RESULT(kvmix_cache_retier(&twin, twin_seq, pos, after[pos], NULL, NULL,
                                                KVMIX_CACHE_ROWS_ORIGINAL),
                             KVMIX_SUCCESS);
        }
    }
    test_context("kvmix_policy_retier_turn");
    CHECK(changed == 32 && done == 2); /* turn 1's pages past the shared ones fell */
    retier_snapshot(&twin, twin_seq, N, twin_pages, twin_formats, twin_rows);
    for (pos = 20; pos < N; pos++) /* past the pages the fork shares */
        CHECK(memcmp(&rows_after[pos * 256], &twin_rows[pos * 256], 256 * sizeof(float)) == 0);
    CHECK(before[2].key_format == KVMIX_FORMAT_FP16 && after[2].key_format == KVMIX_FORMAT_FP16);
    CHECK(memcmp(&after[4], &before[4], 16 * sizeof after[0]) == 0); /* shared with the child */

    /* a second call at the same turn finds nothing to do */
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, seq, tags, N, CUR, &done), KVMIX_SUCCESS);
    CHECK(done == 0);

    /* turn 3: the buffer page (positions 84..99, INT8 observations so far) seals to what its
       positions ask then: INT8 keys for the user text, INT4 values */
    CHECK_RESULT(kvmix_policy_retier_turn(&p, &cache, seq, tags, N, CUR + 1, &done), KVMIX_SUCCESS);
    retier_append(&cache, seq, &p, N, N + 16, CUR + 1, 0, &rng);
    CHECK_RESULT(kvmix_cache_seq_finish(&cache, seq), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_cache_read(&cache, seq, 0, N - 2, NULL, NULL, &after[0]), KVMIX_SUCCESS);
    CHECK(after[0].key_format == KVMIX_FORMAT_INT8 && after[0].value_format == KVMIX_FORMAT_INT4);
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    kvmix_cache_deinit(&twin);
    test_retier_runs(&p, &desc);
    test_context(NULL);
}

/* kvmix_cache_seq_age's question in the tests: below `until`, `want`; a refusal or an answer
   with a format the cache does not know at `bad` (-1: none). */
typedef struct age_wants {
    int32_t until, bad;
    kvmix_result refusal;
    kvmix_cache_precision want;
} age_wants;

static kvmix_result age_wants_of(void *ctx, int32_t position, kvmix_cache_precision *out) {
    const age_wants *a = (const age_wants *)ctx;
    if (position == a->bad && a->refusal != KVMIX_SUCCESS) return a->refusal;
    if (position == a->bad)
        out->key_format = 99;
    else if (position < a->until)
        *out = a->want;
    return KVMIX_SUCCESS;
}

/* kvmix_cache_seq_age, the cache's own call under the policy's: the caller's answers, a side
   asked for nothing stays, precision never rises, and a refusal or an unknown format fails the
   call with nothing changed and the cache saying why. */
static void test_seq_age(void) {
    enum { N = 64 };
    kvmix_policy p = *kvmix_policy_find("int4");
    kvmix_cache_desc desc;
    kvmix_cache cache;
    uint32_t pages[N];
    kvmix_cache_precision before[N], after[N];
    static float rows[N * 256], rows_after[N * 256];
    age_wants a;
    int32_t seq, pos, done = -1;
    test_rng rng;
    test_context("kvmix_cache_seq_age");
    p.page_tokens = 16;
    memset(&desc, 0, sizeof desc);
    desc.n_layers = 2;
    desc.n_kv_heads = 2;
    desc.head_dim = 64;
    desc.max_seqs = 1;
    desc.max_tokens_per_seq = N;
    desc.arena_bytes = (size_t)1 << 20;
    CHECK_RESULT(kvmix_policy_apply(&p, &desc, NULL), KVMIX_SUCCESS);
    if (!CHECK_RESULT(kvmix_cache_init_allocator(&cache, &desc, NULL, NULL), KVMIX_SUCCESS)) return;
    kvmix_cache_seq_create(&cache, &seq);
    test_rng_init(&rng, "seq age");
    retier_append(&cache, seq, &p, 0, N, -1, 0, &rng);
    retier_snapshot(&cache, seq, N, pages, before, rows);
    memset(&a, 0, sizeof a);
    a.until = 32;
    a.want.key_format = KVMIX_FORMAT_INT2; /* values: nothing asked */
    a.bad = 40;
    a.refusal = KVMIX_ERR_BAD_VALUE;
    CHECK_RESULT(kvmix_cache_seq_age(&cache, seq, age_wants_of, &a, &done), KVMIX_ERR_BAD_VALUE);
    CHECK(strstr(kvmix_cache_last_error(&cache), "wants") != NULL && done == -1);
    a.refusal = KVMIX_SUCCESS; /* position 40 answers format 99 */
    CHECK_RESULT(kvmix_cache_seq_age(&cache, seq, age_wants_of, &a, NULL),
                 KVMIX_ERR_UNKNOWN_FORMAT);
    CHECK_RESULT(kvmix_cache_seq_age(&cache, seq, NULL, &a, NULL), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_cache_seq_age(&cache, 1, age_wants_of, &a, NULL),
                 KVMIX_ERR_INVALID_ARGUMENT);
    retier_snapshot(&cache, seq, N, pages, after, rows_after);
    CHECK(memcmp(before, after, sizeof before) == 0 && memcmp(rows, rows_after, sizeof rows) == 0);

    a.bad = -1;
    a.want.key_format = KVMIX_FORMAT_FP16; /* higher than held: never rises */
    CHECK_RESULT(kvmix_cache_seq_age(&cache, seq, age_wants_of, &a, &done), KVMIX_SUCCESS);
    CHECK(done == 0);
    a.want.key_format = KVMIX_FORMAT_INT2;
    CHECK_RESULT(kvmix_cache_seq_age(&cache, seq, age_wants_of, &a, &done), KVMIX_SUCCESS);
    CHECK(done == 2); /* the two sealed pages of positions 0..31 */
    retier_snapshot(&cache, seq, N, pages, after, rows_after);
    for (pos = 0; pos < N; pos++) {
        test_context("kvmix_cache_seq_age position %d", pos);
        CHECK(after[pos].value_format == before[pos].value_format);
        CHECK(after[pos].key_format == (pos < 32 && cache.pages[pages[pos]].sealed
                                            ? KVMIX_FORMAT_INT2
                                            : before[pos].key_format));
    }
    test_context("kvmix_cache_seq_age");
    CHECK_RESULT(kvmix_cache_check(&cache), KVMIX_SUCCESS);
    kvmix_cache_deinit(&cache);
    test_context(NULL);
}

void unit_policy(void) {
    test_builtins();
    test_check_errors();
    test_resolve();
    test_apply();
    test_tag_precision();
    test_retier_turn();
    test_seq_age();
}
