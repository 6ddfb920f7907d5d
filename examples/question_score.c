/* Answers scored by question distance (question_score.h). */
#include "question_score.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* An integer field of a question object, or false when missing or not an int32. */
static bool int_field(const cJSON *o, const char *name, int32_t *out) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!cJSON_IsNumber(x) || x->valuedouble != floor(x->valuedouble) ||
        x->valuedouble < INT32_MIN || x->valuedouble > INT32_MAX)
        return false;
    *out = (int32_t)x->valuedouble;
    return true;
}

bool questions_from_json(const cJSON *root, question_list *out, char *err, size_t err_bytes) {
    const cJSON *array = cJSON_GetObjectItemCaseSensitive(root, "questions");
    *out = (question_list){NULL, 0};
    if (array == NULL) return true;
    if (!cJSON_IsArray(array)) {
        snprintf(err, err_bytes, "\"questions\" must be an array");
        return false;
    }
    int n = cJSON_GetArraySize(array);
    out->items = malloc((size_t)(n > 0 ? n : 1) * sizeof *out->items);
    if (out->items == NULL) {
        snprintf(err, err_bytes, "cannot allocate %d questions", n);
        return false;
    }
    const cJSON *o;
    cJSON_ArrayForEach(o, array) {
        question q;
        if (!int_field(o, "token_start", &q.token_start) ||
            !int_field(o, "token_end", &q.token_end) || !int_field(o, "distance", &q.distance) ||
            q.token_start < 0 || q.token_end <= q.token_start || q.distance < 1) {
            snprintf(err, err_bytes,
                     "questions[%d] needs integers 0 <= token_start < token_end and distance >= 1",
                     out->n);
            questions_free(out);
            return false;
        }
        out->items[out->n++] = q;
    }
    return true;
}

void questions_free(question_list *q) {
    free(q->items);
    *q = (question_list){NULL, 0};
}

static distance_score *bin_of(distance_scores *s, int32_t distance) {
    for (int32_t i = 0; i < s->n; i++)
        if (s->bins[i].distance == distance) return &s->bins[i];
    if (s->n == QUESTION_MAX_DISTANCES) return NULL;
    s->bins[s->n] = (distance_score){.distance = distance};
    return &s->bins[s->n++];
}

void distance_scores_add(distance_scores *s, const question_list *q, const int32_t *ids,
                         const int32_t *tops, const int32_t *ref, int64_t n) {
    for (int32_t i = 0; i < q->n; i++) {
        const question *x = &q->items[i];
        if ((int64_t)x->token_end >= n) continue; /* past the context: never scored */
        distance_score *b = bin_of(s, x->distance);
        if (b == NULL) {
            s->overflow++;
            continue;
        }
        bool exact = true, exact_agree = true;
        /* position p predicts ids[p + 1]: the answer's ids are [token_start + 1, token_end] */
        for (int64_t p = x->token_start; p < x->token_end; p++) {
            bool correct = tops[p] == ids[p + 1], agree = tops[p] == ref[p];
            b->n_tokens++;
            b->n_correct += correct;
            b->n_agree += agree;
            exact = exact && correct;
            exact_agree = exact_agree && agree;
        }
        b->n_questions++;
        b->n_exact += exact;
        b->n_exact_agree += exact_agree;
    }
}

static int by_distance(const void *a, const void *b) {
    int32_t x = ((const distance_score *)a)->distance, y = ((const distance_score *)b)->distance;
    return (x > y) - (x < y);
}

void distance_scores_to_json(const distance_scores *s, cJSON *obj) {
    if (s->n == 0) return;
    distance_score sorted[QUESTION_MAX_DISTANCES];
    for (int32_t i = 0; i < s->n; i++) sorted[i] = s->bins[i];
    qsort(sorted, (size_t)s->n, sizeof sorted[0], by_distance);
    cJSON *array = cJSON_AddArrayToObject(obj, "by_distance");
    for (int32_t i = 0; i < s->n; i++) {
        const distance_score *b = &sorted[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "distance", b->distance);
        cJSON_AddNumberToObject(o, "n_questions", (double)b->n_questions);
        cJSON_AddNumberToObject(o, "question_accuracy",
                                (double)b->n_exact / (double)b->n_questions);
        cJSON_AddNumberToObject(o, "question_agreement",
                                (double)b->n_exact_agree / (double)b->n_questions);
        cJSON_AddNumberToObject(o, "n_answer_tokens", (double)b->n_tokens);
        cJSON_AddNumberToObject(o, "answer_accuracy", (double)b->n_correct / (double)b->n_tokens);
        cJSON_AddNumberToObject(o, "answer_agreement", (double)b->n_agree / (double)b->n_tokens);
        cJSON_AddItemToArray(array, o);
    }
}
