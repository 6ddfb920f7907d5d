/* unit_tags: template specs and the streaming tagger on hand-built streams of four templates
   (the reference models' byte-level ChatML, Qwen3's ChatML ids, gpt-oss's harmony ids with a
   channel name of two tokens and a recipient marker, Llama 3.1's ids with a tool call bracket
   that has no close): system prompts with tool schemas, user turns, reasoning, tool calls and
   responses, harmony preambles and recipients, images, turn aging, run feeding against one id at
   a time, broken streams. */
#include "harness.h"

#include <stdio.h>
#include <string.h>

#define MAX_STREAM 4096

enum {
    INS = KVMIX_ROLE_INSTRUCTION,
    USR = KVMIX_ROLE_USER,
    AST = KVMIX_ROLE_ASSISTANT,
    RSN = KVMIX_ROLE_REASONING,
    CALL = KVMIX_ROLE_TOOL_CALL,
    OBS = KVMIX_ROLE_OBSERVATION,
    SCF = KVMIX_ROLE_SCAFFOLD,
    FB = KVMIX_TAG_FLAG_FALLBACK,
    IMG = 0x100
};

/* A stream of ids with the tag each should get. */
typedef struct stream {
    int32_t ids[MAX_STREAM];
    kvmix_tag want[MAX_STREAM];
    int32_t n;
    int32_t turn; /* turn of what is put next */
    test_rng rng;
} stream;

/* role | IMG, flags */
static void put_ids(stream *s, const int32_t *ids, int32_t n, int role, int flags) {
    int32_t i;
    for (i = 0; i < n && s->n < MAX_STREAM; i++) {
        kvmix_tag *w = &s->want[s->n];
        s->ids[s->n] = ids[i];
        w->turn = s->turn;
        w->role = (uint8_t)(role & 0xff);
        w->modality = (uint8_t)(role & IMG ? KVMIX_MODALITY_IMAGE : KVMIX_MODALITY_TEXT);
        w->flags = (uint8_t)flags;
        w->reserved = 0;
        s->n++;
    }
}
static void put1(stream *s, int32_t id, int role) { put_ids(s, &id, 1, role, 0); }
static void put1f(stream *s, int32_t id, int role, int flags) { put_ids(s, &id, 1, role, flags); }
/* Text as the reference models' byte tokens. */
static void put_text(stream *s, const char *text, int role, int flags) {
    for (; *text; text++) put1f(s, (uint8_t)*text, role, flags);
}
/* n random content ids in [lo, hi]. */
static void put_random(stream *s, int32_t n, int32_t lo, int32_t hi, int role, int flags) {
    int32_t i;
    for (i = 0; i < n; i++) put1f(s, test_rng_range(&s->rng, lo, hi), role, flags);
}

static void set_seq(kvmix_tag_seq *q, const int32_t *ids, int32_t n) {
    memset(q, 0, sizeof *q);
    q->n_ids = n;
    memcpy(q->ids, ids, sizeof(int32_t) * (size_t)n);
}
static void set1(kvmix_tag_marker *m, int alt, int32_t id) { set_seq(&m->alts[alt], &id, 1); }
static void set_text(kvmix_tag_seq *q, const char *text) {
    int32_t i;
    memset(q, 0, sizeof *q);
    for (i = 0; text[i]; i++) q->ids[i] = (uint8_t)text[i];
    q->n_ids = i;
}
static void add_name(kvmix_tag_name *names, int32_t *n, const char *text, int role,
                     const int32_t *ids, int32_t n_ids) {
    kvmix_tag_name *x = &names[(*n)++];
    memset(x, 0, sizeof *x);
    snprintf(x->text, sizeof x->text, "%s", text);
    x->role = role;
    if (ids)
        set_seq(&x->seq, ids, n_ids);
    else
        set_text(&x->seq, text);
}

/* ---- the three templates ---------------------------------------------------------------------- */
enum {
    B_END_TEXT = 256,
    B_START,
    B_END,
    B_THINK,
    B_THINK_END,
    B_CALL,
    B_CALL_END,
    B_RESP,
    B_RESP_END,
    B_VISION,
    B_VISION_END,
    B_PAD
};

static void spec_byte(kvmix_tag_spec *s) {
    memset(s, 0, sizeof *s);
    set1(&s->message_start, 0, B_START);
    set1(&s->message_end, 0, B_END);
    set1(&s->header_end, 0, '\n');
    set1(&s->reasoning_open, 0, B_THINK);
    set1(&s->reasoning_close, 0, B_THINK_END);
    set1(&s->tool_call_open, 0, B_CALL);
    set1(&s->tool_call_close, 0, B_CALL_END);
    set1(&s->tool_response_open, 0, B_RESP);
    set1(&s->tool_response_close, 0, B_RESP_END);
    set1(&s->vision_open, 0, B_VISION);
    set1(&s->vision_close, 0, B_VISION_END);
    set1(&s->image_pad, 0, B_PAD);
    add_name(s->roles, &s->n_roles, "system", INS, NULL, 0);
    add_name(s->roles, &s->n_roles, "user", USR, NULL, 0);
    add_name(s->roles, &s->n_roles, "assistant", AST, NULL, 0);
    add_name(s->roles, &s->n_roles, "tool", OBS, NULL, 0);
}

enum {
    Q_START = 151644,
    Q_END = 151645,
    Q_VISION = 151652,
    Q_VISION_END = 151653,
    Q_PAD = 151655,
    Q_CALL = 151657,
    Q_CALL_END = 151658,
    Q_RESP = 151665,
    Q_RESP_END = 151666,
    Q_THINK = 151667,
    Q_THINK_END = 151668,
    Q_NL = 198,
    Q_SYSTEM = 8948,
    Q_USER = 872,
    Q_ASSISTANT = 77091,
    Q_TOOL = 14172,
    Q_CONTENT_MAX = 151000
};

static void spec_qwen3(kvmix_tag_spec *s) {
    int32_t id;
    memset(s, 0, sizeof *s);
    set1(&s->message_start, 0, Q_START);
    set1(&s->message_end, 0, Q_END);
    set1(&s->header_end, 0, Q_NL);
    set1(&s->reasoning_open, 0, Q_THINK);
    set1(&s->reasoning_close, 0, Q_THINK_END);
    set1(&s->tool_call_open, 0, Q_CALL);
    set1(&s->tool_call_close, 0, Q_CALL_END);
    set1(&s->tool_response_open, 0, Q_RESP);
    set1(&s->tool_response_close, 0, Q_RESP_END);
    set1(&s->vision_open, 0, Q_VISION);
    set1(&s->vision_close, 0, Q_VISION_END);
    set1(&s->image_pad, 0, Q_PAD);
    id = Q_SYSTEM, add_name(s->roles, &s->n_roles, "system", INS, &id, 1);
    id = Q_USER, add_name(s->roles, &s->n_roles, "user", USR, &id, 1);
    id = Q_ASSISTANT, add_name(s->roles, &s->n_roles, "assistant", AST, &id, 1);
    id = Q_TOOL, add_name(s->roles, &s->n_roles, "tool", OBS, &id, 1);
}

enum {
    H_RETURN = 200002,
    H_CONSTRAIN = 200003,
    H_CHANNEL = 200005,
    H_START = 200006,
    H_END = 200007,
    H_MESSAGE = 200008,
    H_CALL = 200012,
    H_SYSTEM = 17360,
    H_DEVELOPER = 77944,
    H_USER = 1428,
    H_ASSISTANT = 173781,
    H_FUNCTIONS = 44580,
    H_ANALYSIS = 35644,
    H_FINAL = 17196,
    H_BROWSER = 46071,
    H_SEARCH = 16718,
    H_CODE = 3490,
    H_SPACE = 220,
    H_COMMENT = 12606,
    H_ARY = 815,
    H_TO = 316,
    H_EQ = 28,
    H_GET = 775,
    H_WEATHER = 170154,
    H_JSON = 5701, /* " json" */
    H_CONTENT_MAX = 199000
};

/* As examples/specs/gpt-oss.json: " to=" is the recipient marker, commentary is assistant text. */
static void spec_harmony(kvmix_tag_spec *s) {
    int32_t id, commentary[2] = {H_COMMENT, H_ARY}, to[2] = {H_TO, H_EQ};
    memset(s, 0, sizeof *s);
    set1(&s->message_start, 0, H_START);
    set1(&s->message_end, 0, H_END);
    set1(&s->message_end, 1, H_CALL);
    set1(&s->message_end, 2, H_RETURN);
    set1(&s->header_end, 0, H_MESSAGE);
    set1(&s->channel, 0, H_CHANNEL);
    set_seq(&s->recipient.alts[0], to, 2);
    id = H_SYSTEM, add_name(s->roles, &s->n_roles, "system", INS, &id, 1);
    id = H_DEVELOPER, add_name(s->roles, &s->n_roles, "developer", INS, &id, 1);
    id = H_USER, add_name(s->roles, &s->n_roles, "user", USR, &id, 1);
    id = H_ASSISTANT, add_name(s->roles, &s->n_roles, "assistant", AST, &id, 1);
    id = H_FUNCTIONS, add_name(s->roles, &s->n_roles, "functions", OBS, &id, 1);
    id = H_ANALYSIS, add_name(s->channels, &s->n_channels, "analysis", RSN, &id, 1);
    add_name(s->channels, &s->n_channels, "commentary", AST, commentary, 2);
    id = H_FINAL, add_name(s->channels, &s->n_channels, "final", AST, &id, 1);
}

/* ---- checking a stream ---------------------------------------------------------------------- */
static int tags_equal(const kvmix_tag *a, const kvmix_tag *b) {
    return a->turn == b->turn && a->role == b->role && a->modality == b->modality &&
           a->flags == b->flags && a->reserved == b->reserved;
}

/* Feeds the stream whole, one id at a time and in random runs; every way must give `want`. */
static void check_stream(const kvmix_tag_spec *spec, const stream *s, const char *name) {
    static kvmix_tag got[MAX_STREAM];
    kvmix_tagger t;
    test_rng rng;
    int way;
    test_rng_init(&rng, name);
    for (way = 0; way < 3; way++) {
        int32_t i = 0, bad = 0;
        test_context("%s, fed %s", name,
                     way == 0   ? "whole"
                     : way == 1 ? "one at a time"
                                : "in runs");
        test_poison(got, sizeof got, 7);
        if (!CHECK_RESULT(kvmix_tagger_init(&t, spec, NULL), KVMIX_SUCCESS)) return;
        while (i < s->n) {
            int32_t n = way == 0 ? s->n : way == 1 ? 1 : test_rng_range(&rng, 0, 40);
            if (n > s->n - i) n = s->n - i;
            CHECK_RESULT(kvmix_tagger_feed(&t, s->ids + i, n, got + i), KVMIX_SUCCESS);
            i += n;
        }
        CHECK_EQ_INT(t.n_fed, s->n);
        for (i = 0; i < s->n && bad < 5; i++)
            if (!tags_equal(&got[i], &s->want[i])) {
                bad++;
                CHECK_MSG(
                    0,
                    "token %d (id %d): got turn %d %s %s flags %d, want turn %d %s %s "
                    "flags %d",
                    i, s->ids[i], got[i].turn, kvmix_tag_role_name((kvmix_tag_role)got[i].role),
                    kvmix_tag_modality_name((kvmix_tag_modality)got[i].modality), got[i].flags,
                    s->want[i].turn, kvmix_tag_role_name((kvmix_tag_role)s->want[i].role),
                    kvmix_tag_modality_name((kvmix_tag_modality)s->want[i].modality),
                    s->want[i].flags);
            }
        if (!bad) CHECK(1);
    }
    test_context(NULL);
}

/* ---- byte-level ChatML (reference models) ------------------------------------------------- */
static void byte_message_head(stream *s, const char *role) {
    put1(s, B_START, SCF);
    put_text(s, role, SCF, 0);
    put1(s, '\n', SCF);
}

static void test_byte_chatml(void) {
    static stream s;
    kvmix_tag_spec spec;
    spec_byte(&spec);
    memset(&s, 0, sizeof s);
    test_rng_init(&s.rng, "tags byte");
    put1(&s, B_END_TEXT, SCF); /* outside any message */
    byte_message_head(&s, "system");
    put_text(&s, "You are a helpful agent.\n<tools>\n{\"name\": \"get_weather\"}\n</tools>", INS,
             0);
    put_text(&s, "Call a tool inside ", INS, 0); /* bracket ids in a system prompt: content */
    put1(&s, B_CALL, INS);
    put_text(&s, " tags.", INS, 0);
    put1(&s, B_THINK_END, INS);
    put1(&s, B_END, SCF);
    put1(&s, '\n', SCF);
    /* turn 1: a user question with an image */
    byte_message_head(&s, "user");
    s.turn = 1; /* takes effect at the first content token */
    put_text(&s, "What is in this picture?", USR, 0);
    put1(&s, B_VISION, SCF);
    put1(&s, B_PAD, USR | IMG);
    put1(&s, B_PAD, USR | IMG);
    put1(&s, B_PAD, USR | IMG);
    put1(&s, B_VISION_END, SCF);
    put1(&s, B_END, SCF);
    put1(&s, '\n', SCF);
    byte_message_head(&s, "assistant");
    put1(&s, B_THINK, SCF);
    put_text(&s, "\nThe user asks about the weather in the picture.\n", RSN, 0);
    put1(&s, B_THINK_END, SCF);
    put_text(&s, "\n\n", AST, 0);
    put1(&s, B_CALL, SCF);
    put_text(&s, "\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n", CALL, 0);
    put1(&s, B_CALL_END, SCF);
    put1(&s, B_END, SCF);
    put1(&s, '\n', SCF);
    /* the tool result as a user message: no new turn */
    byte_message_head(&s, "user");
    put1(&s, B_RESP, SCF);
    put_text(&s, "\n{\"temp\": 21}\n", OBS, 0);
    put1(&s, B_RESP_END, SCF);
    put_text(&s, "\n", OBS, 0);
    put1(&s, B_RESP, SCF);
    put_text(&s, "second", OBS, 0);
    put1(&s, B_RESP_END, SCF);
    put1(&s, B_END, SCF);
    put1(&s, '\n', SCF);
    /* the same through the tool role */
    byte_message_head(&s, "tool");
    put_text(&s, "{\"temp\": 21}", OBS, 0);
    put1(&s, B_END, SCF);
    byte_message_head(&s, "assistant");
    put_text(&s, "It is 21 degrees.", AST, 0);
    put1(&s, B_END, SCF);
    /* turns 2 and 3 */
    byte_message_head(&s, "user");
    s.turn = 2;
    put_text(&s, "Thanks", USR, 0);
    put1(&s, B_END, SCF);
    byte_message_head(&s, "user");
    s.turn = 3;
    put_text(&s, "And tomorrow?", USR, 0);
    put1(&s, B_END, SCF);
    check_stream(&spec, &s, "byte-level ChatML");
}

/* ---- Qwen3 ChatML ids -------------------------------------------------------------------------- */
static void qwen_head(stream *s, int32_t role) {
    put1(s, Q_START, SCF);
    put1(s, role, SCF);
    put1(s, Q_NL, SCF);
}

static void test_qwen3(void) {
    static stream s;
    kvmix_tag_spec spec;
    int k;
    spec_qwen3(&spec);
    memset(&s, 0, sizeof s);
    test_rng_init(&s.rng, "tags qwen3");
    qwen_head(&s, Q_SYSTEM);
    put_random(&s, 200, 0, Q_CONTENT_MAX, INS, 0); /* system prompt and <tools> schemas */
    put1(&s, Q_END, SCF);
    put1(&s, Q_NL, SCF);
    for (k = 1; k <= 4; k++) {
        qwen_head(&s, Q_USER);
        s.turn = k;
        put_random(&s, 30, 0, Q_CONTENT_MAX, USR, 0);
        if (k == 2) {
            put1(&s, Q_VISION, SCF);
            put_ids(&s, (const int32_t[]){Q_PAD, Q_PAD, Q_PAD, Q_PAD}, 4, USR | IMG, 0);
            put1(&s, Q_VISION_END, SCF);
        }
        put1(&s, Q_END, SCF);
        put1(&s, Q_NL, SCF);
        qwen_head(&s, Q_ASSISTANT);
        put1(&s, Q_THINK, SCF);
        put_random(&s, 50, 0, Q_CONTENT_MAX, RSN, 0);
        put1(&s, Q_THINK_END, SCF);
        put_random(&s, 3, 0, Q_CONTENT_MAX, AST, 0);
        put1(&s, Q_CALL, SCF);
        put_random(&s, 20, 0, Q_CONTENT_MAX, CALL, 0);
        put1(&s, Q_CALL_END, SCF);
        put1(&s, Q_END, SCF);
        put1(&s, Q_NL, SCF);
        qwen_head(&s, Q_USER); /* tool results: same turn */
        put1(&s, Q_RESP, SCF);
        put_random(&s, 25, 0, Q_CONTENT_MAX, OBS, 0);
        put1(&s, Q_RESP_END, SCF);
        put1(&s, Q_NL, OBS);
        put1(&s, Q_RESP, SCF);
        put_random(&s, 5, 0, Q_CONTENT_MAX, OBS, 0);
        put1(&s, Q_RESP_END, SCF);
        put1(&s, Q_END, SCF);
        put1(&s, Q_NL, SCF);
        qwen_head(&s, Q_ASSISTANT);
        put1(&s, Q_THINK, SCF);
        put1(&s, Q_THINK_END, SCF);
        put_random(&s, 40, 0, Q_CONTENT_MAX, AST, 0);
        put1(&s, Q_END, SCF);
        put1(&s, Q_NL, SCF);
    }
    check_stream(&spec, &s, "Qwen3 ChatML");
}

/* ---- gpt-oss harmony ids --------------------------------------------------------------------- */
static void harmony_head(stream *s, const int32_t *head, int32_t n) {
    put1(s, H_START, SCF);
    put_ids(s, head, n, SCF, 0);
    put1(s, H_MESSAGE, SCF);
}

#define N_IDS(ids) ((int32_t)(sizeof ids / sizeof ids[0]))

/* A harmony message: its header, n_content random content tokens of `role`, its end marker. */
static void harmony_message(stream *s, const int32_t *head, int32_t n_head, int32_t n_content,
                            int role, int32_t end) {
    harmony_head(s, head, n_head);
    put_random(s, n_content, 0, H_CONTENT_MAX, role, 0);
    put1(s, end, SCF);
}

static void test_harmony(void) {
    static stream s;
    kvmix_tag_spec spec;
    static const int32_t system[] = {H_SYSTEM}, developer[] = {H_DEVELOPER}, user[] = {H_USER},
                         analysis[] = {H_ASSISTANT, H_CHANNEL, H_ANALYSIS},
                         call[] = {H_ASSISTANT, H_TO,      H_EQ,  H_FUNCTIONS, H_GET, H_WEATHER,
                                   H_CHANNEL,   H_COMMENT, H_ARY, H_CONSTRAIN, H_JSON},
                         result[] = {H_FUNCTIONS, H_GET,     H_WEATHER, H_TO, H_EQ,
                                     H_ASSISTANT, H_CHANNEL, H_COMMENT, H_ARY},
                         final[] = {H_ASSISTANT, H_CHANNEL, H_FINAL};
    int k;
    spec_harmony(&spec);
    memset(&s, 0, sizeof s);
    test_rng_init(&s.rng, "tags harmony");
    harmony_message(&s, system, 1, 60, INS, H_END);
    harmony_message(&s, developer, 1, 120, INS, H_END); /* instructions and function schemas */
    for (k = 1; k <= 3; k++) {
        harmony_head(&s, user, 1);
        s.turn = k;
        put_random(&s, 20, 0, H_CONTENT_MAX, USR, 0);
        put1(&s, H_END, SCF);
        harmony_message(&s, analysis, 3, 40, RSN, H_END);
        harmony_message(&s, call, N_IDS(call), 15, CALL, H_CALL);
        harmony_message(&s, result, N_IDS(result), 15, OBS, H_END);
        harmony_message(&s, final, 3, 30, AST, H_RETURN);
    }
    check_stream(&spec, &s, "gpt-oss harmony");
}

/* ---- turn aging -------------------------------------------------------------------------------- */
static void test_buckets(void) {
    kvmix_tagger t;
    kvmix_tag_spec spec;
    kvmix_tag tags[8];
    int32_t head[3] = {Q_START, Q_USER, Q_NL}, word = 1000, turn;
    kvmix_tag first;
    test_context("buckets");
    CHECK_EQ_INT(kvmix_tag_bucket_of(5, 5), KVMIX_BUCKET_CURRENT);
    CHECK_EQ_INT(kvmix_tag_bucket_of(6, 5), KVMIX_BUCKET_CURRENT);
    CHECK_EQ_INT(kvmix_tag_bucket_of(4, 5), KVMIX_BUCKET_PREVIOUS);
    CHECK_EQ_INT(kvmix_tag_bucket_of(3, 5), KVMIX_BUCKET_TWO_BACK);
    CHECK_EQ_INT(kvmix_tag_bucket_of(2, 5), KVMIX_BUCKET_OLDER);
    CHECK_EQ_INT(kvmix_tag_bucket_of(-0x7fffffff - 1, 0x7fffffff), KVMIX_BUCKET_OLDER);
    CHECK_EQ_INT(kvmix_tag_bucket_of(0x7fffffff, -0x7fffffff - 1), KVMIX_BUCKET_CURRENT);
    spec_qwen3(&spec);
    CHECK_RESULT(kvmix_tagger_init(&t, &spec, NULL), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_tagger_feed(&t, head, 3, tags), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_tagger_feed(&t, &word, 1, &first), KVMIX_SUCCESS);
    CHECK_EQ_INT(first.turn, 1);
    CHECK_EQ_INT(t.turn, 1);
    /* a token of turn 1 ages as user turns arrive */
    for (turn = 2; turn <= 5; turn++) {
        CHECK_RESULT(kvmix_tagger_feed(&t, head, 3, tags), KVMIX_SUCCESS);
        CHECK_EQ_INT(tags[0].turn, turn - 1); /* header ids keep the old turn */
        CHECK_EQ_INT(t.turn, turn - 1);       /* the new turn starts at the first content id */
        CHECK_RESULT(kvmix_tagger_feed(&t, &word, 1, tags), KVMIX_SUCCESS);
        CHECK_EQ_INT(t.turn, turn);
        CHECK_EQ_INT(kvmix_tag_bucket_of(first.turn, t.turn), turn == 2   ? KVMIX_BUCKET_PREVIOUS
                                                              : turn == 3 ? KVMIX_BUCKET_TWO_BACK
                                                                          : KVMIX_BUCKET_OLDER);
    }
    test_context(NULL);
}

/* ---- broken streams ------------------------------------------------------------------------- */
static void test_broken(void) {
    static stream s;
    kvmix_tag_spec spec;
    int32_t i;
    spec_byte(&spec);
    memset(&s, 0, sizeof s);
    test_rng_init(&s.rng, "tags broken");
    put1f(&s, B_END, SCF, FB);          /* end outside a message */
    put1f(&s, B_THINK_END, SCF, FB);    /* close outside */
    put1f(&s, B_PAD, SCF | IMG, FB);    /* image pad outside */
    put_text(&s, "loose text", SCF, 0); /* outside a message: scaffold */
    byte_message_head(&s, "bogus");     /* unknown role: user, flagged */
    put_text(&s, "who am I", USR, FB);
    put1(&s, B_THINK, SCF); /* brackets still give their role */
    put_text(&s, "hmm", RSN, 0);
    put1f(&s, B_CALL, SCF, FB); /* an open while one is open replaces it */
    put_text(&s, "{}", CALL, 0);
    put1f(&s, B_THINK_END, SCF, FB); /* mismatched close: stray */
    put_text(&s, "x", CALL, 0);
    put1(&s, B_CALL_END, SCF);
    put_text(&s, "y", USR, FB);
    put1f(&s, B_VISION_END, SCF, FB); /* stray vision end */
    put1(&s, B_VISION, SCF);
    put1f(&s, B_VISION, SCF, FB); /* vision open twice */
    put_text(&s, "z", USR | IMG, FB);
    put1f(&s, B_END, SCF, FB); /* end with a vision span open */
    byte_message_head(&s, "assistant");
    put1(&s, B_THINK, SCF);
    put_text(&s, "never closed", RSN, 0);
    put1f(&s, B_START, SCF, FB); /* a message that never ended */
    put_text(&s, "system\n", SCF, 0);
    put_text(&s, "rules", INS, 0);
    put1f(&s, B_START, SCF, FB); /* never ended either; then a start inside ... */
    put_text(&s, "user", SCF, 0);
    s.turn = 0;
    put_ids(&s, (const int32_t[]){B_START}, 1, SCF, FB); /* ... a header: restarts it */
    put1(&s, 'u', SCF);
    put1f(&s, B_END, SCF, FB); /* end inside a header */
    /* a header that never ends: after KVMIX_TAG_MAX_HEADER ids the rest is content, flagged */
    put1(&s, B_START, SCF);
    put_text(&s, "user", SCF, 0);
    for (i = 4; i < KVMIX_TAG_MAX_HEADER; i++) put1(&s, 'a', SCF);
    s.turn = 1; /* a known user role word still starts a turn */
    put_text(&s, "bbb", USR, FB);
    put1(&s, B_END, SCF);
    put1(&s, '\n', SCF);
    /* ids beyond the vocabulary and negative ids are content */
    byte_message_head(&s, "assistant");
    put_ids(&s, (const int32_t[]){-1, -0x7fffffff - 1, 0x7fffffff, 4096 + B_END, 1 << 20}, 5, AST,
            0);
    put1(&s, B_END, SCF);
    check_stream(&spec, &s, "broken byte-level stream");
}

/* harmony: unknown channel, channel on a non-assistant message, tool result role */
static void test_harmony_channels(void) {
    static stream s;
    kvmix_tag_spec spec;
    static const int32_t odd[] = {H_ASSISTANT, H_CHANNEL, H_COMMENT}, /* "comment" alone */
        none[] = {H_ASSISTANT}, user_channel[] = {H_USER, H_CHANNEL, H_ANALYSIS},
                         unknown[] = {12345, H_CHANNEL, H_FINAL};
    spec_harmony(&spec);
    memset(&s, 0, sizeof s);
    test_rng_init(&s.rng, "tags harmony channels");
    harmony_head(&s, odd, 3);
    put_random(&s, 5, 0, H_CONTENT_MAX, AST, FB);
    put1(&s, H_END, SCF);
    harmony_message(&s, none, 1, 5, AST, H_END);
    harmony_head(&s, user_channel, 3);
    s.turn = 1;
    put_random(&s, 5, 0, H_CONTENT_MAX, USR, 0);
    put1(&s, H_END, SCF);
    harmony_head(&s, unknown, 3);
    put_random(&s, 5, 0, H_CONTENT_MAX, USR, FB);
    put1(&s, H_RETURN, SCF);
    check_stream(&spec, &s, "harmony channels");
}

/* harmony recipients: a message to a tool (" to=" after the role or after the channel name) is a
   tool call on any channel; without one, commentary is assistant text (a preamble), analysis
   reasoning, final assistant; a tool's result names its recipient too and stays observation. */
static void test_harmony_recipients(void) {
    static stream s;
    kvmix_tag_spec spec;
    static const int32_t user[] = {H_USER}, analysis[] = {H_ASSISTANT, H_CHANNEL, H_ANALYSIS};
    static const int32_t preamble[] = {H_ASSISTANT, H_CHANNEL, H_COMMENT, H_ARY};
    static const int32_t final[] = {H_ASSISTANT, H_CHANNEL, H_FINAL};
    /* <|channel|>commentary to=functions.get_weather <|constrain|>json */
    static const int32_t after_channel[] = {H_ASSISTANT, H_CHANNEL, H_COMMENT,   H_ARY,
                                            H_TO,        H_EQ,      H_FUNCTIONS, H_GET,
                                            H_WEATHER,   H_SPACE,   H_CONSTRAIN, H_JSON};
    /* assistant to=functions.get_weather<|channel|>commentary json */
    static const int32_t after_role[] = {H_ASSISTANT, H_TO,      H_EQ,      H_FUNCTIONS, H_GET,
                                         H_WEATHER,   H_CHANNEL, H_COMMENT, H_ARY,       H_JSON};
    /* a built-in tool on analysis: <|channel|>analysis to=browser.search code */
    static const int32_t builtin[] = {H_ASSISTANT, H_CHANNEL, H_ANALYSIS, H_TO,
                                      H_EQ,        H_BROWSER, H_SEARCH,   H_CODE};
    /* a tool's result: functions.get_weather to=assistant<|channel|>commentary */
    static const int32_t result[] = {H_FUNCTIONS, H_GET,     H_WEATHER, H_TO, H_EQ,
                                     H_ASSISTANT, H_CHANNEL, H_COMMENT, H_ARY};
    spec_harmony(&spec);
    memset(&s, 0, sizeof s);
    test_rng_init(&s.rng, "tags harmony recipients");
    harmony_head(&s, user, 1);
    s.turn = 1;
    put_random(&s, 10, 0, H_CONTENT_MAX, USR, 0);
    put1(&s, H_END, SCF);
    harmony_message(&s, analysis, 3, 10, RSN, H_END);
    harmony_message(&s, preamble, 4, 10, AST, H_END);
    harmony_message(&s, after_channel, N_IDS(after_channel), 10, CALL, H_CALL);
    harmony_message(&s, result, N_IDS(result), 10, OBS, H_END);
    harmony_message(&s, preamble, 4, 10, AST,
                    H_END); /* the recipient does not carry over to the next message */
    harmony_message(&s, after_role, N_IDS(after_role), 10, CALL, H_CALL);
    harmony_message(&s, builtin, N_IDS(builtin), 10, CALL, H_CALL);
    harmony_message(&s, analysis, 3, 10, RSN, H_END);
    harmony_message(&s, final, 3, 10, AST, H_RETURN);
    check_stream(&spec, &s, "harmony recipients");

    /* a spec without a recipient marker (version 1 gpt-oss.json: commentary is tool_call) tags
       by the channel alone, as before */
    memset(&spec.recipient, 0, sizeof spec.recipient);
    spec.channels[1].role = CALL;
    memset(&s, 0, sizeof s);
    test_rng_init(&s.rng, "tags harmony without recipients");
    harmony_message(&s, preamble, 4, 10, CALL, H_END);
    harmony_message(&s, after_role, N_IDS(after_role), 10, CALL, H_CALL);
    harmony_message(&s, builtin, N_IDS(builtin), 10, RSN, H_CALL);
    check_stream(&spec, &s, "harmony without recipients");
}

/* A spec whose markers are several ids long: the marker takes effect at its last id. */
static void test_multi_id_markers(void) {
    static stream s;
    kvmix_tag_spec spec;
    spec_byte(&spec);
    set_text(&spec.reasoning_open.alts[0], "<r>");
    set_text(&spec.reasoning_close.alts[0], "</r>");
    set_text(&spec.message_end.alts[1], "##");
    memset(&s, 0, sizeof s);
    byte_message_head(&s, "assistant");
    put_text(&s, "a<r", AST, 0);
    put1(&s, '>', SCF);
    put_text(&s, "b</r", RSN, 0);
    put1(&s, '>', SCF);
    put_text(&s, "c#", AST, 0);
    put1(&s, '#', SCF);
    put_text(&s, "d", SCF, 0);
    check_stream(&spec, &s, "multi-id markers");
}

/* ---- Llama 3.1: an open-ended tool call ------------------------------------------------------ */
enum {
    L_BEGIN = 900,    /* <|begin_of_text|>: no marker, outside any message */
    L_START = 901,    /* <|start_header_id|> */
    L_HEAD_END = 902, /* <|end_header_id|>, then "\n\n": the header end */
    L_NL2 = 903,
    L_EOT = 904,
    L_EOM = 905,      /* ends a message that called a tool */
    L_PYTHON = 906,   /* <|python_tag|>: opens a tool call that runs to the message end */
    L_CALL_END = 907, /* a close marker Llama lacks, for the contrast */
    L_SYSTEM = 10,
    L_USER = 11,
    L_ASSISTANT = 12,
    L_IPYTHON = 13,
    L_CONTENT_MAX = 899
};

static void spec_llama3(kvmix_tag_spec *s) {
    int32_t id, head_end[2] = {L_HEAD_END, L_NL2};
    memset(s, 0, sizeof *s);
    set1(&s->message_start, 0, L_START);
    set_seq(&s->header_end.alts[0], head_end, 2);
    set1(&s->message_end, 0, L_EOT);
    set1(&s->message_end, 1, L_EOM);
    set1(&s->tool_call_open, 0, L_PYTHON); /* no tool_call_close */
    id = L_SYSTEM, add_name(s->roles, &s->n_roles, "system", INS, &id, 1);
    id = L_USER, add_name(s->roles, &s->n_roles, "user", USR, &id, 1);
    id = L_ASSISTANT, add_name(s->roles, &s->n_roles, "assistant", AST, &id, 1);
    id = L_IPYTHON, add_name(s->roles, &s->n_roles, "ipython", OBS, &id, 1);
}

static void llama_head(stream *s, int32_t role) {
    put1(s, L_START, SCF);
    put1(s, role, SCF);
    put1(s, L_HEAD_END, SCF);
    put1(s, L_NL2, SCF);
}

/* An assistant message: text, then <|python_tag|> and a call that <|eom_id|> ends. */
static void llama_call(stream *s, int end_flags) {
    llama_head(s, L_ASSISTANT);
    put_random(s, 6, 0, L_CONTENT_MAX, AST, 0);
    put1(s, L_PYTHON, SCF);
    put_random(s, 12, 0, L_CONTENT_MAX, CALL, 0);
    put1(s, L_NL2, CALL); /* header_end's ids are content outside a header */
    put1f(s, L_EOM, SCF, end_flags);
}

/* The tool result and the answer after a call: tagged as if no bracket had been open. */
static void llama_after_call(stream *s) {
    llama_head(s, L_IPYTHON);
    put_random(s, 10, 0, L_CONTENT_MAX, OBS, 0);
    put1(s, L_EOT, SCF);
    llama_head(s, L_ASSISTANT);
    put_random(s, 8, 0, L_CONTENT_MAX, AST, 0);
    put1(s, L_EOT, SCF);
}

/* Feeds the whole stream once more and checks the breaks the tagger counted. */
static void check_breaks(const kvmix_tag_spec *spec, const stream *s, int64_t want) {
    static kvmix_tag got[MAX_STREAM];
    kvmix_tagger t;
    if (!CHECK_RESULT(kvmix_tagger_init(&t, spec, NULL), KVMIX_SUCCESS)) return;
    CHECK_RESULT(kvmix_tagger_feed(&t, s->ids, s->n, got), KVMIX_SUCCESS);
    CHECK_EQ_INT(t.n_breaks, want);
}

/* Llama 3.1's <|python_tag|> has no close: the tool call runs to <|eom_id|> (or <|eot_id|>),
   which ends it without a break. The same stream under a spec that does give the bracket a close
   marker is broken at the end: the fallback flag and a break. */
static void test_llama_open_bracket(void) {
    static stream s;
    kvmix_tag_spec spec;
    int pass;
    for (pass = 0; pass < 2; pass++) {
        const int closed = pass == 1, end_flags = closed ? FB : 0;
        spec_llama3(&spec);
        if (closed) set1(&spec.tool_call_close, 0, L_CALL_END);
        memset(&s, 0, sizeof s);
        test_rng_init(&s.rng, "tags llama");
        put1(&s, L_BEGIN, SCF);
        llama_head(&s, L_SYSTEM);
        put_random(&s, 20, 0, L_CONTENT_MAX, INS, 0);
        put1(&s, L_PYTHON, INS); /* the system prompt names the tag: content */
        put1(&s, L_EOT, SCF);
        llama_head(&s, L_USER);
        s.turn = 1;
        put_random(&s, 10, 0, L_CONTENT_MAX, USR, 0);
        put1(&s, L_EOT, SCF);
        llama_call(&s, end_flags);
        llama_after_call(&s);
        /* a call that <|eot_id|> ends, then the next turn */
        llama_head(&s, L_ASSISTANT);
        put1(&s, L_PYTHON, SCF);
        put_random(&s, 5, 0, L_CONTENT_MAX, CALL, 0);
        put1f(&s, L_EOT, SCF, end_flags);
        llama_head(&s, L_USER);
        s.turn = 2;
        put_random(&s, 4, 0, L_CONTENT_MAX, USR, 0);
        put1(&s, L_EOT, SCF);
        llama_call(&s, end_flags);
        llama_after_call(&s);
        check_stream(&spec, &s, closed ? "Llama 3.1, tool call with a close" : "Llama 3.1");
        test_context(closed ? "Llama 3.1 breaks, tool call with a close" : "Llama 3.1 breaks");
        check_breaks(&spec, &s, closed ? 3 : 0);
        test_context(NULL);
    }
}

/* ---- argument errors and spec checks ---------------------------------------------------------- */
static void test_errors(void) {
    /* the spec member each case below spoils, as kvmix_error names it */
    static const char *const fields[13] = {
        "message_start", "header_end",     "reasoning_open", "roles", "roles",
        "image_pad",     "reasoning_open", "channel",        "roles", "tool_call_open",
        "recipient",     "recipient",      "header_end"};
    kvmix_tag_spec spec, bad;
    kvmix_tagger t, before;
    kvmix_tag tag;
    kvmix_tag_role role;
    kvmix_error why = {NULL, NULL};
    int32_t id = 5;
    int i;
    test_context("errors");
    spec_byte(&spec);
    CHECK_RESULT(kvmix_tag_spec_check(NULL, &why), KVMIX_ERR_NULL_POINTER);
    CHECK(why.field != NULL && strcmp(why.field, "spec") == 0);
    CHECK_RESULT(kvmix_tag_spec_check(&spec, &why), KVMIX_SUCCESS);
    CHECK(strcmp(why.field, "") == 0 && strcmp(why.reason, "") == 0);
    CHECK_RESULT(kvmix_tagger_init(NULL, &spec, NULL), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_tagger_init(&t, NULL, NULL), KVMIX_ERR_NULL_POINTER);
    for (i = 0; i < 13; i++) {
        bad = spec;
        switch (i) {
        case 0: memset(&bad.message_start, 0, sizeof bad.message_start); break;
        case 1: memset(&bad.header_end, 0, sizeof bad.header_end); break;
        case 2: bad.message_end.alts[1] = bad.reasoning_open.alts[0]; break; /* duplicate */
        case 3: bad.roles[0].role = KVMIX_ROLE_SCAFFOLD; break;
        case 4: bad.n_roles = KVMIX_TAG_MAX_NAMES + 1; break;
        case 5: bad.image_pad.alts[0].n_ids = 2; break;
        case 6: bad.reasoning_open.alts[0].ids[0] = -3; break;
        case 7: bad.channel.alts[0] = bad.header_end.alts[0]; break;
        case 8: bad.roles[1].seq.n_ids = 0; break;
        case 10: bad.recipient.alts[2] = bad.header_end.alts[0]; break;
        case 11:
            set1(&bad.channel, 0, 300);
            set1(&bad.recipient, 1, 300);
            break;
        case 12: /* role starts, and a message start whose messages could not end a header */
            bad.n_role_starts = 1;
            bad.role_starts[0].seq.n_ids = 1;
            bad.role_starts[0].seq.ids[0] = 301;
            bad.role_starts[0].role = KVMIX_ROLE_USER;
            memset(&bad.header_end, 0, sizeof bad.header_end);
            break;
        default: bad.tool_call_open.alts[3].n_ids = KVMIX_TAG_MAX_IDS + 1; break;
        }
        why.field = why.reason = NULL;
        CHECK_RESULT(kvmix_tag_spec_check(&bad, &why), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK_MSG(why.field != NULL && strcmp(why.field, fields[i]) == 0,
                  "case %d: field %s, expected %s", i, why.field ? why.field : "(null)", fields[i]);
        CHECK(why.reason != NULL && why.reason[0] != '\0');
        test_poison(&t, sizeof t, 3);
        why.field = NULL;
        CHECK_RESULT(kvmix_tagger_init(&t, &bad, &why), KVMIX_ERR_INVALID_ARGUMENT);
        CHECK(why.field != NULL && strcmp(why.field, fields[i]) == 0);
        CHECK(test_is_poisoned(&t, sizeof t, 3));
    }
    CHECK_RESULT(kvmix_tagger_init(&t, &spec, &why), KVMIX_SUCCESS);
    CHECK(strcmp(why.field, "") == 0);
    before = t;
    CHECK_RESULT(kvmix_tagger_feed(NULL, &id, 1, &tag), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_tagger_feed(&t, NULL, 1, &tag), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_tagger_feed(&t, &id, 1, NULL), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_tagger_feed(&t, &id, -1, &tag), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(kvmix_tagger_feed(&t, NULL, 0, NULL), KVMIX_SUCCESS);
    CHECK(memcmp(&t, &before, sizeof t) == 0);
    CHECK_RESULT(kvmix_tagger_reset(NULL), KVMIX_ERR_NULL_POINTER);
    CHECK_RESULT(kvmix_tagger_feed(&t, &id, 1, &tag), KVMIX_SUCCESS);
    CHECK_RESULT(kvmix_tagger_reset(&t), KVMIX_SUCCESS);
    CHECK(memcmp(&t, &before, sizeof t) == 0);
    for (i = 0; i < KVMIX_TAG_N_ROLES; i++) {
        CHECK_RESULT(kvmix_tag_role_from_name(kvmix_tag_role_name((kvmix_tag_role)i), &role),
                     KVMIX_SUCCESS);
        CHECK_EQ_INT(role, i);
    }
    CHECK(strcmp(kvmix_tag_role_name(KVMIX_ROLE_TOOL_CALL), "tool_call") == 0);
    CHECK(strcmp(kvmix_tag_role_name((kvmix_tag_role)7), "unknown") == 0);
    CHECK(strcmp(kvmix_tag_modality_name(KVMIX_MODALITY_IMAGE), "image") == 0);
    CHECK(strcmp(kvmix_tag_bucket_name(KVMIX_BUCKET_TWO_BACK), "two_back") == 0);
    CHECK_RESULT(kvmix_tag_role_from_name("User", &role), KVMIX_ERR_NOT_FOUND);
    CHECK_RESULT(kvmix_tag_role_from_name(NULL, &role), KVMIX_ERR_NULL_POINTER);
    CHECK_EQ_INT(sizeof(kvmix_tag), 8);
    test_context(NULL);
}

void unit_tags(void) {
    test_byte_chatml();
    test_qwen3();
    test_harmony();
    test_harmony_channels();
    test_harmony_recipients();
    test_buckets();
    test_broken();
    test_multi_id_markers();
    test_llama_open_bracket();
    test_errors();
}
