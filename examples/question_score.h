/* Answers scored by question distance: long-session traces (bench/refmodel/longtrace.py) record,
 * per user question, the token span of its expected answer and how many turns back the fact it
 * asks about was introduced. kvmix-eval reads them from a data line's "questions" array and
 * reports, per distance, how many answer tokens and whole answers the policy got right (top-1 ==
 * the true token) and how many agree with the fp32 reference (top-1 == the reference's top-1).
 * A question whose answer runs past the model's context is not counted. */
#ifndef QUESTION_SCORE_H
#define QUESTION_SCORE_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One question: its answer's tokens [token_start, token_end) of the text as tokenized (the
   runner's ids put <|endoftext|> first, so they are ids[token_start + 1 ..]). */
typedef struct question {
    int32_t token_start, token_end, distance;
} question;

typedef struct question_list {
    question *items;
    int32_t n;
} question_list;

/* Reads root's optional "questions" array (objects with integer token_start < token_end and
   distance >= 1) into *out (empty when absent). False, with *out empty and why in err, when the
   array is malformed. */
bool questions_from_json(const cJSON *root, question_list *out, char *err, size_t err_bytes);
void questions_free(question_list *q);

enum { QUESTION_MAX_DISTANCES = 64 };

/* Counts at one distance. */
typedef struct distance_score {
    int32_t distance;
    int64_t n_questions, n_exact, n_exact_agree; /* whole answers right / as the reference */
    int64_t n_tokens, n_correct, n_agree;        /* answer tokens */
} distance_score;

/* Every distance seen, in order of first appearance; distances past QUESTION_MAX_DISTANCES
   distinct ones are counted in `overflow`. */
typedef struct distance_scores {
    distance_score bins[QUESTION_MAX_DISTANCES];
    int32_t n;
    int64_t overflow;
} distance_scores;

/* Adds one text's questions: ids [n] (ids[0] = <|endoftext|>), tops [n - 1] the policy's top-1
   at each position, ref [n - 1] the reference's. */
void distance_scores_add(distance_scores *s, const question_list *q, const int32_t *ids,
                         const int32_t *tops, const int32_t *ref, int64_t n);

/* Adds "by_distance": [{distance, n_questions, question_accuracy, question_agreement,
   n_answer_tokens, answer_accuracy, answer_agreement}, ...] in increasing distance, when any
   question was counted. */
void distance_scores_to_json(const distance_scores *s, cJSON *obj);

#endif
