/* tier_probe.h - the verdict of a model's INT4 tolerance probe (kvmix_tier_probe, kvmix.h
 * ">>tiers"), stored per model as a JSON document (version 1) that a transfer's sender reads
 * before it tiers a cache (kvmix_tier_desc.allow_int4):
 *
 *   {"version": 1, "kind": "kvmix-int4-probe", "model": "kvm-small", "budget": 0.3,
 *    "trials": 3, "pass": 2, "passed": 2, "allow_int4": true}
 *
 * budget: the b the trials ran at, (0, 1]; trials: how many ran, >= 1; pass: how many had to
 * pass, 1 .. trials; passed: how many did, 0 .. trials; allow_int4: passed >= pass. Every field
 * is required; unknown or repeated fields, wrong types, out-of-range or inconsistent values and
 * bytes after the object are refused with a message naming the field. Pure and thread-safe;
 * links with one kvmix implementation.
 */
#ifndef KVMIX_TIER_PROBE_H
#define KVMIX_TIER_PROBE_H
#include <stddef.h>
#include "kvmix.h"

#define TIER_PROBE_MODEL_BYTES 64

typedef struct tier_probe_record {
    char model[TIER_PROBE_MODEL_BYTES]; /* non-empty, NUL-terminated, no control characters */
    double budget;
    int32_t n_trials, n_pass, n_passed;
    int32_t allow_int4;
} tier_probe_record;

/* The record of a probe that ran (kvmix_tier_probe's arguments and results). Returns
 * KVMIX_SUCCESS, NULL_POINTER or INVALID_ARGUMENT (a value the document could not hold; the
 * record is written only on success). */
kvmix_result tier_probe_record_make(const char *model, double budget, int32_t n_trials,
                                    int32_t n_pass, int32_t n_passed, tier_probe_record *out);

/* The record as a document, compact and NUL-terminated; malloc'd, free() it. NULL when out of
 * memory or the record does not check. */
char *tier_probe_json(const tier_probe_record *record);

/* Parses a document of json_bytes (need not be NUL-terminated) into *out (written only on
 * success). Returns KVMIX_SUCCESS, NULL_POINTER, MALFORMED (the message says which field and
 * why) or VERSION. err (may be NULL) receives a message on error. */
kvmix_result tier_probe_parse(const char *json, size_t json_bytes, tier_probe_record *out,
                              char *err, size_t err_bytes);

#endif /* KVMIX_TIER_PROBE_H */
