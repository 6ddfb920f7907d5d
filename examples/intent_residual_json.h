/* intent_residual_json.h - the JSON form of the intent residual's weights (kvmix_intent_residual,
 * kvmix.h "Intent residual"), for a runner that rescores the INTENT rule with them. A training
 * script writes it (json.dump of Python floats: each float32 weight as the double it equals);
 * kvmix ships no trained weights.
 *
 * A document is one JSON object, version 1:
 *
 *   {"version": 1, "description": "what it was trained on",
 *    "features": ["rule", "log_age", "log_turns_back", "role_instruction", "role_user",
 *                 "role_assistant", "role_reasoning", "role_tool_call", "role_observation",
 *                 "role_scaffold", "image", "key_norm", "readout"],
 *    "hidden": H,
 *    "w1": [[w, ... F numbers], ... H rows], "b1": [H numbers],
 *    "w2": [H numbers], "b2": x, "alpha": a, "alpha_max": m}
 *
 * features: exactly kvmix_intent_residual_feature_name(0 .. F - 1), in order (a file trained on
 * another feature list is refused, not misread); hidden: 1 .. KVMIX_INTENT_RESIDUAL_MAX_HIDDEN;
 * w1 row j, entry k: hidden unit j's weight of feature k (PyTorch's nn.Linear(F, H).weight);
 * b1 its bias; w2 the output projection (nn.Linear(H, 1).weight[0]), b2 its bias; alpha the
 * learned scale, alpha_max >= 0 its inference clip. Every number finite and within the float
 * range; it is rounded to the nearest float. description is optional, 0-255 bytes. Every other
 * field is required; unknown or repeated fields, wrong types or sizes and bytes after the object
 * are refused with a message naming the field. Pure and thread-safe (cJSON without its global
 * hooks or error pointer); links with one kvmix implementation and tag_spec_json.c (its error
 * formatting and file reading).
 */
#ifndef KVMIX_INTENT_RESIDUAL_JSON_H
#define KVMIX_INTENT_RESIDUAL_JSON_H

#include <stddef.h>

#include "kvmix.h"

#define INTENT_RESIDUAL_VERSION 1

typedef struct intent_residual_doc {
    char description[256];
    kvmix_intent_residual weights; /* w1, b1, w2 point into params */
    float *params;                 /* malloc'd: w1 [hidden][F], then b1 [hidden], w2 [hidden] */
} intent_residual_doc;

/* Parses a document of json_bytes (need not be NUL-terminated) into *out (written only on
 * success; free it with intent_residual_free). Returns KVMIX_SUCCESS, KVMIX_ERR_NULL_POINTER,
 * KVMIX_ERR_MALFORMED (malformed JSON, a field of the wrong type, size or range, unknown or
 * repeated fields; the message names the field), KVMIX_ERR_VERSION or KVMIX_ERR_OUT_OF_MEMORY.
 * err (may be NULL) receives a NUL-terminated message on error. */
kvmix_result intent_residual_parse(const char *json, size_t json_bytes, intent_residual_doc *out,
                                   char *err, size_t err_bytes);

/* Reads and parses the file at path; KVMIX_ERR_NOT_FOUND when it cannot be read. */
kvmix_result intent_residual_load(const char *path, intent_residual_doc *out, char *err,
                                  size_t err_bytes);

/* Frees what a successful parse allocated (NULL or a zeroed doc: nothing) and zeroes the doc. */
void intent_residual_free(intent_residual_doc *doc);

/* The document of weights (checked by kvmix_intent_residual_check) and a description (NULL: ""),
 * one w1 row a line, every number the shortest text that reads back to the same float;
 * malloc'd, NUL-terminated. NULL when the weights do not check, the description is 256 bytes or
 * more, or out of memory. The text parses back to equal weights. */
char *intent_residual_json(const kvmix_intent_residual *weights, const char *description);

/* Nonzero when two docs hold the same description and weights, bit for bit. */
int intent_residual_equal(const intent_residual_doc *a, const intent_residual_doc *b);

#endif /* KVMIX_INTENT_RESIDUAL_JSON_H */
