/* Tests of the intent residual's weight documents (examples/intent_residual_json.c): a valid
 * document reads into the weights it spells (and rescores as kvmix_intent_residual_scores says:
 * the hand case of tests/unit_residual.c), the writer's text reads back to equal weights and the
 * same text, a file loads, and each bad document is refused with its result and a message
 * naming its field, the output untouched. Prints "N passed, N failed". */
#define _POSIX_C_SOURCE 200809L /* mkstemp, fdopen */
#include "intent_residual_json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { F = KVMIX_INTENT_RESIDUAL_N_FEATURES };

static int passed, failed;

static int check_at(int ok, int line, const char *what) {
    if (ok)
        passed++;
    else {
        failed++;
        printf("FAIL test_residual_json.c line %d: %s\n", line, what);
    }
    return ok;
}
#define CHECK(cond) check_at((cond) != 0, __LINE__, #cond)

/* A document's members as text, in FIELDS order; NULL leaves one out. */
enum { N_MEMBERS = 10 };
static const char *const NAMES[N_MEMBERS] = {
    "version", "description", "features", "hidden", "w1", "b1", "w2", "b2", "alpha", "alpha_max"};
static const char FEATURES[] =
    "[\"rule\", \"log_age\", \"log_turns_back\", \"role_instruction\", \"role_user\", "
    "\"role_assistant\", \"role_reasoning\", \"role_tool_call\", \"role_observation\", "
    "\"role_scaffold\", \"image\", \"key_norm\", \"readout\"]";
/* the hand case: x_0 = 2 f_0, x_1 = 0.5 f_1 + 2 f_2 */
static const char W1[] = "[[2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], "
                         "[0, 0.5, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]";

static void defaults(const char *members[N_MEMBERS]) {
    static const char *const values[N_MEMBERS] = {"1",      "\"hand case\"", FEATURES, "2",   W1,
                                                  "[0, 0]", "[1.5, -2]",     "0.25",   "0.5", "1"};
    for (int i = 0; i < N_MEMBERS; i++) members[i] = values[i];
}

/* The document of members, then `extra` (a member's text, or "") inside the object. */
static char *document(const char *const members[N_MEMBERS], const char *extra) {
    static char text[8192];
    size_t n = 0;
    n += (size_t)snprintf(text + n, sizeof text - n, "{");
    for (int i = 0; i < N_MEMBERS; i++)
        if (members[i] != NULL)
            n += (size_t)snprintf(text + n, sizeof text - n, "%s\"%s\": %s", n > 1 ? ", " : "",
                                  NAMES[i], members[i]);
    snprintf(text + n, sizeof text - n, "%s%s}", extra[0] && n > 1 ? ", " : "", extra);
    return text;
}

static void test_valid(void) {
    const char *m[N_MEMBERS];
    intent_residual_doc doc;
    char err[256] = "";
    float f[F], rule = 0.75f, out = 0.0f;
    defaults(m);
    const char *text = document(m, "");
    CHECK(intent_residual_parse(text, strlen(text), &doc, err, sizeof err) == KVMIX_SUCCESS);
    const kvmix_intent_residual *w = &doc.weights;
    CHECK(strcmp(doc.description, "hand case") == 0);
    CHECK(w->n_features == F && w->hidden == 2);
    CHECK(w->w1[0] == 2.0f && w->w1[F + 1] == 0.5f && w->w1[F + 2] == 2.0f && w->w1[1] == 0.0f);
    CHECK(w->b1[0] == 0.0f && w->b1[1] == 0.0f && w->w2[0] == 1.5f && w->w2[1] == -2.0f);
    CHECK(w->b2 == 0.25f && w->alpha == 0.5f && w->alpha_max == 1.0f);
    memset(f, 0, sizeof f);
    f[0] = 0.5f, f[1] = 2.0f, f[2] = -1.0f;
    CHECK(kvmix_intent_residual_scores(w, f, &rule, 1, &out, NULL) == KVMIX_SUCCESS);
    CHECK(fabs(out - 1.6646638134828642) <= 1e-6);
    intent_residual_free(&doc);
    CHECK(doc.params == NULL);
    /* no description; members in another order; spaces after the object */
    m[1] = NULL;
    char swapped[8192];
    snprintf(swapped, sizeof swapped, "%s\n \t", document(m, ""));
    CHECK(intent_residual_parse(swapped, strlen(swapped), &doc, err, sizeof err) == KVMIX_SUCCESS);
    CHECK(doc.description[0] == 0);
    intent_residual_free(&doc);
    const char reordered[] =
        "{\"alpha_max\": 0, \"alpha\": 2, \"b2\": -0, \"w2\": [0], \"b1\": [1e-3], "
        "\"w1\": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], \"hidden\": 1, \"features\": "
        "[\"rule\", \"log_age\", \"log_turns_back\", \"role_instruction\", \"role_user\", "
        "\"role_assistant\", \"role_reasoning\", \"role_tool_call\", \"role_observation\", "
        "\"role_scaffold\", \"image\", \"key_norm\", \"readout\"], \"version\": 1}";
    CHECK(intent_residual_parse(reordered, strlen(reordered), &doc, err, sizeof err) ==
          KVMIX_SUCCESS);
    CHECK(doc.weights.hidden == 1 && doc.weights.w1[12] == 13.0f && doc.weights.b1[0] == 1e-3f);
    CHECK(signbit(doc.weights.b2) && doc.weights.alpha_max == 0.0f);
    intent_residual_free(&doc);
}

/* Weights through the writer and back: equal bit for bit, the same text again. */
static void test_round_trip(void) {
    static float w1[7 * F], b1[7], w2[7];
    static const float odd[] = {
        0.1f, -0.0f, 3.4028234663852886e38f, -1.17549435e-38f, 1e-45f, 16777217.0f, 0.3333333f};
    kvmix_intent_residual w;
    intent_residual_doc a, b;
    char err[256] = "";
    for (int i = 0; i < 7 * F; i++) w1[i] = odd[(i + i / 7) % 7];
    for (int j = 0; j < 7; j++) b1[j] = odd[(j + 2) % 7], w2[j] = -odd[(j + 4) % 7];
    memset(&w, 0, sizeof w);
    w.n_features = F, w.hidden = 7, w.w1 = w1, w.b1 = b1, w.w2 = w2;
    w.b2 = -0.0f, w.alpha = 0.1f, w.alpha_max = 3.4028234663852886e38f;
    char *text = intent_residual_json(&w, "tab\there, \"quote\", back\\slash, \x01");
    CHECK(text != NULL);
    if (text == NULL) return;
    CHECK(intent_residual_parse(text, strlen(text), &a, err, sizeof err) == KVMIX_SUCCESS);
    CHECK(memcmp(a.weights.w1, w1, sizeof w1) == 0 && memcmp(a.weights.b1, b1, sizeof b1) == 0 &&
          memcmp(a.weights.w2, w2, sizeof w2) == 0);
    CHECK(signbit(a.weights.b2) && a.weights.alpha == 0.1f &&
          a.weights.alpha_max == 3.4028234663852886e38f);
    CHECK(strcmp(a.description, "tab\there, \"quote\", back\\slash, \x01") == 0);
    char *again = intent_residual_json(&a.weights, a.description);
    CHECK(again != NULL && strcmp(text, again) == 0);
    CHECK(again != NULL &&
          intent_residual_parse(again, strlen(again), &b, err, sizeof err) == KVMIX_SUCCESS &&
          intent_residual_equal(&a, &b));
    intent_residual_free(&b);
    free(again);
    /* the writer refuses what does not check */
    w.alpha_max = -1.0f;
    CHECK(intent_residual_json(&w, NULL) == NULL);
    w.alpha_max = 1.0f, w.hidden = 0;
    CHECK(intent_residual_json(&w, NULL) == NULL);
    CHECK(intent_residual_json(NULL, NULL) == NULL);
    char long_text[300];
    memset(long_text, 'x', sizeof long_text - 1);
    long_text[sizeof long_text - 1] = 0;
    CHECK(intent_residual_json(&a.weights, long_text) == NULL);
    /* a file */
    char path[] = "/tmp/kvmix-residual-XXXXXX";
    FILE *f = fdopen(mkstemp(path), "w");
    CHECK(f != NULL && fputs(text, f) >= 0);
    if (f != NULL) fclose(f);
    CHECK(intent_residual_load(path, &b, err, sizeof err) == KVMIX_SUCCESS &&
          intent_residual_equal(&a, &b));
    intent_residual_free(&b);
    remove(path);
    CHECK(intent_residual_load(path, &b, err, sizeof err) == KVMIX_ERR_NOT_FOUND);
    CHECK(strstr(err, "cannot open") != NULL);
    intent_residual_free(&a);
    free(text);
}

/* A bad document: its result, a message that names `field`, the output untouched. */
static void refused(int line, const char *text, kvmix_result want, const char *field) {
    intent_residual_doc out;
    char err[256] = "", what[400];
    memset(&out, 0x5a, sizeof out);
    kvmix_result r = intent_residual_parse(text, strlen(text), &out, err, sizeof err);
    const uint8_t *p = (const uint8_t *)&out;
    size_t i = 0;
    while (i < sizeof out && p[i] == 0x5a) i++;
    snprintf(what, sizeof what, "result %d (want %d), message \"%s\" (want \"%s\"), untouched %d",
             (int)r, (int)want, err, field, i == sizeof out);
    check_at(r == want && strstr(err, field) != NULL && i == sizeof out, line, what);
}

static void test_refused(void) {
    const char *m[N_MEMBERS];
    char desc[300];
#define REFUSE(index, value, want, field)                                                          \
    do {                                                                                           \
        defaults(m);                                                                               \
        m[index] = (value);                                                                        \
        refused(__LINE__, document(m, ""), want, field);                                           \
    } while (0)
    const kvmix_result bad = KVMIX_ERR_MALFORMED;
    refused(__LINE__, "", bad, "malformed JSON");
    refused(__LINE__, "{\"version\": 1", bad, "malformed JSON");
    refused(__LINE__, "[1, 2]", bad, "must be a JSON object");
    defaults(m);
    char trailing[8192];
    snprintf(trailing, sizeof trailing, "%s x", document(m, ""));
    refused(__LINE__, trailing, bad, "bytes after");
    defaults(m);
    refused(__LINE__, document(m, "\"gamma\": 1"), bad, "\"gamma\": unknown");
    refused(__LINE__, document(m, "\"b2\": 1"), bad, "\"b2\": given twice");
    for (int i = 0; i < N_MEMBERS; i++) {
        char name[64];
        if (i == 1) continue; /* description is optional */
        snprintf(name, sizeof name, "\"%s\": required", NAMES[i]);
        REFUSE(i, NULL, bad, name);
    }
    REFUSE(0, "2", KVMIX_ERR_VERSION, "version");
    REFUSE(0, "0", KVMIX_ERR_VERSION, "version");
    REFUSE(0, "\"1\"", bad, "version");
    REFUSE(0, "1e10", bad, "version");
    REFUSE(1, "7", bad, "description");
    memset(desc, 'd', sizeof desc);
    desc[0] = '"', desc[257] = '"', desc[258] = 0; /* 256 bytes */
    REFUSE(1, desc, bad, "description");
    REFUSE(2, "[\"rule\"]", bad, "features");
    REFUSE(2, "\"rule\"", bad, "features");
    REFUSE(2,
           "[\"rule\", \"log_turns_back\", \"log_age\", \"role_instruction\", \"role_user\", "
           "\"role_assistant\", \"role_reasoning\", \"role_tool_call\", \"role_observation\", "
           "\"role_scaffold\", \"image\", \"key_norm\", \"readout\"]",
           bad, "\"features[1]\": must be \"log_age\"");
    REFUSE(2,
           "[\"rule\", \"log_age\", \"log_turns_back\", \"role_instruction\", \"role_user\", "
           "\"role_assistant\", \"role_reasoning\", \"role_tool_call\", \"role_observation\", "
           "\"role_scaffold\", \"image\", \"key_norm\", 12]",
           bad, "features[12]");
    REFUSE(3, "0", bad, "hidden");
    REFUSE(3, "257", bad, "hidden");
    REFUSE(3, "1.5", bad, "hidden");
    REFUSE(3, "1", bad, "\"w1\": must be an array of hidden (1) rows");
    REFUSE(4, "[[2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]", bad, "w1");
    REFUSE(4, "[[2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0.5, 2]]", bad, "\"w1[1]\"");
    REFUSE(4,
           "[[2, 0, 0, \"3\", 0, 0, 0, 0, 0, 0, 0, 0, 0], "
           "[0, 0.5, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]",
           bad, "\"w1[0][3]\"");
    REFUSE(4, "{}", bad, "w1");
    REFUSE(5, "[0]", bad, "\"b1\": must be an array of 2 numbers");
    REFUSE(5, "[0, 0, 0]", bad, "b1");
    REFUSE(6, "[1e39, 0]", bad, "\"w2[0]\": must be a finite number within the float range");
    REFUSE(6, "[0, -3.4028236e38]", bad, "w2[1]");
    REFUSE(7, "1e400", bad, "\"b2\"");
    REFUSE(7, "[0.25]", bad, "b2");
    REFUSE(8, "null", bad, "\"alpha\"");
    REFUSE(8, "true", bad, "alpha");
    REFUSE(9, "-1", bad, "\"alpha_max\": must be at least 0");
    REFUSE(9, "\"1\"", bad, "alpha_max");
#undef REFUSE
    intent_residual_doc out;
    char err[64] = "";
    CHECK(intent_residual_parse(NULL, 0, &out, err, sizeof err) == KVMIX_ERR_NULL_POINTER);
    CHECK(intent_residual_parse("{}", 2, NULL, err, sizeof err) == KVMIX_ERR_NULL_POINTER);
    /* a document cut short at each byte never parses, and says so */
    defaults(m);
    const char *full = document(m, "");
    size_t n = strlen(full);
    for (size_t cut = 0; cut + 1 < n; cut++) {
        memset(&out, 0x5a, sizeof out);
        char e[256] = "";
        if (!CHECK(intent_residual_parse(full, cut, &out, e, sizeof e) == bad && e[0] != 0)) break;
    }
}

int main(void) {
    test_valid();
    test_round_trip();
    test_refused();
    printf("%d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
